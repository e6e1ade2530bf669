"""What does each checkpoint mode cost the CPU per op, where kernels are too small to matter?

Selective checkpointing (``memfit.workload.selective_checkpoint``) runs every op of a checkpointed block through
torch's Python dispatch modes, in forward and in the recompute; reentrant and non-reentrant checkpointing differ in
their Python hooks. The speed model (``memfit.estimate.op_costs``, ``memfit.speed.step_time``) prices these as
dispatches, so this script measures them in units of one eager op: a block of ``--ops`` tiny pointwise ops (16
elements each) is run forward + backward without checkpointing and under each mode, and the extra time per op is
divided by the eager time per op.

    python benchmarks/checkpoint_dispatch_cost.py --out benchmarks/results/speed     # CPU, ~20 s
    python benchmarks/checkpoint_dispatch_cost.py --device cuda --out $OUT            # the GPU host, ~20 s

Writes ``checkpoint_dispatch_cost_<card or cpu>_torch<X.Y>_<yyyymmdd>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, stem  # noqa: E402

MODES = ("none", "full", "selective", "reentrant")


class _Chain:
    """``ops`` pointwise ops in a row (mul, add, tanh, ...): nothing for selective checkpointing to keep."""

    def __init__(self, ops: int) -> None:
        self.ops = ops

    def __call__(self, x):  # noqa: ANN001, ANN204
        for i in range(self.ops // 3):
            x = (x * 1.0001 + 0.001).tanh() if i % 2 else (x * 0.9999 - 0.001).sigmoid()
        return x


def _aten_ops(fn, x) -> tuple[int, int]:  # noqa: ANN001
    """(forward, backward) ATen ops of one run of ``fn``, counted with a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        y = fn(x).sum()
        forward = Count.n
        y.backward()
    return forward, Count.n - forward


def _time(fn, x, repeats: int, sync) -> tuple[float, float]:  # noqa: ANN001
    """Median (forward s, backward s) of ``repeats`` runs after 3 warm-ups."""
    fwd, bwd = [], []
    for i in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        y = fn(x).sum()
        sync()
        t1 = time.perf_counter()
        y.backward()
        sync()
        t2 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def run(device: str, ops: int, repeats: int, rounds: int) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint

    from memfit.workload.selective_checkpoint import selective_contexts

    chain = _Chain(ops)
    x = torch.randn(16, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fns = {
        "none": chain,
        "full": lambda t: checkpoint(chain, t, use_reentrant=False),  # memfit's "full"
        "selective": lambda t: checkpoint(chain, t, use_reentrant=False, context_fn=selective_contexts),
        "reentrant": lambda t: checkpoint(chain, t, use_reentrant=True),
    }
    counts = {m: _aten_ops(fns[m], x) for m in MODES}
    # interleaved rounds, so the host's drift hits every mode alike; the least of the rounds' medians, since other
    # jobs on the host only ever add time
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for m in MODES:
            times[m].append(_time(fns[m], x, repeats, sync))
    med = {m: (min(t[0] for t in times[m]), min(t[1] for t in times[m])) for m in MODES}
    eager_fwd_op = med["none"][0] / counts["none"][0]
    out: dict = {"chain_ops": ops, "eager_forward_s_per_op": eager_fwd_op, "eager_backward_s_per_op": med["none"][1] / counts["none"][1],
                 "modes": {}}
    for m in MODES:
        fwd, bwd = med[m]
        out["modes"][m] = {
            "forward_s": fwd, "backward_s": bwd, "aten_ops_forward": counts[m][0], "aten_ops_backward": counts[m][1],
            # time over no checkpointing per op of the chain, in units of one eager forward ATen op
            "extra_forward_per_op": (fwd - med["none"][0]) / ops / eager_fwd_op,
            "extra_backward_per_op": (bwd - med["none"][1]) / ops / eager_fwd_op,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ops", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, required=True, help="a folder")
    args = parser.parse_args()
    import torch

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    result = {"device": name or "cpu", "torch": torch.__version__, "ops": args.ops, "rounds": args.rounds,
              **run(args.device, args.ops, args.repeats, args.rounds)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem('checkpoint_dispatch_cost', card(name), torch.__version__)}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
