"""The markdown tables of issue 15's device numbers: plan ÷ best of the exhaustive sweep, and the patch search
under caps, from the JSON the device stages wrote.

    python benchmarks/plan/sweep_report.py \\
        --sweep benchmarks/results/plan/plan_sweep_h100_torch2.11_20261126 \\
        --patch benchmarks/results/plan/patch_caps_h100_torch2.11_20261126.json --out <file>.md

``--sweep`` takes one or more folders of ``plan_sweep_<workload>.json`` (``plan/sweep_device.py sweep``);
``--patch`` the file ``plan/patch_caps_device.py run`` wrote. Without ``--out`` the tables go to stdout. Reading only:
nothing here measures, so any machine makes the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET = 0.97  # issue 15, "Numbers it must reach": plan ÷ best >= 0.97 in every cell
# the models the speed model's constants were fitted on (memfit/speed/step_time.py: SpeedParams), for sweep files
# written before they recorded it
SPEED_FIT_MODELS = ("gpt2", "resnet50")


def _label(config: dict | None) -> str:
    if not config:
        return "—"
    ckpt = config["checkpoint"]
    return (f"{config['batch_size']}×{config['accumulation_steps']}, "
            f"{f'{len(ckpt)} blocks ckpt' if ckpt else 'no ckpt'}"
            + (f" ({config['checkpoint_mode']})" if ckpt and config.get("checkpoint_mode", "full") != "full" else "")
            + (f", {config['loss_impl']} loss" if config.get("loss_impl", "default") != "default" else "")
            + f", {config['optimizer_impl']}"
            + (", channels_last" if config["channels_last"] else ""))


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def _cells_met(ratios: list[tuple[str, str, float]], which: str) -> str:
    """How many (workload, budget GiB, ratio) cells reach ``TARGET``, and the lowest; ``which`` says which ratio."""
    met = [r for r in ratios if r[2] >= TARGET]
    worst = min(ratios, key=lambda r: r[2]) if ratios else None
    return (f"{len(met)} of {len(ratios)} cells ≥ {TARGET}{which}"
            + (f"; lowest {worst[2]:.3f} ({worst[0]} at {worst[1]} GiB)" if worst else ""))


def sweep_table(folders: list[Path]) -> list[str]:
    files = sorted(f for folder in folders for f in folder.glob("plan_sweep_*.json"))
    if not files:
        raise SystemExit(f"no plan_sweep_*.json in {', '.join(map(str, folders))}: give the sweep stage's --out.")
    lines = ["| workload | speed model fitted on it | budget GiB | plan (speed model; planned on) | plan runs under the "
             "cap | configurations that fit | plan ms | best of the sweep | best ms | best ÷ plan |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios, unseen, not_run, partial, gpus = [], set(), [], [], set()
    for f in files:
        d = json.loads(f.read_text())
        name = d["workload"]
        gpus.add(f"{d['gpu']}, torch {d['torch']}")
        fitted = d.get("speed_fit_model", name in SPEED_FIT_MODELS)
        made_on = (d.get("plans_provenance") or {}).get("made_on", "not recorded")
        if not fitted:
            unseen.add(name)
        swept = len(d["rows"])
        if d.get("configurations") and swept < d["configurations"]:
            partial.append(f"{name}: {swept} of {d['configurations']} configurations swept (deadline)")
        for b in d["budgets"]:
            gib = f"{b['budget_bytes'] / 2**30:.2f}"
            if "plan" not in b:
                lines.append(f"| {name} | {'yes' if fitted else 'no'} | {gib} | no plan: {b.get('plan_error', '?')[:60]} "
                             f"| — | {b['sweep_fitting']} | — | {_label(b.get('sweep_best'))} | — | — |")
                continue
            steps = {json.dumps(x["config"], sort_keys=True): x["step_s"] for x in b["finalists"]}
            plan_s = steps[json.dumps(b["plan"], sort_keys=True)]
            best_s = steps[json.dumps(b["best"], sort_keys=True)]
            ratios.append((name, gib, b["ratio"]))
            if not b["plan_runs_under_cap"]:
                not_run.append(f"{name} at {gib} GiB")
            model = b.get("plan_speed_model") or "roofline (not recorded)"
            plan = _label(b["plan"]) + (", expandable segments" if b.get("plan_expandable_segments") else "")
            lines.append(f"| {name} | {'yes' if fitted else 'no'} | {gib} | {plan} ({model}; {made_on}) | "
                         f"{b['plan_runs_under_cap']} | {b['sweep_fitting']} | {plan_s * 1e3:.1f} | "
                         f"{_label(b['best'])} | {best_s * 1e3:.1f} | {b['ratio']:.3f} |")
    lines += ["", f"Measured on {'; '.join(sorted(gpus))}. best ÷ plan is the plan's throughput as a share of the "
              "best configuration timed beside it in interleaved rounds (1.000: the plan is the best).",
              _cells_met(ratios, "")
              + f". Models the speed model was not fitted on: {', '.join(sorted(unseen)) or 'none'}. "
              f"Plans that did not run under their cap: {', '.join(not_run) or 'none'}."]
    if partial:
        lines.append("Not exhaustive: " + "; ".join(partial) + ".")
    return lines


def calibrated_table(folder: Path) -> list[str]:
    """``plan/sweep_device.py calibrated``: plans made with the default (calibrated) speed model on the GPU."""
    files = sorted(folder.glob("plan_calibrated_*.json"))
    if not files:
        raise SystemExit(f"no plan_calibrated_*.json in {folder}: give the calibrated stage's --out.")
    lines = ["| workload | speed model fitted on it | calibration | budget GiB | calibrated plan | same as the roofline "
             "plan | runs under the cap | plan ms (median) | fastest contender | ms | best ÷ plan per repeat | of the "
             "medians |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, not_run, gpus = [], [], set()
    for f in files:
        d = json.loads(f.read_text())
        name = d["workload"]
        gpus.add(f"{d['gpu']}, torch {d['torch']}, {d['date']}")
        reason = d["speed_reason"].removeprefix("speed model: ")
        for b in d["budgets"]:
            gib = f"{b['budget_bytes'] / 2**30:.2f}"
            if "plan" not in b:
                lines.append(f"| {name} | {'yes' if d['speed_fit_model'] else 'no'} | {reason} | {gib} | no plan: "
                             f"{b.get('plan_error', '?')[:60]} | — | — | — | — | — | — | — |")
                continue
            best = min(b["contenders"], key=lambda c: c["median_step_s"])
            ratios.append((name, gib, b["ratio_of_medians"]))
            if not b["plan_runs_under_cap"]:
                not_run.append(f"{name} at {gib} GiB")
            plan = _label(b["plan"]) + (", expandable segments" if b.get("plan_expandable_segments") else "")
            lines.append(f"| {name} | {'yes' if d['speed_fit_model'] else 'no'} | {reason} | {gib} | {plan} | "
                         f"{'yes' if b['same_as_roofline_plan'] else 'no'} | {b['plan_runs_under_cap']} | "
                         f"{b['contenders'][0]['median_step_s'] * 1e3:.1f} | {best['role']}: {_label(best['config'])} | "
                         f"{best['median_step_s'] * 1e3:.1f} | "
                         f"{', '.join(f'{r:.3f}' for r in b['ratio_per_repeat'])} | {b['ratio_of_medians']:.3f} |")
    lines += ["", f"Measured on {'; '.join(sorted(gpus))}. Contenders: the calibrated plan, the CPU's roofline plan "
              "for the budget, and the fastest configurations the named sweep found running under the same cap, "
              "timed together in interleaved rounds; best ÷ plan is the plan's throughput as a share of the fastest.",
              _cells_met(ratios, " (of the medians)")
              + f". Plans that did not run under their cap: {', '.join(not_run) or 'none'}."]
    return lines


def patch_table(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    if d.get("dry_run"):
        print(f"warning: {path} is a dry run (a stand-in verdict), not a measurement", file=sys.stderr)
    lines = ["| network | budget GB | chosen patch (voxels) | predicted cap GiB (upper bound) | cap GiB | chosen ran | "
             "larger rungs: tried / ran | next larger rung | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    right = total = 0
    for net in d["networks"]:
        for c in net["cells"]:
            total += 1
            right += c["verdict"] == "largest that fits"
            nxt = c["larger"][0] if c["larger"] else None
            nxt_text = "— (the top rung)" if nxt is None else (
                f"{'×'.join(map(str, nxt['patch']))} (+{(nxt['voxels_vs_chosen'] - 1) * 100:.0f} %): "
                + ("not tried" if nxt["trial"] is None else "ran" if nxt["trial"]["ok"] else "OOM"))
            lines.append(f"| {net['network']} | {c['budget_gb']} | {'×'.join(map(str, c['patch']))} "
                         f"({c['voxels'] / 1e6:.2f} M) | {_gib(c['predicted_device_upper_bytes'] - c['context_bytes'])} | {_gib(c['cap_bytes'])} | "
                         f"{c['chosen_ran']} | {c['larger_tried']} of {len(c['larger'])} / {c['larger_ran']} | "
                         f"{nxt_text} | {c['verdict']} |")
    lines += ["", f"{'DRY RUN (stand-in verdicts), ' if d.get('dry_run') else ''}measured on {d.get('gpu')}, torch "
              f"{d.get('torch')}: {right} of {total} cells the largest patch on the ladder that fits (the chosen "
              "patch ran under the cap, every larger rung ran out of memory). Cap = budget − the CUDA context the "
              "plan assumed; the predicted cap is the estimate's upper bound, what the search decides with "
              "(it keeps it under the budget × (1 − the plan's margin) less the context; the margin was 2 % until the "
              "second round of 2026-11-26, 0 since)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", nargs="*", default=[], help="folders of plan_sweep_<workload>.json")
    parser.add_argument("--patch", help="the patch_caps_<card>_torch<X.Y>_<date>.json file")
    parser.add_argument("--calibrated", help="a folder of plan_calibrated_<workload>.json")
    parser.add_argument("--out", help="markdown file to write (default: stdout)")
    args = parser.parse_args()
    if not args.sweep and not args.patch and not args.calibrated:
        parser.error("give --sweep FOLDER..., --patch FILE and/or --calibrated FOLDER")
    parts: list[str] = []
    if args.sweep:
        parts += ["## Plan ÷ best of an exhaustive sweep", "", *sweep_table([Path(s) for s in args.sweep]), ""]
    if args.calibrated:
        parts += ["## Plans made with the default speed model on the GPU (calibrated) ÷ the fastest contender", "",
                  *calibrated_table(Path(args.calibrated)), ""]
    if args.patch:
        parts += ["## Patch search under caps", "", *patch_table(Path(args.patch)), ""]
    text = "\n".join(parts)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
