"""Per-token maps of a late vision-encoder layer, aligned with the LLM's visual tokens (VisionZip's inputs).

For every visual token of the language model: the ``attention`` it receives at one vision layer (from the
CLS query on CLIP towers; averaged over all queries on towers without CLS: SigLIP, Qwen-VL's ViT) and its
``key`` (that layer's keys averaged over heads), the similarity metric of VisionZip's contextual merge.

* **CLIP / SigLIP** (LLaVA family): a pre-hook on the encoder layer recomputes its head-mean attention and
  keys from ``layer_norm1``, ``q_proj``, ``k_proj`` per crop (:func:`vtprune.methods.vit.vit_attention`); the
  CLS column is dropped as the projector drops it, and crops are arranged as the model packs its features
  (:func:`vtprune.methods.vit.arrange`: LLaVA-NeXT / OneVision tiles; newline tokens get attention 1.0).
* **Qwen2/2.5/3-VL**: a pre-hook on the tower reads ``grid_thw``; a pre-hook on a late full-attention block
  recomputes q / k from ``norm1`` and ``attn.qkv`` with the block's own 2-D rotary embedding, within each
  attention segment (``cu_seqlens``: one image or one frame). Maps are taken **after the 2x2 patch merger's
  grouping**: a merged token receives the sum of its patches' attention and has their mean key; Qwen2.5-VL's
  window order is undone (``adapter.vit_merged_order``). Image and video tower calls (images run first) are
  scattered into the sequence by token type, as the model scatters its features.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from vtprune.config import stage_layer
from vtprune.methods import vit
from vtprune.methods.base import Capture
from vtprune.scoring import ScoreContext

FAST_PATCHES = 6144  # above this many patches per image / frame, queries="auto" samples the queries on a CPU
FAST_ROWS = 1024  # queries averaged on the fast path (evenly spaced)


def is_qwen(adapter: Any) -> bool:
    return hasattr(adapter, "vit_blocks")


def vit_depth(adapter: Any) -> int:
    return len(adapter.vit_blocks) if is_qwen(adapter) else len(vit.encoder_layers(adapter))


def default_layer(adapter: Any) -> int:
    """The layer whose attention is read: the projector's feature layer (CLIP / SigLIP), else the last
    full-attention ViT block (Qwen2.5-VL's windowed blocks see only part of the image)."""
    if not is_qwen(adapter):
        return vit.feature_layer_index(adapter)
    full = adapter.vit_full_attention_blocks()
    if not full:
        raise ValueError(f"{adapter.config.model_type}'s vision tower has no full-attention block to score with.")
    return full[-1]


def captures(adapter: Any, key: str, layer: int | None, name: str, query: str = "auto",
             queries: str | int = "auto") -> tuple[Capture, ...]:
    """Hooks storing the maps of ``layer`` (None: :func:`default_layer`) under ``state[key]`` at every call.

    ``query``: ``"cls"`` (the CLS row; CLIP only), ``"mean"`` (all queries) or ``"auto"`` (CLS where the tower
    has one). ``queries`` (Qwen-VL towers, whose map is the mean over queries): :func:`tower_rows`."""
    has_cls = not is_qwen(adapter) and getattr(adapter.config.vision_config, "model_type", "") != "siglip_vision_model"
    if query not in ("auto", "cls", "mean") or (query == "cls" and not has_cls):
        raise ValueError(f"query={query!r}: use 'auto', 'mean' or, on a tower with a CLS token (CLIP), 'cls'; "
                         f"{adapter.config.model_type}'s tower {'has' if has_cls else 'has no'} CLS token.")
    index = resolve_layer(adapter, layer, name)
    if is_qwen(adapter):
        if index not in adapter.vit_full_attention_blocks():
            raise ValueError(f"vit_layer={index} of {adapter.config.model_type} attends within windows; {name} "
                             f"needs a full-attention block: one of {adapter.vit_full_attention_blocks()}.")
        return (Capture(adapter.vision_tower, _grab_grid(key), before=True, outside_forward=True),
                Capture(adapter.vit_blocks[index], _grab_qwen(adapter, key, queries), before=True,
                        outside_forward=True))
    if queries != "auto" and queries != "all":
        raise ValueError(f"queries={queries!r} samples the queries of a Qwen-VL tower's map; "
                         f"{adapter.config.model_type}'s crops (at most 729 patches) always use every query: drop it.")
    cls = has_cls and query != "mean"
    return (Capture(vit.encoder_layers(adapter)[index], _grab_clip(adapter, key, cls), before=True, outside_forward=True),)


def resolve_layer(adapter: Any, layer: int | None, name: str, option: str = "vit_layer") -> int:
    """The vision layer index of ``layer`` (None: :func:`default_layer`), or a one-line ``ValueError``."""
    depth = vit_depth(adapter)
    index = default_layer(adapter) if layer is None else stage_layer(layer, f"{name}: {option}")
    if not 0 <= index < depth:
        raise ValueError(f"{option}={layer} is outside the {depth}-layer vision tower; use 0..{depth - 1} "
                         f"(None: layer {default_layer(adapter)}).")
    return index


def feature_capture(adapter: Any, index: int, key: str) -> Capture:
    """A forward hook on CLIP / SigLIP encoder layer ``index`` appending its output per crop ``[n, T, D]`` (CLS
    dropped as the projector drops it) to ``state[key]``: the pre-projector features of that layer."""

    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        state.setdefault(key, []).append(vit.crop_tokens(adapter, hidden.detach()))

    return Capture(vit.encoder_layers(adapter)[index], grab, outside_forward=True)


def crop_records(ctx: ScoreContext, key: str, name: str, part: int = 0) -> torch.Tensor:
    """``[n_crops, T, ...]`` the call's per-crop records of a CLIP / SigLIP hook under ``state[key]`` (item ``part``
    of each record when records are tuples), concatenated over the call's tower runs (read once per call)."""
    cached = ctx.state.get(f"{key}_crops{part}")
    if cached is not None:
        return cached
    records = ctx.state.pop(key, None)
    if not records:
        raise RuntimeError(f"{name} found no vision-tower maps for this call (were images passed?).")
    _check_images(ctx, name)
    crops = torch.cat([r[part] if isinstance(r, tuple) else r for r in records])
    ctx.state[f"{key}_crops{part}"] = crops
    return crops


def crop_table(ctx: ScoreContext, crops: torch.Tensor, name: str) -> torch.Tensor:
    """``[B, N0max + 1]`` per-crop values ``[n_crops, T]`` laid out over each sample's visual tokens by ordinal, as the
    model packs its crops (:func:`vtprune.methods.vit.arrange`: NeXT / OneVision tiles, newline tokens 1.0)."""
    _check_images(ctx, name)
    counts = ctx.visual_counts
    arranged = vit.arrange(ctx.adapter, crops, ctx.inputs, counts)
    table = torch.zeros(len(counts), max(counts, default=0) + 1, device=ctx.valid.device)
    for row, (values, _) in enumerate(arranged):
        if values.numel() != counts[row]:
            raise ValueError(f"{name} could not align its vision-tower map ({values.numel()} values) with the "
                             f"{counts[row]} visual tokens of sample {row}; this input layout is not supported.")
        table[row, : values.numel()] = values.to(table.device)
    return table


def _check_images(ctx: ScoreContext, name: str) -> None:
    if ctx.inputs.get("pixel_values_videos") is not None or (ctx.inputs.get("mm_encoder_outputs") or {}).get("video"):
        raise ValueError(f"{name} reads the vision tower of images; {ctx.adapter.config.model_type} video input is "
                         "not supported: pass the frames as images, or use 'divprune', 'dart' or 'temporal'.")


# -- pure functions ----------------------------------------------------------------------------------------
def received_attention(query: torch.Tensor, key: torch.Tensor, scale: float, chunk: int = 1024,
                       rows: int | None = None) -> torch.Tensor:
    """Attention each token receives ``[n]`` (fp32), averaged over heads and queries.

    query, key: ``[H, n, d]``. ``sum_i`` over at most ``chunk`` queries at a time (never an ``n x n`` per head
    beyond ``chunk`` rows). ``rows``: average over that many evenly spaced queries only (None or ``>= n``: all,
    the exact map; cost ``rows / n`` of it).
    """
    heads, n, _ = query.shape
    if rows is not None and rows < n:
        query = query[:, spaced_rows(n, rows).to(query.device)]
    total = torch.zeros(n, dtype=torch.float32, device=query.device)
    for part in query.float().split(chunk, dim=1):
        total += torch.softmax(part @ key.float().transpose(-1, -2) * scale, dim=-1).sum(dim=(0, 1))
    return total / (heads * query.shape[1])


def spaced_rows(n: int, rows: int) -> torch.Tensor:
    """``rows`` evenly spaced indices of ``0..n-1`` ``[rows]`` (the first and the last included)."""
    return torch.linspace(0, n - 1, max(rows, 1)).round().long()


def tower_rows(queries: str | int, n: int, device: torch.device | str | None = None) -> int | None:
    """Queries averaged for a map over ``n`` patches (None: all): ``"all"``; an int ``m``: ``m`` sampled;
    ``"auto"``: all on an accelerator (``device`` not the CPU: the exact map costs little there) and on a CPU up to
    :data:`FAST_PATCHES` patches, else :data:`FAST_ROWS` sampled (the CPU fast path; how close it comes to the
    exact map depends on the tower, ``docs/methods.md``). ``device`` None counts as the CPU."""
    accelerator = device is not None and torch.device(device).type != "cpu"
    if queries == "all" or (queries == "auto" and (accelerator or n <= FAST_PATCHES)):
        return None
    return FAST_ROWS if queries == "auto" else int(queries)


def merge_units(values: torch.Tensor, keys: torch.Tensor, unit: int, order: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch maps ``[S]``, ``[S, d]`` -> merged-token maps ``[S / unit]`` (sum), ``[S / unit, d]`` (mean), put
    back in token order by ``order`` (None: already in order)."""
    values = values.reshape(-1, unit).sum(dim=1)
    keys = keys.reshape(-1, unit, keys.shape[-1]).mean(dim=1)
    if order is not None:
        order = order.to(values.device)
        values, keys = values[order], keys[order]
    return values, keys


# -- capture hooks -----------------------------------------------------------------------------------------
def _grab_clip(adapter: Any, key: str, cls: bool):
    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            attention = vit.vit_attention(module, hidden)
            values = attention[:, 0, :] if cls else attention.mean(dim=1)
            heads = int(module.self_attn.num_heads)
            keys = module.self_attn.k_proj(module.layer_norm1(hidden))
            keys = keys.view(*keys.shape[:2], heads, -1).float().mean(dim=2)
        state.setdefault(key, []).append((vit.crop_tokens(adapter, values), vit.crop_tokens(adapter, keys)))

    return grab


def _grab_grid(key: str):
    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        state[key + "_grid"] = grid

    return grab


def qwen_block_qk(module: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key ``[S, H, d]`` of a Qwen-VL ViT block for its input ``hidden`` ``[S, D]``: ``norm1``, the
    fused ``attn.qkv`` and the block's own ``apply_rotary_pos_emb_vision`` with ``(cos, sin)`` ``[S, d]``."""
    attention = module.attn
    length = hidden.shape[0]
    qkv = attention.qkv(module.norm1(hidden)).reshape(length, 3, attention.num_heads, -1).permute(1, 0, 2, 3)
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb_vision
    return rotary(qkv[0], qkv[1], cos, sin)


def _grab_qwen(adapter: Any, key: str, queries: str | int = "auto"):
    unit = adapter.merge_size ** 2

    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        bounds = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        cos, sin = kwargs.get("position_embeddings", args[2] if len(args) > 2 else None)
        with torch.no_grad():
            length = hidden.shape[0]
            query, keys = qwen_block_qk(module, hidden, cos, sin)  # [S, H, d]
            values = torch.zeros(length, dtype=torch.float32, device=hidden.device)
            edges = [int(b) for b in bounds.tolist()]
            for start, end in zip(edges[:-1], edges[1:], strict=True):
                if end > start:
                    values[start:end] = received_attention(query[start:end].transpose(0, 1),
                                                           keys[start:end].transpose(0, 1), float(module.attn.scaling),
                                                           rows=tower_rows(queries, end - start, hidden.device))
            grid = state.pop(key + "_grid", None)
            order = adapter.vit_merged_order(grid) if grid is not None else None
            merged = merge_units(values, keys.float().mean(dim=1), unit, order)
        state.setdefault(key, []).append(merged)

    return grab


# -- alignment with the LLM's visual tokens ------------------------------------------------------------------
def token_maps(ctx: ScoreContext, key: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, N0max], [B, N0max, d])`` attention and key of every original visual token by ordinal."""
    cached = ctx.state.get(key + "_maps")
    if cached is not None:
        return cached
    records = ctx.state.pop(key, None)
    if not records:
        raise RuntimeError(f"{name} found no vision-tower maps for this call (were images passed?).")
    counts = ctx.visual_counts
    device = ctx.valid.device
    if is_qwen(ctx.adapter):
        per_sample = _qwen_samples(ctx, records)
    else:
        per_sample = _llava_samples(ctx, records, counts, name)
    width = max(counts, default=0) + 1
    dim = per_sample[0][1].shape[-1] if per_sample else 1
    values = torch.zeros(len(counts), width, device=device)
    keys = torch.zeros(len(counts), width, dim, device=device)
    for row, (v, k) in enumerate(per_sample):
        if v.numel() != counts[row]:
            raise ValueError(f"{name} could not align its vision-tower map ({v.numel()} values) with the "
                             f"{counts[row]} visual tokens of sample {row}; this input layout is not supported.")
        values[row, : v.numel()], keys[row, : v.numel()] = v.to(device), k.to(device)
    ctx.state[key + "_maps"] = (values, keys)
    return values, keys


def _llava_samples(ctx: ScoreContext, records: list, counts: list[int], name: str) -> list:
    if ctx.inputs.get("pixel_values_videos") is not None or (ctx.inputs.get("mm_encoder_outputs") or {}).get("video"):
        raise ValueError(f"{name} reads the vision tower of images; {ctx.adapter.config.model_type} video input is "
                         "not supported: pass the frames as images, or use 'divprune', 'dart' or 'temporal'.")
    values = torch.cat([v for v, _ in records])
    keys = torch.cat([k for _, k in records])
    arranged = vit.arrange(ctx.adapter, values, ctx.inputs, counts)
    channels = [vit.arrange(ctx.adapter, keys[..., c].contiguous(), ctx.inputs, counts) for c in range(keys.shape[-1])]
    return [(arranged[row][0], torch.stack([channel[row][0] for channel in channels], dim=-1))
            for row in range(len(counts))]


def _qwen_samples(ctx: ScoreContext, records: list) -> list:
    ids = ctx.inputs["input_ids"]
    config = ctx.adapter.config
    kinds = [(ids == config.image_token_id), (ids == config.video_token_id)]
    present = [mask for mask in kinds if bool(mask.any())]
    if len(records) < len(present):
        raise RuntimeError(f"expected {len(present)} vision-tower calls (images, then videos), saw {len(records)}.")
    dim = records[0][1].shape[-1]
    values = torch.zeros(ids.shape, dtype=torch.float32, device=records[0][0].device)
    keys = torch.zeros(*ids.shape, dim, dtype=torch.float32, device=values.device)
    for mask, (v, k) in zip(present, records, strict=False):  # images first, as the model encodes them
        mask = mask.to(values.device)
        values[mask], keys[mask] = v.float(), k.float()
    visual = ctx.adapter.visual_mask(ids).to(values.device)
    return [(values[row][visual[row]], keys[row][visual[row]]) for row in range(ids.shape[0])]
