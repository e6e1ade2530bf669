"""Fit the upper bound's constants on the corpus's *fit* half only (the validation half tunes nothing).

    python benchmarks/corpus/fit_bound.py                        # latest predictions, H200 measurements

For each fit-half entry, the bytes it needed beyond the estimate's replayed cap: measured ``fits_in`` - replayed.
The relative base margin stays the suite's prior (``memfit.estimate.bound.BASE_MARGIN``); each reason's width is
the larger of its prior and the largest relative need, beyond the base and the entry's other widths, of the
entries that recorded it; then the absolute slack is the largest remaining need in bytes, rounded up to 32 MiB
(small steps miss by a few tens of MiB that no percentage of them covers). Writes
``bound_fit_<card>_torch<x.y>_<date>.json``; the constants in ``memfit/estimate/bound.py`` are then set from it by
hand, citing the file, and ``report_corpus.py`` judges them on the validation half.
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


def _up(x: float) -> float:
    return round(math.ceil(max(x, 0.0) / STEP - 1e-9) * STEP, 4)


def fit(rows: list[dict], base: float, priors: dict[str, float]) -> dict:
    fit_rows = [r for r in rows if r["split"] == "fit" and r["status"] == "ok" and r.get("measured_fits_in")]
    needs = [{"id": r["id"], "replayed": r["predicted_replay"], "measured": r["measured_fits_in"],
              "need": r["measured_fits_in"] / r["predicted_replay"] - 1, "reasons": r["reasons"]} for r in fit_rows]
    widths, set_by = {}, {}
    for reason, prior in priors.items():
        with_it = [n for n in needs if reason in n["reasons"]]
        beyond = [(n["need"] - base - sum(priors[o] for o in n["reasons"] if o != reason), n["id"]) for n in with_it]
        need, by = max(beyond, default=(0.0, None))
        widths[reason] = max(prior, _up(need))
        set_by[reason] = {"entries": len(with_it), "largest_need_beyond_the_rest": round(need, 4), "entry": by,
                          "prior": prior}
    for n in needs:
        n["residual_bytes"] = int(n["measured"] - n["replayed"] * (1 + base + sum(widths[r] for r in n["reasons"])))
    worst = max(needs, key=lambda n: n["residual_bytes"])
    slack = max(0, -(-worst["residual_bytes"] // SLACK_STEP) * SLACK_STEP)
    return {"base_margin": base, "base_slack_bytes": slack,
            "slack_set_by": {"entry": worst["id"], "residual_bytes": worst["residual_bytes"]},
            "widths": widths, "widths_set_by": set_by, "fit_entries": len(fit_rows),
            "needs": sorted(needs, key=lambda n: -n["residual_bytes"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictions", default=str(latest("estimate", "corpus_predictions_cpu")))
    parser.add_argument("--measurements", default=str(latest("estimate", "corpus_measurements_h200")))
    args = parser.parse_args()
    from memfit.estimate.bound import BASE_MARGIN, WIDTHS

    predictions, measurements = Path(args.predictions), Path(args.measurements)
    rows = join(predictions, measurements)
    for r in rows:  # the replayed cap and the reasons, from the prediction files
        p = predictions / f"{r['id']}.json"
        if r["status"] == "ok":
            est = json.loads(p.read_text())["estimate"]
            r["predicted_replay"] = est["fits_in_replay_bytes"]
            r["reasons"] = sorted(u["reason"] for u in est.get("uncertainty", []))
    result = fit(rows, BASE_MARGIN, dict(WIDTHS))
    meas = json.loads(next(measurements.glob("*.json")).read_text())
    result.update(predictions=str(predictions.relative_to(RESULTS.parent.parent)),
                  measurements=str(measurements.relative_to(RESULTS.parent.parent)), split="fit")
    name = stem("bound_fit", "h200", meas.get("torch_version", "2.11"))
    out = RESULTS / "estimate" / f"{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "needs"}, indent=1))
    print(out)


if __name__ == "__main__":
    main()
