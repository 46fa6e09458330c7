"""An independent reference for pruned decoding that shares no code with vtprune's engine.

Given the visual tokens each stage kept (as ordinals), it recomputes every step from scratch (no KV cache):
the unwrapped model gives the hidden states entering the first stage layer (a plain forward pre-hook), the
kept positions are gathered with plain indexing, the remaining decoder layers run directly with a hand-built
causal mask and the language model's own rotary embedding, and the next token is the greedy argmax. One
sample at a time, with no padding. Only transformers' modules are used: no vtprune function is called.
"""

from __future__ import annotations

import torch


def _language_model(model):
    return model.model.language_model


def _visual_positions(model, ids: torch.Tensor) -> torch.Tensor:
    tokens = [getattr(model.config, name, None) for name in ("image_token_id", "video_token_id")]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for token in tokens:
        if token is not None:
            mask |= ids == token
    return mask[0].nonzero().flatten()


def _positions(model, inputs: dict, ids: torch.Tensor) -> torch.Tensor:
    """Position ids of ``ids`` (``[1, L]``; ``[3, 1, L]`` M-RoPE for Qwen-VL), as the model computes them."""
    if not model.config.model_type.startswith("qwen"):
        return torch.arange(ids.shape[1], device=ids.device)[None]
    extra = ids.shape[1] - inputs["input_ids"].shape[1]
    given = inputs["mm_token_type_ids"]
    types = torch.cat([given, torch.zeros(1, extra, dtype=given.dtype, device=given.device)], 1)
    grids = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    positions, _ = model.model.get_rope_index(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                                              **grids)
    return positions


def _causal(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.zeros(1, 1, n, n, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.no_grad()
def reference_step(model, inputs: dict, ids: torch.Tensor, stages: list[int], kept: list[list[int]],
                   compact: bool = False) -> torch.Tensor:
    """Next-token logits ``[V]`` of one sample ``ids`` ``[1, L]`` when stage ``s`` (before decoder layer
    ``stages[s]``) keeps the visual tokens with ordinals ``kept[s]``; text is never pruned."""
    lm = _language_model(model)
    extra = ids.shape[1] - inputs["input_ids"].shape[1]
    full = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:
        given = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat(
            [given, torch.zeros(1, extra, dtype=given.dtype, device=given.device)], 1)
    if not stages:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **full).logits[0, -1]
    captured = {}

    def grab(module, args, kwargs):  # the input of the first stage layer (Qwen3-VL DeepStack included)
        captured["hidden"] = args[0] if args else kwargs["hidden_states"]

    def grab_deepstack(module, args, kwargs):  # Qwen3-VL: rows added after layers 0..n-1, one per visual token
        captured["deepstack"] = kwargs.get("deepstack_visual_embeds") or []

    hooks = [lm.layers[stages[0]].register_forward_pre_hook(grab, with_kwargs=True),
             lm.register_forward_pre_hook(grab_deepstack, with_kwargs=True)]
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **full)
    finally:
        for hook in hooks:
            hook.remove()
    hidden, deepstack = captured["hidden"], captured["deepstack"]
    positions = _positions(model, inputs, ids)
    visual = _visual_positions(model, ids)
    alive = torch.arange(ids.shape[1], device=ids.device)
    ordinal_of = torch.full((ids.shape[1],), -1, dtype=torch.long, device=ids.device)
    ordinal_of[visual] = torch.arange(visual.numel(), device=ids.device)
    bounds = [*stages, len(lm.layers)]
    for stage, kept_ordinals in enumerate(kept):
        keep = torch.ones(ids.shape[1], dtype=torch.bool, device=ids.device)
        keep[visual] = False
        keep[visual[torch.tensor(kept_ordinals, dtype=torch.long, device=ids.device)]] = True
        selected = keep[alive]
        hidden, alive = hidden[:, selected], alive[selected]
        stage_positions = positions[..., alive]
        if compact:
            stage_positions = torch.arange(alive.numel(), device=ids.device)[None]
        cos, sin = lm.rotary_emb(hidden, stage_positions)
        mask = _causal(alive.numel(), hidden.dtype, hidden.device)
        for index in range(bounds[stage], bounds[stage + 1]):
            out = lm.layers[index](hidden, attention_mask=mask, position_ids=None, position_embeddings=(cos, sin))
            hidden = out[0] if isinstance(out, tuple) else out
            if index < len(deepstack):  # a stage before layer n: the kept tokens' DeepStack rows, the rest dropped
                rows = ordinal_of[alive]
                hidden = hidden.clone()
                hidden[0, rows >= 0] += deepstack[index][rows[rows >= 0]].to(hidden.dtype)
    return model.lm_head(lm.norm(hidden)[0, -1])


def _greedy(step, ids: torch.Tensor, steps: int, suppress: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with ``step(ids) -> [V]`` logits, tokens below ``suppress`` never chosen."""
    tokens, logits = [], []
    for _ in range(steps):
        step_logits = step(ids).float()
        choice = step_logits.clone()
        choice[:suppress] = float("-inf")
        token = int(choice.argmax())
        tokens.append(token)
        logits.append(step_logits)
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return torch.tensor(tokens), torch.stack(logits).cpu()


def reference_decode(model, inputs: dict, stages: list[int], kept: list[list[int]], steps: int,
                     suppress: int, compact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[steps]`` and logits ``[steps, V]`` of one sample by recomputing every step.

    ``suppress``: token ids below it are never chosen (the tests suppress placeholder tokens).
    """
    return _greedy(lambda ids: reference_step(model, inputs, ids, stages, kept, compact), inputs["input_ids"],
                   steps, suppress)


@torch.no_grad()
def reference_decode_kv(model, inputs: dict, kept: list[list[int]], steps: int, suppress: int,
                        prompt: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of one sample when layer ``l``'s cache keeps only the visual tokens ``kept[l]`` (KV
    retention, e.g. PrefixKV): no cache, every step recomputed by the unwrapped model, with a hand-built mask
    handed to each decoder layer: prompt queries attend causally to the whole prompt (as at prefill), generated
    queries at layer ``l`` to the prompt's text, ``kept[l]`` and the tokens generated so far. ``prompt``: the
    length of the prefilled prompt when ``inputs`` holds a longer conversation (a follow-up turn)."""
    ids = inputs["input_ids"]
    prompt = ids.shape[1] if prompt is None else prompt
    visual = _visual_positions(model, ids)
    allowed_prompt = []
    for layer_kept in kept:
        allowed = torch.ones(prompt, dtype=torch.bool, device=ids.device)
        allowed[visual] = False
        allowed[visual[torch.tensor(layer_kept, dtype=torch.long, device=ids.device)]] = True
        allowed_prompt.append(allowed)
    return _greedy(lambda current: _kv_step(model, inputs, current, prompt, allowed_prompt), ids, steps, suppress)


def _kv_step(model, inputs: dict, ids: torch.Tensor, prompt: int, allowed_prompt: list[torch.Tensor]) -> torch.Tensor:
    """Next-token logits ``[V]`` of ``ids`` with each layer's hand-built mask (see :func:`reference_decode_kv`)."""
    dtype = next(model.parameters()).dtype
    length = ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    masks = []
    for allowed_keys in allowed_prompt:
        allowed = causal.clone()
        allowed[prompt:, :prompt] &= allowed_keys[None, :]
        masks.append(torch.zeros(1, 1, length, length, dtype=dtype, device=ids.device).masked_fill(
            ~allowed, torch.finfo(dtype).min))

    def per_layer(mask):
        return lambda module, args, kwargs: (args, {**kwargs, "attention_mask": mask})

    layers = _language_model(model).layers
    hooks = [layer.register_forward_pre_hook(per_layer(masks[i]), with_kwargs=True) for i, layer in enumerate(layers)]
    full = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:
        given = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat(
            [given, torch.zeros(1, length - given.shape[1], dtype=given.dtype, device=given.device)], 1)
    try:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **full).logits[0, -1]
    finally:
        for hook in hooks:
            hook.remove()
