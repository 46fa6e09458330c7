"""What differs between the tested vLLM minors (:data:`vtprune.vllm.settings.TESTED_VLLM`), one function each.

The plugin's seams into vLLM's private API sit in one module each (docs/serving.md lists them); where a tested
minor spells a seam differently, the seam's module calls the function here instead of vLLM, and the function picks
the spelling the installed vLLM has, by feature (what the object offers), not by version number. Each entry names
the minors it covers and what the others do instead. No vLLM import at module level.

* :func:`build_metadata`: vLLM 0.32 and 0.33 build a KV cache group's attention metadata with
  ``AttentionGroup.build_metadata(common)``, which maps the block table to kernel blocks where a backend needs
  smaller blocks; vLLM 0.31 has no such method: the runner calls ``get_metadata_builder().build(...)`` itself, and its
  ``BlockTable`` already holds kernel block ids (``input_batch.block_table[g].block_size`` is the kernel block size
  there), so the same ``CommonAttentionMetadata`` goes to the builder unchanged.
"""

from __future__ import annotations

from typing import Any


def build_metadata(attention_group: Any, common: Any) -> Any:
    """The backend's attention metadata of ``common`` (a ``CommonAttentionMetadata``: query starts ``[num_reqs + 1]``,
    sequence lengths ``[num_reqs]``, block table ``[num_reqs, max_blocks]``, slot mapping ``[num_tokens]``) for
    ``attention_group`` (the runner's ``AttentionGroup`` of one KV cache group), no cascade prefix."""
    build = getattr(attention_group, "build_metadata", None)
    if build is not None:  # vLLM 0.32, 0.33
        return build(common)
    return attention_group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=common)  # 0.31
