"""How ``plan()`` searches, hand-worked on CPU with real estimates and the real speed model.

The small U-Net of ``conftest.plan_unet`` at an effective batch of 8 has 24 configurations (3 checkpointing
choices × 2 memory formats × 4 micro-batches, fused AdamW): few enough to estimate every one exactly, with and
without expandable segments. That grid is the oracle: at any budget, the plan must be the fastest configuration
whose exact estimate fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from conftest import PLAN_EFFECTIVE, plan_unet
from memfit import BudgetTooSmallError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import OpCost, PhaseCost, StepCost
from memfit.plan.records import Candidate, Config
from memfit.plan.search import DEFAULT_MARGIN, _frontier, _memory_models, plan
from memfit.plan.search_state import Search, Structure, cost_at, divisors, structure_of
from memfit.plan.walk import LAYOUT_CHANGE_GAIN, MemoryModel, _expandable_floor, speed_key
from memfit.workload.spec import Workload
from memfit.workload.zoo import builtin_workload

EFF = PLAN_EFFECTIVE
ALLOCATOR = AllocatorConfig()  # not the environment's PYTORCH_CUDA_ALLOC_CONF: the tests must not depend on it


@dataclass
class Grid:
    """Every configuration the planner considers, estimated exactly (the search's own code, all of it run)."""

    search: Search
    structures: list[Structure]
    models: dict[Structure, MemoryModel]
    configs: list[Config]

    def need(self, c: Config) -> int:
        return self.search.estimate(c).device_upper_bytes

    def time(self, c: Config) -> float:
        t = self.search.step_time(c)
        assert t is not None
        return t

    def ranked_time(self, c: Config) -> float:
        """The predicted time, a change of the workload's memory format charged LAYOUT_CHANGE_GAIN."""
        changed = c.channels_last != self.search.workload.channels_last
        return self.time(c) * (1 + LAYOUT_CHANGE_GAIN if changed else 1.0)

    def fastest_fitting(self, limit: int) -> Config | None:
        """The oracle: by predicted time, the first configuration that fits, as is or with expandable segments."""
        for c in sorted(self.configs, key=self.ranked_time):
            for variant in (c, dataclasses.replace(c, expandable_segments=True)):
                if self.need(variant) <= limit:
                    return variant
        return None

    def line(self, c: Config) -> int:
        """What the memory line alone predicts for ``c``'s device memory."""
        return self.models[Structure(c.precision, c.checkpoint, c.optimizer_impl, c.channels_last)].fits_in(
            c.micro_batch) + self.search.context_bytes


def full_grid(workload: Workload) -> Grid:
    search = Search(workload.replace(keep_output=False), gpu_spec(None), ALLOCATOR, 1 << 62, EFF, None, False)
    structures, models = _memory_models(search)
    configs = [s.config(m, EFF) for s in structures for m in divisors(EFF)]
    for c in configs:
        search.estimate(c)
        search.estimate(dataclasses.replace(c, expandable_segments=True))
    return Grid(search, structures, models, configs)


@pytest.fixture(scope="module")
def grid() -> Grid:
    return full_grid(plan_unet())


def budget_for(limit: int, margin: float = DEFAULT_MARGIN) -> int:
    """The smallest budget whose limit (``budget × (1 - margin)``, as plan() computes it) is ``limit`` or more."""
    budget = math.ceil(limit / (1 - margin))
    while int(budget * (1 - margin)) < limit:
        budget += 1
    return budget


def run_plan(budget: int, **kwargs: object):  # noqa: ANN201
    return plan(plan_unet(), budget_bytes=budget, allocator=ALLOCATOR, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ no false negatives


@pytest.mark.parametrize("quantile", [0.0, 0.3, 0.6, 0.85, 1.0])
def test_the_plan_is_the_fastest_configuration_an_exact_estimate_fits(grid: Grid, quantile: float):
    needs = sorted({grid.need(c) for c in grid.configs}
                   | {grid.need(dataclasses.replace(c, expandable_segments=True)) for c in grid.configs})
    limit = needs[round(quantile * (len(needs) - 1))]
    expected = grid.fastest_fitting(limit)
    p = run_plan(budget_for(limit))
    assert p.chosen.config == expected
    assert p.chosen.verified and p.chosen.fits and p.chosen.device_bytes == grid.need(expected) <= limit


def test_the_memory_line_would_rule_out_the_plan_the_exact_estimate_lets_it_in(grid: Grid):
    """The issue's GPT-2 at 16 GiB in small: the line puts the fastest configuration that fits over the limit."""
    cases = [c for c in sorted(grid.configs, key=grid.time)
             if grid.line(c) > grid.need(c) and grid.fastest_fitting(grid.need(c)) == c]
    assert cases, "the grid has no configuration the line overestimates at the edge; pick another workload"
    c = cases[0]
    limit = grid.need(c)
    assert grid.line(c) > limit  # the line alone would have ruled it out
    p = run_plan(budget_for(limit))
    assert p.chosen.config == c and p.chosen.verified


def test_the_issue_mlp_case_fits_without_accumulation():
    """``memfit plan mlp --budget 1.47GiB`` said nothing fits while 256 × 1 with the fused optimizer needed 1.42 GiB;
    with the bound's slack it needs more, so the budget is made from its own upper bound: the walk estimates that
    configuration exactly (no accumulation, so no gradients alive in forward)."""
    from memfit.estimate.predict import estimate
    from memfit.plan.search import DEFAULT_MARGIN

    mlp = builtin_workload("mlp")
    need = estimate(mlp.replace(keep_output=False, batch_size=256, accumulation_steps=1, optimizer_impl="fused"),
                    allocator=ALLOCATOR).device_upper_bytes
    budget = int(need / (1 - DEFAULT_MARGIN)) + (4 << 20)
    p = plan(mlp, budget_bytes=budget, allocator=ALLOCATOR)
    c = p.chosen.config
    assert (c.micro_batch, c.accumulation_steps, c.optimizer_impl) == (256, 1, "fused")
    assert p.chosen.verified and p.chosen.device_bytes <= budget * (1 - p.margin)
    assert not any("smallest configurations" in n for n in p.notes)  # found by the walk, not the last resort


def test_nothing_fits_only_after_the_smallest_of_every_structure_was_estimated(grid: Grid, monkeypatch):  # noqa: ANN001
    estimated: list[Config] = []
    real = Search.estimate

    def spy(self: Search, config: Config):  # noqa: ANN202
        if self is not grid.search:  # the plan's own estimates, not the oracle's
            estimated.append(config)
        return real(self, config)

    smallest = min(grid.need(v) for c in grid.configs for v in (c, dataclasses.replace(c, expandable_segments=True)))
    monkeypatch.setattr(Search, "estimate", spy)
    with pytest.raises(BudgetTooSmallError, match="smallest configuration found needs") as err:
        run_plan(budget_for(smallest - 1))
    # micro-batch 1 of every structure (nothing smaller can rule it out); the whole batch at once (no gradients
    # alive in forward) without checkpointing and with every block checkpointed (_smallest_exactly); the larger
    # micro-batches of the others are estimated or ruled out by a floor below their exact need
    every_block = max((s.checkpoint for s in grid.structures), key=len)
    for s in grid.structures:
        assert s.config(1, EFF) in estimated, s
        if s.checkpoint in ((), every_block) and s.checkpoint_mode == "full" and not s.channels_last:
            assert s.config(EFF, EFF) in estimated, s
    # with every optimizer implementation; "default" runs foreach for this AdamW on the GPU: estimated once
    assert {c.optimizer_impl for c in estimated} >= {"fused", "for-loop"}
    assert {"default", "foreach"} & {c.optimizer_impl for c in estimated}
    for c in estimated:
        assert c.optimizer_impl != "default" or dataclasses.replace(c, optimizer_impl="foreach") not in estimated
    assert "Try a budget of at least" in str(err.value)


def test_need_floor_is_below_every_larger_configurations_exact_need(grid: Grid):
    """The bound the walk rules configurations out with never exceeds what their exact estimate says, for the
    configurations it rules out: the same structure (``_floor_of``) at a micro-batch at least as large."""
    pairs = 0
    for a in grid.configs:
        for b in grid.configs:
            if structure_of(a) == structure_of(b) and 1 < b.accumulation_steps <= a.accumulation_steps:
                for variant in (b, dataclasses.replace(b, expandable_segments=True)):
                    floor = grid.search.need_floor(a)
                    assert floor <= grid.need(variant)
                    # without the CUDA context (the same cuBLAS use: the same ops): the part that scales with the step
                    context = grid.search.gpu.context_bytes(grid.search.traces[a].uses_cublas)
                    assert floor - context <= grid.search.estimate(variant).fits_in_upper_bytes
                pairs += 1
    assert pairs > 10


def test_whole_batch_floor_is_below_every_larger_configuration_without_accumulation(grid: Grid):
    """The floor that rules out configurations without accumulation (the whole batch at once) never exceeds what
    their exact estimate says, and it is tight enough to rule something out."""
    pairs, below_own_need = 0, 0
    for a in grid.configs:
        for b in grid.configs:
            if structure_of(a) == structure_of(b) and a.accumulation_steps > 1 == b.accumulation_steps:
                floor = grid.search.whole_batch_floor(a)
                for variant in (b, dataclasses.replace(b, expandable_segments=True)):
                    assert floor <= grid.need(variant), (a.label(), variant.label())
                pairs += 1
        if a.accumulation_steps > 1:
            # one micro-batch's window, not the whole stream: below the configuration's own floor
            assert grid.search.whole_batch_floor(a) <= grid.search.need_floor(a)
            below_own_need += grid.search.whole_batch_floor(a) < grid.search.need_floor(a)
    assert pairs > 5 and below_own_need > 0



def test_the_expandable_retry_is_skipped_only_where_its_exact_estimate_misses_too(grid: Grid):
    """The walk retries a miss with expandable segments unless ``_expandable_floor`` (its own reasons' widths on
    the required peak) is over the limit: that floor is never above the expandable estimate's need."""
    reasons = 0
    for c in grid.configs:
        floor = _expandable_floor(grid.search, c)
        assert grid.search.need_floor(c) <= floor <= grid.need(dataclasses.replace(c, expandable_segments=True))
        reasons += bool(grid.search.estimate(c).uncertainty)
    assert reasons  # the grid has configurations whose reasons widen it (reentrant checkpointing)


def _hand_search(sizes_mib: list[int], events: list[tuple[int, int]], optional: tuple[int, ...] = ()):  # noqa: ANN202
    """A search holding one hand-made trace: allocations of ``sizes_mib`` (the keys in ``optional`` may fail and
    fall back), then ``events`` as (op, key); the search, the configuration it is filed under, and the trace."""
    from memfit.estimate.trace_record import Alloc, Trace

    trace = Trace(allocs=[Alloc(n << 20, "op", "", "forward", 0, (), "uint8", "activations", optional=i in optional)
                          for i, n in enumerate(sizes_mib)])
    for op, key in events:
        trace.ops.append(op)
        trace.keys.append(key)
    search = Search(plan_unet(), gpu_spec("h100"), ALLOCATOR, 1 << 40, EFF, None, False)
    config = Structure("fp32").config(1, EFF)
    search.traces[config] = trace
    return search, config, trace


def test_whole_batch_floor_reads_the_first_micro_batch_of_the_steady_step():
    """Worked by hand: step 1's first micro-batch (between its first two forward marks) peaks at 20 + 100 MiB
    (the 20 MiB block made before it still alive); step 0 and step 1's second micro-batch, with 300 MiB alive, do
    not count. The floor is (120 MiB - WHOLE_BATCH_SLACK) × (1 + BASE_MARGIN) + the context."""
    from memfit.estimate.bound import BASE_MARGIN
    from memfit.plan.search_state import WHOLE_BATCH_SLACK

    MiB = 1 << 20
    events = [(1, 0), (1, 1), (-1, 1),  # step 0: the 20 MiB block stays, a 300 MiB one comes and goes
              (1, 2), (-1, 2),          # step 1, first micro-batch: 100 MiB
              (1, 3), (-1, 3)]          # step 1, second micro-batch: 300 MiB
    search, config, trace = _hand_search([20, 300, 100, 300], events)
    trace.phase_marks = [(0, "forward", 0), (3, "forward", 1), (5, "forward", 1), (7, "end", 2)]
    assert search.whole_batch_floor(config) == (int((120 * MiB - WHOLE_BATCH_SLACK) * (1 + BASE_MARGIN))
                                                + gpu_spec("h100").context_bytes(False))


def test_need_floor_is_the_required_peak_widened_by_the_bounds_margin_plus_the_least_context():
    """Worked by hand: 100 MiB and 60 MiB alive together (a 500 MiB optional workspace does not count, and a block
    freed before them neither), so the peak is 160 MiB; the floor is 160 MiB × (1 + BASE_MARGIN) + the context,
    with cuBLAS's handles where the step calls cuBLAS."""
    from memfit.estimate.bound import BASE_MARGIN

    MiB = 1 << 20
    events = [(1, 0), (-1, 0), (1, 1), (1, 2), (-1, 2), (1, 3), (-1, 3), (-1, 1)]
    search, config, trace = _hand_search([40, 100, 500, 60], events, optional=(2,))
    assert search.need_floor(config) == int(160 * MiB * (1 + BASE_MARGIN)) + gpu_spec("h100").context_bytes(False)
    calls_cublas = Structure("fp32", optimizer_impl="fused").config(1, EFF)  # the same stream, with cuBLAS's handles
    search.traces[calls_cublas] = dataclasses.replace(trace, uses_cublas=True)
    assert search.need_floor(calls_cublas) - search.need_floor(config) == gpu_spec("h100").cublas_context_bytes


def test_need_floor_widens_by_the_reasons_every_trace_of_the_op_sequence_records():
    """Worked by hand: the same 160 MiB peak, with reentrant checkpointing of convolutions (recorded by any trace
    of these ops) and a value-dependent branch (which another batch size may not take) among the trace's reasons:
    the floor adds reentrant checkpointing's width to the base margin, and not the branch's."""
    from memfit.estimate.bound import BASE_MARGIN, WIDTHS

    MiB = 1 << 20
    search, config, trace = _hand_search([100, 60], [(1, 0), (1, 1), (-1, 1), (-1, 0)])
    trace.uncertain.update(reentrant_checkpoint="layer1: a convolution recomputed", value_branch="model.py:3")
    widen = BASE_MARGIN + WIDTHS["reentrant_checkpoint"]
    assert search.need_floor(config) == int(160 * MiB * (1 + widen)) + gpu_spec("h100").context_bytes(False)

# ------------------------------------------------------------------------------------ margin, fragmentation


def test_the_margin_keeps_out_a_configuration_that_needs_99_percent_of_the_budget(grid: Grid):
    fastest = min(grid.configs, key=grid.time)
    need = min(grid.need(fastest), grid.need(dataclasses.replace(fastest, expandable_segments=True)))
    budget = math.ceil(need / 0.99)
    p = run_plan(budget, margin=0.02)
    assert p.margin == 0.02
    assert dataclasses.replace(p.chosen.config, expandable_segments=False) != fastest
    assert p.chosen.device_bytes <= budget * (1 - 0.02)
    # the default decides with the upper bound alone, as `estimate --budget` does
    loose = run_plan(budget)
    assert loose.margin == DEFAULT_MARGIN == 0.0
    assert dataclasses.replace(loose.chosen.config, expandable_segments=False) == fastest


def test_the_plan_decides_with_a_need_above_fits_in_and_its_placement_margin(grid: Grid):
    """The margins stack as DEFAULT_MARGIN's docstring says: a margin the user asks for keeps that share of the
    budget, on top of an upper bound that is at least ``fits_in``, which is the replayed cap plus 1.5 % for segment
    placement."""
    p = run_plan(budget_for(grid.need(grid.configs[0]), margin=0.02), margin=0.02)
    est = grid.search.estimate(p.chosen.config)
    assert p.chosen.fits_in_bytes == est.fits_in_upper_bytes >= est.fits_in_bytes
    assert est.fits_in_bytes >= est.fits_in_replay_bytes * 1.015  # memfit.estimate.predict.FITS_IN_MARGIN
    assert p.chosen.device_bytes <= p.budget_bytes * 0.98


def test_fragmentation_keeps_the_fastest_out_and_expandable_segments_let_it_in(grid: Grid):
    fastest = min(grid.configs, key=grid.time)
    expandable = dataclasses.replace(fastest, expandable_segments=True)
    # hand-worked premise: the replay fragments the plain allocator's segments, expandable segments do not
    assert grid.need(expandable) < grid.need(fastest)
    assert grid.search.estimate(fastest).fits_in_replay_bytes > grid.search.estimate(fastest).peak_allocated_bytes
    p = run_plan(budget_for(grid.need(expandable)))
    assert p.chosen.config == expandable
    assert any("expandable segments" in n for n in p.notes)


def test_with_expandable_segments_already_on_no_retry_is_needed(grid: Grid):
    fastest = min(grid.configs, key=grid.time)
    expandable = dataclasses.replace(fastest, expandable_segments=True)
    p = plan(plan_unet(), budget_bytes=budget_for(grid.need(expandable)),
             allocator=AllocatorConfig(expandable_segments=True))
    assert p.chosen.config == fastest  # the allocator is already expandable: the config itself fits


# ------------------------------------------------------------------------------------ interpolation, frontier


def test_the_memory_line_passes_through_the_estimate_it_was_fitted_on(grid: Grid):
    base = grid.structures[0]
    b_mid = max(d for d in divisors(EFF) if d <= EFF // 2)
    mid = grid.search.estimate(base.config(b_mid, EFF))
    model = grid.models[base]
    # the forward/backward peak sets the need here, scaled to the bound as the estimate scales it
    assert abs(model.fits_in(b_mid) - mid.fits_in_upper_bytes) <= 1
    lo = grid.search.estimate(base.config(1, EFF))
    # and through the one at micro-batch 1, each end scaled by its own estimate's widening
    assert abs(model.fits_in(1) - lo.fits_in_upper_bytes) <= 1
    # slope: the forward/backward peak's growth per sample between the two estimates, each scaled to its bound
    fb = [max(p.allocated_bytes for p in e.timeline if p.phase in ("forward", "loss", "backward"))
          * e.fits_in_upper_bytes / e.peak_allocated_bytes for e in (lo, mid)]
    assert model.fb_slope == pytest.approx((fb[1] - fb[0]) / (b_mid - 1))


def test_a_checkpointed_line_starts_below_its_base_by_the_share_it_saves(grid: Grid):
    base = grid.structures[0]
    checkpointed = next(s for s in grid.structures if s.checkpoint and s.checkpoint_mode == "full"
                        and dataclasses.replace(s, checkpoint=(), checkpoint_mode="full") == base)
    b_mid = max(d for d in divisors(EFF) if d <= EFF // 2)
    plain, saved = grid.models[base], grid.models[checkpointed]
    # it meets its own estimate at b_mid, and at micro-batch 1 is the base's less 1/b_mid of what it saves there
    mid = grid.search.estimate(checkpointed.config(b_mid, EFF))
    assert abs(saved.fits_in(b_mid) - mid.fits_in_upper_bytes) <= 1
    fb_mid = plain.fb_intercept + plain.fb_slope * (b_mid - 1)
    fb_ck = saved.fb_intercept + saved.fb_slope * (b_mid - 1)
    assert fb_ck < fb_mid
    assert saved.fb_intercept == pytest.approx(plain.fb_intercept - (fb_mid - fb_ck) / b_mid)


def _rows(*pairs: tuple[int, int]) -> PhaseCost:
    return PhaseCost.of([OpCost(flops=f, flop_class="fp32_matmul", bytes=b, kernels=1, dispatches=1) for f, b in pairs])


def _cost(micro: int, rows: list[tuple[int, int]]) -> StepCost:
    return StepCost(micro_batch_size=micro, forward=_rows(*rows), backward=_rows(*rows), optimizer=_rows((0, 64)))


def test_cost_at_interpolates_each_op_on_its_line():
    """Op costs ``flops = 100 + 10 m``, ``bytes = 1000 + 100 m`` (the weight read is the intercept)."""
    def at(m: int) -> StepCost:
        return _cost(m, [(100 + 10 * m, 1000 + 100 * m), (7 * m, 4 * m)])

    known = [(2, at(2)), (8, at(8))]
    for m in (4, 6, 16):  # between the two, and beyond them along the same line
        got = cost_at(known, m)
        assert got.micro_batch_size == m
        assert [(r.flops, r.bytes) for r in got.forward.ops] == [(100 + 10 * m, 1000 + 100 * m), (7 * m, 4 * m)]
        assert got.forward.bytes == 1000 + 100 * m + 4 * m
    assert cost_at(known, 8) is known[1][1]  # a traced size is taken as traced


def test_cost_at_scales_the_nearest_trace_when_the_op_sequences_differ():
    known = [(2, _cost(2, [(20, 200)])), (8, _cost(8, [(80, 800), (8, 8)]))]
    three = cost_at(known, 3)  # nearer 2: its one op, scaled by 3/2
    assert [(r.flops, r.bytes) for r in three.forward.ops] == [(30, 300)]
    seven = cost_at(known, 7)
    assert [(r.flops, r.bytes) for r in seven.forward.ops] == [(70, 700), (7, 7)]


def _candidate(gib: float, ms: float | None, micro: int = 1) -> Candidate:
    config = Config(micro_batch=micro, accumulation_steps=1, precision="fp32")
    return Candidate(config=config, device_bytes=int(gib * 2**30), fits_in_bytes=int(gib * 2**30),
                     step_time_s=None if ms is None else ms / 1e3, samples_per_s=None, verified=True, fits=True)


def test_frontier_keeps_only_candidates_no_other_beats_on_memory_and_time():
    a, b, c, d, e = _candidate(1, 30), _candidate(2, 20), _candidate(3, 25), _candidate(4, 10), _candidate(0.5, None)
    same_memory_slower = _candidate(2, 22, micro=2)
    assert _frontier([c, e, d, same_memory_slower, b, a]) == [a, b, d]


def test_a_real_plans_frontier_is_pareto_optimal(grid: Grid):
    p = run_plan(budget_for(grid.need(grid.configs[0])))
    f = p.frontier
    assert len(f) >= 2
    for x in f:
        assert not any(y is not x and y.device_bytes <= x.device_bytes and y.step_time_s < x.step_time_s for y in f)
    assert [x.device_bytes for x in f] == sorted(x.device_bytes for x in f)
    assert all(x.step_time_s > y.step_time_s for x, y in zip(f, f[1:], strict=False))


# ------------------------------------------------------------------------------------ precision


def wide_mlp() -> Workload:
    """Activations (8 × 2048 tokens × 2048 features) dominate: bf16 autocast halves them."""
    return Workload(
        name="plan-wide-mlp",
        model=lambda: torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                                          torch.nn.GELU(), torch.nn.Linear(2048, 256)),
        batch=lambda n: (torch.randn(n, 2048, 256), torch.randn(n, 2048, 256)),
        loss=lambda out, b: torch.nn.functional.mse_loss(out, b[1]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        batch_size=EFF,
    )


@pytest.fixture(scope="module")
def fp32_floor() -> int:
    """The least device memory any fp32 configuration of ``wide_mlp`` needs, found by the planner itself."""
    p = plan(wide_mlp(), budget_bytes=1 << 40, allocator=ALLOCATOR)
    assert p.chosen.config.precision == "fp32"
    smallest = Config(micro_batch=1, accumulation_steps=EFF, precision="fp32", optimizer_impl="fused")
    search = Search(wide_mlp().replace(keep_output=False), gpu_spec(None), ALLOCATOR, 1 << 62, EFF, None, False)
    return min(search.estimate(v).device_upper_bytes
               for v in (smallest, dataclasses.replace(smallest, expandable_segments=True)))


def test_precision_changes_only_when_allowed_and_then_rescues_a_budget_fp32_cannot_meet(fp32_floor: int):
    budget = budget_for(fp32_floor - (2 << 20))
    with pytest.raises(BudgetTooSmallError, match="--allow-precision-change"):
        plan(wide_mlp(), budget_bytes=budget, allocator=ALLOCATOR)
    p = plan(wide_mlp(), budget_bytes=budget, allocator=ALLOCATOR, allow_precision_change=True)
    assert p.chosen.config.precision == "bf16" and p.chosen.verified and p.chosen.fits


def test_without_permission_no_configuration_changes_precision():
    p = plan(wide_mlp(), budget_bytes=1 << 40, allocator=ALLOCATOR)
    assert {c.config.precision for c in [p.chosen, *p.frontier]} == {"fp32"}
    allowed = plan(wide_mlp(), budget_bytes=1 << 40, allocator=ALLOCATOR, allow_precision_change=True)
    assert "bf16" in {c.config.precision for c in allowed.frontier}


# ------------------------------------------------------------------------------------ checkpoint modes


class _WideStack(torch.nn.Module):
    """Two residual blocks of wide fp32 matmuls: GPU-bound, so recomputing a matmul costs more than selective
    checkpointing's Python dispatch modes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 1024))
            for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _wide_stack() -> Workload:
    return Workload(name="wide", model=_WideStack, batch=lambda n: (torch.randn(n, 2048, 1024),),
                    loss=lambda out, b: out.float().pow(2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    batch_size=1)


def test_selective_checkpointing_is_chosen_where_it_fits_and_is_faster_and_full_where_only_full_fits():
    modes = ("full", "selective")
    # expandable segments on from the start: no retry with them lets a configuration in that the needs say is out
    allocator = dataclasses.replace(ALLOCATOR, expandable_segments=True)
    search = Search(_wide_stack().replace(keep_output=False), gpu_spec(None), allocator, 1 << 62, 1, None, False, modes)
    structures, _ = _memory_models(search)
    both = ("blocks.0", "blocks.1")
    # each block set in each mode (the heavier half of the blocks, then all)
    assert {(s.checkpoint, s.checkpoint_mode) for s in structures} == {
        ((), "full"), (("blocks.0",), "full"), (("blocks.0",), "selective"), (both, "full"), (both, "selective")}
    configs = {(s.checkpoint, s.checkpoint_mode): s.config(1, 1) for s in structures}
    need = {k: search.estimate(c).device_upper_bytes for k, c in configs.items()}
    time = {k: search.step_time(c) for k, c in configs.items()}
    # selective keeps each block's first matmul output (64 MiB): more than full, less than no checkpointing ...
    assert need[(both, "full")] < need[(both, "selective")] < need[((), "full")]
    # ... and recomputes only GELU, not the 34-GFLOP matmul: predicted faster than full
    assert time[(both, "selective")] < time[(both, "full")]

    def chosen(limit: int) -> Config:
        p = plan(_wide_stack(), budget_bytes=budget_for(limit), effective_batch=1, allocator=allocator,
                 checkpoint_modes=modes)
        assert p.chosen.verified and p.chosen.fits
        return p.chosen.config

    # room for full checkpointing only
    tight = chosen(need[(both, "full")])
    assert tight.checkpoint and tight.checkpoint_mode == "full"
    # room for selective: the fastest configuration that fits is a selective one
    roomy = chosen(min(need[(b, "selective")] for b in (("blocks.0",), both)))
    assert roomy.checkpoint and roomy.checkpoint_mode == "selective"
    assert time[(roomy.checkpoint, "selective")] == min(t for k, t in time.items() if need[k] <= need[(both, "selective")])


def test_a_mode_the_blocks_cannot_run_is_left_out_with_a_note():
    class KeywordBlock(torch.nn.Module):  # a block called with a keyword tensor that needs a gradient
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.inner = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())

        def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> torch.Tensor:
            return self.inner(self.lin(x)) * gate

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Parameter(torch.ones(64))
            self.blocks = torch.nn.ModuleList(KeywordBlock() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, gate=self.gate)
            return x

    w = Workload(name="kw", model=Net, batch=lambda n: (torch.randn(n, 64),), loss=lambda out, b: out.sum(),
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
    p = plan(w, budget_bytes=8 << 30, allocator=ALLOCATOR)
    assert any(n.startswith("reentrant checkpointing left out") and "gate" in n for n in p.notes)
    assert p.chosen.config.checkpoint_mode != "reentrant"


def test_a_plan_with_a_checkpoint_mode_round_trips_and_applies_it(tmp_path):  # noqa: ANN001
    from memfit.plan.search import Plan

    p = plan(_wide_stack(), budget_bytes=16 << 30, effective_batch=1, allocator=ALLOCATOR)
    config = dataclasses.replace(p.chosen.config, checkpoint=("blocks.0",), checkpoint_mode="selective")
    p = dataclasses.replace(p, chosen=dataclasses.replace(p.chosen, config=config))
    again = Plan.load(p.save(tmp_path / "plan.json"))
    assert again.chosen.config.checkpoint_mode == "selective"
    assert again.workload_for(_wide_stack()).checkpoint_mode == "selective"
    model = _WideStack()
    again.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, b: out.sum())
    assert model.blocks[0]._memfit_checkpointed == "selective"


def test_a_change_of_memory_format_must_be_predicted_worth_it():
    # the roofline called channels_last 0.08 % faster for ViT-B/16, which ran 8 % slower: a format change is taken
    # only when predicted LAYOUT_CHANGE_GAIN faster than the workload's own
    def cand(channels_last: bool, ms: float) -> Candidate:
        config = Config(micro_batch=8, accumulation_steps=1, precision="bf16", channels_last=channels_last)
        return Candidate(config=config, device_bytes=1 << 30, fits_in_bytes=1 << 30, step_time_s=ms / 1e3,
                         samples_per_s=None, verified=True, fits=True)

    own = cand(False, 100.0)
    assert min([own, cand(True, 99.0)], key=lambda c: speed_key(c, False)) is own
    faster = cand(True, 100.0 / (1 + LAYOUT_CHANGE_GAIN) - 0.5)
    assert min([own, faster], key=lambda c: speed_key(c, False)) is faster
    # the user's own channels_last is no change: the same candidates, the other way round
    assert min([cand(True, 100.0), cand(False, 99.0)], key=lambda c: speed_key(c, True)).config.channels_last


def test_where_the_plan_checkpoints_every_block_it_also_tries_three_quarters_of_them():
    # ViT-B/16 at 4 GiB: all 12 blocks were checkpointed where 9 ran under the cap 10 % faster
    from memfit.plan.search import _finer_checkpointing
    from memfit.plan.walk import verified

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
                for _ in range(4))
            self.head = torch.nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    w = Workload(model=Stack, batch=lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
                 loss=lambda out, b: torch.nn.functional.cross_entropy(out, b[1]),
                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=64, keep_output=False)
    search = Search(w, gpu_spec(None), ALLOCATOR, 1 << 62, 64, None, False)
    structures, _ = _memory_models(search)
    every = next(s for s in structures if len(s.checkpoint) == 4 and s.checkpoint_mode == "full")
    assert not any(len(s.checkpoint) == 3 for s in structures)  # half and all only, at first
    finer = _finer_checkpointing(search, verified(search, every.config(32, 64)))
    assert [(len(c.config.checkpoint), c.config.checkpoint_mode, c.config.micro_batch) for c in finer] == [
        (3, "full", 32)]
    assert all(c.verified for c in finer)
    # a plan that checkpoints three blocks already has nothing finer to try
    assert _finer_checkpointing(search, verified(search, finer[0].config)) == []


# ------------------------------------------------------------------------------------ the lane's guesses


def _lane_setup(limit_mib: int):  # noqa: ANN202
    """A search with two structures whose memory lines are known (A: 100 MiB per sample, B: 50), no context, and
    no floors: what ``_next_probes`` guesses depends only on them and on the exact rungs given."""
    from types import SimpleNamespace

    MiB = 1 << 20
    search = Search(plan_unet(), gpu_spec("h100"), ALLOCATOR, limit_mib * MiB, 64, None, False)
    search.context_bytes = 0
    search.need_floor = lambda config, bound=True: 0  # type: ignore[method-assign]
    a, b = Structure("fp32"), Structure("fp32", checkpoint=("x",))
    models = {a: MemoryModel(0, 100 * MiB, 0, 0), b: MemoryModel(0, 50 * MiB, 0, 0)}

    def rung(structure: Structure, micro: int, mib: int) -> None:
        search.estimates[structure.config(micro, 64)] = SimpleNamespace(device_upper_bytes=mib * MiB)

    def candidate(structure: Structure, micro: int, seconds: float) -> Candidate:
        return Candidate(config=structure.config(micro, 64), device_bytes=0, fits_in_bytes=0, step_time_s=seconds,
                         samples_per_s=None, verified=False, fits=False)

    return search, a, b, models, rung, candidate


def test_the_lane_guesses_the_rungs_above_a_probe_expected_to_fit():
    from memfit.plan.walk import LANE_GUESSES, _next_probes

    search, a, b, models, rung, candidate = _lane_setup(limit_mib=650)
    best = candidate(a, 32, 1.0)
    # A's line is over 650 MiB from micro-batch 8 on: after the probe at 4, the walk asks 8, then 16 (32 is best)
    guesses = _next_probes(search, [best, candidate(b, 32, 2.0)], best, a.config(4, 64), models, set())
    assert LANE_GUESSES == 2 and guesses == [a.config(8, 64), a.config(16, 64)]


def test_the_lane_guesses_another_structure_when_two_rungs_put_the_probe_over():
    from memfit.plan.walk import _next_probes

    search, a, b, models, rung, candidate = _lane_setup(limit_mib=650)
    rung(a, 1, 100)
    rung(a, 2, 300)  # 200 MiB a sample from here: 700 MiB at 4, over the limit
    best = candidate(a, 32, 1.0)
    others = [candidate(b, 32, 2.0), candidate(b, 16, 3.0)]
    guesses = _next_probes(search, [best, *others], best, a.config(4, 64), models, set())
    # B's line is over 650 MiB from 16 on: the probe that settles B@32 (the fastest other) is B@16
    assert guesses == [b.config(16, 64)]
    # once B@16 is estimated (a miss), it is not guessed again: B@32's probe is B@32 itself
    rung(b, 16, 800)
    assert _next_probes(search, [best, *others], best, a.config(4, 64), models, set()) == [b.config(32, 64)]


def test_the_lane_guesses_another_structure_when_the_line_puts_a_first_probe_over():
    from memfit.plan.walk import _next_probes

    # no exact rung below the probe: the memory line decides. A's line says 400 MiB at micro-batch 4
    search, a, b, models, rung, candidate = _lane_setup(limit_mib=399)
    best = candidate(a, 32, 1.0)
    others = [candidate(b, 32, 2.0), candidate(b, 16, 3.0)]
    guesses = _next_probes(search, [best, *others], best, a.config(4, 64), models, set())
    # the walk will move on from A: the lane traces the probe that settles B@32 (B's line: over 399 MiB from 8 on)
    assert guesses == [b.config(8, 64)]
    # where the line puts the probe under the limit, A's larger micro-batches (over it) are guessed
    search.limit_bytes = 400 << 20
    assert _next_probes(search, [best, *others], best, a.config(4, 64), models, set()) == [a.config(8, 64),
                                                                                            a.config(16, 64)]
