"""chunked_linear_cross_entropy matches F.cross_entropy of the full logits, in value and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from memfit import estimate
from memfit.errors import WorkloadError
from memfit.workload.chunked_cross_entropy import (
    CausalLMOutput,
    chunked_linear_cross_entropy,
    default_chunk_tokens,
    use_chunked_cross_entropy,
)
from memfit.workload.models import CausalLM
from memfit.workload.spec import Workload


def _inputs(n: int = 37, h: int = 16, v: int = 301, bias: bool = True, ignored: int = 5):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:ignored]] = -100
    return hidden, weight, b, targets


def _grads(loss: torch.Tensor, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    live = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss.sum() if loss.dim() else loss, live))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_the_full_logits_in_value_and_gradients(reduction: str, bias: bool) -> None:
    hidden, weight, b, targets = _inputs(bias=bias)
    # 37 tokens in chunks of 8: five chunks, the last one short
    ours = chunked_linear_cross_entropy(hidden, weight, targets, b, reduction=reduction, chunk_tokens=8)
    ref = F.cross_entropy(F.linear(hidden, weight, b), targets, reduction=reduction)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for g_ours, g_ref in zip(_grads(ours, hidden, weight, b), _grads(ref, hidden, weight, b), strict=True):
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


def test_ignored_targets_add_nothing_and_the_mean_is_over_the_rest() -> None:
    hidden, weight, _, targets = _inputs(ignored=20)
    ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=4)
    kept = targets != -100
    ref = F.cross_entropy(hidden[kept] @ weight.T, targets[kept])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    (grad_h,) = torch.autograd.grad(ours, hidden)
    assert grad_h[~kept].abs().max() == 0  # an ignored token's hidden state gets no gradient
    other = chunked_linear_cross_entropy(hidden, weight, targets, ignore_index=7, chunk_tokens=4)
    assert not torch.allclose(other, ours)  # ignore_index is honoured, not fixed at -100


def test_bf16_autocast_matches_the_autocast_reference() -> None:
    hidden, weight, _, targets = _inputs(n=64, h=32, v=1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)  # HF: bf16 matmul, logits.float()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)
    for g_ours, g_ref in zip(_grads(ours, hidden, weight), _grads(ref, hidden, weight), strict=True):
        assert g_ours.dtype == g_ref.dtype == torch.float32
        torch.testing.assert_close(g_ours, g_ref, rtol=5e-2, atol=5e-3)


def test_a_tied_weight_gets_both_gradients() -> None:
    emb = torch.nn.Embedding(200, 16)
    ids = torch.randint(0, 200, (4, 9))
    targets = torch.randint(0, 200, (36,))
    ours = chunked_linear_cross_entropy(emb(ids), emb.weight, targets, chunk_tokens=5)
    (g_ours,) = torch.autograd.grad(ours, emb.weight)
    ref = F.cross_entropy(emb(ids).reshape(-1, 16) @ emb.weight.T, targets)
    (g_ref,) = torch.autograd.grad(ref, emb.weight)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


def test_the_default_chunk_holds_256_mib_of_fp32_logits() -> None:
    assert default_chunk_tokens(128_256) == (256 << 20) // (4 * 128_256) == 523
    assert default_chunk_tokens(10**9) == 1


def test_bad_arguments_say_what_to_pass() -> None:
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match="reduction must be one of"):
        chunked_linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="weight must be"):
        chunked_linear_cross_entropy(hidden, weight.T, targets)


class TinyCausalLM(torch.nn.Module):
    """Shaped like a Hugging Face causal LM: a body, an output Linear, and forward(input_ids, labels)."""

    def __init__(self, vocab: int = 120, dim: int = 16) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim), torch.nn.Tanh())
        self.lm_head = torch.nn.Linear(dim, vocab)

    @property
    def base_model(self) -> torch.nn.Module:
        return self.body

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.lm_head(self.body(input_ids))
        if labels is None:
            return {"logits": logits}
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
        return {"logits": logits, "loss": F.cross_entropy(shifted.float(), labels[:, 1:].reshape(-1))}


def test_the_swapped_model_returns_the_shifted_loss_without_logits() -> None:
    torch.manual_seed(0)
    model = TinyCausalLM()
    ids = torch.randint(0, 120, (3, 11))
    labels = ids.clone()
    labels[0, 4:] = -100  # padding
    ref = model(ids, labels=labels)["loss"]
    ref_grad = torch.autograd.grad(ref, model.lm_head.weight)[0]
    use_chunked_cross_entropy(model, chunk_tokens=4)
    out = model(ids, labels=labels)
    assert isinstance(out, CausalLMOutput) and out.logits is None
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(out.loss, model.lm_head.weight)[0], ref_grad, rtol=1e-5,
                               atol=1e-6)
    # num_items_in_batch: HF's sum over the tokens divided by the count the trainer passes
    total = model(ids, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    valid = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(total, ref * valid / 7, rtol=1e-5, atol=1e-6)
    assert model(ids)["logits"].shape == (3, 11, 120)  # without labels the original forward runs


def test_a_model_without_an_output_layer_is_refused_with_what_to_do() -> None:
    with pytest.raises(WorkloadError, match="get_output_embeddings"):
        use_chunked_cross_entropy(torch.nn.Linear(4, 4))


# ------------------------------------------------------------------------- memfit estimates the knob right

V, H, B, T = 32_000, 128, 4, 2048  # 8192 tokens: four chunks of default_chunk_tokens(32000) = 2097


def _lm_workload(loss_impl: str, precision: str) -> Workload:
    return Workload(
        name="lm-32k",
        model=lambda: CausalLM(vocab=V, seq_len=T, dim=H, layers=1, heads=2),
        batch=lambda n: {"input_ids": torch.randint(0, V, (n, T)), "labels": torch.randint(0, V, (n, T))},
        loss=lambda out, batch: out.loss,
        optimizer=lambda p: torch.optim.AdamW(p),
        batch_size=B,
        precision=precision,
        keep_output=False,  # HF Trainer's loss-only step
        loss_impl=loss_impl,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_estimate_drops_by_the_logits_bytes_and_no_logits_tensor_is_left(precision: str) -> None:
    plain, chunked = estimate(_lm_workload("default", precision)), estimate(_lm_workload("chunked", precision))
    n, c = B * T, default_chunk_tokens(V)
    # plain, at its backward peak: log_softmax's fp32 output (saved for backward), nll_loss's gradient of it and
    # the logits' gradient, each N × V fp32 (the bf16 logits are freed once upcast)
    plain_logits = 3 * n * V * 4
    # chunked, at its peak: one chunk's fp32 logits (plus their bf16 copy under autocast) and the fp32 (V, H)
    # weight-gradient accumulator
    chunk_logits = c * V * (4 + (2 if precision == "bf16" else 0)) + V * H * 4
    saving = plain.peak_allocated_bytes - chunked.peak_allocated_bytes
    assert saving == pytest.approx(plain_logits - chunk_logits, rel=0.10)
    assert any(t.shape == (n, V) for t in plain.largest_tensors)
    assert not any(t.shape[-1:] == (V,) and math.prod(t.shape) >= n * V for t in chunked.largest_tensors)


def _tiny_llama() -> torch.nn.Module:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as exc:  # not installed, or installed without a working torchvision beside it
        pytest.skip(f"needs transformers with a loadable LlamaForCausalLM: {exc}")
    config = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_a_hugging_face_causal_lm_gets_its_own_loss_without_logits() -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 500, (2, 13))
    labels = ids.clone()
    labels[1, 9:] = -100
    ref = model(input_ids=ids, labels=labels)
    grads = torch.autograd.grad(ref.loss, model.lm_head.weight)[0]
    use_chunked_cross_entropy(model, chunk_tokens=5)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(out.loss, model.lm_head.weight)[0], grads, rtol=1e-4, atol=1e-6)
    assert model(input_ids=ids).logits.shape == (2, 13, 500)
