"""The vtprune-shapes generator: determinism, answer correctness, evidence tokens and balance."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from vtprune.shapes import task as S
from vtprune.shapes import video as V

CFG = S.ShapesConfig()
SAMPLES = S.make_split("val", 120, CFG)


def _pixels(sample: S.ImageSample) -> np.ndarray:
    return np.asarray(sample.image, dtype=np.int32)


def _color_fraction(img: np.ndarray, box: S.Box, color: str) -> float:
    """Fraction of the box's pixels within jitter distance of the palette colour."""
    x0, y0, x1, y1 = box
    patch = img[y0:y1, x0:x1].reshape(-1, 3)
    dist = np.abs(patch - np.array(S.PALETTE[color])).max(axis=1)
    return float((dist <= CFG.color_jitter + 2).mean())


def test_same_seed_same_sample() -> None:
    a, b = S.generate_image_sample(7, 3, CFG), S.generate_image_sample(7, 3, CFG)
    assert np.array_equal(_pixels(a), _pixels(b))
    assert a.questions == b.questions and a.objects == b.objects


def test_splits_are_disjoint() -> None:
    hashes = {}
    for split in ("train", "val", "test", "calib"):
        hashes[split] = {_pixels(s).tobytes().__hash__() for s in S.make_split(split, 30, CFG)}
        assert len(hashes[split]) == 30
    names = list(hashes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not hashes[a] & hashes[b], (a, b)
    with pytest.raises(ValueError):
        S.make_split("dev", 1, CFG)


def test_objects_in_one_quadrant_and_disjoint() -> None:
    half = CFG.image_size / 2
    for s in SAMPLES:
        boxes = [o.box for o in s.shapes] + [s.number_box]
        for x0, y0, x1, y1 in boxes:
            assert (x1 <= half or x0 >= half) and (y1 <= half or y0 >= half)
            assert 0 <= x0 < x1 <= CFG.image_size and 0 <= y0 < y1 <= CFG.image_size
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def test_answers_match_rendered_scene() -> None:
    for s in SAMPLES:
        img = _pixels(s)
        shapes = s.shapes
        for q in s.questions:
            if q.qtype in ("color", "shape", "where"):
                (o,) = [o for o in shapes if o.box == q.boxes[0]]
                assert _color_fraction(img, o.box, o.color) > 0.3, (q, o)
                want = {"color": o.color, "shape": o.shape, "where": o.quadrant}[q.qtype]
                assert q.answer == want
                assert o.shape in q.text or o.color in q.text
            if q.qtype == "where":
                x0, y0, x1, y1 = q.boxes[0]
                v = "top" if y1 <= CFG.image_size / 2 else "bottom"
                h = "left" if x1 <= CFG.image_size / 2 else "right"
                assert q.answer == f"{v}-{h}"
            if q.qtype == "count":
                shape = next(k for k, p in S.PLURALS.items() if f" {p} " in q.text)
                assert q.answer == str(sum(o.shape == shape for o in shapes)) == str(len(q.boxes))
            if q.qtype == "exists":
                col, shp = q.text[:-1].split()[-2:]
                present = any(o.color == col and o.shape == shp for o in shapes)
                assert q.answer == ("yes" if present else "no")
            if q.qtype == "read":
                assert q.answer == s.number and 2 <= len(s.number) <= 3
                x0, y0, x1, y1 = q.boxes[0]
                region = img[y0:y1, x0:x1]
                assert ((region.max(axis=2) < 40) | (region.min(axis=2) > 230)).mean() > 0.15


def test_evidence_mask_covers_object() -> None:
    grid, patch = CFG.image_size // 14, 14
    for s in SAMPLES[:40]:
        for q in s.questions:
            m = S.evidence_mask(q.boxes, CFG.image_size, grid, grid)
            assert m.shape == (grid * grid,) and m.dtype == bool
            if not q.boxes:
                assert not m.any()
                continue
            assert m.any()
            for idx in np.flatnonzero(m):
                r, c = divmod(int(idx), grid)
                px = (c * patch, r * patch, (c + 1) * patch, (r + 1) * patch)
                assert any(px[0] < b[2] and b[0] < px[2] and px[1] < b[3] and b[1] < px[3] for b in q.boxes)


def test_evidence_mask_row_major_and_threshold() -> None:
    m = S.evidence_mask([(14, 0, 28, 14)], 112, 8, 8)
    assert np.flatnonzero(m).tolist() == [1]
    m = S.evidence_mask([(0, 14, 14, 28)], (112, 112), 8, 8)
    assert np.flatnonzero(m).tolist() == [8]
    assert not S.evidence_mask([(0, 0, 3, 3)], 112, 8, 8, min_cover=0.25).sum() > 1


def test_question_type_balance() -> None:
    per_type = collections.Counter(q.qtype for s in SAMPLES for q in s.questions)
    assert set(per_type) == set(S.QTYPES)
    assert min(per_type.values()) >= 0.9 * len(SAMPLES)
    ans = collections.Counter((q.qtype, q.answer) for s in SAMPLES for q in s.questions)
    yes, no = ans[("exists", "yes")], ans[("exists", "no")]
    assert abs(yes - no) <= 0.25 * (yes + no)
    assert all(ans[("count", c)] > 0 for c in S.COUNT_ANSWERS)
    assert all(ans[("where", w)] > 0.1 * len(SAMPLES) for w in S.QUADRANTS)
    assert all(ans[("color", c)] > 0 for c in S.COLORS)


def test_hard_negatives_dominate() -> None:
    hard = total = 0
    for s in S.make_split("calib", 200, CFG):
        cols, shps = {o.color for o in s.shapes}, {o.shape for o in s.shapes}
        for q in s.questions:
            if q.qtype == "exists" and q.answer == "no":
                col, shp = q.text[:-1].split()[-2:]
                total += 1
                hard += col in cols and shp in shps
    assert hard / total > 0.6


def test_write_split(tmp_path) -> None:
    path = S.write_split(tmp_path, "test", 3, CFG)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {"id", "image", "question", "answer", "qtype", "boxes"} <= set(rows[0])
    assert len({r["id"] for r in rows}) == len(rows)
    assert all((tmp_path / r["image"]).is_file() for r in rows)
    first = S.make_split("test", 1, CFG)[0]
    assert rows[0]["question"] == first.questions[0].text and rows[0]["answer"] == first.questions[0].answer


def test_video_sample_evidence_frames() -> None:
    from vtprune.shapes.video import make_video_split

    a, b = V.generate_video_sample(11, 2, CFG), V.generate_video_sample(11, 2, CFG)
    assert a.questions == b.questions
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a.frames, b.frames, strict=True))
    for clip in make_video_split("test", 6, CFG):
        lo, hi = CFG.video_frames
        assert lo <= len(clip.frames) <= hi
        for q in clip.questions:
            assert q.text.endswith(S.VIDEO_SUFFIX) and q.answer in S.OPTION_LETTERS
            option = q.text.split(f" {q.answer}. ")[1].split()[0]
            assert option in (S.COLORS if q.qtype == "color" else S.SHAPES)
            assert 2 <= len(q.frames) <= 4 and q.frames == list(range(q.frames[0], q.frames[-1] + 1))
        color = clip.questions[1].text.split("the ")[1].split()[0]
        box = clip.questions[0].boxes[0]
        for t, frame in enumerate(clip.frames):
            visible = _color_fraction(np.asarray(frame, dtype=np.int32), box, color) > 0.3
            assert visible == (t in clip.questions[0].frames), t


def test_open_form_of_a_clip_question() -> None:
    from vtprune.shapes.video import open_form

    for index in range(5):
        clip = V.generate_video_sample(S.SPLIT_SEEDS["test"], index)
        for q in clip.questions:
            text, word = open_form(q)
            assert text.endswith("that appears in the video?") and "A." not in text
            assert f"{q.answer}. {word}" in q.text
