"""The planner's speed model is monotone by construction: the same configuration with more recomputation (more
checkpointed blocks) or smaller micro-batches (same effective batch) is never predicted faster.

Checked on every pair of a grid of configurations with the real roofline (``predict_step_time`` through
``Search.step_time``, nothing mocked), on two models, with the costs the search starts from and with every
configuration traced; then on traces doctored so that the raw roofline would break the rule, which the
construction must absorb.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conftest import PLAN_EFFECTIVE, plan_unet
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import PhaseCost, StepCost
from memfit.plan.records import Config
from memfit.plan.search import _memory_models
from memfit.plan.search_state import Search, divisors
from memfit.workload.spec import Workload

EFF = PLAN_EFFECTIVE


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(500, 64)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))
        self.head = torch.nn.Linear(64, 500)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_lm() -> Workload:
    return Workload(
        name="plan-tiny-lm", model=_TinyLM,
        batch=lambda n: (torch.randint(0, 500, (n, 128)), torch.randint(0, 500, (n, 128))),
        loss=lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b[1].flatten()),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=EFF,
    )


WORKLOADS = {"unet": plan_unet, "tiny_lm": tiny_lm}


def _search(name: str, *, every_config: bool) -> tuple[Search, list[Config]]:
    search = Search(WORKLOADS[name]().replace(keep_output=False), gpu_spec("h100"), AllocatorConfig(), 1 << 62, EFF,
                    None, False)
    structures, _ = _memory_models(search)
    configs = [s.config(m, EFF) for s in structures for m in divisors(EFF)]
    if every_config:
        for c in configs:
            search.estimate(c)
    return search, configs


@pytest.fixture(scope="module", params=[(w, e) for w in WORKLOADS for e in (False, True)],
                ids=[f"{w}-{'every-config' if e else 'line-estimates'}" for w in WORKLOADS for e in (False, True)])
def searched(request: pytest.FixtureRequest) -> tuple[Search, list[Config]]:
    name, every = request.param
    return _search(name, every_config=every)


def no_more_work(a: Config, b: Config) -> bool:
    """``b`` does at least the work of ``a``: the same computation, at least its recompute in the same checkpoint mode
    (the modes trade GPU recompute for CPU hooks, so they are not ordered), micro-batches no larger."""
    same = (a.precision, a.optimizer_impl, a.channels_last, a.effective_batch) == (
        b.precision, b.optimizer_impl, b.channels_last, b.effective_batch)
    same_mode = not a.checkpoint or a.checkpoint_mode == b.checkpoint_mode
    return same and same_mode and a != b and set(a.checkpoint) <= set(b.checkpoint) and b.micro_batch <= a.micro_batch


def test_more_recompute_or_smaller_micro_batches_are_never_predicted_faster(searched):  # noqa: ANN001
    search, configs = searched
    pairs = [(a, b) for a, b in itertools.permutations(configs, 2) if no_more_work(a, b)]
    assert any(a.checkpoint != b.checkpoint for a, b in pairs) and any(a.micro_batch != b.micro_batch for a, b in pairs)
    for a, b in pairs:
        ta, tb = search.step_time(a), search.step_time(b)
        assert ta is not None and tb is not None
        assert tb >= ta, f"{b.label()} predicted {tb * 1e3:.3f} ms, faster than {a.label()} at {ta * 1e3:.3f} ms"


def _scaled(cost: StepCost, factor: float) -> StepCost:
    def phase(p: PhaseCost) -> PhaseCost:
        return PhaseCost.of([r._replace(flops=int(r.flops * factor), bytes=int(r.bytes * factor),
                                        kernels=int(r.kernels * factor), dispatches=int(r.dispatches * factor))
                             for r in p.ops])

    return dataclasses.replace(cost, forward=phase(cost.forward), backward=phase(cost.backward))


def _doctor(search: Search, pick, factor: float) -> Search:  # noqa: ANN001
    """A copy of ``search`` whose estimates chosen by ``pick`` carry op costs scaled by ``factor``."""
    doctored = Search(search.workload, search.gpu, search.allocator, search.limit_bytes, search.effective, None,
                      False)
    doctored.estimates = {c: dataclasses.replace(e, cost=_scaled(e.cost, factor)) if pick(c) and e.cost else e
                          for c, e in search.estimates.items()}
    return doctored


@pytest.fixture(scope="module")
def lm() -> tuple[Search, list[Config]]:
    return _search("tiny_lm", every_config=True)


def test_a_checkpointed_trace_priced_below_the_plain_one_is_still_not_faster(lm):  # noqa: ANN001
    search, configs = lm
    doctored = _doctor(search, lambda c: bool(c.checkpoint), 0.3)
    plain = next(c for c in configs if not c.checkpoint and c.micro_batch == EFF)
    checkpointed = [c for c in configs if c.checkpoint and c.micro_batch == EFF]
    assert checkpointed
    for c in checkpointed:
        assert doctored.raw_step_time(c) < doctored.raw_step_time(plain)  # the raw roofline breaks the rule
        assert doctored.step_time(c) >= doctored.step_time(plain)


def test_a_micro_batch_trace_priced_below_its_share_is_still_not_faster(lm):  # noqa: ANN001
    search, configs = lm
    doctored = _doctor(search, lambda c: not c.checkpoint and c.micro_batch == 1, 0.01)
    one = next(c for c in configs if not c.checkpoint and c.micro_batch == 1)
    whole = next(c for c in configs if not c.checkpoint and c.micro_batch == EFF)
    assert doctored.raw_step_time(one) < doctored.raw_step_time(whole)  # the raw roofline breaks the rule
    assert doctored.step_time(one) >= doctored.step_time(whole)


def test_other_computations_are_not_compared(lm):  # noqa: ANN001
    """A fused optimizer or another precision is a different computation: no envelope over it."""
    search, configs = lm
    c = next(c for c in configs if not c.checkpoint and c.micro_batch == EFF)
    assert search.step_time(c) == search.raw_step_time(c)  # nothing does less work than the whole batch, plain
