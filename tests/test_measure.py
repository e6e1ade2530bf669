"""A measurement trial without a GPU: the process it starts, what it reads back, and the files it writes
(memory snapshot, allocator trace), whole or not at all."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.errors import UsageError
from memfit.estimate import measure
from memfit.estimate.measure import Trial, _write_compact_trace, _write_snapshot, run_trial

# the shape of torch.cuda.memory._snapshot(): one trace per device, entries with frames
SNAPSHOT = {"segments": [], "device_traces": [[
    {"action": "alloc", "addr": 4096, "size": 512, "frames": [{"filename": "/x/train.py", "line": 7, "name": "step"}]},
    {"action": "free_requested", "addr": 4096, "size": 512, "frames": []},
    {"action": "snapshot", "addr": 0, "size": 0},
    {"action": "oom", "device_free": 1024, "size": 2048, "frames": []},  # no address: the device's free bytes
]]}
STATS = {"allocated_bytes.all.peak": 512, "num_alloc_retries": 0}


def test_trace_and_snapshot_are_written_and_read_back(tmp_path: Path) -> None:
    _write_compact_trace(SNAPSHOT, str(tmp_path / "t.json.gz"), STATS)
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        trace = json.load(f)
    assert trace == {"events": [["alloc", 4096, 512, "train.py:7:step"], ["free_requested", 4096, 512, ""],
                                ["oom", 1024, 2048, ""]],
                     "stats": {"allocated_bytes.all.peak": 512}}
    _write_snapshot(SNAPSHOT, str(tmp_path / "s.pickle"))
    with open(tmp_path / "s.pickle", "rb") as f:
        assert pickle.load(f) == SNAPSHOT  # noqa: S301 - the file this test just wrote
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pickle", "t.json.gz"]


@pytest.mark.parametrize("write", [
    lambda path: _write_compact_trace(SNAPSHOT, path, STATS),
    lambda path: _write_snapshot(SNAPSHOT, path),
], ids=["trace", "snapshot"])
def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write) -> None:  # noqa: ANN001
    target = tmp_path / "out"
    target.write_bytes(b"old")

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(UsageError, match="No space left on device"):
        write(str(target))
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_trial_runs_this_module_in_a_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    trial = Trial(ok=False, cap_bytes=5 << 30, peak_allocated_bytes=1, peak_reserved_bytes=2, outside_allocator_bytes=3,
                  num_alloc_retries=4, elapsed_s=0.5, error="CUDA out of memory.")
    seen: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="a warning\n" + trial.to_json() + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    assert run_trial("mlp", batch_size=8, cap_bytes=5 << 30) == trial  # the last JSON line, read back
    cmd = seen[0]
    module = cmd[cmd.index("-m") + 1]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin == measure.__file__
    assert cmd[cmd.index("-m") + 2:] == ["mlp", "--batch-size", "8", "--cap-bytes", str(5 << 30)]


def test_the_trial_module_runs_as_a_script() -> None:
    out = subprocess.run([sys.executable, "-m", measure.TRIAL_MODULE, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: python -m memfit.estimate.measure" in out.stdout, out.stderr


def test_the_bisection_is_checked_from_above(monkeypatch: pytest.MonkeyPatch) -> None:
    # a step that runs from 3400 MiB but runs out of memory again at 3600-3759 MiB (FCN-ResNet50 on an H200 did so
    # between 4.80 and 4.88 GB): bisection alone answers ~3400; the caps tried above it find the window
    import torch

    mib = 2**20
    caps: list[int | None] = []

    def fake_trial(spec: str, *, cap_bytes: int | None = None, **kwargs: object) -> Trial:
        caps.append(cap_bytes)
        ok = cap_bytes is None or (cap_bytes >= 3400 * mib and not 3600 * mib <= cap_bytes < 3760 * mib)
        return Trial(ok=ok, cap_bytes=cap_bytes, peak_allocated_bytes=3000 * mib, peak_reserved_bytes=4000 * mib,
                     outside_allocator_bytes=500 * mib, num_alloc_retries=0, elapsed_s=1.0)

    class Props:
        name, total_memory = "a fake GPU", 80 << 30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(measure, "run_trial", fake_trial)
    result = measure.measure("mlp")
    assert 3760 * mib <= result.fits_in_bytes <= 3760 * mib + 15 * mib  # within the bisection's tolerance above it
    assert any(c is not None and 3600 * mib <= c < 3760 * mib for c in caps)
    monkeypatch.setattr(measure, "ABOVE_TRIALS", 0)
    assert measure.measure("mlp").fits_in_bytes < 3600 * mib  # without the check: below a cap that fails


@pytest.mark.parametrize("hint", [None, 15 << 30])
def test_a_step_in_cudnn_benchmark_mode_is_bisected_below_its_uncapped_peak(monkeypatch: pytest.MonkeyPatch,
                                                                              hint: int | None) -> None:
    # cudnn.benchmark sizes its algorithm search by what the allocator grants: uncapped the step peaks at 80 GiB,
    # under any cap from 14 GiB it runs (FCN-ResNet101 on an H200: 83.6 GB uncapped, ran under 15.4 GB)
    import torch

    need, greedy = (14 << 30) + (123 << 20), 80 << 30

    def fake_trial(spec: str, *, cap_bytes: int | None = None, **kwargs: object) -> Trial:
        ok = cap_bytes is None or cap_bytes >= need
        peak = greedy if cap_bytes is None else min(cap_bytes, greedy)
        return Trial(ok=ok, cap_bytes=cap_bytes, peak_allocated_bytes=peak if ok else 0,
                     peak_reserved_bytes=peak if ok else 0, outside_allocator_bytes=500 << 20,
                     num_alloc_retries=int(cap_bytes is not None), elapsed_s=1.0, cudnn_benchmark=True)

    class Props:
        name, total_memory = "a fake GPU", 141 << 30

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(measure, "run_trial", fake_trial)
    result = measure.measure("mlp", hint_bytes=hint)
    assert result.cudnn_benchmark and result.peak_allocated_bytes == greedy
    assert need <= result.fits_in_bytes <= need * 1.005 + (2 << 20)  # tolerance of its answer, not of the peak
