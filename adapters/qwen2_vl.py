"""Qwen2-VL (``model_type="qwen2_vl"``): dynamic resolution, 2x2 patch merger, 3-D M-RoPE positions."""

from __future__ import annotations

import torch
from torch import nn
from vtprune.adapters.base import Adapter, VisualSegment


class Qwen2VLAdapter(Adapter):
    """``Qwen2VLForConditionalGeneration``: ``model.model.visual`` (ViT + merger), ``model.model.language_model``.

    Images and videos have no padding tokens (``smart_resize`` to multiples of the patch), so the
    padding-sink term of debiasing is inactive. Kept tokens keep their (t, h, w) position ids.
    """

    model_types = ("qwen2_vl",)
    #: 3-D M-RoPE positions are not renumbered; "vit_attention": a ViT block's attention and keys (VisionZip).
    capabilities = frozenset({"attention", "llm_layers", "vit_attention"})
    family = "qwen"
    processor_class = "Qwen2VLProcessor"
    conversation_attributes = ("rope_deltas",)  # a follow-up's text positions continue from its own prefill's

    @property
    def vision_tower(self) -> nn.Module:
        return self.backbone.visual

    @property
    def merge_size(self) -> int:
        return int(getattr(self.config.vision_config, "spatial_merge_size", 2))

    @property
    def vit_blocks(self) -> nn.ModuleList:
        """The ViT blocks (``norm1``, ``attn.qkv``; called with ``cu_seqlens`` and ``position_embeddings``)."""
        return self.vision_tower.blocks

    def vit_full_attention_blocks(self) -> list[int]:
        """Blocks whose attention spans a whole image or frame (Qwen2-VL, Qwen3-VL: every block)."""
        return list(range(len(self.vit_blocks)))

    def vit_merged_order(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        """Index ``[S / merge_size^2]`` putting the merger units, in the order the blocks see them, back in
        token order; None when the blocks already see token order (Qwen2-VL, Qwen3-VL)."""
        return None

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        """Per sample, each run of image / video tokens with its merged (t, h, w) grid.

        The grid comes from ``image_grid_thw`` / ``video_grid_thw`` when the call has them, else from the
        3-D M-RoPE position ids (``generate`` passes those and pre-encoded vision features instead).
        """
        if inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None:
            return self._segments_from_grids(input_ids, inputs)
        positions = inputs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[0] in (3, 4):
            return self._segments_from_positions(input_ids, positions[-3:])
        return super().segments(input_ids, inputs)

    def _runs(self, row: list[int]) -> list[tuple[str, int, int]]:
        """``(kind, start, end)`` of each maximal run of image or video placeholder tokens in ``row``."""
        ids = {self.config.image_token_id: "image", self.config.video_token_id: "video"}
        runs, start = [], None
        for position, token in enumerate([*row, -1]):
            if start is not None and token != row[start]:
                runs.append((ids[row[start]], start, position))
                start = None
            if start is None and token in ids:
                start = position
        return runs

    def _segments_from_positions(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[list[VisualSegment]]:
        result = []
        for b, row in enumerate(input_ids.tolist()):
            segments, ordinal = [], 0
            for kind, start, end in self._runs(row):
                t, h, w = (int(positions[axis, b, start:end].unique().numel()) for axis in range(3))
                if t * h * w != end - start:
                    t, h, w = 1, 1, end - start
                segments.append(VisualSegment(ordinal, t, h, w, kind=kind))
                ordinal += end - start
            result.append(segments)
        return result

    def _segments_from_grids(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        grids = {kind: inputs.get(f"{kind}_grid_thw") for kind in ("image", "video")}
        used, merge, result = {"image": 0, "video": 0}, self.merge_size, []
        for row in input_ids.tolist():
            segments, ordinal, owed = [], 0, {"image": 0, "video": 0}
            for kind, start, end in self._runs(row):
                # Qwen3-VL writes a timestamp before every frame: one video's grid spans several runs
                covered = min(owed[kind], end - start)
                owed[kind] -= covered
                remaining = end - start - covered
                while remaining > 0:
                    table = grids[kind]
                    if table is None or used[kind] >= len(table):
                        segments.append(VisualSegment(ordinal, 1, 1, remaining, kind=kind))
                        ordinal, remaining = ordinal + remaining, 0
                        break
                    t, h, w = (int(x) for x in table[used[kind]])
                    used[kind] += 1
                    segment = VisualSegment(ordinal, t, h // merge, w // merge, kind=kind)
                    segments.append(segment)
                    ordinal += segment.length
                    owed[kind] = max(segment.length - remaining, 0)
                    remaining -= segment.length
            result.append(segments)
        return result
