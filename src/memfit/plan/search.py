"""``plan()``: the fastest training configuration whose predicted memory fits a budget.

The search turns the knobs that keep the training mathematics (micro-batch × gradient accumulation with the
same effective batch, activation checkpointing of chosen blocks, the optimizer's implementation, channels_last,
expandable segments, the chunked cross-entropy of a causal LM) and, only when allowed, the precision and where
Adam keeps its states (torchao's 8-bit states, or offloaded to the CPU). Memory comes from ``estimate()``: a few estimates
per structure give a line ``fits_in(micro_batch)``, and every configuration the plan can choose is verified by
an estimate of exactly that configuration before it is chosen. Speed comes from ``memfit.speed.step_time``: a roofline of
the traced ops, or its calibration on this machine's GPU. What it returns (``Config``, ``Candidate``, ``Plan``)
is in ``memfit.plan.records``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from memfit.errors import BudgetTooSmallError, DeviceError, MemfitError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import GpuSpec, detect_gpu, gpu_spec
from memfit.estimate.predict import Estimate
from memfit.plan.race import Racer, time_on_this_gpu
from memfit.plan.race import race as race_near_ties
from memfit.plan.records import Candidate, Plan
from memfit.plan.search_state import (
    DEFAULT_CHECKPOINT_MODES,
    Search,
    Structure,
    divisors,
    phase_peaks,
    structure_of,
)
from memfit.plan.walk import LAYOUT_CHANGE_GAIN, MemoryModel, score, speed_key, verified, walk
from memfit.speed.model_choice import CalibrationChoice, choose_speed_model, same_card
from memfit.units import format_bytes
from memfit.workload.knobs import ModelFacts, checkpoint_choices, model_facts
from memfit.workload.spec import (
    CHECKPOINT_MODES,
    CheckpointMode,
    LossImpl,
    OptimizerImpl,
    OptimizerState,
    Precision,
    Workload,
)

DEFAULT_MARGIN = 0.0
"""The plan keeps ``device_bytes <= budget × (1 - margin)``, where ``device_bytes`` is already the estimate's upper
bound (``Estimate.device_upper_bytes``: the estimator's error, its placement margin and every named uncertainty),
the number ``memfit estimate --budget`` and ``explain`` decide "fits" with. A second 2 % on top only hid
configurations that run: on an H100 it kept the patch search for the 3-D U-Net at 12 GB one rung short (160³, its
bound 0.6 % over the limit, ran under the cap: benchmarks/results/plan/patch_caps_h100_*_r2 and _r3), while the
bound held on 60 of 60 validation steps on the H100 and the H200 (corpus_accuracy_*_torch2.11_20261126.md), and
every plan of the sweep made without it ran under its cap in a fresh process but one, which the bound then answered
(a 3-D U-Net with reentrant checkpointing: plan_verify_h100_*_r3, plan_sweep_h100_*_r4). Raise it where
memory the estimate does not see is in play (``cudnn.benchmark``'s trial workspaces: the nnU-Net planner keeps 2 %)."""


def plan(
    workload: Workload,
    *,
    budget_bytes: int,
    effective_batch: int | None = None,
    gpu: str | GpuSpec | None = None,
    allocator: AllocatorConfig | None = None,
    margin: float = DEFAULT_MARGIN,
    allow_precision_change: bool = False,
    calibration: CalibrationChoice = "auto",
    checkpoint_modes: tuple[CheckpointMode, ...] = DEFAULT_CHECKPOINT_MODES,
    allow_optimizer_state_change: bool = False,
    race: bool | Racer | None = None,
) -> Plan:
    """The fastest configuration of ``workload`` that fits ``budget_bytes`` of device memory.

    Args:
        workload: the training step (its batch_size × accumulation_steps is the default effective batch). The plan
            runs through ``TrainStep``, which drops each micro-batch's output before its backward, so every
            configuration is estimated that way (``keep_output=False``) whatever the workload says.
        budget_bytes: the GPU memory this process may use, CUDA context included (a 24 GB card: ``24e9``).
        effective_batch: samples per optimizer step; every plan keeps it exactly (micro-batch × accumulation).
        gpu: the GPU to plan for (memory workspaces, context size, roofline speeds); default H100.
        allocator: caching-allocator settings; default ``PYTORCH_CUDA_ALLOC_CONF`` from the environment.
        margin: the plan keeps ``device_bytes <= budget_bytes × (1 - margin)``.
        allow_precision_change: also consider bf16 autocast (changes numerics).
        allow_optimizer_state_change: also consider torchao's 8-bit Adam states (changes numerics) and its
            CPU-offloaded Adam (much slower steps), for a ``torch.optim.Adam``/``AdamW``; running them needs torchao.
        calibration: the speed model that ranks the configurations. ``"auto"``: calibrated (a few micro-batches
            timed, seconds) when CUDA is available and this machine's GPU is ``gpu``, else the roofline;
            ``"roofline"`` (or None): never time anything; a ``memfit.speed.step_time.Calibration``: that one.
            The plan's ``speed_model`` and its first note say which and why (``memfit.speed.model_choice``).
        checkpoint_modes: how the chosen blocks may be checkpointed (``Workload.checkpoint_mode``): each block set
            is estimated in each mode, and the speed model picks (``selective`` keeps more memory and recomputes
            less; ``reentrant`` keeps what ``full`` keeps with fewer hooks). Default: full and reentrant
            (``DEFAULT_CHECKPOINT_MODES``); add ``"selective"`` to try op-level checkpointing too.
        race: settle a near-tie by timing (``memfit.plan.race``): the configurations verified to fit and predicted
            within ``RACE_WITHIN`` of the pick (at most ``RACE_SIZE``) run a few steps each on this machine's GPU,
            and the fastest measured is the plan. None (default): where the speed model is calibrated and this
            machine's GPU is ``gpu``; True: on this machine's GPU (a ``DeviceError`` without one); False: never; a
            ``Racer``: its timings.

    Raises:
        BudgetTooSmallError: nothing fits; the message gives the smallest configuration found and its need.

    Example:
        >>> from memfit.workload.zoo import builtin_workload
        >>> p = plan(builtin_workload("mlp"), budget_bytes=4 << 30, effective_batch=64)
        >>> p.chosen.config.micro_batch * p.chosen.config.accumulation_steps
        64
    """
    started = time.perf_counter()
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    config = allocator if allocator is not None else AllocatorConfig.from_env()
    eff = workload.effective_batch_size if effective_batch is None else effective_batch
    if isinstance(eff, bool) or not isinstance(eff, int) or eff < 1:
        raise UsageError(f"effective batch must be a positive integer, got {eff!r}.")
    check_budget(budget_bytes, margin)
    if isinstance(checkpoint_modes, str) or not checkpoint_modes or any(
            m not in CHECKPOINT_MODES for m in checkpoint_modes):
        raise UsageError(f"checkpoint_modes must be a non-empty tuple of {', '.join(CHECKPOINT_MODES)}, "
                         f"got {checkpoint_modes!r}.")
    limit = int(budget_bytes * (1 - margin))
    workload = workload.replace(keep_output=False)  # the loop Plan.apply runs: TrainStep
    speed = choose_speed_model(workload, spec, calibration, effective_batch=eff)
    search = Search(workload, spec, config, limit, eff, speed.calibration, allow_precision_change,
                    tuple(checkpoint_modes), allow_optimizer_state_change=allow_optimizer_state_change)
    with search.side_lane():
        structures, models = _memory_models(search)
        configs = [s.config(m, eff) for s in structures for m in divisors(eff)]
        chosen, notes = walk(search, configs, models)
        finer = _finer_checkpointing(search, chosen) if chosen is not None else []
        for candidate in finer:
            if candidate.fits and chosen is not None and speed_key(candidate, workload.channels_last) < speed_key(
                    chosen, workload.channels_last):
                chosen = candidate
        notes = [speed.reason, *search.notes, *notes]
        scored = [score(search, models[s], c) for c in configs for s in (structure_of(c)[0],)] + finer
        racer = _racer(race, workload, spec, speed.name)
        if chosen is not None and racer is not None:
            chosen, timed, note = race_near_ties(
                chosen, scored, rank=lambda c: speed_key(c, workload.channels_last)[0],
                verify=lambda config: verified(search, config), racer=racer)
            if note:
                notes.append(note)
            again = {c.config for c in timed}
            scored = [c for c in scored if c.config not in again] + timed
        if chosen is None:
            # every configuration of the search was estimated or ruled out: try the smallest with every optimizer
            # implementation and with every block checkpointed, before saying nothing fits
            chosen, smallest = _smallest_exactly(search, structures)
            if chosen is None:
                raise _nothing_fits(search, smallest, budget_bytes, margin)
            notes.append(f"only {chosen.config.label()} fits, found by estimating the smallest configurations exactly")
    if chosen.config.optimizer_state != workload.optimizer_state:
        notes.append({"8bit": "Adam's states are torchao's 8-bit ones (AdamW8bit): numerics change slightly",
                      "cpu_offload": "Adam runs on the CPU (torchao's CPUOffloadOptimizer): GPU memory for speed",
                      "full": "Adam's states are kept in full precision"}[chosen.config.optimizer_state]
                     + "; Plan.apply swaps the optimizer (needs torchao: pip install torchao)")
    frontier = _frontier([c for c in scored if c.step_time_s is not None] + [chosen])
    return Plan(
        workload=workload.name,
        gpu=spec.name,
        budget_bytes=budget_bytes,
        margin=margin,
        effective_batch=eff,
        chosen=chosen,
        frontier=frontier,
        considered=len(scored),
        estimates=search.runs,
        speed_model=speed.name,
        notes=notes,
        elapsed_s=time.perf_counter() - started,
    )


def _racer(race: bool | Racer | None, workload: Workload, planned: GpuSpec, speed_model: str) -> Racer | None:
    """What settles near-ties (``plan(race=...)``): None where nothing is timed."""
    if callable(race):
        return race
    if race is False:
        return None
    here = detect_gpu() if race or speed_model == "calibrated" else None
    if race and here is None:
        raise DeviceError("race=True times configurations on this machine's GPU, and there is no CUDA GPU here; "
                          "pass race=False (or leave it None) to plan without timing.")
    if here is None or not (race or same_card(planned, here)):
        return None
    return time_on_this_gpu(workload)


def _smallest_exactly(search: Search, structures: list[Structure]) -> tuple[Candidate | None, Candidate]:
    """Estimate exactly the configurations most likely to need the least memory; the fastest that fits (or None)
    and the smallest.

    For each precision and loss the search has: micro-batch 1 and the whole effective batch at once (no accumulation, so
    no gradients alive in forward), each without checkpointing and with every block checkpointed; then the
    smallest of those with every optimizer implementation the optimizer has. Each is also tried with expandable
    segments when fragmentation is what keeps it out. The memory format stays the workload's: channels_last is a
    speed knob, and each format would double the traces of a path that can already take minutes on a large model.
    """
    facts = search.facts
    eff = search.effective
    full = tuple(facts.blocks) if facts is not None else ()
    configs = []
    for precision, impl, loss, state in dict.fromkeys((s.precision, s.optimizer_impl, s.loss_impl, s.optimizer_state)
                                                      for s in structures):
        for checkpoint in dict.fromkeys(((), full)):
            for micro in dict.fromkeys((1, eff)):
                structure = Structure(precision, checkpoint, impl, search.workload.channels_last, loss,
                                       optimizer_state=state)
                configs.append(structure.config(micro, eff))
    search.guess(configs)
    found = [verified(search, c) for c in configs]
    smallest = min(found, key=lambda c: c.device_bytes)
    impls = ["default", *(facts.optimizer_impls if facts is not None else ())]

    def runs(impl: OptimizerImpl) -> OptimizerImpl:  # "default" is one of the others where memfit can tell which
        return facts.default_impl if impl == "default" and facts is not None and facts.default_impl else impl

    tried = {runs(smallest.config.optimizer_impl)}
    others = []
    for other in impls if smallest.config.optimizer_state == "full" else ():
        if runs(other) not in tried:
            tried.add(runs(other))
            others.append(dataclasses.replace(smallest.config, optimizer_impl=other))
    search.guess(others)  # the lane traces the second while this process traces the first
    found += [verified(search, c) for c in others]
    if not search.allocator.expandable_segments:
        # each with expandable segments too: where fragmentation is the gap that fits, and where nothing does, the
        # least of them is the need the error reports
        found += [verified(search, dataclasses.replace(c.config, expandable_segments=True))
                  for c in list(found) if not c.fits]
    fitting = [c for c in found if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (c.step_time_s if c.step_time_s is not None else float("inf"),
                                           c.device_bytes)), smallest
    return None, min(found, key=lambda c: c.device_bytes)


def _nothing_fits(search: Search, smallest: Candidate, budget_bytes: int, margin: float) -> BudgetTooSmallError:
    """The error of a plan that found nothing to fit: the smallest configuration estimated, and what to try."""
    w, facts = search.workload, search.facts
    return BudgetTooSmallError(
        f"nothing fits {format_bytes(budget_bytes)} (with the {margin:.0%} margin: {format_bytes(search.limit_bytes)}): "
        f"the smallest configuration found needs {format_bytes(smallest.device_bytes)} "
        f"({smallest.config.label()}: the least of {len(search.estimates)} configurations estimated "
        "exactly, micro-batch 1 and full checkpointing with every optimizer implementation among them). "
        "Try a budget of at least "
        f"{format_bytes(math.ceil(smallest.device_bytes / (1 - margin)))}, a larger GPU, "
        + ("--allow-precision-change, " if not search.allow_precision_change and w.precision == "fp32" else "")
        + ("--allow-optimizer-state-change, " if not search.allow_optimizer_state_change
           and facts is not None and len(facts.optimizer_states) > 1 else "")
        + "sharding across GPUs, or a smaller model or input."
    )


def _fastest_impl(w: Workload, facts: ModelFacts) -> OptimizerImpl:
    """The optimizer implementation the search gives every structure: fused where the optimizer has it (no
    temporaries, the fewest kernel launches: it dominates foreach and the for-loop), else the workload's."""
    if w.optimizer_impl in ("default", "foreach") and "fused" in facts.optimizer_impls:
        return "fused"
    return w.optimizer_impl


def check_budget(budget_bytes: int, margin: float) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise UsageError(f"budget must be a positive number of bytes, got {budget_bytes!r}.")
    if not 0 <= margin < 0.5:
        raise UsageError(f"margin must be in [0, 0.5), got {margin!r}.")


def _memory_models(search: Search) -> tuple[list[Structure], dict[Structure, MemoryModel]]:
    """Estimate each structure at one or two micro-batch sizes and fit its memory line.

    Per (precision, memory format): micro-batch 1 and the largest divisor of the effective batch up to half of it
    (both run with accumulation, so the gradients are alive in forward, as in every plan but the one without
    accumulation), then each checkpointing choice at the larger size. The optimizer is fused where the optimizer
    supports it: fused needs no temporaries and launches the fewest kernels, so it dominates foreach and for-loop.
    Each structure is tried with every loss the model takes (``ModelFacts.loss_impls``: the chunked cross-entropy
    where memfit finds a causal LM's output layer); a loss other than the workload's whose trace fails (a loss
    function that reads the logits the chunked loss never makes) is left out, with a note. With
    ``allow_optimizer_state_change``, each is also tried with every ``ModelFacts.optimizer_states`` (torchao's 8-bit
    and CPU-offloaded Adam, whose kernels and copies the speed model charges).
    """
    w, eff = search.workload, search.effective
    facts = search.facts = model_facts(w)
    opt = _fastest_impl(w, facts)
    precisions: list[Precision] = [w.precision] + (["bf16"] if search.allow_precision_change and w.precision == "fp32" else [])
    formats = [w.channels_last] + ([True] if facts.has_conv and not w.channels_last else [])
    b_lo = 1
    b_mid = _b_mid(eff)
    structures: list[Structure] = []
    models: dict[Structure, MemoryModel] = {}
    losses: list[LossImpl] = list(dict.fromkeys([w.loss_impl, *facts.loss_impls]))
    modes = list(dict.fromkeys(search.checkpoint_modes))
    # torchao's states bring their own update: the optimizer implementation stays "default" with them
    states: list[OptimizerState] = list(dict.fromkeys(
        [w.optimizer_state, *(facts.optimizer_states if search.allow_optimizer_state_change else ())]))
    for precision, channels_last, loss, state in itertools.product(precisions, formats, losses, states):
        base = Structure(precision, (), opt if state == "full" else "default", channels_last, loss,
                          optimizer_state=state)
        search.guess([base.config(b_mid, eff)])
        try:
            lo = search.estimate(base.config(b_lo, eff))
            mid = search.estimate(base.config(b_mid, eff))
        except Exception as exc:  # noqa: BLE001 - any failure of the other loss only rules that knob out
            if loss == w.loss_impl:  # the workload as given: its errors are the user's to see
                raise
            first = str(exc).splitlines()[0] if str(exc) else ""
            note = (f"the {loss} loss was not tried: tracing it failed ({type(exc).__name__}: {first:.200}); the "
                    "loss function must take the model's loss (out.loss), as the chunked loss makes no logits")
            if note not in search.notes:
                search.notes.append(note)
            continue
        if channels_last != w.channels_last and not _format_may_pay(search, base, mid, b_mid, eff):
            continue
        fb_lo, other_lo = _upper_phases(lo)
        fb_mid, other_mid = _upper_phases(mid)
        span = max(b_mid - b_lo, 1)
        models[base] = MemoryModel(fb_lo, (fb_mid - fb_lo) / span, max(other_lo, other_mid), b_lo)
        structures.append(base)
        choices = checkpoint_choices(mid.activations_by_module, facts.blocks)
        search.guess([dataclasses.replace(base, checkpoint=blocks, checkpoint_mode=mode).config(b_mid, eff)
                      for blocks in choices for mode in modes])
        for blocks in choices:
            for mode in list(modes):
                s = dataclasses.replace(base, checkpoint=blocks, checkpoint_mode=mode)
                try:
                    e = search.estimate(s.config(b_mid, eff))
                except MemfitError as exc:
                    if mode == "full":
                        raise
                    # the blocks cannot run this way (a keyword tensor that needs a gradient under reentrant
                    # checkpointing, an in-place op on an output selective checkpointing keeps): leave it out
                    modes.remove(mode)
                    search.notes.append(f"{mode} checkpointing left out: {exc}")
                    continue
                fb, other = _upper_phases(e)
                # at b_lo: base's, less what checkpointing saves at b_mid scaled down to b_lo's samples
                at_lo = min(fb_lo, max(fb_lo - (fb_mid - fb) * b_lo / b_mid, 0.0))
                models[s] = MemoryModel(at_lo, (fb - at_lo) / span, other, b_lo)
                structures.append(s)
    return structures, models


def _upper_phases(est: Estimate) -> tuple[float, float]:
    """``phase_peaks`` scaled to the estimate's upper bound (``fits_in_upper_bytes`` over the allocated peak): the
    memory line's points, each with its own estimate's widening, so the line meets both estimates it is drawn
    through. Scaling both ends by the larger micro-batch's widening put GPT-2's lines 0.5-1.1 GiB above the exact
    estimates at micro-batch 2 (H200, 5.5 GiB), and probing for that error cost a trace per structure."""
    fb, other = phase_peaks(est)
    ratio = est.fits_in_upper_bytes / est.peak_allocated_bytes if est.peak_allocated_bytes else 1.0
    return fb * ratio, other * ratio


FINER_CHECKPOINT_SHARE = 0.75
"""Where the plan checkpoints more blocks than this share of the activations needs, it also tries the fewest blocks
holding it, at the plan's own micro-batch and checkpoint mode: with half and all only, ViT-B/16 at a 4 GiB
budget checkpointed all 12 blocks where 9 ran under the cap 10 % faster (H100 sweep:
plan_sweep_h100_torch2.11_20261126_final, 0.907 of the best; r5: 1.000). Tried only there it costs one trace;
as a structure of its own in every walk, 10-13 s of GPT-2's plan at 5.5 GiB."""


def _b_mid(effective: int) -> int:
    """The larger micro-batch the memory models are fitted at: the largest divisor up to half the batch."""
    return max(d for d in divisors(effective) if d <= max(1, effective // 2))


def _finer_checkpointing(search: Search, chosen: Candidate) -> list[Candidate]:
    """The chosen configuration with the fewest blocks holding ``FINER_CHECKPOINT_SHARE`` of the activations
    checkpointed instead, in the plan's checkpoint mode, estimated exactly; none when the chosen plan does not
    checkpoint more blocks than that. At the same micro-batch fewer recomputed blocks can only be faster."""
    c, b_mid = chosen.config, _b_mid(search.effective)
    base = dataclasses.replace(c, checkpoint=(), checkpoint_mode="full", expandable_segments=False,
                               micro_batch=b_mid, accumulation_steps=search.effective // b_mid)
    mid = search.estimates.get(base)
    if not c.checkpoint or mid is None or search.facts is None:
        return []
    finer = checkpoint_choices(mid.activations_by_module, search.facts.blocks, (FINER_CHECKPOINT_SHARE,))[0]
    if not set(finer) < set(c.checkpoint):
        return []
    try:
        return [verified(search, dataclasses.replace(c, checkpoint=finer))]
    except MemfitError:
        return []  # these blocks cannot run in the plan's mode (a first pass would have said why)


def _format_may_pay(search: Search, other: Structure, estimate: Estimate, micro: int, effective: int) -> bool:
    """Whether the memory format the workload does not use is worth its checkpointing choices: predicted
    ``LAYOUT_CHANGE_GAIN`` faster than the workload's own format, or smaller, without checkpointing at ``micro``
    (cuDNN's layout conversions). Otherwise the walk would never pick it (``speed_key``), and its checkpointed
    structures only cost traces (ViT-B/16: 12 of its 29)."""
    own = dataclasses.replace(other, channels_last=search.workload.channels_last).config(micro, effective)
    own_estimate = search.estimates.get(own)
    t_own, t_other = search.step_time(own), search.step_time(other.config(micro, effective))
    if own_estimate is None or t_own is None or t_other is None:
        return True
    faster = t_other * (1 + LAYOUT_CHANGE_GAIN) < t_own
    return faster or estimate.fits_in_upper_bytes < own_estimate.fits_in_upper_bytes


def _frontier(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on both memory and time, by memory."""
    out: list[Candidate] = []
    best_time = float("inf")
    for c in sorted(candidates, key=lambda c: (c.device_bytes, c.step_time_s or 0.0)):
        if c.step_time_s is not None and c.step_time_s < best_time:
            out.append(c)
            best_time = c.step_time_s
    return out
