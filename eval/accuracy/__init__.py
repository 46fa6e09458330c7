"""Accuracy on the vtprune-shapes task: ``vtprune bench`` (images, ``video``), ``long`` (all frames of a clip,
2-8 images per prompt), ``followup`` (a second question on a pruned cache), ``tower-queries`` (VisionZip's
query sampling on large towers), and their reports."""
