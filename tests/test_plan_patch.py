"""``plan_patch``: the largest patch on the ladder whose exact estimate fits, hand-worked on CPU.

Every rung of a short ladder (the small U-Net from 256 × 224 in steps of 32) is estimated exactly once: at each
budget the plan must be the first rung from the top that fits, and every rung with more voxels must not fit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import plan_unet
from memfit import BudgetTooSmallError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import gpu_spec
from memfit.plan.patch import patch_ladder, plan_patch
from memfit.plan.records import Config
from memfit.plan.search import DEFAULT_MARGIN
from memfit.plan.search_state import Search
from memfit.workload.spec import Workload

START, MULTIPLE, BATCH = (256, 224), (32, 32), 2
ALLOCATOR = AllocatorConfig()


def workload() -> Workload:
    return plan_unet(batch_size=BATCH, patch_size=START, patch_multiple=MULTIPLE)


@pytest.fixture(scope="module")
def rungs() -> tuple[list[tuple[int, ...]], list[int], Search]:
    """The ladder and the exact need (device_upper_bytes, the number "fits" is decided with) of every rung."""
    ladder = patch_ladder(START, MULTIPLE)
    search = Search(workload(), gpu_spec(None), ALLOCATOR, 1 << 62, BATCH, None, False)
    estimates = [search.estimate(Config(micro_batch=BATCH, accumulation_steps=1, precision="fp32", patch_size=r))
                 for r in ladder]
    return ladder, [e.device_upper_bytes for e in estimates], search


def test_the_ladder_shrinks_every_rung_inside_the_one_above():
    ladder = patch_ladder(START, MULTIPLE)
    assert ladder[0] == START and ladder[-1] == MULTIPLE
    for above, below in zip(ladder, ladder[1:], strict=False):
        assert all(b <= a for a, b in zip(above, below, strict=True)) and below != above
        assert math.prod(below) < math.prod(above)  # so "more voxels" is "higher on the ladder"


@pytest.mark.parametrize("quantile", [0.1, 0.35, 0.6, 0.9])
def test_the_plan_is_the_largest_rung_that_fits_and_no_larger_rung_fits(rungs, quantile: float):  # noqa: ANN001
    ladder, needs, _ = rungs
    limit = sorted(needs)[round(quantile * (len(needs) - 1))]
    budget = math.ceil(limit / (1 - DEFAULT_MARGIN))
    p = plan_patch(workload(), budget_bytes=budget, allocator=ALLOCATOR)
    chosen = p.chosen.config.patch_size
    assert chosen is not None and p.chosen.config.micro_batch == BATCH
    k = ladder.index(chosen)
    limit = int(budget * (1 - DEFAULT_MARGIN))
    assert needs[k] == p.chosen.device_bytes <= limit
    bigger = [r for r in ladder if math.prod(r) > math.prod(chosen)]
    assert bigger == ladder[:k]
    assert all(needs[i] > limit for i in range(k)), [(ladder[i], needs[i], limit) for i in range(k)]


def test_floors_along_the_ladder_stay_below_every_larger_rungs_need(rungs):  # noqa: ANN001
    ladder, needs, search = rungs
    for j, r in enumerate(ladder):
        config = Config(micro_batch=BATCH, accumulation_steps=1, precision="fp32", patch_size=r)
        floor = search.need_floor(config)
        assert all(floor <= needs[i] for i in range(j + 1))
        # the floor a settling search uses holds for the best estimates, which it may take
        best_floor = search.need_floor(config, bound=False)
        assert best_floor <= floor
        assert all(best_floor <= search.estimate(dataclasses.replace(config, patch_size=ladder[i])).device_bytes
                   for i in range(j + 1))


def test_no_patch_fits_after_the_smallest_was_estimated(rungs):  # noqa: ANN001
    ladder, needs, _ = rungs
    with pytest.raises(BudgetTooSmallError, match="no patch fits"):
        plan_patch(workload(), budget_bytes=math.ceil((needs[-1] - 1) / (1 - DEFAULT_MARGIN)) - 1,
                   allocator=ALLOCATOR)


def test_a_larger_rung_ruled_out_only_by_the_bounds_margin_is_named(rungs):  # noqa: ANN001
    # "fits" is decided with the upper bound; a budget between a rung's best estimate and its bound picks the rung
    # below and says the larger one may fit
    ladder, needs, search = rungs
    best = [search.estimate(Config(micro_batch=BATCH, accumulation_steps=1, precision="fp32",
                                   patch_size=r)).device_bytes for r in ladder]
    # the first rung whose bound's margin is wider than the step to the rung below it
    k = next(i for i in range(len(ladder) - 1) if needs[i + 1] < (best[i] + needs[i]) // 2)
    limit = (best[k] + needs[k]) // 2
    assert best[k] < limit < needs[k]
    p = plan_patch(workload(), budget_bytes=math.ceil(limit / (1 - DEFAULT_MARGIN)), allocator=ALLOCATOR)
    assert p.chosen.config.patch_size == ladder[k + 1]
    named = [n for n in p.notes if "may fit too" in n]
    assert len(named) == 1 and "×".join(map(str, ladder[k])) in named[0]
    # with the budget at the bound's need the larger rung is chosen, and nothing is said
    p = plan_patch(workload(), budget_bytes=math.ceil(needs[k] / (1 - DEFAULT_MARGIN)), allocator=ALLOCATOR)
    assert p.chosen.config.patch_size == ladder[k] and not any("may fit too" in n for n in p.notes)


def _between_best_and_bound(rungs):  # noqa: ANN001, ANN202
    """The first rung whose bound's margin is wider than the step to the rung below, and a limit between that
    rung's best estimate and its bound: only the bound keeps it out."""
    ladder, needs, search = rungs
    best = [search.estimate(Config(micro_batch=BATCH, accumulation_steps=1, precision="fp32",
                                   patch_size=r)).device_bytes for r in ladder]
    k = next(i for i in range(len(ladder) - 1) if needs[i + 1] < (best[i] + needs[i]) // 2)
    return k, (best[k] + needs[k]) // 2, best


@pytest.mark.parametrize("runs", [True, False])
def test_a_rung_only_the_bound_keeps_out_is_settled_by_a_run_under_the_cap(rungs, runs: bool):  # noqa: ANN001
    ladder, needs, search = rungs
    k, limit, best = _between_best_and_bound(rungs)
    asked: list[tuple[tuple[int, ...] | None, int]] = []

    def settle(config: Config, cap_bytes: int) -> bool:
        asked.append((config.patch_size, cap_bytes))
        return runs

    p = plan_patch(workload(), budget_bytes=math.ceil(limit / (1 - DEFAULT_MARGIN)), allocator=ALLOCATOR,
                   settle=settle)
    context = search.context_bytes
    # asked only about rungs whose best estimate fits, the largest first, with the cap the plan's context leaves
    assert asked and asked[0] == (ladder[k], limit - context)
    assert all(best[ladder.index(patch)] <= limit for patch, _ in asked)
    if runs:
        assert p.chosen.config.patch_size == ladder[k] and p.chosen.fits
        assert p.chosen.device_bytes == needs[k] > limit  # the bound is still what it is; the run let it in
        assert any("ran under a cap" in n for n in p.notes)
    else:
        assert p.chosen.config.patch_size == ladder[k + 1]
        assert any("did not run under the cap" in n for n in p.notes)
        assert not any("may fit too" in n for n in p.notes)


@pytest.mark.parametrize("rung", [1, 3])
def test_settle_is_asked_only_where_the_best_estimate_fits_and_the_bound_does_not(rungs, rung: int):  # noqa: ANN001
    ladder, needs, _ = rungs
    _, _, best = _between_best_and_bound(rungs)
    limit = needs[rung]
    asked: list[int] = []
    plan_patch(workload(), budget_bytes=math.ceil(limit / (1 - DEFAULT_MARGIN)), allocator=ALLOCATOR,
               settle=lambda config, cap: asked.append(ladder.index(config.patch_size)) is None)
    assert all(best[i] <= limit < needs[i] for i in asked), [(ladder[i], best[i], needs[i], limit) for i in asked]
