"""Every allocation of cuDNN RNN calls, one by one: workspace, reserve and the rest, for memfit's cudnn_rnn rules.

The calibration grid of ``calibrate_cudnn.py --only rnn`` gives peaks per call (one hidden size for the standard
algorithm, no fp16, no autocast, no dropout, input size = hidden size). This records the caching allocator's trace
of each forward and backward call instead, so each buffer is seen with its own size and lifetime, over hidden sizes
128-1024, input sizes other than the hidden size, 1-3 layers, 1-2 directions, fp32 / fp16 modules, bf16 and fp16
autocast (the output dtype says what autocast ran), dropout between layers and the fp16 persistent algorithm.

    PYTHONPATH=$PWD/src python benchmarks/estimate/rnn_allocations.py            # GPU, about 3 minutes; -> $OUT
    python benchmarks/estimate/rnn_allocations.py --quick                        # list the grid, no GPU needed
    PYTHONPATH=$PWD/src python benchmarks/estimate/rnn_allocations.py --long     # beyond that range, ~1 minute
    PYTHONPATH=$PWD/src python benchmarks/estimate/rnn_allocations.py --dropout  # one-direction dropout, ~1 minute

Writes ``rnn_allocations_<card>_torch<X.Y>_<yyyymmdd>.json``: per case its shape, the output's dtype and strides,
and the ``[action, bytes]`` events of forward and of backward (alloc / free_completed, in order).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import RESULTS, card, stem  # noqa: E402

MODES = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN}
# (how the module runs, module dtype, autocast dtype)
PRECISIONS = {"fp32": (torch.float32, None), "fp16": (torch.float16, None),
              "autocast_bf16": (torch.float32, torch.bfloat16), "autocast_fp16": (torch.float32, torch.float16)}


def grid(quick: bool) -> list[dict]:
    cases = []
    shapes = [(64, 32), (256, 16), (128, 128)]  # (T, N)
    for mode, hidden, narrow, layers, directions, (seq, batch), precision in itertools.product(
            ("LSTM", "GRU"), (128, 256, 512, 1024), (False, True), (1, 2, 3), (1, 2), shapes, PRECISIONS):
        if (narrow and layers == 2) or (hidden == 1024 and layers == 3 and seq * batch > 8192 and precision == "fp32"):
            continue
        cases.append(dict(mode=mode, hidden=hidden, input_size=80 if narrow else hidden, layers=layers,
                          directions=directions, seq=seq, batch=batch, precision=precision, dropout=0.0))
    for mode, hidden, precision in itertools.product(("LSTM", "GRU"), (256, 1024), ("fp32", "autocast_bf16")):
        cases.append(dict(mode=mode, hidden=hidden, input_size=hidden, layers=3, directions=2, seq=128, batch=32,
                          precision=precision, dropout=0.1))  # the dropout state and any reserve change
    for hidden, seq in itertools.product((96, 256, 384), (100, 1000)):
        cases.append(dict(mode="RNN_TANH", hidden=hidden, input_size=hidden, layers=2, directions=1, seq=seq,
                          batch=16, precision="fp32", dropout=0.0))
    random.Random(0).shuffle(cases)  # a budget cut leaves an even sample
    return cases[:12] if quick else cases


def long_grid(quick: bool) -> list[dict]:
    """Where the main grid's rules are not measured: long sequences (one-direction LSTMs of 2+ layers take less
    workspace at T=500 than the rule), 4-6 layers, hidden sizes above 1024, narrow inputs at 2 layers."""
    cases = []
    for mode, layers, directions, seq, precision in itertools.product(
            ("LSTM", "GRU"), (2, 3), (1, 2), (256, 384, 512, 768, 1000), ("fp32", "autocast_bf16")):
        cases.append(dict(mode=mode, hidden=512, input_size=512, layers=layers, directions=directions, seq=seq,
                          batch=16, precision=precision, dropout=0.0))
    for mode, layers, directions in itertools.product(("LSTM", "GRU"), (4, 6), (1, 2)):
        cases.append(dict(mode=mode, hidden=256, input_size=256, layers=layers, directions=directions, seq=128,
                          batch=32, precision="fp32", dropout=0.0))
    for mode, hidden, directions in itertools.product(("LSTM", "GRU"), (1536, 2048), (1, 2)):
        cases.append(dict(mode=mode, hidden=hidden, input_size=hidden, layers=1, directions=directions, seq=64,
                          batch=32, precision="autocast_bf16", dropout=0.0))
    for mode, directions, precision in itertools.product(("LSTM", "GRU"), (1, 2), ("fp32", "fp16")):
        cases.append(dict(mode=mode, hidden=512, input_size=80, layers=2, directions=directions, seq=128, batch=32,
                          precision=precision, dropout=0.0))
    for hidden, input_size in ((512, 256), (256, 512)):  # the fp16 persistent LSTM with I != H
        cases.append(dict(mode="LSTM", hidden=hidden, input_size=input_size, layers=1, directions=1, seq=128,
                          batch=32, precision="fp16", dropout=0.0))
    random.Random(0).shuffle(cases)
    return cases[:12] if quick else cases


def dropout_grid(quick: bool) -> list[dict]:
    """Where the fit-side supplement (probe_cases.py, s1327_rnn_*) found the workspace rule 10-17 % under: dropout
    between the layers of one-direction RNNs (the main grid has dropout only with two directions), inputs narrower
    than 80, and bf16 at small hidden sizes (where the algorithm may be the persistent small-H one)."""
    cases = []
    shapes = [(64, 32), (256, 16), (128, 128)]  # (T, N)
    for mode, layers, directions, hidden, narrow, (seq, batch), precision in itertools.product(
            ("LSTM", "GRU"), (2, 3), (1, 2), (256, 1024), (False, True), shapes, ("fp32", "autocast_bf16")):
        cases.append(dict(mode=mode, hidden=hidden, input_size=40 if narrow else hidden, layers=layers,
                          directions=directions, seq=seq, batch=batch, precision=precision, dropout=0.1))
    for mode, layers, hidden, (seq, batch), precision in itertools.product(
            ("LSTM", "GRU"), (2, 3), (256, 1024), shapes, ("fp32", "autocast_bf16")):
        cases.append(dict(mode=mode, hidden=hidden, input_size=40, layers=layers, directions=1, seq=seq,
                          batch=batch, precision=precision, dropout=0.0))
    for mode, hidden, layers, (seq, batch), precision in itertools.product(
            ("LSTM", "GRU"), (96, 128, 160, 192), (1, 2), shapes[::2], ("autocast_bf16", "fp16")):
        cases.append(dict(mode=mode, hidden=hidden, input_size=hidden, layers=layers, directions=1, seq=seq,
                          batch=batch, precision=precision, dropout=0.0))
    random.Random(0).shuffle(cases)
    return cases[:12] if quick else cases


_MARK_BYTES = 1536 + 7  # an odd size nothing else asks for: marks where a phase starts in the ring buffer


def _mark() -> torch.Tensor:
    return torch.empty(_MARK_BYTES, dtype=torch.uint8, device="cuda")


def _events_since_mark() -> list[list]:
    from memfit import _torch_private as tp

    trace = tp.memory_snapshot()["device_traces"][0]
    start = max(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == _MARK_BYTES) + 1
    return [[e["action"], e["size"]] for e in trace[start:] if e["action"] in ("alloc", "free_completed")]


def run_case(c: dict) -> dict:
    dtype, autocast = PRECISIONS[c["precision"]]
    rnn = MODES[c["mode"]](c["input_size"], c["hidden"], c["layers"], batch_first=True, dropout=c["dropout"],
                           bidirectional=c["directions"] == 2).cuda().to(dtype)
    x = torch.randn(c["batch"], c["seq"], c["input_size"], device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.synchronize()
    mark = _mark()
    with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
        out, _ = rnn(x)
    torch.cuda.synchronize()
    forward = _events_since_mark()
    grad = torch.ones_like(out, memory_format=torch.contiguous_format)  # as a Linear's backward hands it over
    torch.cuda.synchronize()
    mark = _mark()
    torch.autograd.grad(out, (x, *rnn.parameters()), grad)
    torch.cuda.synchronize()
    backward = _events_since_mark()
    row = dict(c, out_dtype=str(out.dtype).removeprefix("torch."), out_stride=list(out.stride()),
               weights=sum(p.numel() for p in rnn.parameters()), forward=forward, backward=backward)
    del rnn, x, out, grad, mark
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "estimate"))
    parser.add_argument("--quick", action="store_true", help="list the grid (and run 12 cases if a GPU is there)")
    parser.add_argument("--budget-s", type=float, default=210.0, help="stop starting new cases after this long")
    parser.add_argument("--long", action="store_true", help="the grid beyond the main one's range (long_grid)")
    parser.add_argument("--dropout", action="store_true", help="one-direction dropout, narrow inputs, bf16 small H")
    args = parser.parse_args()
    cases = (long_grid(args.quick) if args.long else dropout_grid(args.quick) if args.dropout
             else grid(args.quick))
    print(f"{len(cases)} cases")
    if not torch.cuda.is_available():
        print("no GPU: nothing measured")
        return
    from memfit import _torch_private as tp

    torch.backends.cudnn.benchmark = False
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")  # cuBLAS workspace out of the way
    tp.record_memory_history(True, max_entries=20_000)  # a ring buffer: a snapshot stays cheap
    started, rows = time.perf_counter(), []
    for c in cases:
        if time.perf_counter() - started > args.budget_s:
            break
        try:
            rows.append(run_case(c))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append(dict(c, error="out of memory"))
    tp.record_memory_history(False)
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "date": dt.date.today().isoformat(),
              "cases_planned": len(cases), "elapsed_s": round(time.perf_counter() - started, 1), "rows": rows}
    name = "rnn_allocations_long" if args.long else "rnn_allocations_dropout" if args.dropout else "rnn_allocations"
    path = Path(args.out) / f"{stem(name, card(props.name), torch.__version__)}.json"
    path.write_text(json.dumps(result))
    print(f"{len(rows)} of {len(cases)} cases -> {path}")


if __name__ == "__main__":
    main()
