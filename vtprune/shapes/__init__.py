"""The vtprune-shapes synthetic task, beside the embedded models trained on it (``vtprune.models``).

:mod:`.task` (112 px images, questions with evidence boxes, seeded splits), :mod:`.dense` (224 px, 64-token
version), :mod:`.video` (clips with the answer in a few frames), :mod:`.multi` (multi-image prompts).
Described in docs/shapes_task.md. Moved from ``vtprune.eval.shapes*`` (the old paths still import, with a
``DeprecationWarning``, for one release: see CHANGELOG.md).
"""
