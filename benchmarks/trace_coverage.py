"""Which zoo training steps ``memfit estimate`` can trace on this CPU machine, and why the others fail.

Each entry runs as ``python -m memfit.cli estimate benchmarks/zoo/<module>.py:NAME --json --gpu h100`` in a fresh
process with a timeout; the result records whether it traced, the exit code, the one-line error and its failure
class, the wall time and the estimate's key fields. Writes
``benchmarks/results/estimate/trace_coverage_cpu_torch<major.minor>_<yyyymmdd>.{json,md}``.

    python benchmarks/trace_coverage.py -j 2                       # the whole zoo (~20 min on 2 cores)
    python benchmarks/trace_coverage.py --family monai --names smp_unet_r34_issue13
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "zoo"))
sys.path.insert(0, str(HERE))
from registry import ZooEntry, entries  # noqa: E402

from _results import stem as result_stem  # noqa: E402

FAILURE_CLASSES = (
    "frozen params", "values-read-as-0", "data-dependent shapes", "meta-stricter-than-CUDA", "sparse", "compile",
    "timeout", "missing library", "other",
)
"""Why a trace failed, first matching rule wins (``classify``)."""

# (class, pattern over the error text): ordered, the first that matches names the class. The patterns come from
# the errors this zoo produced (benchmarks/results/estimate/trace_coverage_*.md lists each with its entry).
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("compile", re.compile(r"dynamo|inductor|torch\.compile|OptimizedModule|compil", re.I)),
    ("sparse", re.compile(r"sparse|Sparse(CPU|CUDA|Meta)", re.I)),
    ("frozen params", re.compile(r"does(n't| not) require grad|requires_grad|frozen|no grad_fn", re.I)),
    ("data-dependent shapes", re.compile(
        r"output size depends on tensor values|data[- ]dependent|DynamicOutputShape|nonzero|masked_select|"
        r"unique", re.I)),
    # MONAI's DiceLoss reduces over torch.arange(2, ndim).tolist(): read as zeros, the dims repeat
    ("values-read-as-0", re.compile(
        r"duplicate value in the list of dims|read(s)? (as )?0|\.item\(\)|tolist|greater than 0|division by zero|must be positive|"
        r"Length of all samples|lengths", re.I)),
    # _grouped_mm's meta kernel refuses fp32 inputs that the CPU kernel takes
    ("meta-stricter-than-CUDA", re.compile(r"\bmeta\b|Meta|FakeTensor|fake tensor|Expected (inputs of BF16|mat_a)", re.I)),
)


def classify(error: str) -> str:
    """The failure class of one error line (``other`` when no rule matches)."""
    for name, pattern in _RULES:
        if pattern.search(error):
            return name
    return "other"


def _error_line(stderr: str) -> str:
    """memfit's one-line ``memfit: error: ...``, else the last line that looks like an exception."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("memfit: error:"):
            return ln.removeprefix("memfit: error:").strip()
    for ln in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln):
            return ln
    return lines[-1] if lines else "no output"


def _warning_classes(warnings: list[str]) -> list[str]:
    """Classes of the estimate's own warnings: a step that traced with values read as 0 may be mis-estimated."""
    return sorted({classify(w) for w in warnings} - {"other"})


def run_one(entry: ZooEntry, gpu: str, timeout_s: float) -> dict[str, Any]:
    """Estimate one entry in a fresh process; never raises."""
    record: dict[str, Any] = {"name": entry.name, "module": entry.module, "library": entry.library,
                              "tags": list(entry.tags), "spec": f"benchmarks/zoo/{entry.module}:{entry.name}"}
    missing = entry.missing()
    if missing:
        return {**record, "traced": False, "exit_code": None, "failure_class": "missing library",
                "error": f"not installed: {', '.join(missing)}", "wall_s": 0.0}
    cmd = [sys.executable, "-m", "memfit.cli", "estimate", entry.spec, "--json", "--gpu", gpu]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {**record, "traced": False, "exit_code": None, "failure_class": "timeout",
                "error": f"no result after {timeout_s:.0f} s", "wall_s": timeout_s}
    wall = time.perf_counter() - started
    record.update(exit_code=proc.returncode, wall_s=round(wall, 2))
    if proc.returncode != 0:
        error = _error_line(proc.stderr)
        return {**record, "traced": False, "failure_class": classify(error), "error": error,
                "stderr_tail": proc.stderr[-1500:]}
    try:
        est = json.loads(proc.stdout[proc.stdout.index("{"):])
    except ValueError:
        return {**record, "traced": False, "failure_class": "other", "error": "exit 0 but no JSON on stdout",
                "stderr_tail": proc.stderr[-1500:]}
    keys = ("peak_allocated_bytes", "peak_reserved_bytes", "fits_in_bytes", "fits_in_replay_bytes", "device_bytes",
            "breakdown", "peak_phase", "peak_step", "peak_op", "peak_module", "batch_size", "precision",
            "param_count", "warnings", "elapsed_s")
    # an upper bound, where the estimator gives one (issue 13), is kept whatever its name
    extra = [k for k in est if "upper" in k or "bound" in k or k == "uncertainty"]
    return {**record, "traced": True, "failure_class": None, "error": "",
            "warning_classes": _warning_classes(est.get("warnings", [])),
            "estimate": {k: est.get(k) for k in (*keys, *extra)}}


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "torchvision", "timm", "transformers", "monai", "segmentation-models-pytorch",
                 "dynamic-network-architectures", "peft"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _gib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**30:.2f}"


def markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    s = summary
    lines = [
        f"# Trace coverage of `memfit estimate` over the zoo ({s['date']})",
        "",
        f"{s['traced']} of {s['total']} zoo entries traced on a {s['machine']} "
        f"(torch {s['versions']['torch']}; " + ", ".join(f"{k} {v}" for k, v in s["versions"].items()
                                                          if k != "torch") + "). "
        f"One fresh `python -m memfit.cli estimate benchmarks/zoo/<module>.py:NAME --json --gpu {s['gpu']}` "
        f"process per entry, {s['timeout_s']:.0f} s timeout, {s['jobs']} at a time (wall times include imports "
        "and the other jobs sharing the cores). Script: `benchmarks/trace_coverage.py`."
        + (f" Every estimate ran with `PYTORCH_CUDA_ALLOC_CONF={s['allocator_conf']}`."
           if s.get("allocator_conf") else ""),
        "",
        "## Totals per library",
        "",
        "| library | entries | traced | failed | failure classes |",
        "|---|---|---|---|---|",
    ]
    for lib, t in s["by_library"].items():
        classes = ", ".join(f"{k} {v}" for k, v in t["classes"].items()) or "—"
        lines.append(f"| {lib} | {t['total']} | {t['traced']} | {t['total'] - t['traced']} | {classes} |")
    lines += ["", "## Failure classes", "", "| class | entries | example (entry: error) |", "|---|---|---|"]
    for cls, names in s["by_class"].items():
        first = next(r for r in rows if r["name"] == names[0])
        lines.append(f"| {cls} | {len(names)} | `{first['spec']}`: {first['error'][:200]} |")
    if s.get("note"):
        lines += ["", s["note"]]
    lines += [
        "", "## Every entry", "",
        "| entry | library | traced | class | peak alloc GiB | fits in GiB | phase / op | wall s | error or warnings |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r.get("estimate") or {}
        note = r["error"][:160] if not r["traced"] else "; ".join(r.get("warning_classes") or [])
        where = f"{e.get('peak_phase')} / {e.get('peak_op')}" if r["traced"] else "—"
        lines.append(
            f"| {r['name']} | {r['library']} | {'yes' if r['traced'] else 'no'} | {r.get('failure_class') or '—'} | "
            f"{_gib(e.get('peak_allocated_bytes'))} | {_gib(e.get('fits_in_bytes'))} | {where} | "
            f"{r.get('wall_s', 0):.1f} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    by_lib: dict[str, dict[str, Any]] = defaultdict(lambda: {"total": 0, "traced": 0, "classes": Counter()})
    by_class: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        t = by_lib[r["library"]]
        t["total"] += 1
        t["traced"] += bool(r["traced"])
        if not r["traced"]:
            t["classes"][r["failure_class"]] += 1
            by_class[r["failure_class"]].append(r["name"])
    return {
        "date": dt.date.today().isoformat(), "gpu": args.gpu, "timeout_s": args.timeout, "jobs": args.jobs,
        "machine": f"{os.cpu_count()}-core CPU machine without a GPU", "versions": _versions(),
        # every estimate inherits it and replays under it (AllocatorConfig.from_env)
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "total": len(rows), "traced": sum(bool(r["traced"]) for r in rows),
        "by_library": {k: {**v, "classes": dict(v["classes"].most_common())} for k, v in by_lib.items()},
        "by_class": dict(sorted(by_class.items(), key=lambda kv: -len(kv[1]))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", help="comma-separated entry names")
    parser.add_argument("--family", help="a library, module stem or tag (e.g. timm, torch_features, issue13)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="estimates at a time (2 cores here: 1 or 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per estimate")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--out", default=str(HERE / "results" / "estimate"))
    parser.add_argument("--tag", default="", help="suffix for the result files (e.g. 'subset')")
    parser.add_argument("--note", help="a paragraph for the report, under the failure classes")
    parser.add_argument("--reclassify", help="an earlier result JSON: classify its failures again with the current "
                                             "rules and rewrite it (and its .md), running nothing")
    parser.add_argument("--update", help="an earlier result JSON: re-run the chosen entries, keep its other rows, "
                                         "and rewrite it (and its .md) in place; with --tag, write "
                                         "<its stem>_<tag>.{json,md} beside it instead and leave it as it is")
    args = parser.parse_args()

    if args.reclassify:
        data = json.loads(Path(args.reclassify).read_text())
        args.jobs, args.timeout = data["summary"]["jobs"], data["summary"]["timeout_s"]
        for r in data["rows"]:
            if not r["traced"] and r["failure_class"] not in ("timeout", "missing library"):
                r["failure_class"] = classify(r["error"])
        data["summary"].update({k: v for k, v in summarise(data["rows"], args).items()
                                if k in ("by_library", "by_class", "total", "traced")})
        if args.note:
            data["summary"]["note"] = args.note
        stem = args.reclassify.removesuffix(".json")
        Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
        Path(f"{stem}.md").write_text(markdown(data["summary"], data["rows"]))
        print(f"reclassified: {data['summary']['by_class'].keys()}")
        return
    chosen = entries(args.names.split(",") if args.names else None, args.family)
    print(f"{len(chosen)} entries, {args.jobs} at a time", flush=True)

    def one(entry: ZooEntry) -> dict[str, Any]:
        r = run_one(entry, args.gpu, args.timeout)
        state = "traced" if r["traced"] else f"FAILED [{r['failure_class']}] {r['error'][:150]}"
        print(f"{entry.name}: {state} ({r.get('wall_s', 0):.1f} s)", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(one, chosen))
    if args.update:
        fresh = {r["name"]: r for r in rows}
        earlier_data = json.loads(Path(args.update).read_text())
        earlier = earlier_data["rows"]
        # the run's settings stay the full run's; the re-run rows carry their own wall times
        args.jobs, args.timeout = earlier_data["summary"]["jobs"], earlier_data["summary"]["timeout_s"]
        known = {r["name"] for r in earlier}
        rows = [fresh.get(r["name"], r) for r in earlier] + [r for r in rows if r["name"] not in known]
    summary = summarise(rows, args)
    if args.note:
        summary["note"] = args.note
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (result_stem("trace_coverage", "cpu", torch.__version__) + (f"_{args.tag}" if args.tag else ""))
    if args.update:
        stem = Path(args.update.removesuffix(".json") + (f"_{args.tag}" if args.tag else ""))
    # not Path.with_suffix: the torch version's dots would count as a suffix
    Path(f"{stem}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    Path(f"{stem}.md").write_text(markdown(summary, rows))
    print(f"traced {summary['traced']} of {summary['total']}; wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
