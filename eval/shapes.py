"""Deprecated path: moved to :mod:`vtprune.shapes.task` (kept for one release; see CHANGELOG.md)."""

import sys
import warnings

from vtprune.shapes import task

warnings.warn("vtprune.eval.shapes moved to vtprune.shapes.task; import it from there (the old path will be "
              "removed in the next release).", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = task  # the same module object: attributes, monkeypatching and pickles agree
