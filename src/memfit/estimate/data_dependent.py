"""Output sizes of the ops whose sizes depend on tensor values: ``nonzero``, boolean masks, ``bincount`` ...

Fake tensors have no values, so FakeTensorMode refuses these ops (``DynamicOutputShapeException``). The tracer
answers them here, cheapest first:

1. **Provable without values.** ``bincount(x, minlength=n)`` of indices that ``topk``, ``argmax`` or ``sort``
   took over a dimension of size <= n has exactly n bins: ``IndexBounds`` follows such indices through views and
   copies (the load-balancing loss of Hugging Face's MoE models counts the experts each token picked this way).
2. **Decided by known values.** The op's size depends on some of its arguments only (a boolean mask, sequence
   lengths), and those have known values (memfit.estimate.values: constants, or the batch's values on a retry):
   ``size_from_known_values``.
3. **From one real forward.** Otherwise the values come from the model (a detector's proposals after NMS): the
   forward and loss of the first step run once for real on the CPU, which keeps what these ops returned, in call
   order (``RealForward``); the traced steps take their sizes from there. Its large convolutions, matrix
   products and batch norms are not computed but stood in for by noise of the scale they would give
   (``ProductStandIns``): the data are random either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit import _torch_private as tp
from memfit.estimate.values import tensors

ValueOf = Callable[[torch.Tensor], "torch.Tensor | None"]
"""The real CPU tensor a (fake) tensor stands for, or None when its values are not known."""

# refused by FakeTensorMode like the tagged ops, but carry no ``dynamic_output_shape`` tag (torch 2.14)
_UNTAGGED_DYNAMIC = frozenset({"_pack_padded_sequence"})

_DYNAMIC: dict[Any, bool] = {}


def is_dynamic(func: Any, name: str) -> bool:
    """``func``'s output size can depend on its inputs' values (the ops that ``RealForward`` keeps): ATen's ops
    tagged so, and every op of another library (torchvision's ``nms`` is not tagged), which are few."""
    try:
        return _DYNAMIC[func]
    except KeyError:
        found = _DYNAMIC[func] = (torch.Tag.dynamic_output_shape in func.tags or name in _UNTAGGED_DYNAMIC
                                  or func.namespace not in ("aten", "prim"))
        return found


def deciding_inputs(name: str, args: Any) -> list[torch.Tensor]:
    """The arguments whose values decide the op's output size (all its tensors, but for the ops below)."""
    if name == "index":  # the boolean masks among the indices; integer indices keep their count
        return [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if name == "masked_select":
        return [args[1]]
    if name == "_pack_padded_sequence":
        return [args[1]]
    if name == "_ctc_loss":  # the target lengths (a list has its values)
        return [args[3]] if isinstance(args[3], torch.Tensor) else []
    return tensors(list(args))


def _shapes(args: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors(list(args)))


# -- 1. provable bounds -------------------------------------------------------------------------------------------

# ops whose output holds some of their input's elements, rearranged (views, copies): a bound on the values holds
_KEEPS_VALUES = frozenset(
    "view _unsafe_view reshape permute transpose t expand select slice squeeze unsqueeze clone alias detach "
    "contiguous narrow unbind split split_with_sizes chunk flatten _to_copy lift_fresh_copy".split()
)


class IndexBounds:
    """Integer tensors whose values are provably in ``[0, n)``: indices into a dimension of size n."""

    def __init__(self) -> None:
        self._bound: Any = tp.WeakIdKeyDictionary()

    def follow(self, name: str, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Note the bounds ``out`` inherits from the op that made it."""
        if name == "topk":  # (self, k, dim=-1, largest, sorted) -> (values, indices)
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            self._set(out[1], args[0].size(dim) if args[0].dim() else 1)
        elif name in ("sort", "max", "min") and isinstance(out, (tuple, list)) and len(out) == 2:
            dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
            self._set(out[1], args[0].size(dim) if args[0].dim() else 1)
        elif name in ("argmax", "argmin"):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            self._set(out, args[0].numel() if dim is None else (args[0].size(dim) if args[0].dim() else 1))
        elif name in _KEEPS_VALUES and args and isinstance(args[0], torch.Tensor) and args[0] in self._bound:
            bound = self._bound[args[0]]
            for t in tensors(out):
                if t.dtype in (torch.int64, torch.int32) and bound <= torch.iinfo(t.dtype).max:
                    self._set(t, bound)

    def _set(self, t: Any, bound: int) -> None:
        if isinstance(t, tp.FakeTensor) and not t.is_floating_point():
            self._bound[t] = bound

    def bincount(self, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """``bincount``'s output when its size is provable: indices below ``minlength`` give exactly ``minlength``
        bins (the kernel sizes its output ``max(minlength, max(x) + 1)``: aten/src/ATen/native/SummaryOps.cpp)."""
        x = args[0]
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        if weights is not None or x.dim() != 1 or x not in self._bound or not 0 < self._bound[x] <= minlength:
            return None
        return torch.empty(minlength, dtype=torch.int64, device=x.device)


SMALL_MASK_BYTES = 1 << 20
"""A boolean mask made from the model's values whose selection can take at most this many bytes is taken at its
largest (every element selected) rather than sized by a real forward (``StepValues.sized_without_all_values``). The
estimate can only come out over: by at most this much for the selection, and by what the step computes from it,
which grows with it; one real forward of a detector costs more than the rest of its estimate (torchvision's
RetinaNet v2: a GIoU loss's mask over the matched anchors' predicted boxes, ``_loss_inter_union``, a few KiB, sent a
4 x 800^2 forward to the CPU; on ten detection and mask steps peaks and ``fits_in`` came out the same to the byte,
benchmarks/results/estimate/estimate_time_small_masks_cpu_torch2.14_20261128_s24.md)."""


class MaskCounts:
    """How many elements boolean masks selected, learned where a value-dependent op they fed was sized.

    ``x[mask] = v`` (``index_put_``) saves ``mask`` for backward, which takes ``grad[mask]``: an ``index`` whose
    size the same mask decides, but in backward, where no real forward ran (torchvision's FCOS box loss,
    ``_loss_inter_union``). The count learned from the forward's op (sized by the batch's values or the real
    forward) sizes it: ``x[mask]`` has as many rows as ``mask`` has True, whatever ``x`` holds (the definition of
    boolean indexing). A mask is known by its storage, offset, shape and strides, which autograd's saved copy
    shares.
    """

    def __init__(self) -> None:
        self._counts: Any = tp.WeakIdKeyDictionary()  # storage -> {(offset, shape, strides): count}

    @staticmethod
    def _mask(name: str, args: Any) -> tuple[int, torch.Tensor] | None:
        """(the dimension it indexes from, the mask) of ``x[..., mask]``: one boolean index, others slices."""
        if name != "index" or len(args) < 2:
            return None
        found = [(i, t) for i, t in enumerate(args[1]) if t is not None]
        if len(found) != 1 or found[0][1].dtype not in (torch.bool, torch.uint8):
            return None
        return found[0]

    @staticmethod
    def _key(mask: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        return int(mask.storage_offset()), tuple(mask.shape), tuple(mask.stride())

    def learn(self, name: str, args: Any, out: Any) -> None:
        """Note the count of the mask of ``x[mask]`` (``index``) whose output ``out`` was sized."""
        found = self._mask(name, args) if isinstance(out, torch.Tensor) else None
        if found is not None:
            dim, mask = found
            self._counts.setdefault(mask.untyped_storage(), {})[self._key(mask)] = out.shape[dim]

    def index(self, name: str, args: Any) -> torch.Tensor | None:
        """The output of ``x[mask]`` (``index``) when the mask's count is known; runs under the fake mode."""
        found = self._mask(name, args)
        if found is None:
            return None
        dim, mask = found
        count = self._counts.get(mask.untyped_storage(), {}).get(self._key(mask))
        if count is None:
            return None
        x = args[0]
        return x.new_empty((*x.shape[:dim], count, *x.shape[dim + mask.dim():]))

    def largest(self, name: str, args: Any, max_bytes: int) -> torch.Tensor | None:
        """The output of ``x[mask]`` (``index``) with every element of the mask selected, where that output takes at
        most ``max_bytes``; None otherwise. Runs under the fake mode."""
        found = self._mask(name, args)
        if found is None:
            return None
        dim, mask = found
        x = args[0]
        shape = (*x.shape[:dim], mask.numel(), *x.shape[dim + mask.dim():])
        if math.prod(shape) * x.element_size() > max_bytes:
            return None
        return x.new_empty(shape)


# -- 2. sizes from known values -----------------------------------------------------------------------------------


def size_from_known_values(name: str, args: Any, kwargs: dict[str, Any], value_of: ValueOf,
                           ) -> tuple[Any, Any] | None:
    """(fake output, real output or None) of an op whose size is decided by arguments with known values (the
    other arguments' values do not change it), or None. Runs under the fake mode: new tensors are fake."""
    if name == "index":  # x[mask] is x[mask.nonzero(as_tuple=True)]: the definition of boolean indexing
        indices: list[torch.Tensor | None] = []
        for i in args[1]:
            if i is not None and i.dtype in (torch.bool, torch.uint8):
                real = value_of(i)
                if real is None:
                    return None
                with tp.no_dispatch_modes():
                    indices.extend(real.nonzero().unbind(1))
            else:
                indices.append(i)
        return torch.ops.aten.index.Tensor(args[0], indices), None
    if name == "masked_select":  # as many elements as the mask, broadcast to the input, has True
        x, mask = args[0], args[1]
        real = value_of(mask)
        if real is None:
            return None
        with tp.no_dispatch_modes():
            n = int(real.expand(torch.broadcast_shapes(x.shape, mask.shape)).count_nonzero())
        return x.new_empty((n,)), None
    if name == "_pack_padded_sequence":  # (input, lengths, batch_first): sizes from the lengths alone
        x, lengths, batch_first = args[0], value_of(args[1]), args[2]
        if lengths is None:
            return None
        with tp.no_dispatch_modes():  # the real kernel on a stand-in without the feature dimensions
            data, batch_sizes = tp.pack_padded_sequence_op(torch.zeros(x.shape[:2]), lengths, batch_first)
        # the batch sizes stay a real CPU tensor, as on CUDA: the RNN kernels read them
        return (x.new_empty((data.shape[0], *x.shape[2:])), batch_sizes), None
    if name == "_ctc_loss":  # (log_probs (T, N, C) or (T, C), targets, input_lengths, target_lengths, ...)
        log_probs, target_lengths = args[0], args[3]
        if isinstance(target_lengths, torch.Tensor):
            target_lengths = value_of(target_lengths)
            if target_lengths is None:
                return None
            with tp.no_dispatch_modes():
                target_lengths = target_lengths.tolist()
        longest = max(target_lengths, default=0)
        steps, batch = log_probs.shape[0], (log_probs.shape[1] if log_probs.dim() == 3 else 1)
        # both kernels: neg_log_likelihood (N,) and log_alpha (N, T, 2 * max target length + 1)
        # (aten/src/ATen/native/LossCTC.cpp, aten/src/ATen/native/cuda/LossCTC.cu)
        return (log_probs.new_empty((batch,)), log_probs.new_empty((batch, steps, 2 * longest + 1))), None
    return None


def ctc_loss_backward(args: Any) -> tuple[torch.Tensor, int]:
    """(grad of log_probs, scratch bytes) of ``_ctc_loss_backward``, which has no fake kernel (torch 2.14): the
    gradient is shaped like ``log_probs``; CUDA's kernel also takes a ``log_beta`` shaped like ``log_alpha`` for the
    call (aten/src/ATen/native/cuda/LossCTC.cu, ctc_loss_backward_gpu_template)."""
    log_probs, log_alpha = args[1], args[6]
    return log_probs.new_empty(log_probs.shape), log_alpha.numel() * log_alpha.element_size()


# -- 3. one real forward ------------------------------------------------------------------------------------------

KEEP_NUMEL = 1 << 16
"""Outputs of at most this many elements are kept with their values (indices, counts); larger ones as shapes."""


@dataclass
class _Returned:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    outputs: list[torch.Tensor | None]
    """What the op returned: small tensors real, with their values; large ones as meta tensors (shape only)."""
    multiple: bool
    """The op returned a tuple (``outputs`` in its order), not one tensor."""


@dataclass
class RealForward:
    """What the value-dependent ops (``is_dynamic``) of one real forward and loss returned, and what its conditions
    (``bool()`` of a tensor) were, each in call order."""

    returned: list[_Returned] = field(default_factory=list)
    host_copies: list[Any] = field(default_factory=list)
    """What ``.numpy()`` gave in forward and loss, in call order: DETR's matcher hands its cost matrix to SciPy's
    ``linear_sum_assignment``; the matches it returns index the predictions."""
    reads: dict[tuple[str, int], Any] = field(default_factory=dict)
    """What each number read (``.item()`` of a non-bool tensor) in forward and loss got, by place and how many reads
    there came before it (``StepValues.number``)."""
    conditions: list[bool] = field(default_factory=list)
    """Kept apart from ``returned``: a module that reads floats once and caches them (torchvision's
    MultiScaleRoIAlign, its scales in the first forward) would shift every later op's index in the next step."""
    first_op: str = ""
    """The first op whose values came from the model (not from the batch or constants): named in the warning."""

    def keep(self, name: str, args: Any, out: Any) -> None:
        kept: list[torch.Tensor | None] = []
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                kept.append(None)
            elif t.numel() <= KEEP_NUMEL:
                kept.append(t.detach().clone())
            else:
                kept.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        self.returned.append(_Returned(name, _shapes(args), kept, isinstance(out, (tuple, list))))

    def lookup(self, index: int, name: str, args: Any) -> _Returned | None:
        """The real forward's ``index``-th value-dependent op, if it is this call (same op, same input shapes)."""
        if index >= len(self.returned):
            return None
        found = self.returned[index]
        return found if found.name == name and found.shapes == _shapes(args) else None


STAND_IN_MACS = 1 << 27
"""Products of at least this many multiply-adds (134 M: a 3×3 convolution of 64 to 64 channels over one 60 × 60
image) are stood in for in the real forward; smaller ones (a detector's box coder, heads at few proposals) compute."""

STAND_IN_NUMEL = 1 << 20
"""Batch norms of at least this many elements are stood in for in the real forward; smaller ones compute."""

NOISE_POOL_NUMEL = 1 << 23
"""Standard normal values drawn once per real forward (32 MiB), from which every stand-in reads its noise in windows
of at most half of it. Windows at random places overlap, so two blocks may share values, shifted; what the boxes
depend on is the noise's scale. Drawing each stand-in's noise afresh cost Faster R-CNN's estimate about a second on
the 2-core VM (benchmarks/results/estimate/estimate_time_noise_pool_cpu_torch2.14_20261128_s25.md)."""

_STOOD_IN = frozenset({"convolution", "mm", "addmm", "bmm", "native_batch_norm"})

DRAW_NUMEL = 1 << 14
"""Draws (``_DRAWS``) of at least this many elements come from the pools: a window costs a few microseconds (a
``randint`` for its place), a generator's pass over 16 k values about 0.2 ms."""

_DRAWS = frozenset({"normal_", "uniform_", "native_dropout"})
"""Random draws the real forward (and the real build before it) takes from pools of values drawn once: a generator's
pass over every element costs 10-30 ns on the 2-core VM, the arithmetic over a pool's window about 1. Hugging Face's
Switch Transformer (8 experts): its weights' ``normal_`` and ``uniform_`` and its forward's dropouts took 7 of the
real forward's 12 s (session 29; ``ProductStandIns._draw``)."""

_PLAIN_CAST = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"})
"""The keyword arguments of a ``_to_copy`` that ``ProductStandIns._cast`` passes on as a dtype change alone."""


class ProductStandIns:
    """Outputs for the real forward's large convolutions, matrix products and batch norms, without computing them.

    The forward that sizes a detector's outputs runs on random data, so its values are one draw among many; what
    must hold is their scale, which decides how many boxes pass a threshold or survive NMS. A product's stand-in
    is Gaussian noise with the variance the product gives when its weights are independent of its input and of
    mean 0 — fan-in × mean(w²) × mean(x²), as randomly initialised layers are and trained ones are near — plus
    the layer's bias; a training batch norm's is noise of its per-channel mean β and standard deviation γ, which
    is what it makes of any input. The noise is spatially white where real features are smooth: NMS keeps more
    boxes in all (16-18 % more on the zoo's three R-CNNs, their estimates within 0.03 % allocated:
    benchmarks/results/estimate/real_forward_sizes_cpu_torch2.14_20261127.json), the side a memory estimate may err
    on. With the forward run without autograd, it cut the estimate of torchvision's Faster R-CNN ResNet-50 FPN (4
    images of 800²) on the 2-core CPU from 13.9 to 7.2 s (detection_stand_ins_cpu_torch2.14_20261127.md).
    """

    def __init__(self) -> None:
        self._noise = torch.empty(0)
        self._uniform = torch.empty(0)
        self._pending: Any = tp.WeakIdKeyDictionary()
        """Stand-in outputs not written yet, by storage: ``(shape, mean, scale)`` of the noise they stand for."""

    def __call__(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """The stand-in output of ``func``, or None when it is not a large product (it computes then).

        A stand-in's output is written only when something reads its values: a convolution's, which a training
        batch norm replaces by noise of its own without reading it (a ResNet's every convolution), never is —
        half of what Faster R-CNN's stand-ins wrote. Every op the real forward runs comes here first and writes
        the pending outputs it reads; a stand-in reads only its input's mean square, which the pending noise
        gives without writing it. ``.numpy()`` runs an op (a ``detach``); ``.tolist()``, which runs none, writes
        them through ``trace.HostCopies`` (``fill``)."""
        out = (self._stand_in(func, name, args, kwargs) if name in _STOOD_IN
               else self._draw(name, args, kwargs) if name in _DRAWS
               else self._cast(args, kwargs) if name == "_to_copy" and self._pending else None)
        if out is None and self._pending:
            self.fill(args, list(kwargs.values()))
        return out

    def _cast(self, args: Any, kwargs: dict[str, Any]) -> Any:
        """A stand-in's output cast to another floating dtype: a stand-in of that dtype, still unwritten, or None.
        Autocast's half-precision products compute in fp32 in the real forward and are cast back
        (``CudaSemantics.half_in_fp32``): without this the cast would write every stand-in a batch norm replaces
        unread (session 29: a bf16 Faster R-CNN's real forward 40 % slower)."""
        t = args[0]
        pending = self._pending.get(t.untyped_storage())
        dtype = kwargs.get("dtype")
        if (pending is None or len(args) > 1 or set(kwargs) - _PLAIN_CAST or dtype is None
                or not dtype.is_floating_point
                or kwargs.get("memory_format") not in (None, torch.preserve_format, torch.contiguous_format)
                or kwargs.get("device") not in (None, t.device) or kwargs.get("layout") not in (None, torch.strided)
                or not t.is_contiguous() or t.numel() * t.element_size() != t.untyped_storage().nbytes()):
            return None
        shape, mean, scale = pending
        return self._normal(shape, dtype, mean, scale)

    def _draw(self, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        """A large random draw from the pools (``_DRAWS``), or None: small, strided, or on a generator of its own
        (the op draws as usual then)."""
        t = args[0]
        if (t.numel() < DRAW_NUMEL or not t.is_floating_point() or not t.is_contiguous()
                or kwargs.get("generator") is not None or t.untyped_storage() in self._pending):
            return None
        with tp.no_dispatch_modes():
            if name == "normal_":  # (self, mean=0, std=1)
                mean, std = (list(args[1:3]) + [0.0, 1.0][len(args) - 1:])[:2]
                mean, std = float(kwargs.get("mean", mean)), float(kwargs.get("std", std))
                self._write_pool(t, self._normal_pool(), std, mean)
                return t
            if name == "uniform_":  # (self, from=0, to=1)
                low, high = (list(args[1:3]) + [0.0, 1.0][len(args) - 1:])[:2]
                low, high = float(kwargs.get("from", low)), float(kwargs.get("to", high))
                self._write_pool(t, self._uniform_pool(), high - low, low)
                return t
            p = float(args[1]) if len(args) > 1 else float(kwargs["p"])
            train = bool(args[2]) if len(args) > 2 else bool(kwargs.get("train"))
            if not train or not 0.0 < p < 1.0:
                return None
            # (input, p, train) -> (input × mask / (1 - p), mask): a kept element where the uniform draw is ≥ p
            mask = torch.empty(t.shape, dtype=torch.bool)
            self._write_pool(mask, self._uniform_pool(), 1.0, 0.0, at_least=p)
            return t * mask * (1.0 / (1.0 - p)), mask

    def _normal_pool(self) -> torch.Tensor:
        if self._noise.numel() == 0:
            self._noise = torch.randn(NOISE_POOL_NUMEL)
        return self._noise

    def _uniform_pool(self) -> torch.Tensor:
        if self._uniform.numel() == 0:
            self._uniform = torch.rand(NOISE_POOL_NUMEL)
        return self._uniform

    @staticmethod
    def _write_pool(out: torch.Tensor, pool: torch.Tensor, scale: float, shift: float,
                    at_least: float | None = None) -> None:
        """Write ``shift + scale ×`` windows of ``pool`` at random places into the contiguous ``out``
        (``_pool_windows``; ``at_least``: whether each value is at least that, into a bool ``out``)."""
        shift_t, scale_t = torch.tensor(shift), torch.tensor(scale)
        for block, window, _, _ in _pool_windows(out.view(1, -1), pool):
            if at_least is not None:
                torch.ge(window, at_least, out=block)
            else:
                torch.addcmul(shift_t, window, scale_t, out=block)

    def fill(self, *items: Any) -> None:
        """Write the pending stand-in outputs among the tensors of ``items`` (nested in lists and tuples)."""
        for t in tensors(items):
            pending = self._pending.pop(t.untyped_storage(), None)
            if pending is not None:
                shape, mean, scale = pending
                with tp.no_dispatch_modes():  # the whole output, whatever view of it ``t`` is
                    self._write_normal(torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).view(shape),
                                       mean, scale)

    def _mean_square(self, t: torch.Tensor) -> float:
        pending = self._pending.get(t.untyped_storage())
        if pending is None:
            return _mean_square(t)
        _, mean, scale = pending  # each channel alike in size: the mean over channels of mean² + scale²
        return float((mean.square().mean() if mean.dim() else mean.square()) +
                     (scale.square().mean() if scale.dim() else scale.square()))

    def _stand_in(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Any:
        if name == "native_batch_norm":
            return self._batch_norm(func, args, kwargs)
        if name == "convolution":
            x, w, bias = args[0], args[1], args[2]
            transposed = args[6] if len(args) > 6 else kwargs.get("transposed", False)
            shape = self._shape(func, args, kwargs)
            # each output element sums over a filter's weights (transposed: each input element scatters over them)
            macs = (x.numel() if transposed else math.prod(shape)) * (w.numel() // max(w.shape[0], 1))
            alpha, beta = 1.0, 1.0
        else:
            if name == "addmm":  # (bias, a, b, *, beta=1, alpha=1)
                bias, x, w = args[0], args[1], args[2]
                beta, alpha = kwargs.get("beta", 1.0), kwargs.get("alpha", 1.0)
            else:
                bias, (x, w), beta, alpha = None, args[:2], 1.0, 1.0
            shape = self._shape(func, args, kwargs)
            macs = math.prod(shape) * x.shape[-1]
        if macs < STAND_IN_MACS or not x.is_floating_point():
            return None
        self.fill(bias)
        with tp.no_dispatch_modes():
            std = alpha * math.sqrt(macs / math.prod(shape) * self._mean_square(w) * self._mean_square(x))
            mean = torch.zeros(()) if bias is None else bias.float() * beta
            return self._normal(shape, x.dtype, mean, torch.tensor(std))

    def _batch_norm(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        # (input, weight, bias, running_mean, running_var, training, momentum, eps) -> (out, save_mean, save_invstd)
        x, weight, bias, training = args[0], args[1], args[2], args[5]
        if not training or x.numel() < STAND_IN_NUMEL or x.dim() < 2 or not x.is_floating_point():
            return None
        self.fill(weight, bias)
        with tp.no_dispatch_modes():
            gamma = torch.ones(x.shape[1]) if weight is None else weight.float()
            beta = torch.zeros(x.shape[1]) if bias is None else bias.float()
            out = self._normal(tuple(x.shape), x.dtype, beta, gamma)
            stats = torch.zeros(x.shape[1], dtype=torch.float32)
            return out, stats, stats.clone()

    @staticmethod
    def _shape(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[int, ...]:
        def meta(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            if isinstance(a, (list, tuple)):
                return type(a)(meta(item) for item in a)
            return a

        with tp.no_dispatch_modes():
            return tuple(func(*meta(args), **{k: meta(v) for k, v in kwargs.items()}).shape)

    def _normal(self, shape: tuple[int, ...], dtype: torch.dtype, mean: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
        """A fresh tensor that stands for ``mean + scale ×`` standard normal noise, ``mean`` and ``scale`` scalars or
        one value per channel (dimension 1); written when an op reads it (``fill``)."""
        out = torch.empty(shape, dtype=dtype)
        self._pending[out.untyped_storage()] = (shape, mean, scale)
        return out

    def _write_normal(self, out: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> None:
        """Write ``mean + scale ×`` standard normal noise into ``out`` (contiguous). The noise is read from one pool
        of ``NOISE_POOL_NUMEL`` values drawn once, a window at a random place for each block of at most half the
        pool: one pass over the output, and no random-number generator's pass over it (``torch.randn`` of 82 M
        values took 1.3 s on the 2-core VM; the arithmetic of a 41 M-value stand-in, about 0.03 s)."""
        shape = tuple(out.shape)
        if len(shape) >= 3:  # (N, C, ...): one row per channel plane, its mean and scale in a column
            rows = out.view(shape[0] * shape[1], -1)
            mean, scale = (v.repeat(shape[0]).unsqueeze(1) if v.dim() else v for v in (mean, scale))
            per_column = False
        else:  # (N, C): a row per sample, the channels along it
            rows = out.view(-1, shape[-1])
            per_column = True
        for block, window, r, c in _pool_windows(rows, self._normal_pool()):
            m, s = ((v[c : c + block.shape[1]] if per_column else v[r : r + block.shape[0]]) if v.dim() else v
                    for v in (mean, scale))
            torch.addcmul(m, window, s, out=block)


def _pool_windows(rows: torch.Tensor, pool: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """The blocks of the 2-D ``rows``, each at most half of ``pool``, row bands of whole rows where rows are narrower
    than that; with each, a window of ``pool`` of its shape at a random place, and the block's first row and column."""
    if rows.numel() == 0:
        return
    half = pool.numel() // 2
    width = min(rows.shape[1], half)
    height = max(1, half // width)
    for r in range(0, rows.shape[0], height):
        for c in range(0, rows.shape[1], width):
            block = rows[r : r + height, c : c + width]
            start = int(torch.randint(0, pool.numel() - block.numel() + 1, ()))
            yield block, pool[start : start + block.numel()].view(block.shape), r, c


def _mean_square(t: torch.Tensor) -> float:
    n = t.numel()
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2 / n if n else 0.0
