"""The dense task version (224 px, 6-12 objects, one digit per patch, 3x3 ``where3``): every answer is
checked against the rendered pixels, read back by small decoders written here (not the generator's data)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from vtprune.shapes import dense as D
from vtprune.shapes import task as S

CFG = D.DenseConfig()
SAMPLES = D.make_dense_split("val", 60, CFG)
EDGES = (0, 224 / 3, 2 * 224 / 3, 224)


def _pixels(sample: S.ImageSample) -> np.ndarray:
    return np.asarray(sample.image, dtype=np.int32)


def _color_mask(img: np.ndarray, box: S.Box, color: str) -> np.ndarray:
    x0, y0, x1, y1 = box
    return np.abs(img[y0:y1, x0:x1] - np.array(S.PALETTE[color])).max(axis=2) <= CFG.color_jitter + 2


def _color_at(img: np.ndarray, box: S.Box) -> str:
    """The palette colour covering most of the box."""
    return max(S.COLORS, key=lambda c: _color_mask(img, box, c).mean())


def _shape_at(img: np.ndarray, box: S.Box) -> str:
    """Shape read from the fill pattern of the box's dominant colour."""
    m = _color_mask(img, box, _color_at(img, box))
    h, w = m.shape
    if m.mean() > 0.9:
        return "square"
    if m[-2].mean() > 0.75 and m[1].mean() < 0.4:
        return "triangle"
    return "circle" if m[h // 5, w // 5] else "cross"  # a circle covers this near-corner point, a cross not


SEGMENT_PROBES = {  # (x, y) as fractions of the digit box: the middle of each segment
    "a": (0.5, 0.04), "b": (0.93, 0.27), "c": (0.93, 0.73), "d": (0.5, 0.96),
    "e": (0.07, 0.73), "f": (0.07, 0.27), "g": (0.5, 0.5),
}


def _read_digit(img: np.ndarray, box: S.Box) -> str:
    """Decode a seven-segment digit from the pixels: which segments carry ink (near-black or near-white)."""
    x0, y0, x1, y1 = box
    region = img[y0:y1, x0:x1]
    ink = (region.max(axis=2) < 40) | (region.min(axis=2) > 230)
    h, w = ink.shape
    lit = {s for s, (fx, fy) in SEGMENT_PROBES.items() if ink[min(h - 1, int(fy * h)), min(w - 1, int(fx * w))]}
    (digit,) = [d for d, segs in S.DIGIT_SEGMENTS.items() if set(segs) == lit]
    return digit


def _cell_of_pixels(mask: np.ndarray, box: S.Box) -> str:
    """3x3 cell name from the object's painted pixels (all of them must lie in that one cell)."""
    ys, xs = np.nonzero(mask)
    xs, ys = xs + box[0], ys + box[1]
    col = {int(np.searchsorted(EDGES, x, side="right")) - 1 for x in (xs.min(), xs.max())}
    row = {int(np.searchsorted(EDGES, y, side="right")) - 1 for y in (ys.min(), ys.max())}
    assert len(col) == 1 and len(row) == 1, "object straddles two cells"
    names = [["top-left", "top", "top-right"], ["left", "center", "right"], ["bottom-left", "bottom", "bottom-right"]]
    return names[row.pop()][col.pop()]


def test_same_seed_same_sample_and_curriculum_changes_it() -> None:
    a, b = D.generate_dense_sample(7, 3, CFG), D.generate_dense_sample(7, 3, CFG)
    assert np.array_equal(_pixels(a), _pixels(b)) and a.questions == b.questions and a.objects == b.objects
    easy = D.generate_dense_sample(7, 3, CFG, difficulty=0.0)
    assert not np.array_equal(_pixels(a), _pixels(easy))
    counts = [len(D.generate_dense_sample(5, i, CFG, difficulty=0.0).shapes) for i in range(40)]
    assert max(counts) <= CFG.easy_objects[1] and min(counts) >= CFG.easy_objects[0] - 1


def test_splits_disjoint_from_each_other_and_from_the_first_version() -> None:
    seen: dict[int, str] = {}
    for split in ("train", "val", "test", "calib"):
        for s in D.make_dense_split(split, 20, CFG):
            key = hash(_pixels(s).tobytes())
            assert key not in seen, (split, seen.get(key))
            seen[key] = split
    v1 = S.generate_image_sample(S.SPLIT_SEEDS["val"], 0, S.ShapesConfig(image_size=224))
    assert hash(_pixels(v1).tobytes()) not in seen
    with pytest.raises(ValueError):
        D.make_dense_split("dev", 1, CFG)


def test_scene_density_and_layout() -> None:
    for s in SAMPLES:
        assert CFG.objects[0] - 1 <= len(s.shapes) <= CFG.objects[1]
        boxes = [o.box for o in s.objects]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
    assert np.mean([len(s.shapes) for s in SAMPLES]) > 8


def test_color_shape_count_exists_answers_match_pixels() -> None:
    for s in SAMPLES:
        img = _pixels(s)
        seen = [(_color_at(img, o.box), _shape_at(img, o.box)) for o in s.shapes]
        assert seen == [(o.color, o.shape) for o in s.shapes]  # the decoders agree with the scene
        for q in s.questions:
            if q.qtype == "color":
                assert [_color_at(img, b) for b in q.boxes] == [q.answer]
                assert [sh for _, sh in seen].count(q.text.split()[-1].rstrip("?")) == 1
            if q.qtype == "shape":
                assert [_shape_at(img, b) for b in q.boxes] == [q.answer]
                assert [c for c, _ in seen].count(q.text.split()[4]) == 1
            if q.qtype == "count":
                shape = next(k for k, p in S.PLURALS.items() if f" {p} " in q.text)
                assert q.answer == str(sum(sh == shape for _, sh in seen)) == str(len(q.boxes))
                assert all(_shape_at(img, b) == shape for b in q.boxes)
            if q.qtype == "exists":
                col, shp = q.text[:-1].split()[-2:]
                assert q.answer == ("yes" if (col, shp) in seen else "no")
                assert q.boxes and all(_color_at(img, b) == col or _shape_at(img, b) == shp for b in q.boxes)


def test_where3_answer_is_the_cell_of_the_painted_object() -> None:
    answers = collections.Counter()
    for s in SAMPLES:
        img = _pixels(s)
        for q in s.questions:
            if q.qtype == "where3":
                col, shp = q.text[:-1].split()[-2:]
                matches = [o.box for o in s.shapes if (_color_at(img, o.box), _shape_at(img, o.box)) == (col, shp)]
                assert matches == q.boxes
                assert _cell_of_pixels(_color_mask(img, q.boxes[0], col), q.boxes[0]) == q.answer
                answers[q.answer] += 1
    assert len(answers) >= 7  # nearly every cell is asked about in 60 images
    assert {o.quadrant for s in SAMPLES for o in s.shapes} == set(D.CELLS)  # and objects fill every cell


def test_read_answer_is_the_rendered_number_one_digit_per_patch() -> None:
    p = CFG.patch
    for s in SAMPLES:
        img = _pixels(s)
        (q,) = [q for q in s.questions if q.qtype == "read"]
        assert q.answer == "".join(_read_digit(img, b) for b in sorted(q.boxes)) and 2 <= len(q.answer) <= 3
        cells = [(b[1] // p, b[0] // p) for b in sorted(q.boxes)]
        assert all((b[2] - 1) // p == b[0] // p and (b[3] - 1) // p == b[1] // p for b in q.boxes)  # one patch each
        assert len({r for r, _ in cells}) == 1 and [c for _, c in cells] == list(range(cells[0][1], cells[0][1] + len(q.answer)))
        mask = S.evidence_mask(q.boxes, CFG.image_size, CFG.grid, CFG.grid)
        assert sorted(np.flatnonzero(mask).tolist()) == [r * CFG.grid + c for r, c in cells]


def test_every_question_has_evidence_and_types_are_balanced() -> None:
    per_type = collections.Counter(q.qtype for s in SAMPLES for q in s.questions)
    assert set(per_type) == set(D.DENSE_QTYPES) and min(per_type.values()) >= 0.9 * len(SAMPLES)
    for s in SAMPLES:
        for q in s.questions:
            assert q.boxes or (q.qtype == "count" and q.answer == "0")
            if q.boxes:
                assert S.evidence_mask(q.boxes, CFG.image_size, CFG.grid, CFG.grid).any()
    ans = collections.Counter((q.qtype, q.answer) for s in SAMPLES for q in s.questions)
    assert abs(ans[("exists", "yes")] - ans[("exists", "no")]) <= 0.3 * per_type["exists"]
    assert sum(ans[("count", c)] > 0 for c in S.COUNT_ANSWERS) >= 5

