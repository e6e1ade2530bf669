"""Selective and reentrant checkpointing: the gradients they give, the memory the trace says they keep, and what the
speed model charges for their recompute. Worked by hand on one MLP block (``_block``)."""

import pytest
import torch

from memfit import Workload, WorkloadError
from memfit.estimate.allocator import replay
from memfit.estimate.gpus import gpu_spec
from memfit.estimate.op_costs import StepCost
from memfit.estimate.trace import _trace, trace_workload
from memfit.speed.step_time import ROOFLINE, predict_step_time
from memfit.workload.knobs import apply_checkpointing
from memfit.workload.models import GPT, ResNet, ViT
from memfit.workload.selective_checkpoint import saves_output

MiB = 1 << 20
GPU = gpu_spec("h100")
MODES = ("full", "selective", "reentrant")


def _block(mode: str = "full", checkpoint: tuple[str, ...] = ("0",), batch: int = 256, width: int = 4096) -> Workload:
    """Linear(1024, width) → GELU → Linear(width, 1024) as block ``0``; fp32, batch × 1024 inputs (1 MiB at 256)."""
    return Workload(
        name="block",
        model=lambda: torch.nn.Sequential(torch.nn.Sequential(
            torch.nn.Linear(1024, width), torch.nn.GELU(), torch.nn.Linear(width, 1024))),
        batch=lambda n: (torch.randn(n, 1024),),
        loss=lambda out, b: out.float().pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        batch_size=batch, checkpoint=checkpoint, checkpoint_mode=mode,
    )


def _saved_activations(trace) -> dict[tuple[str, tuple[int, ...]], int]:  # noqa: ANN001
    """Activation bytes alive as the second step's backward begins (what its forward kept), by (op, shape)."""
    start = next(at for at, name, s in trace.phase_marks if name == "backward" and s == 1)
    live = {}
    for op, key in zip(trace.ops[:start], trace.keys[:start], strict=True):
        if op > 0:
            live[key] = trace.allocs[key]
        else:
            live.pop(key, None)
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for a in live.values():
        if a.category == "activations" and a.nbytes >= MiB:
            out[(a.op, a.shape)] = out.get((a.op, a.shape), 0) + a.nbytes
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_gradients_of_no_checkpointing(mode):  # noqa: ANN001
    torch.manual_seed(0)

    class Block(torch.nn.Module):  # a matmul, a convolution, attention, norms and pointwise ops
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.a, self.b = torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
            self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b(torch.nn.functional.gelu(self.a(self.norm(x))))
            y = y + self.conv(y.view(-1, 4, 4)).view_as(y)
            q = y.view(y.shape[0], 2, 4, 2)
            return x + y + torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape_as(y)

    model = torch.nn.Sequential(Block(), Block()).double()
    x = torch.randn(8, 16, dtype=torch.double)  # needs no gradient: reentrant's first block gets a dummy input
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_checkpointing(model, ["0", "1"], mode)
    model(x).square().sum().backward()
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_reentrant_refuses_a_keyword_tensor_that_needs_a_gradient_and_takes_one_that_does_not():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * scale

    model = apply_checkpointing(torch.nn.Sequential(Scaled()), ["0"], "reentrant")
    with pytest.raises(WorkloadError, match="keyword argument.*scale.*checkpoint_mode='full'"):
        model[0](torch.randn(2, 4), scale=torch.ones(1, requires_grad=True))
    model[0](torch.randn(2, 4), scale=torch.ones(1)).sum().backward()
    assert model[0].lin.weight.grad is not None


def test_a_block_checkpointed_one_way_is_not_silently_checkpointed_another():
    model = apply_checkpointing(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4))), ["0"], "full")
    apply_checkpointing(model, ["0"], "full")  # the same again: nothing to do
    with pytest.raises(WorkloadError, match="checkpointed \\(full\\) already"):
        apply_checkpointing(model, ["0"], "selective")
    with pytest.raises(WorkloadError, match="checkpoint_mode must be one of full, selective, reentrant"):
        _block("partial")


def test_the_policy_keeps_matmuls_convolutions_and_attention_and_recomputes_the_rest():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default):
        assert saves_output(op), op
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor, aten.native_dropout.default,
               aten._to_copy.default, aten.native_batch_norm.default, aten.relu_.default, aten.t.default):
        assert not saves_output(op), op


def test_the_trace_keeps_what_each_mode_keeps_worked_by_hand():
    # no checkpointing: autograd keeps the first Linear's output (GELU's input, 4 MiB), GELU's output (the second
    # Linear's input, 4 MiB) and the block's output (1 MiB, the loss's pow keeps it); the batch is data
    kept = {label: _saved_activations(trace_workload(_block(mode, ck), GPU, steps=2)) for label, mode, ck in (
        ("none", "full", ()), ("full", "full", ("0",)), ("selective", "selective", ("0",)),
        ("reentrant", "reentrant", ("0",)))}
    assert kept["none"] == {("addmm", (256, 4096)): 4 * MiB, ("gelu", (256, 4096)): 4 * MiB,
                            ("addmm", (256, 1024)): MiB}
    # full and reentrant: only the output, which the loss keeps anyway
    assert kept["full"] == kept["reentrant"] == {("addmm", (256, 1024)): MiB}
    # selective: both matmul outputs (the second is the output itself: no more bytes); GELU's is recomputed
    assert kept["selective"] == {("addmm", (256, 4096)): 4 * MiB, ("addmm", (256, 1024)): MiB}


def test_the_recompute_runs_only_what_each_mode_did_not_keep():
    costs = {mode: StepCost.from_trace(trace_workload(_block(mode), GPU, steps=2), 256).backward for mode in MODES}
    first_matmul = 2 * 256 * 1024 * 4096
    # full stops recomputing once GELU's output (the last tensor backward needs) is back: one matmul
    assert costs["full"].recompute_flops == first_matmul
    # reentrant runs the whole forward again; selective hands both matmul outputs back without a kernel
    assert costs["reentrant"].recompute_flops == 2 * first_matmul
    assert costs["selective"].recompute_flops == 0
    handed_back = [r for r in costs["selective"].ops if r.recompute and r.kernels == 0]
    recomputed = [r for r in costs["selective"].ops if r.recompute and r.kernels > 0]
    assert len(handed_back) == 2 and all(r.selective for r in handed_back)
    assert len(recomputed) == 1 and recomputed[0].selective  # GELU, through the recompute's dispatch mode
    assert all(r.reentrant for r in costs["reentrant"].ops if r.recompute)
    assert not any(r.reentrant or r.selective for r in costs["full"].ops)


def test_the_speed_model_charges_selective_less_gpu_and_more_cpu_than_full():
    # wide enough to be GPU-bound: the recompute's matmul is what selective saves
    cost = {mode: StepCost.from_trace(trace_workload(_block(mode, batch=8192, width=8192), GPU, steps=2), 8192)
            for mode in ("full", "selective")}
    pred = {mode: predict_step_time(c, GPU) for mode, c in cost.items()}
    assert pred["selective"].recompute_s < pred["full"].recompute_s / 10  # GELU only, against a matmul and GELU
    assert pred["selective"].step_time_s < pred["full"].step_time_s
    # and its Python dispatch modes cost CPU time per op of the block, forward and recompute
    rows = [r for phase in (cost["selective"].forward, cost["selective"].backward) for r in phase.ops if r.selective]
    assert len(rows) == 3 + 3  # forward: two matmuls and GELU; recompute: two handed back, GELU again
    plain = predict_step_time(cost["selective"], GPU, calibration=None)
    assert plain.cpu_s - _cpu_without_selective(cost["selective"]) == pytest.approx(
        len(rows) * ROOFLINE.selective_dispatch_s)


def _cpu_without_selective(cost: StepCost) -> float:
    from dataclasses import replace

    from memfit.estimate.op_costs import PhaseCost

    def strip(phase: PhaseCost) -> PhaseCost:
        return PhaseCost.of([r._replace(selective=False) for r in phase.ops])

    return predict_step_time(replace(cost, forward=strip(cost.forward), backward=strip(cost.backward)), GPU).cpu_s


_F = torch.nn.functional
SMALL = {
    "gpt": Workload(name="gpt", model=lambda: GPT(vocab=512, seq_len=128, dim=128, layers=2, heads=4),
                    batch=lambda n: (torch.randint(0, 512, (n, 128)), torch.randint(0, 512, (n, 128))),
                    loss=lambda out, b: _F.cross_entropy(out.flatten(0, 1), b[1].flatten()),
                    optimizer=lambda p: torch.optim.AdamW(p), batch_size=4, precision="bf16",
                    checkpoint=("blocks.0", "blocks.1")),
    "vit": Workload(name="vit", model=lambda: ViT(image=64, patch=8, dim=128, layers=2, heads=4, classes=10),
                    batch=lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))),
                    loss=lambda out, b: _F.cross_entropy(out, b[1]), optimizer=lambda p: torch.optim.AdamW(p),
                    batch_size=4, precision="bf16", checkpoint=("blocks.0", "blocks.1")),
    "resnet": Workload(name="resnet", model=lambda: ResNet(layers=(1, 1, 1, 1), num_classes=10),
                       batch=lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))),
                       loss=lambda out, b: _F.cross_entropy(out, b[1]),
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batch_size=4,
                       checkpoint=("layer1.0", "layer2.0", "layer3.0", "layer4.0")),
}


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("mode", MODES)
def test_fake_tensors_trace_what_real_cpu_tensors_do(name, mode):  # noqa: ANN001
    """The trace runs torch's own checkpoint code: on fake tensors it must free what real tensors free, when they
    do (a GPT-2 block stack, a ViT, a ResNet; every allocation and free of two steps)."""
    w = SMALL[name].replace(checkpoint_mode=mode)
    fake, real = _trace(w, GPU, steps=2), _trace(w, GPU, steps=2, real=True)
    assert fake.events() == real.events()
    assert replay(fake.events()).peak_allocated_bytes == replay(real.events()).peak_allocated_bytes
