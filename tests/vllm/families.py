"""The checks every pruned family must pass in vLLM (subclassed per family by test_llava.py / test_qwen.py).

Each class starts two engines, one after the other: stock vLLM (answers at keep 1.0 must equal it), then the
pruned model with prefix caching on and chunked prefill in tiny chunks. The expected answers and kept indices
come from vtprune's transformers path (tests/vllm/reference.py), not from the plugin.
"""

from __future__ import annotations

import pytest
import reference
from conftest import assert_same_answers, generate, make_llm, selections, shutdown


class FamilyChecks:
    family = ""
    options: dict = {}  # vtprune.wrap options that give the positions vLLM uses
    chunk = 4  # max_num_batched_tokens of the pruned engine
    engine_options: dict = {}  # further LLM(...) options of the pruned engine

    @pytest.fixture(scope="class")
    @classmethod
    def expected(cls, items):
        """vtprune's transformers path: unpruned, divprune 0.25 and 0.5 (token ids, kept indices)."""
        model, processor = reference.load(cls.family)
        out = {keep: reference.answers(model, processor, items, "divprune", keep, logprobs=True, **cls.options)
               for keep in (0.25, 0.5)}
        out[1.0] = reference.answers(model, processor, items, None, 1.0)
        return out

    @pytest.fixture(scope="class")
    @classmethod
    def stock(cls, items, expected):
        llm = make_llm(cls.family, pruned=False)
        try:
            return generate(llm, items)
        finally:
            shutdown(llm)

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, stock):
        llm = make_llm(cls.family, enable_prefix_caching=True, enable_chunked_prefill=True,
                       max_num_batched_tokens=cls.chunk, max_num_seqs=cls.chunk, block_size=32, **cls.engine_options)
        yield llm
        shutdown(llm)

    def test_equals_transformers_path(self, engine, items, stock, expected):
        selections(engine, clear=True)
        got = [generate(engine, [item], logprobs=5)[0] for item in items]  # alone: the first chunk ends as set
        assert selections(engine) == [row[1] for row in expected[0.25]]
        # the first step's log-probabilities too: they move when positions do (greedy answers may not)
        assert_same_answers(got, expected[0.25])
        assert [row[1] for row in got] == [row[1] - 12 for row in stock]  # 4 of 16 placeholders per image

    def test_keep_one_equals_stock(self, engine, items, stock):
        got = generate(engine, items, keeps=[1.0] * len(items))
        assert [(ids, length) for ids, length, _ in got] == [(ids, length) for ids, length, _ in stock]

    def test_mixed_batch(self, engine, items, stock, expected):
        keeps = [0.25, 1.0, 0.5, 0.25, 1.0, 0.5][:len(items)]
        got = generate(engine, items, keeps=keeps)
        want = [stock[i][0] if keep == 1.0 else expected[keep][i][0] for i, keep in enumerate(keeps)]
        assert [ids for ids, _, _ in got] == want
        assert len({length - stock[i][1] for i, (_, length, _) in enumerate(got) if keeps[i] == 0.25}) == 1

    def test_prefix_cache_two_keeps(self, engine, items):
        image, question = items[1]
        item = (image, " ".join([question] * 8))  # long enough to fill a 32-token block after the image
        first, full, again = (generate(engine, [item], keeps=[keep])[0] for keep in (0.25, 1.0, 0.25))
        model, processor = reference.load(self.family)
        want = {keep: reference.answers(model, processor, [item], "divprune", keep, **self.options)[0][0]
                for keep in (0.25, 1.0)}
        assert first[0] == again[0] == want[0.25]
        assert full[0] == want[1.0]
        assert full[1] - first[1] == 12  # 16 vs 4 placeholders
        assert again[2] >= 32  # the repeat hit the prefix cache (its own keep's blocks)

    def test_two_images_per_prompt(self, engine, items):
        """Each image keeps ``keep_count(keep, n_i)``; at 0.25 of two 16-token images that is also the transformers
        path's ``keep_count(keep, 32)``, so kept indices (over the prompt's 32 visual tokens) and answers agree."""
        item = ([items[0][0], items[1][0]], items[1][1])
        model, processor = reference.load(self.family)
        (want_ids, want_kept), = reference.answers(model, processor, [item], "divprune", 0.25, **self.options)
        selections(engine, clear=True)
        (ids, _, _), = generate(engine, [item])
        first, second = selections(engine)
        assert ids == want_ids
        assert first + [16 + i for i in second] == want_kept
        assert len(first) == len(second) == 4
        # where the two roundings differ (0.28: 4 + 4 per image, keep_count(0.28, 32) = 9 per prompt) the
        # transformers path gives one image a fifth pick; the plugin keeps each image's first four (a subset),
        # exactly the transformers path's rows under rounding="per_image" (the plugin's count), answers too
        (_, sample_kept), = reference.answers(model, processor, [item], "divprune", 0.28, max_new_tokens=1,
                                              **self.options)
        (want_ids, want_kept), = reference.answers(model, processor, [item], "divprune", 0.28, max_new_tokens=1,
                                                   rounding="per_image", **self.options)
        (ids, _, _), = generate(engine, [item], keeps=[0.28], max_tokens=1)
        first, second = selections(engine)[-2:]
        assert len(sample_kept) == 9 and len(first) == len(second) == 4
        assert set(first + [16 + i for i in second]) < set(sample_kept)
        assert first + [16 + i for i in second] == want_kept
        assert ids == want_ids
