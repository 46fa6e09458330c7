"""The embedded LLaVA in vLLM with the plugin: compact positions, equal to vtprune's positions="compact"."""

import reference
import torch
from conftest import chat_prompt
from families import FamilyChecks


class TestLlava(FamilyChecks):
    family = "llava"
    options = {"positions": "compact"}
    chunk = 4  # the first chunk ends two tokens into the image
    engine_options = {"enable_mm_embeds": True}

    def test_image_embeddings_are_pruned_as_pixels_are(self, engine, items, stock, expected):
        """A request with precomputed image embeddings (``[1, n, D]``, the projector's output) gets the same
        kept rows and answer as its pixels: the keep field travels with embedding items too."""
        from vllm import SamplingParams

        model, processor = reference.load(self.family)
        requests = []
        for image, question in items[:3]:
            pixels = processor(images=image, text=reference.prompt(processor, question), return_tensors="pt")
            with torch.no_grad():
                features = model.model.get_image_features(pixel_values=pixels["pixel_values"])
            features = getattr(features, "pooler_output", features)
            rows = (torch.cat(list(features)) if isinstance(features, list | tuple) else features).reshape(16, -1)
            requests.append({"prompt": chat_prompt(engine, question), "multi_modal_data": {"image": rows[None]}})
        outputs = engine.generate(requests, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [ids for ids, _, _ in expected[0.25][:3]]
        assert [len(o.prompt_token_ids) for o in outputs] == [row[1] - 12 for row in stock[:3]]  # 4 of 16 rows
