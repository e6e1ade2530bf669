"""``estimate()`` against ``measure()`` of the same protocol on the local GPU.

Marked ``gpu``: skipped on CPU machines (tests/conftest.py), run on the device machine with ``pytest -m gpu``.
Each case runs the cap bisection of ``measure`` (a fresh process per try), a few minutes per case.
"""

import pytest

from memfit import estimate, measure
from memfit.estimate.gpus import detect_gpu
from memfit.workload.zoo import builtin_workload

# Small built-ins that fit any 16 GB card: an MLP, a CNN with cuDNN workspaces, a bf16 transformer with SDPA.
CASES = [("mlp", 256), ("resnet50", 16), ("gpt2", 2)]
ALLOCATED_TOLERANCE = 0.05  # peak allocated within 5 % of the measured peak
FITS_IN_SHORTFALL = 0.02  # fits_in may sit above the measured smallest cap, but at most 2 % below it


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("name", "batch_size"), CASES)
def test_estimate_agrees_with_measurement_on_this_gpu(name: str, batch_size: int) -> None:
    gpu = detect_gpu()
    assert gpu is not None
    est = estimate(builtin_workload(name).replace(batch_size=batch_size), gpu=gpu)
    measured = measure(name, batch_size=batch_size, hint_bytes=est.fits_in_bytes)

    assert measured.fits_in_bytes is not None
    context = (f"{name} batch {batch_size} on {measured.gpu}: estimated {est.peak_allocated_bytes} allocated, "
               f"{est.fits_in_bytes} fits_in; measured {measured.peak_allocated_bytes}, {measured.fits_in_bytes}")
    assert est.peak_allocated_bytes == pytest.approx(measured.peak_allocated_bytes, rel=ALLOCATED_TOLERANCE), context
    assert est.fits_in_bytes >= (1 - FITS_IN_SHORTFALL) * measured.fits_in_bytes, context
