"""Join the corpus's predictions and measurements into accuracy tables, one per half (fit, validation).

    python benchmarks/corpus/report_corpus.py --measurements benchmarks/results/estimate/corpus_measurements_h100_torch2.11_<date>

Writes ``benchmarks/results/estimate/corpus_accuracy_<card>_torch<x.y>_<yyyymmdd>.{json,md}``. Error = (predicted - measured)
/ measured. The *fit* half is what rules and margins may be tuned on; the *validation* half judges them and must
tune nothing. Where the estimate carries an upper bound (``fits_in_upper_bytes``), the tables give its coverage:
the share of entries whose measured ``fits_in`` it does not undercut, and how far above it sits.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _results import RESULTS as ALL_RESULTS  # noqa: E402
from _results import card, latest, stem  # noqa: E402

RESULTS = ALL_RESULTS / "estimate"


def _err(pred: int | None, meas: int | None) -> float | None:
    return None if not pred or not meas else (pred - meas) / meas


def recomputed_upper(est: dict[str, Any]) -> int:
    """The upper bound of a prediction recomputed by the installed memfit from its replayed cap and its reasons:
    the bound's constants can change without tracing the corpus again (the rest of the estimate does not move)."""
    from memfit.estimate.bound import upper_bound

    reasons = {u["reason"]: u.get("detail", "") for u in est.get("uncertainty") or []}
    extra = {u["reason"]: u.get("bytes", 0) for u in est.get("uncertainty") or []}
    return max(upper_bound(est["fits_in_replay_bytes"], reasons, extra)[0], est["fits_in_bytes"])


def _last_with(name: str, folders: tuple[Path, ...]) -> Path:
    """``name`` in the last of ``folders`` that has it, else in the first (which may not have it either)."""
    return next((d / name for d in reversed(folders) if (d / name).exists()), folders[0] / name)


def join(predictions: Path, measurements: Path, rebound: bool = False,
         also: tuple[Path, ...] = (), also_predictions: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """One row per corpus entry; an entry's measurement from the last of ``also`` that has it, else
    ``measurements``; its prediction likewise from ``also_predictions``, else ``predictions``."""
    sys.path.insert(0, str(HERE))
    import corpus

    rows = []
    for e in corpus.entries():
        p_file = _last_with(f"{e['id']}.json", (predictions, *also_predictions))
        m_file = _last_with(f"{e['id']}.json", (measurements, *also))
        p = json.loads(p_file.read_text()) if p_file.exists() else None
        m = json.loads(m_file.read_text()) if m_file.exists() else None
        row: dict[str, Any] = {"id": e["id"], "split": e["split"], "family": e["family"], "precision": e["precision"],
                               "optimizer": f"{e['optimizer']['name']}/{e['optimizer']['impl']}",
                               "keep_output": e["keep_output"], "description": e["description"]}
        if p is None or "error" in p:
            row["status"] = "not predicted" if p is None else "estimate failed"
            row["error"] = (p or {}).get("error", "")
        elif m is None or m.get("error"):
            row["status"] = "not measured" if m is None else "measurement failed"
            row["error"] = (m or {}).get("error", "")
        else:
            est = p["estimate"]
            upper = recomputed_upper(est) if rebound else est.get("fits_in_upper_bytes")
            row.update(
                status="ok",
                predicted_allocated=est["peak_allocated_bytes"], measured_allocated=m["peak_allocated_bytes"],
                error_allocated=_err(est["peak_allocated_bytes"], m["peak_allocated_bytes"]),
                predicted_reserved=est["peak_reserved_bytes"], measured_reserved=m["peak_reserved_bytes"],
                error_reserved=_err(est["peak_reserved_bytes"], m["peak_reserved_bytes"]),
                predicted_fits_in=est["fits_in_bytes"], measured_fits_in=m.get("fits_in_bytes"),
                error_fits_in=_err(est["fits_in_bytes"], m.get("fits_in_bytes")),
                predicted_upper=upper, error_upper=_err(upper, m.get("fits_in_bytes")),
                uncertainty=[u.get("reason") for u in est.get("uncertainty") or [] if isinstance(u, dict)],
                estimate_wall_s=p.get("wall_s"), estimate_torch=p.get("torch"),
            )
        rows.append(row)
    return rows


def stats(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    signed = [r[key] for r in rows if r.get(key) is not None]
    if not signed:
        return {"n": 0, "median_abs": None, "max_abs": None, "most_negative": None, "median_signed": None}
    return {"n": len(signed), "median_abs": statistics.median(abs(x) for x in signed),
            "max_abs": max(abs(x) for x in signed), "most_negative": min(signed),
            "median_signed": statistics.median(signed)}


def coverage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How often the upper bound holds (>= measured fits_in) and how much it over-asks."""
    pairs = [r["error_upper"] for r in rows if r.get("error_upper") is not None]
    if not pairs:
        return {"n": 0}
    held = [x for x in pairs if x >= 0]
    return {"n": len(pairs), "held": len(held), "coverage": len(held) / len(pairs),
            "median_over": statistics.median(pairs), "max_over": max(pairs), "worst_under": min(pairs)}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _gib(x: int | None) -> str:
    return "—" if not x else f"{x / 2**30:.2f}"


def markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    s = summary
    lines = [
        f"# memfit estimate on the validation corpus, {s['gpu']} ({s['date']})",
        "",
        f"Corpus: `benchmarks/corpus/corpus.json` ({s['entries']} configurations drawn by `generate.py`, seed "
        f"{s['seed']}, before any fitting). Measured with torch {s['torch_measure']} by `measure_corpus.py` "
        "(protocol as `memfit measure`: 3 steps; `fits_in` = smallest `set_per_process_memory_fraction` cap that "
        "ran, by bisection); predicted on the CPU by `predict_corpus.py` (torch per row in the JSON). "
        "Error = (predicted - measured) / measured.",
        "",
        *([s["note"], ""] if s.get("note") else []),
    ]
    for half in ("fit", "validation"):
        h = s[half]
        lines += [
            f"## {half} half ({h['ok']} of {h['entries']} entries predicted and measured; "
            f"{h['estimate_failed']} estimates failed, {h['missing']} not yet measured or failed on the GPU)",
            "",
            "| metric | median abs error | max abs error | most negative (under-prediction) | median signed | n |",
            "|---|---|---|---|---|---|",
        ]
        for key in ("allocated", "reserved", "fits_in"):
            st = h[key]
            lines.append(f"| peak {key} | {_pct(st['median_abs'])} | {_pct(st['max_abs'])} | "
                         f"{_pct(st['most_negative'])} | {_pct(st['median_signed'])} | {st['n']} |")
        cov = h["upper_bound"]
        if cov.get("n"):
            lines += ["", f"Upper bound (`fits_in_upper_bytes`): holds on {cov['held']} of {cov['n']} "
                      f"({cov['coverage']:.0%}); median {_pct(cov['median_over'])} above the measured cap, at most "
                      f"{_pct(cov['max_over'])}; worst {_pct(cov['worst_under'])}."]
        lines.append("")
    lines += [
        "## Every entry", "",
        "| id | half | precision | optimizer | keeps output | alloc pred / meas GiB | err | fits-in pred / meas GiB "
        "| err | upper err | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['id']} | {r['split']} | {r['precision']} | {r['optimizer']} | {r['keep_output']} "
                         f"| — | — | — | — | — | {r['status']}: {str(r.get('error', ''))[:100].replace('|', '/')} |")
            continue
        lines.append(
            f"| {r['id']} | {r['split']} | {r['precision']} | {r['optimizer']} | {r['keep_output']} | "
            f"{_gib(r['predicted_allocated'])} / {_gib(r['measured_allocated'])} | {_pct(r['error_allocated'])} | "
            f"{_gib(r['predicted_fits_in'])} / {_gib(r['measured_fits_in'])} | {_pct(r['error_fits_in'])} | "
            f"{_pct(r['error_upper'])} | ok |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictions", default=str(latest("estimate", "corpus_predictions_cpu")))
    parser.add_argument("--measurements", default=str(latest("estimate", "corpus_measurements_")),
                        help="measure_corpus.py's output folder (default: the newest in results/estimate/)")
    parser.add_argument("--also", action="append", default=[], type=Path,
                        help="a later measurement folder whose entries win (e.g. measure_corpus.py --check-above)")
    parser.add_argument("--also-predictions", action="append", default=[], type=Path,
                        help="a later predictions folder whose entries win (entries estimated again)")
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--note", default="", help="a paragraph under the header (which set, which code)")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--rebound", action="store_true",
                        help="recompute each upper bound with the installed memfit's constants (memfit.estimate.bound)")
    args = parser.parse_args()

    rows = join(Path(args.predictions), Path(args.measurements), rebound=args.rebound, also=tuple(args.also),
                also_predictions=tuple(args.also_predictions))
    sample = next((json.loads(p.read_text()) for p in Path(args.measurements).glob("c*.json")
                   if not p.name.endswith(".partial.json")), {})
    corpus_meta = json.loads((HERE / "corpus.json").read_text())
    summary: dict[str, Any] = {
        "gpu": sample.get("gpu", "unknown GPU"), "torch_measure": sample.get("torch_version"),
        "date": dt.date.today().isoformat(), "entries": len(rows), "seed": corpus_meta["seed"],
    }
    for half in ("fit", "validation"):
        part = [r for r in rows if r["split"] == half]
        ok = [r for r in part if r["status"] == "ok"]
        summary[half] = {
            "entries": len(part), "ok": len(ok),
            "estimate_failed": sum(r["status"] == "estimate failed" for r in part),
            "missing": sum(r["status"] in ("not measured", "measurement failed", "not predicted") for r in part),
            "allocated": stats(ok, "error_allocated"), "reserved": stats(ok, "error_reserved"),
            "fits_in": stats(ok, "error_fits_in"), "upper_bound": coverage(ok),
        }
    name = stem("corpus_accuracy", card(sample.get("gpu")), sample.get("torch_version") or "unknown")
    out = Path(args.results) / (f"{name}_{args.tag}" if args.tag else name)
    summary.update(predictions=[args.predictions, *map(str, args.also_predictions)], measurements=[args.measurements, *map(str, args.also)],
                   note=args.note)
    Path(f"{out}.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    text = markdown(summary, rows)
    Path(f"{out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
