"""Knobs on a real model and optimizer: checkpointed blocks, optimizer implementations, accumulation."""

import pytest
import torch

from memfit import WorkloadError, estimate
from memfit.workload.knobs import apply_checkpointing, checkpoint_candidates, set_optimizer_impl
from memfit.workload.models import GPT, ResNet, UNet
from memfit.workload.zoo import builtin_workload


def test_checkpoint_candidates_are_the_blocks_users_checkpoint():
    assert checkpoint_candidates(GPT(layers=3, dim=64, heads=2, vocab=100, seq_len=16)) == [
        "blocks.0", "blocks.1", "blocks.2"
    ]
    resnet = checkpoint_candidates(ResNet())
    assert len(resnet) == 16 and resnet[0] == "layer1.0"  # 3 + 4 + 6 + 3 bottlenecks
    unet = checkpoint_candidates(UNet(features=(8, 16, 32)))
    assert unet == ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"]


def test_checkpointing_keeps_outputs_and_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Sequential(torch.nn.Linear(16, 4))
    ).double()
    x = torch.randn(5, 8, dtype=torch.double)
    ref = model(x).square().sum()
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_checkpointing(model, ["0", "1"])
    out = model(x).square().sum()
    out.backward()
    assert torch.equal(out, ref)
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_unknown_block_is_one_clear_error():
    with pytest.raises(WorkloadError, match="no such submodule"):
        apply_checkpointing(GPT(layers=1, dim=32, heads=2, vocab=10, seq_len=8), ["blocks.7"])


@pytest.mark.parametrize(("impl", "foreach", "fused"), [("foreach", True, False), ("for-loop", False, False),
                                                         ("fused", False, True)])
def test_optimizer_impl_keeps_groups_and_settings(impl, foreach, fused):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a], "lr": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=0.01)
    new = set_optimizer_impl(opt, impl)
    assert type(new) is torch.optim.AdamW
    assert [g["lr"] for g in new.param_groups] == [0.1, 0.01]
    assert [g["weight_decay"] for g in new.param_groups] == [0.01, 0.0]
    assert all(g["foreach"] is foreach and g["fused"] is fused for g in new.param_groups)


def test_knobs_change_the_estimate_as_their_mechanics_say():
    w = builtin_workload("mlp").replace(batch_size=16)
    base, fused, two, four = (
        estimate(w.replace(**c))
        for c in ({}, {"optimizer_impl": "fused"}, {"accumulation_steps": 2}, {"accumulation_steps": 4})
    )
    assert base.peak_phase == "optimizer"  # Adam's foreach temporaries on top of grads and state
    assert fused.peak_allocated_bytes < base.peak_allocated_bytes  # fused: no foreach temporaries
    # from the second micro-batch on the grads are alive in forward; later micro-batches repeat it exactly
    assert two.peak_allocated_bytes >= base.peak_allocated_bytes
    assert four.peak_allocated_bytes == two.peak_allocated_bytes


def test_checkpointing_lowers_a_transformer_peak():
    w = builtin_workload("gpt2").replace(
        model=lambda: GPT(layers=4, dim=256, heads=4, vocab=1000, seq_len=256),
        batch=lambda n: (torch.randint(0, 1000, (n, 256)), torch.randint(0, 1000, (n, 256))),
        batch_size=8,
    )
    plain = estimate(w)
    ckpt = estimate(w.replace(checkpoint=("blocks.0", "blocks.1", "blocks.2", "blocks.3")))
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"]
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes


def test_the_chunked_loss_is_a_knob_only_for_models_that_expose_their_output_layer():
    from memfit.workload.knobs import model_facts
    from memfit.workload.models import CausalLM
    from memfit.workload.spec import Workload

    def facts(model):
        return model_facts(Workload(model=model, batch=lambda n: (torch.zeros(n, 8, dtype=torch.long),),
                                    loss=lambda out, b: out.loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                    batch_size=1))

    lm = facts(lambda: CausalLM(vocab=50_000, seq_len=8, dim=16, layers=1, heads=2))
    assert lm.output_vocab == 50_000 and lm.loss_impls == ("default", "chunked")
    gpt = facts(lambda: GPT(vocab=50_000, seq_len=8, dim=16, layers=1, heads=2))  # logits only: no loss inside
    assert gpt.output_vocab is None and gpt.loss_impls == ("default",)


def test_checkpoint_choices_take_the_heaviest_blocks_and_the_earliest_of_one_size():
    from memfit.workload.knobs import checkpoint_choices

    blocks = [f"blocks.{i}" for i in range(6)]
    # six blocks of one size up to a few bytes (a repeated block's estimate): half the activations is the first
    # three, so the last three stay plain and are freed before the first recompute
    same = {f"blocks.{i}.mlp": 1_000_000 + b for i, b in enumerate((0, 900, 1500, 300, 1900, 2600))}
    assert checkpoint_choices(same, blocks) == [tuple(blocks[:3]), tuple(blocks)]
    # clearly heavier blocks (a U-Net's high-resolution stages) still go first, wherever they are
    unequal = {**same, "blocks.4.conv": 4_000_000, "blocks.5.conv": 4_000_000}
    assert checkpoint_choices(unequal, blocks) == [("blocks.4", "blocks.5"), tuple(blocks)]
    # the fewest blocks holding three quarters, of one size: the first five
    assert checkpoint_choices(same, blocks, (0.75,)) == [tuple(blocks[:5]), tuple(blocks)]


def test_default_impl_on_cuda_is_what_torch_picks_for_the_optimizer_as_built():
    from memfit.workload.knobs import default_impl_on_cuda, model_facts
    from memfit.workload.spec import Workload

    p = [torch.nn.Parameter(torch.zeros(2))]
    assert default_impl_on_cuda(torch.optim.AdamW(p)) == "foreach"  # neither flag set: torch's choice on CUDA
    assert default_impl_on_cuda(torch.optim.SGD(p, lr=0.1, foreach=False)) == "for-loop"
    assert default_impl_on_cuda(torch.optim.Adam(p, fused=True)) == "fused"
    mixed = torch.optim.SGD([{"params": p[:1], "foreach": False}, {"params": [torch.nn.Parameter(torch.zeros(1))]}],
                            lr=0.1)
    assert default_impl_on_cuda(mixed) is None  # groups that differ

    class Mine(torch.optim.SGD):  # another library's optimizer: its flags may mean something else
        pass

    assert default_impl_on_cuda(Mine(p, lr=0.1)) is None
    w = Workload(name="t", model=lambda: torch.nn.Linear(2, 2), batch=lambda n: (torch.randn(n, 2), torch.randn(n, 2)),
                 loss=lambda out, b: out.sum(), optimizer=lambda q: torch.optim.SGD(q, lr=0.1, foreach=False),
                 batch_size=2)
    assert model_facts(w).default_impl == "for-loop"
