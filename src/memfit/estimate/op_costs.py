"""What each op of a traced training step costs a GPU: FLOPs, bytes moved, kernel launches, CPU dispatches.

The recorder (``recorder.py``) hands every ATen op it sees to an ``OpCounter``, which keeps one ``OpCost`` row per op
that launches work, in program order. ``StepCost`` gathers the rows of one steady-state micro-batch and of one
optimizer step, with their totals; ``memfit.speed.step_time`` turns them into time.

What a row counts, and why:

* **FLOPs** of matmuls, convolutions and attention, from ``torch.utils.flop_counter``'s formulas (2 per
  multiply-add), by the dtype the kernel runs in: fp32 matmuls, fp32 convolutions (cuDNN runs them on TF32
  tensor cores by default, matmuls not), bf16, fp16. Other ops' FLOPs are ignored: they are bound by memory.
* **Bytes**: every tensor the op reads plus every tensor it writes (outputs, or the mutated arguments of an
  in-place op), at ``numel * itemsize``. Caches are ignored: each op is assumed to stream its tensors through HBM.
* **Kernels**: 0 for views and metadata ops (``view``, ``t``, ``expand``, ``detach``, ``as_strided``,
  ``_unsafe_view``, ``empty``...), the chunked launches of ``multi_tensor_apply`` for foreach and fused
  optimizer ops, 1 otherwise, plus cuDNN's NCHW<->NHWC conversions around a convolution that is not
  channels_last.
* **Dispatches**: ATen ops and ``nn.Module`` calls the CPU goes through, including the free ones: eager PyTorch
  pays a few microseconds of Python, autograd and dispatcher time for each, kernel or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from memfit import _torch_private as tp
from memfit.errors import TraceError
from memfit.records import JsonRecord, json_as

SCHEMA = 1

FLOP_CLASSES = ("fp32_matmul", "fp32_conv", "bf16", "fp16")
"""What decides a FLOP's peak rate: fp32 matmuls run on CUDA cores unless TF32 is allowed for matmuls (off by
default), fp32 convolutions on TF32 tensor cores (cuDNN's default), bf16/fp16 on 16-bit tensor cores."""

_CONV_OPS = frozenset({"convolution", "_convolution", "cudnn_convolution", "convolution_overrideable"})
_CPU_ATTENTION = frozenset(
    {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
)
# Ops that only make or reinterpret tensor metadata (or only allocate): no kernel, still a CPU dispatch. Views
# are found by their schema (OpOverload.is_view); these are the metadata ops whose schema does not say so.
_NO_KERNEL = frozenset(
    "_unsafe_view _reshape_alias empty empty_like empty_strided new_empty new_empty_strided resize_ set_ "
    "lift_fresh transpose_ t_ squeeze_ unsqueeze_ as_strided_ detach_".split()
)
# Ops that write their first argument without reading it.
_WRITE_ONLY = frozenset("copy_ fill_ zero_ normal_ uniform_ bernoulli_ random_ exponential_".split())
# Namespaces of ops that exist only under fake tensors (prim.device) or cost nothing measurable (profiler marks).
_IGNORED_NAMESPACES = frozenset({"prim", "profiler"})

# ATen's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh, DepthToMaxConfig<true>, the 32 KB
# kernel-argument build used with CUDA >= 12.1 on sm70+): one launch holds at most this many tensors, by the
# number of tensor lists ("depth"), and at most 2240 blocks of 65536 elements; a launch goes when either fills.
_MTA_MAX_TENSORS = (770, 448, 336, 252, 210)
_MTA_MAX_BLOCKS = 2240
_MTA_CHUNK = 65536
# cuDNN converts an NCHW input, weight and output to NHWC and back around its tensor-core kernels: three
# transpose kernels per call, each reading and writing its tensor (see memfit.estimate.workspaces.conv_workspace_bytes,
# which sizes the block they use from H200 measurements).
_LAYOUT_KERNELS = 3


class OpCost(NamedTuple):
    """What one op (or a run of free ops ending in one) costs, in program order."""

    flops: int
    """Matmul/convolution/attention FLOPs as the kernel executes them (0 for other ops)."""
    flop_class: str | None
    """One of ``FLOP_CLASSES``, or None when ``flops`` is 0 or in a dtype with no tensor-core path."""
    bytes: int
    """Bytes read plus bytes written."""
    kernels: int
    """CUDA kernel launches."""
    dispatches: int
    """CPU-side dispatches: this op plus the free ops and module calls just before it."""
    sync: bool = False
    """The CPU waits for the GPU here (``.item()``, e.g. GradScaler's inf check)."""
    recompute: bool = False
    """Run in backward to recompute a checkpointed module's forward."""
    selective: bool = False
    """Run inside a selectively checkpointed block (its forward or its recompute), so through torch's Python
    dispatch modes for selective checkpointing (``memfit.workload.selective_checkpoint``). A row with no kernel
    and ``recompute`` is an output the recompute hands back from the forward."""
    reentrant: bool = False
    """Recomputed by reentrant checkpointing (``use_reentrant=True``): no saved-tensor hooks."""


class OpCounter:
    """Turns each dispatched op into an ``OpCost`` row; ``marks`` say where each phase begins."""

    def __init__(self) -> None:
        self.rows: list[OpCost] = []
        self.marks: list[tuple[int, str, int]] = []  # (row index, phase, step)
        self._pending = 0  # dispatches of free ops and module calls, charged to the next row
        self._kinds: dict[Any, tuple[Any, ...]] = {}
        self._formulas = tp.flop_formulas()
        self.active = False

    def set_phase(self, name: str, step: int) -> None:
        if self.active and self._pending:
            # free ops at the end of a phase still cost their dispatches
            self.rows.append(OpCost(0, None, 0, 0, self._pending))
        # model building and data placement are not part of the step
        self.active = name not in ("init", "data", "end")
        self._pending = 0
        self.marks.append((len(self.rows), name, step))

    def splice(self, rows: list[OpCost], marks: list[tuple[int, str, int]]) -> None:
        """Append rows copied from an earlier step, with their phase marks (row indices relative to ``rows``)."""
        if self.active and self._pending:
            self.rows.append(OpCost(0, None, 0, 0, self._pending))
        self._pending = 0
        offset = len(self.rows)
        self.marks.extend((offset + at, name, step) for at, name, step in marks)
        self.rows.extend(rows)

    def module_call(self) -> None:
        if self.active:
            self._pending += 1

    def kept_outputs(self, count: int) -> None:
        """A selective recompute begins: ``count`` ops kept in its forward are handed back with no kernel, each
        one dispatch through the recompute's Python mode."""
        if self.active:
            self.rows.extend([OpCost(0, None, 0, 0, 1, recompute=True, selective=True)] * count)

    def record(self, func: Any, name: str, args: Any, kwargs: dict[str, Any], out: Any, *, recompute: bool = False,
               sync: bool = False, selective: bool = False, reentrant: bool = False) -> None:
        """Count one op; ``recompute`` if it recomputes a checkpointed module (``reentrant``: by reentrant
        checkpointing), ``selective`` if it runs in a selectively checkpointed block, ``sync`` if the host waits
        on it."""
        if not self.active:
            return
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = self._classify(func, name)
        if kind[0] == "ignore":
            return
        if kind[0] == "free":
            self._pending += 1
            return
        _, formula, mutated, foreach = kind
        read = _nbytes(args) + (_nbytes(kwargs.values()) if kwargs else 0)
        out_bytes = _nbytes(out if isinstance(out, (tuple, list)) else (out,))
        if name in _WRITE_ONLY:
            read -= _nbytes(args[:1])
        # an in-place foreach or fused op returns nothing: what it writes is its mutated arguments
        written = out_bytes if out_bytes else sum(_nbytes(args[i : i + 1]) for i in mutated if i < len(args))
        flops, flop_class = 0, None
        kernels = 1
        if formula is not None:
            flops = int(formula(*args, out_val=out, **kwargs))
            flop_class = _flop_class(args[0], name)
        elif name in _CPU_ATTENTION:
            flops = _cpu_attention_flops(name, args, kwargs)
            flop_class = _flop_class(args[1] if name.endswith("backward") else args[0], name)
        if name == "_local_scalar_dense":
            kernels = 1 if sync else 0  # a device-to-host copy, or a read of a host tensor (optimizer step count)
        elif foreach:
            kernels = _multi_tensor_launches(args, out)
        elif name in _CONV_OPS or name == "convolution_backward":
            layout_bytes, kernels = _conv_kernels(name, args, out)
            written += layout_bytes
        if flop_class is None:
            flops = 0
        self.rows.append(
            OpCost(flops, flop_class, read + written, kernels, 1 + self._pending, sync, recompute, selective,
                   recompute and reentrant)
        )
        self._pending = 0

    def record_kernel(self, nbytes: int, dispatches: int) -> None:
        """One memory-bound kernel that no traced op stands for (a compiled function's), with its dispatches."""
        if self.active:
            self.rows.append(OpCost(0, None, nbytes, 1, dispatches + self._pending))
            self._pending = 0

    def _classify(self, func: Any, name: str) -> tuple[Any, ...]:
        if func.namespace in _IGNORED_NAMESPACES:
            return ("ignore",)
        if func.is_view or name in _NO_KERNEL:
            return ("free",)
        mutated = tp.op_mutated_arguments(func)
        foreach = name.startswith(("_foreach_", "_fused_", "_amp_foreach_"))
        return ("kernel", self._formulas.get(func.overloadpacket), mutated, foreach)


# ---------------------------------------------------------------------------------------- a step's totals
@dataclass(frozen=True, kw_only=True)
class PhaseCost:
    """The ops of one phase, and their totals."""

    flops: dict[str, int]
    """Matmul/convolution/attention FLOPs by the class that sets their peak (``memfit.estimate.op_costs.FLOP_CLASSES``)."""
    bytes: int
    """Bytes read plus written by all ops."""
    kernels: int
    dispatches: int
    """ATen ops and module calls the CPU goes through."""
    recompute_flops: int
    """FLOPs of checkpointed modules run again in backward (a part of ``flops``)."""
    syncs: int
    """Host syncs (``.item()``): the CPU waits for the GPU."""
    ops: tuple[OpCost, ...] = field(repr=False, metadata=json_as(lambda rows: [list(r) for r in rows]))
    """Every op in program order: the speed model needs their order, not only the totals."""

    @classmethod
    def of(cls, rows: Sequence[OpCost]) -> PhaseCost:
        flops = dict.fromkeys(FLOP_CLASSES, 0)
        for r in rows:
            if r.flop_class is not None:
                flops[r.flop_class] += r.flops
        return cls(
            flops=flops,
            bytes=sum(r.bytes for r in rows),
            kernels=sum(r.kernels for r in rows),
            dispatches=sum(r.dispatches for r in rows),
            recompute_flops=sum(r.flops for r in rows if r.recompute),
            syncs=sum(1 for r in rows if r.sync),
            ops=tuple(rows),
        )

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PhaseCost:
        return cls.of([OpCost(*r) for r in d["ops"]])


@dataclass(frozen=True, kw_only=True)
class StepCost(JsonRecord):
    """What one micro-batch and one optimizer step cost a GPU, counted on fake tensors (``memfit.estimate.op_costs``).

    Read from the steady state: the last micro-batch of the second traced step (the first also creates the
    optimizer state). Example:

        >>> from memfit.workload.zoo import builtin_workload
        >>> from memfit.estimate.predict import estimate
        >>> cost = estimate(builtin_workload("mlp").replace(batch_size=8)).cost
        >>> # twice the forward, less the first layer's input gradient (the batch needs none)
        >>> round(cost.backward.total_flops / cost.forward.total_flops, 2)
        1.89
    """

    _schema: ClassVar[int] = SCHEMA

    micro_batch_size: int
    traced_step: int = 1
    """The traced step the costs are read from (0-based)."""
    forward: PhaseCost
    """Forward and loss of one micro-batch."""
    backward: PhaseCost
    """Backward of one micro-batch, with the recomputation of checkpointed modules."""
    optimizer: PhaseCost
    """``zero_grad`` and ``optimizer.step()``: once per step, whatever the gradient accumulation."""
    offload_d2h_bytes: int = 0
    """An offloaded optimizer's gradient copies to the host, per micro-batch (``Workload.optimizer_state``)."""
    offload_h2d_bytes: int = 0
    """An offloaded optimizer's parameter copies back to the GPU, per step."""
    host_update_bytes: int = 0
    """Bytes an offloaded optimizer's host update streams through host memory, per step."""
    offload_tensors: int = 0
    """Parameters an offloaded optimizer updates on the host, each with its own optimizer step and copies."""

    @property
    def schema(self) -> int:
        """The layout version of ``to_dict``, which ``from_dict`` reads."""
        return SCHEMA

    @classmethod
    def from_trace(cls, trace: Any, micro_batch_size: int) -> StepCost:
        """The cost of ``trace``'s steady-state step (``trace.op_costs`` and ``trace.cost_marks``)."""
        marks = list(trace.cost_marks) + [(len(trace.op_costs), "end", -1)]
        spans = [(at, marks[i + 1][0], name, s) for i, (at, name, s) in enumerate(marks[:-1])]
        steps = {s for _, _, name, s in spans if name == "forward"}
        if not steps:
            raise TraceError("the trace has no forward phase, so its speed cannot be predicted.")
        step = 1 if 1 in steps else max(steps)
        # the last micro-batch of the step: its forward, then loss and backward until another phase begins
        first = max(i for i, (_, _, name, s) in enumerate(spans) if name == "forward" and s == step)
        forward: list[OpCost] = []
        backward: list[OpCost] = []
        for at, end, name, _ in spans[first:]:
            if name in ("forward", "loss") and not backward:
                forward += trace.op_costs[at:end]
            elif name == "backward":
                backward += trace.op_costs[at:end]
            else:
                break
        optimizer = [
            r for at, end, name, s in spans if s == step and name in ("zero_grad", "optimizer")
            for r in trace.op_costs[at:end]
        ]
        offload = getattr(trace, "offload", None)
        return cls(
            micro_batch_size=micro_batch_size, forward=PhaseCost.of(forward), backward=PhaseCost.of(backward),
            optimizer=PhaseCost.of(optimizer), traced_step=step,
            offload_d2h_bytes=offload.d2h_bytes if offload else 0, offload_h2d_bytes=offload.h2d_bytes if offload else 0,
            host_update_bytes=offload.host_update_bytes if offload else 0,
            offload_tensors=offload.tensors if offload else 0,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCost:
        return cls(
            micro_batch_size=d["micro_batch_size"], traced_step=d.get("traced_step", 1),
            forward=PhaseCost.from_dict(d["forward"]), backward=PhaseCost.from_dict(d["backward"]),
            optimizer=PhaseCost.from_dict(d["optimizer"]),
            **{k: int(d.get(k, 0)) for k in ("offload_d2h_bytes", "offload_h2d_bytes", "host_update_bytes",
                                              "offload_tensors")},
        )



# ------------------------------------------------------------------------------------------------ counting
def _tensor_bytes(t: torch.Tensor) -> int:
    # a sparse tensor moves its indices and values
    return t.nbytes if t.layout == torch.strided else sum(part.nbytes for part in tp.sparse_parts(t))


def _nbytes(values: Any) -> int:
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += _tensor_bytes(v)
        elif isinstance(v, (list, tuple)):
            total += sum(_tensor_bytes(t) for t in v if isinstance(t, torch.Tensor))
    return total


def _flop_class(t: Any, name: str) -> str | None:
    dtype = t.dtype if isinstance(t, torch.Tensor) else None
    if dtype == torch.float32:
        return "fp32_conv" if (name in _CONV_OPS or name == "convolution_backward") else "fp32_matmul"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return None


def _cpu_attention_flops(name: str, args: Any, kwargs: dict[str, Any]) -> int:
    # CUDA runs a fused flash/memory-efficient kernel; the trace sees the CPU flash op (cuda_emulation.py).
    if name.endswith("backward"):
        grad, q, k, v = args[:4]
        flops = tp.sdpa_backward_flops(tuple(grad.shape), tuple(q.shape), tuple(k.shape), tuple(v.shape))
        causal = bool(args[7]) if len(args) > 7 else False
    else:
        q, k, v = args[:3]
        flops = tp.sdpa_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape))
        causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
    # flash attention skips the key blocks a causal mask hides entirely: about half the work for long sequences
    # (Dao, FlashAttention-2, 2023, section 3.1.1)
    return flops // 2 if causal else flops


def _multi_tensor_launches(args: Any, out: Any) -> int:
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return 1
    if isinstance(out, (list, tuple)) and out:
        lists.append(out)  # an out-of-place foreach op writes a list of its own
    depth = min(len(lists), len(_MTA_MAX_TENSORS))
    numels = [t.numel() for t in lists[0] if t.numel()]
    chunks = sum(-(-n // _MTA_CHUNK) for n in numels)
    return max(1, -(-len(numels) // _MTA_MAX_TENSORS[depth - 1]), -(-chunks // _MTA_MAX_BLOCKS))


def _conv_kernels(name: str, args: Any, out: Any) -> tuple[int, int]:
    """Bytes cuDNN's layout conversions move, and the kernels a convolution (or its backward) launches."""
    if name == "convolution_backward":
        grad, x, w = args[0], args[1], args[2]
        calls = sum(1 for t in out[:2] if t is not None)  # data and weight gradients are separate cuDNN calls
        y = grad
        reductions = 1 if len(out) > 2 and out[2] is not None else 0  # the bias gradient
    else:
        x, w, y = args[0], args[1], out
        calls, reductions = 1, 0
    if x.dim() < 4 or _is_channels_last(x) == _nhwc_native(x):
        return 0, calls + reductions
    # the tensors cuDNN converts to the layout its kernels run in, and back: each conversion reads one layout
    # and writes the other
    block = sum(t.numel() * t.element_size() for t in (x, w, y) if isinstance(t, torch.Tensor))
    return 2 * block * calls, calls * (1 + _LAYOUT_KERNELS) + reductions


def _nhwc_native(x: torch.Tensor) -> bool:
    """Whether cuDNN's fast kernels for this convolution take channels-last input.

    2-D convolutions run on NHWC tensor-core kernels (16-bit, and TF32 for fp32); 3-D convolutions have native
    NCDHW kernels, and a channels_last_3d input is converted instead. Measured on an H200, torch 2.11
    (benchmarks/results/speed/speed_model_h200_torch2.11_20261126.md and the plan grid,
    benchmarks/results/plan/plan_grid_h200_torch2.11_20261126/): ResNet-50 channels_last 20 % faster in bf16 and
    18-24 % faster in fp32 at micro-batches 32-64; a 3-D U-Net (fp16, 128³) channels_last_3d 23 % slower.
    """
    return x.dim() == 4


def _is_channels_last(t: torch.Tensor) -> bool:
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.is_contiguous(memory_format=fmt) and not t.is_contiguous()
