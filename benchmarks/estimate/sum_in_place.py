"""Where the autograd engine sums two gradients of one tensor in place, and where out of place: a real step's
profile beside memfit's trace.

    python benchmarks/estimate/sum_in_place.py --device cuda --out $OUT/sums_h100.json NAME ...   # GPU
    python benchmarks/estimate/sum_in_place.py --device cpu --out sums_cpu.json NAME ...          # a real CPU step
    python benchmarks/estimate/sum_in_place.py --device trace --out sums_trace.json NAME ...      # memfit's trace
    python benchmarks/estimate/sum_in_place.py --compare sums_h100.json sums_trace.json           # side by side

NAME: a zoo entry (benchmarks/zoo/), ``gap:NAME`` (benchmarks/estimate/gap_cases.py), a corpus id (cNNN_...) or
``file.py:name``.

A real step (the protocol's second, ``memfit.workload.protocol.run_steps``) runs its backward under
``torch.profiler``: each ``aten::add_`` directly under ``autograd::engine::evaluate_function: NODE`` is a sum the
engine made in place (``InputBuffer::accumulate``), each ``aten::add`` there one made out of place (or an ``add`` of
a derivative formula). The trace's side lists the sums ``Recorder._accumulate_in_place`` saw and which it folded
into their first term's block. Rows: (node, shape of the sum) -> [in place, out of place].
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def load(name: str):  # noqa: ANN201
    from memfit.workload.loading import load_workload

    if ".py" in name:
        return load_workload(name)
    if name.startswith("gap:"):
        return load_workload(f"{HERE / 'gap_cases.py'}:{name[4:]}")
    if name[:1] == "c" and name[1:4].isdigit():
        return load_workload(f"{ROOT / 'benchmarks' / 'corpus' / 'corpus.py'}:{name}")
    sys.path.insert(0, str(ROOT / "benchmarks" / "zoo"))
    from registry import entries

    return load_workload(entries([name])[0].spec)


def _key(node: str, shape: object) -> str:
    return f"{node} {list(shape)}"


def real_sums(workload, device: str) -> dict[str, list[int]]:  # noqa: ANN001
    """The sums a real step's backward made on ``device`` (the profile's rows)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memfit.workload.protocol import build, run_steps

    model, optimizer, batch = build(workload, device)
    scaler = torch.amp.GradScaler(device) if workload.precision == "fp16" else None
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    state = {"on": False}

    def phase(what: str, step: int) -> None:
        if what == "backward" and step == 1 and not state["on"]:
            prof.start()
            state["on"] = True
        elif state["on"] and what != "backward":
            prof.stop()
            state["on"] = False

    run_steps(workload, model, optimizer, batch, autocast_device=device, scaler=scaler, steps=2, phase=phase,
              micro_batches=1)
    rows: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    prefix = "autograd::engine::evaluate_function: "
    for e in prof.events():
        parent = e.cpu_parent
        if e.name in ("aten::add_", "aten::add") and parent is not None and parent.name.startswith(prefix):
            node = parent.name[len(prefix):]
            rows[_key(node, e.input_shapes[0])][0 if e.name == "aten::add_" else 1] += 1
    return dict(rows)


def traced_sums(workload, gpu: str) -> dict[str, list[int]]:  # noqa: ANN001
    """The sums memfit's trace of ``workload`` saw in its first backward, and which it folded (the same rows)."""
    from memfit import _torch_private as tp
    from memfit.estimate import trace as tr
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.recorder import Recorder

    rows: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    pending: list[str] = []
    accumulate, fold = Recorder._accumulate_in_place, Recorder._fold_sum

    def watch_accumulate(self, name, args, kwargs, out):  # noqa: ANN001, ANN202
        taken = accumulate(self, name, args, kwargs, out)
        pending.clear()
        if taken and self.step == 0:  # the first step's backward (later steps are copies or the same sums)
            key = _key(tp.autograd_node_name(tp.current_autograd_node()), out.shape)
            rows[key][1] += 1
            pending.append(key)
        return taken

    def watch_fold(self, key):  # noqa: ANN001, ANN202
        folded = fold(self, key)
        if folded and pending:
            rows[pending[0]][0] += 1
            rows[pending[0]][1] -= 1
        pending.clear()
        return folded

    Recorder._accumulate_in_place, Recorder._fold_sum = watch_accumulate, watch_fold
    try:
        tr.trace_workload(workload.replace(accumulation_steps=1), gpu_spec(gpu))
    finally:
        Recorder._accumulate_in_place, Recorder._fold_sum = accumulate, fold
    return dict(rows)


def compare(a_path: str, b_path: str) -> None:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    for name in sorted(set(a["entries"]) & set(b["entries"])):
        ra, rb = a["entries"][name], b["entries"][name]
        if "error" in ra or "error" in rb:
            print(f"{name}: {ra.get('error') or rb.get('error')}")
            continue
        same = sum(min(ra.get(k, [0, 0])[0], rb.get(k, [0, 0])[0]) for k in set(ra) | set(rb))
        print(f"{name}: in place {sum(v[0] for v in ra.values())} ({a['device']}) / "
              f"{sum(v[0] for v in rb.values())} ({b['device']}), {same} agree")
        for k in sorted(set(ra) | set(rb)):
            va, vb = ra.get(k, [0, 0]), rb.get(k, [0, 0])
            if va[0] != vb[0]:
                print(f"    {k}: in place {va[0]} vs {vb[0]}; out of place {va[1]} vs {vb[1]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--device", choices=("cuda", "cpu", "trace"), default="trace")
    parser.add_argument("--gpu", default="h100", help="the GPU the trace is for (--device trace)")
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar="JSON")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    import torch

    found: dict[str, object] = {}
    for name in args.names:
        try:
            workload = load(name)
            found[name] = traced_sums(workload, args.gpu) if args.device == "trace" else real_sums(workload, args.device)
        except Exception as exc:  # noqa: BLE001 - one entry's failure is a row, not the end of the run
            found[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        print(name, "done", flush=True)
    device = args.device if args.device != "cuda" else torch.cuda.get_device_name(0)
    result = {"device": device, "torch": torch.__version__, "entries": found}
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
