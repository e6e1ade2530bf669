"""The walk: the fastest configuration that fits, ruled in only by an estimate of exactly it.

Candidates are ranked by the speed model on the costs known so far; the fastest left is estimated exactly, ruled
out by the floor of a smaller configuration of its structure (``Search.need_floor``), or settled by a probe the
structure's memory line picks. The line (``MemoryModel``) only chooses what to estimate first: nothing predicted
faster than the plan is ruled out by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.estimate.bound import widening
from memfit.estimate.predict import Estimate
from memfit.plan.records import Candidate, Config
from memfit.plan.search_state import Search, Structure, divisors, structure_of


@dataclass
class MemoryModel:
    """``fits_in(b) ≈ max(fb_at_1 + fb_per_sample × (b - b_lo), other)`` for one structure, through points already
    scaled to each estimate's upper bound (``search._upper_phases``)."""

    fb_intercept: float
    fb_slope: float
    other: float
    b_lo: int

    def fits_in(self, micro: int) -> int:
        fb = self.fb_intercept + self.fb_slope * (micro - self.b_lo)
        return int(max(fb, self.other))


def score(search: Search, model: MemoryModel, config: Config) -> Candidate:
    """The candidate with the memory line's prediction, or the estimate's where this exact config has one."""
    est = search.estimates.get(config)
    if est is not None:
        return verified(search, config)
    return _candidate(search, config, model.fits_in(config.micro_batch), search.context_bytes, verified=False)


def verified(search: Search, config: Config) -> Candidate:
    """The candidate from an estimate of exactly ``config`` (run now if it was not yet)."""
    est = search.estimate(config)
    return _candidate(search, config, est.fits_in_upper_bytes, est.device_upper_bytes - est.fits_in_upper_bytes,
                      verified=True)


def _candidate(search: Search, config: Config, fits_in: int, context: int, *, verified: bool) -> Candidate:
    device = fits_in + context
    t = search.step_time(config)
    return Candidate(
        config=config, device_bytes=device, fits_in_bytes=fits_in, step_time_s=t,
        samples_per_s=config.effective_batch / t if t else None, verified=verified,
        fits=device <= search.limit_bytes,
    )


def _expandable_floor(search: Search, config: Config) -> int:
    """The least ``device_upper_bytes`` ``config`` (estimated) can have with expandable segments: its required peak
    widened by the base margin and the reasons its own trace recorded, plus their bytes and the context. The replay
    with expandable segments reuses that trace, so the same reasons widen its bound
    (``memfit.estimate.bound.upper_bound``), over a replayed cap never below the required peak."""
    est = search.estimates[dataclasses.replace(config, expandable_segments=False)]
    widen, extra = widening(est.uncertainty)
    return int(search.required_peak(config) * (1 + widen)) + extra + search.context_of(config)


def _floor_of(search: Search, config: Config) -> int:
    """The largest floor an estimated configuration of the same structure with accumulation and a micro-batch no
    larger than ``config``'s puts under it; 0 when none. With accumulation, ``Search.need_floor``: gradients are
    alive in forward in both. Without (``config`` runs the whole batch at once, no gradients alive in forward, so
    it can need less), ``Search.whole_batch_floor``: one steady micro-batch's window."""
    key = structure_of(config)
    floor = search.need_floor if config.accumulation_steps > 1 else search.whole_batch_floor
    return max((floor(c) for c in search.estimates
                if c.accumulation_steps > 1 and c.micro_batch <= config.micro_batch and structure_of(c) == key),
               default=0)


def _probe(search: Search, model: MemoryModel, config: Config) -> Config:
    """What to estimate to settle ``config``: the smallest micro-batch of its structure above every one known to
    fit that the memory line puts over the limit, when that is below ``config``'s. If it misses, its floor rules
    out ``config`` and everything larger in one estimate; if it fits, the line was wrong there and the next probe
    is larger. Without accumulation (no floor to use), or when the line says ``config`` fits: ``config`` itself."""
    if config.accumulation_steps == 1:
        return config
    same = _exact_rungs(search, structure_of(config))
    fit = max((m for m, e in same.items() if e.device_upper_bytes <= search.limit_bytes), default=0)
    for m in _line_misses(search, model, fit, config.micro_batch):
        if m not in same:
            return _at_micro(config, m, search.effective)
    return config


def _exact_rungs(search: Search, key: tuple[Structure, tuple[int, ...] | None]) -> dict[int, Estimate]:
    """The exact estimates of structure ``key`` with accumulation and without expandable segments, by micro-batch."""
    return {c.micro_batch: e for c, e in search.estimates.items()
            if structure_of(c) == key and c.accumulation_steps > 1 and not c.expandable_segments}


def _line_misses(search: Search, model: MemoryModel, above: int, up_to: int) -> list[int]:
    """The micro-batches in (``above``, ``up_to``], with accumulation, that the memory line puts over the limit."""
    eff = search.effective
    return [m for m in divisors(eff) if above < m <= up_to and m != eff
            and model.fits_in(m) + search.context_bytes > search.limit_bytes]


def _at_micro(config: Config, micro: int, effective: int) -> Config:
    return dataclasses.replace(config, micro_batch=micro, accumulation_steps=effective // micro)


LAYOUT_CHANGE_GAIN = 0.02
"""How much faster the speed model must call another memory format than the workload's own before the plan
changes it. The roofline prices convolutions' layouts, not what the layout does to the ops around them: on ViT-B/16
(one convolution, the patch embedding) it called channels_last 0.08 % faster at a 3 GiB budget, and the step ran
8 % slower (H100, interleaved: plan_sweep_h100_torch2.11_20261127_r5, 48.5 against 44.7 ms). The 2-D U-Net's
predicted gain is far above this: its plans keep channels_last at all four budgets, the configurations its sweep
found fastest (plan_sweep_h100_torch2.11_20261126_r2)."""


def speed_key(c: Candidate, channels_last: bool = False) -> tuple[float, int]:
    """What the walk ranks by: the step time, with a change of memory format charged ``LAYOUT_CHANGE_GAIN``."""
    if c.step_time_s is None:
        return (float("inf"), c.device_bytes)
    changed = c.config.channels_last != channels_last
    return (c.step_time_s * (1 + LAYOUT_CHANGE_GAIN if changed else 1.0), c.device_bytes)


def walk(search: Search, configs: list[Config], models: dict[Structure, MemoryModel]
          ) -> tuple[Candidate | None, list[str]]:
    """The fastest configuration that fits, by an estimate of exactly it.

    Candidates are taken from the fastest (the speed model on the costs known so far). The fastest left is
    estimated exactly, or ruled out by ``need_floor`` of a smaller configuration of its structure, or settled by a
    probe the memory line picks (``_probe``); the walk stops when the fastest left is an exact estimate that fits.
    So nothing predicted faster than the plan was ruled out by the line: the line only chooses what to estimate
    first. A miss whose floor (its requested bytes) fits is retried with expandable segments: fragmentation is
    the gap.
    None when every configuration was estimated or ruled out, the smallest of each structure estimated.
    """
    notes: list[str] = []
    out: set[Config] = set()
    while True:
        pending = [score(search, models[structure_of(c)[0]], c) for c in configs if c not in out]
        if not pending:
            return None, notes
        best = min(pending, key=lambda c: speed_key(c, search.workload.channels_last))
        c = best.config
        if best.verified:
            if best.fits:
                return best, notes
            out.add(c)
            if not search.allocator.expandable_segments and _expandable_floor(search, c) <= search.limit_bytes:
                ex = verified(search, dataclasses.replace(c, expandable_segments=True))
                if ex.fits:
                    notes.append(f"{c.label()} fits only with expandable segments (less fragmentation)")
                    return ex, notes
            continue
        if _floor_of(search, c) > search.limit_bytes:
            out.add(c)
            continue
        probe = _probe(search, models[structure_of(c)[0]], c)
        search.guess(_next_probes(search, pending, best, probe, models, out))
        search.estimate(probe)


LANE_GUESSES = 2
"""How many estimates the walk guesses ahead for the lane: with two, this process makes the first while the lane
traces the second (``TraceLane.guess`` starts from the last)."""


def _next_probes(search: Search, pending: list[Candidate], best: Candidate, probe: Config,
                 models: dict[Structure, MemoryModel], out: set[Config]) -> list[Config]:
    """What the walk will probably estimate after ``probe``, in order: if ``probe`` is expected to fit, the
    micro-batches of its structure above it up to ``best``'s that the memory line puts over the limit (each a probe
    in turn); then the probes of the next-fastest candidates of other structures. At most ``LANE_GUESSES``.
    ``probe`` is expected to fit unless two exact estimates of its structure below it, extended along their line,
    put it over the limit, or, with fewer than two below, the memory line does. Near the limit the line errs both
    ways by a few percent, and a wrong guess costs only the other core's time; taking every first probe to fit
    kept the lane tracing larger micro-batches of structures whose micro-batch 1 missed. Guesses used, before and
    after: ResNet-50 at 1.2 GiB, where only micro-batch 1 fits, 4 of 11 and 10 of 11 (planning 27.3 -> 21.7 s);
    ViT-B/16 at 2 GiB, where nothing fits, 5 of 9 and 7 of 7; GPT-2 at 5.5 GiB 6 of 8 and 4 of 6, its planning
    no slower (benchmarks/results/plan/lane_use_cpu_torch2.13_20261128_s24.json,
    planning_time_lane_guess_ab_cpu_torch2.13_20261128_s24.md)."""
    key = structure_of(probe)
    model = models[structure_of(best.config)[0]]
    below = sorted((m, e.device_upper_bytes) for m, e in _exact_rungs(search, key).items() if m < probe.micro_batch)
    if len(below) >= 2:
        (m0, b0), (m1, b1) = below[-2:]
        expected_to_fit = b1 + (b1 - b0) / (m1 - m0) * (probe.micro_batch - m1) <= search.limit_bytes
    else:  # if not, the walk moves on to another structure after it
        expected_to_fit = model.fits_in(probe.micro_batch) + search.context_bytes <= search.limit_bytes
    guesses = [_at_micro(probe, m, search.effective) for m in _line_misses(
        search, model, probe.micro_batch, best.config.micro_batch)] if expected_to_fit else []
    for c in sorted(pending, key=lambda c: speed_key(c, search.workload.channels_last)):
        if len(guesses) >= LANE_GUESSES:
            break
        if c is best or c.verified or c.config in out or structure_of(c.config) == key \
                or _floor_of(search, c.config) > search.limit_bytes:
            continue
        guesses.append(_probe(search, models[structure_of(c.config)[0]], c.config))
    return [g for g in dict.fromkeys(guesses) if g not in search.estimates][:LANE_GUESSES]
