"""Sharding when model states dominate: FSDP2 set-up with sensible wrapping, and per-rank model-state memory.

Per rank, DDP keeps a full copy of parameters, gradients and optimizer state, plus gradient buckets; FSDP2
(``fully_shard``) keeps ``1/world`` of each (ZeRO-3, Rajbhandari et al. SC20) plus the unsharded parameters of the
unit being computed. :func:`model_state_memory` gives both from the model's parameter shapes, term by term, so a
planner can decide; the terms are checked against real tensors in ``tests/test_shard.py``.

FSDP2 moved from ``torch.distributed._composable.fsdp`` (torch 2.4-2.5) to ``torch.distributed.fsdp`` (2.6+):
``memfit._torch_private.load_fully_shard`` finds it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    >>> ddp = model_state_memory(model, strategy="ddp", world_size=8, optimizer="adamw")
    >>> fsdp = model_state_memory(model, strategy="fsdp", world_size=8, optimizer="adamw")
    >>> round(ddp.total_bytes / fsdp.total_bytes, 1) > 3
    True
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn

from memfit import _torch_private as tp
from memfit.errors import UsageError
from memfit.records import JsonRecord

logger = logging.getLogger(__name__)

# torch/nn/parallel/distributed.py: _DEFAULT_BUCKET_CAP_MB = 25 (MiB: _MB_TO_BYTES = 1024 * 1024); the first bucket
# is dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) so the first all-reduce starts early.
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024

# torch.optim keeps ``state["step"]`` as a float32 scalar tensor per parameter (Adam, AdamW, Adagrad, RMSprop).
STEP_TENSOR_BYTES = 4

Strategy = Literal["ddp", "fsdp"]


def find_blocks(model: nn.Module, block_types: Iterable[type[nn.Module]] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules to shard one by one: each repeated block, outermost only, in definition order.

    Without ``block_types``, a block is a child of a ``ModuleList``, ``ModuleDict`` or ``Sequential`` whose class
    repeats at least twice there and which holds parameters: transformer layers, U-Net stages, ResNet blocks.
    """
    types = tuple(block_types) if block_types is not None else None
    chosen: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if types is not None:
            candidates = [(name, module)] if isinstance(module, types) and module is not model else []
        elif isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential):
            children = list(module.named_children())
            counts = Counter(type(c) for _, c in children)
            candidates = [(f"{name}.{n}" if name else n, c) for n, c in children
                          if counts[type(c)] >= 2 and any(True for _ in c.parameters())]
        else:
            candidates = []
        for cname, child in candidates:
            chosen.append((cname, child))
            inside.update(id(m) for m in child.modules())
    return chosen


@dataclass(frozen=True, kw_only=True)
class Sharding(JsonRecord):
    """What :func:`shard_model` wrapped."""

    units: tuple[str, ...]
    """Qualified names of the modules given their own ``fully_shard`` call; the root (``""``) comes last."""
    reshard_after_forward: bool


def shard_model(
    model: nn.Module,
    *,
    block_types: Iterable[type[nn.Module]] | None = None,
    reshard_after_forward: bool = True,
    **fully_shard_kwargs: Any,
) -> Sharding:
    """Apply FSDP2 to ``model`` in place: each repeated block, then the root (needs an initialised process group).

    Sharding block by block means only one block's parameters are unsharded at a time (plus the prefetched next),
    instead of the whole model. The root call groups the leftover parameters (embeddings, heads).

    Args:
        model: The model, already on its device (or on ``meta`` for deferred init).
        block_types: Classes to treat as blocks; by default found by :func:`find_blocks`.
        reshard_after_forward: ``True`` frees unsharded params after forward (ZeRO-3, least memory, one more
            all-gather in backward); ``False`` keeps them to backward (ZeRO-2-like, faster, more memory).
        **fully_shard_kwargs: Passed on (``mesh``, ``mp_policy``, ``offload_policy``).
    """
    fully_shard = tp.load_fully_shard()
    blocks = find_blocks(model, block_types)
    for _name, block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    # the root's params are needed again right at the start of backward (the head), so keep them unsharded
    fully_shard(model, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    units = tuple(n for n, _ in blocks) + ("",)
    logger.info("fully_shard applied to %d blocks and the root", len(blocks))
    return Sharding(units=units, reshard_after_forward=reshard_after_forward)


@dataclass(frozen=True, kw_only=True)
class ModelStateMemory(JsonRecord):
    """Per-rank bytes of model states under one strategy; every term is a formula of the parameter shapes."""

    _json_properties: ClassVar[tuple[str, ...]] = ("resident_bytes", "total_bytes")

    strategy: Strategy
    world_size: int
    optimizer: str
    num_params: int
    params_bytes: int
    """Resident parameters: full under DDP; under FSDP each tensor's dim-0 shard, padded to ceil(dim0 / world)."""
    master_params_bytes: int
    """An extra fp32 copy of low-precision params kept by the optimizer wrapper (0 unless asked for)."""
    grads_bytes: int
    """Gradients, same shapes as the resident params, in grad_dtype."""
    optimizer_state_bytes: int
    """Optimizer state: per-element buffers (Adam: exp_avg, exp_avg_sq) plus one float32 step per tensor."""
    buckets_bytes: int
    """DDP gradient buckets: all buckets exist at once, ~ one more copy of the grads (0 with
    gradient_as_bucket_view=True, and 0 for FSDP)."""
    transient_bytes: int
    """FSDP only, an estimate: the largest unit unsharded twice (computing + prefetched) plus its reduce-scatter
    input (research/techniques.md §3.3, derived from pytorch PR 117323). Not part of ``resident_bytes``."""

    @property
    def resident_bytes(self) -> int:
        """Bytes held through the whole step: params + master + grads + optimizer state + buckets."""
        return (self.params_bytes + self.master_params_bytes + self.grads_bytes + self.optimizer_state_bytes
                + self.buckets_bytes)

    @property
    def total_bytes(self) -> int:
        """Resident plus transient: what model states add to the per-rank peak, before activations."""
        return self.resident_bytes + self.transient_bytes


def _state_elements_per_param(optimizer: str, momentum: float, amsgrad: bool, centered: bool) -> tuple[int, bool]:
    """(buffers of param size, has a step tensor) per parameter, from torch/optim/<optimizer>.py ``_init_group``."""
    if optimizer in ("adam", "adamw"):
        return 2 + int(amsgrad), True  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if optimizer == "sgd":
        return int(momentum > 0), False  # momentum_buffer, only with momentum
    if optimizer == "adagrad":
        return 1, True  # sum
    if optimizer == "rmsprop":
        return 1 + int(momentum > 0) + int(centered), True  # square_avg (+ momentum_buffer, grad_avg)
    raise UsageError(f"Unknown optimizer {optimizer!r}; use 'adam', 'adamw', 'sgd', 'adagrad' or 'rmsprop'.")


def _shard_numel(shape: torch.Size, world_size: int) -> int:
    """Elements of rank 0's shard: FSDP2 chunks dim 0 into ceil(dim0 / world) rows (rank 0 is never short)."""
    if len(shape) == 0:
        return 1
    rows = math.ceil(shape[0] / world_size)
    return rows * math.prod(shape[1:])


def model_state_memory(
    model: nn.Module,
    *,
    strategy: Strategy,
    world_size: int,
    optimizer: str = "adamw",
    param_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype | None = None,
    state_dtype: torch.dtype = torch.float32,
    master_weights: bool = False,
    momentum: float = 0.0,
    amsgrad: bool = False,
    centered: bool = False,
    gradient_as_bucket_view: bool = False,
    compute_dtype: torch.dtype | None = None,
    block_types: Iterable[type[nn.Module]] | None = None,
) -> ModelStateMemory:
    """Per-rank model-state memory of ``model`` under DDP or FSDP2; shapes only, so a meta-device model works.

    Args:
        model: The model (trainable params only are counted).
        strategy: ``"ddp"`` or ``"fsdp"``.
        world_size: Ranks sharing the model (FSDP shards over all of them).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"adagrad"`` or ``"rmsprop"``.
        param_dtype: dtype of the resident (for FSDP: sharded) parameters.
        grad_dtype: dtype of gradients; defaults to ``param_dtype``.
        state_dtype: dtype of optimizer buffers (torch creates them like the param; bf16 states halve them).
        master_weights: Count an extra fp32 copy of the params (pure-bf16 training with fp32 master weights).
        momentum, amsgrad, centered: Optimizer options that add buffers.
        gradient_as_bucket_view: DDP option; grads become views of the buckets, removing one grad-sized copy.
        compute_dtype: FSDP all-gather dtype (``MixedPrecisionPolicy.param_dtype``); defaults to ``param_dtype``.
        block_types: FSDP unit classes, as for :func:`shard_model`, for the transient term.
    """
    if strategy not in ("ddp", "fsdp"):
        raise UsageError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}.")
    if world_size < 1:
        raise UsageError(f"world_size must be >= 1, got {world_size}.")
    optimizer = optimizer.lower()
    buffers, has_step = _state_elements_per_param(optimizer, momentum, amsgrad, centered)
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy == "ddp":
        numel = sum(p.numel() for p in params)
    else:
        numel = sum(_shard_numel(p.shape, world_size) for p in params)
    p_size = torch.empty((), dtype=param_dtype).element_size()
    g_size = torch.empty((), dtype=grad_dtype or param_dtype).element_size()
    s_size = torch.empty((), dtype=state_dtype).element_size()
    grads = numel * g_size
    transient = 0
    if strategy == "fsdp" and world_size > 1:
        c_size = torch.empty((), dtype=compute_dtype or param_dtype).element_size()
        blocks = find_blocks(model, block_types)
        units = [sum(p.numel() for p in block.parameters() if p.requires_grad) for _, block in blocks]
        root = sum(p.numel() for p in params) - sum(units)
        largest = max(units + [root])
        transient = 2 * largest * c_size + largest * g_size
    return ModelStateMemory(
        strategy=strategy,
        world_size=world_size,
        optimizer=optimizer,
        num_params=sum(p.numel() for p in params),
        params_bytes=numel * p_size,
        master_params_bytes=numel * 4 if master_weights else 0,
        grads_bytes=grads,
        optimizer_state_bytes=buffers * numel * s_size + (STEP_TENSOR_BYTES * len(params) if has_step else 0),
        buckets_bytes=grads if strategy == "ddp" and not gradient_as_bucket_view else 0,
        transient_bytes=transient,
    )


@dataclass(frozen=True, kw_only=True)
class ShardingComparison(JsonRecord):
    """DDP vs FSDP per-rank model-state memory for one model, optimizer and world size."""

    _json_properties: ClassVar[tuple[str, ...]] = ("fsdp_saves_bytes",)

    ddp: ModelStateMemory
    fsdp: ModelStateMemory

    @property
    def fsdp_saves_bytes(self) -> int:
        return self.ddp.total_bytes - self.fsdp.total_bytes


def compare_sharding(model: nn.Module, *, world_size: int, **kwargs: Any) -> ShardingComparison:
    """:func:`model_state_memory` for both strategies with the same options."""
    return ShardingComparison(
        ddp=model_state_memory(model, strategy="ddp", world_size=world_size, **kwargs),
        fsdp=model_state_memory(model, strategy="fsdp", world_size=world_size, **kwargs),
    )
