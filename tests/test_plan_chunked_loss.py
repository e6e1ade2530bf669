"""The chunked cross-entropy as a plan knob, on CPU: a small decoder LM whose logits dominate the step.

The plan takes the chunked loss where only it fits, keeps the default loss where both fit (the chunked one does
more work), never predicts the chunked loss faster than the default, and a plan that chose it runs it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from memfit.errors import BudgetTooSmallError, UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import PhaseCost, StepCost
from memfit.plan.records import Candidate, Config, Plan
from memfit.plan.search import DEFAULT_MARGIN, _memory_models, plan
from memfit.plan.search_state import Search, divisors
from memfit.workload.chunked_cross_entropy import causal_lm_loss
from memfit.workload.models import CausalLM
from memfit.workload.spec import Workload

# 512 tokens a sample over a 32k vocabulary at width 64: one sample's fp32 logits are 65.5 MB and the step keeps
# three of them at the backward peak (see tests/test_chunked_cross_entropy.py), far more than the 4.2 M
# parameters' weights, gradients and AdamW states (67 MB) and the activations of two narrow blocks
V, T, H = 32_000, 512, 64
EFF = 4
ALLOCATOR = AllocatorConfig()  # not the environment's PYTORCH_CUDA_ALLOC_CONF


def decoder(*, loss_from_logits: bool = False) -> Workload:
    """The decoder, its loss taken from the model (so the chunked loss applies) or computed from its logits (the
    same loss, which the chunked loss cannot serve: it makes no logits)."""
    def loss(out: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return causal_lm_loss(out.logits, batch["labels"]) if loss_from_logits else out.loss  # type: ignore[attr-defined]

    return Workload(
        name="decoder-32k", model=lambda: CausalLM(vocab=V, seq_len=T, dim=H, layers=2, heads=2),
        batch=lambda n: {"input_ids": torch.randint(0, V, (n, T)), "labels": torch.randint(0, V, (n, T))},
        loss=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), batch_size=1, accumulation_steps=EFF,
        keep_output=False,
    )


def run_plan(workload: Workload, budget_bytes: int) -> Plan:
    return plan(workload, budget_bytes=budget_bytes, effective_batch=EFF, gpu="h100", allocator=ALLOCATOR)


@pytest.fixture(scope="module")
def tight_budget() -> int:
    """A budget between the chunked loss's smallest need (micro-batch 1) and the default loss's: the default
    loss's least need is found by the plan itself (the BudgetTooSmallError of the twin below)."""
    search = Search(decoder().replace(keep_output=False), gpu_spec("h100"), ALLOCATOR, 1 << 62, EFF, None, False)
    chunked = search.estimate(Config(micro_batch=1, accumulation_steps=EFF, precision="fp32", loss_impl="chunked"))
    default = search.estimate(Config(micro_batch=1, accumulation_steps=EFF, precision="fp32"))
    # the logits the chunked loss never makes: about 3 × 512 × 32000 × 4 B = 197 MB less, less one chunk
    assert default.device_upper_bytes - chunked.device_upper_bytes > 100 << 20
    return int(chunked.device_upper_bytes / (1 - DEFAULT_MARGIN)) + (20 << 20)


def test_where_only_the_chunked_loss_fits_the_plan_takes_it(tight_budget: int) -> None:
    p = run_plan(decoder(), tight_budget)
    assert p.chosen.config.loss_impl == "chunked" and p.chosen.verified and p.chosen.fits
    assert p.chosen.device_bytes <= tight_budget * (1 - DEFAULT_MARGIN)
    assert "chunked cross-entropy" in p.chosen.config.label()
    assert p.chosen.config.effective_batch == EFF


def test_the_same_loss_from_the_logits_cannot_use_the_knob_and_nothing_fits(tight_budget: int) -> None:
    """The twin whose loss reads the logits: the planner leaves the chunked loss out (with a note, checked at a
    loose budget) and, at the tight budget, no configuration of the default loss fits: only the chunked one did."""
    with pytest.raises(BudgetTooSmallError, match="nothing fits"):
        run_plan(decoder(loss_from_logits=True), tight_budget)
    p = run_plan(decoder(loss_from_logits=True), 16 << 30)
    assert p.chosen.config.loss_impl == "default"
    assert any("chunked loss was not tried" in n and "out.loss" in n for n in p.notes)


def test_where_both_fit_the_plan_keeps_the_faster_default_loss() -> None:
    p = run_plan(decoder(), 16 << 30)
    assert p.chosen.config.loss_impl == "default" and p.chosen.config.micro_batch == EFF
    # the chunked loss was scored (it is on the frontier: it needs less memory), and predicted slower
    chunked = [c for c in p.frontier if c.config.loss_impl == "chunked"]
    assert chunked
    twin = dataclasses.replace(p.chosen.config, loss_impl="chunked")
    same = next(c for c in chunked if dataclasses.replace(c.config, expandable_segments=False) == twin)
    assert same.step_time_s is not None and p.chosen.step_time_s is not None
    assert same.step_time_s > p.chosen.step_time_s
    assert same.device_bytes < p.chosen.device_bytes


# --------------------------------------------------------------------------------------------------- speed


@pytest.fixture(scope="module")
def searched() -> tuple[Search, list[Config]]:
    """Every configuration of the plan's search estimated exactly."""
    search = Search(decoder().replace(keep_output=False), gpu_spec("h100"), ALLOCATOR, 1 << 62, EFF, None, False)
    structures, _ = _memory_models(search)
    configs = [s.config(m, EFF) for s in structures for m in divisors(EFF)]
    for c in configs:
        search.estimate(c)
    return search, configs


def _default_twins(configs: list[Config]) -> list[tuple[Config, Config]]:
    pairs = [(dataclasses.replace(c, loss_impl="default"), c) for c in configs if c.loss_impl == "chunked"]
    assert pairs and all(d in configs for d, _ in pairs)
    return pairs


def test_the_roofline_itself_prices_the_chunked_loss_above_the_default(searched: tuple[Search, list[Config]]
                                                                       ) -> None:
    """Its traced ops: the default's over chunks of tokens and one more output-layer matmul per chunk."""
    search, configs = searched
    for default, chunked in _default_twins(configs):
        assert search.raw_step_time(chunked) > search.raw_step_time(default), chunked.label()  # type: ignore[operator]
        assert search.step_time(chunked) >= search.step_time(default), chunked.label()  # type: ignore[operator]


def _scaled(cost: StepCost, factor: float) -> StepCost:
    def phase(p: PhaseCost) -> PhaseCost:
        return PhaseCost.of([r._replace(flops=int(r.flops * factor), bytes=int(r.bytes * factor),
                                        kernels=int(r.kernels * factor), dispatches=int(r.dispatches * factor))
                             for r in p.ops])

    return dataclasses.replace(cost, forward=phase(cost.forward), backward=phase(cost.backward))


def test_a_chunked_trace_priced_below_the_default_is_still_not_faster(searched: tuple[Search, list[Config]]
                                                                      ) -> None:
    """Doctored costs (the chunked traces at a tenth) break the raw roofline's order; the construction holds."""
    search, configs = searched
    doctored = Search(search.workload, search.gpu, search.allocator, search.limit_bytes, search.effective, None,
                      False)
    doctored.estimates = {c: dataclasses.replace(e, cost=_scaled(e.cost, 0.1))
                          if c.loss_impl == "chunked" and e.cost is not None else e
                          for c, e in search.estimates.items()}
    for default, chunked in _default_twins(configs):
        assert doctored.raw_step_time(chunked) < doctored.raw_step_time(default)  # type: ignore[operator]
        assert doctored.step_time(chunked) >= doctored.step_time(default)  # type: ignore[operator]


# ------------------------------------------------------------------------------------------ records and apply


def _fixed_plan(config: Config) -> Plan:
    chosen = Candidate(config=config, device_bytes=3 << 30, fits_in_bytes=2 << 30, step_time_s=0.1,
                       samples_per_s=40.0, verified=True, fits=True)
    return Plan(workload="decoder", gpu="H100", budget_bytes=4 << 30, margin=0.02,
                effective_batch=config.effective_batch, chosen=chosen, frontier=[chosen], considered=1, estimates=1,
                speed_model="roofline")


def test_the_knob_is_in_the_configuration_its_changes_and_its_json(tmp_path: object) -> None:
    config = Config(micro_batch=2, accumulation_steps=2, precision="bf16", loss_impl="chunked")
    assert config.changes()["loss_impl"] == "chunked"
    assert Config(micro_batch=2, accumulation_steps=2, precision="bf16").changes()["loss_impl"] == "default"
    p = _fixed_plan(config)
    assert p.workload_for(decoder()).loss_impl == "chunked"
    assert Plan.from_dict(json.loads(p.to_json())).chosen.config.loss_impl == "chunked"
    # a plan written before the knob existed has no loss_impl: it reads as the default loss
    data = json.loads(p.to_json())
    for c in (data["chosen"], *data["frontier"]):
        del c["config"]["loss_impl"]
    assert Plan.from_dict(data).chosen.config.loss_impl == "default"
    data["chosen"]["config"]["loss_impl"] = "fused"
    with pytest.raises(UsageError, match="loss_impl must be one of 'default', 'chunked'"):
        Plan.from_dict(data)
    with pytest.raises(UsageError, match="Config.loss_impl must be one of default, chunked"):
        Config(micro_batch=1, accumulation_steps=1, precision="fp32", loss_impl="fused")  # type: ignore[arg-type]


def test_apply_runs_the_chunked_loss_and_the_loss_is_the_same() -> None:
    torch.manual_seed(0)
    small = {"vocab": 300, "seq_len": 16, "dim": 16, "layers": 1, "heads": 2}
    model, reference = CausalLM(**small), CausalLM(**small)
    reference.load_state_dict(model.state_dict())
    batch = {"input_ids": torch.randint(0, 300, (4, 16)), "labels": torch.randint(0, 300, (4, 16))}
    step = _fixed_plan(Config(micro_batch=4, accumulation_steps=1, precision="fp32", loss_impl="chunked")).apply(
        model, torch.optim.SGD(model.parameters(), lr=0.0), lambda out, mb: out.loss)
    metrics = step(batch)
    assert model(**batch).logits is None  # the chunked forward: no logits made
    expected = reference(**batch).loss
    assert metrics.loss == pytest.approx(float(expected.detach()), rel=1e-5)
