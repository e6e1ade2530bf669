"""Find the memory CUDA kernels take inside an op and give back before it returns (workspaces, internal
buffers): what a CPU trace cannot see. Runs each workload's protocol on the GPU under a dispatch mode that reads
the caching allocator's peak around every ATen op, forward and backward.

    python benchmarks/profile_transients.py --out $OUT [--names a,b]

Writes ``transients_<card>_torch<X.Y>_<yyyymmdd>.json`` into ``--out`` (default ``$OUT``, else
``benchmarks/results/estimate``): per op call with a transient above 1 MiB, the op, its input
shapes and dtypes, its output bytes and the transient bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _results import RESULTS, card, stem  # noqa: E402


class _Transients(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        after = torch.cuda.memory_allocated()
        transient = torch.cuda.max_memory_allocated() - after
        if transient > (1 << 20):
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            self.rows.append({
                "op": str(func), "in": [[list(t.shape), str(t.dtype)[6:]] for t in ins[:6]],
                "out_bytes": sum(o.untyped_storage().nbytes() for o in outs),
                "transient": transient,
                "nonscalar_args": [a for a in tree_flatten(args)[0] if isinstance(a, (int, float, bool))][:12],
            })
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "estimate"))
    parser.add_argument("--names")
    args = parser.parse_args()
    import workloads
    from memfit.workload.protocol import build, run_steps

    names = args.names.split(",") if args.names else workloads.SUITE
    result = {}
    for name in names:
        w = getattr(workloads, name)
        try:
            model, opt, batch = build(w, "cuda")
            scaler = torch.amp.GradScaler("cuda") if w.precision == "fp16" else None
            run_steps(w, model, opt, batch, autocast_device="cuda", scaler=scaler, steps=1)  # warm up
            mode = _Transients()
            with mode:
                run_steps(w, model, opt, batch, autocast_device="cuda", scaler=scaler, steps=1)
            result[name] = mode.rows
            print(name, len(mode.rows), "ops with transients", flush=True)
        except Exception as exc:  # keep going: one failure must not lose the rest
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, "FAILED", exc, flush=True)
        finally:
            model = opt = batch = scaler = None
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    path = Path(args.out) / f"{stem('transients', card(props.name), torch.__version__)}.json"
    path.write_text(json.dumps({"gpu": props.name, "torch": torch.__version__, "cudnn":
                                torch.backends.cudnn.version(), "workloads": result}))
    print("->", path)


if __name__ == "__main__":
    main()
