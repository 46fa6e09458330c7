"""Importance criteria beyond the baselines; importing this package registers their methods.

* :mod:`.debias` - attention debiasing (arXiv:2508.17807), a post-processor of attention scores;
* :mod:`.transprune` - ``transprune`` and ``ttv`` (arXiv:2507.20630);
* :mod:`.vflowopt` - ``vflowopt`` (arXiv:2508.05211).
"""

from vtprune.criteria import debias, transprune, vflowopt

__all__ = ["debias", "transprune", "vflowopt"]
