"""The pruning engine: per-instance forward hooks that shrink the visual tokens inside the language model.

Hooks (all removed exactly by :meth:`PruneHandle.remove`):

* a pre-hook and an always-called forward hook on the whole model find the visual tokens in
  ``input_ids``, tell prefill from cached decoding, and record statistics;
* a pre-hook on the language model runs the pre-LLM stage (layer 0) and keeps the 2-D attention mask
  and position ids in step with a pruned layer-0 cache during decoding;
* pre-hooks on decoder layers compute scores at the scoring layers, drop tokens at the stage layers,
  and hand every later layer the sliced mask, ``(cos, sin)`` and position ids.

Layers before the first stage keep the full sequence, so their cache (layer 0 sizes generate's
masks) stays full length; deeper layers cache only the kept tokens. Kept tokens keep their original
position ids, so decoding continues from the original prompt length.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
from torch import nn

from vtprune.adapters.base import Adapter
from vtprune.config import PruneConfig, Stage, keep_count
from vtprune.layout import attention_mask_for, gather_tokens, mask_style, repad
from vtprune.methods import Method
from vtprune.scoring import ScoreContext
from vtprune.state import CallState, CallStats, StageView, next_view, select_keep, visual_ordinals

MAX_STATS = 1000


class PruneHandle:
    """A wrapped model's pruning hooks and statistics. Create it with :func:`vtprune.wrap`."""

    def __init__(self, model: nn.Module, adapter: Adapter, method: Method, config: PruneConfig,
                 stages: tuple[Stage, ...]) -> None:
        self.model, self.adapter, self.method, self.config = model, adapter, method, config
        self.stages = stages
        self.stats: deque[CallStats] = deque(maxlen=MAX_STATS)
        self._call: CallState | None = None
        self._evidence: list | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._llm_stages = [s for s in stages if s.layer > 0]
        self._score_layers = {method.score_layer(s): i for i, s in enumerate(stages) if s.layer > 0}
        self._stage_at = {s.layer: i for i, s in enumerate(stages)}
        self._register()

    # -- public API ------------------------------------------------------------------------------------
    @property
    def last_stats(self) -> CallStats | None:
        """Statistics of the most recent prefill with visual tokens, or None."""
        return self.stats[-1] if self.stats else None

    def set_evidence(self, evidence: list | None) -> None:
        """Per-sample ``[N_b]`` evidence weights for the next calls (used by the ``oracle`` method)."""
        self._evidence = evidence

    def add_hook(self, hook: torch.utils.hooks.RemovableHandle) -> None:
        """Adopt a hook registered by a method so that :meth:`remove` removes it too."""
        self._hooks.append(hook)

    def remove(self) -> None:
        """Remove every hook; the model is the pristine model again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._call = None
        if getattr(self.model, "_vtprune_handle", None) is self:
            del self.model._vtprune_handle

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def __enter__(self) -> PruneHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        stages = ", ".join(f"{s.layer}:{s.keep:g}" for s in self.stages)
        return f"PruneHandle(method={self.config.method!r}, stages=[{stages}], active={self.active})"

    # -- registration -------------------------------------------------------------------------------------
    def _register(self) -> None:
        self._hooks.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        self._hooks.append(
            self.model.register_forward_hook(self._model_post_hook, with_kwargs=True, always_call=True)
        )
        self._hooks.append(
            self.adapter.language_model.register_forward_pre_hook(self._lm_pre_hook, with_kwargs=True)
        )
        first = min((s.layer for s in self._llm_stages), default=None)
        for index, layer in enumerate(self.adapter.decoder_layers):
            if index in self._score_layers or (first is not None and index >= first):
                hook = layer.register_forward_pre_hook(self._make_layer_hook(index), with_kwargs=True)
                self._hooks.append(hook)
        self.method.prepare(self)

    # -- whole-model hooks --------------------------------------------------------------------------
    def _model_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        call = self._call
        if input_ids is None:
            self._call = None
            return
        visual = self.adapter.visual_mask(input_ids)
        if cache is not None and cache.get_seq_length() > 0:
            if call is not None and call.cache is cache:
                call.decoding, call.decode_columns = True, None
                return
            self._call = None
            if any(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
                raise RuntimeError(
                    "vtprune prunes visual tokens at prefill; this call adds images to a non-empty cache "
                    "(multi-turn with new images). Start a new cache, or remove the handle for this call."
                )
            return
        if not bool(visual.any()):
            self._call = None
            return
        self._call = self._new_call(input_ids, visual, dict(kwargs))

    def _new_call(self, input_ids: torch.Tensor, visual: torch.Tensor, inputs: dict) -> CallState:
        num_visual = visual.sum(dim=1)
        if self._evidence is not None:
            inputs["vtprune_evidence"] = self._evidence
        stats = CallStats(visual_tokens=num_visual.tolist())
        if visual.device.type == "cuda":
            torch.cuda.synchronize(visual.device)
        return CallState(
            num_visual=num_visual,
            segments=self.adapter.segments(input_ids, inputs),
            inputs=inputs,
            visual=visual,
            ordinal=visual_ordinals(visual),
            prompt_length=input_ids.shape[1],
            stats=stats,
            started=time.perf_counter(),
        )

    def _model_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self._call
        if call is None:
            return
        if call.decoding:
            step = kwargs.get("input_ids", args[0] if args else None)
            call.decoded += step.shape[1] if step is not None else 1
            return
        if call.visual.device.type == "cuda":
            torch.cuda.synchronize(call.visual.device)
        call.stats.forward_ms = (time.perf_counter() - call.started) * 1000.0
        self.stats.append(call.stats)
        if output is None:
            self._call = None

    # -- language-model hook ------------------------------------------------------------------------
    def _lm_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call = self._call
        if call is None:
            return None
        if call.decoding:
            return args, self._lm_decode_kwargs(call, kwargs)
        embeds = kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4):
            self._call = None
            raise RuntimeError(
                "vtprune needs the 2-D attention mask and a DynamicCache; this call passed a prepared 4-D mask "
                "(static or compiled cache). Use the default cache (generate(..., cache_implementation=None))."
            )
        if embeds is None:
            self._call = None
            return None
        batch, length = embeds.shape[:2]
        valid = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else torch.ones(
            batch, length, dtype=torch.bool, device=embeds.device)
        call.left_padding = bool((~valid[:, 0]).any()) or not bool((~valid[:, -1]).any())
        call.lm_valid = valid
        view = StageView(
            index=torch.arange(length, device=embeds.device).expand(batch, length),
            valid=valid, visual=call.visual & valid, ordinal=call.ordinal,
        )
        if self.stages and self.stages[0].layer == 0:
            kwargs, view = self._pre_llm_stage(call, kwargs, view)
        call.views = [view]
        call.base_count = view.valid.sum(dim=1)
        call.next_stage = 1 if self.stages and self.stages[0].layer == 0 else 0
        return args, kwargs

    def _pre_llm_stage(self, call: CallState, kwargs: dict, view: StageView) -> tuple[dict, StageView]:
        stage = self.stages[0]
        embeds = kwargs["inputs_embeds"]
        ctx = self._context(call, view, embeds, -1, None, None)
        keep, embeds = self._select(call, ctx, stage, view, embeds)
        layout = repad(keep, call.left_padding)
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = gather_tokens(embeds, layout.index, 1)
        kwargs["attention_mask"] = layout.valid.long()
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[0], -1)
        kwargs["position_ids"] = gather_tokens(positions, layout.index, positions.dim() - 1)
        call.pre_llm_index, call.pre_llm_valid = layout.index, layout.valid
        new = next_view(view, keep, call.left_padding)
        length = layout.index.shape[1]
        identity = torch.arange(length, device=embeds.device).expand(embeds.shape[0], length)
        return kwargs, StageView(index=identity, valid=new.valid, visual=new.visual, ordinal=new.ordinal)

    def _lm_decode_kwargs(self, call: CallState, kwargs: dict) -> dict:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            call.decode_columns = mask[:, call.prompt_length:].bool()
        if call.pre_llm_index is None:
            return kwargs
        kwargs = dict(kwargs)
        step = (kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else kwargs["input_ids"])
        new_tokens = step.shape[1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            kwargs["attention_mask"] = torch.cat([call.pre_llm_valid.long(), mask[:, call.prompt_length:].long()], 1)
        if kwargs.get("position_ids") is None:
            start = call.prompt_length + call.decoded
            positions = torch.arange(start, start + new_tokens, device=step.device)
            kwargs["position_ids"] = positions.expand(step.shape[0], -1)
        return kwargs

    # -- decoder-layer hooks ------------------------------------------------------------------------
    def _make_layer_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            call = self._call
            if call is None or call.view is None:
                return None
            if call.decoding:
                return args, self._decode_layer_kwargs(call, index, kwargs)
            return self._prefill_layer(call, index, module, args, kwargs)

        return hook

    def _prefill_layer(self, call: CallState, index: int, layer: nn.Module, args: tuple, kwargs: dict):
        if call.cache is None:
            call.cache = kwargs.get("cache", kwargs.get("past_key_values"))
        hidden = args[0] if args else kwargs["hidden_states"]
        original = kwargs
        kwargs = self._apply_view(call, original)
        while call.next_stage < len(self.stages):
            stage = self.stages[call.next_stage]
            ctx = self._context(call, call.view, hidden, index, layer, kwargs.get("position_embeddings"))
            if self.method.score_layer(stage) == index and call.pending_scores is None:
                call.pending_scores = self.method.score(ctx, stage)
            if stage.layer != index:
                break
            keep, hidden = self._select(call, ctx, stage, call.view, hidden)
            hidden = gather_tokens(hidden, repad(keep, call.left_padding).index, 1)
            call.views.append(next_view(call.view, keep, call.left_padding))
            call.next_stage += 1
            kwargs = self._apply_view(call, original)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _apply_view(self, call: CallState, kwargs: dict) -> dict:
        """Replace mask, ``(cos, sin)`` and position ids by those of the current view (built once per view)."""
        view = call.view
        if view.kwargs.get("source") is not None:
            return {**kwargs, **{k: v for k, v in view.kwargs.items() if k != "source"}}
        if len(call.views) == 1:
            view.kwargs["source"] = "identity"
            return kwargs
        update: dict[str, Any] = {"source": "view"}
        incoming = kwargs.get("attention_mask")
        style = mask_style(incoming, self.adapter.attn_implementation)
        length = view.index.shape[1]
        if incoming is not None or view.valid.logical_not().any():
            dtype = incoming.dtype if isinstance(incoming, torch.Tensor) else torch.float32
            update["attention_mask"] = attention_mask_for(view.valid, length, style, dtype)
        else:
            update["attention_mask"] = None
        embeddings = kwargs.get("position_embeddings")
        if embeddings is not None:
            update["position_embeddings"] = tuple(gather_tokens(t, view.index, 1) for t in embeddings)
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor):
            update["position_ids"] = gather_tokens(positions, view.index, positions.dim() - 1)
        if self.config.positions == "compact" and embeddings is not None:
            update.update(self._compact_embeddings(view, embeddings[0]))
        view.kwargs = update
        return {**kwargs, **{k: v for k, v in update.items() if k != "source"}}

    def _compact_embeddings(self, view: StageView, like: torch.Tensor) -> dict:
        compact = (view.valid.long().cumsum(dim=1) - 1).clamp(min=0)
        rotary = self.adapter.language_model.rotary_emb
        cos, sin = rotary(like, compact)
        return {"position_embeddings": (cos, sin), "position_ids": compact}

    def _decode_layer_kwargs(self, call: CallState, index: int, kwargs: dict) -> dict:
        region = sum(1 for stage in self._llm_stages if stage.layer <= index)
        if region == 0 or region >= len(call.views):
            return kwargs
        view = call.views[region]
        if view.kwargs.get("source") != "view":
            return kwargs
        incoming = kwargs.get("attention_mask")
        hidden_len = call.decoded
        columns = call.decode_columns
        new_tokens = None
        embeddings = kwargs.get("position_embeddings")
        if embeddings is not None:
            new_tokens = embeddings[0].shape[1]
        new_tokens = new_tokens or 1
        if columns is None:
            columns = torch.ones(view.valid.shape[0], hidden_len + new_tokens, dtype=torch.bool,
                                 device=view.valid.device)
        kv_valid = torch.cat([view.valid, columns[:, : hidden_len + new_tokens]], dim=1)
        kwargs = dict(kwargs)
        if incoming is None and bool(kv_valid.all()):
            kwargs["attention_mask"] = None
        else:
            style = mask_style(incoming, self.adapter.attn_implementation)
            dtype = incoming.dtype if isinstance(incoming, torch.Tensor) else torch.float32
            kwargs["attention_mask"] = attention_mask_for(kv_valid, new_tokens, style, dtype)
        if self.config.positions == "compact" and embeddings is not None:
            positions = kwargs.get("position_ids")
            removed = (call.base_count - view.valid.sum(dim=1))[:, None]
            compact = positions - removed
            kwargs["position_embeddings"] = self.adapter.language_model.rotary_emb(embeddings[0], compact)
            kwargs["position_ids"] = compact
        return kwargs

    # -- scoring and selection ----------------------------------------------------------------------
    def _context(self, call: CallState, view: StageView, hidden: torch.Tensor, index: int,
                 layer: nn.Module | None, embeddings: Any) -> ScoreContext:
        return ScoreContext(
            hidden=hidden, layer_index=index, layer=layer, position_embeddings=embeddings,
            valid=view.valid, visual=view.visual, ordinal=view.ordinal, num_visual=call.num_visual,
            segments=call.segments, adapter=self.adapter, inputs=call.inputs, state=call.method_state,
        )

    def _select(self, call: CallState, ctx: ScoreContext, stage: Stage, view: StageView,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep mask ``[B, L]`` of the stage (and possibly merged hidden states); records the stats."""
        scores = call.pending_scores
        if scores is None or scores.shape != view.valid.shape:
            scores = self.method.score(ctx, stage)
        call.pending_scores = None
        counts = torch.tensor([keep_count(stage.keep, int(n)) for n in call.num_visual.tolist()],
                              device=view.valid.device)
        keep = select_keep(scores, view.visual, view.valid, counts)
        keep, hidden = self.method.refine(ctx, stage, keep, scores, hidden)
        kept_visual = keep & view.visual
        call.stats.stage_layers.append(stage.layer)
        call.stats.kept.append(kept_visual.sum(dim=1).tolist())
        call.stats.kept_indices.append(
            [sorted(view.ordinal[b][kept_visual[b]].tolist()) for b in range(keep.shape[0])]
        )
        return keep, hidden
