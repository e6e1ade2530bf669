"""The recorder: a dispatch mode above ``FakeTensorMode`` that turns every ATen op of a training step into
allocation and free events with CUDA's semantics.

Each new storage becomes an allocation event; a ``weakref.finalize`` on the storage emits the free when the last
reference goes, as the CUDA caching allocator would see it. Beyond the ops' outputs it records what CUDA does
otherwise: sums autograd does in place, kernels' scratch blocks and cuDNN's workspaces
(``memfit.estimate.kernel_scratch``, ``memfit.estimate.workspaces``), cuBLAS's workspace on first use, the
values a step reads (``memfit.estimate.step_values``), and each op's cost for the speed model. The driver,
``memfit.estimate.trace``, runs the protocol under it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit import _torch_private as tp
from memfit.errors import TraceError
from memfit.estimate import kernel_scratch, sparse
from memfit.estimate.bound import UncertaintyReason
from memfit.estimate.categories import TracedCategory
from memfit.estimate.data_dependent import RealForward, ctc_loss_backward, deciding_inputs
from memfit.estimate.gpus import GpuSpec, cublas_workspace_bytes
from memfit.estimate.op_costs import OpCounter
from memfit.estimate.step_values import NOT_KNOWN, StepValues
from memfit.estimate.trace_record import Alloc, Trace, output_tensors
from memfit.estimate.value_reads import ValuesNeededToBuild, ValuesNeededToTrace, user_frame
from memfit.workload.selective_checkpoint import REGIONS as selective_regions

__all__ = ["BATCH_SEED", "Recorder"]


@dataclass(frozen=True)
class _PendingSum:
    """A gradient sum just traced out of place, which CUDA does in place if its first term dies next."""

    old_key: int
    sum_key: int
    sum_storage: Any  # a weakref to the sum's storage: holding it would delay the sum's own free
    node: tuple[str, int] | None


_DEVICE_QUERY = torch.ops.prim.device.default


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _float32_inputs(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)


def _no_constants(args: Any) -> bool:
    """No fake tensor in ``args`` (or in a list there) carries a constant value FakeTensorMode keeps up to date."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and (not isinstance(t, tp.FakeTensor) or t.constant is not None):
                return False
    return True


class _InPlaceForeachOps(dict):
    """func -> whether it is an in-place foreach op that returns nothing (``_foreach_mul_``), by its schema."""

    def __missing__(self, func: Any) -> bool:
        name = tp.op_short_name(func)
        self[func] = answer = (
            func.namespace == "aten" and name.startswith("_foreach_") and name.endswith("_")
            and tp.op_returns_nothing(func)
        )
        return answer


_IN_PLACE_FOREACH = _InPlaceForeachOps()


# torch's CPU generator is seeded with this as the batch is made, so that the real forward (RealForward) and the
# traced steps that follow the batch's values see the same batch; torch.random.fork_rng keeps the caller's state
BATCH_SEED = 0


class Recorder(tp.TorchDispatchMode):
    def __init__(self, gpu: GpuSpec, *, real: bool = False, batch_values: bool = False,
                 real_forward: RealForward | None = None) -> None:
        super().__init__()
        self.gpu = gpu
        self.trace = Trace()
        self._live: Any = tp.WeakIdKeyDictionary()
        self.phase, self.step = "init", 0
        self.module_stack: list[str] = []
        self.module_names: dict[int, str] = {}
        self._workspace_threads: set[str] = set()
        self.closed = False
        self.building_model = False
        """Inside the model factory: an op whose output size needs tensor values makes ``build_model`` build the
        model for real."""
        self.silent = False
        """Run ops untracked (the tracer's own bookkeeping, e.g. the grads of a copied step)."""
        self._finalizers: dict[int, Any] = {}
        # key -> the autograd node (tp.autograd_node_key: a name, never the node) that ran when a backward op made it
        self._born_in_node: dict[int, tuple[str, int] | None] = {}
        self._pending_sum: _PendingSum | None = None
        self.held_keys: list[int] = []
        """Keys of the output and loss that the plain loop holds after step 0 (``Workload.keep_output``)."""
        self.kept: dict[int, tuple[int, Any]] = {}
        """What the first step's forward and backward kept alive beyond grads and output
        (``step_copies.kept_is_small``): its key there -> the key of the newest copy of it and the storage standing
        for that copy, held until the next copy: the step the copy stands for would keep its own until then,
        whatever drops the first step's (its output, when a copy hands over the held output)."""
        self.grad_keys: list[tuple[int, int]] | None = None
        """(parameter index in the optimizer, key of its grad's storage) as the first optimizer step begins."""
        self.real = real
        """Tracing real CPU tensors (a step whose sizes depend on data values), not fake ones."""
        self.batch_values = batch_values
        """The batch is made for real and its values are followed too (a step whose sizes depend on the data)."""
        self.step_values = StepValues(self, real=real, batch_values=batch_values, real_forward=real_forward)
        """What the trace knows of tensor values, and its answers where they decide the step."""
        self.sparse = sparse.SparseValues(self.step_values.known.value)
        self.costs = OpCounter()
        self.trace.op_costs, self.trace.cost_marks = self.costs.rows, self.costs.marks

    # ------------------------------------------------------------------ events
    def set_phase(self, name: str, step: int) -> None:
        self.phase, self.step = name, step
        if name == "forward":
            self.step_values.begin_forward()
        elif name == "data" and (self.batch_values or self.real):
            torch.manual_seed(BATCH_SEED)
        if name != "backward":
            self.module_stack.clear()
        self.trace.phase_marks.append((len(self.trace.ops), name, step))
        self.costs.set_phase(name, step)

    def _default_category(self) -> TracedCategory:
        if self.phase == "data":
            return "data"
        if self.phase in ("forward", "loss"):
            return "activations"
        if self.phase == "backward" and self.module_stack:
            return "activations"  # recomputation of checkpointed modules
        return "temporaries"

    def _alloc(self, nbytes: int, op: str, shape: tuple[int, ...], dtype: str, category: TracedCategory | None = None) -> int:
        self._pending_sum = None
        key = len(self.trace.allocs)
        module = self.module_stack[-1] if self.module_stack else ("(loss)" if self.phase == "loss" else "")
        self.trace.allocs.append(
            Alloc(nbytes, op, module, self.phase, self.step, shape, dtype, category or self._default_category())
        )
        self.trace.ops.append(1)
        self.trace.keys.append(key)
        return key

    def _free(self, key: int) -> None:
        if self.closed:
            # a fake storage collected after the trace ended (a reference cycle reaped by a later gc): its free
            # belongs to no step, and after the step copy it would free a key the copy already freed
            return
        if self._pending_sum is not None and self._fold_sum(key):
            return
        self.trace.ops.append(-1)
        self.trace.keys.append(key)
        self._finalizers.pop(key, None)
        self._born_in_node.pop(key, None)

    def track(self, t: torch.Tensor, op: str) -> None:
        if t.layout != torch.strided:  # a sparse gradient: its indices and values are the allocations
            # what sparse ops keep after coalescing (SparseAdam, sparse SGD) depends on the indices' values
            self.trace.uncertain.setdefault(
                "sparse_data", f"a sparse tensor ({op}, {self.module_stack[-1] if self.module_stack else self.phase})")
            for part in tp.sparse_parts(t):
                self.track(part, op)
            return
        st = t.untyped_storage()
        if st in self._live or st.nbytes() == 0:
            return  # the CUDA allocator hands out no block for an empty tensor
        key = self._alloc(st.nbytes(), op, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self.own(st, key)
        if self.phase == "backward":
            self._born_in_node[key] = tp.autograd_node_key(tp.current_autograd_node())

    def key_of(self, storage: Any) -> int | None:
        """The allocation ``storage`` is tracked under; None if it is not tracked."""
        return self._live.get(storage)

    def storage_of(self, key: int) -> Any:
        """The storage tracked under ``key``, or None if there is none."""
        return next((st for st, k in self._live.items() if k == key), None)

    def own(self, storage: Any, key: int) -> None:
        """``key``'s allocation is ``storage`` from now on, and is freed when it is."""
        self._live[storage] = key
        self._finalizers[key] = weakref.finalize(storage, self._free, key)

    def _accumulate_in_place(self, name: str, args: Any, kwargs: dict[str, Any], out: Any) -> bool:
        """Account for the autograd engine summing two gradients of one tensor as CUDA does: in place.

        Where a tensor feeds two ops (a residual branch, a tied weight, a window's slices), backward adds the second
        gradient into the first. ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) does
        ``old.add_(new)`` when ``old`` is a dense, non-overlapping tensor that only the buffer holds (its use count
        and its storage's are one), and ``old + new`` otherwise; fake tensors are tensor-subclass-like, so under a
        trace it always takes the second path, one buffer too many (the 190 MiB of a tied embedding in
        benchmarks/results/explain/explain_cases_h200_torch2.11_20261126.md). Told apart from an ``add`` inside a
        derivative formula by where ``old`` was made: under an earlier node of this backward (the formula's own
        tensors are the node's).

        Whether only the buffer holds ``old`` is known a moment later: the engine then drops it, and its storage is
        freed before anything else is allocated. The sum is tracked as a new allocation here and ``_free`` folds
        the pair back into ``old``'s block when that happens (``_fold_sum``). A real CPU backward's profile
        (``aten::add_`` against ``aten::add`` under ``evaluate_function``) is the reference the tests hold this to.
        """
        self._pending_sum = None
        if name != "add" or self.phase != "backward" or torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1:
            return False
        if len(args) < 2 or not all(isinstance(t, torch.Tensor) for t in (args[0], args[1], out)):
            return False
        old, new = args[0], args[1]
        if not (old.shape == new.shape == out.shape and old.dtype == new.dtype == out.dtype):
            return False
        if old.layout != torch.strided or out.layout != torch.strided or new.layout != torch.strided:
            return False  # sparse gradients are summed by concatenation: a new tensor, as traced
        storage = old.untyped_storage()
        key = self._live.get(storage)
        node = tp.current_autograd_node()
        if key is None or node is None or key not in self._born_in_node or (
                self._born_in_node[key] == tp.autograd_node_key(node)):
            return False
        self.track(out, name)
        if tp.is_view(old) or not tp.is_non_overlapping_and_dense(old):
            # a view's base holds its storage too: a permute's or a reshape's gradient (Swin-UNETR's stage outputs,
            # a linear layer's weight gradient in fp32, which mm's backward hands over transposed)
            return True
        out_storage = out.untyped_storage()
        out_key = self._live.get(out_storage)
        if out_key is not None and out_key == len(self.trace.allocs) - 1:
            self._pending_sum = _PendingSum(key, out_key, weakref.ref(out_storage), tp.autograd_node_key(node))
        return True

    def _fold_sum(self, key: int) -> bool:
        """``key`` is freed: if it is the ``old`` of the sum just traced (``_accumulate_in_place``) and nothing
        happened in between, the engine summed in place on CUDA: the sum's allocation is dropped and the sum's
        storage takes over ``old``'s block. True when folded (no free is recorded)."""
        pending, self._pending_sum = self._pending_sum, None
        if pending is None or pending.old_key != key or self.trace.keys[-1] != pending.sum_key \
                or self.trace.ops[-1] != 1:
            return False
        storage = pending.sum_storage()
        if storage is None or self._live.get(storage) != pending.sum_key:
            return False
        self.trace.ops.pop()
        self.trace.keys.pop()
        self.trace.allocs.pop()
        self._finalizers.pop(pending.sum_key).detach()
        self._born_in_node.pop(pending.sum_key, None)
        self._finalizers.pop(key, None)
        self.own(storage, key)
        self._born_in_node[key] = pending.node
        return True

    def _index_put_in_place(self, name: str, args: Any, kwargs: dict[str, Any], out: Any) -> bool:
        """Account for ``index``'s backward writing the gradient into its zeros in place, as CUDA does.

        ``index_backward`` (torch/csrc/autograd/FunctionsManual.cpp) calls ``_index_put_impl_`` on the fresh zeros
        for plain tensors and the out-of-place ``index_put`` for tensor-subclass-like ones, which fake tensors
        are: one buffer of the indexed tensor's size too many under a trace (a loss over the masked positions
        of a 32k-vocabulary's logits: 500 MiB, the zoo's boolean_mask_loss 8 % over the H100's peak,
        benchmarks/results/estimate/zoo_accuracy_h100_torch2.11_20261127.md). The result's storage takes over
        the zeros' allocation, as in ``_accumulate_in_place``."""
        if name != "index_put" or self.phase != "backward" or torch.is_grad_enabled():
            return False
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        zeros = args[0]
        if not accumulate or not isinstance(zeros, torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        if zeros.shape != out.shape or zeros.dtype != out.dtype or zeros.layout != torch.strided:
            return False
        storage = zeros.untyped_storage()
        key = self._live.get(storage)
        node = tp.current_autograd_node()
        if key is None or node is None or tp.autograd_node_name(node) != "IndexBackward0" \
                or self._born_in_node.get(key) != tp.autograd_node_key(node):
            return False  # not the formula's own zeros
        self._take_over(storage, key, out)
        return True

    def _take_over(self, storage: Any, key: int, out: torch.Tensor) -> None:
        """``out``'s storage takes over the allocation ``key`` of ``storage``: CUDA wrote into that block in place
        where the trace made a new one (its own allocation is never recorded)."""
        self._finalizers.pop(key).detach()
        del self._live[storage]
        self.own(out.untyped_storage(), key)

    def disown(self, storage: Any) -> None:
        """Stop tracking ``storage``: its free is accounted for elsewhere (a copied step's events)."""
        key = self._live.pop(storage, None)
        if key is not None:
            self._finalizers.pop(key).detach()
            self._born_in_node.pop(key, None)

    def mark(self, t: torch.Tensor | None, category: TracedCategory) -> None:
        if t is None:
            return
        if t.layout != torch.strided:
            for part in tp.sparse_parts(t):
                self.mark(part, category)
            return
        key = self._live.get(t.untyped_storage())
        if key is not None:
            self.trace.allocs[key].category = category

    def _note_compiled_roi_align(self, args: Any) -> None:
        """torchvision's ``roi_align`` under deterministic algorithms, which on CUDA runs its Python implementation
        compiled: its backward's blocks are charged (``kernel_scratch.roi_align_compiled_backward_blocks``); the bound
        adds what large feature maps took beyond them (``kernel_scratch.ROI_ALIGN_INPUT_ALLOWANCE``)."""
        features = args[0]
        allowance = math.ceil(kernel_scratch.ROI_ALIGN_INPUT_ALLOWANCE * features.numel() * 4)
        held = self.trace.uncertain_bytes
        held["deterministic_roi_align"] = max(held.get("deterministic_roi_align", 0), allowance)
        adaptive = len(args) > 5 and int(args[5]) <= 0
        where = self.module_stack[-1] if self.module_stack else "the step"
        self.note_rule("deterministic_roi_align", (
            f"torchvision's roi_align under deterministic algorithms ({where}): on CUDA it runs a Python "
            "implementation through torch.compile, whose backward takes 48 B for each point it gathers and four "
            "gradients of them (an H200 grid of single calls): charged; the bound adds 3.2 x the largest feature map "
            "in fp32, which a map large against its samples took beyond that"
            + ("; with an adaptive sampling ratio (<= 0) it gathers every point of the map for each bin, sized from "
               "torchvision's source, not measured" if adaptive else "")))

    def note_rule(self, reason: UncertaintyReason, detail: str) -> None:
        """The trace relies on a rule here (the first detail of each reason is kept)."""
        self.trace.uncertain.setdefault(reason, detail)

    def record_kernel(self, nbytes: int, dispatches: int) -> None:
        """One kernel the trace does not run (a compiled optimizer update), moving ``nbytes``."""
        self.costs.record_kernel(nbytes, dispatches)

    # ---------------------------------------------------------- dispatch hook
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE_QUERY:
            # C++ asks each fake tensor for its device thousands of times a step (autograd checks every grad's);
            # the answer is a Python attribute, and nothing runs or allocates
            return args[0].device
        kwargs = kwargs or {}
        if self.silent:
            return func(*args, **kwargs)
        name = tp.op_short_name(func)
        values = self.step_values
        # the indices of a value-dependent op and of a bool() read in this forward and loss (RealForward's orders)
        call, condition = values.number(func, name, args)
        if name in sparse.RULES and not self.real:
            # sparse COO tensors (sparse gradients): FakeTensorMode's kernels lose their nnz or have none
            try:
                result = sparse.RULES[name](self.sparse, args, kwargs)
            except sparse.SparseValuesNeeded as exc:
                raise ValuesNeededToTrace(str(exc), user_frame(), False, values.param_bytes()) from exc
            if result is not None:
                out, scratch, let_go = result
                self.costs.record(func, name, args, kwargs, out)
                for t in output_tensors(out):
                    self.track(t, name)
                self._transient(scratch, f"{name}_scratch", optional=False)
                del let_go  # the tensors the op replaced: freed now, after its output was allocated
                return out
        if _IN_PLACE_FOREACH[func] and not self.real:
            results = sparse.foreach_in_place(self.sparse, name, args, kwargs)
            if results is not None:  # sparse tensors: one op per tensor, as CUDA falls back to
                self.costs.record(func, name, args, kwargs, None)
                for result in results:
                    if result is not None:
                        self.track(result[0], name)
                        self._transient(result[1], f"{name}_scratch", optional=False)
                del results  # what the ops replaced goes now, after their outputs were allocated
                return None
        if _IN_PLACE_FOREACH[func] and _no_constants(args):
            # an in-place foreach op (the optimizer's updates) allocates nothing, and fake tensors have no values
            # to update: FakeTensorMode would only check shapes, at 0.2-0.4 ms a tensor. Tensors with a constant
            # value (the optimizer's step counts, whose .item() the step reads) still go through it.
            self.costs.record(func, name, args, kwargs, None)
            return None
        if name == "_local_scalar_dense":
            top = values.drawn_top(args[0])
            if top is not None:  # a draw read as a number: its largest, in the real forward and the trace alike
                self.costs.record(func, name, args, kwargs, top)
                return top
            known = values.known_read(args[0], condition)
            if known is not NOT_KNOWN:  # a value computed from constants: the real one, no guess
                self.costs.record(func, name, args, kwargs, known, sync=not self._is_optimizer_state(args[0]))
                return known
        try:
            out = (values.stand_ins(func, name, args, kwargs)
                   if values.stand_ins is not None and self.phase in ("init", "forward", "loss") else None)
            if out is None and name == "lift_fresh":
                out = self._lifted_scalar(args[0])
            if out is None:
                out = func(*args, **kwargs)
            if name == "_scaled_dot_product_flash_attention_for_cpu_backward" and not self.real:
                out = kernel_scratch.cuda_attention_grads(out, args[1:4])
            if name == "native_layer_norm_backward" and not self.real:
                out = kernel_scratch.cuda_layer_norm_grads(out)
            if name == "log_sigmoid_forward" and not self.real:
                out = kernel_scratch.cuda_log_sigmoid_outputs(out)
        except (tp.DataDependentOutputException, tp.DynamicOutputShapeException) as exc:
            out = values.sized_from_known(func, name, args, kwargs)
            if out is not None:  # its size depends on values that are known: a fake output of the real size
                for t in output_tensors(out):
                    self.track(t, name)
                return out
            if name == "_local_scalar_dense":  # a value read (bool(), .item()): no size, a value to decide
                out = values.unknown_read(args[0], condition)
            else:
                out = values.sized_without_all_values(name, args, kwargs, call)
                if out is not None:
                    values.mask_counts.learn(name, args, out)
                    self.costs.record(func, name, args, kwargs, out)
                    for t in output_tensors(out):
                        self.track(t, name)
                    return out
                if self.building_model and isinstance(exc, tp.DynamicOutputShapeException):
                    # the constructor cannot even be faked (torch.unique sizes a layer): build it for real instead,
                    # see trace_setup.build_model. A constructor's .item() reads 0 below, as in the step: timm's models read
                    # their drop-path rates that way, and a real build costs host memory for every parameter.
                    raise ValuesNeededToBuild(name) from exc
                if isinstance(exc, tp.DynamicOutputShapeException):
                    # the size depends on values made from data (a detector's matched boxes): run the step for real
                    raise values.needed(name, deciding_inputs(name, args)) from exc
                raise
        except tp.UnsupportedOperatorException as exc:
            if name == "_ctc_loss_backward":
                out, scratch = ctc_loss_backward(args)
                self.costs.record(func, name, args, kwargs, out)
                self.track(out, name)
                self._transient(scratch, f"{name}_scratch", optional=False)
                return out
            if tp.op_returns_nothing(func):
                # an op that returns nothing only updates its arguments in place (fused SGD has no fake kernel in
                # torch 2.13): there is no output to fake and no storage to track
                out = None
            else:
                raise TraceError(
                    f"the op {func} has no fake (meta) implementation in torch {torch.__version__}, so memfit "
                    "cannot trace it without running it for real. Use `memfit measure` on a GPU for this model."
                ) from exc
        except RuntimeError:
            if name != "_grouped_mm" or not _float32_inputs(args):
                raise
            # the meta kernel refuses fp32 (MoE experts under autocast); CUDA's kernel runs it, as the H200 corpus
            # measured (benchmarks/results/estimate/corpus_measurements_h200_*: c056-c061): shapes from a bf16 call
            out = func(*[a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args],
                       **kwargs).float()
        values.follow(func, name, args, kwargs, out, call, condition)
        # backward runs with grad mode off; checkpointing turns it on to run a module's forward again. The module
        # stack alone is no test: non-reentrant checkpointing stops recomputing early, before the forward hook.
        recompute = self.phase == "backward" and torch.is_grad_enabled() and bool(self.module_stack)
        # reentrant checkpointing recomputes inside its own node's backward; non-reentrant inside whichever node
        # unpacks a saved tensor first
        reentrant = recompute and tp.autograd_node_name(tp.current_autograd_node()) == "CheckpointFunctionBackward"
        if reentrant and name == "convolution" and "reentrant_checkpoint" not in self.trace.uncertain:
            self.note_rule("reentrant_checkpoint", f"{self.module_stack[-1]}: a convolution recomputed by reentrant "
                           "checkpointing, in a nested backward")
        self.costs.record(func, name, args, kwargs, out, recompute=recompute, reentrant=reentrant,
                          selective=selective_regions.depth > 0,
                          sync=name == "_local_scalar_dense" and not self._is_optimizer_state(args[0]))
        if name == "roi_align" and torch.are_deterministic_algorithms_enabled():
            self._note_compiled_roi_align(args)
        if name == "convolution":
            if torch.backends.cudnn.benchmark and "cudnn_benchmark" not in self.trace.uncertain:
                self.note_rule("cudnn_benchmark", (
                    f"torch.backends.cudnn.benchmark is on ({self._where_conv()}): the first step times every "
                    "algorithm of each convolution with what memory the GPU has free, so "
                    "torch.cuda.max_memory_allocated() can show far more than this; the step then runs within "
                    "the cap estimated here"))
            if ((torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled())
                    and "deterministic_algorithms" not in self.trace.uncertain):
                self.note_rule("deterministic_algorithms", (
                    f"deterministic algorithms are on ({self._where_conv()}): cuDNN runs only its deterministic "
                    "convolution algorithms, whose workspaces differed from the ones charged here on 173 of 2818 "
                    "grid shapes measured (by up to 172 MB); the 52 steps measured so ran within the bound. "
                    "Bilinear and trilinear upsampling run as the decomposition CUDA takes then"))
            copy = self._scratch((kernel_scratch.conv_input_copy_bytes(args[0], args[1]),), f"{name}_scratch")
            self.track(out, name)
            self._transient(kernel_scratch.conv_workspace(self.trace, self._where_conv(), args[0], args[1], out,
                                                          args[3], args[6], args[8]))
            self._release(copy)
            return out
        if name == "convolution_backward":
            # measured: one layout-conversion block per backward (the data and filter calls share it), sized
            # like the forward one (benchmarks/results/estimate/cudnn_calibration_h200_torch2.11_20261126.json,
            # bwd_ws), taken by the last of the two calls; the copies of permuted or sliced tensors where
            # kernel_scratch.conv_backward_copies says the source makes them
            grad_input, grad_weight, grad_bias = out
            copies = kernel_scratch.conv_backward_copies(args[0], args[1], args[2], input_grad=grad_input is not None,
                                                         weight_grad=grad_weight is not None)
            workspace = 0
            if grad_input is not None or grad_weight is not None:
                where = self._where_conv()
                layout = kernel_scratch.conv_workspace(self.trace, where, args[1], args[2], args[0], args[4], args[7],
                                                       args[9], backward=True)
                narrow = kernel_scratch.narrow_dgrad_workspace(self.trace, where, args[1], args[2], args[4], args[6],
                                                               args[7], args[9]) if grad_input is not None else 0
                workspace = max(layout, narrow)
            held = self._scratch(copies.before, f"{name}_scratch")
            if grad_input is not None:
                self.track(grad_input, name)
                inner = self._scratch((copies.data,), f"{name}_scratch")
                if grad_weight is None:
                    self._transient(workspace)
                self._release(inner)
            if grad_weight is not None:
                inner = self._scratch(copies.weight, f"{name}_scratch")
                self.track(grad_weight, name)
                self._transient(workspace)
                self._release(inner)
            if grad_bias is not None:
                self.track(grad_bias, name)
            self._release(held)
            return out
        if self._accumulate_in_place(name, args, kwargs, out):
            return out
        if self._index_put_in_place(name, args, kwargs, out):  # into the zeros, then its sort's block
            self._release(self._scratch(kernel_scratch.kernel_transients(name, args, out, self.gpu), f"{name}_scratch"))
            return out
        outputs = output_tensors(out)
        order = kernel_scratch.ALLOCATION_ORDER.get(name)
        if order is not None and len(outputs) == len(order):
            outputs = [outputs[i] for i in order]
        # blocks held during the op (kernel_scratch.held_during_bytes). layer_norm_cuda and its backward:
        # X = input.expect_contiguous() comes before the outputs and goes when the op returns, after the kernel's
        # own scratch (a frozen ViT-B/16's stream, fit-side probe
        # s1327_frozen_cnn_r501: the copy taken after the outputs packed its blocks otherwise and put its cap 4 %
        # low; the backward's order is the H200 stream of Data2Vec-Audio's: X's copy, dX, dY's copy, freed in
        # reverse, entry_traces_h200_torch2.11_20261128_s26.tar.gz)
        copy = self._scratch(kernel_scratch.held_during_bytes(name, args), f"{name}_scratch")
        for t in outputs:
            self.track(t, name)
        if name in kernel_scratch.CUBLAS_OPS:
            # inside the op: the structured kernel allocates the output, then the cuBLAS call takes its workspace
            self._maybe_cublas_workspace()
        self._release(self._scratch(kernel_scratch.kernel_transients(name, args, out, self.gpu), f"{name}_scratch"))
        self._release(copy)
        return out

    def _where_conv(self) -> str:
        return self.module_stack[-1] if self.module_stack else "a convolution"

    def _scratch(self, sizes: Sequence[int], op: str) -> list[int]:
        """Blocks a kernel takes one after another inside one op (the non-zero ``sizes``, in order): their keys,
        for ``_release`` when the kernel gives them back."""
        return [self._alloc(n, op, (), "uint8", "workspaces") for n in sizes if n > 0]

    def _release(self, keys: list[int]) -> None:
        """Gives back what ``_scratch`` took, in reverse order (C++ locals going out of scope)."""
        for key in reversed(keys):
            self._free(key)

    def _transient(self, nbytes: int, op: str = "cudnn_workspace", *, optional: bool = True) -> None:
        """A block a library takes inside one call and gives back before the call returns; ``optional`` when
        the library can do without it (cuDNN picks an algorithm that needs less)."""
        if nbytes > 0:
            key = self._alloc(nbytes, op, (), "uint8", "workspaces")
            self.trace.allocs[key].optional = optional
            self._free(key)

    def _lifted_scalar(self, a: Any) -> torch.Tensor | None:
        """What ``lift_fresh`` makes of ``a`` if it is a real 0-dim tensor (the value written by ``x[i] = 1``): a new
        fake tensor of its dtype with its value as the constant, made directly (``tp.lifted_scalar``); None for
        anything else, which FakeTensorMode converts itself, through a ``MetaConverter`` round (~1 ms each): timm
        MaxViT's relative-position lookup tables, filled by about 2,000 such writes in its constructor, spent a
        quarter of its estimate there. The known values (``values.KnownValues``) still run the op on the real
        tensor."""
        if self.real or type(a) is not torch.Tensor or a.dim() != 0 or a.requires_grad or a.device.type != "cpu":
            return None
        return tp.lifted_scalar(a)

    def _is_optimizer_state(self, t: torch.Tensor) -> bool:
        # torch.optim keeps the `step` counters on the CPU unless capturable or fused (adam.py, _init_group), so
        # reading one is no GPU sync; they are marked optimizer_state from the end of the first step on
        key = self._live.get(t.untyped_storage())
        return key is not None and self.trace.allocs[key].category == "optimizer_state"

    def _maybe_cublas_workspace(self) -> None:
        # cuBLAS keeps one workspace per (handle, stream); handles are per thread and CUDA's autograd engine runs
        # backward on its own device thread, so forward and backward each get one (aten/src/ATen/cuda/
        # CublasHandlePool.cpp). The size is per GPU architecture and CUBLAS_WORKSPACE_CONFIG
        # (gpus.cublas_workspace_bytes).
        thread = "backward" if self.phase == "backward" else "main"
        if thread in self._workspace_threads:
            return  # read CUBLAS_WORKSPACE_CONFIG only for a thread's first cuBLAS call, not for every matmul
        size = cublas_workspace_bytes(self.gpu)
        if size <= 0:
            return
        self._workspace_threads.add(thread)
        self.trace.uses_cublas = True
        self._alloc(size, "cublas_workspace", (), "uint8", "workspaces")

    # ----------------------------------------------------- module attribution
    def pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.module_stack.append(self.module_names.get(id(module), type(module).__name__))
        self.costs.module_call()

    def post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.module_stack:
            self.module_stack.pop()
