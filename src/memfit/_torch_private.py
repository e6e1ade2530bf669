"""Every private or semi-private PyTorch API memfit uses, in one place, behind a version check.

If a torch release moves one of these, this is the only module to change. Checked on torch 2.11, 2.13 and 2.14.
``tests/test_architecture.py`` fails when another module touches ``torch._*``, an op's ``_schema`` or a module's
``_parameters``.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memfit.errors import MemfitError, UsageError

MIN_TORCH = (2, 4)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


if torch_version() < MIN_TORCH:  # pragma: no cover - depends on the installed torch
    raise MemfitError(
        f"memfit needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (FakeTensorMode, autocast dispatch keys), "
        f"found {torch.__version__}. Upgrade with: pip install -U torch"
    )

# Fake tensors: shapes, dtypes and storages without data.
import torch._subclasses.fake_tensor as _fake  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

# Norm layers with running statistics (BatchNorm*, InstanceNorm* with track_running_stats) share this base.
NormBase = torch.nn.modules.batchnorm._NormBase
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
OpOverload = torch._ops.OpOverload

__all__ = [
    "BatchNormBase",
    "NormBase",
    "OpOverload",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "StaticShapeFakeTensorMode",
    "TorchDispatchMode",
    "UnsupportedOperatorException",
    "WeakIdKeyDictionary",
    "all_op_names",
    "autograd_node_key",
    "autograd_node_name",
    "current_autograd_node",
    "is_view",
    "coo_parts",
    "cuda_branches_under_deterministic_algorithms",
    "sparse_coo",
    "set_sparse",
    "sparse_coo_op",
    "embedding_bag_sparse_backward",
    "pack_padded_sequence_op",
    "load_fully_shard",
    "op_argument_names",
    "op_mutated_arguments",
    "op_returns_nothing",
    "op_short_name",
    "sdpa_efficient",
    "sdpa_flash_cpu",
    "sdpa_math",
    "no_dispatch_modes",
    "has_kernel",
    "exclude_dispatch_key",
    "override_library",
    "record_memory_history",
    "memory_snapshot",
    "flop_formulas",
    "sdpa_flops",
    "sdpa_backward_flops",
]


# Ops that FakeTensorMode serves with Python rules written for symbolic sizes or device changes before any
# decomposition is looked at (fake_impls.py: torch._refs' reshape helper for view, its own slice and select rules;
# _to_copy's decomposition); their meta kernels are exact for int sizes on one device.
_META_SHORTCUT = frozenset({
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int, torch.ops.aten._to_copy.default,
})

# arguments a dispatch cache key holds as they are, with their type (1 and 1.0 hash alike but type outputs apart)
_KEY_AS_IS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                        torch.memory_format})


class StaticShapeFakeTensorMode(FakeTensorMode):
    """FakeTensorMode for programs whose sizes are all plain ints, on one device, as every memfit trace's are.

    FakeTensorMode runs some ops through Python written for symbolic sizes: views through torch._refs, and ops with
    a decomposition in torch._decomp (layer and batch norm and their backwards, addmm, uniform_, dtype casts...)
    op by op under the fake mode. A new shape then costs 1-10 ms where the op's meta kernel takes a fraction of a
    millisecond (torch 2.14 on this repository's 2-core CPU: a view 2.1 ms, an addmm 9.7 ms). With int sizes the
    meta kernels give the same outputs, so this mode runs them instead. Where a decomposition branches on the
    device, the meta kernel takes the non-CPU branch, which is CUDA's, the device memfit emulates: batch norm keeps
    its statistics in float32 for a bf16 input, as ``batch_norm_cuda`` does (the CPU branch casts them to bf16).
    An op whose meta kernel fails goes back to FakeTensorMode's own way.
    """

    # FakeTensorMode keeps one dispatch cache for every instance (``FakeTensorMode.cache``, outputs by op and input
    # metadata). Ours can differ (batch norm's statistics), so while this mode is entered the class points at
    # this dict instead: memfit never reads FakeTensorMode's entries, and torch.compile never reads memfit's.
    _own_cache: dict[Any, Any] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> StaticShapeFakeTensorMode:
        # ``copy.deepcopy`` of a module (nn.TransformerEncoder's layers, any model that clones a block) copies each
        # fake parameter's ``__dict__``, its ``fake_mode`` with it: the copy's tensors then belong to a second mode,
        # which converts them again on every op, each view with a storage of its own, so the trace counted a
        # parameter-sized block for every ``weight.t()`` (fit probe p_enc_fp32_ckpt, an fp32 nn.TransformerEncoder:
        # fits_in +25.6 % of its H200 measurement, +1.3 % with one mode).
        # One mode is the truth: a copy shares it, as a copied CUDA tensor shares its device.
        return self

    def __init__(self, **kwargs: Any) -> None:
        from torch._decomp import decomposition_table

        super().__init__(**kwargs)
        self._decomposed = decomposition_table
        # ops whose meta kernel failed, and _to_copy, whose meta kernel cannot move between devices
        self._python_only: set[Any] = {torch.ops.aten._to_copy.default}
        self._entered = 0
        self._their_cache: dict[Any, Any] = {}

    def __enter__(self) -> StaticShapeFakeTensorMode:
        if self._entered == 0:
            self._their_cache, FakeTensorMode.cache = FakeTensorMode.cache, StaticShapeFakeTensorMode._own_cache
        self._entered += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._entered -= 1
            if self._entered == 0:
                FakeTensorMode.cache = self._their_cache

    def cpp_meta_supports_symint(self, func: Any) -> bool:
        # True makes FakeTensorMode skip the Python decomposition of ``func`` for its meta kernel (fake_tensor.py,
        # _dispatch_impl, the one caller)
        return super().cpp_meta_supports_symint(func) or (
            func in self._decomposed and func not in self._python_only
        )

    def _dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        out: Any
        if func in _META_SHORTCUT and self._plain(args, kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}  # _plain: the same device
            try:
                with _fake.in_kernel_invocation_manager(self):
                    out = func(*args, **kwargs)
                return self.wrap_meta_outputs_with_default_device_logic(out, func, args[:1], device=args[0].device)
            except NotImplementedError:
                pass  # FakeTensorMode's own way, below
        try:
            out = super()._dispatch_impl(func, types, args, kwargs)
        except UnsupportedOperatorException:
            if func in self._python_only:
                raise
            self._python_only.add(func)
            out = super()._dispatch_impl(func, types, args, kwargs)
        first: Any = out[0] if type(out) is tuple and out else out
        if type(first) is FakeTensor and first.dim() in (4, 5) and (
                func in _LIKE_INPUT or func is _DROPOUT_BACKWARD or _is_pointwise(func)):
            outs: tuple[Any, ...] = (out,) if first is out else out  # type: ignore[assignment]
            if func in _LIKE_INPUT:
                outs = self._preserved(func, args[0], kwargs, outs)
            elif func is _DROPOUT_BACKWARD:
                outs = self._suggested(func, args[0], outs)
            else:
                outs = self._laid_out_as_eager(func, args, kwargs, outs)
            return outs[0] if first is out else outs
        return out

    def _preserved(self, func: Any, like: Any, kwargs: Any, outs: tuple[Any, ...]) -> tuple[Any, ...]:
        """``outs`` of ``torch.*_like(like)`` or of CUDA's dropout, which allocates its output and mask with
        ``empty_like`` (``dropout_cuda``, aten/src/ATen/native/cuda/Dropout.cu). Eager ``empty_like`` gives a dense
        ``like``'s copy its strides exactly (aten/src/ATen/native/TensorFactories.cpp); torch._refs' sorts them, and
        makes a 5-D (N, C, 1, 1, 1) tensor strided (C, 1, C, C, C) contiguous."""
        if (kwargs.get("memory_format") not in (None, torch.preserve_format) or not isinstance(like, torch.Tensor)
                or not is_non_overlapping_and_dense(like)):
            return outs
        return self._strided_as(func, outs, like, like.stride())

    def _suggested(self, func: Any, like: Any, outs: tuple[Any, ...]) -> tuple[Any, ...]:
        """``outs`` of CUDA's dropout backward, which allocates its gradient in the memory format ``like`` suggests
        (``masked_scale_cuda``, aten/src/ATen/native/cuda/Dropout.cu): channels-last where its strides are, else
        contiguous (a permuted gradient comes out contiguous; an H200, tests/test_fake_mode.py)."""
        if not isinstance(like, torch.Tensor):
            return outs
        stride = torch.empty(like.shape, device="meta", memory_format=suggest_memory_format(like)).stride()
        return self._strided_as(func, outs, like, stride)

    def _strided_as(self, func: Any, outs: tuple[Any, ...], like: torch.Tensor,
                    stride: tuple[int, ...]) -> tuple[Any, ...]:
        """``outs``, those shaped as ``like`` strided ``stride``."""
        return tuple(self._restrided(func, out, stride, [like])
                     if type(out) is FakeTensor and out.shape == like.shape and out.stride() != stride else out
                     for out in outs)

    def _restrided(self, func: Any, out: FakeTensor, stride: tuple[int, ...], inputs: list[torch.Tensor]) -> FakeTensor:
        """A fake tensor shaped and typed as ``out``, strided ``stride``."""
        with _fake.in_kernel_invocation_manager(self):
            meta = torch.empty_strided(out.shape, stride, dtype=out.dtype, device="meta")
        return self.wrap_meta_outputs_with_default_device_logic(meta, func, inputs, device=out.device)

    def _laid_out_as_eager(self, func: Any, args: Any, kwargs: Any, outs: tuple[Any, ...]) -> tuple[Any, ...]:
        """``outs`` with the strides eager gives a pointwise op's outputs where its operands' layout is ambiguous.

        A tensor with size-1 dimensions can be contiguous and channels-last at once (an (N, C, 1, 1) tensor strided
        (C, 1, C, C), a one-channel (N, 1, H, W) image made channels-last). Eager TensorIterator gives most pointwise
        ops' outputs on such operands contiguous strides (``compute_fast_setup_type``, aten/src/ATen/
        TensorIterator.cpp: "ambiguous cases (NC11) always treated as contiguous") and keeps the operand's where an
        operand differs in shape (a wrapped Python scalar: ``x * 2``, ``x.le(0)``) or where the kernel allocates its
        output like its input (``hardtanh``); the fake kernels keep them (torch._prims sorts the strides) or make
        them contiguous (FakeTensorMode's fast path for ``add``/``mul``, which ignores a scalar operand). No rule
        over op names separates the cases (``pow(x, 2)`` is contiguous, ``x / 2`` is not), so the op runs for real
        on a miniature of its operands (``_miniature``) and its output's layout is taken, once per op and operand
        layout; CPU and CUDA share TensorIterator's set-up. What came after a wrong layout (UperNet's pooled 1 x 1
        branch: its upsampling, a ``cat``, the convolution reading it) was channels-last in the trace and NCHW on
        the GPU (benchmarks/results/estimate/psp_layouts_*_s32.txt)."""
        flat = [*args, *kwargs.values()]  # a pointwise op takes its tensors as arguments of their own
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        # only ambiguous operands part the two; a non-contiguous one rules TensorIterator's contiguous set-up out
        if not any(_ambiguous_layout(t) for t in tensors) or not all(t.is_contiguous() for t in tensors):
            return outs
        key = (func, tuple((t.dtype, _miniature_layout(t)) if isinstance(t, torch.Tensor) else type(t) for t in flat))
        if key not in _EAGER_LAYOUT:
            _EAGER_LAYOUT[key] = _eager_layout(func, args, kwargs)
        layouts = _EAGER_LAYOUT[key]
        if layouts is None or len(layouts) != len(outs):
            return outs
        laid_out = []
        for out, layout in zip(outs, layouts, strict=True):
            stride = _strides_from_layout(out.shape, layout) if type(out) is FakeTensor else None
            laid_out.append(out if stride is None or stride == out.stride()
                            else self._restrided(func, out, stride, tensors))
        return tuple(laid_out)

    def _prep_args_for_hash(self, result: list[Any], args: Any, state: Any, id_hashed_objects: list[Any]) -> None:
        # The dispatch cache's key: FakeTensorMode's own describes each fake tensor by a dataclass of 17 fields that
        # it flattens field by field, recursing into shape and stride an int at a time. That is most of the cache's
        # cost on a hit (Mamba's Python time-step loop, 68k cached dispatches: 18 of 86 s under cProfile, torch
        # 2.14; 0-26 % off eight zoo steps' estimate times without it: benchmarks/results/estimate/
        # estimate_time_cachekey_cpu_torch2.14_20261127.md). Here a plain fake tensor of this mode is one tuple of what decides an op's output: dtype,
        # sizes, strides, device, offset, storage size, autograd, conj/neg/inference/quantized flags. The memory
        # format FakeTensorMode also keys on follows from sizes and strides. The key only has to be consistent
        # within this mode's own cache (``_own_cache``), which nothing else reads; anything else (constants,
        # other modes' tensors, sparse or symbolic ones, callables) goes FakeTensorMode's way, bypasses included.
        if type(args) is not list and type(args) is not tuple:
            return super()._prep_args_for_hash(result, args, state, id_hashed_objects)
        result.append(type(args))
        result.append(len(args))
        for arg in args:
            kind = type(arg)
            if kind in _KEY_AS_IS:
                result.append(kind)
                result.append(arg)
            elif kind is FakeTensor and arg.fake_mode is self and arg.constant is None \
                    and arg.layout is torch.strided and not arg._has_symbolic_sizes_strides:
                result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                               arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                               arg.is_inference(), arg.is_quantized))
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)
        return None

    def _plain(self, args: Any, kwargs: Any) -> bool:
        """A fake tensor of this mode with int sizes, no constant value and no device change, then ints, lists of
        ints or None."""
        t = args[0] if args else None
        if not (isinstance(t, FakeTensor) and t.fake_mode is self and t.constant is None
                and not t._has_symbolic_sizes_strides):
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device) != t.device:
            return False
        return all(a is None or type(a) is int or (type(a) in (list, tuple) and all(type(i) is int for i in a))
                   for a in args[1:])


if not all(hasattr(FakeTensorMode, name) for name in (
    "cpp_meta_supports_symint", "_dispatch_impl", "wrap_meta_outputs_with_default_device_logic",
)) or not hasattr(_fake, "in_kernel_invocation_manager"):  # pragma: no cover - depends on the installed torch
    # slower, and batch norm keeps its statistics as the CPU does
    StaticShapeFakeTensorMode = FakeTensorMode  # type: ignore[misc,assignment]


# (op, operand miniature layouts) -> the layout of eager's output (StaticShapeFakeTensorMode._laid_out_as_eager)
_EAGER_LAYOUT: dict[Any, tuple[tuple[int, ...] | None, ...] | None] = {}
_POINTWISE: dict[Any, bool] = {}
# ops whose outputs take their first argument's strides where it is dense: the *_like factories, and CUDA's dropout
# (the trace emulates CUDA's kernels; the CPU's composite dropout lays its output out as TensorIterator does)
_LIKE_INPUT = frozenset(getattr(torch.ops.aten, name).default for name in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "native_dropout"))
_DROPOUT_BACKWARD = torch.ops.aten.native_dropout_backward.default


# TensorIterator kernels that native_functions.yaml does not tag pointwise (aten/src/ATen/native/Activation.cpp,
# torch 2.13; leaky_relu is tagged there, not in 2.11, the GPU machine's); they lay out their outputs as the tagged
# ones do
_UNTAGGED_POINTWISE = frozenset(f"aten::{name}" for name in (
    "leaky_relu", "hardswish", "hardswish_backward", "hardsigmoid_backward", "mish_backward", "elu_backward",
    "leaky_relu_backward", "softplus_backward", "hardtanh_backward", "log_sigmoid_backward", "softshrink_backward",
    "hardshrink_backward", "_prelu_kernel", "_prelu_kernel_backward"))


def _is_pointwise(func: Any) -> bool:
    """An elementwise op that returns a new tensor and draws no random numbers."""
    known = _POINTWISE.get(func)
    if known is None:
        known = _POINTWISE[func] = (
            isinstance(func, torch._ops.OpOverload) and not func._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in func.tags
            and (torch.Tag.pointwise in func.tags or func.name() in _UNTAGGED_POINTWISE))
    return known


def _ambiguous_layout(t: torch.Tensor) -> bool:
    """Contiguous and channels-last at once, but not strided as a plain contiguous tensor."""
    from torch._prims_common import make_contiguous_strides_for

    last = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return (t.is_contiguous() and t.is_contiguous(memory_format=last)
            and t.stride() != tuple(make_contiguous_strides_for(t.shape)))


def _miniature_layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes and strides of a miniature of the dense tensor ``t``: every size above 1 made 2, the strides in the
    same order, and each size-1 dimension's stride standing where ``t``'s stands among the others (its value matters
    to TensorIterator: (N, 1, H, W) strided (HW, 1, W, 1) is channels-last, strided (HW, HW, W, 1) is not)."""
    extents = _extents(t.shape, sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: t.stride()[d]))
    shape = tuple(min(n, 2) for n in t.shape)
    return shape, tuple(2 ** bisect.bisect_left(extents, stride) for stride in t.stride())


def _miniature(t: Any) -> Any:
    """A real CPU tensor of ones laid out as ``_miniature_layout`` gives for the fake tensor ``t``."""
    if not isinstance(t, torch.Tensor):
        return t
    shape, stride = _miniature_layout(t)
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    return torch.ones(span, dtype=t.dtype).as_strided(shape, stride)


def _eager_layout(func: Any, args: Any, kwargs: Any) -> tuple[tuple[int, ...] | None, ...] | None:
    """The layouts of ``func``'s eager outputs on miniatures of its fake operands: for each output and dimension,
    the position of its stride among the output's extents (``_miniature_layout``'s exponents); None where the op
    does not run on them (the fake kernel's strides stand)."""
    import torch.utils._pytree as pytree

    # real CPU tensors, no autocast (the trace's CUDA policy would cast them; a cast changes no layout)
    with no_dispatch_modes(), exclude_dispatch_key("AutocastCPU"):
        try:
            real = func(*pytree.tree_map(_miniature, args), **pytree.tree_map(_miniature, kwargs))
        except Exception:  # an op the miniature does not suit
            return None
    return tuple(
        tuple(st.bit_length() - 1 for st in t.stride())
        if isinstance(t, torch.Tensor) and all(st > 0 and st & (st - 1) == 0 for st in t.stride()) else None
        for t in (real if isinstance(real, tuple) else (real,)))


def _strides_from_layout(shape: torch.Size, layout: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Strides for ``shape`` laid out as ``layout`` (``_eager_layout``) says; None where it fits no dense layout."""
    if layout is None or len(layout) != len(shape):
        return None
    inner = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: layout[d])
    if [layout[d] for d in inner] != list(range(len(inner))) or max(layout) > len(inner):
        return None
    extents = _extents(shape, inner)
    return tuple(extents[k] for k in layout)


def _extents(shape: tuple[int, ...] | torch.Size, dims: list[int]) -> list[int]:
    """1, then the running products of ``shape``'s sizes over ``dims`` (innermost first): a dense layout's strides."""
    extents = [1]
    for d in dims:
        extents.append(extents[-1] * shape[d])
    return extents


def no_dispatch_modes() -> Any:
    """A context in which no TorchDispatchMode (fake tensors, memfit's recorder) is active: real tensors again."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def lifted_scalar(real: torch.Tensor) -> torch.Tensor:
    """The fake tensor ``lift_fresh`` of the real 0-dim ``real`` gives under the running fake mode: its dtype, on the
    CPU, with ``real``'s value as its constant (``FakeTensor.constant``: the mode propagates it, and the optimizers'
    step counts are read through it), made directly rather than through ``FakeTensorConverter.from_real_tensor``'s
    ``MetaConverter`` round. Call it from a dispatch mode above the fake mode (its empty tensor is the fake mode's)."""
    with no_dispatch_modes():
        value = real.clone()
    fake = torch.empty_strided((), (), dtype=real.dtype, device="cpu")
    fake.constant = value  # type: ignore[attr-defined]
    # the converter's memo, as from_real_tensor leaves it: an in-place op on the constant propagates it for real and
    # converts the result back, which must be this tensor again, not a new fake (a new storage to the trace)
    fake.fake_mode.fake_tensor_converter.set_tensor_memo(value, fake)  # type: ignore[attr-defined]
    return fake


def current_autograd_node() -> Any:
    """The autograd node the engine is running on this thread, or None outside backward."""
    return torch._C._current_autograd_node()


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its storage span without gaps or overlaps, in any order of dimensions (what the
    autograd engine asks before summing a gradient in place)."""
    import torch._prims_common as prims

    # renamed in torch 2.12 (``..._or_false``: False where a symbolic size cannot decide it)
    check = (getattr(prims, "is_non_overlapping_and_dense_or_false", None)
             or prims.is_non_overlapping_and_dense)  # type: ignore[attr-defined]  # torch <= 2.11 (the GPU machine)
    return bool(check(t))


def autograd_node_name(node: Any) -> str | None:
    """The class name of an autograd node (``CheckpointFunctionBackward``), or None for no node."""
    return None if node is None else node.name()


def autograd_node_key(node: Any) -> tuple[str, int] | None:
    """Names ``node`` without holding it: its class name and its sequence number (unique per node made in forward
    or in a recompute; ``AccumulateGrad`` nodes share the largest one). Holding the node itself would keep alive
    every tensor its graph still reaches, such as the detached inputs of a reentrant checkpoint (their
    ``AccumulateGrad`` nodes hold them) to the end of backward: on the zoo's 8-layer reentrant encoder
    (benchmarks/zoo/torch_features.py) that read as 17 % more peak than the step has."""
    return None if node is None else (node.name(), node._sequence_nr())


# -- operator schemas: OpOverload._schema is a torch._C.FunctionSchema ------------------------------------------

# the tracer asks for the name of every op it dispatches (tens of thousands a step): once per op overload
_SHORT_NAMES: dict[Any, str] = {}


def op_short_name(func: Any) -> str:
    """``func``'s name without namespace or overload: ``mm`` for ``aten::mm.out``."""
    try:
        return _SHORT_NAMES[func]
    except KeyError:
        name = _SHORT_NAMES[func] = func._schema.name.split("::")[-1]
        return name


def op_returns_nothing(func: Any) -> bool:
    """The op only updates its arguments in place (``_foreach_mul_``, fused optimizer steps)."""
    return not func._schema.returns


def op_mutated_arguments(func: Any) -> tuple[int, ...]:
    """Positions of the arguments the op writes (``Tensor(a!)`` in its schema)."""
    return tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def op_argument_names(func: Any) -> list[str]:
    """The op's argument names in schema order (``["self", "dtype", ...]``)."""
    return [a.name for a in func._schema.arguments]


def is_compiled_module(m: torch.nn.Module) -> bool:
    """``m`` is what ``torch.compile(module)`` returns (``torch._dynamo.eval_frame.OptimizedModule``)."""
    return type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")


def sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors a sparse tensor keeps its data in: COO's indices and values (``nn.Embedding(sparse=True)``'s
    gradients), CSR/CSC/BSR's index arrays and values."""
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()


def coo_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO tensor's indices (sparse_dim, nnz) and values (nnz, *dense dims), coalesced or not."""
    return t._indices(), t._values()


def sparse_coo(indices: torch.Tensor, values: torch.Tensor, like: torch.Tensor, *, coalesced: bool) -> torch.Tensor:
    """A sparse COO tensor of ``like``'s size and device and ``values``' dtype that holds ``indices`` and
    ``values`` (no copy)."""
    return sparse_coo_op(
        like.sparse_dim(), like.dense_dim(), list(like.shape), indices, values, dtype=values.dtype,
        layout=torch.sparse_coo, device=like.device, is_coalesced=coalesced)


def sparse_coo_op(*args: Any, **kwargs: Any) -> torch.Tensor:
    """ATen's ``_sparse_coo_tensor_with_dims_and_tensors``: a sparse COO tensor from its indices and values."""
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(*args, **kwargs)


def embedding_bag_sparse_backward(*args: Any) -> torch.Tensor:
    """ATen's composite ``_embedding_bag_sparse_backward`` (the sparse gradient of an embedding bag)."""
    return torch.ops.aten._embedding_bag_sparse_backward(*args)


def pack_padded_sequence_op(data: torch.Tensor, lengths: torch.Tensor, batch_first: bool,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's ``_pack_padded_sequence``: (packed data, batch sizes)."""
    return torch.ops.aten._pack_padded_sequence(data, lengths, batch_first)


def set_sparse(t: torch.Tensor, source: torch.Tensor) -> None:
    """Make the sparse tensor ``t`` hold ``source``'s indices and values, in place."""
    torch.ops.aten.copy_sparse_to_sparse_(t, source)


def is_view(t: torch.Tensor) -> bool:
    """``t`` shares another tensor's storage as a view (autocast never caches a cast of one)."""
    return bool(t._is_view())


# -- attention kernels CUDA runs, called on the CPU for the tensors they save ---------------------------------


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """c10's ``suggest_memory_format``: channels-last for a 4-D or 5-D tensor with channels-last strides, else
    contiguous (``torch._prims_common``)."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


def batch_norm_impl(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                    momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
    """What the ``batch_norm`` composite runs (``aten::_batch_norm_impl_index``, the output of its five)."""
    return torch.ops.aten._batch_norm_impl_index(input, weight, bias, running_mean, running_var, training, momentum,
                                                 eps, cudnn_enabled)[0]


def softmax_kernel(input: torch.Tensor, dim: int, half_to_float: bool, *, log: bool = False) -> torch.Tensor:
    """What the ``softmax`` / ``log_softmax`` composites run (``aten::_softmax`` / ``aten::_log_softmax``):
    ``half_to_float`` reads fp16 and writes fp32 (CUDA's kernels only)."""
    kernel = torch.ops.aten._log_softmax if log else torch.ops.aten._softmax
    return kernel(input, dim, half_to_float)


def sdpa_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """Attention by its math path (``aten::_scaled_dot_product_attention_math``): saves the probabilities."""
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale
    )[0]


def sdpa_efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """The memory-efficient kernel (``aten::_scaled_dot_product_efficient_attention``): saves the output and,
    when a gradient is wanted, a log-sum-exp (as ``sdpa_utils``' dispatch asks it to)."""
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias))
    return torch.ops.aten._scaled_dot_product_efficient_attention.default(
        query, key, value, bias, wants_grad, dropout_p, is_causal, scale=scale
    )[0]


def flash_cpu_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                       is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's output and log-sum-exp (what its backward takes)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, scale=scale)
    return out, lse


def flash_cpu_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dropout_p: float, is_causal: bool,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's backward: the gradients of query, key and value."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, query, key, value, out, lse, dropout_p, is_causal, scale=scale)
    return dq, dk, dv


def sdpa_flash_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None) -> torch.Tensor:
    """The CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``): saves the output and a
    log-sum-exp, as CUDA's fused kernels do."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


# -- FSDP2 ---------------------------------------------------------------------------------------------------


def load_fully_shard() -> Callable[..., Any]:
    """``fully_shard`` from wherever this torch keeps it, or raise naming the torch version needed."""
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
        except ImportError as exc:
            raise UsageError(
                f"FSDP2 (fully_shard) needs torch >= 2.4 with torch.distributed; this is torch {torch.__version__}. "
                "Upgrade torch or use DistributedDataParallel."
            ) from exc
    return fully_shard


def all_op_names() -> list[str]:
    """Every registered operator, as ``aten::name.overload``."""
    return list(torch._C._dispatch_get_all_op_names())


def has_kernel(op_name: str, dispatch_key: str) -> bool:
    """Whether ``op_name`` has its own kernel (not a fallback) for ``dispatch_key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dispatch_key))


def exclude_dispatch_key(key_name: str) -> torch._C._ExcludeDispatchKeyGuard:
    """A guard that skips ``key_name`` (e.g. ``AutocastCPU``) for the ops called inside it."""
    key = getattr(torch._C.DispatchKey, key_name)
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key))


class override_library:
    """Temporarily override kernels of existing operators; everything is undone on exit.

    ``torch.library.Library(..., "IMPL")`` is public, but undoing it needs ``Library._destroy``.
    """

    def __init__(self, namespace: str = "aten") -> None:
        self.namespace = namespace
        self.lib: torch.library.Library | None = None

    def __enter__(self) -> torch.library.Library:
        import warnings

        # Overriding aten kernels warns once per kernel; these overrides are intended and scoped.
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
        self.lib = torch.library.Library(self.namespace, "IMPL")
        return self.lib

    def __exit__(self, *exc: object) -> None:
        if self.lib is not None:
            self.lib._destroy()
            self.lib = None


fallthrough_kernel = torch.library.fallthrough_kernel


def record_memory_history(enabled: bool, max_entries: int = 1_000_000) -> None:
    """Start or stop the CUDA caching allocator's trace (``torch.cuda.memory._record_memory_history``)."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def clear_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per (handle, stream) in the caching allocator; the next matmul of each
    thread allocates its own again (``torch._C._cuda_clearCublasWorkspaces``, as PyTorch's own tests use)."""
    torch._C._cuda_clearCublasWorkspaces()


def memory_snapshot() -> dict:
    """The allocator's segments and trace, as pytorch.org/memory_viz reads them."""
    return torch.cuda.memory._snapshot()


def autocast_header_path() -> str:
    """The installed ``ATen/autocast_mode.h``: its macros list CUDA autocast's op policies."""
    import os

    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


def flop_formulas() -> dict:
    """``{OpOverloadPacket: formula}`` of ``torch.utils.flop_counter``: ``formula(*args, out_val=out, **kwargs)``.

    Only ``FlopCounterMode`` and ``register_flop_formula`` are public (``__all__``); the registry behind them is a
    module global since torch 2.1 and still in 2.11 and 2.13. Reading it from an instance keeps custom formulas
    registered by the user.
    """
    from torch.utils.flop_counter import FlopCounterMode

    return dict(FlopCounterMode(display=False).flop_registry)


def sdpa_flops(query_shape: tuple, key_shape: tuple, value_shape: tuple) -> int:
    """Forward FLOPs of scaled-dot-product attention (``torch.utils.flop_counter.sdpa_flop_count``)."""
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def sdpa_backward_flops(grad_shape: tuple, query_shape: tuple, key_shape: tuple, value_shape: tuple) -> int:
    """Backward FLOPs of scaled-dot-product attention (``sdpa_backward_flop_count``): five matmuls, the scores
    recomputed as FlashAttention's backward does."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape))


# -- Module._apply (behind .to(), .cuda(), .half()) ---------------------------------------------------------------

def _apply_without_swap(memo: dict[int, tuple[torch.Tensor, torch.nn.Parameter]]) -> Any:
    def _apply(module: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
        if recurse:
            for child in module.children():
                child._apply(fn)
        for key, param in module._parameters.items():
            if param is None:
                continue
            with torch.no_grad():
                applied = fn(param)
            if applied is param:
                continue
            if id(param) not in memo:  # the old one is kept with it, so its id is not reused meanwhile
                memo[id(param)] = (param, torch.nn.Parameter(applied, requires_grad=param.requires_grad))
            module._parameters[key] = memo[id(param)][1]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = fn(buffer)
        return module

    return _apply


@contextlib.contextmanager
def module_apply_without_swap() -> Iterator[None]:
    """Inside: ``Module._apply`` puts a new ``Parameter`` in the module (one per old one, so tied weights stay
    tied) instead of swapping tensors in place, which FakeTensorMode's weak references forbid ("_apply(): Couldn't
    swap Linear.weight"). Only while nothing else holds the parameters (before the optimizer is built)."""
    original = torch.nn.Module._apply
    memo: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}
    torch.nn.Module._apply = _apply_without_swap(memo)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]
        memo.clear()


def _deterministic_on_cuda() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.jit.is_scripting()


@contextlib.contextmanager
def cuda_branches_under_deterministic_algorithms() -> Iterator[None]:
    """Inside: the calls ``torch.nn.functional`` makes into ``torch._C._nn`` take the decompositions a CUDA tensor
    takes there under deterministic algorithms, decided at each call (a fake CPU tensor fails those branches'
    ``is_cuda``/``is_cpu`` test, torch/nn/functional.py):

    * ``interpolate``'s bilinear (4-D) and trilinear (5-D) modes: ``torch._decomp.decompositions``'s
      ``_upsample_linear_vec``, whose forward gathers the input 2**dims times at the output's size and whose
      backward is an ``index_put`` with accumulation, instead of one kernel;
    * ``pad``'s replicate mode: ``_replication_pad``;
    * ``max_pool3d_with_indices`` (``return_indices=True``): its decomposition.

    Only ``interpolate``'s call (four positional arguments: the ``.vec`` overload) is taken for the upsamplings; a
    direct call to ``torch._C._nn.upsample_bilinear2d`` with per-axis scales runs the kernel, as on CUDA. Where the
    installed torch has no such decomposition, the call is left alone."""
    from torch._decomp import decompositions

    nn = torch._C._nn
    saved: dict[str, Callable[..., Any]] = {}

    def upsample(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) == 4 and not kwargs and _deterministic_on_cuda():
                return decompositions._upsample_linear_vec(*args)
            return real(*args, **kwargs)
        return call

    def pad(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(input: torch.Tensor, pad: Any, mode: str = "constant", value: float | None = None) -> Any:
            if mode == "replicate" and _deterministic_on_cuda():
                return decompositions._replication_pad(input, pad)
            return real(input, pad, mode, value)
        return call

    def max_pool3d(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if _deterministic_on_cuda():
                return decompositions.max_pool3d_with_indices(*args, **kwargs)
            return real(*args, **kwargs)
        return call

    wrappers = {"upsample_bilinear2d": (upsample, "_upsample_linear_vec"),
                "upsample_trilinear3d": (upsample, "_upsample_linear_vec"),
                "pad": (pad, "_replication_pad"),
                "max_pool3d_with_indices": (max_pool3d, "max_pool3d_with_indices")}
    for name, (wrap, decomposition) in wrappers.items():
        if hasattr(nn, name) and hasattr(decompositions, decomposition):
            saved[name] = getattr(nn, name)
            setattr(nn, name, wrap(saved[name]))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(nn, name, real)
