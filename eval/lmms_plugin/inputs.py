"""Turn lmms-eval requests into processor inputs: visuals, chat-template prompts, batches, stop strings.

Prompts go through the processor's own chat template with one ``{"type": "image"}`` entry per image
followed by the request's text, exactly as :func:`vtprune.models.pipeline.build_inputs` does for one image, so a
run here and ``vtprune bench`` feed the model the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from PIL import Image

IMAGE_PLACEHOLDERS = ("<image>", "<video>")
DEFAULT_MAX_NEW_TOKENS = 128


def flatten_visuals(visuals: Any) -> list[Image.Image]:
    """The PIL images of one document's ``doc_to_visual`` output (nested lists flattened, ``None`` dropped).

    Raises ``NotImplementedError`` for video paths / audio dicts: this plugin feeds images (a clip can be
    given as a list of frames, as the ``vtprune_shapes_video`` task does).
    """
    if visuals is None:
        return []
    if isinstance(visuals, Image.Image):
        from vtprune.media.images import to_rgb

        return [to_rgb(visuals)]  # EXIF orientation applied, 16-bit greyscale scaled (not clipped to white)
    if isinstance(visuals, (str, dict)):
        raise NotImplementedError(
            f"the vtprune lmms-eval models take images (PIL) and lists of frames, got {type(visuals).__name__} "
            f"{str(visuals)[:80]!r}; video files and audio are not supported yet: decode the frames in the "
            "task's doc_to_visual."
        )
    images: list[Image.Image] = []
    for item in visuals:
        images.extend(flatten_visuals(item))
    return images


def clean_context(context: str) -> str:
    """The request text without ``<image>`` / ``<video>`` placeholders (images are added by the template)."""
    for placeholder in IMAGE_PLACEHOLDERS:
        context = context.replace(placeholder, "")
    return context.strip()


def prompt_text(processor: Any, model_type: str, question: str, n_images: int) -> str:
    """The generation prompt for ``question`` about ``n_images`` images (chat template when there is one)."""
    if getattr(processor, "chat_template", None):
        content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": question}]
        messages = [{"role": "user", "content": content}]
        return processor.apply_chat_template(messages, add_generation_prompt=True)
    from vtprune.models.tiny import prompt_for

    return prompt_for(model_type, question, images=n_images)


def expand2square(image: Image.Image, background: tuple[int, ...]) -> Image.Image:
    """``image`` centred on a square canvas of its longer side filled with ``background`` (LLaVA-1.5's
    ``expand2square``: the offset on the short axis is ``(long - short) // 2``); a square image is returned as is."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    canvas = Image.new(image.mode, (side, side), background)
    canvas.paste(image, ((side - width) // 2, (side - height) // 2))
    return canvas


def pad_to_square(processor: Any, images: list[Image.Image]) -> list[Image.Image]:
    """``images`` padded to squares with the image processor's mean colour (``int(255 * mean)`` per channel),
    as LLaVA-1.5's evaluation prepares them (``process_images`` with ``image_aspect_ratio="pad"``)."""
    image_processor = getattr(processor, "image_processor", processor)
    mean = getattr(image_processor, "image_mean", None)
    if mean is None:
        raise ValueError(f"{type(image_processor).__name__} has no image_mean to pad with; use image_aspect_ratio=original.")
    background = tuple(int(value * 255) for value in mean)
    return [expand2square(image, background) for image in images]


def pil_image_processor(image_processor: Any) -> Any:
    """The PIL-backend twin of ``image_processor`` with the same settings (itself if it is one already).

    transformers 5 loads the torchvision image processor wherever torchvision is installed; its resize is not
    PIL's, which the original LLaVA code (and the papers' numbers) used. ``ValueError`` when transformers has no
    PIL twin of the class.
    """
    import transformers

    name = type(image_processor).__name__
    if name.endswith("Pil"):
        return image_processor
    twin = getattr(transformers, f"{name.removesuffix('Fast')}Pil", None)
    if twin is None:
        raise ValueError(f"transformers has no PIL image processor for {name}; drop image_backend=pil.")
    return twin.from_dict(image_processor.to_dict())


def encode(processor: Any, texts: list[str], images: list[Image.Image]) -> dict:
    """Left-padded processor outputs for ``texts`` (their placeholders consume ``images`` in order)."""
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True}
    if images:
        kwargs["images"] = images
    return dict(processor(**kwargs))


def batches(items: list[tuple[int, str, dict]], size: int) -> Iterable[list[tuple[int, str, dict]]]:
    """``(index, context, gen_kwargs)`` items in batches of ``size`` that share generation settings.

    Inside a group, longer contexts come first (less padding, out-of-memory errors show up at once).
    """
    groups: dict[str, list[tuple[int, str, dict]]] = {}
    for item in items:
        groups.setdefault(json.dumps(item[2], sort_keys=True, default=str), []).append(item)
    for group in groups.values():
        group.sort(key=lambda item: (-len(item[1]), item[0]))
        for start in range(0, len(group), size):
            yield group[start:start + size]


def generation_options(gen_kwargs: dict, pad_token_id: int | None) -> tuple[dict, list[str]]:
    """``(generate() keyword arguments, stop strings)`` from a task's ``generation_kwargs``.

    Greedy unless ``temperature > 0`` or ``do_sample``; ``max_new_tokens`` defaults to 128. Other keys
    (``image_aspect_ratio``, ...) are task hints for other models and are ignored.
    """
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or [])
    temperature = float(kwargs.get("temperature") or 0.0)
    do_sample = bool(kwargs.get("do_sample", False)) or temperature > 0
    options: dict[str, Any] = {
        "max_new_tokens": int(kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
        "do_sample": do_sample,
        "num_beams": int(kwargs.get("num_beams") or 1),
    }
    if do_sample:
        options["temperature"] = temperature if temperature > 0 else 1.0
        if kwargs.get("top_p") is not None:
            options["top_p"] = float(kwargs["top_p"])
    if pad_token_id is not None:
        options["pad_token_id"] = pad_token_id
    return options, [u for u in until if u]


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to the first stop string, stripped."""
    for stop in until:
        text = text.split(stop, 1)[0]
    return text.strip()
