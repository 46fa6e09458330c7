"""Reproducing the papers' tables with lmms-eval: ``vtprune bench reproduce`` (:mod:`.reproduce`), the papers'
numbers (``papers.csv``, read by :mod:`.data`) and the comparison table (:mod:`.table`)."""
