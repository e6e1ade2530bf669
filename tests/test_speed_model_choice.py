"""Which speed model a plan ranks with: the roofline on CPU, a calibration where this machine's GPU is the one
planned for, and an opt-out. The GPU is pretended (its properties and RNG calls, ``StrictFakeCuda``) and the
timing itself (``calibrate``, which needs kernels to run) is replaced; the choice and the search are real."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

from conftest import StrictFakeCuda
from memfit.errors import UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import detect_gpu, gpu_spec
from memfit.plan.search import plan
from memfit.speed import model_choice
from memfit.speed.model_choice import choose_speed_model
from memfit.speed.step_time import ROOFLINE, Calibration
from memfit.workload.zoo import builtin_workload

EFF = 64


def _plan(**kwargs: Any) -> Any:
    return plan(builtin_workload("mlp"), budget_bytes=4 << 30, effective_batch=EFF, gpu="h100",
                allocator=AllocatorConfig(), **kwargs)


class FakeCalibrate:
    """Stands for ``calibrate`` (it times kernels on a real GPU): records its calls, draws from the global random
    generator as building models does, and returns constants four times slower than the roofline's."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.error = error

    def __call__(self, workload: Any, **kwargs: Any) -> Calibration:
        self.calls.append({"workload": workload, **kwargs})
        torch.randn(100)  # what building a model and its batch does to the generator
        if self.error is not None:
            raise self.error
        params = dataclasses.replace(ROOFLINE, compute_efficiency=ROOFLINE.compute_efficiency / 4,
                                     memory_efficiency=ROOFLINE.memory_efficiency / 4, kernel_s=ROOFLINE.kernel_s * 4,
                                     forward_dispatch_s=ROOFLINE.forward_dispatch_s * 4,
                                     backward_dispatch_s=ROOFLINE.backward_dispatch_s * 4)
        return Calibration(params=params, gpu=kwargs["gpu"].name, workload=workload.name,
                           micro_batches=kwargs["micro_batches"], measured=((0.1, 0.2, 0.05),) * 2,
                           rms_log_error=0.04)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, strict_fake_cuda: StrictFakeCuda) -> Any:
    """A pretend CUDA machine whose current device (1) is an H100; ``name`` changes the card."""
    emptied: list[bool] = []
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 10**9, major=9, minor=0,
                                  multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    return types.SimpleNamespace(props=props, emptied=emptied, cuda=strict_fake_cuda)


@pytest.fixture
def fake_calibrate(monkeypatch: pytest.MonkeyPatch) -> FakeCalibrate:
    fake = FakeCalibrate()
    monkeypatch.setattr(model_choice, "calibrate", fake)
    return fake


def test_on_cpu_the_default_is_the_roofline_and_the_plan_says_why() -> None:
    assert not torch.cuda.is_available()
    p = _plan()
    assert p.speed_model == "roofline"
    assert p.notes[0] == "speed model: the roofline (no CUDA GPU here to calibrate on)"


def test_with_this_gpu_the_default_calibrates_and_ranks_with_it(fake_gpu: Any, fake_calibrate: FakeCalibrate
                                                                ) -> None:
    assert detect_gpu() is not None
    rng = torch.get_rng_state()
    p = _plan()
    assert p.speed_model == "calibrated" and "calibrated on this NVIDIA H100 80GB HBM3" in p.notes[0]
    assert "micro-batches 1, 2, 4, 8, 64 timed" in p.notes[0]
    (call,) = fake_calibrate.calls
    # the effective batch too: the largest micro-batch the plan can pick, where the GPU, not the host, is the limit
    assert call["micro_batches"] == (1, 2, 4, 8, EFF) and call["gpu"].name == gpu_spec("h100").name
    assert call["workload"].keep_output is False  # the loop the plan runs (TrainStep) is the one timed
    # the calibration is what ranks: its constants (four times slower) give other step times than the roofline's
    roofline = _plan(calibration="roofline")
    assert p.chosen.step_time_s > 2 * roofline.chosen.step_time_s
    # the timed steps left the random stream and the allocator's cache as they were
    assert torch.equal(torch.get_rng_state(), rng)
    assert fake_gpu.emptied and ("set_rng_state", 1) in fake_gpu.cuda.calls


@pytest.mark.parametrize("opt_out", ["roofline", None])
def test_the_opt_out_times_nothing(fake_gpu: Any, fake_calibrate: FakeCalibrate, opt_out: str | None) -> None:
    p = _plan(calibration=opt_out)
    assert p.speed_model == "roofline" and fake_calibrate.calls == []
    assert "calibration='roofline'" in p.notes[0]


def test_a_plan_for_another_card_than_this_one_uses_the_roofline(fake_gpu: Any, fake_calibrate: FakeCalibrate
                                                                 ) -> None:
    fake_gpu.props.name = "NVIDIA H200"
    p = _plan()
    assert p.speed_model == "roofline" and fake_calibrate.calls == []
    assert "the plan is for NVIDIA H100 80GB HBM3; this machine's GPU is NVIDIA H200" in p.notes[0]


def test_a_calibration_that_fails_leaves_the_roofline_with_the_reason(fake_gpu: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCalibrate(error=UsageError("calibration needs timings of at least 2 micro-batch sizes, got 1."))
    monkeypatch.setattr(model_choice, "calibrate", fake)
    p = _plan()
    assert p.speed_model == "roofline" and len(fake.calls) == 1
    assert "calibrating on NVIDIA H100 80GB HBM3 failed: UsageError: calibration needs timings" in p.notes[0]


def test_a_small_effective_batch_times_sizes_up_to_it(fake_gpu: Any, fake_calibrate: FakeCalibrate) -> None:
    for eff in (4, 1, 8, 9, 96):
        choose_speed_model(builtin_workload("mlp"), gpu_spec("h100"), effective_batch=eff)
    assert [c["micro_batches"] for c in fake_calibrate.calls] == [
        (1, 2, 4), (1, 2), (1, 2, 4, 8), (1, 2, 4, 8, 9), (1, 2, 4, 8, 96)]  # two sizes at least


def test_a_given_calibration_is_used_and_a_bad_value_is_one_line() -> None:
    given = FakeCalibrate()(builtin_workload("mlp"), micro_batches=(1, 2), gpu=gpu_spec("h100"))
    choice = choose_speed_model(builtin_workload("mlp"), gpu_spec("h100"), given)
    assert choice.name == "calibrated" and choice.calibration is given
    with pytest.raises(UsageError, match="calibration must be 'auto', 'roofline', None or a memfit.Calibration"):
        choose_speed_model(builtin_workload("mlp"), gpu_spec("h100"), "fast")  # type: ignore[arg-type]


def test_the_cli_says_which_speed_model_and_opts_out_with_roofline() -> None:
    def run(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "memfit.cli", "plan", "mlp", "--budget", "4GiB", "--json", *args],
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    default, roofline = run(), run("--roofline")
    assert default["speed_model"] == roofline["speed_model"] == "roofline"
    assert "no CUDA GPU here" in default["notes"][0] and "as asked" in roofline["notes"][0]


@pytest.mark.gpu
def test_gpu_a_plan_on_this_gpu_is_calibrated() -> None:
    here = detect_gpu()
    assert here is not None
    p = plan(builtin_workload("mlp"), budget_bytes=here.total_bytes // 2, effective_batch=EFF, gpu=here)
    assert p.speed_model == "calibrated", p.notes
    assert p.notes[0].startswith(f"speed model: calibrated on this {here.name}")


def test_ranks_that_plan_for_themselves_use_the_roofline() -> None:
    """Calibrated timings differ by rank, and so could their plans; the roofline gives all ranks one plan."""
    assert model_choice.per_rank_choice(1) == "auto" and model_choice.per_rank_choice(2) == "roofline"
