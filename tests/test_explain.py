"""explain(): the diagnosis names the real cause, and every fix is exactly the estimate of the changed workload."""

import json

import pytest
import torch

from memfit import estimate
from memfit.estimate.allocator import AllocatorConfig
from memfit.explain.explanation import explain
from memfit.plan.patch import patch_ladder
from memfit.plan.search import DEFAULT_MARGIN
from memfit.workload.models import CausalLM, UNet
from memfit.workload.spec import Workload
from memfit.workload.zoo import builtin_workload


def small_unet(batch_size: int = 4) -> Workload:
    return Workload(
        name="small-unet",
        model=lambda: UNet(dims=2, in_channels=3, classes=2, features=(8, 16, 32), norm="batch",
                           deep_supervision=False),
        batch=lambda n: (torch.randn(n, 3, 128, 128), torch.randint(0, 2, (n, 128, 128))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        batch_size=batch_size,
    )


@pytest.fixture(scope="module")
def unet_explained():
    return explain(small_unet())


def test_activations_dominate_a_unet_and_scale_per_pixel(unet_explained):
    e = unet_explained
    assert e.parts[0].category == "activations"
    assert "activations" in e.headline and e.blocks[0].name in e.headline
    assert e.estimate.peak_phase in ("forward", "loss", "backward")
    s = e.scaling
    assert s.input_unit == "pixel" and s.elements_per_sample == 128 * 128 and s.input_shape == (3, 128, 128)
    assert s.per_sample_bytes > 0 and s.bytes_per_element == pytest.approx(s.per_sample_bytes / 128**2)


def test_every_fix_is_the_estimate_of_the_changed_workload(unet_explained):
    e = unet_explained
    knobs = {f.knob for f in e.fixes + e.not_helping}
    assert {"micro_batch", "precision", "checkpointing", "optimizer", "expandable_segments"} <= knobs
    w = small_unet()
    for fix in e.fixes + e.not_helping:
        allocator = AllocatorConfig(expandable_segments=True) if fix.allocator else None
        again = estimate(w.replace(**fix.changes), allocator=allocator)
        assert (again.fits_in_bytes, again.peak_allocated_bytes) == (fix.fits_in_bytes, fix.peak_allocated_bytes)
        assert fix.saving_bytes == e.estimate.fits_in_bytes - fix.fits_in_bytes
    assert [f.saving_bytes for f in e.fixes] == sorted((f.saving_bytes for f in e.fixes), reverse=True)
    assert all(f.saving_bytes > 0 for f in e.fixes) and all(f.saving_bytes <= 0 for f in e.not_helping)


def test_micro_batch_keeps_the_effective_batch_and_flags_batchnorm(unet_explained):
    micro = [f for f in unet_explained.fixes + unet_explained.not_helping if f.knob == "micro_batch"]
    assert micro and all(f.changes["batch_size"] * f.changes["accumulation_steps"] == 4 for f in micro)
    assert micro[0].changes_training == "semantics" and "BatchNorm" in micro[0].caveat


def test_budget_that_binds_gets_a_fix_or_a_combination_that_fits():
    base = estimate(small_unet())
    budget = base.device_bytes - (base.fits_in_bytes - base.breakdown["params"]) // 2  # half the non-weight memory
    e = explain(small_unet(), budget_bytes=budget)
    assert e.fits_budget is False
    fitting = [f for f in e.fixes if f.fits_budget] + ([e.combination] if e.combination else [])
    assert fitting and all(f.device_bytes <= budget for f in fitting)


def test_patch_fix_is_the_largest_patch_on_the_ladder_that_fits_the_budget():
    w = small_unet(batch_size=2).replace(
        batch=lambda n, patch: (torch.randn(n, 3, *patch), torch.randint(0, 2, (n, *patch))),
        patch_size=(384, 256), patch_multiple=(4, 4),
    )
    big = estimate(w)
    budget = big.device_upper_bytes - big.fits_in_upper_bytes + int(big.fits_in_upper_bytes * 0.7)
    fix = next(f for f in explain(w, budget_bytes=budget).fixes if f.knob == "patch")
    patch = tuple(fix.changes["patch_size"])
    ladder = patch_ladder((384, 256), (4, 4))
    assert fix.fits_budget and patch in ladder and patch != (384, 256)
    # the next larger rung is predicted not to fit (its upper bound, with plan's margin): no needlessly small patch
    assert estimate(w.replace(patch_size=ladder[ladder.index(patch) - 1])).device_upper_bytes > budget * (1 - DEFAULT_MARGIN)
    # without a budget: the first rung with at most half the voxels
    half = next(f for f in explain(w).fixes if f.knob == "patch").changes["patch_size"]
    assert tuple(half) == next(p for p in ladder if p[0] * p[1] <= 384 * 256 / 2)


def test_impossible_budget_says_what_the_model_state_needs():
    e = explain(builtin_workload("mlp").replace(batch_size=8), budget_bytes=900 << 20)
    assert e.fits_budget is False and e.combination is None
    assert any("Nothing tried fits" in n and "optimizer state" in n for n in e.notes)


def test_peak_in_the_first_optimizer_step_is_named():
    e = explain(builtin_workload("mlp").replace(batch_size=8), fixes=False)
    assert e.estimate.peak_phase == "optimizer" and e.estimate.peak_step == 0
    assert "first iteration" in e.peak_when
    # Adam's foreach temporaries on grads + state: every step reaches the first one's peak again
    assert "every later step" in e.peak_when and "temporaries" in e.peak_why


def test_explanation_is_json(unet_explained):
    d = json.loads(unet_explained.to_json())
    assert d["schema"] == 1 and d["fixes"] and d["estimate"]["fits_in_bytes"] == unet_explained.estimate.fits_in_bytes


@pytest.mark.gpu
def test_gpu_top_fix_measured_within_the_estimators_bound():
    """On a real GPU: the top fix's measured peak allocated is within 5 % of its prediction."""
    from memfit.estimate.gpus import detect_gpu
    from memfit.estimate.measure import run_trial

    e = explain(builtin_workload("unet2d"), gpu=detect_gpu())
    top = next(f for f in e.fixes if not f.allocator)
    trial = run_trial("unet2d", changes={k: list(v) if isinstance(v, tuple) else v for k, v in top.changes.items()})
    assert trial.ok, trial.error
    assert abs(top.peak_allocated_bytes - trial.peak_allocated_bytes) <= 0.05 * trial.peak_allocated_bytes


def _causal_lm(vocab: int) -> Workload:
    """One decoder layer over 8192 tokens; with vocab 32000 its logits are most of the step's memory."""
    return Workload(
        name=f"lm-{vocab}",
        model=lambda: CausalLM(vocab=vocab, seq_len=8192, dim=128, layers=1, heads=2),
        batch=lambda n: {"input_ids": torch.randint(0, vocab, (n, 8192)), "labels": torch.randint(0, vocab, (n, 8192))},
        loss=lambda out, batch: out.loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        batch_size=1,  # no micro-batch fixes to estimate: keeps the test fast
        precision="bf16",
        keep_output=False,
    )


def test_large_vocabulary_logits_are_named_and_the_chunked_loss_is_offered():
    w = _causal_lm(32_000)
    e = explain(w)
    assert e.notes[0].startswith("The logits dominate the peak") and "8192 × 32000" in e.notes[0]
    fix = next(f for f in e.fixes if f.knob == "loss")
    assert fix.changes == {"loss_impl": "chunked"}
    chunked = estimate(w.replace(loss_impl="chunked"))
    assert fix.device_upper_bytes == chunked.device_upper_bytes
    # the logits (three 8192 × 32000 fp32 tensors at the backward peak, 3 GiB) were most of the step
    assert fix.saving_bytes > 0.5 * e.estimate.fits_in_bytes
    assert e.fixes[0] is fix  # the largest saving here


def test_small_vocabulary_gets_no_logits_note_and_no_chunked_loss():
    e = explain(_causal_lm(256))  # byte-level: 8192 × 256 logits are a few MiB next to the cuBLAS workspaces
    assert not any("logits" in n for n in e.notes)
    assert not any(f.knob == "loss" for f in [*e.fixes, *e.not_helping])


def test_logits_are_named_below_32k_when_they_hold_a_quarter_of_the_peak():
    e = explain(_causal_lm(1000), fixes=False)  # 3 × 8192 × 1000 fp32 = 96 MiB, over 40 % of the peak
    assert e.notes[0].startswith("The logits dominate the peak: 3 tensors of 8192 × 1000")
