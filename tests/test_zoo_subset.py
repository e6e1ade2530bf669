"""A CPU-sized subset of the zoo (benchmarks/zoo/): plain-torch steps that must trace and give sane numbers, and
one step per known failure class, marked ``xfail(strict=True)`` with the class's name so that a fix flips it.

The whole zoo (122+ steps over timm, transformers, torchvision, MONAI, smp, nnU-Net, peft) is run by
``benchmarks/trace_coverage.py``; this file keeps the torch-only part in the test suite (about 30 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memfit import estimate
from memfit.workload.loading import load_workload

ZOO = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo"
sys.path.insert(0, str(ZOO))
sys.path.insert(0, str(ZOO.parent))

import registry  # noqa: E402
from trace_coverage import classify  # noqa: E402

GIB = 2**30


def _estimate(name: str):  # noqa: ANN202
    return estimate(load_workload(f"{ZOO / 'torch_features.py'}:{name}"), gpu="h100")


def test_registry_lists_the_zoo_without_importing_model_libraries() -> None:
    entries = registry.entries()
    assert len(entries) >= 80
    assert len({e.name for e in entries}) == len(entries)
    libraries = {e.library for e in entries}
    assert {"timm", "transformers", "torchvision", "monai", "segmentation_models_pytorch",
            "dynamic_network_architectures", "peft", "torch"} <= libraries
    issue13 = {e.name for e in registry.entries(family="issue13")}
    assert issue13 == {"smp_unet_r34_issue13", "monai_swin_unetr_issue13", "lstm_lm_issue13",
                       "gru_bidir_1000_issue13"}


# optimizer state per parameter byte: Adam keeps two moments, SGD with momentum one buffer
TRACES = [
    ("lstm_lm_issue13", 2),
    ("tcn_dilated_fp16", 2),
    ("mlp_fused_adamw", 2),
    ("checkpoint_reentrant", 2),
    ("mlp_forloop_sgd_accum4", 1),
]


@pytest.mark.parametrize(("name", "states"), TRACES)
def test_zoo_step_traces_with_sane_numbers(name: str, states: int) -> None:
    est = _estimate(name)
    # params + grads + optimizer state are alive together during the optimizer step (fp32 master weights)
    floor = est.param_count * 4 * (2 + states)
    assert floor <= est.peak_allocated_bytes < 80 * GIB
    assert est.peak_allocated_bytes <= est.peak_reserved_bytes
    assert est.peak_allocated_bytes <= est.fits_in_bytes <= est.peak_reserved_bytes * 1.1


def test_lstm_lm_holds_its_flattened_logits() -> None:
    est = _estimate("lstm_lm_issue13")
    logits = 64 * 256 * 10000 * 4  # (64*256, 10000) fp32 logits, alive from the head to the loss's backward
    states = est.param_count * 4 * 4
    assert est.peak_allocated_bytes >= states + logits


def test_value_dependent_branch_takes_the_branch_real_data_takes_and_says_so() -> None:
    est = _estimate("value_dependent_branch")  # `if x.abs().sum() > 0:` is true for real data: the big branch
    assert any(m.startswith("a.") for m in est.activations_by_module)
    assert not any(m.startswith("b.") for m in est.activations_by_module)
    assert any("branches on tensor values" in w for w in est.warnings)
    assert "value_branch" in {u.reason for u in est.uncertainty}


# one plain-torch reproducer per failure class (benchmarks/results/estimate/trace_coverage_*.md lists the library
# entries of each class); strict: when memfit learns to trace one, the test fails until the mark is removed
FAILURES: list[tuple[str, str, str]] = []


# classes that used to fail and trace now; the detectors whose sizes come from the model's values (one real CPU
# forward, tens of seconds) are left to benchmarks/trace_coverage.py
FIXED = [
    ("boolean_mask_loss", "sizes from the labels' values took a real CPU step of the transformer (85 s)"),
    ("packed_lstm_lengths_tensor", "pack_padded_sequence timed out (a real CPU step over 5 minutes)"),
    ("frozen_embedding_head", "a hook registered on a parameter with requires_grad=False"),
    ("dice_dims_from_tensor", "torch.arange(2, ndim).tolist() read zeros, so the dims repeated"),
    ("sparse_skipgram_sparseadam", "nbytes of a sparse gradient"),
    ("module_to_after_build", "Module.to() in the factory could not swap fake parameters (peft's LoRA)"),
    ("grouped_mm_experts", "_grouped_mm's meta kernel refuses fp32, which CUDA runs"),
]


@pytest.mark.parametrize(("name", "was"), FIXED)
def test_zoo_step_of_a_fixed_failure_class_traces(name: str, was: str) -> None:
    est = _estimate(name)
    assert 0 < est.peak_allocated_bytes <= est.fits_in_bytes <= est.fits_in_upper_bytes, was


class KnownFailure(Exception):
    """The estimate failed with the error of its class (anything else is a real failure)."""


@pytest.mark.parametrize(("name", "failure_class"), [
    pytest.param(n, c, marks=pytest.mark.xfail(strict=True, raises=KnownFailure, reason=f"{c}: {why}"))
    for n, c, why in FAILURES])
def test_zoo_step_of_a_known_failure_class(name: str, failure_class: str) -> None:
    try:
        est = _estimate(name)
    except Exception as exc:
        # the error must still be of its class: a new failure on the way is a real failure, not an xfail
        assert classify(str(exc)) == failure_class, f"{name} now fails differently: {exc}"
        raise KnownFailure(str(exc)) from exc
    assert est.peak_allocated_bytes > 0
