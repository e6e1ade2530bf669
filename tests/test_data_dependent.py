"""Value-dependent sizes (memfit.estimate.data_dependent): proven, decided by the batch's values, or taken from one
real forward; each a small CPU step whose sizes can be worked out by hand."""

import gc
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence

from memfit import Workload
from memfit._torch_private import StaticShapeFakeTensorMode
from memfit.estimate import trace as trace_module
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.recorder import BATCH_SEED
from memfit.estimate.trace import trace_workload
from memfit.estimate.values import KnownValues

GPU = gpu_spec("h100")
EXPERTS, TOKENS, TOP_K = 8, 512, 2


def _sgd(p):  # noqa: ANN001, ANN202
    return torch.optim.SGD(p, lr=0.1)


def _router_loss(minlength: int):  # noqa: ANN202
    def loss(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
        # a MoE load-balancing loss: how many tokens picked each expert
        picked = out.softmax(-1).topk(TOP_K, dim=-1).indices
        counts = torch.bincount(picked.reshape(-1), minlength=minlength).float()
        return (counts * out.mean(0)).sum()

    return loss


def _router(minlength: int) -> Workload:
    return Workload(model=lambda: torch.nn.Linear(64, EXPERTS), batch=lambda n: (torch.randn(n, 64),),
                    loss=_router_loss(minlength), optimizer=_sgd, batch_size=TOKENS)


def test_bincount_of_topk_indices_has_one_bin_per_expert_without_any_values():
    trace = trace_workload(_router(EXPERTS), GPU)
    assert "data_dependent_shape" not in trace.uncertain and not trace.warnings
    counts = [a for a in trace.allocs if a.op == "bincount"]
    assert counts and all(a.shape == (EXPERTS,) and a.nbytes == EXPERTS * 8 for a in counts)


def test_bincount_with_too_few_bins_for_its_indices_is_not_proven():
    # indices up to 7, minlength 4: the bins are max(4, largest + 1), which only the values tell
    trace = trace_workload(_router(EXPERTS // 2), GPU)
    assert "data_dependent_shape" in trace.uncertain


def _masked_select_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return out.masked_select(batch[1] > 0).square().mean()  # the labels' values decide the size


def test_a_mask_made_from_the_labels_is_sized_by_the_batch_values_without_a_real_step(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)
    w = Workload(model=lambda: torch.nn.Linear(256, 256), loss=_masked_select_loss, optimizer=_sgd, batch_size=64,
                 batch=lambda n: (torch.randn(n, 256), torch.randint(0, 2, (n, 256))))  # P(label > 0) = 1/2
    trace = trace_workload(w, GPU)
    assert "one random batch" in trace.uncertain["data_dependent_shape"]
    # the same seeded batch the trace made: as many elements as its labels have > 0
    torch.manual_seed(BATCH_SEED)
    selected = int((w.make_batch(64)[1] > 0).sum())
    assert 0.3 * 64 * 256 < selected < 0.7 * 64 * 256
    assert [a.nbytes for a in trace.allocs if a.op == "masked_select"] == [selected * 4] * 3  # one per step


def _no_real_forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("the step ran for real although the batch's values decide its sizes")


class _Packed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(16, 32)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return out.data


def test_a_packed_sequence_has_one_row_per_real_time_step(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)
    w = Workload(model=_Packed, optimizer=_sgd, batch_size=8, loss=lambda out, b: out.square().mean(),
                 batch=lambda n: (torch.randn(50, n, 16), torch.randint(1, 51, (n,))),
                 forward=lambda m, b: m(b[0], b[1]))
    trace = trace_workload(w, GPU)
    torch.manual_seed(BATCH_SEED)
    rows = int(w.make_batch(8)[1].sum())
    packed = [a for a in trace.allocs if a.op == "_pack_padded_sequence" and a.dtype == "float32"]
    assert packed and all(a.shape == (rows, 16) for a in packed)
    assert any(a.shape == (rows, 32) for a in trace.allocs if a.category == "activations")  # the GRU's output


def _ctc_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    log_probs = out.log_softmax(-1).transpose(0, 1)  # (T, N, C)
    steps = torch.full((out.shape[0],), out.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, batch[1], steps, batch[2])


def test_ctc_keeps_alphas_for_the_longest_target_of_the_batch(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)
    w = Workload(model=lambda: torch.nn.Linear(8, 20), optimizer=_sgd, batch_size=4, loss=_ctc_loss,
                 batch=lambda n: (torch.randn(n, 100, 8), torch.randint(1, 20, (n, 30)), torch.randint(5, 31, (n,))))
    trace = trace_workload(w, GPU)
    torch.manual_seed(BATCH_SEED)
    longest = int(w.make_batch(4)[2].max())
    alphas = [a for a in trace.allocs if a.op == "_ctc_loss" and len(a.shape) == 3]
    assert alphas and all(a.shape == (4, 100, 2 * longest + 1) for a in alphas)


def _loss_of_the_positive_outputs(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    return out[out[:, 0] > 0].square().mean()  # the model's own values decide the size


def test_sizes_from_the_models_values_come_from_one_real_forward(monkeypatch):  # noqa: ANN001
    torch.manual_seed(1)
    # 8192 rows of 64 floats: 2 MiB at the most, over SMALL_MASK_BYTES, so not taken at its largest
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_loss_of_the_positive_outputs, optimizer=_sgd, batch_size=8192)
    attempts = []
    trace_steps = trace_module._trace_steps

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        attempts.append((kwargs.get("batch_values", False), kwargs.get("real_forward") is not None))
        return trace_steps(*args, **kwargs)

    monkeypatch.setattr(trace_module, "_trace_steps", counted)
    trace = trace_workload(w, GPU)
    # the mask is made from the model's outputs: the batch's values cannot size it, so that trace is not tried
    assert attempts == [(False, False), (True, True)]
    assert "one real CPU forward" in trace.uncertain["data_dependent_shape"]
    rows = {a.shape[0] for a in trace.allocs if a.op == "index"}
    assert len(rows) == 1 and 0.3 * 8192 < rows.pop() < 0.7 * 8192  # about half the outputs are positive


def test_the_real_forward_builds_the_same_model_whatever_random_state_the_caller_left():
    # the model built for real is seeded (trace.MODEL_SEED): its weights decide the sizes, so two estimates of the
    # same step must not depend on what drew random numbers before them; the caller's state is given back
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_loss_of_the_positive_outputs, optimizer=_sgd, batch_size=512)
    rows = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        trace = trace_workload(w, GPU)
        rows.append(sorted({a.shape[0] for a in trace.allocs if a.op == "index"}))
        after = torch.rand(1)
        torch.manual_seed(seed)
        assert torch.equal(after, torch.rand(1))
    assert len(rows[0]) == 1 and rows[0] == rows[1]


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise AssertionError("the real forward ran backward")


def test_the_real_forward_stops_before_backward():
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=lambda out, b: _loss_of_the_positive_outputs(_FailsInBackward.apply(out), b),
                 optimizer=_sgd, batch_size=32)
    forward = trace_module._real_forward(w, GPU)
    assert [r.name for r in forward.returned] == ["index"]


@pytest.mark.parametrize("shapes_differ", [False, True])
def test_a_real_forward_is_used_only_where_the_same_op_gets_the_same_shapes(shapes_differ: bool) -> None:
    forward = trace_module.RealForward()
    forward.keep("nonzero", (torch.ones(4, dtype=torch.bool),), torch.arange(4).unsqueeze(1))
    args = (torch.ones(5 if shapes_differ else 4, dtype=torch.bool),)
    assert (forward.lookup(0, "nonzero", args) is None) == shapes_differ
    assert forward.lookup(0, "masked_select", args) is None and forward.lookup(1, "nonzero", args) is None


def _stand_in_and_real(func, args):  # noqa: ANN001, ANN202
    from memfit.estimate.data_dependent import ProductStandIns

    name = func.__name__.split(".")[0]
    stand_ins = ProductStandIns()
    stood = stand_ins(func, name, args, {})
    assert stand_ins(torch.ops.aten.clone.default, "clone", (stood,), {}) is None  # an op that reads it writes it
    return stood, func(*args)


@pytest.mark.parametrize("case", ["addmm", "mm", "convolution", "batch_norm"])
def test_the_real_forward_stands_in_for_large_products_with_noise_of_their_scale(case: str) -> None:
    torch.manual_seed(0)
    aten = torch.ops.aten
    if case in ("addmm", "mm"):
        x, w, b = torch.rand(512, 1024), torch.randn(1024, 768) * 0.02, torch.randn(768)
        args = (b, x, w) if case == "addmm" else (x, w)
        stood, real = _stand_in_and_real(aten.addmm.default if case == "addmm" else aten.mm.default, args)
        channel_mean = stood.mean(0)
        bias = b if case == "addmm" else torch.zeros(768)
    elif case == "convolution":
        x, w, b = torch.relu(torch.randn(4, 64, 64, 64)), torch.randn(128, 64, 3, 3) * 0.05, torch.randn(128)
        stood, real = _stand_in_and_real(aten.convolution.default, (x, w, b, [2, 2], [1, 1], [1, 1], False, [0, 0], 1))
        channel_mean, bias = stood.mean((0, 2, 3)), b
    else:
        x, w, b = torch.randn(4, 32, 96, 96) * 3 + 1, torch.rand(32) + 0.5, torch.randn(32)
        stood, real = _stand_in_and_real(aten.native_batch_norm.default, (x, w, b, None, None, True, 0.1, 1e-5))
        assert [t.shape for t in stood] == [t.shape for t in real]
        stood, real = stood[0], real[0]
        channel_mean, bias = stood.mean((0, 2, 3)), b
    assert stood.shape == real.shape and stood.dtype == real.dtype
    # the scale of what the product gives (about the input and weights' statistics), and the bias per channel
    assert float(stood.std()) == pytest.approx(float(real.std()), rel=0.1)
    samples = stood.numel() // bias.numel()  # per channel: its mean is within 5 standard errors of the bias
    assert torch.allclose(channel_mean, bias, atol=5 * float(real.std()) / samples**0.5)
    assert not torch.allclose(stood, real, atol=0.1 * float(real.std()))  # not computed: noise


@pytest.mark.parametrize("shape", [(3, 5, 40, 40), (2, 3, 64, 64), (1000, 5)])
def test_a_stand_in_larger_than_half_the_noise_pool_keeps_each_channels_mean_and_scale(monkeypatch, shape):  # noqa: ANN001
    from memfit.estimate import data_dependent

    # half the pool is 2048 values: channel planes of 1600 (one a block), of 4096 (two blocks each), rows of 5 (409 a block)
    monkeypatch.setattr(data_dependent, "NOISE_POOL_NUMEL", 1 << 12)
    torch.manual_seed(0)
    channels = shape[1]
    mean, scale = torch.arange(channels, dtype=torch.float32) * 10, torch.arange(1, channels + 1, dtype=torch.float32)
    stand_ins = data_dependent.ProductStandIns()
    out = stand_ins._normal(shape, torch.float32, mean, scale)
    stand_ins.fill(out)
    per_channel = out.transpose(0, 1).reshape(channels, -1)
    samples = per_channel.shape[1]
    assert torch.allclose(per_channel.mean(1), mean, atol=float(5 * scale.max()) / samples**0.5)
    assert torch.allclose(per_channel.std(1), scale, rtol=0.1)
    # each block reads its own window of the pool, not one window repeated
    if len(shape) > 2:  # the same channel's planes of two samples
        standard = ((out - mean.view(-1, 1, 1)) / scale.view(-1, 1, 1)).flatten(2)
        first, second = standard[0], standard[1]
    else:  # two blocks of 2048 // 5 rows
        standard = (out - mean) / scale
        first, second = standard[:409], standard[409:818]
    assert not torch.allclose(first, second, atol=0.1)


def _conv_args(x, w):  # noqa: ANN001, ANN202
    return (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def test_a_stand_in_output_is_written_when_an_op_reads_it_and_a_stand_in_takes_its_scale_unwritten():
    from memfit.estimate.data_dependent import ProductStandIns

    torch.manual_seed(0)
    conv = torch.ops.aten.convolution.default
    x, w1, w2 = torch.relu(torch.randn(4, 64, 64, 64)), torch.randn(128, 64, 3, 3) * 0.05, torch.randn(64, 128, 3, 3)
    # two products in a row: the second reads the first's scale from the noise it stands for, unwritten, or written
    deferred, written = ProductStandIns(), ProductStandIns()
    second_deferred = deferred(conv, "convolution", _conv_args(deferred(conv, "convolution", _conv_args(x, w1), {}),
                                                                 w2), {})
    first_written = written(conv, "convolution", _conv_args(x, w1), {})
    written.fill(first_written)
    second_written = written(conv, "convolution", _conv_args(first_written, w2), {})
    deferred.fill(second_deferred)
    written.fill(second_written)
    assert float(second_deferred.std()) == pytest.approx(float(second_written.std()), rel=0.02)

    # an op that computes (a relu) reads a stand-in's output: written first, noise of the product's scale, not the
    # empty tensor's zeros or old memory
    stand_ins = ProductStandIns()
    first = stand_ins(conv, "convolution", _conv_args(x, w1), {})
    assert stand_ins(torch.ops.aten.relu.default, "relu", (first,), {}) is None
    assert float(first.std()) == pytest.approx(float(conv(*_conv_args(x, w1)).std()), rel=0.1)


def test_a_stand_in_cast_to_another_dtype_stays_unwritten_and_keeps_its_scale():
    from memfit.estimate.data_dependent import ProductStandIns

    torch.manual_seed(0)
    aten, stand_ins = torch.ops.aten, ProductStandIns()
    x, w = torch.randn(4, 64, 64, 64), torch.randn(128, 64, 3, 3) * 0.05
    out = stand_ins(aten.convolution.default, "convolution", _conv_args(x, w), {})
    # autocast's product computed in fp32 and rounded back (CudaSemantics.half_in_fp32): the cast is a stand-in too
    half = stand_ins(aten._to_copy.default, "_to_copy", (out,), {"dtype": torch.bfloat16})
    assert half.dtype == torch.bfloat16 and half.shape == out.shape
    assert out.untyped_storage() in stand_ins._pending and half.untyped_storage() in stand_ins._pending
    # read, it is written with the product's scale
    assert stand_ins(aten.relu.default, "relu", (half,), {}) is None
    expected = float(torch.nn.functional.conv2d(x, w, padding=1).std())
    assert float(half.float().std()) == pytest.approx(expected, rel=0.1)
    # a cast that is not a plain dtype change, or of a view, writes and computes
    assert stand_ins(aten._to_copy.default, "_to_copy", (out,), {"dtype": torch.float16,
                                                                   "memory_format": torch.channels_last}) is None
    assert out.untyped_storage() not in stand_ins._pending


def test_small_products_and_eval_batch_norms_compute():
    from memfit.estimate.data_dependent import ProductStandIns

    stand_ins, aten = ProductStandIns(), torch.ops.aten
    assert stand_ins(aten.mm.default, "mm", (torch.randn(64, 64), torch.randn(64, 64)), {}) is None
    x = torch.randn(4, 32, 64, 64)
    eval_norm = (x, None, None, torch.zeros(32), torch.ones(32), False, 0.1, 1e-5)
    assert stand_ins(aten.native_batch_norm.default, "native_batch_norm", eval_norm, {}) is None
    assert stand_ins(aten.relu.default, "relu", (x,), {}) is None


def test_large_draws_of_the_real_forward_come_from_pools_of_their_distribution():
    from memfit.estimate.data_dependent import DRAW_NUMEL, STAND_IN_NUMEL, ProductStandIns

    stand_ins, aten = ProductStandIns(), torch.ops.aten
    t = torch.zeros(2 * STAND_IN_NUMEL, dtype=torch.bfloat16)
    assert stand_ins(aten.normal_.default, "normal_", (t, 0.5, 0.02), {}) is t
    assert float(t.float().mean()) == pytest.approx(0.5, abs=1e-3)
    assert float(t.float().std()) == pytest.approx(0.02, rel=0.02)
    assert stand_ins(aten.uniform_.default, "uniform_", (t, -3.0, 1.0), {}) is t
    assert -3.0 <= float(t.min()) < -2.99 and 0.99 < float(t.max()) <= 1.0
    assert float(t.float().mean()) == pytest.approx(-1.0, abs=0.01)
    x = torch.randn(STAND_IN_NUMEL)
    out, mask = stand_ins(aten.native_dropout.default, "native_dropout", (x, 0.25, True), {})
    assert mask.dtype == torch.bool and float(mask.float().mean()) == pytest.approx(0.75, abs=0.01)
    torch.testing.assert_close(out, x * mask / 0.75)
    # small ones, another generator's, evaluation-mode dropout and integers draw as usual
    small = torch.zeros(DRAW_NUMEL // 2)
    assert stand_ins(aten.normal_.default, "normal_", (small,), {}) is None
    assert stand_ins(aten.normal_.default, "normal_", (t,), {"generator": torch.Generator()}) is None
    assert stand_ins(aten.native_dropout.default, "native_dropout", (x, 0.25, False), {}) is None
    assert stand_ins(aten.uniform_.default, "uniform_", (torch.zeros(STAND_IN_NUMEL, dtype=torch.int64),), {}) is None


def test_a_real_forward_with_stood_in_products_sizes_a_mask_as_the_computed_one_does(monkeypatch):  # noqa: ANN001
    from memfit.estimate import data_dependent

    calls, drawn = [], []
    stand_in = data_dependent.ProductStandIns.__call__

    def counted(self, func, name, args, kwargs):  # noqa: ANN001, ANN202
        out = stand_in(self, func, name, args, kwargs)
        if name in ("mm", "addmm"):
            calls.append(out is not None)
        if out is not None:
            drawn.append(name)
        return out

    monkeypatch.setattr(data_dependent.ProductStandIns, "__call__", counted)
    w = Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 64)),
                 batch=lambda n: (torch.randn(n, 1024),), loss=_loss_of_the_positive_outputs, optimizer=_sgd,
                 batch_size=512)
    forward = trace_module._real_forward(w, GPU)
    assert calls.count(True) == 1  # the 512 × 1024 × 1024 product; the 1024 → 64 one (34 M) computes
    assert drawn.count("uniform_") == 2  # the real build's weights (kaiming_uniform_), from the pool; biases: small
    (kept,) = [r for r in forward.returned if r.name == "index"]
    assert 0.3 * 512 < kept.shapes[0][0] and 0.3 * 512 < kept.outputs[0].shape[0] < 0.7 * 512


def _penalised_positive_outputs(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    # a gradient penalty: autograd in the loss, which a forward without autograd cannot run
    (grad,) = torch.autograd.grad(out.sum(), batch[0], create_graph=True)
    return _loss_of_the_positive_outputs(out, batch) + grad.square().mean()


def test_a_real_forward_whose_loss_needs_autograd_runs_with_it():
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64).requires_grad_(),),
                 loss=_penalised_positive_outputs, optimizer=_sgd, batch_size=32)
    forward = trace_module._real_forward(w, GPU)
    assert [r.name for r in forward.returned] == ["index"]


def _scatter_positive_loss(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    # torchvision's box IoU loss: `inter[mask] = ...` with a mask from the predictions; backward takes grad[mask]
    kept = torch.zeros_like(out)
    mask = out > 0
    kept[mask] = out[mask] * 2
    return kept.square().mean()


def test_a_mask_sized_in_forward_sizes_its_index_in_backward():
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_scatter_positive_loss, optimizer=_sgd, batch_size=8192)  # over SMALL_MASK_BYTES at most
    trace = trace_workload(w, GPU)
    # one real forward was enough: backward's grad[mask] took the count the forward's out[mask] had
    assert "one real CPU forward" in trace.uncertain["data_dependent_shape"]
    forward = {a.shape for a in trace.allocs if a.op == "index" and a.phase == "loss"}
    backward = {a.shape for a in trace.allocs if a.op == "index" and a.phase == "backward"}
    assert len(forward) == 1 and forward == backward
    assert 0.3 * 8192 * 64 < next(iter(forward))[0] < 0.7 * 8192 * 64  # about half the outputs are positive


def test_a_small_mask_of_the_models_values_is_taken_at_its_largest_without_a_real_forward(monkeypatch):  # noqa: ANN001
    # torchvision's GIoU loss (``_loss_inter_union``): ``inter[mask] = ...`` over a few hundred predicted boxes. At
    # 256 x 64 floats the selection takes 64 KiB at the most: every element selected, in forward and backward alike
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_scatter_positive_loss, optimizer=_sgd, batch_size=256)
    trace = trace_workload(w, GPU)
    assert "taken at its largest" in trace.uncertain["data_dependent_shape"]
    forward = {a.shape for a in trace.allocs if a.op == "index" and a.phase == "loss"}
    backward = {a.shape for a in trace.allocs if a.op == "index" and a.phase == "backward"}
    assert forward == backward == {(256 * 64,)}


def test_a_small_mask_made_from_the_labels_keeps_its_real_count(monkeypatch):  # noqa: ANN001
    # the batch's values decide this one exactly (and cheaply): it is not taken at its largest
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)
    w = Workload(model=lambda: torch.nn.Linear(64, 64),
                 batch=lambda n: (torch.randn(n, 64), torch.arange(n) % 4 == 0),
                 loss=lambda out, b: out[b[1]].square().mean(), optimizer=_sgd, batch_size=256)
    trace = trace_workload(w, GPU)
    assert {a.shape for a in trace.allocs if a.op == "index" and a.phase == "loss"} == {(64, 64)}


def _numpy_picked_loss(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    # a matcher in NumPy (DETR's Hungarian matching hands its costs to SciPy): the rows it picks index the output
    picked = np.flatnonzero(out.detach().cpu().numpy()[:, 0] > 0)
    return out[torch.as_tensor(picked, device=out.device)].square().mean()


def test_numpy_in_the_loss_gets_the_values_of_one_real_forward():
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_numpy_picked_loss, optimizer=_sgd, batch_size=512)
    trace = trace_workload(w, GPU)
    assert ".numpy()" in trace.uncertain["data_dependent_shape"]
    rows = {a.shape[0] for a in trace.allocs if a.op == "index" and a.phase == "loss"}
    assert len(rows) == 1 and 0.3 * 512 < rows.pop() < 0.7 * 512


def _asarray_picked_loss(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    picked = np.flatnonzero(np.asarray(out.detach().cpu())[:, 0] > 0)  # NumPy's own conversion: Tensor.__array__
    return out[torch.as_tensor(picked, device=out.device)].square().mean()


def test_numpy_asarray_in_the_loss_gets_the_values_of_one_real_forward_and_numpy_is_torch_s_again_after():
    before = torch.Tensor.__dict__.get("numpy")
    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),),
                 loss=_asarray_picked_loss, optimizer=_sgd, batch_size=512)
    trace = trace_workload(w, GPU)
    assert ".numpy()" in trace.uncertain["data_dependent_shape"]
    rows = {a.shape[0] for a in trace.allocs if a.op == "index" and a.phase == "loss"}
    assert len(rows) == 1 and 0.3 * 512 < rows.pop() < 0.7 * 512
    assert torch.Tensor.__dict__.get("numpy") is before  # the trace put torch's own method back
    assert torch.ones(2).numpy().tolist() == [1.0, 1.0]


def test_numpy_in_another_thread_during_a_trace_is_torch_s():
    seen: list[object] = []

    def loss(out: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
        if type(out).__name__ == "FakeTensor":  # the trace, not the real forward whose copies it takes
            # another thread's .numpy() of its own tensor, before this thread's: not one of the step's copies
            worker = threading.Thread(target=lambda: seen.append(torch.arange(3).numpy()))
            worker.start()
            worker.join()
        return _numpy_picked_loss(out, batch)

    w = Workload(model=lambda: torch.nn.Linear(64, 64), batch=lambda n: (torch.randn(n, 64),), loss=loss,
                 optimizer=_sgd, batch_size=512)
    trace = trace_workload(w, GPU)
    assert seen and all(isinstance(a, np.ndarray) and a.tolist() == [0, 1, 2] for a in seen)
    rows = {a.shape[0] for a in trace.allocs if a.op == "index" and a.phase == "loss"}
    assert len(rows) == 1 and 0.3 * 512 < rows.pop() < 0.7 * 512  # the real forward's copy, in its place


def test_numpy_of_the_labels_is_computed_from_the_batch_without_a_real_forward(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(trace_module, "_real_forward", _no_real_forward)

    def loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        present = np.unique(batch[1].cpu().numpy())  # the classes this batch has
        return out[:, torch.as_tensor(present, device=out.device)].square().mean()

    w = Workload(model=lambda: torch.nn.Linear(64, 64), optimizer=_sgd, batch_size=32, loss=loss,
                 batch=lambda n: (torch.randn(n, 64), torch.randint(0, 40, (n,))))
    trace = trace_workload(w, GPU)
    torch.manual_seed(BATCH_SEED)
    classes = len(np.unique(w.make_batch(32)[1].numpy()))
    assert classes < 40
    assert {a.shape for a in trace.allocs if a.op == "index" and a.phase == "loss"} == {(32, classes)}


def test_running_an_op_for_real_keeps_no_fake_tensor_alive_past_its_last_reference():
    # the trace frees a fake tensor when its last reference goes; a reference cycle made on the way (a closure
    # that calls itself) would hold it until Python's collector runs, so the trace's frees would follow the
    # collector: torchvision's Faster R-CNN's batched images and anchors, 61 MB of its peak with it off
    values = KnownValues()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with StaticShapeFakeTensorMode():
            t = torch.empty(4)
            seen = weakref.ref(t)
            out = values.run(torch.ops.aten.fill_.Scalar, "fill_", (t, 2.0), {})
            del t
        assert out is not None and out.tolist() == [2.0] * 4  # it ran for real
        assert seen() is None
    finally:
        if enabled:
            gc.enable()
