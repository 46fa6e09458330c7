"""The model side of the Gradio demo (:mod:`.app`) and its upload checks (:mod:`.uploads`); the UI is
``demos/app.py``. An application layer: nothing in vtprune's core imports it."""
