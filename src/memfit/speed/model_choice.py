"""Which speed model a plan ranks with: calibrated on this machine's GPU where it can be, else the roofline.

Timing a few micro-batches on the GPU the plan is for costs seconds and fits the speed model's constants to that
card (``memfit.speed.step_time.calibrate``); on a CPU, or when planning for another GPU than the one here, the
roofline of the traced ops is all there is. ``plan(..., calibration="auto")`` (the default) asks
``choose_speed_model``; ``"roofline"`` opts out; a ``Calibration`` is used as given.

Example:
    >>> from memfit.estimate.gpus import gpu_spec
    >>> from memfit.workload.zoo import builtin_workload
    >>> choose_speed_model(builtin_workload("mlp"), gpu_spec("h100"), "roofline").name
    'roofline'
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from memfit.errors import UsageError
from memfit.estimate.gpus import GpuSpec, detect_gpu
from memfit.speed.step_time import Calibration, calibrate
from memfit.workload.spec import Workload

logger = logging.getLogger(__name__)

CalibrationChoice = Calibration | Literal["auto", "roofline"] | None
"""What ``plan(calibration=...)`` takes: ``"auto"`` (calibrate where this machine's CUDA GPU is the one planned
for, else the roofline), ``"roofline"`` or ``None`` (never time anything), or a ``Calibration`` to use."""
CALIBRATION_SIZES = (1, 2, 4, 8)
"""Micro-batch sizes ``"auto"`` times, up to the effective batch (``calibrate``'s default spread, from CPU-bound to
GPU-bound); see ``calibration_sizes`` for the one it adds."""


def calibration_sizes(effective_batch: int) -> tuple[int, ...]:
    """The micro-batches ``"auto"`` times for a plan of ``effective_batch``: ``CALIBRATION_SIZES`` up to it (two at
    least), and the effective batch itself where it is larger — the largest micro-batch the plan can pick.

    Sizes up to 8 leave a CNN or a ViT at 224² CPU-bound, so the GPU's efficiencies were extrapolated to the
    micro-batches a plan picks. On an H100, refitting one run's timings (every block checkpointed in each of four
    modes, micro-batch 64): calibrated on 1-8, ResNet-50 and ViT-B/16 were −13 … +5 % off their measured step
    times; with 64 timed too, −11 … +6 %, the no-checkpointing steps −13 / −11 → +4 / +3 %
    (``benchmarks/results/plan/checkpoint_calibrated_h100_torch2.11_20261128_wide.md``). Checked on three
    built-ins it was not chosen on (a 2-D U-Net, the LSTM LM, the MLP at micro-batches up to 32-1024): median
    |error| 17.8 → 3.1 %, the worst +152 → +18 % (``calibration_sizes_check_h100_torch2.11_20261128.md``, same
    folder). A size that runs out of memory is skipped (``calibrate``), which leaves the small ones.
    """
    small = tuple(m for m in CALIBRATION_SIZES if m <= max(effective_batch, 2))
    return small + ((effective_batch,) if effective_batch > CALIBRATION_SIZES[-1] else ())


@dataclass(frozen=True)
class SpeedModel:
    """The speed model a plan ranks with, and why it is that one."""

    name: Literal["roofline", "calibrated"]
    calibration: Calibration | None
    """The fitted constants; None for the roofline."""
    reason: str
    """One sentence for the plan's notes."""


def choose_speed_model(workload: Workload, gpu: GpuSpec, calibration: CalibrationChoice = "auto",
                       *, effective_batch: int | None = None) -> SpeedModel:
    """The speed model for a plan of ``workload`` on ``gpu``.

    ``"auto"`` calibrates when CUDA is available and this machine's GPU is ``gpu`` (the same card as
    ``detect_gpu`` names it); otherwise, or when the calibration fails (fewer than two sizes ran), it is the
    roofline, and the reason says why. The calibration runs under ``torch.random.fork_rng`` and empties the
    allocator's cache afterwards, so a training run in the same process starts from the random state and the
    memory it would have had without it.

    Raises:
        UsageError: ``calibration`` is none of ``"auto"``, ``"roofline"``, None or a ``Calibration``.
    """
    if isinstance(calibration, Calibration):
        return SpeedModel("calibrated", calibration, f"speed model: the calibration given (fitted on {calibration.gpu})")
    if calibration is None or calibration == "roofline":
        return SpeedModel("roofline", None, "speed model: the roofline, as asked (calibration='roofline')")
    if calibration != "auto":
        raise UsageError(f"calibration must be 'auto', 'roofline', None or a memfit.Calibration, got {calibration!r}.")
    here = detect_gpu()
    if here is None:
        return SpeedModel("roofline", None, "speed model: the roofline (no CUDA GPU here to calibrate on)")
    if not same_card(gpu, here):
        return SpeedModel("roofline", None, f"speed model: the roofline (the plan is for {gpu.name}; this machine's "
                                            f"GPU is {here.name}, so nothing here can be timed for it)")
    eff = workload.effective_batch_size if effective_batch is None else effective_batch
    try:
        fitted = _calibrate_here(workload, calibration_sizes(eff), gpu)
    except Exception as exc:  # noqa: BLE001 - any failure to time the step leaves the roofline, which needs none
        logger.warning("calibrating the speed model on %s failed (%s: %s); planning with the roofline",
                       here.name, type(exc).__name__, exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        return SpeedModel("roofline", None, f"speed model: the roofline (calibrating on {here.name} failed: "
                                            f"{type(exc).__name__}: {first:.160})")
    sizes_run = ", ".join(map(str, fitted.micro_batches))
    return SpeedModel("calibrated", fitted, f"speed model: calibrated on this {here.name} (micro-batches {sizes_run} "
                                            f"timed; rms error {fitted.rms_log_error:.0%})")


def per_rank_choice(world_size: int) -> CalibrationChoice:
    """What a rank of a data-parallel job that plans for itself (the integrations) should ask for: ``"auto"``
    alone, ``"roofline"`` with several ranks. Timings differ from rank to rank, so calibrated plans could differ
    (another micro-batch or accumulation on one rank, and the ranks' collectives no longer match); the roofline
    gives every rank the same plan (and, not being calibrated, settles no near-tie by timing it: ``plan(race=None)``)."""
    return "auto" if world_size <= 1 else "roofline"


def same_card(planned: GpuSpec, here: GpuSpec) -> bool:
    """Is ``here`` (``detect_gpu()``) the card ``planned`` describes? By name, as ``detect_gpu`` matches its table:
    the model word (``H100``, ``A100-SXM4-80GB``) of the planned name in the device's name."""
    if planned.name == here.name:
        return True
    words = planned.name.split()
    return len(words) > 1 and words[1] in here.name


def _calibrate_here(workload: Workload, sizes: tuple[int, ...], gpu: GpuSpec) -> Calibration:
    import torch

    # the timed steps draw weights and batches from the global generators: fork them, so a training run after the
    # plan sees the random stream it would have seen without one
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        try:
            return calibrate(workload, micro_batches=sizes, gpu=gpu)
        finally:
            # the timed models are gone; hand their cached blocks back, so the step starts from the memory the
            # plan's estimates assume (an allocator holding no one else's segments)
            torch.cuda.empty_cache()
