"""The tracer's fake-tensor mode: C++ meta kernels where FakeTensorMode runs Python written for symbolic sizes."""

import pytest
import torch
import torch.nn.functional as F

from memfit._torch_private import FakeTensorMode, StaticShapeFakeTensorMode

aten = torch.ops.aten


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def _run(mode_cls: type, fn):  # noqa: ANN001, ANN202
    with mode_cls(allow_non_fake_inputs=True, allow_fallback_kernels=False):
        x = torch.empty(4, 6, 8, 10)
        return fn(x)


def _views(x: torch.Tensor) -> list[torch.Tensor]:
    t = x.permute(0, 2, 3, 1)  # a non-contiguous base
    return [
        x.view(4, 6, -1), x.view(-1), aten._unsafe_view(x, [24, 80]), t.reshape(4, 80, 6),
        x[:, 1:5], x[..., ::3], x[:, -2:], x[:, 9:], t[1:, :, 2:7:2], x.select(1, -1), t.select(3, 2), x[2],
        x.flatten(1).unflatten(1, (2, -1)),
    ]


def _decomposed(x: torch.Tensor) -> list[torch.Tensor]:
    w = torch.empty(10, 10, requires_grad=True)
    flat = x.reshape(-1, 10)
    ln, mean, rstd = aten.native_layer_norm(x, [10], w[0], w[1], 1e-5)
    grads = aten.native_layer_norm_backward(ln, x, [10], mean, rstd, w[0], w[1], [True, True, True])
    bn = aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    return [
        torch.addmm(w[0], flat, w), ln, mean, rstd, *grads, *bn, torch.empty(3, 5).uniform_(),
        aten.gelu_backward(x, x), aten._softmax_backward_data(x, x, 1, x.dtype), x[:, :1].squeeze(1),
        aten.slice_backward(x[:, 1:3], [4, 6, 8, 10], 1, 1, 3, 1), torch.arange(7),
        # dtype casts (_to_copy), with and without a device that is the same, keeping a permuted layout
        x.to(torch.bfloat16), aten._to_copy(x, dtype=torch.float16, device=torch.device("cpu")),
        x.to(memory_format=torch.channels_last), x.permute(0, 2, 3, 1).to(torch.bfloat16),
    ]


@pytest.mark.parametrize("ops", [_views, _decomposed], ids=["views", "decomposed"])
def test_outputs_match_fake_tensor_mode(ops):  # noqa: ANN001
    fast = [_meta(t) for t in _run(StaticShapeFakeTensorMode, ops)]
    slow = [_meta(t) for t in _run(FakeTensorMode, ops)]
    assert fast == slow


def test_views_share_their_base_storage():
    def views_and_base(x: torch.Tensor) -> list[bool]:
        return [v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in _views(x)]

    # reshape of the permuted base copies (not viewable), in both modes
    assert _run(StaticShapeFakeTensorMode, views_and_base) == _run(FakeTensorMode, views_and_base)


def test_a_view_that_cannot_be_taken_raises_as_in_eager():
    # eager raises RuntimeError (FakeTensorMode's Python rule a ValueError)
    x = torch.empty(4, 6, 8, 10)
    for bad, error in ((lambda x: x.permute(0, 2, 3, 1).view(-1), RuntimeError), (lambda x: x.select(1, 6), IndexError)):
        with pytest.raises(error):
            bad(x)
        with pytest.raises(error):
            _run(StaticShapeFakeTensorMode, bad)


def test_batch_norm_keeps_float32_statistics_for_bf16_input_like_cuda():
    # batch_norm_cuda allocates save_mean/save_invstd in the accumulate type (float32 for bf16); the CPU branch of
    # torch._decomp's decomposition, which FakeTensorMode takes for CPU fake tensors, casts them to bf16
    def stats(x: torch.Tensor) -> list[torch.dtype]:
        out = aten.native_batch_norm(x.bfloat16(), None, None, None, None, True, 0.1, 1e-5)
        return [t.dtype for t in out]

    assert _run(StaticShapeFakeTensorMode, stats) == [torch.bfloat16, torch.float32, torch.float32]


def test_the_two_modes_never_read_each_others_cached_outputs():
    # FakeTensorMode caches outputs in one class-wide dict; batch norm's statistics differ between the two modes
    def stats(x: torch.Tensor) -> list[torch.dtype]:
        return [t.dtype for t in aten.native_batch_norm(x.bfloat16(), None, None, None, None, True, 0.1, 1e-5)]

    theirs = _run(FakeTensorMode, stats)
    ours = _run(StaticShapeFakeTensorMode, stats)
    assert theirs[1] == torch.bfloat16 and ours[1] == torch.float32
    assert _run(FakeTensorMode, stats) == theirs and _run(StaticShapeFakeTensorMode, stats) == ours


@pytest.mark.gpu
def test_batch_norm_statistics_dtype_matches_cuda():
    x = torch.randn(2, 6, 5, 5, device="cuda", dtype=torch.bfloat16)
    real = [t.dtype for t in aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)]
    assert real == _run(StaticShapeFakeTensorMode, lambda x: [
        t.dtype for t in aten.native_batch_norm(x.bfloat16(), None, None, None, None, True, 0.1, 1e-5)
    ])


def test_in_a_trace_a_layer_norm_model_is_traced_the_same(monkeypatch):  # noqa: ANN001
    from memfit import Workload
    from memfit import _torch_private as tp
    from memfit.estimate.gpus import gpu_spec
    from memfit.estimate.trace import trace_workload

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(self.norm(x)).view(8, 4, 8, 64)[:, 1:3].reshape(8, 16, 64)
            return F.gelu(h).select(1, 0)

    work = Workload(name="block", model=Block, batch=lambda n: (torch.randn(n, 32, 64),),
                    loss=lambda out, b: out.float().mean(), optimizer=lambda p: torch.optim.AdamW(p),
                    batch_size=8, precision="fp32")

    def events(mode_cls: type) -> tuple:
        monkeypatch.setattr(tp, "StaticShapeFakeTensorMode", mode_cls)
        tr = trace_workload(work, gpu_spec("h100"))
        return tr.ops, tr.keys, [(a.nbytes, a.op, a.module, a.phase, a.shape, a.dtype) for a in tr.allocs]

    assert events(StaticShapeFakeTensorMode) == events(FakeTensorMode)


def test_the_dispatch_cache_tells_apart_inputs_that_differ_in_one_attribute():
    # StaticShapeFakeTensorMode keys its dispatch cache on a tuple of its own: each pair runs one op on two inputs
    # that differ in one attribute only (their storages of one size), the first filling the cache; a key blind to
    # that attribute would hand the second the first's cached output (wrong strides, offset, dtype, conj, neg)
    def outputs(x: torch.Tensor) -> list[tuple]:
        pairs = [
            (torch.empty(6, 8), torch.empty(8, 6).t(), lambda t: t.exp()),  # strides
            (torch.empty(6, 8)[:5], torch.empty(6, 8)[1:], lambda t: aten.view(t, [40])),  # storage offset
            (torch.empty(6, 8), torch.empty(12, 8, dtype=torch.float16)[:6], lambda t: t.exp()),  # dtype
            (torch.empty(6, 8, dtype=torch.complex64), torch.empty(6, 8, dtype=torch.complex64).conj(),
             lambda t: aten.view(t, [48])),  # conjugate bit
            (torch.empty(6, 8), torch._neg_view(torch.empty(6, 8)), lambda t: aten.view(t, [48])),  # negative bit
        ]
        got = []
        for first, second, op in pairs:
            for t in (first, second):
                out = op(t)
                got.append((*_meta(out), out.is_conj(), out.is_neg()))
        return got

    ours = _run(StaticShapeFakeTensorMode, outputs)
    assert ours == _run(FakeTensorMode, outputs)
    assert ours == outputs(torch.empty(0))  # and eager's, on real tensors


# Tensors that are contiguous and channels-last at once: a globally pooled channels-last feature map (N, C, 1, 1)
# and a one-channel image made channels-last (N, 1, H, W); then plain layouts, which must stay as they were.
_LAYOUTS = {
    "pooled": lambda: torch.randn(8, 1, 1, 32).permute(0, 3, 1, 2),
    "one_channel": lambda: torch.randn(4, 6, 5, 1).permute(0, 3, 1, 2),
    "pooled_3d": lambda: torch.randn(2, 1, 1, 1, 16).permute(0, 4, 1, 2, 3),
    "channels_last": lambda: torch.randn(4, 6, 5, 16).permute(0, 3, 1, 2),
    "permuted": lambda: torch.randn(6, 4, 5, 16).permute(1, 3, 2, 0),
    "contiguous": lambda: torch.randn(4, 16, 6, 5),
}
_POINTWISE = {
    "relu": torch.relu, "relu6": F.relu6, "sigmoid": torch.sigmoid, "gelu": F.gelu, "silu": F.silu,
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu, "mish": F.mish, "softplus": F.softplus, "tanh": torch.tanh, "clamp": lambda x: x.clamp(0, 6),
    "pow": lambda x: x**2, "times_two": lambda x: x * 2, "plus_one": lambda x: x + 1, "half": lambda x: x / 2,
    "square": lambda x: x * x,
    "scale": lambda x: x * torch.ones(1, x.shape[1], *[1] * (x.dim() - 2), device=x.device),
    "where": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "prelu": lambda x: F.prelu(x, torch.full((1,), 0.25, device=x.device)),
}


def _strides(fn, x: torch.Tensor) -> tuple:  # noqa: ANN001
    x = x.detach().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    return out.stride(), grad.stride()


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_pointwise_outputs_and_their_gradients_are_laid_out_as_in_eager(layout: str) -> None:
    # eager TensorIterator gives most of these contiguous outputs on an ambiguous input and keeps the input's strides
    # for the rest (a wrapped scalar operand, hardtanh); the fake kernels kept the input's strides for all of them
    eager = {name: _strides(fn, _LAYOUTS[layout]()) for name, fn in _POINTWISE.items()}
    with StaticShapeFakeTensorMode(allow_non_fake_inputs=True):
        x = _LAYOUTS[layout]()
        fake = {name: _strides(fn, x) for name, fn in _POINTWISE.items()}
    assert fake == eager


def test_a_pooled_branch_after_relu_is_upsampled_and_concatenated_as_on_the_gpu() -> None:
    # UperNet's pyramid pooling: the 1 x 1 branch of a channels-last map, after its ReLU, is upsampled and
    # concatenated NCHW on an H200 (benchmarks/results/estimate/psp_layouts_h200_torch2.11_20261129_s32.txt)
    with StaticShapeFakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(8, 16, 16, 768).permute(0, 3, 1, 2)
        branch = torch.relu(F.adaptive_avg_pool2d(x, 1))
        up = F.interpolate(branch, size=(16, 16), mode="bilinear", align_corners=False)
        assert branch.stride() == (768, 1, 1, 1)
        assert up.is_contiguous()
        assert torch.cat([x, up], dim=1).is_contiguous()


@pytest.mark.parametrize(("layout", "output", "gradient"), [
    # what an H200 gave (benchmarks/results/tests/gpu_tests_layouts_h200_torch2.11_20261129_s33{,_r2}.log): the
    # output and mask strided as the input, the gradient in the format the gradient suggests
    ("pooled", (32, 1, 32, 32), (32, 1, 32, 32)),
    ("one_channel", (30, 1, 5, 1), (30, 1, 5, 1)),
    ("pooled_3d", (16, 1, 16, 16, 16), (16, 1, 16, 16, 16)),
    ("permuted", (80, 1, 16, 320), (480, 30, 6, 1)),
])
def test_dropout_in_a_trace_is_laid_out_as_cudas_kernels(layout: str, output: tuple, gradient: tuple) -> None:
    from memfit.estimate.cuda_emulation import CudaSemantics

    with StaticShapeFakeTensorMode(allow_non_fake_inputs=True), CudaSemantics():
        assert _strides(lambda x: F.dropout(x, 0.1, True), _LAYOUTS[layout]()) == (output, gradient)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_pointwise_layouts_in_a_trace_are_cudas(layout: str) -> None:
    # the same ops as the CPU test, and dropout (CUDA's fused kernel, not the CPU's composite), against CUDA
    from memfit.estimate.cuda_emulation import CudaSemantics

    ops = {**_POINTWISE, "dropout": lambda x: F.dropout(x, 0.1, True)}
    cuda = {name: _strides(fn, _LAYOUTS[layout]().cuda()) for name, fn in ops.items()}
    with StaticShapeFakeTensorMode(allow_non_fake_inputs=True), CudaSemantics():
        x = _LAYOUTS[layout]()
        fake = {name: _strides(fn, x) for name, fn in ops.items()}
    assert fake == cuda
