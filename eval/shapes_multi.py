"""Deprecated path: moved to :mod:`vtprune.shapes.multi` (kept for one release; see CHANGELOG.md)."""

import sys
import warnings

from vtprune.shapes import multi

warnings.warn("vtprune.eval.shapes_multi moved to vtprune.shapes.multi; import it from there (the old path will be "
              "removed in the next release).", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = multi  # the same module object: attributes, monkeypatching and pickles agree
