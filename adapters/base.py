"""The uniform view of a vision-language model that the engine and the criteria use.

An adapter absorbs the differences between model families: where the language model, its decoder
layers and the vision tower live, which token ids mark visual tokens, the patch grid of each image,
and how to recompute a layer's queries and keys (with the model's own rotary embedding, M-RoPE
included) so attention rows can be scored without eager attention.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class VisualSegment:
    """One image or video inside a sample's visual tokens, in visual-token (grid) order.

    ``start`` is the ordinal of its first visual token within the sample, ``t, h, w`` its token grid
    (``h * w`` tokens per frame, ``t`` frames) and ``extra`` the tokens it holds beyond the grid
    (for example LLaVA-NeXT's image-newline tokens), so it spans ``t * h * w + extra`` tokens.
    """

    start: int
    t: int
    h: int
    w: int
    kind: str = "image"
    extra: int = 0

    @property
    def length(self) -> int:
        return self.t * self.h * self.w + self.extra


class Adapter:
    """Base adapter: everything shared by the LLaVA and Qwen-VL families.

    Subclasses set ``model_types`` and override what differs (module paths, token ids, grids, limits).
    """

    model_types: tuple[str, ...] = ()
    #: What scorers may require (``Scorer.requires``): LM attention rows recomputed from q/k, what decoder
    #: layers compute, 1-D RoPE positions that can be renumbered; subclasses add e.g. ``"clip_tower"``.
    capabilities: frozenset[str] = frozenset({"attention", "llm_layers", "compact_positions"})
    #: ``"llava"`` or ``"qwen"``: which prompt format, processor family and lmms-eval model serve the model.
    family: str = ""
    #: The transformers processor class, rebuilt from its parts when ``AutoProcessor`` needs torchvision.
    processor_class: str | None = None
    #: Images are split into tiles plus a base view (LLaVA-NeXT / OneVision), not one crop per image.
    tiled_images: bool = False
    #: The forward has no argument carrying original image sizes; padding maps need them from the user.
    image_sizes_from_user: bool = False
    #: Attributes of the backbone that a prefill sets and a continued cache reads (Qwen-VL's M-RoPE
    #: ``rope_deltas``): one per model instance in transformers, one per conversation in a wrapped model.
    conversation_attributes: tuple[str, ...] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.text_config = getattr(model.config, "text_config", model.config)

    # -- modules -----------------------------------------------------------------------------------
    @property
    def backbone(self) -> nn.Module:
        """The ``*Model`` inside ``*ForConditionalGeneration`` (holds vision tower and language model)."""
        return self.model.model if hasattr(self.model, "model") else self.model

    @property
    def language_model(self) -> nn.Module:
        return self.backbone.language_model

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def vision_tower(self) -> nn.Module:
        raise NotImplementedError

    @property
    def attn_implementation(self) -> str:
        impl = getattr(self.text_config, "_attn_implementation", None) or "sdpa"
        return impl if isinstance(impl, str) else "sdpa"

    def conversation_state(self) -> dict[str, Any] | None:
        """The values of :attr:`conversation_attributes` the model holds now (None: the model keeps none)."""
        if not self.conversation_attributes:
            return None
        return {name: getattr(self.backbone, name, None) for name in self.conversation_attributes}

    def set_conversation_state(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self.backbone, name, value)

    # -- visual tokens -----------------------------------------------------------------------------
    @property
    def visual_token_ids(self) -> tuple[int, ...]:
        ids = [getattr(self.config, name, None) for name in ("image_token_id", "video_token_id")]
        return tuple(int(i) for i in ids if i is not None)

    def visual_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` bool: True where ``input_ids`` holds an image or video placeholder token."""
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for token_id in self.visual_token_ids:
            mask |= input_ids == token_id
        return mask

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        """Per sample, the images/videos among its visual tokens, in order. Default: one flat segment."""
        counts = self.visual_mask(input_ids).sum(dim=1).tolist()
        return [[VisualSegment(0, 1, 1, int(n), extra=0)] if n else [] for n in counts]

    def padding_fraction(self, input_ids: torch.Tensor, inputs: dict) -> list[torch.Tensor] | None:
        """Per sample ``[N_b]`` fraction of each visual token's patch that is image padding, or None."""
        return None

    def min_prune_layer(self) -> int:
        """The first decoder layer after the pre-LLM stage allowed to see a pruned sequence (0: any layer)."""
        return 0

    def prune_lm_inputs(self, kwargs: dict, index: torch.Tensor, valid: torch.Tensor) -> dict:
        """The language model's model-specific keyword inputs for the pre-LLM stage's kept slots.

        kwargs: the language model's keyword arguments; index: ``[B, L']`` each kept slot's position in the
        unpruned sequence; valid: ``[B, L']`` bool, real (not padding) slots. The engine itself gathers
        ``inputs_embeds``, the mask and the positions; the default has nothing else to slice.
        """
        return kwargs

    # -- attention recomputation -------------------------------------------------------------------
    def rotary(self, attention: nn.Module):
        """The ``apply_rotary_pos_emb(q, k, cos, sin)`` function of this attention module's modeling file."""
        return sys.modules[type(attention).__module__].apply_rotary_pos_emb

    def project_qk(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        query_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries of a few positions and keys of all positions, as ``layer`` computes them.

        hidden: ``[B, L, D]`` the input of ``layer``; query_index: ``[B, Q]`` positions.
        Returns ``q`` ``[B, H, Q, d]`` and ``k`` ``[B, H_kv, L, d]`` after the layer's norms and RoPE.
        """
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        head_dim = attention.head_dim
        batch, length, _ = normed.shape
        query_index = query_index.to(normed.device)
        rows = torch.gather(normed, 1, query_index[..., None].expand(-1, -1, normed.shape[-1]))
        query = attention.q_proj(rows).view(batch, query_index.shape[1], -1, head_dim)
        key = attention.k_proj(normed).view(batch, length, -1, head_dim)
        if hasattr(attention, "q_norm"):
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        cos, sin = (t.to(query.device) for t in position_embeddings)
        if cos.shape[0] != batch:
            cos, sin = cos.expand(batch, *cos.shape[1:]), sin.expand(batch, *sin.shape[1:])
        index = query_index.to(cos.device)[..., None].expand(-1, -1, cos.shape[-1])
        cos_q, sin_q = torch.gather(cos, 1, index), torch.gather(sin, 1, index)
        apply_rope = self.rotary(attention)
        query = apply_rope(query, query, cos_q, sin_q)[0]
        key = apply_rope(key, key, cos, sin)[0]
        return query, key
