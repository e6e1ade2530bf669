"""The speed model: op costs counted in the trace, the roofline, and the calibration fit (hardware mocked)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit import Workload
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import OpCost
from memfit.estimate.predict import estimate
from memfit.estimate.trace import trace_workload
from memfit.speed import step_time as speed
from memfit.speed.step_time import (
    ROOFLINE,
    Calibration,
    SpeedParams,
    StepCost,
    calibrate,
    fit_calibration,
    predict_step_time,
)

GPU = gpu_spec("h100")
IN, HIDDEN, OUT = 256, 1024, 512


class _Net(nn.Module):
    """Linear layers only; the middle block can be checkpointed."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = nn.Linear(IN, IN, bias=False)
        # ends in a ReLU, whose backward needs its output: the whole block is recomputed (checkpointing stops
        # recomputing once every saved tensor is back)
        self.block = nn.Sequential(nn.Linear(IN, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, IN, bias=False),
                                   nn.ReLU())
        self.head = nn.Linear(IN, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(x)


def _workload(batch_size: int = 64, **kw: object) -> Workload:
    checkpointed = bool(kw.pop("checkpointed", False))
    base: dict = dict(
        name="net",
        model=lambda: _Net(checkpointed),
        batch=lambda n: (torch.randn(n, IN),),
        loss=lambda out, b: out.float().pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=batch_size,
    )
    base.update(kw)
    return Workload(**base)


def _cost(w: Workload) -> StepCost:
    return StepCost.from_trace(trace_workload(w, GPU, steps=2), w.batch_size)


@functools.cache
def _mlp_cost(batch_size: int) -> StepCost:
    # wide enough that large micro-batches are bound by the GPU, small ones by the CPU
    return _cost(_workload(batch_size, model=lambda: nn.Sequential(
        nn.Linear(IN, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, OUT)),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)))


# ------------------------------------------------------------------------------------------------- op counts
def test_linear_flops_match_the_hand_formula():
    n = 64
    cost = _cost(_workload(n))
    layers = [(IN, IN), (IN, HIDDEN), (HIDDEN, IN), (IN, OUT)]
    forward = sum(2 * n * i * o for i, o in layers)
    assert cost.forward.flops == {"fp32_matmul": forward, "fp32_conv": 0, "bf16": 0, "fp16": 0}
    # backward: a weight gradient and an input gradient per layer, each as costly as the forward matmul, except
    # the first layer's input gradient: the batch does not require grad, so autograd skips it
    assert cost.backward.total_flops == 2 * forward - 2 * n * IN * IN
    assert cost.backward.recompute_flops == 0
    assert cost.optimizer.total_flops == 0
    assert cost.micro_batch_size == n


def test_checkpointing_adds_the_block_forward_to_backward():
    n = 64
    plain, ckpt = _cost(_workload(n)), _cost(_workload(n, checkpointed=True))
    block = 2 * n * IN * HIDDEN * 2
    assert ckpt.forward.total_flops == plain.forward.total_flops
    assert ckpt.backward.total_flops - plain.backward.total_flops == block
    assert ckpt.backward.recompute_flops == block
    p_plain, p_ckpt = predict_step_time(plain, GPU), predict_step_time(ckpt, GPU)
    assert p_ckpt.recompute_s > 0 == p_plain.recompute_s
    assert p_ckpt.step_time_s > p_plain.step_time_s


def test_bf16_autocast_moves_matmul_flops_to_the_16bit_class():
    fp32, bf16 = _cost(_workload(64)), _cost(_workload(64, precision="bf16"))
    assert bf16.forward.flops["fp32_matmul"] == 0
    assert bf16.forward.flops["bf16"] == fp32.forward.flops["fp32_matmul"]
    assert bf16.backward.flops["bf16"] == fp32.backward.flops["fp32_matmul"]


def test_for_loop_optimizer_launches_more_kernels_than_foreach_and_fused():
    def optimizer_cost(**kw: object) -> speed.PhaseCost:
        return _cost(_workload(8, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, **kw))).optimizer

    loop, foreach, fused = optimizer_cost(foreach=False), optimizer_cost(foreach=True), optimizer_cost(fused=True)
    assert loop.kernels > foreach.kernels > fused.kernels >= 1
    assert loop.dispatches > foreach.dispatches
    # the step counters live on the CPU: reading them is no GPU sync
    assert loop.syncs == foreach.syncs == 0
    loop_s = predict_step_time(dataclasses.replace(_cost(_workload(8)), optimizer=loop), GPU).optimizer_s
    foreach_s = predict_step_time(dataclasses.replace(_cost(_workload(8)), optimizer=foreach), GPU).optimizer_s
    assert loop_s > foreach_s


def test_fused_sgd_traces_as_one_launch():
    # aten._fused_sgd_ has no fake kernel (torch 2.13); it returns nothing, so the trace skips running it
    fused = _cost(_workload(8, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)))
    assert fused.optimizer.kernels == 1
    assert fused.optimizer.bytes > 0


def test_channels_last_saves_cudnn_layout_conversions():
    def conv_workload(channels_last: bool) -> Workload:
        return Workload(
            model=lambda: nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)),
            batch=lambda n: (torch.randn(n, 16, 32, 32),), loss=lambda o, b: o.float().mean(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=8, precision="bf16",
            channels_last=channels_last,
        )

    nchw, nhwc = _cost(conv_workload(False)), _cost(conv_workload(True))
    assert nchw.forward.flops["bf16"] == nhwc.forward.flops["bf16"] > 0
    assert nchw.forward.kernels > nhwc.forward.kernels
    assert nchw.forward.bytes > nhwc.forward.bytes


def test_estimate_carries_the_cost_and_stays_json():
    est = estimate(_workload(16))
    assert est.cost is not None and est.cost.forward.total_flops > 0
    d = json.loads(est.to_json())
    assert d["cost"]["forward"]["flops"]["fp32_matmul"] == est.cost.forward.flops["fp32_matmul"]
    assert "ops" not in d["cost"]["forward"]  # the per-op rows stay out of reports
    assert StepCost.from_dict(json.loads(json.dumps(est.cost.to_dict()))) == est.cost


# ------------------------------------------------------------------------------------------------- the model
def test_bigger_micro_batches_are_faster_per_sample_until_saturation():
    sizes = (1, 4, 16, 64, 256, 1024)
    rates = [predict_step_time(_mlp_cost(b), GPU).samples_per_s for b in sizes]
    assert all(b > a for a, b in zip(rates, rates[1:], strict=False))
    gains = [b / a for a, b in zip(rates, rates[1:], strict=False)]
    assert gains[0] > 3  # CPU-bound: 4x the samples for about the same time
    # GPU-bound: forward and backward time grow with the batch (the step still gains from spreading the
    # optimizer over more samples)
    micro = [b / predict_step_time(_mlp_cost(b), GPU).micro_batch_s for b in sizes]
    assert micro[-1] / micro[-2] < 1.5
    small, large = predict_step_time(_mlp_cost(1), GPU), predict_step_time(_mlp_cost(1024), GPU)
    assert small.bound == "cpu" and large.bound == "gpu"


def test_accumulation_repeats_the_micro_batch_not_the_optimizer():
    cost = _mlp_cost(16)
    one, four = predict_step_time(cost, GPU), predict_step_time(cost, GPU, accumulation=4)
    assert four.step_time_s == pytest.approx(4 * one.micro_batch_s + one.optimizer_s)
    assert four.samples_per_s == pytest.approx(4 * 16 / four.step_time_s)
    assert four.model == "roofline"
    with pytest.raises(ValueError, match="accumulation"):
        predict_step_time(cost, GPU, accumulation=0)


def test_tensor_cores_make_bf16_and_tf32_faster_than_fp32_when_gpu_bound():
    fp32 = _mlp_cost(1024)
    bf16 = dataclasses.replace(fp32, **{
        p: dataclasses.replace(getattr(fp32, p), ops=tuple(
            r._replace(flop_class="bf16") if r.flop_class else r for r in getattr(fp32, p).ops))
        for p in ("forward", "backward")})
    t_fp32 = predict_step_time(fp32, GPU).micro_batch_s
    t_tf32 = predict_step_time(fp32, GPU, matmul_tf32=True).micro_batch_s
    t_bf16 = predict_step_time(bf16, GPU).micro_batch_s
    assert t_fp32 > t_tf32 > t_bf16


def _with_host_only_optimizer(cost: StepCost, dispatches: int) -> StepCost:
    # an optimizer step that is all CPU (Python and launches, no GPU work): torchao's 8-bit update per parameter
    return dataclasses.replace(cost, optimizer=speed.PhaseCost.of([OpCost(0, None, 0, 0, dispatches)]))


def test_a_cpu_bound_optimizer_step_runs_while_the_gpu_finishes_backward():
    p = ROOFLINE.optimizer_dispatch_s
    gpu_bound = _mlp_cost(1024)  # backward's kernels outlast their launches: the GPU has a backlog when it returns
    short, long1, long2 = (_with_host_only_optimizer(gpu_bound, d) for d in (1, 100_000, 200_000))
    # a short step hides entirely behind the backlog; a long one adds its CPU time less the backlog
    assert predict_step_time(short, GPU).optimizer_s == 0.0
    t1, t2 = predict_step_time(long1, GPU).optimizer_s, predict_step_time(long2, GPU).optimizer_s
    assert 0 < t1 < 100_000 * p and t2 - t1 == pytest.approx(100_000 * p)
    # calibration times the optimizer apart (after a sync): no overlap there
    phases = {n: speed._rows(getattr(long1, n), GPU, False, True) for n in ("forward", "backward", "optimizer")}
    apart = speed._predict(long1, phases, ROOFLINE, GPU.name, 1, "roofline", overlap_optimizer=False)
    assert apart.optimizer_s == pytest.approx(100_000 * p)
    # a CPU-bound backward leaves no backlog: nothing is hidden
    cpu_bound = _with_host_only_optimizer(_mlp_cost(1), 1000)
    assert predict_step_time(cpu_bound, GPU).optimizer_s == pytest.approx(1000 * p)


def test_an_offloaded_optimizer_pays_per_parameter_on_the_host(monkeypatch: pytest.MonkeyPatch):
    cost = dataclasses.replace(_mlp_cost(64), host_update_bytes=7 << 20, offload_tensors=3)
    assert StepCost.from_dict(json.loads(json.dumps(cost.to_dict()))).offload_tensors == 3
    monkeypatch.setattr(speed, "OFFLOAD_S_PER_TENSOR", 0.0)
    base = predict_step_time(cost, GPU).host_s
    monkeypatch.setattr(speed, "OFFLOAD_S_PER_TENSOR", 2e-3)
    assert predict_step_time(cost, GPU).host_s == pytest.approx(base + 3 * 2e-3)


# ------------------------------------------------------------------------------------------------ calibration
TRUE = SpeedParams(compute_efficiency=0.45, memory_efficiency=0.9, kernel_s=5e-6, forward_dispatch_s=20e-6,
                   backward_dispatch_s=8e-6, optimizer_dispatch_s=4e-6)
SIZES = (1, 8, 64, 512, 2048)


def _synthetic_times(cost: StepCost) -> tuple[float, float, float]:
    p = predict_step_time(cost, GPU, calibration=_as_calibration(TRUE))
    return p.forward_s, p.backward_s, p.optimizer_s


def _as_calibration(params: SpeedParams) -> Calibration:
    return Calibration(params=params, gpu=GPU.name, workload="", micro_batches=(), measured=(), rms_log_error=0.0)


def test_calibration_recovers_known_constants_from_timings(monkeypatch: pytest.MonkeyPatch):
    # mock the hardware: "timing" a micro-batch size returns what a GPU with the TRUE constants would take
    def fake_time_phases(w: Workload, device: str, *, warmup: int, repeats: int) -> tuple[float, float, float]:
        return _synthetic_times(_mlp_cost(w.batch_size))

    monkeypatch.setattr(speed, "_time_phases", fake_time_phases)
    monkeypatch.setattr(speed, "_trace_cost", lambda w, spec: _mlp_cost(w.batch_size))
    cal = calibrate(_workload(1), micro_batches=SIZES, gpu=GPU)
    assert cal.micro_batches == SIZES and cal.gpu == GPU.name
    assert cal.rms_log_error < 0.01
    # what the timings can see comes back; the optimizer here is bound by memory, so its CPU cost stays a guess
    for name in ("compute_efficiency", "memory_efficiency", "forward_dispatch_s", "backward_dispatch_s"):
        assert getattr(cal.params, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    # and it predicts a size it never saw
    held_out = predict_step_time(_mlp_cost(128), GPU, calibration=cal)
    truth = _synthetic_times(_mlp_cost(128))
    assert held_out.model == "calibrated"
    assert held_out.forward_s + held_out.backward_s == pytest.approx(truth[0] + truth[1], rel=0.03)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_calibration_skips_sizes_that_run_out_of_memory(monkeypatch: pytest.MonkeyPatch):
    def fake_time_phases(w: Workload, device: str, *, warmup: int, repeats: int) -> tuple[float, float, float]:
        if w.batch_size > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _synthetic_times(_mlp_cost(w.batch_size))

    monkeypatch.setattr(speed, "_time_phases", fake_time_phases)
    monkeypatch.setattr(speed, "_trace_cost", lambda w, spec: _mlp_cost(w.batch_size))
    cal = calibrate(_workload(1), micro_batches=SIZES, gpu=GPU)
    assert cal.micro_batches == (1, 8, 64)


def test_calibration_needs_two_sizes():
    with pytest.raises(ValueError, match="at least 2"):
        fit_calibration([], GPU)


def test_roofline_defaults_are_positive_and_validated():
    assert ROOFLINE.compute_efficiency < 1
    with pytest.raises(ValueError, match="positive"):
        SpeedParams(kernel_s=0.0)
    with pytest.raises(ValueError, match="at most 1"):
        SpeedParams(compute_efficiency=1.5)
    assert math.isfinite(predict_step_time(_mlp_cost(1), GPU).step_time_s)
