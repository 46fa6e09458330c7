"""Gradio demo of vtprune: one image (or video) and question, answered unpruned and pruned, side by side.

Run ``vtprune demo [--model PATH] [--host 127.0.0.1] [--port N]`` or ``python demos/app.py`` (same options).
The model side (runs, scores, costs, examples) is :mod:`vtprune.demo.app`; pictures are :mod:`demos.overlay`.
Model calls go through Gradio's queue one at a time; uploads are checked here (size, kind, upload folder).
"""

from __future__ import annotations

import logging
import math
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python demos/app.py`: make the `demos` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradio as gr  # noqa: E402
from PIL import Image  # noqa: E402

import vtprune  # noqa: E402
from demos import overlay  # noqa: E402
from vtprune.cli.checks import check_port, exposure_warning  # noqa: E402
from vtprune.demo.app import (  # noqa: E402
    MAX_UPLOAD_MB,
    Comparison,
    DemoRunner,
    UploadError,
    VideoComparison,
    VideoUnavailable,
    check_upload,
    load_image,
    model_summary,
    speed_caption,
    write_examples,
)
from vtprune.errors import UserError  # noqa: E402

LOG = logging.getLogger("vtprune.demo")
OUTPUTS = ("status", "answer_full", "answer_pruned", "notes", "metrics", "overlay", "heatmap", "caption", "gp_map",
           "gp_frames", "video_info", "video_metrics", "tabs")
EMPTY_ANSWER = "(empty: see the notes)"
CSS = """
#status {min-height: 1.5em}
table.vt-table {width: 100%; border-collapse: collapse; font-size: 0.95em; border: none !important; margin: 4px 0}
table.vt-table tr, table.vt-table tbody {border: none !important}
table.vt-table th, table.vt-table td {padding: 6px 10px; border: none !important; text-align: left;
                                      background: transparent; border-bottom: 1px solid #d4d4d8 !important}
table.vt-table th:first-child {white-space: nowrap}
table.vt-table tr:first-child th {border-bottom: 2px solid #a1a1aa !important}
table.vt-table td {font-variant-numeric: tabular-nums}
table.vt-table tr.speedup td {font-weight: 600}
p.vt-caption {font-size: 0.85em; color: #52525b; margin: 2px 0 8px}
"""


def upload_roots() -> list[str]:
    """Folders the demo reads client files from: Gradio's upload folder only."""
    return [gr.utils.get_upload_folder()]


def human(value: float, unit: str, base: int = 1000) -> str:
    """``213 MFLOP`` / ``150 KiB`` (``base=1024`` for bytes), three significant digits."""
    prefixes = ("", "k", "M", "G", "T", "P") if base == 1000 else ("", "Ki", "Mi", "Gi", "Ti", "Pi")
    step = 0
    while abs(value) >= base and step < len(prefixes) - 1:
        value, step = value / base, step + 1
    return f"{value:.3g} {prefixes[step]}{unit}"


def stage_text(visual: int, layers: list[int], kept: list[int]) -> str:
    """``64 → 40 (layer 1) → 16 (layer 3)``: visual tokens before and after each stage."""
    steps = [f"{count} (layer {layer})" for layer, count in zip(layers, kept, strict=True)]
    return " → ".join([str(visual), *steps]) if steps else f"{visual} (all layers)"


def ratio(before: float, after: float) -> str:
    """``before / after`` as ``2.50×`` (``n/a`` when ``after`` is zero)."""
    return f"{before / after:.2f}×" if after else "n/a"


def table_html(columns: tuple[str, str], rows: list[tuple[str, str, str, str]], speedups: str, prefix: str) -> str:
    """A two-column comparison table; ``rows`` are ``(id, name, unpruned, pruned)``, cells get ids."""
    head = f"<tr><th></th><th>{columns[0]}</th><th>{columns[1]}</th></tr>"
    body = "".join(f"<tr><th>{name}</th><td id='{prefix}{key}-full'>{a}</td><td id='{prefix}{key}-pruned'>{b}</td>"
                   "</tr>" for key, name, a, b in rows)
    tail = (f"<tr class='speedup'><th>Speedup (unpruned / pruned)</th><td>1×</td>"
            f"<td id='{prefix}speedup'>{speedups}</td></tr>")
    return f"<table class='vt-table'>{head}{body}{tail}</table>"


def metrics_html(result: Comparison, method: str, keep: float, caption: str = "") -> str:
    """Image table: visual tokens per stage, prefill time, FLOPs, KV cache and the speedups; ``caption`` below."""
    full, pruned = result.full, result.pruned
    rows = [
        ("tokens", "Visual tokens", stage_text(full.visual_tokens, [], []),
         stage_text(pruned.visual_tokens, pruned.stage_layers, pruned.kept)),
        ("prefill", "Prefill time (median, this machine)", f"{full.prefill_ms:.1f} ms", f"{pruned.prefill_ms:.1f} ms"),
        ("flops", "LM prefill FLOPs (theory)", human(full.flops, "FLOP"), human(pruned.flops, "FLOP")),
        ("kv", "KV cache after prefill", human(full.kv_bytes, "B", 1024), human(pruned.kv_bytes, "B", 1024)),
    ]
    speedups = (f"time {ratio(full.prefill_ms, pruned.prefill_ms)} · FLOPs {ratio(full.flops, pruned.flops)} · "
                f"KV cache {ratio(full.kv_bytes, pruned.kv_bytes)}")
    table = table_html(("Unpruned", f"Pruned: {method}, keep {keep:g}"), rows, speedups, "")
    return table + (f"<p id='speed-caption' class='vt-caption'>{caption}</p>" if caption else "")


def video_metrics_html(result: VideoComparison, method: str, keep: float) -> str:
    """Video table: all candidate frames unpruned vs GridProbe frames (pruned by ``method``)."""
    full, probed = result.full, result.probed
    spent_flops = probed.probe_flops + probed.answer_flops
    rows = [
        ("frames", "Frames", f"{full.m_eff} (uniform)",
         f"{probed.m_eff} of {probed.k ** 2}, after {2 * probed.k} probes of {probed.k} frames"),
        ("tokens", "Visual tokens (answer pass)", f"{full.answer_visual_tokens}",
         f"{probed.answer_visual_tokens} → {probed.answer_kept_tokens} kept"),
        ("time", "Model time", f"{full.answer_ms:.0f} ms",
         f"{result.spent_ms:.0f} ms ({probed.probe_ms:.0f} probes + {probed.answer_ms:.0f} answer)"),
        ("flops", "LM prefill FLOPs (theory)", human(full.answer_flops, "FLOP"), human(spent_flops, "FLOP")),
    ]
    speedups = f"time {ratio(full.answer_ms, result.spent_ms)} · FLOPs {ratio(full.answer_flops, spent_flops)}"
    pruning = "no token pruning" if method == "none" else f"{method}, keep {keep:g}"
    return table_html(("All frames, unpruned", f"GridProbe + {pruning}"), rows, speedups, "video-")


def _result(**values: Any) -> tuple:
    """The click outputs in :data:`OUTPUTS` order; a missing value clears its component."""
    values.setdefault("tabs", gr.update())
    return tuple(values.get(key) for key in OUTPUTS)


def _pictures(result: Comparison, method: str) -> tuple[Any, Any, str]:
    """(kept/pruned overlay, importance heatmap, caption)."""
    if result.grid is None:
        return None, None, "The token grid is not drawn: this model's visual tokens are not one plain grid."
    h, w = result.grid
    pruned = result.pruned
    kept = overlay.kept_overlay(result.image, h, w, pruned.kept_indices, pruned.merged)
    merged = f"; {len(pruned.merged)} kept tokens absorbed pruned ones (cyan outline)" if pruned.merged else ""
    if pruned.recycled and not pruned.merged:
        merged = f"; {len(pruned.recycled)} tokens absorbed pruned ones, but later stages dropped them"
    caption = f"**Left:** the {pruned.final_tokens} kept visual tokens in colour, the pruned ones greyed{merged}. "
    if result.scores is None:
        return kept, None, caption + f"**Right:** `{method}` computes no importance scores."
    heat = overlay.heatmap_overlay(result.image, overlay.scores_to_grid(result.scores, h, w))
    where = "before the LLM" if result.score_layer < 0 else f"from the input of layer {result.score_layer}"
    return kept, heat, caption + (f"**Right:** `{method}` importance {where}, for the stage before layer "
                                  f"{result.stage_layer} (red high, blue low, grey already pruned).")


def run_image(runner: DemoRunner, path: str, question: str, method: str, keep: float, debias: bool) -> tuple:
    """Outputs for an image upload: answers, metrics table and pictures."""
    result = runner.compare(load_image(path), question, method, keep, debias)
    kept_picture, heat_picture, caption = _pictures(result, method)
    return _result(status=f"Answered with **{runner.label}**: unpruned vs **{method}** keeping "
                          f"{result.pruned.final_tokens} of {result.pruned.visual_tokens} visual tokens.",
                   answer_full=result.full.answer or EMPTY_ANSWER, answer_pruned=result.pruned.answer or EMPTY_ANSWER,
                   notes=notes_markdown(result.notes),
                   metrics=metrics_html(result, method, keep, speed_caption(runner, result.full.visual_tokens)),
                   overlay=kept_picture, heatmap=heat_picture, caption=caption, tabs=gr.Tabs(selected="image-results"))


def notes_markdown(notes: list[str]) -> str:
    """The run's notes as a list (the same sentences ``vtprune run`` prints), or nothing."""
    return "\n".join(f"- ⚠️ Note: {note}" for note in notes)


def option_text(question: str, answer: str) -> str:
    """``"B"`` -> ``"B. purple"`` when the question lists ``B. purple``; otherwise ``answer`` unchanged."""
    match = re.search(rf"(?:^|\s){re.escape(answer.strip())}[.)]\s*(.+?)(?=\s+[A-J][.)]\s|\s+Answer\b|$)", question)
    return f"{answer.strip()}. {match.group(1).strip()}" if len(answer.strip()) == 1 and match else answer


def run_video(runner: DemoRunner, path: str, question: str, method: str, keep: float, debias: bool,
              grid: int) -> tuple:
    """Outputs for a video upload: GridProbe map, selected frames, answers and costs."""
    result = runner.gridprobe(path, question, int(grid), method, keep, debias)
    probed = result.probed
    picture = overlay.gridprobe_map(probed.selection.importance, probed.selection.cells) if probed.selection else None
    per_row = max(3, math.ceil(math.sqrt(1.5 * len(result.frames))))
    strip = overlay.frame_strip(result.frames, [f"{t:.2f} s" for t in probed.times_selected], per_row=per_row)
    info = (f"**GridProbe, K = {probed.k}.** {2 * probed.k} probes (rows and columns of the {probed.k} x "
            f"{probed.k} grid of candidate frames) score the question; the map is row x column confidence and "
            f"the {probed.m_eff} outlined cells are the frames that answer. {' '.join(probed.notes)}")
    return _result(status=f"Video answered with **{runner.label}**: all frames vs GridProbe-selected frames.",
                   answer_full=option_text(question, result.full.answer) or EMPTY_ANSWER,
                   answer_pruned=option_text(question, probed.answer) or EMPTY_ANSWER, gp_map=picture, gp_frames=strip,
                   notes=notes_markdown(video_notes(runner, question, result)),
                   video_info=info, video_metrics=video_metrics_html(result, method, keep),
                   tabs=gr.Tabs(selected="video-results"))


def video_notes(runner: DemoRunner, question: str, result: VideoComparison) -> list[str]:
    """The CLI's notes for a clip: the question's vocabulary / form, empty answers."""
    from vtprune.models.notes import empty_answer_note, input_notes

    notes = input_notes(runner.processor, question, runner.embedded)
    for who, answer in (("the all-frames run", result.full.answer), ("the GridProbe run", result.probed.answer)):
        notes.append(empty_answer_note(answer, runner.max_new_tokens, who))
    return [note for note in notes if note]


def on_run(runner: DemoRunner, path: str | None, question: str, method: str, keep: float, debias: bool,
           grid: int) -> tuple:
    """Click handler: every expected failure becomes a message in ``#status`` instead of a traceback."""
    if not path:
        return _result(status="⚠️ Upload an image or a video first (or click one of the examples).")
    if not (question or "").strip():
        return _result(status="⚠️ Type a question about the image.")
    try:
        kind = check_upload(path, upload_roots())
        if kind == "video":
            return run_video(runner, path, question.strip(), method, keep, debias, grid)
        return run_image(runner, path, question.strip(), method, keep, debias)
    except UploadError as error:
        return _result(status=f"⚠️ Cannot run: {error}")
    except UserError as error:  # e.g. a question longer than the model's context
        return _result(status=f"⚠️ Cannot run: {error}")
    except VideoUnavailable as error:
        return _result(status=f"⚠️ {error}", video_info=str(error), tabs=gr.Tabs(selected="video-results"))
    except (ValueError, RuntimeError) as error:
        return _result(status=f"⚠️ {method} cannot run with these settings: {error}")
    except Exception as error:  # a demo answers with a message, never with a traceback
        LOG.exception("demo run failed")
        return _result(status=f"⚠️ Internal error ({type(error).__name__}: {error}); see the server log.")


def on_upload(path: str | None) -> tuple[Any, str]:
    """Preview of a new upload (the image, or a video's first frame) or the reason it is refused."""
    if not path:
        return None, ""
    try:
        kind = check_upload(path, upload_roots())
    except UploadError as error:
        return None, f"⚠️ {error}"
    if kind == "image":
        return overlay.display_image(load_image(path), 320), "Image ready: ask a question and press **Run**."
    first = _first_frame(path)
    return first, "Video ready: GridProbe selects the frames that answer the question. Press **Run**."


def _first_frame(path: str) -> Image.Image | None:
    try:
        from vtprune.media.video import load_video

        return overlay.display_image(load_video(path, num_frames=1).frames[0], 320)
    except (ImportError, ValueError, FileNotFoundError):
        return None


def _inputs_column(examples: list[tuple[str, str]]) -> dict[str, Any]:
    ui: dict[str, Any] = {}
    ui["upload"] = gr.File(label=f"Image or video (≤ {MAX_UPLOAD_MB} MB)", elem_id="upload", height=120)
    ui["preview"] = gr.Image(label="Preview", elem_id="preview", interactive=False, height=220)
    ui["question"] = gr.Textbox(label="Question", elem_id="question", placeholder="What color is the circle?")
    with gr.Row():
        ui["method"] = gr.Dropdown(vtprune.list_methods(), value="fastv", label="Method", elem_id="method")
        ui["keep"] = gr.Slider(0.05, 1.0, value=0.25, step=0.05, label="Keep fraction",
                               elem_id="keep")
    with gr.Row():
        ui["debias"] = gr.Checkbox(False, label="Debias attention", elem_id="debias")
        ui["grid"] = gr.Slider(2, 8, value=4, step=1, label="GridProbe K (video)", elem_id="grid")
    ui["run"] = gr.Button("Run", variant="primary", elem_id="run")
    gr.Examples([list(row) for row in examples], [ui["upload"], ui["question"]], elem_id="examples",
                label="Sample inputs the embedded models answer (click one: it fills in the image and a question)",
                example_labels=[f"{Path(p).suffix[1:]}: {q[:48]}" for p, q in examples])
    return ui


def _outputs_column() -> dict[str, Any]:
    ui: dict[str, Any] = {"status": gr.Markdown(elem_id="status")}
    with gr.Row():
        ui["answer_full"] = gr.Textbox(label="Answer: unpruned", elem_id="answer-full", interactive=False)
        ui["answer_pruned"] = gr.Textbox(label="Answer: pruned", elem_id="answer-pruned", interactive=False)
    ui["notes"] = gr.Markdown(elem_id="notes")
    with gr.Tabs(selected="image-results") as ui["tabs"]:
        with gr.Tab("Image", id="image-results"):
            ui["metrics"] = gr.HTML(elem_id="metrics")
            with gr.Row():
                ui["overlay"] = gr.Image(label="Kept tokens", elem_id="overlay", interactive=False, height=330)
                ui["heatmap"] = gr.Image(label="Importance", elem_id="heatmap", interactive=False, height=330)
            ui["caption"] = gr.Markdown(elem_id="picture-caption")
        with gr.Tab("Video (GridProbe)", id="video-results"):
            ui["video_info"] = gr.Markdown(elem_id="video-info")
            ui["video_metrics"] = gr.HTML(elem_id="video-metrics")
            with gr.Row():
                ui["gp_map"] = gr.Image(label="GridProbe map", elem_id="gridprobe-map", interactive=False,
                                        height=300, scale=2)
                ui["gp_frames"] = gr.Image(label="Selected frames", elem_id="frames", interactive=False,
                                           height=300, scale=3)
    return ui


def build_app(model_spec: str | None = None, runner: DemoRunner | None = None, device: str | None = None
              ) -> gr.Blocks:
    """The demo for ``model_spec`` (default: the embedded LLaVA); ``runner`` reuses a loaded model."""
    runner = runner or DemoRunner(model_spec, device=device)
    with gr.Blocks(title="vtprune demo") as demo:
        gr.Markdown("# vtprune: visual-token pruning, side by side\nThe same prompt runs unpruned and pruned; "
                    "the pictures show which visual tokens survived.")
        gr.Markdown(model_summary(runner), elem_id="model-info")
        with gr.Row():
            with gr.Column(scale=2):
                ui = _inputs_column(write_examples())
            with gr.Column(scale=3):
                ui.update(_outputs_column())
        ui["upload"].change(on_upload, ui["upload"], [ui["preview"], ui["status"]], queue=False,
                            show_progress="hidden")
        inputs = [ui[k] for k in ("upload", "question", "method", "keep", "debias", "grid")]
        ui["run"].click(lambda *args: on_run(runner, *args), inputs, [ui[k] for k in OUTPUTS],
                        concurrency_limit=1, concurrency_id="model",
                        show_progress_on=[ui["answer_full"], ui["answer_pruned"]])
    demo.queue(max_size=32, default_concurrency_limit=1)
    return demo


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int | None = None, share: bool = False,
           **kwargs: Any) -> Any:
    """``demo.launch`` with the demo's CSS, upload size limit, and 127.0.0.1 unless told otherwise."""
    return demo.launch(server_name=host, server_port=port, share=share, css=CSS, theme=gr.themes.Soft(),
                       max_file_size=f"{MAX_UPLOAD_MB}mb", footer_links=[], **kwargs)


def main(argv: list[str] | None = None) -> int:
    """``python demos/app.py [--model PATH] [--host 127.0.0.1] [--port 7860] [--share] [--device cpu]``.

    The options (and ``--help``) are ``vtprune demo``'s: :func:`vtprune.demo.cli.demo_parser`; a bad value is one
    ``python demos/app.py: error: ...`` line and exit status 2.
    """
    from vtprune.cli import run_reporting_errors
    from vtprune.demo.cli import demo_parser

    args = demo_parser().parse_args(argv)
    return run_reporting_errors(lambda: serve(args), "python demos/app.py")


def serve(args: Any) -> int:
    """Check the parsed options (port, model, device: :class:`UserError`), build the app and serve it."""
    from vtprune.models.loading import check_device, check_model_spec

    check_port(args.host, args.port)
    check_model_spec(args.model)
    check_device(args.device)
    warning = exposure_warning(args.host, args.share)
    if warning:
        print(warning, file=sys.stderr)
    demo = build_app(args.model, device=args.device)
    launch(demo, args.host, args.port, args.share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
