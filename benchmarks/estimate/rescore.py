"""Every GPU-measured step estimated again by this tree, set beside its measured peak and ``fits_in`` (CPU).

    PYTHONPATH=src:benchmarks python benchmarks/estimate/rescore.py --out rows.jsonl -j 2     # all measured steps
    python benchmarks/estimate/rescore.py --report rows.jsonl --out FILE.md                    # the tables

The steps: every measurement folder under ``benchmarks/results/estimate`` (the corpus on H100 and H200, the zoo and
its draws), the last folder of a name winning. A step is estimated once per GPU it was measured on, in a worker
process that estimates many (imports once); a row per step, appended as it is done, so an interrupted run resumes
(``--out`` is read first and its steps skipped). The report splits them as the results must be read: the corpus's
validation half (which tuned nothing), its fit half, the zoo and each draw (which tuned nothing until their own
report named a change made after seeing them). Needs the zoo's model libraries.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
RESULTS = BENCH / "results" / "estimate"
sys.path.insert(0, str(BENCH / "zoo"))


def steps() -> list[dict]:
    """One per (step, GPU, allocator setting) measured: the last measurement folder holding it wins. A step measured
    under a ``PYTORCH_CUDA_ALLOC_CONF`` (the twelfth draw, zoo/allocator_draw.py) is a step of its own, estimated
    under the same setting."""
    found: dict[tuple[str, str, str | None], dict] = {}
    for folder in sorted(RESULTS.glob("*measurements*")):
        if folder.name.startswith("measurements_"):
            continue  # the 14-workload suite: not zoo or corpus specs
        gpu = "h100" if "_h100_" in folder.name else "h200"
        for path in sorted(folder.glob("*.json")):
            m = json.loads(path.read_text())
            if not m.get("fits_in_bytes"):
                continue
            conf = m.get("allocator_conf")
            found[path.stem, gpu, conf] = {
                "name": path.stem, "gpu": gpu, "measured": str(path.relative_to(BENCH.parent)),
                "corpus": folder.name.startswith("corpus"), "meas_fit": m["fits_in_bytes"],
                "meas_alloc": m["peak_allocated_bytes"], **({"allocator_conf": conf} if conf else {}),
            }
    return list(found.values())


def _spec(step: dict) -> str:
    if step["corpus"]:
        return f"{BENCH / 'corpus' / 'corpus.py'}:{step['name']}"
    from registry import entries

    return entries([step["name"]])[0].spec


def _one(step: dict, precisions: tuple[str, ...] = ()) -> dict | None:
    import torch

    from memfit.estimate.allocator_config import AllocatorConfig
    from memfit.estimate.predict import estimate
    from memfit.workload.loading import load_workload

    row = dict(step)
    started = time.perf_counter()
    # as in a fresh process: a step before it in this worker may have turned benchmark mode or deterministic
    # algorithms on (zoo/cudnn_benchmark.py, zoo/deterministic.py)
    torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
    torch.use_deterministic_algorithms(False)
    try:
        workload = load_workload(_spec(step))
        if precisions and workload.precision not in precisions:
            return None
        conf = step.get("allocator_conf")
        est = estimate(workload, gpu=step["gpu"], allocator=AllocatorConfig.from_env(conf) if conf else None)
        row.update(fits_in=est.fits_in_bytes, alloc=est.peak_allocated_bytes, upper=est.fits_in_upper_bytes,
                   reasons=[u.reason for u in est.uncertainty])
    except BaseException as exc:  # a row, not a crash: the report counts them
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def _split() -> dict[str, str]:
    """Corpus id -> "fit" or "validation" (benchmarks/corpus/corpus.json)."""
    corpus = json.loads((BENCH / "corpus" / "corpus.json").read_text())
    return {c["id"]: c["split"] for c in corpus["entries"]}


_VARIANT_DRAWS = {"cb": "thirteenth draw (cudnn.benchmark)", "det": "fourteenth draw (deterministic algorithms)",
                  "det2": "fifteenth draw (deterministic algorithms)",
                  "det3": "sixteenth draw (deterministic algorithms)",
                  "det4": "seventeenth draw (deterministic algorithms)"}
"""The name prefixes of the draws made of zoo steps under a process-wide setting (zoo/variants.py)."""


def _set(row: dict, halves: dict[str, str]) -> str:
    if row["corpus"]:
        return f"corpus {halves.get(row['name'], '?')} half"
    if row.get("allocator_conf"):
        return f"twelfth draw ({row['allocator_conf']})"
    prefix = row["name"].split("_")[0]
    if prefix in _VARIANT_DRAWS:
        return _VARIANT_DRAWS[prefix]
    if prefix.startswith("h") and prefix[1:].isdigit():
        return f"draw {prefix[1:]}"
    return "first draw (ho_)" if prefix == "ho" else "zoo"


def report(rows: list[dict], title: str) -> str:
    halves = _split()
    lines = [f"# {title}", "", "| set | GPU | steps | errors | fits_in median abs | max abs | most negative | "
             "upper below measured | upper median above |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((_set(r, halves), r["gpu"]), []).append(r)
    for (name, gpu), rs in sorted(groups.items()):
        ok = [r for r in rs if "error" not in r]
        err = [100 * (r["fits_in"] / r["meas_fit"] - 1) for r in ok]
        up = [100 * (r["upper"] / r["meas_fit"] - 1) for r in ok]
        if not ok:
            lines.append(f"| {name} | {gpu} | {len(rs)} | {len(rs)} | | | | | |")
            continue
        lines.append(f"| {name} | {gpu} | {len(rs)} | {len(rs) - len(ok)} | {statistics.median(map(abs, err)):.1f} % | "
                     f"{max(map(abs, err)):.1f} % | {min(err):+.1f} % | {sum(1 for u in up if u < 0)} | "
                     f"{statistics.median(up):+.1f} % |")
    lines += ["", "Steps whose `fits_in` is more than 5 % off, or whose upper bound is below the measured `fits_in`:", "",
              "| step | GPU | set | fits_in | upper | reasons |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["name"]):
        if "error" in r:
            lines.append(f"| {r['name']} | {r['gpu']} | {_set(r, halves)} | error: {r['error'][:80]} | | |")
            continue
        e, u = r["fits_in"] / r["meas_fit"] - 1, r["upper"] / r["meas_fit"] - 1
        if abs(e) > 0.05 or u < 0:
            lines.append(f"| {r['name']} | {r['gpu']} | {_set(r, halves)} | {100 * e:+.1f} % | {100 * u:+.1f} % | "
                         f"{', '.join(r['reasons'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="rows (JSON lines) to append to, or the report's Markdown file")
    parser.add_argument("-j", type=int, default=2)
    parser.add_argument("--report", help="the rows to report (JSON lines)")
    parser.add_argument("--title", default="Every measured step, estimated again")
    parser.add_argument("--precision", default="", help="only these precisions (comma-separated: a change that only "
                        "half precision can feel)")
    args = parser.parse_args()
    if args.report:
        rows = [json.loads(line) for line in Path(args.report).read_text().splitlines() if line.strip()]
        Path(args.out).write_text(report(rows, args.title))
        return
    out = Path(args.out)
    def key(r: dict) -> tuple[str, str, str | None]:
        return r["name"], r["gpu"], r.get("allocator_conf")

    done = {key(r) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    todo = [s for s in steps() if key(s) not in done]
    precisions = tuple(p for p in args.precision.split(",") if p)
    with cf.ProcessPoolExecutor(args.j) as pool, out.open("a") as f:
        for row in pool.map(partial(_one, precisions=precisions), todo):
            if row is None:
                continue
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(row["name"], row["gpu"], row.get("error", ""), row["seconds"], flush=True)


if __name__ == "__main__":
    main()
