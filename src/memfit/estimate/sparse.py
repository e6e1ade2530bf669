"""Sparse COO tensors under the trace, with CUDA's sizes: ``nn.Embedding(sparse=True)``'s gradients and what the
optimizers do with them.

FakeTensorMode keeps a sparse tensor's nnz only when it is built from its parts: its ``clone`` and
``_embedding_bag_backward`` return an empty sparse tensor (nnz 0), and a sparse ``mul_`` has no fake kernel at all
(torch 2.14), so a sparse gradient, SGD's momentum buffer and SparseAdam's update would take no memory in the
trace. The rules here build each result from fake indices and values of the size CUDA's kernels give:

* the gradient of a sparse embedding bag has one row per index looked up, uncoalesced
  (``_embedding_bag_sparse_backward`` -> ``embedding_sparse_backward``, aten/src/ATen/native/EmbeddingBag.cpp and
  Embedding.cpp: the same code on CUDA);
* ``sparse.add_(sparse)`` concatenates indices and values without merging them ("We deliberately choose to simply
  concat", ``add_out_sparse_cuda``, aten/src/ATen/native/sparse/cuda/SparseCUDATensorMath.cu), so SGD's sparse
  momentum buffer grows by one gradient's rows each step; ``dense.add_(sparse)`` allocates only a flattened copy
  of the indices when there are several sparse dimensions (``add_out_dense_sparse_cuda``, ``flatten_indices``);
* ``sparse.mul_(scalar)`` scales the values in place;
* ``coalesce`` keeps one row per distinct index: its size needs the indices' values, which are followed from the
  batch (``SparseValues``); without them the tracer asks for a retry with the batch's values known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit import _torch_private as tp
from memfit.estimate.data_dependent import ValueOf


class SparseValuesNeeded(Exception):
    """The op's size needs the values of a sparse tensor's indices, which are not known: the op's name."""


class SparseValues:
    """The real indices of the fake sparse tensors whose indices have known values (from the batch)."""

    def __init__(self, value_of: ValueOf) -> None:
        self.value_of = value_of
        """The known value of a dense fake tensor (memfit.estimate.values.KnownValues.value)."""
        self._indices: Any = tp.WeakIdKeyDictionary()

    def indices(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real (sparse_dim, nnz) indices of the sparse tensor ``t``, or None when they are not known."""
        return self._indices.get(t)

    def note(self, t: torch.Tensor, indices: torch.Tensor | None) -> None:
        if indices is not None:
            self._indices[t] = indices


Result = tuple[Any, int, tuple[torch.Tensor, ...]] | None
"""(the op's output, bytes of scratch memory CUDA's kernel takes and gives back, what the op lets go of: to be
dropped only after the output is tracked, as the kernel frees it after making the output), or None: not a case
for a rule."""


def has_sparse(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.layout == torch.sparse_coo for a in args)


def _clone(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    t = args[0]
    if t.layout != torch.sparse_coo:
        return None
    indices, values = tp.coo_parts(t)
    out = tp.sparse_coo(indices.clone(), values.clone(), t, coalesced=t.is_coalesced())
    state.note(out, state.indices(t))
    return out, 0, ()


def _mul_in_place(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    t, factor = args[0], args[1]
    if t.layout != torch.sparse_coo or (isinstance(factor, torch.Tensor) and factor.dim() != 0):
        return None
    return t, 0, ()  # the values are scaled where they are (mul_out_sparse_zerodim)


def _add_in_place(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    t, other = args[0], args[1]
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    if not isinstance(other, torch.Tensor) or other.layout != torch.sparse_coo:
        return None
    other_indices, other_values = tp.coo_parts(other)
    if t.layout == torch.strided:
        # index_add_ of the values into the dense tensor, through flattened indices: a view of the indices for
        # one sparse dimension, a new int64 tensor for several
        return t, (0 if other.sparse_dim() == 1 or other.is_coalesced() else 8 * other_indices.shape[1]), ()
    indices, values = tp.coo_parts(t)
    scaled = other_values.numel() * other_values.element_size() if alpha != 1 else 0  # s_values.mul(alpha)
    merged = tp.sparse_coo(torch.cat([indices, other_indices], 1), torch.cat([values, other_values]), t,
                           coalesced=False)
    known, other_known = state.indices(t), state.indices(other)
    tp.set_sparse(t, merged)  # CUDA concatenates into new tensors, then lets go of the old ones
    if known is not None and other_known is not None:
        with tp.no_dispatch_modes():  # real tensors: the fake mode would make them fake
            state.note(t, torch.cat([known, other_known], 1))
    return t, scaled, (indices, values)


def _coalesce(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    t = args[0]
    if t.layout != torch.sparse_coo:
        return None
    known = state.indices(t)
    if known is None:
        raise SparseValuesNeeded("coalesce")
    with tp.no_dispatch_modes():
        distinct = torch.unique(known, dim=1) if known.numel() else known
    indices, values = tp.coo_parts(t)
    out = tp.sparse_coo(indices.new_empty((t.sparse_dim(), distinct.shape[1])),
                        values.new_empty((distinct.shape[1], *values.shape[1:])), t, coalesced=True)
    state.note(out, distinct)
    return out, 0, ()


def _embedding_bag_backward(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    # (grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
    #  sparse, per_sample_weights, padding_idx=-1)
    padding_idx = args[11] if len(args) > 11 else kwargs.get("padding_idx", -1)
    if not args[9] or padding_idx not in (-1, None):
        return None  # dense, or a padding index whose rows are dropped: a size that needs values
    grad, indices, offsets, offset2bag, bag_size = args[:5]
    if offset2bag.numel() != indices.numel():
        # the forward's fake kernel leaves offset2bag empty, as CPU's fast path for sums does; CUDA's has one bag
        # number per index (embedding_bag_cuda), which the backward gathers the bags' gradients by
        offset2bag = indices.new_empty(indices.shape)
    out = tp.embedding_bag_sparse_backward(
        grad, indices, offsets, offset2bag, bag_size, args[6], args[7], args[8], args[10], -1)
    known = state.value_of(indices)
    if known is not None:
        with tp.no_dispatch_modes():
            state.note(out, known.reshape(1, -1).long())
    return out, 0, ()


def _sparse_mask(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    # dense.sparse_mask(sparse): the dense tensor's values at the mask's indices (SparseAdam's state update), as
    # ``t.mul(mask_template)`` (aten/src/ATen/native/sparse/SparseTensor.cpp): new indices and values of its nnz
    t, mask = args[0], args[1]
    if t.layout != torch.strided or mask.layout != torch.sparse_coo:
        return None
    indices, values = tp.coo_parts(mask)
    out = tp.sparse_coo(indices.clone(), values.new_empty(values.shape, dtype=t.dtype), mask,
                        coalesced=mask.is_coalesced())
    state.note(out, state.indices(mask))
    return out, 0, ()


def _from_parts(state: SparseValues, args: Any, kwargs: dict[str, Any]) -> Result:
    # (sparse_dim, dense_dim, size, indices, values, ...): FakeTensorMode keeps the nnz here; note the indices
    out = tp.sparse_coo_op(*args, **kwargs)
    state.note(out, state.value_of(args[3]))
    return out, 0, ()


RULES: dict[str, Callable[[SparseValues, Any, dict[str, Any]], Result]] = {
    "_sparse_coo_tensor_with_dims_and_tensors": _from_parts,
    "clone": _clone,
    "sparse_mask": _sparse_mask,
    "mul_": _mul_in_place,
    "add_": _add_in_place,
    "_coalesce": _coalesce,
    "_embedding_bag_backward": _embedding_bag_backward,
}
"""Op name -> its rule; a rule returns None for calls it does not handle (dense tensors)."""


def foreach_in_place(state: SparseValues, name: str, args: Any, kwargs: dict[str, Any]) -> list[Result] | None:
    """The per-tensor rules of an in-place foreach op over sparse tensors (``_foreach_add_`` of SGD's momentum
    buffers): CUDA's foreach kernels take dense tensors only and fall back to one op per tensor
    (aten/src/ATen/native/ForeachUtils.h, ``can_use_fast_route``). None when no tensor is sparse."""
    rule = RULES.get(name.removeprefix("_foreach_"))
    tensors = args[0] if args and isinstance(args[0], (list, tuple)) else ()
    if rule is None or not any(t.layout == torch.sparse_coo for t in tensors):
        return None
    others = args[1] if len(args) > 1 else None
    return [rule(state, (t, others[i] if isinstance(others, (list, tuple)) else others, *args[2:]), kwargs)
            for i, t in enumerate(tensors)]

