"""Tiny random models of every supported family, built from configs with their real processors.

Used by the test suite and by ``vtprune run --model tiny:<model_type>``; nothing is downloaded.
"""

from __future__ import annotations

import functools

import torch
from PIL import Image

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "<video>", "<|im_start|>", "<|im_end|>",
                  "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_TYPES = ("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
LLAVA_PROMPT = "USER: <image>\n{question} ASSISTANT:"
QWEN_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in-process (vocab ~300), with the VLM special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["what color is the circle square triangle how many are there user assistant answer yes no"] * 4
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", unk_token="<unk>")
    wrapped.padding_side = "left"
    return wrapped


def _llama_text(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _token(name: str) -> int:
    return tiny_tokenizer().convert_tokens_to_ids(name)


def _llava(model_type: str, size: int):
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
    )

    tok = tiny_tokenizer()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=size, patch_size=14)
    common = dict(vision_config=vision, text_config=LlamaConfig(**_llama_text(len(tok))),
                  image_token_id=_token("<image>"), vision_feature_layer=-2,
                  vision_feature_select_strategy="default")
    crop = {"height": size, "width": size}
    if model_type == "llava":
        processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size=crop),
                                   tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1)
        return LlavaConfig(**common), LlavaForConditionalGeneration, processor
    pinpoints = [[size, 2 * size], [2 * size, size], [2 * size, 2 * size]]
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": size}, crop_size=crop,
                                              image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return LlavaNextConfig(**common, image_grid_pinpoints=pinpoints), LlavaNextForConditionalGeneration, processor


def _onevision(size: int):
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    class NoVideoProcessor(LlavaOnevisionProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    tok = tiny_tokenizer()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=size, patch_size=14)
    pinpoints = [[size, size], [size, 2 * size], [2 * size, size]]
    config = LlavaOnevisionConfig(vision_config=vision, text_config=Qwen2Config(**_llama_text(len(tok))),
                                  image_token_id=_token("<image>"), video_token_id=_token("<video>"),
                                  vision_feature_layer=-1, vision_feature_select_strategy="full",
                                  image_grid_pinpoints=pinpoints)
    image_processor = LlavaOnevisionImageProcessor(size={"height": size, "width": size},
                                                   image_grid_pinpoints=pinpoints)
    processor = NoVideoProcessor(image_processor=image_processor, tokenizer=tok, video_processor=None,
                                 vision_feature_select_strategy="full", num_image_tokens=(size // 14) ** 2)
    return config, LlavaOnevisionForConditionalGeneration, processor


def _qwen(model_type: str):
    import transformers as tf

    tok = tiny_tokenizer()
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    text = dict(_llama_text(len(tok)), rope_parameters=rope)
    ids = dict(image_token_id=_token("<|image_pad|>"), video_token_id=_token("<|video_pad|>"),
               vision_start_token_id=_token("<|vision_start|>"), vision_end_token_id=_token("<|vision_end|>"))
    patch = 16 if model_type == "qwen3_vl" else 14
    if model_type == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        names = ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor")
    elif model_type == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      window_size=56, fullatt_block_indexes=[1])
        names = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor")
    else:
        text = dict(text, head_dim=16, rope_parameters={**rope, "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, num_position_embeddings=256, deepstack_visual_indexes=[0, 1])
        names = ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor")
    config_cls, model_cls, processor_cls = (getattr(tf, n) for n in names)
    config = config_cls(text_config=text, vision_config=vision, **ids)
    image_processor = tf.Qwen2VLImageProcessor(patch_size=patch, merge_size=2,
                                               size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224})
    return config, model_cls, no_video_processor(processor_cls)(image_processor=image_processor, tokenizer=tok,
                                                                 video_processor=None)


def no_video_processor(processor_cls: type) -> type:
    """A processor subclass that accepts ``video_processor=None`` (Qwen video processors need torchvision)."""

    class NoVideo(processor_cls):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    NoVideo.__name__ = processor_cls.__name__
    return NoVideo


def tiny_model(model_type: str = "llava", attn_implementation: str = "sdpa", seed: int = 0, image_size: int = 56):
    """A random-weight model of ``model_type`` (4 decoder layers, hidden 64) and its processor, in eval mode."""
    if model_type in ("llava", "llava_next"):
        config, model_cls, processor = _llava(model_type, image_size)
    elif model_type == "llava_onevision":
        config, model_cls, processor = _onevision(image_size)
    elif model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        config, model_cls, processor = _qwen(model_type)
    else:
        raise ValueError(f"no tiny model for {model_type!r}; choose one of {', '.join(TINY_TYPES)}.")
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn_implementation).eval()
    return model, processor


def prompt_for(model_type: str, question: str, images: int = 1) -> str:
    """The plain prompt used with tiny models (no chat template needed)."""
    if model_type.startswith("qwen"):
        block = "<|vision_start|><|image_pad|><|vision_end|>" * images
        return f"<|im_start|>user\n{block}{question}<|im_end|>\n<|im_start|>assistant\n"
    return "USER: " + "<image>\n" * images + f"{question} ASSISTANT:"


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic noise image."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def tiny_inputs(processor, model_type: str, samples: list[tuple[str, list[Image.Image]]]) -> dict:
    """Processor outputs for ``[(question, [images...]), ...]`` (left padded), ready for the model."""
    texts = [prompt_for(model_type, question, len(images)) for question, images in samples]
    images = [image for _, imgs in samples for image in imgs]
    processor.tokenizer.padding_side = "left"
    return dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
