"""A zoo step's GPU allocator stream and memfit's trace of it, aligned phase by phase: which short-lived blocks make
their capped replays differ (CPU).

    PYTHONPATH=src:benchmarks python benchmarks/estimate/align_streams.py ARCHIVE NAME [--patch all] [--gpu h200]

ARCHIVE is a ``trace_entries.py --zoo`` tar.gz holding ``NAME.json.gz`` (an uncapped run). The GPU stream's phases
(forward, loss, backward, optimizer of each step) are found from its Python frames, memfit's from its phase marks;
within each phase the two are aligned by their blocks' signs and sizes in MiB (``difflib``). Where the two differ only
by short-lived blocks (each freed right after it was made: library workspaces and scratch), memfit's trace takes the
GPU's blocks there (``--patch``: ``all``, or only a phase's: ``forward``, ``backward``, ``loss``, ``optimizer``).
Printed: the smallest cap each stream fits in with short-lived blocks optional (a workspace the library may do
without, as the estimate replays them; the GPU's: its blocks freed within two events), memfit's after the patch, and
the differences by kind. If the patched trace needs what the GPU stream needs, the short-lived blocks are the whole
difference.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "zoo"))
from replay_capped import _events, short_lived  # noqa: E402

OPTIMIZER_FRAMES = ("unscale_", "adam", "sgd", "optim", "lamb", "lion")


def _gpu_phases(raw: list, events: list) -> list[tuple[int, str]]:
    """(index into ``events``, phase) where each phase of the GPU stream begins, from its top Python frames."""
    marks, prev = [], None
    for i, (action, _, _, frame, *_) in enumerate(raw):
        phase = None
        if "conv.py" in frame and prev != "forward" or "linear.py" in frame and prev in (None, "optimizer"):
            phase = "forward"
        elif prev == "forward" and any(x in frame for x in ("cross_entropy", "loss")):
            phase = "loss"
        elif prev == "loss" and frame == "" and action == "alloc":
            phase = "backward"
        elif prev == "backward" and action == "alloc" and any(x in frame for x in OPTIMIZER_FRAMES):
            phase = "optimizer"
        if phase:
            at = next(j for j, (_, key, _) in enumerate(events) if key >= i)
            marks.append((at, phase))
            prev = phase
    return marks


def _tokens(events: list, sizes: dict) -> list[tuple[str, int]]:
    out = []
    for op, key, nbytes in events:
        if op > 0:
            sizes[key] = nbytes
        out.append(("+" if op > 0 else "-", sizes[key] >> 20))
    return out


def _short_lived(events: list) -> bool:
    return len(events) % 2 == 0 and all(
        events[i][0] > 0 and events[i + 1][0] < 0 and events[i + 1][1] == events[i][1] for i in range(0, len(events), 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive")
    parser.add_argument("name")
    parser.add_argument("--patch", default="all", choices=["all", "forward", "loss", "backward", "optimizer", "none"])
    parser.add_argument("--gpu", default="h200")
    args = parser.parse_args()
    from registry import entries

    from memfit.estimate.allocator import smallest_fitting_capacity
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload
    from memfit.workload.loading import load_workload

    with tarfile.open(args.archive) as tar:
        raw = json.loads(gzip.decompress(tar.extractfile(f"{args.name}.json.gz").read()))["events"]  # type: ignore[union-attr]
    brief = short_lived(raw)
    gpu = [(2 if op == 1 and key in brief and n >= 1 << 20 else op, key, n) for op, key, n in _events(raw)]
    trace = trace_workload(load_workload(entries([args.name])[0].spec), gpu_spec(args.gpu))
    ours = trace.events()
    g_marks = _gpu_phases(raw, gpu)
    m_marks = [(at, ph) for at, ph, _ in trace.phase_marks if ph in ("forward", "loss", "backward", "optimizer")]
    if [p for _, p in g_marks] != [p for _, p in m_marks]:
        sys.exit(f"the phases differ: GPU {[p for _, p in g_marks]}, memfit {[p for _, p in m_marks]}")
    g_sizes: dict[int, int] = {}
    m_sizes: dict[int, int] = {}
    g_tok, m_tok = _tokens(gpu, g_sizes), _tokens(ours, m_sizes)
    g_ends = [at for at, _ in g_marks[1:]] + [len(gpu)]
    m_ends = [at for at, _ in m_marks[1:]] + [len(ours)]
    patched = list(ours[:m_marks[0][0]])
    kinds: Counter[str] = Counter()
    fresh = len(trace.allocs)
    for (g0, phase), g1, (m0, _), m1 in zip(g_marks, g_ends, m_marks, m_ends):
        matcher = difflib.SequenceMatcher(a=g_tok[g0:g1], b=m_tok[m0:m1], autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            g_part, m_part = gpu[g0 + i1:g0 + i2], ours[m0 + j1:m0 + j2]
            if tag == "equal":
                patched += m_part
                continue
            kinds[f"{phase}: GPU {g_tok[g0 + i1:g0 + i2][:3]} / memfit {m_tok[m0 + j1:m0 + j2][:3]}"] += 1
            if args.patch in ("all", phase) and _short_lived(g_part) and _short_lived(m_part):
                for i in range(0, len(g_part), 2):
                    fresh += 1
                    patched += [(g_part[i][0], fresh, g_part[i][2]), (-1, fresh, 0)]
            else:
                patched += m_part
    print(f"{args.name}: smallest fitting cap, short-lived blocks optional: GPU stream "
          f"{smallest_fitting_capacity(gpu) / 1e9:.3f} GB, memfit's trace {smallest_fitting_capacity(ours) / 1e9:.3f} GB, "
          f"memfit's with the GPU's short-lived blocks ({args.patch}) {smallest_fitting_capacity(patched) / 1e9:.3f} GB")
    print("\n| times | where the streams differ (MiB; + made, - freed) |\n|---|---|")
    for kind, n in kinds.most_common(30):
        print(f"| {n} | {kind} |")


if __name__ == "__main__":
    main()
