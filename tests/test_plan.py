"""The planner on CPU: real estimates and the real speed model (the roofline needs no GPU)."""

import os

import pytest
import torch

from conftest import PLAN_EFFECTIVE, plan_unet, small_plan
from memfit import BudgetTooSmallError, estimate
from memfit.errors import UsageError
from memfit.estimate.allocator import AllocatorConfig
from memfit.plan.patch import patch_ladder, plan_patch
from memfit.plan.records import Plan
from memfit.plan.search import plan
from memfit.workload.spec import Workload

EFFECTIVE = PLAN_EFFECTIVE


def unet(**changes) -> Workload:  # noqa: ANN003
    return plan_unet(**changes)


@pytest.fixture(scope="module")
def needs():
    """Device bytes of the biggest and the smallest configurations."""
    biggest = estimate(unet(keep_output=False)).device_upper_bytes
    smallest = estimate(unet(batch_size=1, accumulation_steps=EFFECTIVE, keep_output=False)).device_upper_bytes
    return smallest, biggest


def test_slack_budget_takes_the_whole_batch_without_checkpointing(needs):
    p = plan(unet(), budget_bytes=2 * needs[1])
    c = p.chosen.config
    assert (c.micro_batch, c.accumulation_steps, c.checkpoint) == (EFFECTIVE, 1, ())
    assert p.chosen.verified and p.chosen.fits


def test_binding_budget_fits_keeps_the_effective_batch_and_is_the_fastest_that_fits(needs):
    smallest, biggest = needs
    budget = (smallest + biggest) // 2
    p = plan(unet(), budget_bytes=budget)
    c = p.chosen.config
    assert c.effective_batch == EFFECTIVE and c.micro_batch < EFFECTIVE or c.checkpoint
    # the plan runs through TrainStep, which drops each output before backward: estimated that way, with the
    # allocator the configuration asks for, and "fits" is decided with the upper bound
    again = estimate(unet(keep_output=False, **c.changes()),
                     allocator=AllocatorConfig(expandable_segments=c.expandable_segments))
    assert again.device_upper_bytes == p.chosen.device_bytes <= budget * (1 - p.margin)
    assert all(f.config.effective_batch == EFFECTIVE for f in p.frontier)
    # nothing verified to fit is faster than the choice
    faster = [f for f in p.frontier if f.verified and f.fits and f.step_time_s < p.chosen.step_time_s]
    assert not faster


def test_impossible_budget_raises_with_the_numbers(needs):
    with pytest.raises(BudgetTooSmallError, match="smallest configuration found needs"):
        plan(unet(), budget_bytes=needs[0] // 4)


def test_plan_json_round_trips(tmp_path, needs):  # noqa: ANN001
    p = plan(unet(), budget_bytes=2 * needs[1])
    path = p.save(tmp_path / "plan.json")
    assert Plan.load(path) == p
    with pytest.raises(Exception, match="directory"):
        p.save(tmp_path)


def test_save_replaces_the_file_atomically(tmp_path):  # noqa: ANN001
    p = small_plan()
    target = tmp_path / "plan.json"
    target.write_text("old plan")
    assert p.save(target) == target and Plan.load(target) == p
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # the temporary file was renamed


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_save_keeps_the_old_plan_and_leaves_no_temporary_file(tmp_path, monkeypatch, failing):  # noqa: ANN001
    target = tmp_path / "plan.json"
    target.write_text("old plan")

    def full_disk(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, full_disk)
    with pytest.raises(UsageError, match="cannot write the plan .*No space left on device"):
        small_plan().save(target)
    monkeypatch.undo()
    assert target.read_text() == "old plan"
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]


def test_save_into_a_missing_folder_says_so(tmp_path):  # noqa: ANN001
    with pytest.raises(UsageError, match="does not exist"):
        small_plan().save(tmp_path / "missing" / "plan.json")


def test_apply_configures_the_guarded_step(needs):
    smallest, biggest = needs
    p = plan(unet(), budget_bytes=(smallest + biggest) // 2)
    model = unet().model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = p.apply(model, opt, lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]))
    cfg = p.chosen.config
    assert step.config.micro_batch_size == cfg.micro_batch
    for name in cfg.checkpoint:
        assert getattr(model.get_submodule(name), "_memfit_checkpointed", False)
    metrics = step((torch.randn(EFFECTIVE, 3, 32, 32), torch.randint(0, 2, (EFFECTIVE, 32, 32))))
    assert metrics.samples == EFFECTIVE


def test_patch_ladder_keeps_aspect_and_divisibility():
    ladder = patch_ladder((160, 192, 64), (32, 32, 16))
    assert ladder[0] == (160, 192, 64)
    assert all(p % m == 0 for patch in ladder for p, m in zip(patch, (32, 32, 16), strict=True))
    assert all(a != b for a, b in zip(ladder, ladder[1:], strict=False))
    assert ladder[-1] == (32, 32, 16)


def test_patch_search_picks_the_largest_patch_that_fits():
    w = unet(batch_size=2, patch_size=(768, 512))
    big = estimate(w)
    budget = big.device_bytes - big.fits_in_bytes + int(big.fits_in_bytes * 0.6)  # 60 % of the allocator's need
    p = plan_patch(w, budget_bytes=budget)
    chosen = p.chosen.config.patch_size
    assert chosen is not None and chosen != (768, 512) and p.chosen.config.micro_batch == 2
    assert abs(chosen[0] / chosen[1] - 768 / 512) < 0.1  # the aspect ratio is kept
    ladder = patch_ladder((768, 512), (4, 4))
    bigger = ladder[ladder.index(chosen) - 1]
    assert estimate(w.replace(patch_size=bigger)).device_upper_bytes > budget * (1 - p.margin)


@pytest.mark.gpu
def test_gpu_plan_runs_under_its_budget_cap():
    """On a real GPU: the planned configuration of a built-in runs under a cap of budget - CUDA context."""
    from memfit.estimate.gpus import detect_gpu
    from memfit.estimate.measure import run_trial
    from memfit.workload.zoo import builtin_workload

    gpu = detect_gpu()
    w = builtin_workload("resnet50")
    biggest = estimate(w.replace(batch_size=32), gpu=gpu)
    budget = biggest.device_bytes * 6 // 10
    p = plan(w, budget_bytes=budget, effective_batch=32, gpu=gpu)
    c = p.chosen.config
    # the allocator gets the budget less the CUDA context the plan assumed (measured on the H200: see gpus.py)
    context = p.chosen.device_bytes - p.chosen.fits_in_bytes
    trial = run_trial("resnet50", cap_bytes=budget - context, changes={
        "batch_size": c.micro_batch, "accumulation_steps": c.accumulation_steps, "checkpoint": list(c.checkpoint),
        "optimizer_impl": c.optimizer_impl, "channels_last": c.channels_last})
    assert trial.ok, trial.error


def _lm() -> Workload:
    """A small language model whose logits are a large part of the peak: the loop's handling of them shows."""

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mix, self.head = torch.nn.Embedding(8000, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 8000)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.mix(self.emb(tokens))))

    return Workload(
        name="plan-lm", model=LM,
        batch=lambda n: (torch.randint(0, 8000, (n, 256)), torch.randint(0, 8000, (n, 256))),
        loss=lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b[1].flatten()),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=16,
    )


@pytest.mark.gpu
def test_gpu_trainstep_runs_the_loop_the_plan_predicted():
    """The plan estimates the loss-only loop TrainStep runs: its measured peak matches that estimate, not the
    plain loop's (which keeps 16 x 256 x 8000 fp32 logits more through backward)."""
    from memfit._torch_private import clear_cublas_workspaces
    from memfit.estimate.gpus import detect_gpu

    w = _lm()
    p = plan(w, budget_bytes=64 << 30, gpu=detect_gpu(), calibration="roofline")
    c = p.chosen.config
    assert (c.micro_batch, c.accumulation_steps) == (16, 1)
    device = torch.device("cuda", torch.cuda.current_device())
    # the estimate counts the cuBLAS workspaces the step's first matmuls allocate (2 x 32 MiB on an H200); earlier
    # tests in this process left theirs in `base`, out of the measured peak: free them, as a fresh process has none
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.device(device):
        model = w.model()
        step = p.apply(model, w.optimizer(model.parameters()), w.loss)
        batch = w.make_batch(16)
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    predicted = estimate(w.replace(keep_output=False, **c.changes()), gpu=detect_gpu())
    plain = estimate(w.replace(**c.changes()), gpu=detect_gpu())
    assert abs(measured / predicted.peak_allocated_bytes - 1) < 0.03, (measured, predicted.peak_allocated_bytes)
    assert plain.peak_allocated_bytes - predicted.peak_allocated_bytes >= 16 * 256 * 8000 * 4
