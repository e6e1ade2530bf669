"""A ``Workload`` from a model the user already built and one batch of their data, without copying the weights.

A ``Workload`` is a recipe of factories (``memfit.workload.spec``): the planner builds the model on fake tensors
at every size it tries. A framework integration holds a built model instead, often already on the GPU. Its
factory here deep-copies the model with every parameter and buffer replaced by a tensor on the ``meta`` device
(shape and dtype, no data), then makes each anew on the device memfit builds on, so planning costs no copy of
the weights. Other attributes of the model are copied as they are; objects named in ``detach`` (the
Lightning ``Trainer`` the module points to) become ``None`` in the copy.

The batch factory repeats the first sample of the user's batch ``n`` times: the planner sees the shapes and
dtypes of the real data (sequence length, image size), with values that keep embeddings and label indices valid.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from memfit._torch_private import no_dispatch_modes
from memfit.errors import UsageError
from memfit.guard import microbatch

__all__ = ["batch_factory", "meta_copy", "model_factory"]


def meta_copy(module: nn.Module, *, detach: Iterable[object] = ()) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no data copied)."""
    memo: dict[int, Any] = {id(obj): None for obj in detach if obj is not None}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def model_factory(template: nn.Module, *, dtype: torch.dtype | None = None) -> Callable[[], nn.Module]:
    """A factory that builds ``template`` (a meta copy) on the current default device, values unset.

    The planner calls it inside its device context (fake tensors); weights' values never matter there. Each
    parameter and buffer is made anew on that device (tied parameters stay tied). ``dtype`` casts floating-point
    parameters and buffers (a ``bf16-true`` Lightning run keeps its weights in bf16).
    """

    def build() -> nn.Module:
        # copied as real (meta) objects: the planner's fake-tensor modes would otherwise see the copy's storages
        with no_dispatch_modes():
            model = copy.deepcopy(template)
        made: dict[int, torch.Tensor] = {}

        def fresh(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                new = torch.empty(t.shape, dtype=cast, device=torch.get_default_device())
                made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
            return made[id(t)]

        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                setattr(module, name, fresh(p))  # Module.__setattr__ registers a Parameter under that name
            for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                setattr(module, name, fresh(b))  # ... and replaces a registered buffer, keeping it persistent or not
        return model

    return build


def batch_factory(batch: Any) -> tuple[Callable[[int], Any], int]:
    """A factory of batches of ``n`` samples shaped like ``batch``'s, and ``batch``'s own size.

    Raises:
        UsageError: ``batch`` has no tensor with a batch dimension, or holds a type that cannot be rebuilt.
    """
    size = microbatch.batch_size(batch)
    _check(batch)

    def make(n: int) -> Any:
        return _grow(batch, operator.index(n))

    return make, size


def _check(value: Any) -> None:
    if isinstance(value, (torch.Tensor, str, bytes, int, float, bool)) or value is None:
        return
    if isinstance(value, Mapping):
        for v in value.values():
            _check(v)
        return
    if isinstance(value, (tuple, list)):
        for v in value:
            _check(v)
        return
    raise UsageError(
        f"memfit cannot plan for a batch holding a {type(value).__name__}: it rebuilds batches of tensors in "
        "tuples, lists and dicts. Plan with memfit.plan(Workload(...)) for this data, or pass a batch of tensors."
    )


def _grow(value: Any, n: int) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        first = value[:1].detach().to(torch.get_default_device())
        return first.expand(n, *first.shape[1:]).clone()  # a real n-sample tensor, not a stride-0 view
    if isinstance(value, Mapping):
        return {k: _grow(v, n) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple: positional constructor
        return type(value)(*(_grow(v, n) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_grow(v, n) for v in value)
    return value
