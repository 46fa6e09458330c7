"""vtprune's own scores, read from vLLM's language-model layers: one request at a time, batch 1.

:class:`VllmLayers` is what vtprune's scorers see of the model (the part of :class:`vtprune.adapters.Adapter` they
use): ``project_qk`` recomputes a decoder layer's post-RoPE queries and keys from its own ``qkv_proj``, (QK norms) and
rotary embedding, as the transformers adapter does from ``q_proj`` / ``k_proj`` (under tensor parallelism the heads
of all ranks are gathered, so every rank scores with every head and keeps the same tokens); ``decoder_layers`` and
``language_model.norm`` are vLLM's modules. :func:`score_context` builds the request's
:class:`vtprune.scoring.ScoreContext` and :func:`select` keeps the top tokens with vtprune's
:func:`vtprune.prefill.select_with_query` (:func:`vtprune.layout.select_kept`, the prompt's last token always kept):
the scorer, the counts and the selection are the transformers path's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from vtprune.adapters.base import VisualSegment
from vtprune.config import Stage, keep_count
from vtprune.prefill import select_with_query
from vtprune.scoring import ScoreContext


def _gather_heads(tensor: torch.Tensor) -> torch.Tensor:
    """``[rows, local heads * d]`` of every tensor-parallel rank, heads in rank order (unchanged without TP)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    if get_tensor_model_parallel_world_size() <= 1:
        return tensor
    return tensor_model_parallel_all_gather(tensor.contiguous(), dim=-1)


class VllmLayers:
    """vLLM's language model seen through the :class:`vtprune.adapters.Adapter` calls scorers make.

    ``model``: the language model's inner module (``layers``, ``norm``), e.g. ``LlamaModel`` / ``Qwen2Model``;
    ``config``: the HF config (``model_type`` names the family in messages).
    """

    def __init__(self, model: Any, config: Any) -> None:
        self.model = model
        self.config = config
        norm = model.norm
        # ``.forward``: the final norm's hook (which restores the step's layout) must not see scoring calls
        self.language_model = SimpleNamespace(norm=lambda x: norm.forward(x.reshape(-1, x.shape[-1])).reshape(x.shape))

    @property
    def decoder_layers(self) -> Any:
        return self.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def padding_fraction(self, input_ids: torch.Tensor, inputs: dict) -> None:
        """No padding mask (debiasing's ``m_i = 1``): vLLM's processors resize (LLaVA-1.5 centre-crops)."""
        return None

    def project_qk(self, layer: Any, hidden: torch.Tensor, positions: torch.Tensor, query_index: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[1, H, Q, d]`` at ``query_index`` ``[1, Q]`` and ``k`` ``[1, H_kv, L, d]`` of vLLM decoder ``layer``
        for its input ``hidden`` ``[1, L, D]`` at ``positions`` (``[L]``, or ``[3, L]`` M-RoPE), after RoPE."""
        attention = layer.self_attn
        normed = layer.input_layernorm.forward(hidden[0])  # .forward: no capture hook sees it
        qkv, _ = attention.qkv_proj(normed)
        query, key, _ = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        size = attention.head_dim
        if hasattr(attention, "q_norm"):
            query = attention.q_norm.forward(query.reshape(-1, size)).reshape(query.shape)
            key = attention.k_norm.forward(key.reshape(-1, size)).reshape(key.shape)
        query, key = attention.rotary_emb(positions, query.contiguous(), key.contiguous())
        query, key = _gather_heads(query), _gather_heads(key)
        length = hidden.shape[1]
        query = query.reshape(length, -1, size)[query_index[0].to(query.device)]  # [Q, H, d]
        key = key.reshape(length, -1, size)
        return query.transpose(0, 1)[None], key.transpose(0, 1)[None]


@dataclass
class RequestView:
    """The rows of one request's prompt in the current layer region: ``index`` ``[m]`` (each row's prompt position),
    ``visual`` ``[m]`` (an alive visual token) and ``ordinal`` ``[m]`` (its index among the prompt's visual tokens, -1
    for text)."""

    index: torch.Tensor
    visual: torch.Tensor
    ordinal: torch.Tensor

    @classmethod
    def whole_prompt(cls, prompt: int, visual_positions: torch.Tensor) -> RequestView:
        visual = torch.zeros(prompt, dtype=torch.bool)
        visual[visual_positions] = True
        ordinal = torch.full((prompt,), -1, dtype=torch.long)
        ordinal[visual_positions] = torch.arange(visual_positions.numel())
        return cls(torch.arange(prompt), visual, ordinal)

    def take(self, rows: torch.Tensor) -> RequestView:
        return RequestView(self.index[rows], self.visual[rows], self.ordinal[rows])


def score_context(layers: VllmLayers, view: RequestView, hidden: torch.Tensor, positions: torch.Tensor, layer: int,
                  stage: Stage, stage_index: int, kept: int, num_visual: int, state: dict, input_ids: torch.Tensor
                  ) -> ScoreContext:
    """The :class:`ScoreContext` of one request's prompt rows: ``hidden`` ``[m, D]`` (the layer's input, the full
    residual stream), ``positions`` ``[m]`` / ``[3, m]``, the stage and its kept count (``kept``)."""
    device = hidden.device
    return ScoreContext(
        hidden=hidden[None], layer_index=layer, layer=layers.decoder_layers[layer], position_embeddings=positions,
        valid=torch.ones(1, view.index.numel(), dtype=torch.bool, device=device),
        visual=view.visual[None].to(device), ordinal=view.ordinal[None].to(device),
        num_visual=torch.tensor([num_visual], device=device), segments=[[VisualSegment(0, 1, 1, num_visual)]],
        adapter=layers, inputs={"input_ids": input_ids[None]}, state=state, visual_counts=[num_visual],
        stage=stage, stage_index=stage_index, count_rule=keep_count, planned=[kept])


def select(scores: torch.Tensor, view: RequestView, kept: int) -> torch.Tensor:
    """Row indices ``[m']`` the stage keeps (every text row, the top ``kept`` alive visual rows; in order). The
    prompt's last row, its query token, is always kept (inside ``kept``; :func:`vtprune.prefill.select_with_query`,
    the transformers engine's own rule): a prompt that ends on an image keeps the row its next token is read from."""
    alive = int(view.visual.sum())
    count = min(kept, alive)
    valid = torch.ones(1, view.index.numel(), dtype=torch.bool)
    mask = select_with_query(scores.float().cpu(), view.visual[None], valid, torch.tensor([count]), width=alive,
                             k_max=count)
    return mask[0].nonzero().flatten()


def merge_states(states: list[Any]) -> Any:
    """One state from the per-chunk states of a chunked prefill: dicts merged by key, lists and tuples item by item,
    tensors concatenated along dimension 1 (the token dimension of vtprune's ``[B, L, ...]`` captures)."""
    first = states[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(key for state in states for key in state))
        return {key: merge_states([state[key] for state in states if key in state]) for key in keys}
    if isinstance(first, (list, tuple)):
        if any(len(state) != len(first) for state in states):
            raise RuntimeError("vtprune: a method's captures differ between the chunks of one prompt.")
        merged = [merge_states(list(items)) for items in zip(*states, strict=True)]
        return type(first)(merged) if isinstance(first, tuple) else merged
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=1) if first.dim() >= 2 else states[-1]
    return states[-1]
