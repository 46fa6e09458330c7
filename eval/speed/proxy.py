"""Random-weight speed-proxy models and their ragged batches, for ``vtprune bench --speed``.

A proxy runs the real ``transformers`` code path (``LlavaForConditionalGeneration`` or
``Qwen2_5_VLForConditionalGeneration``) with a language model of realistic width/depth and a vision tower
kept tiny (one layer, 32-64 wide; Qwen's uses 224 px windowed attention only), so the language model dominates as
on a 7B model and no ``L x L`` matrix is built anywhere, also at 16,384 visual tokens.

Geometries (visual tokens per sample at batch 1; larger batches cycle ``samples``, so they are ragged):

* ``576``: LLaVA-1.5, one 336 px image (576 tokens); batch samples hold 1 or 2 images;
* ``2880``: LLaVA-NeXT-like, five 336 px images per sample (NeXT's base + 4 crops = 2,880 tokens before
  unpadding); batch samples hold 5, 4 or 3 images;
* ``2304`` / ``16384``: Qwen2.5-VL, one image of 48 x 48 / 128 x 128 merged tokens; batch images differ in size;
* ``video``: Qwen2.5-VL video of 32 temporal patches (64 frames) x 14 x 14 merged tokens = 6,272, the
  32 frames x 196 tokens of LLaVA-Video-style budgets; batch clips are shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TEXT_TOKENS = 48  # text around the visual tokens, special tokens included
LLAVA_IMAGE = 336  # px; 24 x 24 = 576 tokens with 14 px patches


@dataclass(frozen=True)
class LMGeometry:
    """Sizes of the proxy's language model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Geometry:
    """One benchmark geometry: the model family and each sample's visual layout (cycled for batches).

    ``samples``: LLaVA, images per sample (576 tokens each); Qwen image, merged ``(h, w)``; Qwen video,
    merged ``(t, h, w)``. ``samples[0]`` is the batch-1 case.
    """

    key: str
    name: str
    family: str
    kind: str
    samples: tuple

    def layout(self, batch: int) -> list:
        return [self.samples[i % len(self.samples)] for i in range(batch)]

    def visual_tokens(self, batch: int) -> list[int]:
        """``[B]`` visual tokens of each sample."""
        if self.family == "llava":
            return [n * (LLAVA_IMAGE // 14) ** 2 for n in self.layout(batch)]
        return [_prod(spec) for spec in self.layout(batch)]


def _prod(values: tuple) -> int:
    out = 1
    for v in values:
        out *= v
    return out


GEOMETRIES: dict[str, Geometry] = {g.key: g for g in (
    Geometry("576", "llava-1.5 (576)", "llava", "image", (1, 2, 1, 2, 1, 2, 1, 2)),
    Geometry("2880", "llava-next-like (2880)", "llava", "image", (5, 4, 3, 5, 4, 3, 5, 4)),
    Geometry("2304", "qwen2.5-vl (2304)", "qwen", "image",
             ((48, 48), (48, 36), (36, 36), (48, 24), (40, 40), (36, 48), (44, 44), (24, 32))),
    Geometry("16384", "qwen2.5-vl (16384)", "qwen", "image",
             ((128, 128), (128, 96), (96, 96), (128, 64), (112, 112), (96, 128), (120, 120), (64, 96))),
    Geometry("video", "qwen2.5-vl video (32x196)", "qwen", "video",
             ((32, 14, 14), (24, 14, 14), (16, 14, 14), (32, 14, 14), (28, 14, 14), (20, 14, 14),
              (32, 14, 14), (12, 14, 14))),
)}
ALIASES = {"2916": "2880", "6272": "video"}

SEVEN_B = {
    "llava": LMGeometry(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32064),
    "qwen": LMGeometry(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064),
}


def parse_geometries(spec: str) -> list[Geometry]:
    """Geometries named in a comma-separated ``spec`` (``576,2880,2304,16384,video`` or ``all``)."""
    keys = list(GEOMETRIES) if spec.strip() == "all" else [ALIASES.get(k.strip(), k.strip())
                                                            for k in spec.split(",") if k.strip()]
    unknown = [k for k in keys if k not in GEOMETRIES]
    if unknown or not keys:
        raise ValueError(f"--speed-tokens {spec!r}: unknown geometry {', '.join(unknown) or '(none)'}; use a "
                         f"comma-separated list of {', '.join(GEOMETRIES)} or 'all'.")
    return [GEOMETRIES[k] for k in keys]


def lm_geometry(family: str, preset: str, hidden: int, layers: int) -> LMGeometry:
    """The LM of ``family`` ("llava" / "qwen"): the 7B model's (``preset="7b"``) or a proxy of ``hidden x layers``.

    Proxies keep 64-wide heads, LLaVA's MHA and 2.75x MLP, Qwen's 4:1 grouped-query attention and 5.3x MLP,
    and a 1,024-token vocabulary.
    """
    if preset == "7b":
        return SEVEN_B[family]
    if preset != "proxy":
        raise ValueError(f"--speed-lm {preset!r}: use 'proxy' (--speed-hidden x --speed-layers) or '7b'.")
    if hidden % 64 or hidden < 64 or layers < 1:
        raise ValueError(f"--speed-hidden {hidden} / --speed-layers {layers}: the hidden size must be a positive "
                         "multiple of 64 (64-wide heads) and the model needs at least one layer.")
    heads = hidden // 64
    if family == "llava":
        return LMGeometry(hidden, layers, heads, heads, int(hidden * 2.75), 1024)
    ffn = max(64, round(hidden * 18944 / 3584 / 64) * 64)
    return LMGeometry(hidden, layers, heads, max(1, heads // 4), ffn, 1024)


def special_ids(lm: LMGeometry) -> dict[str, int]:
    """Token ids of the visual placeholders (at the top of the vocabulary) and padding."""
    top = lm.vocab - 24
    return {"image": top, "video": top + 1, "vision_start": top + 2, "vision_end": top + 3, "pad": 0}


def build_model(family: str, lm: LMGeometry, attn: str, dtype: torch.dtype, device: str):
    """A random-weight proxy of ``family`` with language model ``lm``, built directly on ``device``, eval mode."""
    ids = special_ids(lm)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

        text = LlamaConfig(vocab_size=lm.vocab, hidden_size=lm.hidden, intermediate_size=lm.intermediate,
                           num_hidden_layers=lm.layers, num_attention_heads=lm.heads,
                           num_key_value_heads=lm.kv_heads, max_position_embeddings=32768, pad_token_id=0)
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=LLAVA_IMAGE, patch_size=14)
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=ids["image"],
                             vision_feature_layer=-1, vision_feature_select_strategy="default")
        model_cls = LlavaForConditionalGeneration
    elif family == "qwen":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        head_dim = lm.hidden // lm.heads
        section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # 7B: [16, 24, 24] for 128
        section[0] += head_dim // 2 - sum(section)
        text = dict(vocab_size=lm.vocab, hidden_size=lm.hidden, intermediate_size=lm.intermediate,
                    num_hidden_layers=lm.layers, num_attention_heads=lm.heads, num_key_value_heads=lm.kv_heads,
                    max_position_embeddings=65536, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=lm.hidden,
                      window_size=224, fullatt_block_indexes=[], patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                                  video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                                  vision_end_token_id=ids["vision_end"])
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        raise ValueError(f"unknown proxy family {family!r}; use 'llava' or 'qwen'.")
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls._from_config(config, attn_implementation=attn, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return model.eval()


def _text(generator: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(2, min(900, vocab - 100), (n,), generator=generator)


def batch_inputs(model, geometry: Geometry, batch: int, lm: LMGeometry, device: str) -> dict:
    """Left-padded inputs of ``batch`` samples laid out by ``geometry`` (ids ``[B, L]``, pixels, grids)."""
    generator = torch.Generator().manual_seed(0)
    ids = special_ids(lm)
    dtype = next(model.parameters()).dtype
    rows, types, pixels, grids = [], [], [], []
    for spec in geometry.layout(batch):
        prefix, suffix = _text(generator, 8, lm.vocab), _text(generator, TEXT_TOKENS - 10, lm.vocab)
        if geometry.family == "llava":
            visual = torch.full((spec * (LLAVA_IMAGE // 14) ** 2,), ids["image"])
            pixels.append(torch.randn(spec, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=generator))
            row = torch.cat([prefix, visual, _text(generator, 2, lm.vocab), suffix])
            kind = torch.zeros_like(row)
        else:
            t, h, w = (1, *spec) if geometry.kind == "image" else spec
            token = ids["image"] if geometry.kind == "image" else ids["video"]
            visual = torch.full((t * h * w,), token)
            row = torch.cat([prefix, torch.tensor([ids["vision_start"]]), visual, torch.tensor([ids["vision_end"]]),
                             suffix])
            kind = (row == token).long() * (1 if geometry.kind == "image" else 2)
            patches = t * (2 * h) * (2 * w)  # each row: 2 frames x 14 x 14 px x 3 channels
            pixels.append(torch.randn(patches, 3 * 2 * 14 * 14, generator=generator))
            grids.append([t, 2 * h, 2 * w])
        rows.append(row)
        types.append(kind)
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    token_types = torch.zeros(batch, length, dtype=torch.long)
    for b, (row, kind) in enumerate(zip(rows, types)):
        input_ids[b, length - len(row):] = row
        mask[b, length - len(row):] = 1
        token_types[b, length - len(row):] = kind
    out = {"input_ids": input_ids, "attention_mask": mask}
    if geometry.family == "llava":
        out["pixel_values"] = torch.cat(pixels).to(dtype)
    else:
        key = "" if geometry.kind == "image" else "_videos"
        out[f"pixel_values{key}"] = torch.cat(pixels).to(dtype)
        out[f"{geometry.kind}_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        if _accepts(model, "mm_token_type_ids"):
            out["mm_token_type_ids"] = token_types
    return {k: v.to(device) for k, v in out.items()}


def _accepts(model, name: str) -> bool:
    import inspect

    return name in inspect.signature(model.forward).parameters


def text_tokens(inputs: dict, model) -> list[int]:
    """``[B]`` valid non-visual tokens of each sample."""
    config = model.config
    visual = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    for name in ("image_token_id", "video_token_id"):
        token = getattr(config, name, None)
        if token is not None:
            visual |= inputs["input_ids"] == token
    return (inputs["attention_mask"].bool() & ~visual).sum(dim=1).tolist()
