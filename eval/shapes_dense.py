"""Deprecated path: moved to :mod:`vtprune.shapes.dense` (kept for one release; see CHANGELOG.md)."""

import sys
import warnings

from vtprune.shapes import dense

warnings.warn("vtprune.eval.shapes_dense moved to vtprune.shapes.dense; import it from there (the old path will be "
              "removed in the next release).", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = dense  # the same module object: attributes, monkeypatching and pickles agree
