"""Where does activation checkpointing's time go where the CPU is the bottleneck?

On the H200 grid of ``plan_quality.py`` checkpointing all of ResNet-50's bottlenecks made a micro-batch 2.3-3.5
times slower at every micro-batch size from 1 to 64, and GPT-2's 12 blocks added ~3 ms each at micro-batch 1:
far more than one extra forward. The profile here says where that time goes, which is what the speed model's
``recompute_dispatch_s`` (``memfit.speed.step_time``, fitted to that grid) stands for. This script times one
micro-batch (forward + backward, CUDA events, median) of ResNet-50 and GPT-2 at small micro-batches without
checkpointing and with every block checkpointed in several ways, then profiles one checkpointed micro-batch
(torch.profiler: CPU time by op, host syncs):

* ``memfit``: ``memfit.workload.knobs.apply_checkpointing`` (non-reentrant, torch's defaults);
* ``no-rng``: ``preserve_rng_state=False``;  ``no-check``: ``determinism_check="none"``;
* ``reentrant``: ``use_reentrant=True``;  ``no-early-stop``: ``torch.utils.checkpoint.set_checkpoint_early_stop(False)``.

    python benchmarks/checkpoint_overhead.py --out $OUT      # GPU machine, ~1 min

Writes ``checkpoint_overhead_<card>_torch<X.Y>_<yyyymmdd>.json``; committed results go to ``benchmarks/results/speed/``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, stem  # noqa: E402


def _wrap(model, names, **kwargs):  # noqa: ANN001, ANN202
    import torch
    from torch.utils.checkpoint import checkpoint

    for name in names:
        module = model.get_submodule(name)
        forward = module.forward

        def run(*args, _f=forward, **kw):  # noqa: ANN002, ANN003, ANN202
            if not torch.is_grad_enabled():
                return _f(*args, **kw)
            return checkpoint(_f, *args, **kwargs, **kw)

        module.forward = functools.wraps(forward)(run)
    return model


def _build(workload: str, micro: int, variant: str):  # noqa: ANN202
    import torch

    from memfit.workload.knobs import apply_checkpointing, checkpoint_candidates
    from memfit.workload.protocol import autocast_dtype, build
    from memfit.workload.zoo import builtin_workload

    w = builtin_workload(workload).replace(batch_size=micro, accumulation_steps=1, optimizer_impl="fused")
    model, optimizer, batch = build(w, "cuda")
    blocks = checkpoint_candidates(model)
    if variant == "memfit":
        apply_checkpointing(model, blocks)
    elif variant == "no-rng":
        _wrap(model, blocks, use_reentrant=False, preserve_rng_state=False)
    elif variant == "no-check":
        _wrap(model, blocks, use_reentrant=False, determinism_check="none")
    elif variant == "reentrant":
        _wrap(model, blocks, use_reentrant=True)
    elif variant == "no-early-stop":
        apply_checkpointing(model, blocks)
    elif variant != "none":
        raise ValueError(variant)
    dtype = autocast_dtype(w.precision)
    def micro_batch() -> None:
        early = (torch.utils.checkpoint.set_checkpoint_early_stop(False) if variant == "no-early-stop"
                 else contextlib.nullcontext())  # a fresh context each call: it is a one-shot generator
        with early:
            ctx = torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                loss = w.loss(w.run_forward(model, batch), batch)
            loss.backward()

    return micro_batch, len(blocks)


def _time(fn, repeats: int = 7) -> tuple[float, float, float]:  # noqa: ANN001
    """(median CUDA-event ms, median host ms to enqueue forward+backward, min CUDA ms)."""
    import time

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host), min(gpu)


def _profile(fn) -> dict:  # noqa: ANN001
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append({"name": e.key, "count": e.count, "cpu_self_us": e.self_cpu_time_total,
                     "cpu_total_us": e.cpu_time_total, "device_us": getattr(e, "self_device_time_total", 0)})
    rows.sort(key=lambda r: -r["cpu_self_us"])
    syncs = [r for r in rows if "Synchronize" in r["name"] or "Memcpy" in r["name"] or "cudaMalloc" in r["name"]
             or "cudaFree" in r["name"]]
    return {"top_cpu_self": rows[:25], "syncs_and_mallocs": syncs}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "timings": [], "profiles": {}}
    for workload, micros in (("resnet50", (1, 8, 32)), ("gpt2", (1, 4))):
        for micro in micros:
            for variant in ("none", "memfit", "no-rng", "no-check", "reentrant", "no-early-stop"):
                fn = None
                try:
                    fn, n = _build(workload, micro, variant)
                    gpu_ms, host_ms, min_ms = _time(fn)
                    row = {"workload": workload, "micro": micro, "variant": variant, "blocks": n,
                           "gpu_ms": gpu_ms, "host_ms": host_ms, "min_ms": min_ms}
                    if micro == micros[0] and variant in ("none", "memfit"):
                        result["profiles"][f"{workload}/{micro}/{variant}"] = _profile(fn)
                except Exception as exc:  # noqa: BLE001 - a failing variant is a result
                    row = {"workload": workload, "micro": micro, "variant": variant, "error": repr(exc)[:300]}
                print(json.dumps(row), flush=True)
                result["timings"].append(row)
                del fn
                torch.cuda.empty_cache()
    name = stem("checkpoint_overhead", card(result["gpu"]), torch.__version__)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
