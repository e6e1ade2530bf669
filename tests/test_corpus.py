"""The validation corpus (benchmarks/corpus/): drawn reproducibly, split in halves, loadable as workloads, and its
GPU driver's bisection finds the smallest cap on a simulated GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "benchmarks" / "corpus"
sys.path.insert(0, str(CORPUS))

import generate  # noqa: E402
import measure_corpus  # noqa: E402

GIB = 2**30


def test_committed_corpus_is_what_the_seeded_generator_draws() -> None:
    committed = json.loads((CORPUS / "corpus.json").read_text())
    assert generate.draw() == committed


def test_halves_are_large_and_hold_every_family() -> None:
    entries = generate.draw()["entries"]
    fit = [e for e in entries if e["split"] == "fit"]
    val = [e for e in entries if e["split"] == "validation"]
    assert len(fit) >= 50 and len(val) >= 50
    assert {e["family"] for e in fit} == {e["family"] for e in val} == set(generate.QUOTAS)
    assert len({e["id"] for e in entries}) == len(entries)


def test_size_rule_keeps_every_entry_under_its_limit() -> None:
    for e in generate.draw()["entries"]:
        assert generate.rough_peak_bytes(e) <= generate.LIMIT_BYTES, e["id"]


def test_every_entry_loads_through_memfits_file_loader() -> None:
    from memfit.workload.loading import load_workload

    entries = json.loads((CORPUS / "corpus.json").read_text())["entries"]
    for e in entries:
        w = load_workload(f"{CORPUS / 'corpus.py'}:{e['id']}")
        assert (w.name, w.batch_size, w.precision) == (e["id"], e["batch_size"], e["precision"])
        assert w.optimizer_impl == e["optimizer"]["impl"]
        if hasattr(w, "keep_output"):
            assert w.keep_output == e["keep_output"]


def test_unknown_entry_is_an_attribute_error() -> None:
    import corpus

    with pytest.raises(AttributeError):
        corpus.c999_nothing  # noqa: B018


def _simulate(need: int, alloc: int, reserved: int, hint: int | None, tolerance: float = 0.005) -> tuple[int, int]:
    """Run EntryState against a GPU on which a trial runs iff its cap >= need. Returns (found cap, trials)."""
    pool = 80 * GIB
    state = measure_corpus.EntryState(id="x", hint_bytes=hint, guess_bytes=alloc, tolerance=tolerance)
    while True:
        cap = state.next_cap(pool, bisect=True)
        if cap is None:
            break
        ok = cap >= need
        state.record({"ok": ok, "cap_bytes": cap, "peak_allocated_bytes": alloc if ok else 0,
                      "peak_reserved_bytes": reserved if ok else 0, "outside_allocator_bytes": 0,
                      "num_alloc_retries": 0, "elapsed_s": 1.0,
                      "error": "" if ok else "CUDA out of memory. Tried to allocate 2.00 MiB."}, pool)
        assert len(state.trials) < 40
    assert not state.error
    return state.hi, len(state.trials)


@pytest.mark.parametrize("hint_error", [None, -0.05, -0.01, 0.0, 0.01, 0.08])
def test_bisection_finds_the_smallest_cap_within_tolerance(hint_error: float | None) -> None:
    alloc, need, reserved = 10 * GIB, int(10.6 * GIB), 12 * GIB
    hint = None if hint_error is None else int(need * (1 + hint_error))
    found, trials = _simulate(need, alloc, reserved, hint)
    assert need <= found <= need + max(int(0.005 * alloc), 2 << 20)
    if hint_error is not None and abs(hint_error) <= 0.01:
        assert trials <= 6  # a close prediction saves trials


@pytest.mark.parametrize("window", [(10.80, 10.95), (11.50, 11.62), None])
def test_check_above_finds_the_smallest_cap_at_and_above_which_it_runs(window: tuple[float, float] | None) -> None:
    """A GPU where caps in ``window`` (GiB) run out of memory although 10.6 GiB runs: the bisection answers 10.6;
    six caps checked above it find the window and bisect above its top."""
    alloc, need, reserved = 10 * GIB, int(10.6 * GIB), 12 * GIB
    pool = 80 * GIB
    fails = (lambda cap: False) if window is None else (lambda cap: window[0] * GIB <= cap < window[1] * GIB)
    state = measure_corpus.EntryState(id="x", hint_bytes=None, guess_bytes=alloc, check_above=6)
    while (cap := state.next_cap(pool, bisect=True)) is not None:
        ok = cap >= need and not fails(cap)
        state.record({"ok": ok, "cap_bytes": cap, "peak_allocated_bytes": alloc if ok else 0,
                      "peak_reserved_bytes": reserved if ok else 0, "outside_allocator_bytes": 0,
                      "num_alloc_retries": 0, "elapsed_s": 1.0,
                      "error": "" if ok else "CUDA out of memory. Tried to allocate 2.00 MiB."}, pool)
        assert len(state.trials) < 40
    step = int(0.005 * alloc)
    assert state.bisected_bytes is not None and need <= state.bisected_bytes <= need + step
    top = need if window is None else int(window[1] * GIB)
    assert top <= state.hi <= top + step
    assert sum(t["cap_bytes"] > state.bisected_bytes for t in state.trials) >= (6 if window is None else 1)


def test_without_the_floor_the_bisection_goes_below_the_uncapped_peak() -> None:
    """cuDNN's benchmark mode takes what memory it is given: uncapped the step peaks at 80 GiB, under any cap from 15
    GiB up it runs. With the floor the answer cannot go below the uncapped peak; without it the bisection finds 15
    GiB, to a tolerance of the hint."""
    pool, need, greedy = 120 * GIB, 15 * GIB, 80 * GIB

    def measure(floor: bool) -> measure_corpus.EntryState:
        state = measure_corpus.EntryState(id="x", hint_bytes=16 * GIB, guess_bytes=16 * GIB, floor=floor)
        while (cap := state.next_cap(pool, bisect=True)) is not None:
            ok, bound = cap >= need, cap < greedy  # a cap under the greedy peak binds: retries, not an OOM
            state.record({"ok": ok, "cap_bytes": cap, "peak_allocated_bytes": min(cap, greedy) if ok else 0,
                          "peak_reserved_bytes": min(cap, greedy) if ok else 0, "outside_allocator_bytes": 0,
                          "num_alloc_retries": int(bound), "elapsed_s": 1.0,
                          "error": "" if ok else "CUDA out of memory. Tried to allocate 2.00 MiB."}, pool)
            assert len(state.trials) < 40
        return state

    assert measure(floor=True).hi >= greedy - 1
    state = measure(floor=False)
    assert need <= state.hi <= need + int(0.005 * 16 * GIB)


def test_first_run_whose_cap_bound_is_repeated_with_twice_the_cap() -> None:
    state = measure_corpus.EntryState(id="x", hint_bytes=None, guess_bytes=GIB)
    first = state.next_cap(80 * GIB, bisect=True)
    assert first == 4 * GIB
    state.record({"ok": True, "cap_bytes": first, "peak_allocated_bytes": 3 * GIB, "peak_reserved_bytes": first,
                  "outside_allocator_bytes": 0, "num_alloc_retries": 2, "elapsed_s": 1.0, "error": ""}, 80 * GIB)
    assert state.first is None and state.next_cap(80 * GIB, bisect=True) == 8 * GIB


def test_a_crash_that_is_not_an_oom_ends_the_entry_with_its_error() -> None:
    state = measure_corpus.EntryState(id="x", hint_bytes=None, guess_bytes=GIB)
    cap = state.next_cap(80 * GIB, bisect=True)
    state.record({"ok": False, "cap_bytes": cap, "peak_allocated_bytes": 0, "peak_reserved_bytes": 0,
                  "outside_allocator_bytes": 0, "num_alloc_retries": 0, "elapsed_s": 1.0,
                  "error": "RuntimeError: shapes cannot be multiplied"}, 80 * GIB)
    assert state.done and "shapes" in state.error


def test_physical_oom_is_told_apart_from_the_cap() -> None:
    cap_oom = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "61.02 GiB is free. Including non-PyTorch memory, this process has 18.1 GiB memory in use.")
    physical = ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "300.00 MiB is free.")
    assert not measure_corpus.physical_oom(cap_oom)
    assert measure_corpus.physical_oom(physical)
    assert not measure_corpus.physical_oom("RuntimeError: something else")


def _on_simulated_gpu(monkeypatch: pytest.MonkeyPatch, trial: Callable[..., object]) -> None:
    """measure_corpus.main on an 80 GiB GPU that is not there: ``trial`` stands in for each trial process."""
    import importlib

    monkeypatch.setattr(importlib.import_module("memfit.estimate.measure"), "run_trial", trial)
    monkeypatch.setattr(measure_corpus, "_device", lambda: {
        "gpu": "Simulated GPU", "total_bytes": 80 * GIB, "torch_version": "x", "cuda_version": "y"})
    monkeypatch.setattr(measure_corpus, "_missing", lambda modules: "")


def _trial_that_runs_if(runs: Callable[[int], bool], allocated: int, reserved: int,
                        caps: list[int]) -> Callable[..., object]:
    """A trial that runs iff ``runs(cap)``, with these peaks when it does; each cap tried is appended to ``caps``."""
    import importlib

    trial_type = importlib.import_module("memfit.estimate.measure").Trial

    def trial(spec: str, *, cap_bytes: int, timeout_s: float, **_: object) -> object:
        caps.append(cap_bytes)
        ok = runs(cap_bytes)
        return trial_type(ok, cap_bytes, allocated if ok else 0, reserved if ok else 0, 0, 0, 0.1,
                          error="" if ok else "CUDA out of memory. Tried to allocate 2.00 MiB.")

    return trial


def test_driver_measures_resumes_and_keeps_tickets_within_the_gpu(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """measure_corpus.main on a simulated 80 GiB GPU: every entry finishes with a cap within tolerance, physical
    OOMs are repeated, the running caps never exceed the GPU, and a second run finds everything done."""
    import importlib
    import threading

    measure = importlib.import_module("memfit.estimate.measure")

    ids = [e["id"] for e in json.loads((CORPUS / "corpus.json").read_text())["entries"]][:8]
    need = {i: (2 + k) * GIB for k, i in enumerate(ids)}
    lock = threading.Lock()
    running = {"bytes": 0, "max": 0, "calls": 0}
    physical_done: set[str] = set()

    def fake_trial(spec: str, *, cap_bytes: int, timeout_s: float, **_: object) -> measure.Trial:
        entry = spec.rsplit(":", 1)[1]
        with lock:
            running["bytes"] += cap_bytes + measure_corpus.CONTEXT_BYTES
            running["max"] = max(running["max"], running["bytes"])
            running["calls"] += 1
        try:
            if entry == ids[0] and entry not in physical_done:
                physical_done.add(entry)
                return measure.Trial(False, cap_bytes, 0, 0, 0, 0, 0.1, error=(
                    "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
                    "which 10.00 MiB is free."))
            ok = cap_bytes >= need[entry]
            alloc = int(need[entry] * 0.95)
            return measure.Trial(ok, cap_bytes, alloc if ok else 0, int(need[entry] * 1.1) if ok else 0, 0, 0, 0.1,
                                 error="" if ok else "CUDA out of memory. Tried to allocate 2.00 MiB.")
        finally:
            with lock:
                running["bytes"] -= cap_bytes + measure_corpus.CONTEXT_BYTES

    _on_simulated_gpu(monkeypatch, fake_trial)
    argv = ["measure_corpus.py", "--out", str(tmp_path), "--ids", ",".join(ids), "--concurrency", "4",
            "--budget-s", "60"]
    monkeypatch.setattr(sys, "argv", argv)
    measure_corpus.main()
    for i in ids:
        record = json.loads((tmp_path / f"{i}.json").read_text())
        assert not record["error"]
        assert need[i] <= record["fits_in_bytes"] <= need[i] + max(int(0.005 * need[i]), 2 << 20)
        assert not (tmp_path / f"{i}.partial.json").exists()
    assert any(t.get("physical_oom") for t in json.loads((tmp_path / f"{ids[0]}.json").read_text())["trials"])
    assert running["max"] <= 80 * GIB - 4 * GIB
    calls = running["calls"]
    measure_corpus.main()  # resumed: nothing left to run
    assert running["calls"] == calls


def test_a_peaks_only_record_seeds_the_bisection(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--no-bisect first, then a bisecting run with --done: the first trial is not run again."""
    entry = json.loads((CORPUS / "corpus.json").read_text())["entries"][0]["id"]
    need, caps = 5 * GIB, []
    _on_simulated_gpu(monkeypatch, _trial_that_runs_if(lambda cap: cap >= need, int(need * 0.9), int(need * 1.2), caps))
    peaks, full = tmp_path / "peaks", tmp_path / "full"
    monkeypatch.setattr(sys, "argv", ["m", "--out", str(peaks), "--ids", entry, "--no-bisect", "--budget-s", "60"])
    measure_corpus.main()
    assert len(caps) == 1 and json.loads((peaks / f"{entry}.json").read_text())["fits_in_bytes"] is None
    monkeypatch.setattr(sys, "argv", ["m", "--out", str(full), "--ids", entry, "--done", str(peaks),
                                      "--predictions", str(tmp_path / "none"), "--budget-s", "60"])
    measure_corpus.main()
    record = json.loads((full / f"{entry}.json").read_text())
    assert caps[1] < caps[0]  # went straight to the bisection
    assert need <= record["fits_in_bytes"] <= need + max(int(0.005 * 0.9 * need), 2 << 20)


def test_check_above_takes_up_a_finished_record_without_running_its_trials_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A record bisected without the check (its answer in a lower window), then ``--check-above 5 --done``: only
    caps above the old answer run, and the new answer is above the window that ran out of memory."""
    entry = json.loads((CORPUS / "corpus.json").read_text())["entries"][0]["id"]
    need, window, reserved = 5 * GIB, (int(5.3 * GIB), int(5.45 * GIB)), 6 * GIB
    caps: list[int] = []
    _on_simulated_gpu(monkeypatch, _trial_that_runs_if(
        lambda cap: cap >= need and not window[0] <= cap < window[1], int(need * 0.9), reserved, caps))
    old, new = tmp_path / "old", tmp_path / "new"
    common = ["--ids", entry, "--predictions", str(tmp_path / "none"), "--budget-s", "60"]
    monkeypatch.setattr(sys, "argv", ["m", "--out", str(old), *common])
    measure_corpus.main()
    bisected = json.loads((old / f"{entry}.json").read_text())["fits_in_bytes"]
    assert need <= bisected < window[0] and "bisected_fits_in_bytes" not in json.loads(
        (old / f"{entry}.json").read_text())
    before = len(caps)
    monkeypatch.setattr(sys, "argv", ["m", "--out", str(new), "--done", str(old), "--check-above", "5", *common])
    measure_corpus.main()
    record = json.loads((new / f"{entry}.json").read_text())
    assert all(c > bisected for c in caps[before:])  # the old trials are not run again
    assert record["bisected_fits_in_bytes"] == bisected
    assert window[1] <= record["fits_in_bytes"] <= window[1] + max(int(0.005 * 0.9 * need), 2 << 20)


def test_report_takes_each_entry_from_the_last_folder_that_has_it(tmp_path: Path) -> None:
    """report_corpus.join: a later measurement folder (--also) and a later predictions folder (--also-predictions)
    win for the entries they hold; the others come from the first folders."""
    import report_corpus

    first, second = [e["id"] for e in json.loads((CORPUS / "corpus.json").read_text())["entries"]][:2]
    folders = {name: tmp_path / name for name in ("pred", "pred2", "meas", "meas2")}
    for folder in folders.values():
        folder.mkdir()

    def prediction(fits_in: int) -> dict:
        return {"estimate": {"peak_allocated_bytes": GIB, "peak_reserved_bytes": 2 * GIB, "fits_in_bytes": fits_in,
                             "fits_in_upper_bytes": fits_in + GIB, "uncertainty": []}}

    def measurement(fits_in: int) -> dict:
        return {"peak_allocated_bytes": GIB, "peak_reserved_bytes": 2 * GIB, "fits_in_bytes": fits_in, "error": ""}

    for entry in (first, second):
        (folders["pred"] / f"{entry}.json").write_text(json.dumps(prediction(2 * GIB)))
        (folders["meas"] / f"{entry}.json").write_text(json.dumps(measurement(2 * GIB)))
    (folders["pred2"] / f"{first}.json").write_text(json.dumps(prediction(3 * GIB)))
    (folders["meas2"] / f"{second}.json").write_text(json.dumps(measurement(4 * GIB)))
    rows = {r["id"]: r for r in report_corpus.join(folders["pred"], folders["meas"], also=(folders["meas2"],),
                                                   also_predictions=(folders["pred2"],))}
    assert (rows[first]["predicted_fits_in"], rows[first]["measured_fits_in"]) == (3 * GIB, 2 * GIB)
    assert (rows[second]["predicted_fits_in"], rows[second]["measured_fits_in"]) == (2 * GIB, 4 * GIB)


def test_the_bound_fit_covers_every_fit_step_and_says_which_set_each_constant() -> None:
    import fit_bound

    mib = 2**20

    def step(name: str, measured_mib: float, reasons: tuple[str, ...] = (), reason_bytes: int = 0) -> dict:
        return {"id": name, "set": "zoo", "replayed": 1000 * mib, "measured": int(measured_mib * mib),
                "need": measured_mib / 1000 - 1, "reasons": list(reasons), "reason_bytes": reason_bytes}

    needs = [step("plain", 1030), step("worst", 1041.5),
             step("erratic", 1050, ("conv_workspace_erratic",), reason_bytes=20 * mib),  # 3 % beyond its bytes
             step("rnn", 1200, ("rnn_kernel",))]  # 20 %: more than the 10 % prior and the base cover
    result = fit_bound.fit(needs, {"rnn_kernel": 0.10, "conv_workspace_erratic": 0.0})
    assert result["base_margin"] == 0.042  # 4.15 % rounded up to 0.1 %
    assert result["base_margin_set_by"]["entry"] == "worst"
    assert result["widths"]["rnn_kernel"] == 0.16  # 20 % - 4.2 %, rounded up to 0.5 %
    assert result["widths"]["conv_workspace_erratic"] == 0.0
    assert result["base_slack_bytes"] == 0
    for n in result["needs"]:  # every step at or under its bound
        width = sum(result["widths"][r] for r in n["reasons"])
        assert n["replayed"] * (1 + result["base_margin"] + width) + n["reason_bytes"] >= n["measured"], n["id"]
    assert result["widths_set_by"]["rnn_kernel"]["entry"] == "rnn"
