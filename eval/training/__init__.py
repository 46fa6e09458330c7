"""Training the embedded tiny VLMs (``vtprune.models``) on the vtprune-shapes task: ``vtprune bench train``
(:mod:`.train`), their tokenizers, processors and configs (:mod:`.models`, :mod:`.qwen`, :mod:`.dense`) and
their evaluation (:mod:`.evaluate`)."""
