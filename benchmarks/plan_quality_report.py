"""Merge plan_quality predictions and the measured grid into plan_quality_<card>_torch<X.Y>_<date>.{json,md}.

    python benchmarks/plan_quality_report.py --replanned \
        --predictions benchmarks/results/plan/plan_predictions_cpu_20261126 \
        --measurements benchmarks/results/plan/plan_grid_h200_torch2.11_20261126 --out benchmarks/results/plan

The name's card, torch and date are the grid's (the measurement's), so the same inputs give the same file.
``--replanned`` when the plans were made after the grid was measured: whether a plan fits is then read off the
grid's capped runs (``plan_quality.py verify`` runs the plans themselves under their caps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import card, stem  # noqa: E402


def _key(cfg: dict) -> tuple:
    return (cfg["batch_size"], cfg["accumulation_steps"], tuple(cfg["checkpoint"]), cfg["optimizer_impl"],
            bool(cfg["channels_last"]))


def _plan_key(cfg: dict) -> tuple:
    return (cfg["micro_batch"], cfg["accumulation_steps"], tuple(cfg["checkpoint"]), cfg["optimizer_impl"],
            bool(cfg["channels_last"]))


def _label(k: tuple) -> str:
    micro, acc, ckpt, impl, cl = k
    return f"{micro}×{acc}, ckpt {len(ckpt)}, {impl}" + (", channels_last" if cl else "")


def report(pred_dir: Path, meas_dir: Path, *, replanned: bool = False) -> dict:
    """``replanned``: the predictions were made after the measurement (the plans' own capped runs are then of
    other configurations): whether a plan fits is read off the grid's capped runs instead."""
    out: dict = {"models": []}
    for meas_file in sorted(meas_dir.glob("plan_quality_*.json")):
        m = json.loads(meas_file.read_text())
        p = json.loads((pred_dir / f"{m['model']}.json").read_text())
        grid = {_key(r["config"]): r for r in m["grid"]}
        rows = []
        for i, (budget, entry) in enumerate(zip(p["budgets"], p["plans"], strict=True)):
            fitting = [(r["time"]["samples_per_s"], k) for k, r in grid.items() if r["fits"][i] and r.get("time")]
            best_sps, best_key = max(fitting) if fitting else (None, None)
            row = {"budget_bytes": budget, "cap_bytes": m["caps"][i], "best": _label(best_key) if best_key else None,
                   "best_samples_per_s": best_sps}
            if "plan" in entry:
                cfg = entry["plan"]["chosen"]["config"]
                key = _plan_key(cfg)
                g = grid.get(key)
                sps = g["time"]["samples_per_s"] if g and g.get("time") else None
                run = None if replanned else m["plan_runs"][i]
                row.update({
                    "plan": _label(key) + (", expandable_segments" if cfg.get("expandable_segments") else ""),
                    "plan_samples_per_s": sps,
                    "ratio": sps / best_sps if sps and best_sps else None,
                    "plan_ran_under_cap": run["ok"] if run else (g["fits"][i] if g else None),
                    "fit_checked_by": "grid (in-process capped run)" if replanned else "fresh process under the cap",
                    "plan_grid_fits": g["fits"][i] if g else None,
                    "planning_s": entry["planning_s"],
                    "predicted_device_bytes": entry["plan"]["chosen"]["device_bytes"],
                    "measured_peak_reserved_bytes": run["peak_reserved_bytes"] if run else None,
                })
            else:
                row["plan_error"] = entry.get("error")
            # plain halving, read off the grid: micro-batch eff, eff/2, ... (no checkpointing, foreach, NCHW)
            eff = p["effective_batch"]
            micro, tries = eff, 0
            while micro >= 1:
                tries += 1
                g = grid.get((micro, eff // micro, (), "foreach", False))
                if g and g["fits"][i]:
                    break
                micro //= 2
            hg = grid.get((micro, eff // micro, (), "foreach", False)) if micro >= 1 else None
            row["halving"] = {"micro_batch": micro if micro >= 1 else None, "tries": tries,
                              "samples_per_s": hg["time"]["samples_per_s"] if hg and hg.get("time") else None}
            lightning = (m.get("lightning") or [None] * 4)[i]
            if lightning:
                row["lightning"] = lightning
            rows.append(row)
        out["models"].append({"model": m["model"], "gpu": m["gpu"], "torch": m["torch"], "cuda": m["cuda"],
                              "date": m["date"], "effective_batch": p["effective_batch"], "grid_size": len(grid),
                              "grid_s": m["grid_s"], "rows": rows})
    return out


def markdown(r: dict) -> str:
    g = 2**30
    lines = ["# Plan quality: memfit plan vs an exhaustive measured grid", ""]
    for mod in r["models"]:
        lines += [f"## {mod['model']} (effective batch {mod['effective_batch']}) — {mod['gpu']}, torch {mod['torch']}, "
                  f"CUDA {mod['cuda']}, {mod['date']}", "",
                  f"Grid: {mod['grid_size']} configurations measured in {mod['grid_s']:.0f} s.", "",
                  "| budget | best in grid (samples/s) | memfit plan (samples/s) | plan / best | plan ran under cap "
                  "| planning (2-core CPU) | halving: micro (samples/s, tries) |",
                  "|---|---|---|---|---|---|---|"]
        for row in mod["rows"]:
            h = row["halving"]
            best = f"{row['best']} ({row['best_samples_per_s']:.1f})" if row["best"] else "nothing fits"
            if "plan" in row:
                plan = f"{row['plan']} ({row['plan_samples_per_s']:.1f})" if row["plan_samples_per_s"] else row["plan"]
                ratio = f"{row['ratio']:.1%}" if row["ratio"] else "—"
                ran = "yes" if row["plan_ran_under_cap"] else "**no**"
                planning = f"{row['planning_s']:.1f} s"
            else:
                plan, ratio, ran, planning = f"error: {row['plan_error']}", "—", "—", "—"
            halving = (f"{h['micro_batch']} ({h['samples_per_s']:.1f}, {h['tries']})" if h["samples_per_s"]
                       else f"none ({h['tries']})")
            lines.append(f"| {row['budget_bytes'] / g:.2f} GiB | {best} | {plan} | {ratio} | {ran} | {planning} | "
                         f"{halving} |")
        lines.append("")
    return "\n".join(lines)


def retime_markdown(paths: list[Path]) -> str:
    """The ``retime`` stage's runs: per budget the plan against each of the grid's fastest fitting configurations,
    timed in the same interleaved rounds. ``median ratio`` is the ratio of medians; ``paired`` the median over
    rounds of plan / rival in the same round (the machine's speed drifts between rounds, and pairing cancels it),
    against the rival it fares worst with."""
    import statistics

    lines = []
    for path in paths:
        d = json.loads(path.read_text())
        sps = d["samples_per_s"]
        lines += [f"### {d['model']}: {d['rounds']} rounds × {d['repeats']} micro-batches — {d['gpu']}, "
                  f"torch {d['torch']}, {d['date']} (`{path.parent.name}/{path.name}`)", "",
                  "| budget | plan | plan samples/s (median) | fastest rival by median | ratio of medians "
                  "| paired ratio, worst rival | round-to-round spread of the plan |", "|---|---|---|---|---|---|---|"]
        for b in d["budgets"]:
            plan = sps[b["plan"]]
            rivals = [k for k in b["grid_top"] if k != b["plan"]]
            paired = {k: statistics.median(p / r for p, r in zip(plan, sps[k], strict=True)) for k in rivals}
            worst = min(paired, key=paired.get) if paired else None
            best = max(b["grid_top"], key=lambda k: statistics.median(sps[k]))
            lines.append(
                f"| {b['budget_bytes'] / 2**30:.2f} GiB | {_label(_key(json.loads(b['plan'])))} | "
                f"{statistics.median(plan):.1f} | {_label(_key(json.loads(best)))} ({statistics.median(sps[best]):.1f})"
                f" | {statistics.median(plan) / statistics.median(sps[best]):.1%} | "
                + (f"{paired[worst]:.1%} ({_label(_key(json.loads(worst)))})" if worst else "—")
                + f" | {min(plan):.0f}–{max(plan):.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--predictions", required=True)
    parser.add_argument("--measurements", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", help="file name without suffix; default plan_quality_<card>_torch<X.Y>_<date>")
    parser.add_argument("--replanned", action="store_true")
    parser.add_argument("--retime", nargs="*", default=[], help="plan_retime_*.json files: print their table")
    args = parser.parse_args()
    if args.retime:
        print(retime_markdown([Path(p) for p in args.retime]))
        return
    r = report(Path(args.predictions), Path(args.measurements), replanned=args.replanned)
    first = r["models"][0]
    args.name = args.name or stem("plan_quality", card(first["gpu"]), first["torch"], first["date"])
    Path(args.out, f"{args.name}.json").write_text(json.dumps(r, indent=1))
    Path(args.out, f"{args.name}.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
