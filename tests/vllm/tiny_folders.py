"""Tiny random-weight checkpoints of LLaVA-NeXT, LLaVA-OneVision and Qwen3-VL, saved with transformers'
``save_pretrained`` so that vLLM and vtprune's transformers path load the same weights.

The text models take the embedded models' sizes (hidden 192, 4 heads of 48: head sizes vLLM's CPU attention
supports; 2 decoder layers, or ``layers``) and tokenizers (the embedded LLaVA's for the LLaVA family, the embedded Qwen2-VL's for Qwen3-VL).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TEXT = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=48, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PINPOINTS = [[112, 224], [224, 112], [224, 224]]


def _copy_tokenizer(family: str, target: Path) -> dict:
    from vtprune.models.embedded import embedded_model_path

    source = embedded_model_path(family)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, target / name)
    return json.loads((source / "config.json").read_text())


def _save(model_cls, config, target: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random weights of a visible scale (the default init is near zero for some)
        for name, parameter in model.named_parameters():
            if "newline" in name:
                parameter.normal_(0.0, 1.0)
    model.save_pretrained(target)
    from vtprune.vllm.export import rename_in_place

    rename_in_place(target / "model.safetensors")  # the tower under vision_tower.vision_model. (llava-hf layout)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": config.text_config.eos_token_id}))


def _llava_parts(target: Path, text_cls: type, vision_cls: type, layers: int = 2, **vision_extra
                 ) -> tuple[dict, object, object]:
    """The embedded LLaVA's tokenizer copied into ``target`` (its config returned), a text config and a 2-layer
    vision config (112 px images, 28 px patches: a 4 x 4 base view) for a LLaVA-family checkpoint."""
    base = _copy_tokenizer("llava", target)
    text = text_cls(vocab_size=base["text_config"]["vocab_size"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
                    **dict(TEXT, num_hidden_layers=layers))
    vision = vision_cls(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        image_size=112, patch_size=28, **vision_extra)
    return base, text, vision


def _add_token(target: Path, token: str) -> int:
    """Add a special ``token`` to the folder's tokenizer (saved back); its id."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    tokenizer.save_pretrained(target)
    return tokenizer.convert_tokens_to_ids(token)


def _processor_parts(target: Path) -> dict:
    """The tokenizer and chat template of a folder, as processor keyword arguments."""
    from transformers import PreTrainedTokenizerFast

    return {"tokenizer": PreTrainedTokenizerFast.from_pretrained(target),
            "chat_template": (target / "chat_template.jinja").read_text()}


def llava_next_folder(target: Path, seed: int = 0, layers: int = 2) -> Path:
    """LLaVA-NeXT: CLIP 112 px / 28 px patches (16 base tokens), tiles of 112 px up to 2 x 2."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    base, text, vision = _llava_parts(target, LlamaConfig, CLIPVisionConfig, layers, hidden_act="quick_gelu")
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=base["image_token_index"],
                             vision_feature_layer=-1, vision_feature_select_strategy="default",
                             image_grid_pinpoints=PINPOINTS, tie_word_embeddings=False)
    _save(LlavaNextForConditionalGeneration, config, target, seed)
    images = LlavaNextImageProcessor(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112},
                                     image_grid_pinpoints=PINPOINTS)
    LlavaNextProcessor(image_processor=images, patch_size=28, image_token="<image>",
                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                       **_processor_parts(target)).save_pretrained(target)
    return target


def llava_onevision_folder(target: Path, seed: int = 0, layers: int = 2) -> Path:
    """LLaVA-OneVision: SigLIP 112 px / 28 px patches (16 base tokens), anyres tiles up to 2 x 1 (never downsized)."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        Qwen2Config,
        SiglipVisionConfig,
    )

    base, text, vision = _llava_parts(target, Qwen2Config, SiglipVisionConfig, layers)
    video_token = _add_token(target, "<video>")  # the embedded tokenizer has no video token
    text.vocab_size = video_token + 1
    pinpoints = [[112, 112], [112, 224], [224, 112]]
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_id=base["image_token_index"],
                                  video_token_id=video_token, vision_feature_layer=-1, vision_feature_select_strategy="full",
                                  image_grid_pinpoints=pinpoints, tie_word_embeddings=False)
    _save(LlavaOnevisionForConditionalGeneration, config, target, seed)
    images = LlavaOnevisionImageProcessor(size={"height": 112, "width": 112}, image_grid_pinpoints=pinpoints)
    LlavaOnevisionProcessor(
        image_processor=images, image_token="<image>", video_token="<video>",
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 112, "width": 112}),
        vision_feature_select_strategy="full", num_image_tokens=16, **_processor_parts(target)).save_pretrained(target)
    return target


def qwen3_vl_folder(target: Path, seed: int = 0, layers: int = 2) -> Path:
    """Qwen3-VL: 2 ViT blocks (16 px patches, 2 x 2 merge) with DeepStack after both, interleaved M-RoPE."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    base = _copy_tokenizer("qwen2_vl", target)
    text = dict(TEXT, vocab_size=base["text_config"]["vocab_size"], pad_token_id=0, bos_token_id=1,
                eos_token_id=base["eos_token_id"], num_hidden_layers=layers,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 8, 8],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=192, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256,
                  deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh", in_channels=3)
    ids = {k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    _save(Qwen3VLForConditionalGeneration, config, target, seed)
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
                    "temporal_patch_size": 2, "size": {"shortest_edge": 4096, "longest_edge": 65536},
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
                    "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
                    "rescale_factor": 1 / 255, "processor_class": "Qwen3VLProcessor"}
    (target / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return target


def qwen2_5_vl_folder(target: Path, seed: int = 0, layers: int = 2) -> Path:
    """Qwen2.5-VL: 2 ViT blocks (14 px patches, 2 x 2 merge), block 0 full attention and block 1 in windows of
    2 x 2 merged tokens (56 px), so a 112 px image's blocks see its tokens in window order, not token order."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    base = _copy_tokenizer("qwen2_vl", target)
    text = dict(TEXT, vocab_size=base["text_config"]["vocab_size"], pad_token_id=0, bos_token_id=1,
                eos_token_id=base["eos_token_id"], num_hidden_layers=layers,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 8, 8]})
    vision = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=192, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0],
                  hidden_act="silu", in_channels=3)
    ids = {k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    _save(Qwen2_5_VLForConditionalGeneration, config, target, seed)
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
                    "temporal_patch_size": 2, "size": {"shortest_edge": 3136, "longest_edge": 65536},
                    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "resample": 3,
                    "rescale_factor": 1 / 255, "processor_class": "Qwen2_5_VLProcessor"}
    (target / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return target


BUILDERS = {"llava_next": llava_next_folder, "llava_onevision": llava_onevision_folder, "qwen3_vl": qwen3_vl_folder,
            "qwen2_5_vl": qwen2_5_vl_folder}
