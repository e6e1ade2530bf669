"""Selective (op-level) activation checkpointing: keep the outputs of the expensive ops, recompute the cheap ones.

Full checkpointing of a block keeps only its inputs and runs its whole forward again in backward. Selective
checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) runs the block under a policy that
decides op by op: the outputs of matmuls, convolutions and fused attention kernels are kept from the forward (they
hold most of the FLOPs), everything else (pointwise ops, norms, activations, dropout, casts, copies) is recomputed
in backward from them. It keeps more memory than full checkpointing and recomputes much less: the recompute is
memory-bound kernels only.

Example (CPU)::

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> checkpoint(block, x, use_reentrant=False, context_fn=selective_contexts).sum().backward()
    >>> x.grad.shape
    torch.Size([4, 8])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

SAVED_OPS: frozenset[str] = frozenset((
    # matmuls: nn.Linear, einsum and torch.matmul reach autograd's dispatch as these (addmm for a 2-D input with a
    # bias, mm / bmm otherwise; _addmm_activation is CUDA's addmm fused with GELU/ReLU)
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "_scaled_mm", "_grouped_mm",
    # convolutions: every Conv*d and ConvTranspose*d, on CPU and CUDA, dispatches aten::convolution
    "convolution",
    # fused attention kernels: CUDA's flash, memory-efficient and cuDNN kernels, and the CPU flash kernel. Their
    # outputs include the log-sum-exp (and the dropout RNG state) that their backward needs.
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
))
"""ATen ops (overload packets, by name) whose outputs selective checkpointing keeps; names this torch lacks are
skipped. The names were read from traces of nn.Linear, Conv1d-3d, ConvTranspose2d/3d, Hugging Face GPT-2's Conv1D
and ``scaled_dot_product_attention`` under torch 2.13 (CPU) and torch's CUDA kernel selection
(``torch/nn/attention/__init__.py``, ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``)."""

_SAVED_PACKETS = frozenset(getattr(torch.ops.aten, name) for name in SAVED_OPS if hasattr(torch.ops.aten, name))


def saves_output(func: Any) -> bool:
    """Whether selective checkpointing keeps the output of the ATen op ``func`` (an ``OpOverload``)."""
    return getattr(func, "overloadpacket", None) in _SAVED_PACKETS


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if saves_output(func):
        REGIONS.saved_in_forward += 1
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@dataclass
class _Regions:
    """Where the step is relative to selectively checkpointed blocks, for the tracer's cost accounting.

    Every op run inside such a block (in forward and in its recompute) goes through torch's Python dispatch modes
    for selective checkpointing; the outputs it keeps are handed back in the recompute without running a kernel.
    The tracer reads ``depth`` for the first and sets ``on_recompute`` for the second; nothing else reads them.
    """

    depth: int = 0
    """How many selectively checkpointed regions (forward or recompute) are open now."""
    saved_in_forward: int = 0
    """Ops whose outputs the policy kept, counted since the last recompute began."""
    on_recompute: Callable[[int], None] | None = None
    """Called as a recompute begins, with the number of kept outputs it will hand back without a kernel."""


REGIONS = _Regions()


class _Region:
    """One of torch's two dispatch modes for selective checkpointing, entered and left with ``REGIONS`` kept."""

    def __init__(self, mode: Any, *, recompute: bool, saved: list[int]) -> None:
        self._mode, self._recompute, self._saved = mode, recompute, saved

    def __enter__(self) -> Any:
        if self._recompute and REGIONS.on_recompute is not None:
            REGIONS.on_recompute(self._saved[0])
        else:
            REGIONS.saved_in_forward = 0
        REGIONS.depth += 1
        return self._mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._mode.__exit__(*exc)
        finally:
            REGIONS.depth -= 1
            if not self._recompute:
                self._saved[0] = REGIONS.saved_in_forward


def selective_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for memfit's policy (``SAVED_OPS``): a forward
    context that keeps the outputs of the expensive ops and a recompute context that hands them back."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    saved = [0]  # the kept outputs of this call's forward: what its recompute hands back
    return _Region(forward, recompute=False, saved=saved), _Region(recompute, recompute=True, saved=saved)
