"""Fit the upper bound's constants on measured steps outside the corpus's validation half (which tunes nothing).

    python benchmarks/corpus/fit_bound.py                        # latest predictions, H200 measurements
    python benchmarks/corpus/fit_bound.py --predictions P --measurements M \
        --zoo results/estimate/trace_coverage_<zoo>.json:results/estimate/zoo_accuracy_<card>.json ...

The fit steps: the corpus's fit half, and each zoo set given (the zoo and its draws: estimates from
``trace_coverage.py``, measured ``fits_in`` from ``report_zoo.py``'s rows). For each, what it needed beyond the
estimate's replayed cap: measured ``fits_in`` / replayed - 1. The relative base margin is the largest such need,
beyond the bytes its reasons add, of the steps that no reason widens by a fraction, rounded up to 0.1 % and never
below the 14-workload suite's worst miss before margins (``SUITE_WORST``); each reason's width is the larger of its
prior and the largest relative need, beyond the base and the step's other widths, of the steps that recorded it;
then the absolute slack is the largest remaining need in bytes, rounded up to 32 MiB (small steps miss by a few tens
of MiB that no percentage of them covers). Writes ``bound_fit_<card>_torch<x.y>_<date>.json``; the constants in
``memfit/estimate/bound.py`` are then set from it by hand, citing the file, and ``report_corpus.py`` judges them on
the validation half.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from report_corpus import join  # noqa: E402

from _results import RESULTS, latest, stem  # noqa: E402

STEP = 0.005
SLACK_STEP = 32 << 20
SUITE_WORST = 0.034
"""The worst ``fits_in`` under-estimate before margins on the 14-workload suite (H200; the base margin's floor)."""
BASE_STEP = 0.001
"""The base margin's rounding: finer than the widths' (``STEP``), since it widens every estimate."""


def _up(x: float, step: float = STEP) -> float:
    return round(math.ceil(max(x, 0.0) / step - 1e-9) * step, 4)


def fit(needs: list[dict], priors: dict[str, float]) -> dict:
    """The constants from ``needs`` (one per measured step: id, set, replayed, measured, need, reasons,
    reason_bytes)."""
    for n in needs:
        n["beyond_reasons"] = n["need"] - sum(priors[o] for o in n["reasons"]) - n["reason_bytes"] / n["replayed"]
    # the base from the steps no reason widens by a fraction (a step that one does is its width's to cover)
    worst = max((n for n in needs if not any(priors[o] for o in n["reasons"])), key=lambda n: n["beyond_reasons"])
    base = max(_up(SUITE_WORST, BASE_STEP), _up(worst["beyond_reasons"], BASE_STEP))
    widths, set_by = {}, {}
    for reason, prior in priors.items():
        with_it = [n for n in needs if reason in n["reasons"]]
        beyond = [(n["need"] - base - sum(priors[o] for o in n["reasons"] if o != reason)
                   - n["reason_bytes"] / n["replayed"], n["id"]) for n in with_it]
        need, by = max(beyond, default=(0.0, None))
        widths[reason] = max(prior, _up(need))
        set_by[reason] = {"entries": len(with_it), "largest_need_beyond_the_rest": round(need, 4), "entry": by,
                          "prior": prior}
    for n in needs:
        n["residual_bytes"] = int(n["measured"] - n["replayed"] * (1 + base + sum(widths[r] for r in n["reasons"]))
                                  - n["reason_bytes"])
    closest = max(needs, key=lambda n: n["residual_bytes"])
    slack = max(0, -(-closest["residual_bytes"] // SLACK_STEP) * SLACK_STEP)
    return {"base_margin": base,
            "base_margin_set_by": {"entry": worst["id"], "set": worst["set"],
                                   "largest_need_beyond_its_reasons": round(worst["beyond_reasons"], 4),
                                   "suite_worst": SUITE_WORST},
            "base_slack_bytes": slack,
            "slack_set_by": {"entry": closest["id"], "residual_bytes": closest["residual_bytes"]},
            "widths": widths, "widths_set_by": set_by, "fit_entries": len(needs),
            "fit_sets": {s: sum(n["set"] == s for n in needs) for s in dict.fromkeys(n["set"] for n in needs)},
            "needs": sorted(needs, key=lambda n: -n["residual_bytes"])}


def _need(entry: str, set_name: str, est: dict, measured: int) -> dict:
    reasons = est.get("uncertainty", [])
    replayed = est["fits_in_replay_bytes"]
    return {"id": entry, "set": set_name, "replayed": replayed, "measured": measured, "need": measured / replayed - 1,
            "reasons": sorted(u["reason"] for u in reasons), "reason_bytes": sum(u.get("bytes", 0) for u in reasons)}


def corpus_needs(predictions: Path, measurements: Path) -> list[dict]:
    """The corpus's fit half: one need per entry estimated and measured."""
    needs = []
    for r in join(predictions, measurements):
        if r["split"] == "fit" and r["status"] == "ok" and r.get("measured_fits_in"):
            est = json.loads((predictions / f"{r['id']}.json").read_text())["estimate"]
            needs.append(_need(r["id"], "corpus fit half", est, r["measured_fits_in"]))
    return needs


def zoo_needs(pair: str) -> list[dict]:
    """``TRACE_COVERAGE.json:ACCURACY.json``: a zoo set's estimates (``trace_coverage.py``) and its accuracy rows
    (``report_zoo.py``), which hold the measured ``fits_in``."""
    coverage, accuracy = pair.split(":")
    estimates = {r["name"]: r.get("estimate") for r in json.loads(Path(coverage).read_text())["rows"]}
    set_name = Path(accuracy).name.split("_accuracy")[0]
    return [_need(r["name"], set_name, estimates[r["name"]], r["meas_fits_in"])
            for r in json.loads(Path(accuracy).read_text())["rows"]
            if r.get("meas_fits_in") and estimates.get(r["name"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictions", default=str(latest("estimate", "corpus_predictions_cpu")))
    parser.add_argument("--measurements", default=str(latest("estimate", "corpus_measurements_h200")))
    parser.add_argument("--zoo", action="append", default=[], metavar="TRACE_COVERAGE.json:ACCURACY.json",
                        help="a zoo set's estimates and accuracy rows, fitted on too (repeatable)")
    parser.add_argument("--out", help="default: results/estimate/bound_fit_h200_torch<x.y>_<date>.json")
    args = parser.parse_args()
    from memfit.estimate.bound import WIDTHS

    predictions, measurements = Path(args.predictions).resolve(), Path(args.measurements).resolve()
    needs = corpus_needs(predictions, measurements)
    for pair in args.zoo:
        needs += zoo_needs(pair)
    result = fit(needs, dict(WIDTHS))
    meas = json.loads(next(measurements.glob("*.json")).read_text())
    result.update(predictions=str(predictions.relative_to(RESULTS.parent.parent)),
                  measurements=str(measurements.relative_to(RESULTS.parent.parent)), zoo=args.zoo,
                  split="fit (the corpus's fit half and the zoo sets given; never the validation half)")
    out = Path(args.out) if args.out else RESULTS / "estimate" / f"{stem('bound_fit', 'h200', meas.get('torch_version', '2.11'))}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "needs"}, indent=1))
    print(out)


if __name__ == "__main__":
    main()
