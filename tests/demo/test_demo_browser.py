"""The Gradio demo in a real browser: headless Debian Chromium driven by Playwright, app served in-process.

Browser tests skip only where ``/usr/bin/chromium`` is absent (``scripts/system-deps.sh`` installs it). Set
``VTPRUNE_DEMO_SCREENSHOT=docs/demo.png`` to refresh the README screenshot from the image run.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vtprune.demo.cli import load_demo_module

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_MS = 90_000


def _visual_tokens() -> int:
    """Visual tokens per image of the demo's default model (the embedded LLaVA), from its config."""
    import json

    from vtprune.models.embedded import embedded_model_path

    vision = json.loads((embedded_model_path("llava") / "config.json").read_text())["vision_config"]
    return (vision["image_size"] // vision["patch_size"]) ** 2


def _kept(keep: float) -> int:
    from vtprune import keep_count

    return keep_count(keep, _visual_tokens())
NO_CHROMIUM = "Debian chromium is not installed at /usr/bin/chromium (run scripts/system-deps.sh as root)"


def browser(test):
    """Marks a test ``browser`` and skips it where Debian chromium is missing."""
    return pytest.mark.browser(pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)(test))


app = load_demo_module("app")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runner():
    from vtprune.demo.app import DemoRunner

    torch.set_num_threads(1)
    return DemoRunner(None, device="cpu", timing_repeats=1)


@pytest.fixture(scope="module")
def server(runner) -> Iterator[str]:
    demo = app.build_app(runner=runner)
    port = _free_port()
    app.launch(demo, "127.0.0.1", port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        handle = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield handle
        handle.close()


@pytest.fixture
def page(chromium, server):
    page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(server)
    page.wait_for_selector("#run")
    yield page
    page.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A generated shapes image, a generated clip (MP4), a text file and a broken PNG."""
    import cv2

    from vtprune.shapes.task import make_split
    from vtprune.shapes.video import make_video_split

    folder = tmp_path_factory.mktemp("demo-inputs")
    sample = make_split("test", 3)[2]
    sample.image.save(folder / "shapes.png")
    clip = make_video_split("test", 2)[1]
    writer = cv2.VideoWriter(str(folder / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, clip.frames[0].size)
    for frame in clip.frames:
        writer.write(cv2.cvtColor(np.asarray(frame), cv2.COLOR_RGB2BGR))
    writer.release()
    (folder / "notes.txt").write_text("not a picture\n")
    _photo().save(folder / "photo.jpg", quality=90)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not really a PNG")
    return {"image": folder / "shapes.png", "question": sample.questions[0].text, "video": folder / "clip.mp4",
            "photo": folder / "photo.jpg",
            "video_question": clip.questions[0].text, "text": folder / "notes.txt", "broken": folder / "broken.png"}


def _photo() -> Image.Image:
    """A 640x427 landscape 'photo' (smooth colour gradients and noise, nothing of vtprune-shapes in it)."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:427, 0:640]
    base = np.stack([120 + 80 * np.sin(x / 90), 90 + 60 * np.cos(y / 70), 60 + 40 * np.sin((x + y) / 120)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))


def _upload(page, path: Path) -> None:
    """Upload ``path`` (clearing a previous upload first) and wait for the preview / refusal message."""
    clear = page.locator("#upload button[aria-label=Clear]")
    if clear.count():
        clear.click()
        page.wait_for_selector("#upload input[type=file]", state="attached")
    page.set_input_files("#upload input[type=file]", str(path))
    page.wait_for_function("/^(Image ready|Video ready|⚠)/.test(document.querySelector('#status').innerText.trim())")


def _run(page) -> str:
    """Click Run and wait until ``#status`` reports a new result (answer or message)."""
    before = page.inner_text("#status")
    page.click("#run")
    page.wait_for_function(
        """(before) => { const text = document.querySelector('#status').innerText;
            return text !== before && /^(Answered|Video answered|⚠)/.test(text.trim()); }""",
        arg=before, timeout=RUN_TIMEOUT_MS)
    return page.inner_text("#status")


def _choose(page, method: str, keep: float) -> None:
    page.click("#method input")
    page.get_by_role("option", name=method, exact=True).click()
    page.fill("#keep input[type=number]", str(keep))
    page.press("#keep input[type=number]", "Enter")


@browser
def test_image_run_shows_both_answers_counts_and_pictures(page, inputs) -> None:
    _upload(page, inputs["image"])
    page.wait_for_selector("#preview img")
    page.fill("#question textarea", inputs["question"])
    status = _run(page)
    assert status.startswith("Answered"), status
    assert page.input_value("#answer-full textarea").strip()
    assert page.input_value("#answer-pruned textarea").strip()
    n = _visual_tokens()
    assert page.inner_text("#tokens-full").startswith(str(n))
    assert page.inner_text("#tokens-pruned") == f"{n} → {_kept(0.25)} (layer 2)"
    assert "FLOP" in page.inner_text("#flops-pruned") and "B" in page.inner_text("#kv-pruned")
    assert "FLOPs" in page.inner_text("#speedup")
    for picture in ("#overlay img", "#heatmap img"):
        assert page.locator(picture).get_attribute("src")
    target = os.environ.get("VTPRUNE_DEMO_SCREENSHOT")
    if target:
        page.screenshot(path=target, full_page=True)


@browser
def test_a_photo_and_an_off_task_question_are_explained(page, inputs) -> None:
    """A user's photo with "What is on the sofa?": the page says what the model is, and why the answers mean nothing."""
    info = page.inner_text("#model-info")
    assert "embedded:llava" in info and "vtprune-shapes" in info and "What color is the circle?" in info
    assert page.locator("#model-info a[href='https://huggingface.co/llava-hf/llava-1.5-7b-hf']").count() == 1
    assert page.locator("#examples").is_visible()
    _upload(page, inputs["photo"])
    page.fill("#question textarea", "What is on the sofa?")
    assert _run(page).startswith("Answered")
    notes = page.inner_text("#notes")
    assert "not in its vocabulary: 'on', 'sofa'" in notes and "its answer is a guess or empty" in notes
    assert "the image is 640x427" in notes and "centre-crops a square" in notes
    for box in ("#answer-full textarea", "#answer-pruned textarea"):
        answer = page.input_value(box).strip()
        assert answer, f"{box} is blank"
        if answer == app.EMPTY_ANSWER:
            assert "generated no text" in notes
    caption = page.inner_text("#speed-caption")
    assert "M-parameter model with 16 visual tokens" in caption and "FLOPs and KV-cache ratios" in caption
    target = os.environ.get("VTPRUNE_DEMO_PHOTO_SCREENSHOT")
    if target:
        page.screenshot(path=target, full_page=True)


@browser
def test_switching_method_and_keep_changes_kept_count(page, inputs) -> None:
    _upload(page, inputs["image"])
    page.fill("#question textarea", inputs["question"])
    _choose(page, "random", 0.5)
    assert _run(page).startswith("Answered")
    assert page.inner_text("#tokens-pruned") == f"{_visual_tokens()} → {_kept(0.5)} (layer 2)"
    _choose(page, "pdrop", 0.25)
    assert _run(page).startswith("Answered")
    assert page.inner_text("#tokens-pruned").endswith(f"→ {_kept(0.25)} (layer 3)")
    assert page.inner_text("#tokens-pruned").count("→") == 3


@browser
def test_video_shows_gridprobe_map_and_frames(page, inputs) -> None:
    _upload(page, inputs["video"])
    page.fill("#question textarea", inputs["video_question"])
    page.fill("#grid input[type=number]", "3")
    page.press("#grid input[type=number]", "Enter")
    status = _run(page)
    if importlib.util.find_spec("vtprune.gridprobe.run") is None:
        assert "video support not installed" in status
        return
    assert status.startswith("Video answered"), status
    assert page.locator("#gridprobe-map img").get_attribute("src")
    assert page.locator("#frames img").get_attribute("src")
    assert "of 9" in page.inner_text("#video-frames-pruned")
    assert page.input_value("#answer-pruned textarea").strip()[0] in "ABCD"


@browser
def test_non_image_upload_gets_a_readable_message(page, inputs) -> None:
    _upload(page, inputs["text"])
    assert "notes.txt is not an image or a video" in page.inner_text("#status")
    page.fill("#question textarea", "What is this?")
    assert "Cannot run: notes.txt is not an image or a video" in _run(page)
    assert "Traceback" not in page.content()
    _upload(page, inputs["broken"])
    assert "broken.png is not a readable image" in page.inner_text("#status")


def test_server_binds_localhost_and_serves_no_local_files(server) -> None:
    import urllib.error
    import urllib.request

    assert server.startswith("http://127.0.0.1:")
    for path in ("/etc/passwd", str(Path(__file__).resolve())):
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"{server}gradio_api/file={path}", timeout=10)
        assert error.value.code in (403, 404)


def test_demo_cli_explains_a_missing_demos_folder(tmp_path, monkeypatch, capsys) -> None:
    from vtprune import cli
    from vtprune.demo import cli as demo_cli

    args = cli.build_parser().parse_args(["demo"])
    assert (args.host, args.port, args.share, args.model) == ("127.0.0.1", 7860, False, None)
    monkeypatch.setattr(demo_cli, "DEMOS_DIR", tmp_path / "demos")
    assert cli.main(["demo"]) == 2
    assert "needs the repository's demos/ folder" in capsys.readouterr().err


def test_demo_app_and_vtprune_demo_have_the_same_options_and_help(capsys) -> None:
    from vtprune import cli

    helps = []
    for run in (lambda: cli.main(["demo", "--help"]), lambda: app.main(["--help"])):
        with pytest.raises(SystemExit):
            run()
        helps.append(capsys.readouterr().out.split("\n\n", 1)[1])  # past the usage line (program names differ)
    assert helps[0] == helps[1] and "port (default 7860)" in helps[0] and "examples:" in helps[0]


def test_uploads_outside_the_upload_folder_or_too_large_are_refused(tmp_path) -> None:
    from vtprune.demo.app import UploadError, check_upload

    inside = tmp_path / "uploads"
    inside.mkdir()
    image = inside / "a.png"
    Image.new("RGB", (8, 8)).save(image)
    np.save(tmp_path / "x.npy", np.zeros(1))
    assert check_upload(image, [inside]) == "image"
    (inside / "link.png").symlink_to(tmp_path / "x.npy")
    for path in ("/etc/passwd", tmp_path / "x.npy", inside / "link.png", inside / ".." / "x.npy"):
        with pytest.raises(UploadError, match="not in the demo's upload folder"):
            check_upload(path, [inside])
    with pytest.raises(UploadError, match="accepts files up to"):
        check_upload(image, [inside], max_mb=1e-6)


def test_click_handler_turns_failures_into_messages(runner) -> None:
    outputs = dict(zip(app.OUTPUTS, app.on_run(runner, "/etc/passwd", "q", "fastv", 0.25, False, 4), strict=True))
    assert "upload folder" in outputs["status"]
    outputs = dict(zip(app.OUTPUTS, app.on_run(runner, None, "q", "fastv", 0.25, False, 4), strict=True))
    assert outputs["status"].startswith("⚠️ Upload an image")


def test_video_without_gridprobe_says_video_support_is_not_installed(runner, inputs, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vtprune.gridprobe.run", None)
    monkeypatch.setattr(app, "upload_roots", lambda: [str(inputs["video"].parent)])
    outputs = dict(zip(app.OUTPUTS, app.on_run(runner, str(inputs["video"]), "Which?", "fastv", 0.25, False, 3),
                       strict=True))
    assert "video support not installed" in outputs["status"]
    assert "video support not installed" in outputs["video_info"]
