"""``estimate()`` against ``measure()`` of the same protocol on the local GPU.

Marked ``gpu``: skipped on CPU machines (tests/conftest.py), run on the device machine with ``pytest -m gpu``.
Each case runs the cap bisection of ``measure`` (a fresh process per try), a few minutes per case.
"""

import math
from typing import Any

import pytest
import torch

from memfit import Workload, estimate, measure
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


def _language_model(keep_output: bool) -> Workload:
    """Logits of 8 × 128 × 5000 fp32 (20 480 000 bytes), larger than everything else the step holds at once."""
    return Workload(
        name="lm",
        model=lambda: torch.nn.Sequential(torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 5000)),
        batch=lambda n: (torch.randint(0, 1000, (n, 128)), torch.randint(0, 5000, (n, 128))),
        loss=lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b[1].flatten()),
        optimizer=lambda p: torch.optim.Adam(p),
        batch_size=8,
        keep_output=keep_output,
    )


def test_the_plain_loop_keeps_the_logits_on_top_of_the_backward_peak():
    logits = 8 * 128 * 5000 * 4
    plain, loss_only = estimate(_language_model(True)), estimate(_language_model(False))
    assert plain.peak_phase == loss_only.peak_phase == "backward"
    assert logits <= plain.peak_allocated_bytes - loss_only.peak_allocated_bytes <= logits + (1 << 20)
    assert plain.keep_output and not loss_only.keep_output


def test_the_upper_bound_is_the_base_margin_when_the_trace_relied_on_nothing():
    from memfit.estimate.bound import BASE_MARGIN, BASE_SLACK_BYTES

    est = estimate(_language_model(False))
    assert est.uncertainty == []
    base = est.fits_in_replay_bytes * (1 + BASE_MARGIN) + BASE_SLACK_BYTES
    assert base <= est.fits_in_upper_bytes < base + (2 << 20)  # one segment
    assert est.device_upper_bytes - est.fits_in_upper_bytes == est.device_bytes - est.fits_in_bytes  # the context


class _ReadsAValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(64, 64, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        scale = float(out.abs().max())  # a value the fake tensors do not have
        return out * scale


def test_each_reason_widens_the_bound_and_is_named():
    from memfit.estimate.bound import BASE_MARGIN, BASE_SLACK_BYTES, WIDTHS

    w = Workload(model=_ReadsAValue, batch=lambda n: (torch.randn(n, 100, 64),),
                 loss=lambda out, b: out.mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=16)
    est = estimate(w)
    reasons = {u.reason: u for u in est.uncertainty}
    assert set(reasons) == {"rnn_kernel", "value_read"}
    assert reasons["rnn_kernel"].detail.startswith("rnn (LSTM)")
    assert "test_estimate.py:" in reasons["value_read"].detail and "in forward" in reasons["value_read"].detail
    widen = BASE_MARGIN + WIDTHS["rnn_kernel"] + WIDTHS["value_read"]
    low = est.fits_in_replay_bytes * (1 + widen) + BASE_SLACK_BYTES
    assert low <= est.fits_in_upper_bytes < low + (2 << 20)


def test_fits_is_decided_with_the_upper_bound():
    est = estimate(_language_model(True))
    between = (est.device_bytes + est.device_upper_bytes) // 2
    assert est.device_bytes < between < est.device_upper_bytes
    assert not est.fits(between) and est.margin_bytes(between) < 0
    assert est.fits(est.device_upper_bytes) and est.margin_bytes(est.device_upper_bytes) == 0


@pytest.mark.parametrize(("cin", "cout"), [(40, 240), (64, 256)])
def test_an_erratic_cudnn_workspace_widens_the_bound_by_its_bytes(cin: int, cout: int):
    # a half-precision 1x1 convolution with channel counts not multiples of 32, from 28 x 28 up at batch <= 16:
    # cuDNN's filter-gradient workspace was erratic on the H200 grid, so the bound adds the larger choice's bytes
    from memfit.estimate.bound import BASE_MARGIN, BASE_SLACK_BYTES
    from memfit.estimate.workspaces import pointwise_half_unsure_bytes

    w = Workload(model=lambda: torch.nn.Conv2d(cin, cout, 1), batch=lambda n: (torch.randn(n, cin, 64, 64),),
                 loss=lambda out, b: out.float().square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                 batch_size=2, precision="fp16")
    est = estimate(w, gpu="h200")
    reasons = {u.reason: u for u in est.uncertainty}
    extra = pointwise_half_unsure_bytes((2, cin, 64, 64), (cout, cin, 1, 1), (2, cout, 64, 64), itemsize=2,
                                        stride=(1, 1))
    low = est.fits_in_replay_bytes * (1 + BASE_MARGIN) + BASE_SLACK_BYTES
    if cin % 32:
        assert extra > 0 and reasons["conv_workspace_erratic"].bytes == extra
        assert f"{cin} -> {cout}" in reasons["conv_workspace_erratic"].detail
        assert low + extra <= est.fits_in_upper_bytes < low + extra + (2 << 20)
    else:
        assert extra == 0 and "conv_workspace_erratic" not in reasons
        assert low <= est.fits_in_upper_bytes < low + (2 << 20)


def _masked_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out[batch[1] > 0].square().mean()  # boolean-mask indexing: the size depends on the data


def test_sizes_that_depend_on_data_come_from_the_values_of_one_real_batch():
    w = Workload(model=lambda: torch.nn.Linear(256, 256), batch=lambda n: (torch.randn(n, 256), torch.randn(n, 256)),
                 loss=_masked_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=64)
    est = estimate(w)
    reasons = {u.reason: u.detail for u in est.uncertainty}
    assert "test_estimate.py" in reasons["data_dependent_shape"] and "index" in reasons["data_dependent_shape"]
    assert any("the values of one random batch" in w for w in est.warnings)
    # the selection is as large as the real data made it: about half of the 64 x 256 fp32 elements
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload

    selected = [a.nbytes for a in trace_workload(w, gpu_spec("h100")).allocs if a.op == "index"]
    assert selected and all(0.3 * 64 * 256 * 4 < n < 0.7 * 64 * 256 * 4 for n in selected)


def _truncated_normal_linear() -> torch.nn.Module:
    layer = torch.nn.Linear(64, 64)
    torch.nn.init.trunc_normal_(layer.weight, std=0.02)  # its rejection loop asks `mask.any()` of fake values
    return layer


def test_an_initializers_conditions_on_values_neither_warn_nor_widen():
    w = Workload(model=_truncated_normal_linear, batch=lambda n: (torch.randn(n, 64),),
                 loss=lambda out, b: out.mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=8)
    est = estimate(w)
    assert est.uncertainty == [] and not est.warnings


def test_a_compiled_model_is_named_and_estimated_as_eager():
    w = Workload(model=lambda: torch.compile(torch.nn.Linear(64, 64)), batch=lambda n: (torch.randn(n, 64),),
                 loss=lambda out, b: out.mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=8)
    est = estimate(w)
    assert any("torch.compile" in m for m in est.warnings)
    assert [(u.reason, u.widen) for u in est.uncertainty] == [("compiled", 0.0)]  # named, and no wider


def test_sparse_gradients_widen_the_bound_and_say_so():
    # coalescing a sparse gradient keeps as many rows as the indices have distinct values: the trace cannot know
    w = Workload(model=lambda: torch.nn.EmbeddingBag(100_000, 64, mode="sum", sparse=True),
                 batch=lambda n: (torch.randint(0, 100_000, (n, 4)),), loss=lambda out, b: out.float().mean(),
                 optimizer=lambda p: torch.optim.SparseAdam(list(p), lr=0.1), batch_size=8)
    est = estimate(w)
    reasons = {u.reason: u for u in est.uncertainty}
    assert "sparse_data" in reasons and reasons["sparse_data"].widen > 0
    assert est.fits_in_upper_bytes >= est.fits_in_replay_bytes * (1 + reasons["sparse_data"].widen)


def _blocks(conv: bool) -> torch.nn.Module:
    if conv:
        block = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(8, 8, 3, padding=1))
        return torch.nn.Sequential(block, torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 4))
    block = torch.nn.Sequential(torch.nn.Linear(3 * 16 * 16, 64), torch.nn.ReLU())
    return torch.nn.Sequential(torch.nn.Flatten(), block, torch.nn.Linear(64, 4))


@pytest.mark.parametrize("conv", [True, False])
def test_reentrant_checkpointing_of_convolutions_widens_the_bound(conv: bool):
    # measured: a nested backward over convolutions needed 12 % more than the trace (3-D U-Net, H100); transformer
    # and linear blocks were exact, and full checkpointing of the same convolutions too
    from memfit.estimate.bound import WIDTHS

    def workload(mode: str) -> Workload:
        return Workload(model=lambda: _blocks(conv), batch=lambda n: (torch.randn(n, 3, 16, 16), torch.randn(n, 4)),
                        loss=lambda out, b: (out - b[1]).square().mean(),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4,
                        checkpoint=("1",) if not conv else ("0",), checkpoint_mode=mode)

    reentrant, full = estimate(workload("reentrant")), estimate(workload("full"))
    reasons = {u.reason: u for u in reentrant.uncertainty}
    assert ("reentrant_checkpoint" in reasons) == conv and not full.uncertainty
    if conv:
        assert reasons["reentrant_checkpoint"].widen == WIDTHS["reentrant_checkpoint"] > 0
        assert "0" in reasons["reentrant_checkpoint"].detail


def _conv_step() -> Workload:
    """A one-convolution step: what the process-wide cuDNN settings act on."""
    return Workload(model=lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(),
                                                      torch.nn.Linear(8 * 14 * 14, 4)),
                    batch=lambda n: (torch.randn(n, 3, 16, 16), torch.randn(n, 4)),
                    loss=lambda out, b: (out - b[1]).square().mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)


def test_cudnn_benchmark_mode_is_named_where_the_step_has_convolutions(monkeypatch: pytest.MonkeyPatch):
    # its algorithm search takes what memory is free (max_memory_allocated reads far more), then the step runs within
    # the cap it needs: on 14 steps measured with it on, fits_in was above that cap, so the bound is named, not widened
    conv = _conv_step()
    mlp = builtin_workload("mlp").replace(batch_size=4)
    plain = estimate(conv)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    searched = estimate(conv)
    reasons = {u.reason: u for u in searched.uncertainty}
    assert "cudnn_benchmark" in reasons and reasons["cudnn_benchmark"].widen == 0
    assert "max_memory_allocated" in reasons["cudnn_benchmark"].detail and "0" in reasons["cudnn_benchmark"].detail
    assert searched.fits_in_upper_bytes == plain.fits_in_upper_bytes and not plain.uncertainty
    assert "cudnn_benchmark" not in {u.reason for u in estimate(mlp).uncertainty}  # no convolution: nothing to say


@pytest.mark.parametrize("flag", ["cudnn", "algorithms"])
def test_deterministic_algorithms_are_named_in_a_step_with_convolutions(monkeypatch: pytest.MonkeyPatch, flag: str):
    # measured (H200): cuDNN's deterministic algorithms' workspaces moved on 173 of 2818 grid shapes, and 52 steps run
    # so stayed within the bound; the caps the setting moved came from bilinear upsampling's decomposition, which the
    # trace takes
    conv = _conv_step()
    plain, mlp = estimate(conv), builtin_workload("mlp").replace(batch_size=4)
    if flag == "cudnn":
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        strict, strict_mlp = estimate(conv), estimate(mlp)
    finally:
        torch.use_deterministic_algorithms(False)
    reasons = {u.reason: u for u in strict.uncertainty}
    assert reasons["deterministic_algorithms"].widen == 0 and "upsampling" in reasons["deterministic_algorithms"].detail
    assert strict.fits_in_bytes == plain.fits_in_bytes  # a convolution alone runs the same
    assert strict.fits_in_upper_bytes == plain.fits_in_upper_bytes
    assert "deterministic_algorithms" not in {u.reason for u in strict_mlp.uncertainty}  # no convolution


_ROIS, _POOLED, _SAMPLING = 128, 7, 2


@torch.library.custom_op("memfit_test::roi_align", mutates_args=())
def _stand_in_roi_align(features: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int,
                        pooled_width: int, sampling_ratio: int, aligned: bool) -> torch.Tensor:
    """An op named and called as torchvision's roi_align (the trace knows ops by name; CI has no torchvision)."""
    return features[:1, :, :pooled_height, :pooled_width].expand(rois.shape[0], -1, -1, -1).clone()


@_stand_in_roi_align.register_fake
def _(features: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int, pooled_width: int,
      sampling_ratio: int, aligned: bool) -> torch.Tensor:
    return features.new_empty(rois.shape[0], features.shape[1], pooled_height, pooled_width)


@torch.library.custom_op("memfit_test::_roi_align_backward", mutates_args=())
def _stand_in_roi_align_backward(grad: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int,
                                 pooled_width: int, batch_size: int, channels: int, height: int, width: int,
                                 sampling_ratio: int, aligned: bool) -> torch.Tensor:
    return grad.new_zeros(batch_size, channels, height, width)


@_stand_in_roi_align_backward.register_fake
def _(grad: torch.Tensor, rois: torch.Tensor, spatial_scale: float, pooled_height: int, pooled_width: int,
      batch_size: int, channels: int, height: int, width: int, sampling_ratio: int, aligned: bool) -> torch.Tensor:
    return grad.new_empty(batch_size, channels, height, width)


def _roi_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.rois, ctx.shape, ctx.args = inputs[1], inputs[0].shape, inputs[2:]


def _roi_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    scale, ph, pw, sampling, aligned = ctx.args
    return (_stand_in_roi_align_backward(grad, ctx.rois, scale, ph, pw, *ctx.shape, sampling, aligned),
            None, None, None, None, None, None)


_stand_in_roi_align.register_autograd(_roi_backward, setup_context=_roi_setup)


class _RoiHead(torch.nn.Module):
    """A convolution, then RoIs pooled from its map, as a detector's box head pools them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 64, 3, padding=1)
        self.register_buffer("rois", torch.zeros(_ROIS, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _stand_in_roi_align(self.conv(x), self.rois, 1.0, _POOLED, _POOLED, _SAMPLING, False)


def _roi_step() -> Workload:
    return Workload(model=_RoiHead, batch=lambda n: (torch.randn(n, 3, 32, 32),),
                    loss=lambda out, b: out.square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    batch_size=2)


def test_roi_align_under_deterministic_algorithms_charges_its_compiled_backward():
    # torchvision runs roi_align through torch.compile on CUDA then: its backward takes four gradients of the
    # gathered samples and an index sort over them, 64.25 B a sample in fp32 (an H200 grid of single calls);
    # the bound adds 3.2 x the feature map in fp32
    from memfit.estimate.kernel_scratch import INDEX_SORT_BYTES

    plain = estimate(_roi_step())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        strict = estimate(_roi_step())
    finally:
        torch.use_deterministic_algorithms(False)
    assert "deterministic_roi_align" not in {u.reason for u in plain.uncertainty}
    reasons = {u.reason: u for u in strict.uncertainty}
    assert reasons["deterministic_roi_align"].widen == 0
    assert reasons["deterministic_roi_align"].bytes == math.ceil(3.2 * 2 * 64 * 32 * 32 * 4)
    samples = _ROIS * 64 * _POOLED * _POOLED * _SAMPLING ** 2
    blocks = samples * (INDEX_SORT_BYTES + 4 * 4)
    # on top of what is alive at the RoIs' backward, which is less than the plain step's peak
    assert blocks < strict.peak_allocated_bytes < blocks + plain.peak_allocated_bytes, (blocks, plain, strict)


def test_explain_names_roi_align_compiled_backward_at_the_peak():
    # the trace's name for those blocks (_roi_align_backward_scratch) is not the user's
    from memfit import explain

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        told = explain(_roi_step(), fixes=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert "torchvision's roi_align, which runs compiled under deterministic algorithms" in told.peak_when
    assert "_scratch" not in told.peak_when


def test_explain_offers_deterministic_algorithms_off_with_what_it_saves():
    # the compiled roi_align's blocks go with the setting; the process's setting is given back after
    from memfit import explain

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        told = explain(_roi_step(), budget_bytes=64 << 20)
        still_on = torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    off = next(f for f in told.fixes if f.knob == "deterministic")
    assert off.fits_in_bytes == estimate(_roi_step()).fits_in_bytes and off.saving_bytes > 100 << 20
    assert still_on
    assert not any(f.knob == "deterministic" for f in explain(_roi_step(), budget_bytes=64 << 20).fixes)
    assert told.combination is None or "deterministic" not in told.combination.name


def test_roi_align_gathers_every_point_of_the_map_with_an_adaptive_sampling_ratio():
    # torchvision/ops/roi_align.py: an adaptive ratio (<= 0) gathers over arange(height) x arange(width), masked
    from memfit.estimate.kernel_scratch import roi_align_samples

    assert roi_align_samples(10, 8, (7, 7), 2, (50, 60)) == 10 * 8 * 49 * 4
    assert roi_align_samples(10, 8, (7, 7), 0, (50, 60)) == roi_align_samples(10, 8, (7, 7), -1, (50, 60)) \
        == 10 * 8 * 49 * 50 * 60


def test_a_model_with_lazy_modules_estimates_as_its_plain_twin():
    # nn.LazyLinear & co. take their sizes from their first input; materialized, they are their plain twins
    from torch import nn

    def net(lazy: bool) -> nn.Module:
        return nn.Sequential(
            nn.LazyConv2d(16, 3) if lazy else nn.Conv2d(3, 16, 3),
            nn.LazyBatchNorm2d() if lazy else nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
            nn.LazyLinear(32) if lazy else nn.Linear(16 * 14 * 14, 32), nn.ReLU(), nn.Linear(32, 4))

    def step(lazy: bool) -> Workload:
        return Workload(model=lambda: net(lazy), batch=lambda n: (torch.randn(n, 3, 16, 16), torch.randn(n, 4)),
                        loss=lambda out, b: (out - b[1]).square().mean(),
                        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), batch_size=8)

    lazy, plain = estimate(step(True)), estimate(step(False))
    assert lazy.param_count == plain.param_count > 0
    for field in ("peak_allocated_bytes", "peak_reserved_bytes", "fits_in_bytes", "fits_in_upper_bytes",
                  "breakdown"):
        assert getattr(lazy, field) == getattr(plain, field), field


@pytest.mark.parametrize("backends", ["math", "efficient", "default"])
def test_attention_runs_the_kernels_the_user_left_on(backends: str):
    # torch.nn.attention.sdpa_kernel(SDPBackend.MATH) sends CUDA to the math path, which saves the B*H*L*L
    # probabilities that the fused kernels never make; the memory-efficient kernel alone saves what flash saves
    from torch import nn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"math": [SDPBackend.MATH], "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}

    class Attention(nn.Module):
        def __init__(self, kernels: list[SDPBackend] | None) -> None:
            super().__init__()
            self.qkv, self.kernels = nn.Linear(64, 192), kernels

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
            if self.kernels is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
            with sdpa_kernel(self.kernels):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def step(kernels: list[SDPBackend] | None) -> Workload:
        return Workload(model=lambda: Attention(kernels), batch=lambda n: (torch.randn(n, 512, 64), None),
                        loss=lambda out, b: out.float().square().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        batch_size=4, precision="bf16")

    fused = estimate(step(None)).peak_allocated_bytes
    picked = estimate(step(chosen.get(backends))).peak_allocated_bytes
    probabilities = 4 * 4 * 512 * 512 * 2  # B * H * L * L in bf16, saved for backward
    if backends == "math":
        assert picked >= fused + probabilities
    else:
        assert picked == fused


def test_the_replays_after_a_trace_keep_the_collector_off_old_objects(monkeypatch: pytest.MonkeyPatch):
    """A full garbage collection walks every object in the process (torch, the model's libraries): 0.5 s at a time
    on a 2-core CPU. The trace freezes what existed before it; the analysis and replays after it keep it frozen,
    and give it back as they found it."""
    import gc

    from memfit.estimate import allocator, predict
    from memfit.estimate.trace import trace_workload

    w = builtin_workload("mlp").replace(batch_size=8)
    trace = trace_workload(w, detect_gpu() or predict.gpu_spec(None))
    seen: list[int] = []
    real = predict.smallest_fitting_capacity

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "smallest_fitting_capacity", counting)
    est = estimate(w, gpu=detect_gpu() or predict.gpu_spec(None), reuse_trace=trace)
    # frozen while it replayed (beyond the 375 objects CPython 3.12 starts with frozen), unfrozen after
    assert len(seen) == 1 and seen[0] > 1000
    assert gc.get_freeze_count() == 0
    assert est.fits_in_replay_bytes == max(allocator.smallest_fitting_capacity(trace.events()), est.peak_allocated_bytes)


def test_the_bound_assumes_a_workspace_the_replay_let_fail_is_taken() -> None:
    """The replay lets a cuDNN workspace fail where memory is short (PyTorch tries another algorithm), so ``fits_in``
    may count on doing without it; the fallback may need one too, so the bound replays the step with every
    workspace taken and names the reason with the bytes it adds."""
    from memfit.estimate import predict
    from memfit.estimate.trace_record import Alloc, Trace

    mib = 1 << 20
    w = builtin_workload("mlp")
    # three tensors kept, then a 16 MiB workspace inside one call: with it skipped the blocks fit in 36 MiB, with it
    # taken (its own segment) in 52 MiB, both above the 42 MiB allocated with it
    def trace(optional: bool) -> Trace:
        made = Trace(phase_marks=[(0, "forward", 0), (0, "backward", 0)], cost_marks=[(0, "forward", 0)])
        for nbytes, soft in ((6 * mib, False), (4 * mib, False), (16 * mib, False), (16 * mib, optional)):
            made.allocs.append(Alloc(nbytes, "op", "", "backward", 0, (), "uint8", "workspaces", soft))
            made.ops.append(1)
            made.keys.append(len(made.allocs) - 1)
        made.ops.append(-1)
        made.keys.append(3)
        return made

    est = estimate(w, gpu=predict.gpu_spec("h200"), reuse_trace=trace(optional=True))
    assert est.fits_in_replay_bytes == 42 * mib
    reason = {u.reason: u for u in est.uncertainty}["workspace_fallback"]
    assert reason.widen == 0 and reason.bytes == 10 * mib and "10 MiB more" in reason.detail
    assert est.fits_in_upper_bytes >= 52 * mib > est.fits_in_bytes
    # a block the library cannot do without: nothing to assume
    assert "workspace_fallback" not in {u.reason for u in estimate(w, gpu="h200", reuse_trace=trace(False)).uncertainty}


def test_a_frozen_set_made_before_memfit_is_taken_over_and_a_later_one_left_alone(monkeypatch: pytest.MonkeyPatch):
    """CPython 3.12 starts with objects frozen: a trace must still freeze (else every full collection walks the whole
    process); a set a caller froze after importing memfit (a pre-fork server) stays as it is."""
    import gc

    from memfit.estimate import trace

    class Held:  # objects tracked by the collector, frozen below
        pass

    held = [Held() for _ in range(50)]
    gc.freeze()
    frozen = gc.get_freeze_count()
    assert frozen >= 50
    try:
        monkeypatch.setattr(trace, "INTERPRETER_FROZEN", frozen)  # as if the interpreter had started so
        with trace.OldObjectsFrozen():
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() == 0  # taken over: unfrozen with what the trace froze
        gc.freeze()
        monkeypatch.setattr(trace, "INTERPRETER_FROZEN", 0)  # frozen after memfit's import: the caller's own
        with trace.OldObjectsFrozen() as old:
            old.freeze(collect=False)
        assert gc.get_freeze_count() >= frozen  # left alone
    finally:
        gc.unfreeze()
    del held
