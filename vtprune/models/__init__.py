"""Models to run vtprune on: the embedded models shipped in this folder (:mod:`.embedded`), tiny random models
of every family built from configs (:mod:`.tiny`), loading any of them or a hub checkpoint (:mod:`.loading`),
and answering questions with a (wrapped) model (:mod:`.pipeline`). An application layer: nothing in vtprune's
core imports it. The weights live in sub-folders (``vtprune-llava-shapes/`` ...)."""
