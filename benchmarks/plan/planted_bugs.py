"""Plant each bug the issue tried, one at a time, run the planner's CPU tests, and record which tests fail.

    python benchmarks/plan/planted_bugs.py > benchmarks/results/plan/planted_bugs_cpu_<date>.jsonl   # ~12 min

Each bug is one text replacement in one source file; the file's text is put back after its run (also when the
run fails), so uncommitted edits elsewhere are untouched. A bug that no test catches prints an empty ``failed``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/test_plan_search.py", "tests/test_plan_speed.py", "tests/test_plan_patch.py", "tests/test_plan.py",
         "tests/test_trace.py"]
SEARCH, PREDICT = "src/memfit/plan/search.py", "src/memfit/estimate/predict.py"
STATE, WALK, COPIES = "src/memfit/plan/search_state.py", "src/memfit/plan/walk.py", "src/memfit/estimate/step_copies.py"
# name: (file, text, replacement)
BUGS = {
    # (a1, the plan's default margin set to 0, is no bug since the plan decides with the upper bound alone:
    # memfit.plan.search.DEFAULT_MARGIN; a2 plants a margin the user asks for being ignored)
    "a2_limit_ignores_margin": (SEARCH, "    limit = int(budget_bytes * (1 - margin))\n    workload = workload.replace(",
                                "    limit = budget_bytes\n    workload = workload.replace("),
    "a3_fits_in_margin_0": (PREDICT, "FITS_IN_MARGIN = 0.015", "FITS_IN_MARGIN = 0.0"),
    "b1_fragmentation_0_in_the_replay": (
        PREDICT, 'replayed = max(smallest_fitting_capacity(events, config), analysis["peak_allocated"])',
        'replayed = analysis["peak_allocated"]'),
    "b2_fragmentation_0_in_the_line": (SEARCH, "mid.fits_in_upper_bytes / mid.peak_allocated_bytes, b_lo)", "1.0, b_lo)"),
    "c_frontier_keeps_every_candidate": (
        SEARCH, '    """The candidates no other one beats on both memory and time, by memory."""\n',
        '    """The candidates no other one beats on both memory and time, by memory."""\n    return candidates\n'),
    "d_cost_at_returns_the_first_cost": (STATE, "    sizes = [m for m, _ in known]\n",
                                         "    return known[0][1]\n    sizes = [m for m, _ in known]\n"),
    "e_no_expandable_segments_retry": (
        WALK, "            if not search.allocator.expandable_segments and _expandable_floor(search, c)",
        "            if False and _expandable_floor(search, c)"),
    # session 9's planner and tracer changes
    "f_format_change_free": (WALK, "LAYOUT_CHANGE_GAIN = 0.02", "LAYOUT_CHANGE_GAIN = 0.0"),
    "g_finer_checkpointing_never_tried": (
        SEARCH, "    if not set(finer) < set(c.checkpoint):\n        return []",
        "    if True:\n        return []"),
    "h_copied_micro_batch_frees_the_old_output": (
        COPIES, "trace.keys.append(renamed[k] if k in renamed else instead[k])",
        "trace.keys.append(renamed[k] if k in renamed else k)"),
}


def plant(name: str) -> dict:
    path, old, new = BUGS[name]
    file = ROOT / path
    original = file.read_text()
    if original.count(old) != 1:
        return {"bug": name, "error": f"the text to replace occurs {original.count(old)} times in {path}"}
    file.write_text(original.replace(old, new))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *TESTS],
                             capture_output=True, text=True, cwd=ROOT)
    finally:
        file.write_text(original)
    failed = [line.split(" ")[1] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    return {"bug": name, "file": path, "failed": failed, "summary": run.stdout.strip().splitlines()[-1]}


if __name__ == "__main__":
    for bug in sys.argv[1:] or BUGS:
        print(json.dumps(plant(bug)), flush=True)
