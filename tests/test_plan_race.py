"""Near-ties of the speed model settled by timing (``memfit.plan.race``): which contenders run, which one wins,
and the plan that comes out. Stand-in timings on the CPU; the real timer on the GPU."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Sequence

import pytest
import torch

from conftest import plan_unet
from memfit import estimate
from memfit.errors import DeviceError
from memfit.plan.race import RACE_SIZE, RACE_WITHIN, race, time_on_this_gpu
from memfit.plan.records import Candidate, Config
from memfit.plan.search import _racer, plan


def _candidate(micro: int, ms: float, *, verified: bool = True, fits: bool = True, mode: str = "full",
               expandable: bool = False) -> Candidate:
    config = Config(micro_batch=micro, accumulation_steps=64 // micro, precision="bf16", checkpoint=("b.0",),
                    checkpoint_mode=mode, expandable_segments=expandable)  # type: ignore[arg-type]
    return Candidate(config=config, device_bytes=1 << 30, fits_in_bytes=1 << 29, step_time_s=ms / 1e3,
                     samples_per_s=64e3 / ms, verified=verified, fits=fits)


class _Timer:
    """A stand-in racer: fixed seconds by configuration, and a record of what it was asked to run."""

    def __init__(self, seconds: dict[Config, float | None]) -> None:
        self.seconds, self.asked = seconds, []

    def __call__(self, configs: Sequence[Config]) -> list[float | None]:
        self.asked.append(list(configs))
        return [self.seconds.get(c, 1.0) for c in configs]


def _rank(c: Candidate) -> float:
    return c.step_time_s or 0.0


def test_the_contenders_are_the_near_ties_that_fit_fastest_first_and_the_fastest_measured_wins() -> None:
    chosen = _candidate(8, 100.0)
    near = _candidate(4, 100.0 * (1 + RACE_WITHIN) * 0.99, mode="reentrant")
    unverified = _candidate(16, 101.0, verified=False)
    too_big = _candidate(2, 100.5, fits=False)
    too_slow = _candidate(1, 100.0 * (1 + RACE_WITHIN) * 1.01)
    checked = dataclasses.replace(unverified, verified=True)
    verify_calls = []

    def verify(config: Config) -> Candidate:  # micro-batch 2 does not fit, with expandable segments or without
        verify_calls.append(config)
        return dataclasses.replace(checked, config=config, fits=config.micro_batch != 2)

    timer = _Timer({chosen.config: 0.105, checked.config: 0.102, near.config: 0.098})
    best, timed, note = race(chosen, [too_slow, near, too_big, chosen, unverified], rank=_rank, verify=verify,
                             racer=timer)
    # the pick first, then the near-ties by predicted time; the one only the memory line scored estimated first;
    # none that does not fit, none predicted more than RACE_WITHIN slower
    assert timer.asked == [[chosen.config, unverified.config, near.config]]
    assert verify_calls == [dataclasses.replace(too_big.config, expandable_segments=True), unverified.config]
    assert best.config == near.config and best.measured_step_s == pytest.approx(0.098)
    assert {c.config for c in timed} == {chosen.config, checked.config}
    assert all(c.measured_step_s is not None for c in timed)
    assert note is not None and "took the fastest measured" in note and "98.0 ms" in note


def test_at_most_race_size_run_and_a_contender_that_does_not_fit_when_estimated_is_left_out() -> None:
    chosen = _candidate(8, 100.0)
    others = [_candidate(m, 100.0 + m / 10, verified=False) for m in (1, 2, 4, 16, 32)]
    timer = _Timer({})

    def verify(config: Config) -> Candidate:  # the exact estimate of micro-batch 1 says it does not fit
        c = next(o for o in others if o.config.micro_batch == config.micro_batch)
        return dataclasses.replace(c, config=config, verified=True, fits=config.micro_batch != 1)

    race(chosen, others, rank=_rank, verify=verify, racer=timer)
    (asked,) = timer.asked
    assert len(asked) == RACE_SIZE
    assert [c.micro_batch for c in asked] == [8, 2, 4]


def test_no_near_tie_no_speed_model_or_nothing_ran_keeps_the_pick() -> None:
    chosen = _candidate(8, 100.0)
    far = _candidate(4, 200.0)
    timer = _Timer({})
    assert race(chosen, [far], rank=_rank, verify=lambda c: far, racer=timer) == (chosen, [], None)
    assert not timer.asked
    blind = dataclasses.replace(chosen, step_time_s=None)
    assert race(blind, [far], rank=_rank, verify=lambda c: far, racer=timer)[0] is blind
    # both ran out of memory here: the prediction decides, and the note says so
    near = _candidate(4, 101.0)
    best, timed, note = race(chosen, [near], rank=_rank, verify=lambda c: near,
                             racer=_Timer({chosen.config: None, near.config: None}))
    assert best is chosen and note is not None and "none ran" in note
    # one ran out of memory: the other wins whatever its time
    best, _, note = race(chosen, [near], rank=_rank, verify=lambda c: near,
                         racer=_Timer({chosen.config: None, near.config: 9.0}))
    assert best.config == near.config and "did not run" in (note or "")


def test_the_same_configuration_with_expandable_segments_is_not_a_contender() -> None:
    chosen = _candidate(8, 100.0)
    twin = _candidate(8, 100.0, expandable=True)
    timer = _Timer({})
    assert race(chosen, [twin, chosen], rank=_rank, verify=lambda c: twin, racer=timer) == (chosen, [], None)


def test_plan_takes_the_near_tie_the_timings_call_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    w = plan_unet()
    biggest = estimate(w.replace(keep_output=False)).device_upper_bytes
    smallest = estimate(w.replace(batch_size=1, accumulation_steps=8, keep_output=False)).device_upper_bytes
    budget = (smallest + biggest) // 2
    calm = plan(w, budget_bytes=budget, calibration="roofline", race=False)
    # this small U-Net's candidates are far apart (the next after the pick 37 % slower): a window that takes them
    monkeypatch.setattr(importlib.import_module("memfit.plan.race"), "RACE_WITHIN", 1.0)
    asked: list[list[Config]] = []

    def backwards(configs: Sequence[Config]) -> list[float | None]:  # the walk's pick is the slowest here
        asked.append(list(configs))
        return [float(len(configs) - i) for i in range(len(configs))]

    raced = plan(w, budget_bytes=budget, calibration="roofline", race=backwards)
    (field,) = asked
    assert field[0] == calm.chosen.config and len(field) >= 2
    assert raced.chosen.config == field[-1] != calm.chosen.config
    assert raced.chosen.verified and raced.chosen.fits and raced.chosen.measured_step_s == 1.0
    assert raced.chosen.step_time_s <= calm.chosen.step_time_s * 2
    # the exact estimate of the one taken fits the budget, as every plan's does (with its allocator setting:
    # expandable segments are not a workload field)
    from memfit.estimate.allocator import AllocatorConfig

    allocator = AllocatorConfig(expandable_segments=raced.chosen.config.expandable_segments)
    again = estimate(w.replace(keep_output=False, **raced.chosen.config.changes()), allocator=allocator)
    assert again.device_upper_bytes <= budget
    assert any("took the fastest measured" in n for n in raced.notes)


def test_racing_is_on_only_where_a_gpu_is_here_to_time_on() -> None:
    from memfit.estimate.gpus import gpu_spec

    w, h100 = plan_unet(), gpu_spec("h100")
    assert _racer(False, w, h100, "calibrated") is None
    assert _racer(None, w, h100, "roofline") is None  # the roofline plans on a CPU: nothing to time on
    stand_in = _Timer({})
    assert _racer(stand_in, w, h100, "roofline") is stand_in
    if not torch.cuda.is_available():
        assert _racer(None, w, h100, "calibrated") is None
        with pytest.raises(DeviceError, match="no CUDA GPU here"):
            _racer(True, w, h100, "roofline")


@pytest.mark.gpu
def test_gpu_the_timer_runs_each_configuration_and_gives_its_step_time() -> None:
    w = plan_unet(batch_size=2, accumulation_steps=4)
    small = Config(micro_batch=2, accumulation_steps=4, precision="fp32")
    whole = Config(micro_batch=8, accumulation_steps=1, precision="fp32")
    before = torch.cuda.memory_allocated()
    times = time_on_this_gpu(w)([small, whole])
    assert all(t is not None and 0 < t < 10 for t in times), times
    assert torch.cuda.memory_allocated() == before  # every build freed


def test_a_contender_that_fits_only_with_expandable_segments_runs_with_them() -> None:
    """GPT-2 at 9 GiB on an H100: the pick has expandable segments, and so must its near-tie in the other mode."""
    chosen = _candidate(8, 100.0, expandable=True)
    other = _candidate(8, 100.5, verified=False, mode="reentrant")

    def verify(config: Config) -> Candidate:
        return dataclasses.replace(other, config=config, verified=True, fits=config.expandable_segments)

    timer = _Timer({})
    race(chosen, [other], rank=_rank, verify=verify, racer=timer)
    assert timer.asked == [[chosen.config, dataclasses.replace(other.config, expandable_segments=True)]]


def test_the_terminal_says_what_the_pick_ran_in_and_the_json_keeps_it() -> None:
    from rich.console import Console

    from conftest import small_plan
    from memfit.plan.records import Plan
    from memfit.report.terminal import render_plan

    p = small_plan()
    raced = dataclasses.replace(p, chosen=dataclasses.replace(p.chosen, measured_step_s=0.0874))
    console = Console(record=True, width=200)
    render_plan(raced, console)
    assert "ran 87 ms per optimizer step on this GPU" in console.export_text()
    render_plan(p, console := Console(record=True, width=200))
    assert "ran " not in console.export_text()
    assert Plan.from_dict(json.loads(raced.to_json())).chosen.measured_step_s == 0.0874


@pytest.mark.gpu
def test_gpu_a_plan_that_races_takes_a_configuration_it_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on the card: a window wide enough to hold several configurations, and the plan is one of them,
    timed here, and the fastest of those timed."""
    from memfit.estimate.gpus import detect_gpu

    monkeypatch.setattr(importlib.import_module("memfit.plan.race"), "RACE_WITHIN", 1.0)
    w = plan_unet()
    gpu = detect_gpu()
    biggest = estimate(w.replace(keep_output=False), gpu=gpu).device_upper_bytes
    smallest = estimate(w.replace(batch_size=1, accumulation_steps=8, keep_output=False), gpu=gpu).device_upper_bytes
    p = plan(w, budget_bytes=(smallest + biggest) // 2, gpu=gpu, calibration="roofline", race=True)
    timed = [c for c in [p.chosen, *p.frontier] if c.measured_step_s is not None]
    assert p.chosen.measured_step_s is not None and p.chosen.measured_step_s > 0
    assert p.chosen.measured_step_s == min(c.measured_step_s for c in timed)  # type: ignore[type-var]
    assert any("took the fastest measured" in n for n in p.notes)
