"""Layer-wise methods (FastV, PyramidDrop, TransPrune, TTV, DART, ``+debias``) inside vLLM's language model.

One module per concern, each over one seam of vLLM's private API (checked on the tested vLLM minors,
:data:`vtprune.vllm.settings.TESTED_VLLM`; docs/serving.md lists the seams):

* :mod:`~vtprune.vllm.layerwise.plan` (pure): the stages and each request's pruned count per layer region.
* :mod:`~vtprune.vllm.layerwise.requests` (pure): a request's visual tokens and keep from its multimodal features.
* :mod:`~vtprune.vllm.layerwise.layout` (pure): each request's rows, sequence length and KV positions per region.
* :mod:`~vtprune.vllm.layerwise.config`: start-up checks and settings (vLLM's per-architecture config hook).
* :mod:`~vtprune.vllm.layerwise.kv`: the pruned regions' and PrefixKV's layers' KV specs and managers (vLLM's KV
  spec registry).
* :mod:`~vtprune.vllm.layerwise.scheduler`: the pruned counts at a request's arrival (vLLM's ``scheduler_cls``).
* :mod:`~vtprune.vllm.layerwise.metadata`: the regions' attention metadata in a compacting step (the backends' builders).
* :mod:`~vtprune.vllm.layerwise.decode`: decode steps without hooks (each pruned group's builder shifts them).
* :mod:`~vtprune.vllm.layerwise.ops`: PrefixKV's hooks as registered ops (kept by a compiled graph).
* :mod:`~vtprune.vllm.layerwise.scoring`: vtprune's scorers on vLLM's layers (queries, keys, score contexts).
* :mod:`~vtprune.vllm.layerwise.records` / :mod:`~vtprune.vllm.layerwise.runtime`: the per-request state and the
  hooks on the decoder layers that score, select and compact.

Nothing here changes vLLM's files or classes: hooks and attributes are per model instance.
"""
