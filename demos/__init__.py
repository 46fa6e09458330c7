"""The vtprune Gradio demo: ``app`` (UI, ``python demos/app.py``) and ``overlay`` (pure picture functions)."""
