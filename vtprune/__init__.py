"""vtprune: layer-wise visual-token pruning for Hugging Face vision-language models.

``import vtprune`` changes nothing global; every hook belongs to one wrapped model instance.

>>> handle = vtprune.wrap(model, method="fastv", keep=0.25)   # doctest: +SKIP
>>> model.generate(**inputs)                                   # doctest: +SKIP
>>> handle.remove()                                            # doctest: +SKIP
"""

from vtprune.api import apply, wrap
from vtprune.config import PruneConfig, Stage, keep_count
from vtprune.engine import PruneHandle
from vtprune.methods import Capture, Scorer, list_methods, register_method, resolve
from vtprune.scoring import ScoreContext
from vtprune.state import CallStats, StageRecord

__version__ = "0.1.0"

__all__ = [
    "CallStats", "Capture", "PruneConfig", "PruneHandle", "ScoreContext", "Scorer", "Stage", "StageRecord", "apply",
    "keep_count",
    "list_methods", "register_method", "resolve", "wrap", "__version__",
]
