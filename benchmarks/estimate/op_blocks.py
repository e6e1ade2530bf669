"""Which op takes each block of a zoo step on a GPU, set beside the blocks memfit's trace gives each op.

    python benchmarks/estimate/op_blocks.py run NAME[,NAME...] --out $OUT            # GPU machine
    PYTHONPATH=src:benchmarks python benchmarks/estimate/op_blocks.py compare FOLDER NAME [--min-mib 64]   # CPU
    python benchmarks/estimate/op_blocks.py conv_backward FOLDER NAME        # each convolution backward's scratch

``run``: each entry in its own process, side by side on the one GPU. The step (the protocol memfit measures,
``run_steps_on_cuda``) runs under a dispatch mode that notes, for every aten op, the caching allocator's allocation
counter before and after it (``allocation.all.allocated``), its phase, the autograd node running it and its tensor
arguments (shape, dtype, strides), while the allocator's trace (``_record_memory_history``) notes every block's
size and when it was freed. The k-th block of the trace is the one that moved the counter to k: so each block is
named by the op that took it, and a block freed before that op returned is the op's scratch. Writes
``op_blocks_<card>/NAME.json.gz``.

What the probe itself changes: under any dispatch mode ATen treats every tensor as tensor-subclass-like
(``isTensorSubclassLike``, aten/src/ATen/TensorSubclassLikeUtils.h), so the autograd engine sums a tensor's two
gradients out of place (``InputBuffer::accumulate``) where the step alone sums in place: the backward ``add`` blocks
are the probe's, not the step's (its peak allocated is the measured one where those sums are not at the peak).
Convolutions' blocks are not affected.

``compare``: memfit's trace of the same entry, its blocks of at least ``--min-mib`` MiB counted by (phase, op, MiB)
beside the GPU's, and the ops whose counts differ, with the arguments of the first GPU call of each.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _args_text(args: object) -> str:
    import torch

    parts = []
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}/{list(a.stride())}")
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            parts.append(f"[{len(a)} tensors]")
        elif isinstance(a, (int, float, bool, list, tuple)) or a is None:
            parts.append(str(a))
    return " ".join(parts)


def _one(name: str, out: Path) -> None:
    """One entry's step on the GPU, every op's allocations noted (see the module's docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE.parent / "zoo"))
    from registry import entries

    from memfit import _torch_private as tp
    from memfit.workload.loading import load_workload
    from memfit.workload.protocol import DEFAULT_STEPS, build, run_steps_on_cuda

    def counters() -> tuple[int, int]:
        stats = torch.cuda.memory_stats()
        return stats["allocation.all.allocated"], stats["allocation.all.freed"]

    phase = ["init", 0]
    rows: list[list] = []

    class OpLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            before, _ = counters()
            result = func(*args, **(kwargs or {}))
            after, freed = counters()
            if after > before:
                node = tp.current_autograd_node()
                rows.append([tp.op_short_name(func), phase[0], phase[1], node.name() if node is not None else "",
                             before, after, freed, _args_text(args)])
            return result

    def on_phase(p: str, step: int) -> None:
        phase[:] = [p, step]

    workload = load_workload(entries([name])[0].spec)
    torch.cuda.init()
    tp.record_memory_history(True)
    start, start_freed = counters()
    model, optimizer, batch = build(workload, "cuda", phase=on_phase)
    with OpLog():
        run_steps_on_cuda(workload, model, optimizer, batch, steps=DEFAULT_STEPS, phase=on_phase)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    snap = tp.memory_snapshot()
    tp.record_memory_history(False)
    # the k-th block of the trace moved the allocation counter from start + k to start + k + 1, and the j-th free
    # the free counter from start_freed + j: a block whose free came before its op's last count was freed inside it
    blocks = []  # [size, index of the op's row or -1, freed before the op returned]
    made: dict[int, int] = {}
    free_ordinal = {}
    frees = 0
    for entry in snap["device_traces"][0]:
        if entry["action"] == "alloc":
            made[entry["addr"]] = len(blocks)
            blocks.append([entry["size"], -1, False])
        elif entry["action"] == "free_requested":
            if entry["addr"] in made:
                free_ordinal[made.pop(entry["addr"])] = frees
            frees += 1
    row_of = {}
    for r, row in enumerate(rows):
        for k in range(row[4], row[5]):
            row_of[k - start] = r
    for k, b in enumerate(blocks):
        b[1] = row_of.get(k, -1)
        if b[1] >= 0 and k in free_ordinal:
            b[2] = free_ordinal[k] < rows[b[1]][6] - start_freed
    with gzip.open(out / f"{name}.json.gz", "wt") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
                   "peak_reserved_bytes": stats["reserved_bytes.all.peak"], "start": start,
                   "rows": rows, "blocks": blocks}, f)
    print(name, "ops", len(rows), "blocks", len(blocks), "peak", stats["allocated_bytes.all.peak"])


def run(names: list[str], out_root: str) -> None:
    import torch

    card = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().split()[0]
    out = Path(out_root) / f"op_blocks_{card}"
    out.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "one", n, "--out", str(out)]) for n in names]
    for p in procs:
        p.wait()


def _memfit_name(op: str, scratch: bool) -> str:
    """The name memfit's trace gives what ``op`` took on the GPU: a convolution's scratch is cuDNN's workspace,
    and the trace's batch norm is the device-neutral one (it runs on the meta device)."""
    if scratch and op.startswith("convolution"):
        return "cudnn_workspace"
    return op.replace("cudnn_batch_norm", "native_batch_norm")


def compare(folder: str, name: str, min_mib: int) -> None:
    sys.path.insert(0, str(HERE.parent / "zoo"))
    from registry import entries

    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.loading import load_workload

    data = json.loads(gzip.decompress((Path(folder) / f"{name}.json.gz").read_bytes()))
    rows, floor = data["rows"], min_mib * MiB
    gpu: Counter[tuple[str, str, int]] = Counter()
    brief: Counter[tuple[str, str, int]] = Counter()
    example: dict[tuple[str, str], str] = {}
    for b in data["blocks"]:
        if b[0] >= floor and b[1] >= 0 and rows[b[1]][2] == 0:  # the first step
            op, ph = _memfit_name(rows[b[1]][0], b[2]), rows[b[1]][1]
            gpu[ph, op, b[0] // MiB] += 1
            brief[ph, op, b[0] // MiB] += b[2]
            example.setdefault((ph, op), f"{rows[b[1]][3]} {rows[b[1]][7]}")
    trace = trace_workload(load_workload(entries([name])[0].spec), gpu_spec(data["gpu"].lower().replace("nvidia", "").split()[0]))
    ours: Counter[tuple[str, str, int]] = Counter(
        (a.phase, a.op.removesuffix("_scratch"), a.nbytes // MiB) for a in trace.allocs
        if a.nbytes >= floor and a.step == 0)
    print(f"{name}: GPU {data['gpu']}, torch {data['torch']}; blocks of at least {min_mib} MiB in the first step")
    print("| phase | op | MiB | GPU | of them freed inside the op | memfit |\n|---|---|---|---|---|---|")
    for key in sorted(set(gpu) | set(ours)):
        if gpu[key] != ours[key]:
            print(f"| {key[0]} | {key[1]} | {key[2]} | {gpu[key]} | {brief[key]} | {ours[key]} |")
    print("\nFirst GPU call of each op above (autograd node, arguments):")
    for ph, op in sorted({(k[0], k[1]) for k in set(gpu) | set(ours) if gpu[k] != ours[k]}):
        if (ph, op) in example:
            print(f"- {ph} {op}: {example[ph, op]}")


def conv_backward(folder: str, name: str) -> None:
    """Each distinct convolution backward of the first step: its scratch blocks (freed inside the call) of at least
    1 MiB in order, the data gradient's then the filter gradient's, and how much larger the second is, also in
    units of the weight's fp32 size (a split-K reduction buffer would be a whole number of them)."""
    import math
    import re

    data = json.loads(gzip.decompress((Path(folder) / f"{name}.json.gz").read_bytes()))
    rows, per_row = data["rows"], defaultdict(list)
    for b in data["blocks"]:
        if b[1] >= 0 and b[2] and b[0] >= MiB:
            per_row[b[1]].append(b[0])
    print(f"{name} ({data['gpu']}, torch {data['torch']}): convolution backward scratch, first step")
    print("| weight | input | dtype | scratch blocks (B) | second - first (B) | / fp32 weight |\n|---|---|---|---|---|---|")
    seen = set()
    for r, row in enumerate(rows):
        if row[0] != "convolution_backward" or row[2] != 0:
            continue
        tensors = re.findall(r"(\w+)\[([\d, ]*)\]/", row[7])
        key = re.sub(r"/\[[\d, ]*\]", "", row[7])
        if key in seen or len(tensors) < 3:
            continue
        seen.add(key)
        (dtype, _), (_, x), (_, w) = tensors[:3]
        blocks = per_row.get(r, [])
        numel = math.prod(int(v) for v in w.split(","))
        diff = blocks[-1] - blocks[0] if len(blocks) == 2 else None
        ratio = f"{diff / (4 * numel):.2f}" if diff is not None else ""
        print(f"| [{w}] | [{x}] | {dtype} | {', '.join(map(str, blocks))} | {'' if diff is None else diff} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["run", "one", "compare", "conv_backward"])
    parser.add_argument("names")
    parser.add_argument("name", nargs="?")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--min-mib", type=int, default=64)
    args = parser.parse_args()
    if args.what == "run":
        run(args.names.split(","), args.out)
    elif args.what == "one":
        _one(args.names, Path(args.out))
    elif args.what == "conv_backward":
        conv_backward(args.names, args.name)
    else:
        compare(args.names, args.name, args.min_mib)


if __name__ == "__main__":
    main()
