"""Read a ``measure_corpus.py --check-above`` run from its printed lines alone (when its per-entry records did not
come back): an entry whose answer is unchanged (to the line's 0.01 GiB) and whose trial count is its old record's
plus exactly the caps a check with no failure tries ran under every cap checked.

    python benchmarks/corpus/above_logs.py --check-above 8 LOG... --done FOLDER...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure_corpus import ABOVE_MIN_SPACING, DONE_LINE  # noqa: E402

GIB = 2**30


def probes_without_failure(record: dict, check_above: int) -> int:
    """The caps ``EntryState`` tries above ``record``'s answer when none of them fails (its spacing rule)."""
    first = next(t for t in record["trials"] if t["ok"] and t["num_alloc_retries"] == 0)
    top, hi = first["peak_reserved_bytes"], record["fits_in_bytes"]
    step = max(int(record.get("tolerance", 0.005) * first["peak_allocated_bytes"]), 2 << 20)
    spacing = max((top - hi) // (check_above + 1), int(ABOVE_MIN_SPACING * hi))
    return 0 if spacing <= step else len(range(top - spacing, hi, -spacing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--done", action="append", default=[], type=Path, help="the records it started from")
    parser.add_argument("--check-above", type=int, required=True)
    args = parser.parse_args()
    old: dict[str, dict] = {}
    for folder in args.done:  # the first folder that has an entry wins, as in measure_corpus.py
        for path in sorted(folder.glob("*.json")):
            rec = json.loads(path.read_text())
            if not path.name.endswith(".partial.json") and rec.get("fits_in_bytes") and rec["id"] not in old:
                old[rec["id"]] = rec
    held, moved = [], []
    for log in args.logs:
        for line in log.read_text().splitlines():
            m = DONE_LINE.match(line)
            if not m or m.group(1) not in old:
                continue
            rec = old[m.group(1)]
            expected = sum(not t.get("physical_oom") for t in rec["trials"]) + probes_without_failure(
                rec, args.check_above)
            same = abs(float(m.group(3)) - rec["fits_in_bytes"] / GIB) < 0.006 and int(m.group(4)) == expected
            (held if same else moved).append(m.group(1))
            if not same:
                print(f"{m.group(1)}: {rec['fits_in_bytes'] / GIB:.3f} -> {m.group(3)} GiB, {m.group(4)} trials "
                      f"({expected} without a failure)")
    print(f"{len(held)} ran under every cap checked above their answer; {len(moved)} did not or cannot tell")


if __name__ == "__main__":
    main()
