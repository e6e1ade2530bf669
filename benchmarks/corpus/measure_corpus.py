"""Measure the corpus on one GPU: peak allocated / reserved and the smallest cap that runs (``fits_in``), with
several trial processes side by side. Runs on the device machine.

    PYTHONPATH=src python benchmarks/corpus/measure_corpus.py --budget-s 540
        # -> $OUT/corpus_measurements_<card>_torch<x.y>_<date>/; copy it to benchmarks/results/estimate/ and run the
        #    same command again: it goes on from the newest such folder there (or name folders with --done)

``--zoo COVERAGE_JSON`` measures the zoo (``benchmarks/zoo/``) instead, in a seeded random order
(``ZOO_ORDER_SEED``), sized and hinted by a ``trace_coverage.py`` result (``benchmarks/estimate/device_zoo.sh``).

Each trial is ``memfit.estimate.measure.run_trial``: one fresh process that runs the protocol under
``torch.cuda.set_per_process_memory_fraction`` (a cap on *that process's* caching allocator: processes do not
see each other's caps). So trials of different entries can share the GPU, provided their *physical* memory never
runs out: the scheduler gives every running trial a ticket of its cap plus 1 GiB for its CUDA context (measured
639-771 MiB on the H100, estimate_accuracy_h100_20261126.md) and starts a trial only while the tickets fit in the
GPU's memory less a reserve. Every trial therefore runs under a cap, the first one too: a first run whose cap
never bound (no OOM, ``num_alloc_retries == 0``) behaved exactly as an uncapped run, and gives the peaks; one that
bound is run again with twice the cap. A trial that still hits a *physical* OOM (the allocator's message says less
is free on the GPU than it tried to allocate) is repeated instead of being counted as "does not fit".

The bisection starts at the prediction's ``fits_in`` when ``--predictions`` is given, then steps away from it
doubling the step until the answer flips, then bisects to ``--tolerance`` of the peak: 3-5 trials when the
prediction is close. ``outside_allocator_bytes`` (CUDA context) is only meaningful for trials that ran alone:
each record says how many trials overlapped it.

Resumable: one ``<id>.json`` per finished entry, ``<id>.partial.json`` with the trials of an unfinished one; both
are read back from ``--out`` and every ``--done`` folder. ``--budget-s`` stops starting trials when the next one
might not finish in time and ends running ones at the deadline (their results are lost, the entry's earlier
trials are kept).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _results import card, latest, stem, torch_tag  # noqa: E402

GIB = 2**30
CONTEXT_BYTES = GIB
"""Ticket for one process's CUDA context and other memory outside its allocator (639-771 MiB measured)."""

_OOM = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]?i?B).*?of which ([\d.]+) ([KMGT]?i?B) is free", re.S)
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def physical_oom(error: str) -> bool:
    """True when the GPU itself had less free memory than the allocation asked for (not the process's cap), or
    memory outside the caching allocator (CUDA context, cuBLAS/cuDNN handles) could not be had."""
    if "CUDA error: out of memory" in error or "ALLOC_FAILED" in error:
        return True
    m = _OOM.search(error)
    if not m:
        return False
    wanted = float(m.group(1)) * _UNIT.get(m.group(2), 1)
    free = float(m.group(3)) * _UNIT.get(m.group(4), 1)
    return free < wanted + (64 << 20)


DONE_LINE = re.compile(r"^(\S+): done \(peak ([\d.]+) GiB, fits in ([\d.]+) GiB, (\d+) trials\)")
"""The line ``main`` prints for each entry it finishes (id, peak allocated, fits_in, trials): what is left of a run
whose folders did not come back (``benchmarks/zoo/report_zoo.py --logs``, ``above_logs.py``)."""

ABOVE_MIN_SPACING = 0.01
"""The closest ``EntryState.check_above`` spaces its caps, a fraction of the answer: the out-of-memory windows an
H200 showed above a bisected answer were 1-3 % wide (FCN-ResNet50 4.80-4.88 GB, PVT-v2 3.87-3.93, Video Swin-T
6.45-6.65; measure_check_above_h200_torch2.11_20261129_s27/, swin3d_caps_h200_torch2.11_20261129_s27/)."""


@dataclass
class EntryState:
    """One entry's measurement so far; everything needed to resume it."""

    id: str
    hint_bytes: int | None
    guess_bytes: int
    trials: list[dict[str, Any]] = field(default_factory=list)
    first: dict[str, Any] | None = None
    first_cap: int | None = None
    lo: int = 0
    hi: int = 0
    step: int = 0
    hint_result: bool | None = None
    """Whether the trial at the hint ran; None until it was tried (or when there is no usable hint)."""
    gallop: int = 0
    """Distance of the next probe from the hint side; 0 once the answer flipped (plain bisection from then)."""
    error: str = ""
    done: bool = False
    check_above: int = 0
    """Caps to try above the bisection's answer, evenly spaced (at least ``ABOVE_MIN_SPACING`` apart) below the
    uncapped run's peak reserved (which always runs), from the top down: a larger cap can run out of memory where a smaller one ran (session 27: FCN-ResNet50
    ran under 4.80 GB, ran out under 4.84, ran under 4.88), and ``fits_in`` is the smallest cap *at and above
    which* the step runs. The first that fails is bisected against the one above it; then the entry is done."""
    above_next: int = 0
    """The next cap to check above the answer (0: not started or over); ``above_passing`` ran, just above it."""
    above_passing: int = 0
    above_spacing: int = 0
    bisected_bytes: int | None = None
    """The bisection's answer before the check above (``fits_in`` when no cap above failed)."""
    floor: bool = True
    """Whether the uncapped run's peak allocated bounds the answer from below (a cap under it cannot fit). Not where
    the step takes what memory it is given: cuDNN's benchmark mode sizes its algorithm search by what the allocator
    can grant, so FCN-ResNet101 peaked at 83.6 GB uncapped and ran under a 15.4 GB cap (session 37); the bisection
    then starts from 0 and its tolerance is a fraction of the hint (the prediction) instead of that peak."""

    def next_cap(self, pool_bytes: int, bisect: bool) -> int | None:
        """The cap of this entry's next trial, or None when it is finished (``done`` / ``error`` set)."""
        if self.first is None:
            if self.first_cap is None:
                self.first_cap = min(pool_bytes - CONTEXT_BYTES, max(4 * GIB, int(self.guess_bytes * 1.5) + GIB))
            return self.first_cap
        if bisect and self.hi - self.lo <= self.step and self.check_above and self.bisected_bytes is None:
            self.bisected_bytes = self.hi
            top = self.first["peak_reserved_bytes"]
            self.above_spacing = max((top - self.hi) // (self.check_above + 1), int(ABOVE_MIN_SPACING * self.hi))
            if self.above_spacing > self.step:
                self.above_passing, self.above_next = top, top - self.above_spacing
        if self.above_next > self.hi:
            return self.above_next
        if not bisect or self.hi - self.lo <= self.step:
            self.done = True
            return None
        if self.hint_bytes is not None and self.hint_result is None and self.lo < self.hint_bytes < self.hi:
            return self.hint_bytes
        if self.gallop:
            probe = (self.hi - self.gallop) if self.hint_result else (self.lo + self.gallop)
            if self.lo < probe < self.hi:
                return probe
            self.gallop = 0
        return (self.lo + self.hi) // 2

    def record(self, trial: dict[str, Any], pool_bytes: int) -> None:
        """Take one trial's result (not a physical OOM: those are repeated, not recorded here)."""
        self.trials.append(trial)
        cap = trial["cap_bytes"]
        oom = not trial["ok"] and "out of memory" in trial["error"].lower()
        if not trial["ok"] and not oom:
            self.error = trial["error"] or "the trial process failed without an error line"
            self.done = True
            return
        if self.first is None:
            if trial["ok"] and trial["num_alloc_retries"] == 0:
                self.first = trial  # the cap never bound: an uncapped run's peaks
                self.lo = trial["peak_allocated_bytes"] - 1 if self.floor else 0
                self.hi = trial["peak_reserved_bytes"]
                scale = trial["peak_allocated_bytes"] if self.floor or not self.hint_bytes else self.hint_bytes
                self.step = max(int(self.tolerance * scale), 2 << 20)
                self.gallop = 2 * self.step
                if self.hint_bytes is None or not self.lo < self.hint_bytes < self.hi:
                    self.hint_result, self.gallop = False, 0
                return
            if cap >= pool_bytes - CONTEXT_BYTES:
                self.error = f"needs more than the whole GPU ({cap / GIB:.1f} GiB cap): {trial['error']}"
                self.done = True
                return
            self.first_cap = min(pool_bytes - CONTEXT_BYTES, 2 * cap)
            return
        ok = bool(trial["ok"])
        if self.above_next and cap == self.above_next:
            if ok:
                self.above_passing, self.above_next = cap, cap - self.above_spacing
            else:  # out of memory above the answer: bisect between it and the cap above it that ran
                self.lo, self.hi, self.above_next, self.gallop = cap, self.above_passing, 0, 0
            return
        if ok:
            self.hi = min(self.hi, cap)
        else:
            self.lo = max(self.lo, cap)
        if self.hint_bytes is not None and cap == self.hint_bytes and self.hint_result is None:
            self.hint_result = ok
        elif self.gallop:
            if ok == self.hint_result:
                self.gallop *= 2  # still on the hint's side: step further
            else:
                self.gallop = 0  # flipped: bracket found, bisect

    tolerance: float = 0.005


def _load_state(entry_id: str, folders: list[Path]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(finished record, partial state) for an entry, from the first folder that has it."""
    for folder in folders:
        done = folder / f"{entry_id}.json"
        if done.exists():
            return json.loads(done.read_text()), None
    for folder in folders:
        part = folder / f"{entry_id}.partial.json"
        if part.exists():
            return None, json.loads(part.read_text())
    return None, None


def _device() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        sys.exit("measure_corpus.py needs a CUDA GPU; none is visible.")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "total_bytes": props.total_memory, "torch_version": torch.__version__,
            "cuda_version": str(torch.version.cuda)}


@dataclass(frozen=True)
class Entry:
    """What the scheduler needs of one step to measure: where to load it, a rough size, a hint, a reason to skip."""

    id: str
    spec: str
    """``file.py:NAME``, as ``memfit.estimate.measure.run_trial`` takes it."""
    guess_bytes: int
    """A rough peak, for the first trial's cap."""
    hint_bytes: int | None
    """A predicted ``fits_in``, where the bisection starts."""
    skip: str = ""
    """Why it cannot run here (a missing library), or empty."""


def _missing(modules: tuple[str, ...]) -> str:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"not installed here: {', '.join(missing)}" if missing else ""


def corpus_entries(split: str | None, ids: list[str] | None, predictions: str | None) -> list[Entry]:
    """The corpus's entries (``split``, ``ids``), in corpus order, hinted by ``predict_corpus.py``'s folder."""
    sys.path.insert(0, str(HERE))
    import corpus

    found = []
    for e in corpus.entries(split):
        if ids and e["id"] not in ids:
            continue
        hint = None
        pred = Path(predictions) / f"{e['id']}.json" if predictions else None
        if pred is not None and pred.exists():
            hint = (json.loads(pred.read_text()).get("estimate") or {}).get("fits_in_bytes")
        found.append(Entry(e["id"], f"{HERE / 'corpus.py'}:{e['id']}", int(e["rough_peak_gib"] * GIB), hint,
                           _missing(corpus.REQUIRES.get(e["family"], ()))))
    return found


ZOO_ORDER_SEED = 1127
"""The zoo's measuring order is a shuffle with this seed, fixed before its first measurement (2026-11-27): a run
cut short by its budget measured a prefix of it, a random sample of the zoo."""


def zoo_entries(predictions: str, ids: list[str] | None) -> list[Entry]:
    """The zoo's entries in a seeded random order, sized and hinted by a ``trace_coverage.py`` JSON (its CPU
    estimates; an entry it did not estimate gets a 4 GiB guess and no hint)."""
    import random

    sys.path.insert(0, str(HERE.parent / "zoo"))
    from registry import entries as zoo

    estimates = {r["name"]: r.get("estimate") or {} for r in json.loads(Path(predictions).read_text())["rows"]}
    found = zoo()
    random.Random(ZOO_ORDER_SEED).shuffle(found)  # the whole zoo's order, whatever is chosen from it
    found = [e for e in found if not ids or e.name in ids]
    return [Entry(e.name, e.spec, estimates.get(e.name, {}).get("device_bytes") or 4 * GIB,
                  estimates.get(e.name, {}).get("fits_in_bytes"), _missing(e.requires)) for e in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="default: $OUT/corpus_measurements_<card>_torch<x.y>_<date>")
    parser.add_argument("--done", action="append", default=[], help="folders of earlier results to resume from")
    default_predictions = latest("estimate", "corpus_predictions_cpu")
    parser.add_argument("--predictions", default=str(default_predictions) if default_predictions.is_dir() else None,
                        help="predict_corpus.py's folder: start each bisection at the predicted fits_in")
    parser.add_argument("--split", choices=("fit", "validation"))
    parser.add_argument("--ids", help="comma-separated entry ids")
    parser.add_argument("--zoo", metavar="COVERAGE_JSON",
                        help="measure the zoo (benchmarks/zoo/) instead, in a seeded order, sized and hinted by "
                             "this trace_coverage.py result")
    parser.add_argument("--concurrency", type=int, default=5, help="trial processes at a time")
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="GPU memory no ticket may use")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop by this many seconds from the start")
    parser.add_argument("--trial-timeout-s", type=float, default=300.0)
    parser.add_argument("--tolerance", type=float, default=0.005, help="bisection stops at this fraction of peak")
    parser.add_argument("--no-bisect", action="store_true", help="peaks only: one trial per entry")
    parser.add_argument("--check-above", type=int, default=0, metavar="N",
                        help="after bisecting, try N caps above the answer (EntryState.check_above); finished "
                             "records without that check are taken up again from their trials")
    parser.add_argument("--no-floor", action="store_true",
                        help="steps whose allocations grow with the memory they are given (cudnn.benchmark): "
                             "bisect from 0, not from the uncapped peak allocated (EntryState.floor)")
    parser.add_argument("--fresh", action="store_true",
                        help="measure again: resume only from --out and --done, not from the committed results")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s

    from memfit.estimate.measure import run_trial

    device = _device()
    ids = args.ids.split(",") if args.ids else None
    chosen = zoo_entries(args.zoo, ids) if args.zoo else corpus_entries(args.split, ids, args.predictions)
    kind = "zoo_measurements" if args.zoo else "corpus_measurements"
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), stem(
        kind, card(device["gpu"]), device["torch_version"])))
    out.mkdir(parents=True, exist_ok=True)
    earlier = latest("estimate", f"{kind}_{card(device['gpu'])}_{torch_tag(device['torch_version'])}")
    folders = [out, *map(Path, args.done), *([earlier] if earlier.is_dir() and not args.fresh else [])]
    pool_bytes = device["total_bytes"] - int(args.reserve_gib * GIB)
    skipped = {e.id: e.skip for e in chosen if e.skip}
    meta = {**device, "date": dt.date.today().isoformat(), "concurrency": args.concurrency,
            "tolerance": args.tolerance, "floor": not args.no_floor,
            # every trial inherits it (run_trial): a draw under the settings users set (zoo/allocator_draw.py)
            "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}

    states: dict[str, EntryState] = {}
    for e in chosen:
        finished, partial = _load_state(e.id, folders)
        unchecked = bool(args.check_above and finished is not None and finished.get("fits_in_bytes") is not None
                         and "bisected_fits_in_bytes" not in finished)
        if finished is not None and not unchecked and (args.no_bisect or finished.get("fits_in_bytes") is not None
                                                       or finished.get("error")):
            if not (out / f"{e.id}.json").exists():
                (out / f"{e.id}.json").write_text(json.dumps(finished, indent=1))
            continue
        if e.id in skipped:
            continue
        hint = e.hint_bytes
        state = EntryState(id=e.id, hint_bytes=hint, guess_bytes=e.guess_bytes, tolerance=args.tolerance,
                           check_above=args.check_above, floor=not args.no_floor)
        if finished is not None:  # a peaks-only or unchecked record: its trials seed the bisection
            for trial in finished.get("trials", []):
                if not trial.get("physical_oom"):
                    state.record(trial, device["total_bytes"] - int(args.reserve_gib * GIB))
            state.done = False
            if unchecked:
                state.hint_result, state.gallop = False, 0  # its bisection is over: on to the check above
        elif partial is not None:
            state = EntryState(**{**asdict(state), **{k: v for k, v in partial.items() if k != "id"}})
            state.hint_bytes = hint if hint is not None else state.hint_bytes
        states[e.id] = state
    print(f"{device['gpu']}: {len(states)} entries to measure, {len(chosen) - len(states) - len(skipped)} done "
          f"already, {len(skipped)} skipped (missing libraries); {args.concurrency} trials at a time, "
          f"{args.budget_s:.0f} s budget", flush=True)
    for i, why in skipped.items():
        print(f"  skip {i}: {why}", flush=True)

    lock = threading.Lock()
    in_use = 0
    running: dict[Future[Any], tuple[EntryState, int, int, float]] = {}
    overlap: dict[str, int] = {}
    typical_s = 30.0  # a trial's wall time (imports, CUDA init, build, 3 steps); updated as trials finish

    def write(state: EntryState) -> None:
        record = {"id": state.id, **meta, "hint_bytes": state.hint_bytes, "trials": state.trials}
        if state.done:
            first = state.first or {}
            record.update(
                peak_allocated_bytes=first.get("peak_allocated_bytes"),
                peak_reserved_bytes=first.get("peak_reserved_bytes"),
                outside_allocator_bytes=first.get("outside_allocator_bytes"),
                fits_in_bytes=None if args.no_bisect or state.error or not first else state.hi,
                **({"bisected_fits_in_bytes": state.bisected_bytes, "check_above": state.check_above,
                    "above_spacing_bytes": state.above_spacing} if state.check_above else {}),
                error=state.error, measured_s=sum(t.get("wall_s", 0) for t in state.trials),
            )
            (out / f"{state.id}.json").write_text(json.dumps(record, indent=1))
            (out / f"{state.id}.partial.json").unlink(missing_ok=True)
        else:
            (out / f"{state.id}.partial.json").write_text(json.dumps(asdict(state), indent=1))

    spec_of = {e.id: e.spec for e in chosen}
    waiting = list(states)  # entries with no trial running, in corpus order
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        while waiting or running:
            now = time.monotonic()
            launched = False
            for entry_id in list(waiting):
                if len(running) >= args.concurrency or now + typical_s > deadline:
                    break
                state = states[entry_id]
                cap = state.next_cap(pool_bytes, not args.no_bisect)
                if cap is None:
                    waiting.remove(entry_id)
                    write(state)
                    print(f"{entry_id}: {'ERROR ' + state.error[:160] if state.error else 'done'} "
                          f"(peak {((state.first or {}).get('peak_allocated_bytes') or 0) / GIB:.2f} GiB, "
                          f"fits in {state.hi / GIB:.2f} GiB, {len(state.trials)} trials)", flush=True)
                    continue
                ticket = cap + CONTEXT_BYTES
                with lock:
                    if in_use + ticket > pool_bytes:
                        continue  # a smaller trial further on may fit now
                    in_use += ticket
                timeout = max(10.0, min(args.trial_timeout_s, deadline - now))
                fut = pool.submit(run_trial, spec_of[entry_id], cap_bytes=cap, timeout_s=timeout)
                running[fut] = (state, cap, ticket, now)
                overlap[entry_id] = len(running) - 1
                for other_state, *_ in running.values():
                    overlap[other_state.id] = max(overlap.get(other_state.id, 0), len(running) - 1)
                waiting.remove(entry_id)
                launched = True
            if not running:
                if waiting and not launched:
                    if time.monotonic() + typical_s > deadline:
                        break
                    # nothing runs and nothing fits: the largest ticket exceeds the pool; let it run alone
                    state = states[waiting[0]]
                    state.first_cap = min(state.first_cap or pool_bytes, pool_bytes - CONTEXT_BYTES)
                    if state.next_cap(pool_bytes, not args.no_bisect) is not None and \
                            state.next_cap(pool_bytes, not args.no_bisect) + CONTEXT_BYTES > pool_bytes:
                        state.error, state.done = "its trial needs more than the GPU's pool", True
                continue
            finished, _ = wait(list(running), timeout=5, return_when=FIRST_COMPLETED)
            for fut in finished:
                state, cap, ticket, t0 = running.pop(fut)
                with lock:
                    in_use -= ticket
                wall = time.monotonic() - t0
                try:
                    trial = asdict(fut.result())
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline - 1:
                        write(state)  # budget over: keep what it had, the next run goes on
                        continue
                    trial = {"ok": False, "cap_bytes": cap, "peak_allocated_bytes": 0, "peak_reserved_bytes": 0,
                             "outside_allocator_bytes": 0, "num_alloc_retries": 0, "elapsed_s": wall,
                             "error": f"trial timed out after {args.trial_timeout_s:.0f} s"}
                trial.update(wall_s=round(wall, 2), overlapping_trials=overlap.pop(state.id, 0))
                typical_s = max(typical_s * 0.8 + wall * 0.2, 10.0)
                repeats = sum(bool(t.get("physical_oom")) for t in state.trials)
                if not trial["ok"] and physical_oom(trial["error"]) and repeats < 5:
                    print(f"{state.id}: physical OOM at cap {cap / GIB:.2f} GiB (other trials): repeating",
                          flush=True)
                    state.trials.append({**trial, "physical_oom": True})
                else:
                    state.record(trial, pool_bytes)
                write(state)
                if not state.done:
                    waiting.insert(0, state.id)  # go on with it before starting new entries
                else:
                    print(f"{state.id}: {'ERROR ' + state.error[:160] if state.error else 'done'}", flush=True)
    left = [i for i, s in states.items() if not s.done]
    print(f"stopped after {time.monotonic() - started:.0f} s: {len(states) - len(left)} finished, "
          f"{len(left)} left (run again with --done {out} to go on)", flush=True)


if __name__ == "__main__":
    main()
