"""lmms-eval models ``vtprune_llava`` and ``vtprune_qwen_vl``: a Hugging Face VLM with vtprune's hooks on it.

A clean :class:`lmms_eval.api.model.lmms` subclass rather than a subclass of lmms-eval's ``llava_hf`` /
``qwen2_5_vl`` wrappers: those assert ``batch_size == 1`` (LLaVA), import ``qwen_vl_utils`` (which needs
torchvision), and place every rank on ``cuda:<i>`` under ``accelerate launch``, so they cannot run on the
CPU CI. Loading goes through :func:`vtprune.models.loading.load`, prompts through the processor's chat template
(see :mod:`vtprune.eval.lmms_plugin.inputs`), and :func:`vtprune.wrap` is applied once at construction so a
bad ``--model_args`` value fails with vtprune's own ``ValueError`` before any data is loaded.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from loguru import logger as eval_logger
from tqdm import tqdm
from vtprune.adapters import ADAPTERS
from vtprune.eval.lmms_plugin import loglikelihood as ll
from vtprune.eval.lmms_plugin.args import PluginArgs, parse_model_args
from vtprune.eval.lmms_plugin.inputs import (
    batches,
    clean_context,
    cut_at_stop,
    encode,
    flatten_visuals,
    generation_options,
    pad_to_square,
    prompt_text,
)
from vtprune.eval.lmms_plugin.stats import RunStats, log_run_stats

PADDING_FLAG = "__padding_only__"  # lmms-eval marks the requests it adds to even out ranks


class VTPruneModel(lmms):
    """Shared implementation; subclasses name the model family they accept."""

    is_simple = True
    model_id: ClassVar[str] = ""
    families: ClassVar[tuple[str, ...]] = ()
    other_model: ClassVar[str] = ""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args: PluginArgs = parse_model_args(kwargs)
        if self.args.threads:
            torch.set_num_threads(self.args.threads)
        self._setup_processes()
        self._model, self.processor = self._load()
        self.handle = self._wrap()
        eval_logger.info(f"{self.model_id}: {self.args.describe()} on {self.model.config.model_type} "
                         f"({self.device}, rank {self._rank}/{self._world_size}): {self.handle!r}")

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> VTPruneModel:
        """Like lmms-eval's, but ``--model_args`` win over the CLI's defaults (``batch_size=8`` is allowed)."""
        from lmms_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
        return cls(**extra, **args)

    # -- setup ----------------------------------------------------------------------------------------
    def _setup_processes(self) -> None:
        """Rank, world size and this rank's device (one model copy per process: data parallel)."""
        from accelerate import Accelerator

        self.accelerator = Accelerator()
        self._rank = self.accelerator.process_index
        self._world_size = self.accelerator.num_processes
        device = self.args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._world_size > 1 and device == "cuda":
            device = f"cuda:{self.accelerator.local_process_index}"
        self._load_device = device  # "auto" spreads one model over the GPUs (device_map="auto")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)

    def _load(self) -> tuple[Any, Any]:
        from vtprune.models.loading import load

        self._check_family(self.args.pretrained)
        model, processor = load(self.args.pretrained, self.args.attn_implementation, self.args.dtype,
                                self._load_device)
        if self.args.image_backend == "pil":
            from vtprune.eval.lmms_plugin.inputs import pil_image_processor

            processor.image_processor = pil_image_processor(processor.image_processor)
        self._set_pixels(processor)
        return model.eval(), processor

    def _check_family(self, spec: str | None) -> None:
        """Refuse a checkpoint of the other family before loading its weights (clear message, cheap)."""
        model_type = checkpoint_model_type(spec)
        if model_type not in self.families:
            hint = f"; use --model {self.other_model}" if model_type in OTHER_FAMILIES.get(self.model_id, ()) else ""
            raise ValueError(
                f"--model {self.model_id} takes {', '.join(self.families)} checkpoints, but pretrained={spec!r} "
                f"is a {model_type!r} model{hint}."
            )
        if self.args.image_aspect_ratio == "pad" and model_type != "llava":
            raise ValueError(f"image_aspect_ratio=pad is LLaVA-1.5's preprocessing; pretrained={spec!r} is a "
                             f"{model_type!r} model, which prepares its images itself: drop it from --model_args.")

    def _set_pixels(self, processor: Any) -> None:
        if self.args.max_pixels is None and self.args.min_pixels is None:
            return
        raise ValueError(f"max_pixels / min_pixels apply to Qwen-VL models; drop them from --model_args of {self.model_id}.")

    def _wrap(self) -> Any:
        import vtprune

        return vtprune.wrap(self.model, self.args.prune)

    # -- lmms properties ------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        return self._model

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_size(self) -> int:
        return self.args.batch_size

    # -- requests -------------------------------------------------------------------------------------
    def _doc_images(self, doc_to_visual: Any, doc_id: int, task: str, split: str) -> list:
        if doc_to_visual is None:
            return []
        return flatten_visuals(doc_to_visual(self.task_dict[task][split][doc_id]))

    def _inputs(self, questions: list[str], images: list[list]) -> dict:
        model_type = self.model.config.model_type
        texts = [prompt_text(self.processor, model_type, q, len(imgs)) for q, imgs in zip(questions, images, strict=True)]
        flat = self._prepared([image for imgs in images for image in imgs])
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in encode(self.processor, texts, flat).items()}

    def _prepared(self, images: list) -> list:
        """The images as the processor gets them: padded to squares under ``image_aspect_ratio=pad`` (their
        original sizes go to the handle: attention debiasing's padding mask reads them)."""
        if self.args.image_aspect_ratio != "pad":
            return images
        self.handle.set_image_sizes([(image.height, image.width) for image in images])
        return pad_to_square(self.processor, images)

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult | str]:
        """Batched greedy (or sampled, if the task asks) generation with pruning; stats logged at the end."""
        results: list[GenerationResult | str] = [""] * len(requests)
        work = [(i, req.args[0], req.args[1]) for i, req in enumerate(requests)
                if not (req.metadata or {}).get(PADDING_FLAG)]
        stats = RunStats()
        progress = tqdm(total=len(work), disable=self._rank != 0, desc=f"{self.model_id} responding")
        for batch in batches(work, self.batch_size):
            answers = self._generate_batch([requests[i] for i, _, _ in batch], batch[0][2], stats)
            for (index, _, _), answer in zip(batch, answers, strict=True):
                results[index] = answer
            progress.update(len(batch))
        progress.close()
        log_run_stats(stats, self.batch_size, f"{self.model_id} {self.args.describe()}")
        return results

    @torch.inference_mode()
    def _generate_batch(self, batch: list[Instance], gen_kwargs: dict, stats: RunStats) -> list[GenerationResult]:
        questions = [clean_context(req.args[0]) for req in batch]
        images = [self._doc_images(req.args[2], *req.args[3:6]) for req in batch]
        inputs = self._inputs(questions, images)
        options, until = generation_options(gen_kwargs, self._pad_token_id())
        before = self.handle.last_stats
        start = time.perf_counter()
        output = self.model.generate(**inputs, **options)
        elapsed = time.perf_counter() - start
        prompt_length = inputs["input_ids"].shape[1]
        new_tokens = output[:, prompt_length:]
        texts = self.processor.batch_decode(new_tokens, skip_special_tokens=True)
        counts = self._generated_counts(new_tokens)
        call_stats = self.handle.last_stats
        stats.add_call(call_stats if call_stats is not before else None, len(batch), sum(counts), elapsed)
        input_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        return [GenerationResult(cut_at_stop(text, until), TokenCounts(int(n_in), int(n_out)))
                for text, n_in, n_out in zip(texts, input_tokens, counts, strict=True)]

    def _pad_token_id(self) -> int | None:
        tokenizer = self.tokenizer
        pad = getattr(tokenizer, "pad_token_id", None)
        return pad if pad is not None else getattr(tokenizer, "eos_token_id", None)

    def _generated_counts(self, new_tokens: torch.Tensor) -> list[int]:
        """Generated tokens per row, up to and including the first end-of-sequence token."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        counts = []
        for row in new_tokens.tolist():
            counts.append(row.index(eos) + 1 if eos is not None and eos in row else len(row))
        return counts

    def loglikelihood(self, requests: list[Instance]) -> list[ll.LoglikelihoodResult]:
        """``(score, continuation is greedy)`` per request, one at a time.

        ``score`` is, by default (``loglikelihood=loss``), the mean negative log-likelihood per continuation
        token: lmms-eval's own models return that and its ``multiple_choice`` scoring takes the argmin (a log
        probability there would pick the least likely answer). ``loglikelihood=logprob`` returns
        ``log p(continuation | context, images)`` (summed), as lmms-eval's API docstring describes. Each pair is
        a :class:`~vtprune.eval.lmms_plugin.loglikelihood.LoglikelihoodResult` (lmms-eval 0.7.3 turns plain
        tuples into strings); it unpacks like the pair.
        """
        results: list[ll.LoglikelihoodResult] = []
        stats = RunStats()
        for req in tqdm(requests, disable=self._rank != 0, desc=f"{self.model_id} loglikelihood"):
            if (req.metadata or {}).get(PADDING_FLAG):
                results.append(ll.result(0.0, False))
                continue
            results.append(self._loglikelihood_one(req, stats))
        log_run_stats(stats, 1, f"{self.model_id} {self.args.describe()} loglikelihood")
        return results

    @torch.inference_mode()
    def _loglikelihood_one(self, req: Instance, stats: RunStats) -> ll.LoglikelihoodResult:
        context, target, doc_to_visual, doc_id, task, split = req.args
        doc = self.task_dict[task][split][doc_id]
        continuation = target if isinstance(target, str) else target(doc)
        images = self._doc_images(doc_to_visual, doc_id, task, split)
        question = clean_context(context)
        prompt = self._inputs([question], [images])
        full_text = prompt_text(self.processor, self.model.config.model_type, question, len(images)) + continuation
        full = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in encode(self.processor, [full_text], self._prepared(images)).items()}
        n_cont = full["input_ids"].shape[1] - prompt["input_ids"].shape[1]
        if n_cont <= 0:
            raise ValueError(f"continuation {continuation!r} adds no tokens to the prompt of doc {doc_id} of {task}.")
        before = self.handle.last_stats
        start = time.perf_counter()
        logits = self._continuation_logits(full, n_cont)
        elapsed = time.perf_counter() - start
        target_ids = full["input_ids"][:, -n_cont:]
        logprob = float(torch.log_softmax(logits, dim=-1).gather(-1, target_ids.unsqueeze(-1)).sum())
        call_stats = self.handle.last_stats
        stats.add_call(call_stats if call_stats is not before else None, 1, 0, elapsed)
        greedy = bool((logits.argmax(-1) == target_ids).all())
        return ll.result(ll.score(logprob, n_cont, self.args.loglikelihood), greedy)

    def _continuation_logits(self, full: dict, n_cont: int) -> torch.Tensor:
        """Logits ``[1, n_cont, V]`` predicting the continuation: the prompt is prefilled (and pruned) first,
        then the continuation is fed through the KV cache, exactly as ``generate`` would see it (pruning
        decisions come from the prompt's last token, not from the continuation, so every candidate answer of a
        question is scored on the same kept tokens). One request, no padding: ``out.logits[:, -1]`` is the
        prompt's last token in either logits layout, and the continuation's rows are never pruned. Tested
        against ``tests/independent_reference.py`` (``test_loglikelihood_equals_the_independent_reference``)."""
        length = full["input_ids"].shape[1] - n_cont
        prompt = {k: v[:, :length] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
                  for k, v in full.items()}
        ids = full["input_ids"][:, length:]
        step = {"input_ids": ids, "attention_mask": full["attention_mask"]}
        backbone = getattr(self.model, "model", None)
        if "mm_token_type_ids" in full and hasattr(backbone, "get_rope_index"):
            # Qwen-VL: 3-D M-RoPE positions of the whole sequence, split between prefill and continuation.
            positions, _ = backbone.get_rope_index(
                full["input_ids"], full["mm_token_type_ids"], image_grid_thw=full.get("image_grid_thw"),
                attention_mask=full["attention_mask"])
            prompt["position_ids"], step["position_ids"] = positions[..., :length], positions[..., length:]
            step["mm_token_type_ids"] = full["mm_token_type_ids"][:, length:]
        out = self.model(**prompt, use_cache=True)
        step["cache"] = out.cache
        rest = self.model(**step).logits
        return torch.cat([out.logits[:, -1:], rest[:, :-1]], dim=1).float()

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError(
            f"{self.model_id} does not implement generate_until_multi_round: later rounds would add images to a "
            "KV cache that vtprune already pruned. Evaluate single-round (generate_until / loglikelihood) tasks."
        )


class VTPruneLlava(VTPruneModel):
    """``--model vtprune_llava``: LLaVA-1.5, LLaVA-NeXT and LLaVA-OneVision Hugging Face checkpoints."""

    model_id = "vtprune_llava"
    families = tuple(t for t, adapter in ADAPTERS.items() if adapter.family == "llava")
    other_model = "vtprune_qwen_vl"


class VTPruneQwenVL(VTPruneModel):
    """``--model vtprune_qwen_vl``: Qwen2-VL, Qwen2.5-VL and Qwen3-VL Hugging Face checkpoints."""

    model_id = "vtprune_qwen_vl"
    families = tuple(t for t, adapter in ADAPTERS.items() if adapter.family == "qwen")
    other_model = "vtprune_llava"

    def _set_pixels(self, processor: Any) -> None:
        """Apply ``min_pixels`` / ``max_pixels`` to the image processor (its ``size`` edges)."""
        image_processor = processor.image_processor
        size = dict(getattr(image_processor, "size", None) or {})
        if self.args.min_pixels is not None:
            size["shortest_edge"] = self.args.min_pixels
        if self.args.max_pixels is not None:
            size["longest_edge"] = self.args.max_pixels
        if size.get("shortest_edge", 0) > size.get("longest_edge", float("inf")):
            raise ValueError(f"min_pixels={size['shortest_edge']} exceeds max_pixels={size['longest_edge']}.")
        image_processor.size = size


OTHER_FAMILIES = {VTPruneLlava.model_id: VTPruneQwenVL.families, VTPruneQwenVL.model_id: VTPruneLlava.families}


def checkpoint_model_type(spec: str | None) -> str:
    """``config.model_type`` of a ``pretrained=`` value without loading weights."""
    from vtprune.models.loading import check_model_spec

    target = check_model_spec(spec)
    if target.startswith("tiny:"):
        return target.split(":", 1)[1]
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target).model_type
