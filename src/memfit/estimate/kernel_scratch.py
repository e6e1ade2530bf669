"""What CUDA kernels allocate that their outputs do not show, and the layouts CUDA gives outputs the CPU lays out
otherwise.

The tracer runs every op on fake CPU tensors, so it sees each op's outputs; a CUDA kernel may also take scratch
blocks for the call (a contiguous copy of a permuted input, a reduction's staging buffer), call cuBLAS (whose
handle takes a workspace on first use), or allocate its outputs in another order than it returns them. Each rule
names the kernel's source or the measurement it comes from; ``memfit.estimate.workspaces`` has the sizes that
depend on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from memfit.estimate import workspaces as ws
from memfit.estimate.gpus import GpuSpec

if TYPE_CHECKING:
    from memfit.estimate.trace_record import Trace

__all__ = [
    "ALLOCATION_ORDER", "CUBLAS_OPS", "ConvBackwardCopies", "contiguous_copy_bytes", "conv_backward_copies",
    "conv_input_copy_bytes", "conv_workspace", "cuda_attention_grads", "cuda_layer_norm_grads", "held_during_bytes",
    "kernel_transients", "narrow_dgrad_workspace",
]


# ops served by cuBLAS/cuBLASLt on CUDA: their first call on a thread allocates the handle's workspace
CUBLAS_OPS = frozenset(
    "mm addmm bmm baddbmm addbmm mv addmv dot vdot _addmm_activation addr _scaled_mm".split()
)


# Ops whose CUDA kernel allocates its outputs in another order than it returns them: op -> output indices in
# allocation order. Which of two equal-sized free blocks each output gets decides later splits, and so the
# fragmentation a capped run meets. native_dropout: aten/src/ATen/native/cuda/Dropout.cu (dropout_cuda) makes the
# mask before the output; an H200 trace of HF T5 shows the mask's block first at every dropout
# (benchmarks/results/estimate/entry_traces_h200_torch2.11_20261126.tar.gz, c077_hf_seq2seq).
ALLOCATION_ORDER: dict[str, tuple[int, ...]] = {"native_dropout": (1, 0)}


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides of some permutation of a contiguous tensor (what ``empty_like``
    keeps)."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def cuda_attention_grads(grads: Any, inputs: Any) -> Any:
    """The CPU flash kernel's gradients (stand-ins for CUDA's fused attention) laid out as CUDA lays them out.

    CUDA's fused backward (flash: ``empty_like`` of each input, flash_api.cpp mha_bwd; cuDNN's attention, which an
    H100 with torch 2.11 runs: the same, tests/test_trace.py checks on the GPU) gives each gradient its input's
    strides, so a query that is a view of (L, B*H, D), as ``nn.MultiheadAttention`` makes it, gets a gradient whose
    views back to the in-projection need no copy; the CPU kernel's gradients are (B, L, H, D)-contiguous whatever
    the inputs, and the views' backward then copied each of q, k and v twice (8 MiB blocks an H100's stream of the
    zoo's nn.Transformer does not have: zoo_traces_h100_torch2.11_20261127.tar.gz)."""
    return tuple(torch.empty_strided(x.shape, x.stride(), dtype=g.dtype)
                 if isinstance(g, torch.Tensor) and g.shape == x.shape and _dense(x) else g
                 for g, x in zip(grads, inputs))


def cuda_log_sigmoid_outputs(outputs: Any) -> Any:
    """``log_sigmoid_forward``'s outputs as CUDA makes them: the result and an empty buffer. CUDA's backward
    recomputes what the CPU kernel keeps in the buffer, which the fake kernel sizes like the input; an H200 returned
    a (0,)-shaped buffer and allocated the result alone (benchmarks/results/estimate/log_sigmoid_h200_torch2.11_20261129/,
    and a GPU test). A focal loss (MONAI's DiceFocalLoss) otherwise kept one more input-sized block until its
    backward."""
    result, buffer = outputs
    return result, torch.empty(0, dtype=buffer.dtype)


def cuda_layer_norm_grads(grads: Any) -> Any:
    """The layer norm's backward outputs as CUDA lays them out: the input's gradient contiguous
    (layer_norm_kernel.cu: ``dX = empty_like(*X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``, X being the contiguous copy),
    where the fake kernel gives it the input's strides. Over a permuted input (a speech encoder's (B, C, T) features
    normed over C) the gradient flowing back is then a permuted view, which the convolution before it copies (an
    H200 stream of Data2Vec-Audio: entry_traces_h200_torch2.11_20261128_s26.tar.gz)."""
    dx = grads[0]
    if not isinstance(dx, torch.Tensor) or dx.is_contiguous():
        return grads
    return (torch.empty(dx.shape, dtype=dx.dtype), *grads[1:])


def contiguous_copy_bytes(x: torch.Tensor) -> int:
    """Bytes of ``x.contiguous()`` when it copies (a CUDA kernel's ``expect_contiguous`` of a permuted input), else 0."""
    return 0 if x.is_contiguous() else x.numel() * x.element_size()


@dataclass(frozen=True)
class _Layout:
    """A tensor's shape, strides and element size: what a convolution's copies depend on, without a tensor (the
    copies' layouts are worked out, not made)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @staticmethod
    def of(t: torch.Tensor) -> _Layout:
        return _Layout(tuple(t.shape), tuple(t.stride()), t.element_size())

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def as_2d(self) -> _Layout:
        """A 1-D convolution's tensor as CUDA runs it: ``view4d``, an ``unsqueeze(2)``
        (aten/src/ATen/native/Convolution.cpp)."""
        if len(self.shape) != 3:
            return self
        s = self.shape
        return _Layout((s[0], s[1], 1, s[2]), (*self.strides[:2], s[2] * self.strides[2], self.strides[2]),
                       self.itemsize)

    def laid_out(self, fmt: torch.memory_format) -> _Layout:
        """The layout of ``contiguous(fmt)``."""
        strides = [0] * len(self.shape)
        step = 1
        for d in _order(len(self.shape), fmt):
            strides[d] = step
            step *= max(self.shape[d], 1)
        return _Layout(self.shape, tuple(strides), self.itemsize)

    def is_in(self, fmt: torch.memory_format) -> bool:
        """``is_contiguous(memory_format=fmt)``: dense in that order, size-1 dimensions' strides ignored."""
        step = 1
        for d in _order(len(self.shape), fmt):
            if self.shape[d] != 1:
                if self.strides[d] != step:
                    return False
                step *= self.shape[d]
        return True

    def copy_bytes(self, fmt: torch.memory_format) -> int:
        """Bytes of ``contiguous(fmt)`` when it copies, else 0."""
        return 0 if self.is_in(fmt) else self.nbytes

    def suggested(self) -> torch.memory_format:
        """c10's ``suggest_memory_format``: channels-last for the strides of one (c10/core/MemoryFormat.h,
        ``is_channels_last_strides_2d``/``_3d``: a channel slice of one keeps the order), else contiguous."""
        n = len(self.shape)
        if n not in (4, 5) or self.strides[1] == 0:
            return torch.contiguous_format
        least = 0
        for d in (1, 3, 2, 0) if n == 4 else (1, 4, 3, 2, 0):
            if self.shape[d] == 0 or self.strides[d] < least or (d == 0 and least == self.strides[1]):
                return torch.contiguous_format
            least = self.strides[d] * max(self.shape[d], 1)
        return torch.channels_last if n == 4 else torch.channels_last_3d


def _order(ndim: int, fmt: torch.memory_format) -> tuple[int, ...]:
    """Dimensions from the fastest-varying to the slowest in a memory format."""
    if fmt == torch.channels_last:
        return (1, 3, 2, 0)
    if fmt == torch.channels_last_3d:
        return (1, 4, 3, 2, 0)
    return tuple(range(ndim - 1, -1, -1))


def _cudnn_format(a: _Layout, b: _Layout) -> torch.memory_format:
    """aten/src/ATen/native/ConvUtils.h, ``cudnn_conv_suggest_memory_format``: channels-last when either is."""
    for t in (a, b):
        if t.suggested() != torch.contiguous_format:
            return t.suggested()
    return torch.contiguous_format


def conv_input_copy_bytes(x: torch.Tensor, w: torch.Tensor) -> int:
    """The copy a CUDA convolution makes of an input not laid out as it runs (0 when there is none), taken before
    the output and given back when the op returns.

    aten/src/ATen/native/Convolution.cpp, ``_convolution``: a 1-D input is made ``contiguous()`` before it is viewed
    as 2-D ("avoid accidentally going through NHWC for permuted 3d input"), and cuDNN gets
    ``input.contiguous(backend_memory_format)``. A transposed (B, C, T) input is a speech model's feature encoder
    with layer norms over channels (Data2Vec-Audio): an H200 stream of the third fresh draw's Data2Vec-Audio CTC step
    has one such copy, the size of the input, before each convolution's output and freed after its workspace
    (entry_traces_h200_torch2.11_20261128_s26.tar.gz)."""
    xl = _Layout.of(x)
    if x.dim() == 3:
        return xl.copy_bytes(torch.contiguous_format)
    return xl.copy_bytes(_cudnn_format(xl, _Layout.of(w)))


@dataclass(frozen=True)
class ConvBackwardCopies:
    """The copies a CUDA convolution's backward makes, in bytes (0: none), in the three places it makes them."""

    before: tuple[int, int]
    """Before the gradients, held until the op returns: the input's copy, then the output gradient's."""
    data: int
    """The output gradient's copy the input's gradient takes (after it is allocated), freed after its call."""
    weight: tuple[int, int]
    """The output gradient's and the input's copies the weight's gradient takes (before it), freed after its call."""


def conv_backward_copies(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, input_grad: bool,
                         weight_grad: bool) -> ConvBackwardCopies:
    """Where and how large the copies of a CUDA convolution's backward are.

    aten/src/ATen/native/Convolution.cpp, ``convolution_backward``: a 1-D input is made ``contiguous()``; cuDNN gets
    ``input.contiguous(backend_memory_format)`` when the weight's gradient is wanted. cudnn/ConvShared.cpp:
    ``grad_output.to(input.suggest_memory_format())`` (a copy only where the two suggest different layouts), then
    ``cudnn_convolution_backward_input`` takes ``grad_output.contiguous(format)`` after allocating the input's
    gradient, and ``cudnn_convolution_backward_weight`` ``grad_output.contiguous(layout)`` and
    ``input.contiguous(layout)`` before the weight's. The H200 stream of Data2Vec-Audio (``conv_input_copy_bytes``)
    shows the input's copy, then the gradient's, before the input's gradient; a U-Net's gradients are channel slices
    of a concatenation's, which only the two inner calls copy."""
    xl, wl, gl = _Layout.of(x), _Layout.of(w), _Layout.of(grad)
    first = 0
    if x.dim() == 3:
        first = xl.copy_bytes(torch.contiguous_format)
        xl = xl.laid_out(torch.contiguous_format)
    xl, wl, gl = xl.as_2d(), wl.as_2d(), gl.as_2d()
    if weight_grad and x.dim() != 3:
        first = xl.copy_bytes(_cudnn_format(xl, wl))
        xl = xl.laid_out(_cudnn_format(xl, wl)) if first else xl
    moved = gl.nbytes if gl.suggested() != xl.suggested() else 0
    gl = gl.laid_out(xl.suggested()) if moved else gl
    data = gl.copy_bytes(_cudnn_format(gl, wl)) if input_grad else 0
    layout = _cudnn_format(xl, gl)
    weight = (gl.copy_bytes(layout), xl.copy_bytes(layout)) if weight_grad else (0, 0)
    return ConvBackwardCopies(before=(first, moved), data=data, weight=weight)


def held_during_bytes(name: str, args: Any) -> list[int]:
    """Blocks an op takes before its outputs and gives back, in reverse order, when it returns (0: none taken);
    none for most.

    * The CUDA layer norm's contiguous copy of a permuted input (ConvNeXt, Swin, a ViT's residual stream after
      nn.MultiheadAttention, a speech encoder's (B, C, T) features), forward and backward alike
      (aten/src/ATen/native/cuda/layer_norm_kernel.cu: ``X = input.expect_contiguous()`` before ``Y``/``dX``).
    * ``roll`` over k > 1 dimensions: one roll per dimension, each into a new tensor the input's size
      (TensorTransformations.cpp, roll_common: ``roll(roll(self, shifts[0], dims[0]), tail_shifts, tail_dims)``),
      so k - 1 intermediates before the output, freed as the recursion returns (a Swin3D-T's H200 stream: two
      blocks the input's size before each 3-D shift's output, entry_traces_h200_torch2.11_20261128_s26_r3.tar.gz).
    """
    if name == "native_layer_norm":
        return [contiguous_copy_bytes(args[0])]
    if name == "native_layer_norm_backward":
        return [contiguous_copy_bytes(args[1])]
    if name == "roll" and len(args) > 2 and len(args[2]) > 1:
        x = args[0]
        return [x.numel() * x.element_size()] * (len(args[2]) - 1)
    return []


def kernel_transients(name: str, args: Any, out: Any, gpu: GpuSpec) -> list[int]:
    """Blocks a CUDA kernel takes, in order, and gives back in reverse order inside one op
    (memfit.estimate.workspaces has the rules)."""
    if name in ("_softmax", "_log_softmax"):
        # SoftMax.cu, host_softmax: input_.contiguous() after the structured kernel allocated the output, so a
        # softmax over a permuted input takes a copy of it for the call (an H100 stream of the zoo's
        # nn.Transformer: a 606 MB block for cross-entropy over its (B, V, L) logits, after the log-softmax's
        # output, every step: zoo_traces_h100_torch2.11_20261127.tar.gz)
        return [b for b in (contiguous_copy_bytes(args[0]),) if b > 0]
    if name in ("_softmax_backward_data", "_log_softmax_backward_data"):
        grad, output = args[0], args[1]
        if name == "_softmax_backward_data":
            # SoftMax.cu, softmax_backward_cuda_out: tmp = grad * output, laid out as TensorIterator lays out
            # a product (fake tensors do the same), then host_softmax_backward's tmp.contiguous() and
            # output.contiguous(); log-softmax's backward skips the product
            grad = torch.ops.aten.mul.Tensor(grad, output)
        blocks = [grad.numel() * grad.element_size()] if name == "_softmax_backward_data" else []
        blocks += [contiguous_copy_bytes(t) for t in (grad, output)]
        return [b for b in blocks if b > 0]
    if name == "_scaled_dot_product_efficient_attention_backward" and args[1].dtype == torch.float32:
        # attention_backward.cu, _efficient_attention_backward: ``grad_out.contiguous()`` of the (B, L, H, D) view
        # first (a copy where the attention's output was permuted after it, as nn.MultiheadAttention does), held
        # through the call; then delta and the kernel's workspace
        grad, q = _Layout.of(args[0]), args[1]
        order = (0, 2, 1, 3)  # the (B, H, L, D) gradient viewed (B, L, H, D)
        view = _Layout(tuple(grad.shape[d] for d in order), tuple(grad.strides[d] for d in order), grad.itemsize)
        blocks = [view.copy_bytes(torch.contiguous_format),
                  ws.efficient_attention_backward_fp32_bytes(q.shape[0], q.shape[1], q.shape[2], q.shape[3])]
        return [b for b in blocks if b > 0]
    if name == "_roi_align_backward" and torch.are_deterministic_algorithms_enabled():
        return roi_align_compiled_backward_blocks(args)
    nbytes = _kernel_transient(name, args, out, gpu)
    return [nbytes] if nbytes > 0 else []


def _nhwc_upsample_backward(grad: torch.Tensor) -> bool:
    """Whether a 2-D upsampling's backward runs CUDA's NHWC kernel: a channels-last gradient of at least 4 channels
    (the input's gradient, allocated in the gradient's layout, then is channels-last too)."""
    return grad.dim() == 4 and grad.shape[1] >= 4 and _Layout.of(grad).suggested() == torch.channels_last


def _kernel_transient(name: str, args: Any, out: Any, gpu: GpuSpec) -> int:
    """Scratch memory a CUDA kernel takes as one block and gives back inside one op."""
    if name == "native_layer_norm_backward":
        # the kernel's contiguous copy of a permuted output gradient, after dX (the input's copy comes before it:
        # held_during_bytes). An H200 stream of Data2Vec-Audio (both permuted): input copy, dX, this, each
        # the input's size, the two copies freed when the op returns (entry_traces_h200_torch2.11_20261128_s26)
        return contiguous_copy_bytes(args[0])
    if name in ("sum", "mean") and isinstance(out, torch.Tensor) and args[0].is_floating_point():
        x = args[0]
        dims = args[1] if len(args) > 1 and args[1] else list(range(x.dim()))
        return ws.reduction_staging_bytes(x.shape, x.stride(), dims, x.element_size(), gpu.sm_count,
                                          ws.max_threads_per_sm(gpu.compute_capability))
    if name in ("upsample_bilinear2d_backward", "upsample_nearest2d_backward") and _nhwc_upsample_backward(args[0]):
        # UpSampleBilinear2d.cu / UpSampleNearest2d.cu: a channels-last gradient of 4 or more channels runs the NHWC
        # kernel on grad_output.contiguous(ChannelsLast), which copies nothing when it is laid out so. HF DPT's
        # neck and head (channels-last: permuted ViT tokens) upsample bilinearly: its H200 stream has no such
        # block, where this rule's block below charged one of up to 576 MB in each of four backward calls
        # (entry_traces_holdout4_h200_torch2.11_20261129_s31.tar.gz)
        return _Layout.of(args[0]).copy_bytes(torch.channels_last)
    if name.startswith("upsample_") and name.endswith("_backward"):
        # the kernels' grad_output.contiguous() (aten/src/ATen/native/cuda/UpSampleNearest2d.cu and its siblings): a
        # copy of a gradient that is a channel slice of a concatenation's (smp's U-Net decoder on an H200,
        # transients_h200_20261126.json), none for a contiguous one. The H200 blocks of smp's U-Net at 2048², named
        # by the op that took them, show both: its first upsampling's contiguous gradient took only the input's
        # gradient, the others' sliced ones a copy each (op_blocks_h200_torch2.11_20261130_s36; the ninth draw, where
        # charging the contiguous one too, as memfit did from session 27 to 35 for smp's MAnet, put the estimate
        # 13 % over). MAnet's capped replay, which that charge had held up, is covered by the bound's
        # ``workspace_fallback`` (memfit.estimate.predict)
        return contiguous_copy_bytes(args[0])
    if name in ("_scaled_dot_product_flash_attention_for_cpu_backward",
                "_scaled_dot_product_efficient_attention_backward"):
        # (the memory-efficient kernel's backward in fp32: kernel_transients, above)
        q = args[1]
        return ws.attention_backward_bytes(q.numel() * q.element_size(), q.shape[0] * q.shape[1] * q.shape[2])
    if name == "embedding_dense_backward":
        grad, indices = args[0], args[1]
        return grad.numel() * grad.element_size() + 16 * indices.numel()
    if name == "binary_cross_entropy_with_logits":
        return 2 * args[0].numel() * args[0].element_size()
    return _index_sort_bytes(name, args)


INDEX_SORT_BYTES = 48.25
"""Bytes a CUDA ``index_put_`` takes per index element when it sorts its indices (indexing.cu,
``index_put_with_sort_kernel``: the linear index, its sorted copy, the original positions and the radix sort's
buffers, int64 each): 48.25 on every shape of an H200 grid, 1-D to 4-D, 65 536 to 16.8 M indices
(benchmarks/results/estimate/deterministic_index_h200_torch2.11_20261130.json; 48 x N plus 0.22-0.30 x N)."""


ROI_ALIGN_GRAD_COPIES = 4
"""The compiled ``roi_align``'s backward holds four gradients of the gathered samples, one per bilinear corner, in
its compute dtype (``_bilinear_interpolate``: ``val = w1 * v1 + ... + w4 * v4``)."""

ROI_ALIGN_INPUT_ALLOWANCE = 3.2
"""Where a feature map is large against the samples gathered from it (input elements over 1.5 x the samples), the
compiled backward's peak was above the rule by up to 3.12 x the input's size in fp32 (a 200 x 200 x 256 map, 64 RoIs),
not a block the rule names: the bound adds this many fp32 input sizes (``deterministic_roi_align``)."""


def roi_align_samples(rois: int, channels: int, pooled: tuple[int, int], sampling_ratio: int,
                      size: tuple[int, int]) -> int:
    """How many points torchvision's Python ``roi_align`` gathers: ``(K, C, PH, PW, IY, IX)`` with IY x IX the
    sampling ratio squared, or the feature map's whole height x width for an adaptive ratio (<= 0), masked
    (torchvision/ops/roi_align.py, ``_roi_align``: ``iy = torch.arange(height)`` when not ``exact_sampling``)."""
    grid = sampling_ratio * sampling_ratio if sampling_ratio > 0 else size[0] * size[1]
    return rois * channels * pooled[0] * pooled[1] * grid


def roi_align_compiled_backward_blocks(args: Any) -> list[int]:
    """The blocks of torchvision's ``roi_align`` backward under deterministic algorithms on CUDA, where it runs
    ``_roi_align`` through ``torch.compile``, for N gathered samples: ``ROI_ALIGN_GRAD_COPIES`` gradients of them in
    the compute dtype (fp32 for fp32 inputs and under autocast, which casts to it: ``maybe_cast``), then four int64
    indices of them and one of twice that (the gathers' backward, an ``index_put_`` with accumulation into the
    input's gradient, and its sort: ``INDEX_SORT_BYTES`` a sample in all). At the peaks of two detection steps an
    H200 held these blocks, allocated in the compiled graph at ``masked_index`` and ``_bilinear_interpolate``
    (benchmarks/results/estimate/peak_blocks_rcnn_deterministic_h200_torch2.11_20261130_s38.json: 4 x 0.38 GB,
    4 x 0.76 GB, 1.55 GB); on an H200 grid of 44 single calls (64-2048 RoIs, 64 and 256 channels, 7 x 7 and 14 x 14
    bins, sampling ratios 1-3, maps of 25-200, fp32, fp16 and fp16 under autocast) their sum is the backward's peak
    above its input's gradient to within 0.2 B a sample where the samples outnumber the input's elements 1.5 : 1 or
    more (64.22 B fp32, 56.22 B fp16), and the forward kept nothing for the backward and took nothing beyond its
    output (benchmarks/results/estimate/roi_align_deterministic_h200_torch2.11_20261130.json). The kernel the trace
    runs shows none of it. ``args``: ``_roi_align_backward``'s (grad, rois, spatial_scale, pooled_height,
    pooled_width, batch_size, channels, height, width, sampling_ratio, aligned)."""
    grad = args[0]
    samples = roi_align_samples(grad.shape[0], grad.shape[1], (int(args[3]), int(args[4])), int(args[9]),
                                (int(args[7]), int(args[8])))
    if samples == 0:
        return []
    # under autocast torchvision's autocast kernel hands the op fp32 tensors, so the gradient is fp32 as the
    # compiled path's is
    grads = [samples * grad.element_size()] * ROI_ALIGN_GRAD_COPIES
    indices = [samples * 8] * 4
    return grads + indices + [math.ceil(samples * INDEX_SORT_BYTES) - sum(indices)]  # the sort's rest


_SORTING_OPS = frozenset({"index_put", "index_put_", "_index_put_impl_", "scatter_add", "scatter_add_",
                          "scatter_reduce", "scatter_reduce_", "index_add", "index_add_"})


def _index_sort_bytes(name: str, args: Any) -> int:
    """The sort block of CUDA's accumulating index ops (the same grid): ``index_put_`` with accumulation sorts with
    or without deterministic algorithms; under them ``index_put_`` without accumulation takes the same kernel
    (TensorAdvancedIndexing.cpp, ``_index_put_impl_``: ``accumulate || deterministicAlgorithms()``), ``scatter_add_``
    and ``scatter_reduce_`` with "sum" run through it over their index's elements (``_scatter_via_index_put``), and
    ``index_add_`` through it on a copy of its source (``source * alpha``)."""
    if name not in _SORTING_OPS:
        return 0
    deterministic = torch.are_deterministic_algorithms_enabled()
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        accumulate = bool(args[3]) if len(args) > 3 else False
        indices = [i for i in args[1] if i is not None]
        if not (accumulate or deterministic) or not indices:
            return 0
        if any(i.dtype == torch.bool for i in indices):
            count = max(i.numel() for i in indices)  # a mask becomes its true elements' positions: at most its size
        else:
            count = math.prod(torch.broadcast_shapes(*(i.shape for i in indices)))
        return math.ceil(INDEX_SORT_BYTES * count)
    if not deterministic:
        return 0
    if name in ("scatter_add", "scatter_add_") or (name in ("scatter_reduce", "scatter_reduce_")
                                                   and len(args) > 4 and args[4] == "sum"):
        return math.ceil(INDEX_SORT_BYTES * args[2].numel())
    if name in ("index_add", "index_add_"):
        source = args[3]
        return math.ceil(INDEX_SORT_BYTES * args[2].numel()) + source.numel() * source.element_size()
    return 0


def conv_workspace(trace: Trace, where: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, stride: Any,
                   transposed: bool, groups: int, *, backward: bool = False) -> int:
    """cuDNN's workspace for a convolution of ``x`` by ``w`` into ``y`` (``workspaces``, measured); ``trace``
    notes where the size is extrapolated or erratic (``where``: the module)."""
    fmt = _cudnn_format(_Layout.of(x), _Layout.of(w))
    channels_last = fmt != torch.contiguous_format and x.dim() == 4 and not transposed and groups == 1
    spatial = max(x.shape[2:], default=0)
    if max(math.prod(x.shape[1:]), math.prod(y.shape[1:])) > ws.INT32_LIMIT and (
            "conv_workspace_extrapolated" not in trace.uncertain):
        # PyTorch cannot split such a call by the batch (needs_64bit_indexing_no_split): cuDNN's 64-bit kernels run
        # it. The one 3x3x3 shape measured took 54 MiB more than the rule in its filter gradient
        # (conv_grid_first_h200_torch2.11_20261129_s34.json)
        trace.uncertain["conv_workspace_extrapolated"] = (
            f"{where}: a convolution whose one sample has more than 2^31 - 1 elements ({tuple(x.shape[1:])} -> "
            f"{tuple(y.shape[1:])}), which cuDNN runs with 64-bit indexing, measured on two shapes")
    calibrated = ws.channels_last_calibrated_size(x.shape, w.shape[2:], tuple(stride)) if channels_last else (
        ws.CALIBRATED_CONV_SIZE.get(x.dim() - 2, 0))
    if spatial > calibrated and "conv_workspace_extrapolated" not in trace.uncertain:
        layout = " channels-last" if channels_last else ""
        trace.uncertain["conv_workspace_extrapolated"] = (
            f"{where}: a {x.dim() - 2}-D{layout} convolution over {tuple(x.shape[2:])}, larger than the calibrated "
            f"{calibrated} per axis"
        )
    half = x.element_size() == 2
    call = dict(itemsize=x.element_size(), stride=stride, groups=groups, transposed=transposed,
                half=half, backward=backward, fp16=x.dtype == torch.float16)
    if channels_last:
        unsure = ws.channels_last_unsure_bytes(x.shape, y.shape, w.shape[2:], itemsize=x.element_size(),
                                               half=half, backward=backward)
        if ws.channels_last_strided_pointwise_fp32(x.shape, y.shape, w.shape[2:], half=half, backward=backward):
            what = (f"a strided fp32 channels-last 1x1 convolution {w.shape[1]} -> {w.shape[0]} channels over "
                    f"{tuple(x.shape[2:])}, whose cuDNN workspace was none or input + output by shape on the grid")
        elif ws.channels_last_fp32_odd(x.shape, y.shape, w.shape[2:], half=half):
            what = (f"an fp32 channels-last convolution {w.shape[1]} -> {w.shape[0]} channels over "
                    f"{tuple(x.shape[2:])}, whose cuDNN workspace ranged from none to "
                    f"{ws.CHANNELS_LAST_FP32_ODD_RATIO} x input + output by channel count on the grid")
        else:
            what = (f"a channels-last convolution {w.shape[1]} -> {w.shape[0]} channels over {tuple(x.shape[2:])}, "
                    f"whose cuDNN workspace ranged from none to {ws.CHANNELS_LAST_BACKWARD_MAX_BYTES / 2**20:.0f} MiB "
                    "on the grid")
    else:
        unsure = ws.conv_workspace_unsure_bytes(x.shape, w.shape, y.shape, **call)
        if groups > 1:
            what = f"the gradient of a grouped convolution ({groups} groups) over {tuple(x.shape[2:])} in fp16"
        elif half:
            what = (f"the filter gradient of a 1x1 convolution {w.shape[1]} -> {w.shape[0]} channels over "
                    f"{tuple(x.shape[2:])} in half precision")
        elif backward:
            what = (f"the filter gradient of an fp32 3x3 convolution {w.shape[1]} -> {w.shape[0]} channels over "
                    f"{tuple(x.shape[2:])}, which took up to {17 + 16 / min(x.shape[2:]):.1f} x its input at some "
                    "channel counts on the grid")
        else:
            what = (f"the forward of an fp32 1x1 convolution {w.shape[1]} -> {w.shape[0]} channels over "
                    f"{tuple(x.shape[2:])} (strided, or beyond 2^31 - 1 elements), which took the input or input + "
                    "output by shape")
    if unsure > trace.uncertain_bytes.get("conv_workspace_erratic", 0):
        trace.uncertain["conv_workspace_erratic"] = (
            f"{where}: {what}, where cuDNN's workspace was erratic: the bound adds {unsure / 2**20:.0f} MiB")
        trace.uncertain_bytes["conv_workspace_erratic"] = unsure
    if channels_last:
        # PyTorch's weight.contiguous(format) for the forward and the input's gradient (ConvShared.cpp), in the call
        return ws.conv_workspace_bytes(x.shape, w.shape, y.shape, **call, channels_last=True) + (
            _Layout.of(w).copy_bytes(fmt))
    return ws.conv_workspace_bytes(x.shape, w.shape, y.shape, **call)


def narrow_dgrad_workspace(trace: Trace, where: str, x: torch.Tensor, w: torch.Tensor, stride: Any, dilation: Any,
                           transposed: bool, groups: int) -> int:
    """The input gradient's workspace of a narrow half-precision 3x3 convolution (``workspaces``, measured)."""
    shape = dict(itemsize=x.element_size(), stride=stride, dilation=dilation, groups=groups, transposed=transposed)
    if ws.narrow_dgrad_unsure(x.shape, w.shape, **shape) and "conv_workspace_extrapolated" not in trace.uncertain:
        trace.uncertain["conv_workspace_extrapolated"] = (
            f"{where}: a 3x3 convolution to {w.shape[0]} channels in half precision, whose input gradient "
            "cuDNN computes with a 72-image workspace at some sizes"
        )
    return ws.narrow_dgrad_workspace_bytes(x.shape, w.shape, **shape)
