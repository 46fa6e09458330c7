"""Peak CPU memory of ``generate`` calls, measured in a fresh process (``python -m vtprune.eval.speed.memory``).

Reads a JSON spec on stdin (written by ``vtprune.eval.speed.bench``: jobs = geometry x batch, configs =
``[method, keep]``, LM settings) and prints one JSON line per call: ``{"geometry", "batch", "method",
"keep", "peak_bytes"}``.

Method: the parent starts this process with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor above 64 KiB
is its own ``mmap`` and leaves the resident set when freed (glibc's adaptive threshold would otherwise keep
freed blocks resident and hide later peaks). Per call: ``gc.collect()``, reset the kernel's peak-RSS mark
(``/proc/self/clear_refs``), read ``VmRSS``, run ``generate``, read ``VmHWM``; the difference is the call's
peak (activations, KV cache, logits; the model and inputs were resident before). One warm-up call per model
comes first. Timings are never taken here: the fixed threshold makes allocation slower.
"""

from __future__ import annotations

import gc
import json
import sys

import torch


def main() -> int:
    from vtprune.eval.speed.bench import DTYPES
    from vtprune.eval.speed.measure import generate_with_cache, reset_peak_rss, rss_bytes
    from vtprune.eval.speed.proxy import GEOMETRIES, batch_inputs, build_model, lm_geometry

    import vtprune

    spec = json.load(sys.stdin)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    tokens, layer = spec["new_tokens"], spec.get("layer")
    jobs = [(GEOMETRIES[j["geometry"]], j["batch"]) for j in spec["jobs"]]
    for family in dict.fromkeys(g.family for g, _ in jobs):
        lm = lm_geometry(family, spec["lm"], spec["hidden"], spec["layers"])
        model = build_model(family, lm, spec["attn"], DTYPES[spec["dtype"]], "cpu")
        warmed = False
        for geometry, batch in [(g, b) for g, b in jobs if g.family == family]:
            inputs = batch_inputs(model, geometry, batch, lm, "cpu")
            if not warmed:
                generate_with_cache(model, inputs, 2)
                warmed = True
            for method, keep in spec["configs"]:
                options = {"layer": layer} if layer is not None else {}
                handle = vtprune.wrap(model, method, keep=keep, **options) if method != "none" else None
                try:
                    gc.collect()
                    reset_peak_rss()
                    before = rss_bytes()
                    output = generate_with_cache(model, inputs, tokens)
                    peak = rss_bytes("VmHWM") - before
                    del output
                except (RuntimeError, ValueError) as error:
                    print(f"[speed_memory] {geometry.key} b{batch} {method}@{keep}: {error}", file=sys.stderr)
                    continue
                finally:
                    if handle is not None:
                        handle.remove()
                print(json.dumps({"geometry": geometry.key, "batch": batch, "method": method, "keep": keep,
                                  "peak_bytes": int(peak)}), flush=True)
        del model
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
