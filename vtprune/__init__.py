"""vtprune: layer-wise visual-token pruning for Hugging Face vision-language models.

``import vtprune`` changes nothing global; every hook belongs to one wrapped model instance.

>>> handle = vtprune.wrap(model, method="fastv", keep=0.25)   # doctest: +SKIP
>>> model.generate(**inputs)                                   # doctest: +SKIP
>>> handle.remove()                                            # doctest: +SKIP
"""

from vtprune.api import apply, wrap
from vtprune.config import PruneConfig, Stage, keep_count
from vtprune.engine import PruneHandle
from vtprune.methods import list_methods, register_method
from vtprune.state import CallStats

__version__ = "0.1.0"

__all__ = [
    "CallStats", "PruneConfig", "PruneHandle", "Stage", "apply", "keep_count", "list_methods",
    "register_method", "wrap", "__version__",
]
