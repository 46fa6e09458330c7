"""Deprecated path: moved to :mod:`vtprune.shapes.video` (kept for one release; see CHANGELOG.md)."""

import sys
import warnings

from vtprune.shapes import video

warnings.warn("vtprune.eval.shapes_video moved to vtprune.shapes.video; import it from there (the old path will be "
              "removed in the next release).", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = video  # the same module object: attributes, monkeypatching and pickles agree
