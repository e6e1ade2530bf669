"""Linear + cross-entropy over chunks of tokens, so the (tokens × vocabulary) logits never exist at once.

A language model's last layer turns N hidden states into N × V logits; with a 128k vocabulary and 8k tokens per
micro-batch that is 4 GiB of fp32 logits (Hugging Face upcasts them with ``logits.float()`` before the loss), plus
their bf16 copy and their gradient — often the largest tensors of the whole step. Liger Kernel and
cut-cross-entropy fuse the projection and the loss in Triton/CUDA kernels; this module does the same in plain
PyTorch, so it runs on every device and memfit traces it exactly on fake tensors.

Forward computes, chunk by chunk, the logits, their log-sum-exp and the loss, and keeps only the per-token
log-sum-exp (N floats). Backward recomputes each chunk's logits (one more N × H × V matmul: about a third more
head FLOPs), turns them into ``softmax - onehot`` and adds the chunk's share to the hidden-state and weight
gradients. The numerics follow Hugging Face under autocast: the matmul runs in the autocast dtype and the logits
are upcast to fp32 before the log-sum-exp.

Example (CPU)::

    >>> import torch
    >>> h, w, t = torch.randn(6, 8), torch.randn(50, 8), torch.randint(0, 50, (6,))
    >>> loss = chunked_linear_cross_entropy(h, w, t, chunk_tokens=4)
    >>> bool(torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.T, t)))
    True
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import WorkloadError

CHUNK_LOGITS_BYTES = 256 << 20
"""The fp32 logits one chunk may hold by default. At a 128k vocabulary that is 523 tokens, enough rows for the
chunk's GEMM to run near a tensor-core GPU's peak (tiles are 128-256 rows), and the same order as the (V, H)
weight-gradient product each backward chunk makes anyway (256 MiB for 128k × 1024 in bf16); smaller chunks save
little more memory and launch more kernels."""
REDUCTIONS = ("mean", "sum", "none")
LARGE_VOCAB = 32_000
"""From this vocabulary on (Llama 2, Mistral: 32k; Llama 3: 128k; Gemma: 256k) the logits are worth chunking."""
_UNSUPPORTED_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Hugging Face config fields of models whose forward changes the logits between the head and the loss
(Gemma 2/3 soft-capping, Cohere's logit_scale, Granite's logits_scaling): the chunked loss would differ."""


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk so a chunk's fp32 logits stay within ``CHUNK_LOGITS_BYTES`` (at least one)."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab))  # 4: bytes of an fp32 logit


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        ignore_index: int, reduction: str, chunk: int,
    ) -> torch.Tensor:
        device = hidden.device.type
        # the autocast dtype when autocast is on (as nn.Linear would compute), else the inputs' own dtype
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        n = hidden.shape[0]
        lse = hidden.new_empty(n, dtype=torch.float32)
        rows = hidden.new_empty(n, dtype=torch.float32)
        with torch.autocast(device, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, n, chunk):
                t = targets[s : s + chunk]
                logits = _logits(hidden[s : s + chunk].to(dtype), w, b).float()  # fp32, as HF's logits.float()
                lse[s : s + chunk] = torch.logsumexp(logits, dim=1)
                picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                rows[s : s + chunk] = (lse[s : s + chunk] - picked).masked_fill(t == ignore_index, 0.0)
                del logits  # free this chunk's logits before the next one's
        valid = targets != ignore_index
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.meta = (ignore_index, reduction, chunk, dtype)
        if reduction == "none":
            return rows
        total = rows.sum()
        return total / valid.sum() if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        ignore_index, reduction, chunk, dtype = ctx.meta
        valid = targets != ignore_index
        # d loss / d row-loss: grad_out per row ('none'), grad_out / count ('mean') or grad_out ('sum'); 0 if ignored
        if reduction == "none":
            scale = grad_out.float() * valid
        else:
            per = grad_out.float() / valid.sum() if reduction == "mean" else grad_out.float()
            scale = per * valid
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        device = hidden.device.type
        with torch.autocast(device, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, hidden.shape[0], chunk):
                h, t = hidden[s : s + chunk].to(dtype), targets[s : s + chunk]
                # softmax from the saved log-sum-exp, in place on the recomputed fp32 logits
                probs = _logits(h, w, b).float().sub_(lse[s : s + chunk].unsqueeze(1)).exp_()
                onehot = valid[s : s + chunk].to(probs.dtype).unsqueeze(1)
                probs.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -onehot)  # softmax - onehot
                g = probs.mul_(scale[s : s + chunk].unsqueeze(1)).to(dtype)
                del probs
                if grad_h is not None:
                    grad_h[s : s + chunk] = g @ w
                if grad_w is not None:
                    grad_w.add_(g.T @ h)  # accumulated in the weight's dtype (fp32 for an autocast model)
                if grad_b is not None:
                    grad_b.add_(g.sum(0))
                del g  # before the next chunk's logits: two chunks alive at once would double the saving's cost
        return grad_h, grad_w, grad_b, None, None, None, None


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return h @ w.T if b is None else torch.addmm(b, h, w.T)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, targets)`` without materialising the (N, V) logits.

    Args:
        hidden: (N, H) or (..., H) hidden states; leading axes are flattened.
        weight: (V, H), the output layer's weight (tied embeddings work: it is an ordinary input).
        targets: (N,) or (...,) class indices; ``ignore_index`` entries add nothing.
        bias: (V,) or None.
        ignore_index: target value to skip, as ``F.cross_entropy``.
        reduction: ``mean`` (over non-ignored targets), ``sum`` or ``none`` (per token, 0 where ignored).
        chunk_tokens: tokens per chunk; default ``default_chunk_tokens(V)`` (256 MiB of fp32 logits). Smaller saves
            memory down to the (V, H) weight-gradient product; larger launches fewer, fuller GEMMs.

    Memory: per chunk, the chunk's logits in the compute dtype and in fp32, plus one (V, H) product in backward.
    Speed: one more head matmul (recompute in backward), and a Python loop of N / chunk_tokens iterations.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}.")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (vocabulary, {hidden.shape[-1]}) to match hidden {tuple(hidden.shape)}, "
                         f"got {tuple(weight.shape)}.")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"targets have {t.shape[0]} entries but hidden has {h.shape[0]} rows.")
    chunk = default_chunk_tokens(weight.shape[0]) if chunk_tokens is None else chunk_tokens
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}.")
    out: torch.Tensor = _ChunkedLinearCrossEntropy.apply(h, weight, bias, t, ignore_index, reduction, chunk)
    return out.reshape(targets.shape) if reduction == "none" else out


# ------------------------------------------------------------------------------------------- causal LM swap


@dataclass
class CausalLMOutput:
    """A causal LM's output with labels: the loss, and the logits (None once the chunked loss is swapped in)."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None = None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` (mean reduction): fp32 logits, labels shifted left by one, the last
    position ignored. Padding the labels, not slicing the logits, avoids copying the (B, T, V) logits."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                             ignore_index=ignore_index)


def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output Linear if it can take the chunked loss, else None.

    It can when it is shaped like a Hugging Face causal LM: ``get_output_embeddings()`` returns an ``nn.Linear``,
    ``base_model`` is the body that returns the last hidden states, and its forward takes ``labels``.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    body = getattr(model, "base_model", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(body, torch.nn.Module) or body is model:
        return None
    return head


def use_chunked_cross_entropy(model: torch.nn.Module, *, chunk_tokens: int | None = None) -> torch.nn.Module:
    """Make ``model(input_ids, labels=...)`` compute its loss with ``chunked_linear_cross_entropy``, in place.

    For a Hugging Face causal LM (``*ForCausalLM``, ``GPT2LMHeadModel``) or any model with the same hooks (see
    ``output_head``). With labels, the forward runs ``model.base_model`` for the hidden states and returns the loss
    of Hugging Face's ``ForCausalLMLoss`` (labels shifted by one, ``-100`` ignored, ``shift_labels`` and
    ``num_items_in_batch`` honoured) with ``logits=None``: no (batch × sequence × vocabulary) tensor is made.
    Without labels (generation, evaluation of logits) the original forward runs.

    Raises:
        WorkloadError: the model has no output Linear memfit can find, or changes its logits before the loss.
    """
    head = output_head(model)
    if head is None:
        raise WorkloadError(
            f"{type(model).__name__} does not expose its output layer: the chunked cross-entropy needs a model "
            "with get_output_embeddings() returning an nn.Linear and a base_model returning hidden states "
            "(a Hugging Face causal LM has both). Compute the loss with "
            "memfit.workload.chunked_cross_entropy.chunked_linear_cross_entropy in your own forward instead."
        )
    config = getattr(model, "config", None)
    changed = [f for f in _UNSUPPORTED_CONFIG if getattr(config, f, None) not in (None, 1, 1.0)]
    if changed:
        raise WorkloadError(f"{type(model).__name__} transforms its logits before the loss ({', '.join(changed)}): "
                            "the chunked cross-entropy would compute another loss, so memfit does not swap it.")
    if getattr(model, "_memfit_chunked_ce", False):
        return model
    model.forward = _chunked_forward(model, model.forward, head, chunk_tokens)  # type: ignore[method-assign]
    model._memfit_chunked_ce = True  # type: ignore[assignment]
    return model


def _chunked_forward(model: torch.nn.Module, forward: Any, head: torch.nn.Linear, chunk_tokens: int | None) -> Any:
    @functools.wraps(forward)
    def run(input_ids: Any = None, attention_mask: Any = None, labels: torch.Tensor | None = None,
            **kwargs: Any) -> Any:
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if labels is None and kwargs.get("shift_labels") is None:
            return forward(input_ids, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        kwargs.pop("logits_to_keep", None)  # the loss covers every position, as HF's does with labels
        body: Any = model.base_model
        out = body(input_ids, **kwargs)
        hidden = out if isinstance(out, torch.Tensor) else out[0]  # HF: last_hidden_state comes first
        if shift_labels is None:
            assert labels is not None
            # tokens < n predict n: HF pads the labels with ignore_index on the right and drops the first
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = chunked_linear_cross_entropy(
            hidden, head.weight, shift_labels.to(hidden.device), head.bias, ignore_index=ignore_index,
            reduction="sum" if num_items is not None else "mean", chunk_tokens=chunk_tokens,
        )
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if isinstance(num_items, torch.Tensor) else num_items)
        return _output(model, loss, out)

    return run


def _output(model: torch.nn.Module, loss: torch.Tensor, body_out: Any) -> Any:
    if type(model).__module__.startswith("transformers.") and "transformers" in sys.modules:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(body_out, "hidden_states", None),
                                      attentions=getattr(body_out, "attentions", None))
    return CausalLMOutput(loss=loss)
