"""Settle a near-tie of the speed model by timing the contenders on the GPU the plan is for.

The speed model ranks configurations well, but two that it predicts within a few per cent of each other can run in
either order: on an H100 the calibrated model put GPT-2's 6 blocks checkpointed non-reentrant at 213.3 ms and the
same blocks reentrant at 214.4 ms, and the first ran at 231.1 ms, the second at 214.7
(``benchmarks/results/plan/plan_calibrated_h100_torch2.11_20261128``). Where the plan runs on that GPU anyway (the
calibrated default), timing a few steps of each contender costs seconds and decides what the model cannot.

``plan(race=...)`` takes the configurations its walk verified (an exact estimate that fits) and predicted within
``RACE_WITHIN`` of the fastest, at most ``RACE_SIZE``, times them here (``time_on_this_gpu``) and keeps the fastest
measured. A ``Racer`` is any callable from configurations to step seconds, so tests give stand-in timings.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence

from memfit.guard.oom import is_oom
from memfit.plan.records import Candidate, Config
from memfit.workload.protocol import build, run_steps_on_cuda
from memfit.workload.spec import Workload

log = logging.getLogger(__name__)

Racer = Callable[[Sequence[Config]], list[float | None]]
"""``racer(configs)``: one optimizer step's seconds for each configuration, None where it did not run (out of
memory, or an error: logged)."""

RACE_WITHIN = 0.05
"""Contenders are predicted at most this much slower than the fastest. The calibrated model's errors on one model
differ by this much between configurations: ResNet-50 every block checkpointed, full mode +4 %, reentrant +9 %
against measured (H100, benchmarks/results/plan/checkpoint_calibrated_h100_torch2.11_20261128_wide.md), so a
prediction 5 % apart can come out in either order."""

RACE_SIZE = 3
"""At most this many contenders, the plan's own pick among them: each costs two builds and a few steps."""

WARMUP_STEPS = 2
"""Untimed optimizer steps per build (the first creates the optimizer state and picks cuDNN's and cuBLAS's
kernels)."""

TIMED_STEPS = 3
"""Timed optimizer steps per build; each contender is built twice, so its time is the median of twice this."""


def time_on_this_gpu(workload: Workload, device: str = "cuda") -> Racer:
    """A ``Racer`` that runs each configuration of ``workload`` on ``device``: built, ``WARMUP_STEPS`` steps, then
    ``TIMED_STEPS`` steps timed on the host clock (the protocol ``TrainStep`` runs: every micro-batch of a step, the
    optimizer). Each micro-batch starts from an idle GPU (a host sync before it), as the speed model's phases and
    the sweeps' timings do, and as a loop that reads each micro-batch's loss (``loss.item()``) runs: the host work
    of a configuration shows in full. Without the syncs the host can run ahead and hide it: GPT-2 at 9 GiB on an
    H100, 6 blocks checkpointed non-reentrant against reentrant, ran 181.6 against 182.3 ms a step without them and
    213.1 against 201.4 ms with one before each micro-batch
    (``benchmarks/results/plan/plan_race_h100_torch2.11_20261128``). The contenders run in turn, twice, in opposite
    orders, each built anew and freed before the next, so they never share the GPU's memory and a drift of the
    card's speed falls on all."""

    def racer(configs: Sequence[Config]) -> list[float | None]:
        import torch

        times: list[list[float]] = [[] for _ in configs]
        failed: set[int] = set()
        order = list(range(len(configs)))
        # the steps draw weights and batches from the global generators: a training run after the plan sees the
        # random stream it would have seen without one
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            for rotation in (order, order[::-1]):
                for i in rotation:
                    if i in failed:
                        continue
                    try:
                        times[i] += _step_seconds(workload.replace(**configs[i].changes()), device)
                    except Exception as exc:  # noqa: BLE001 - a contender that cannot run is left out, as
                        # calibrating leaves the roofline: the plan never fails for want of a timing
                        log.warning("race: %s did not run (%s)", configs[i].label(),
                                    "out of memory" if is_oom(exc) else f"{type(exc).__name__}: {exc}")
                        failed.add(i)
                    finally:
                        torch.cuda.empty_cache()
        return [None if i in failed else statistics.median(t) for i, t in enumerate(times)]

    return racer


def _step_seconds(workload: Workload, device: str) -> list[float]:
    """The seconds of each timed optimizer step of ``workload`` on ``device`` (one build)."""
    import torch

    marks: list[float] = []

    def mark(name: str, step: int) -> None:
        if name == "forward":
            torch.cuda.synchronize(device)  # each micro-batch from an idle GPU
        elif name in ("zero_grad", "end") and step >= WARMUP_STEPS:
            torch.cuda.synchronize(device)
            marks.append(time.perf_counter())

    model, optimizer, batch = build(workload, device)
    try:
        # fp16: past a fresh GradScaler's skipped steps, whose optimizer does nothing
        run_steps_on_cuda(workload, model, optimizer, batch, steps=WARMUP_STEPS + TIMED_STEPS, phase=mark)
        # the last TIMED_STEPS steps: the ones the scaler's extra steps, if any, pushed past the warm-up
        return [b - a for a, b in zip(marks[:-1], marks[1:])][-TIMED_STEPS:]
    finally:
        del model, optimizer, batch


def race(chosen: Candidate, candidates: Sequence[Candidate], *, rank: Callable[[Candidate], float],
         verify: Callable[[Config], Candidate], racer: Racer) -> tuple[Candidate, list[Candidate], str | None]:
    """The fastest measured of ``chosen`` and its contenders; the contenders as timed; one sentence for the notes
    (None when there was nothing to race).

    Contenders: the other configurations of ``candidates`` that ``rank`` (the walk's: the predicted step time, a
    change of memory format charged) puts within ``RACE_WITHIN`` of ``chosen``, fastest first, at most
    ``RACE_SIZE`` with ``chosen``. One the walk only scored on its memory line is estimated exactly first
    (``verify``), then with expandable segments where it does not fit without, and is left out unless it fits:
    every configuration that runs here is one the plan could have picked. Expandable segments are the allocator's:
    they change memory, not speed, and this process's allocator keeps the setting it started with.
    """
    if chosen.step_time_s is None:  # no speed model: nothing is a near-tie
        return chosen, [], None
    limit = rank(chosen) * (1 + RACE_WITHIN)
    seen = {_plain(chosen.config)}
    near: list[Candidate] = []
    for c in sorted((c for c in candidates if c.step_time_s is not None and rank(c) <= limit), key=rank):
        if len(near) + 1 >= RACE_SIZE:
            break
        if _plain(c.config) in seen:
            continue
        seen.add(_plain(c.config))
        c = c if c.verified else verify(c.config)
        if not c.fits and not c.config.expandable_segments:
            # as the walk does: where fragmentation is the gap, expandable segments may make it fit (GPT-2's plan
            # at 9 GiB on an H100 has them, and so does its near-tie in the other checkpoint mode)
            c = verify(dataclasses.replace(c.config, expandable_segments=True))
        if c.fits:
            near.append(c)
    if not near:
        return chosen, [], None
    field = [chosen, *near]
    times = racer([c.config for c in field])
    timed = [dataclasses.replace(c, measured_step_s=t) for c, t in zip(field, times, strict=True)]
    ran = [c for c in timed if c.measured_step_s is not None]
    if not ran:
        return chosen, timed[1:], (f"timed {len(field)} configurations predicted within {RACE_WITHIN:.0%} of "
                                   "each other on this GPU; none ran, so the prediction decides")
    best = min(ran, key=lambda c: c.measured_step_s or 0.0)
    said = "; ".join(f"{c.config.label()}: predicted {(c.step_time_s or 0.0) * 1e3:.1f} ms, "
                     + (f"ran {c.measured_step_s * 1e3:.1f} ms" if c.measured_step_s is not None else "did not run")
                     for c in timed)
    return best, [c for c in timed if c is not best], (
        f"timed the {len(field)} configurations predicted within {RACE_WITHIN:.0%} of the fastest on this GPU "
        f"({said}) and took the fastest measured")


def _plain(config: Config) -> Config:
    return dataclasses.replace(config, expandable_segments=False)
