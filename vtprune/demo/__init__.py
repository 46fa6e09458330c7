"""The model side of the Gradio demo (:mod:`.app`), its upload checks (:mod:`.uploads`) and ``vtprune demo``
(:mod:`.cli`, which finds and launches the UI); the UI is the checkout's ``demos/`` (``demos/app.py``, pictures
in ``demos/overlay.py``). An application layer: nothing in vtprune's core imports it."""
