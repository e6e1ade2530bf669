"""What CUDA kernels allocate that their outputs do not show, and the layouts CUDA gives outputs the CPU lays out
otherwise.

The tracer runs every op on fake CPU tensors, so it sees each op's outputs; a CUDA kernel may also take scratch
blocks for the call (a contiguous copy of a permuted input, a reduction's staging buffer), call cuBLAS (whose
handle takes a workspace on first use), or allocate its outputs in another order than it returns them. Each rule
names the kernel's source or the measurement it comes from; ``memfit.estimate.workspaces`` has the sizes that
depend on the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from memfit.estimate import workspaces as ws
from memfit.estimate.gpus import GpuSpec

if TYPE_CHECKING:
    from memfit.estimate.trace_record import Trace

__all__ = ["ALLOCATION_ORDER", "CUBLAS_OPS", "contiguous_copy_bytes", "conv_workspace", "cuda_attention_grads",
           "kernel_transients", "layer_norm_copy_bytes", "narrow_dgrad_workspace"]


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


def contiguous_copy_bytes(x: torch.Tensor) -> int:
    """Bytes of ``x.contiguous()`` when it copies (a CUDA kernel's ``expect_contiguous`` of a permuted input), else 0."""
    return 0 if x.is_contiguous() else x.numel() * x.element_size()


def layer_norm_copy_bytes(name: str, args: Any) -> int:
    """The contiguous copy the CUDA layer norm makes of a permuted input (ConvNeXt, Swin, a ViT's residual
    stream after nn.MultiheadAttention) before its outputs, freed when it returns; 0 when there is none."""
    return contiguous_copy_bytes(args[0]) if name == "native_layer_norm" else 0


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
    nbytes = _kernel_transient(name, args, out, gpu)
    return [nbytes] if nbytes > 0 else []


def _kernel_transient(name: str, args: Any, out: Any, gpu: GpuSpec) -> int:
    """Scratch memory a CUDA kernel takes as one block and gives back inside one op."""
    if name == "native_layer_norm_backward":
        return contiguous_copy_bytes(args[1])  # of a permuted input (ConvNeXt, Swin)
    if name in ("sum", "mean") and isinstance(out, torch.Tensor) and args[0].is_floating_point():
        x = args[0]
        dims = args[1] if len(args) > 1 and args[1] else list(range(x.dim()))
        return ws.reduction_staging_bytes(x.shape, x.stride(), dims, x.element_size(), gpu.sm_count,
                                          ws.max_threads_per_sm(gpu.compute_capability))
    if name == "roll":
        x = args[0]
        # one intermediate per rolled dimension but the last
        return max(len(args[2]) - 1, 0) * x.numel() * x.element_size() if len(args) > 2 else 0
    if name.startswith("upsample_") and name.endswith("_backward"):
        return args[0].numel() * args[0].element_size()
    if name in ("_scaled_dot_product_flash_attention_for_cpu_backward",
                "_scaled_dot_product_efficient_attention_backward"):
        # the memory-efficient kernel's backward took the same (fp32 nn.MultiheadAttention: two query-sized
        # blocks and two log-sum-exp-sized ones beyond the gradients; fit probe p_enc_fp32_prenorm, H200)
        q = args[1]
        return ws.attention_backward_bytes(q.numel() * q.element_size(), q.shape[0] * q.shape[1] * q.shape[2])
    if name == "embedding_dense_backward":
        grad, indices = args[0], args[1]
        return grad.numel() * grad.element_size() + 16 * indices.numel()
    if name == "binary_cross_entropy_with_logits":
        return 2 * args[0].numel() * args[0].element_size()
    return 0


def conv_workspace(trace: Trace, where: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, stride: Any,
                   transposed: bool, groups: int, *, backward: bool = False) -> int:
    """cuDNN's workspace for a convolution of ``x`` by ``w`` into ``y`` (``workspaces``, measured); ``trace``
    notes where the size is extrapolated or erratic (``where``: the module)."""
    spatial = max(x.shape[2:], default=0)
    calibrated = ws.CALIBRATED_CONV_SIZE.get(x.dim() - 2, 0)
    if spatial > calibrated and "conv_workspace_extrapolated" not in trace.uncertain:
        trace.uncertain["conv_workspace_extrapolated"] = (
            f"{where}: a {x.dim() - 2}-D convolution over {tuple(x.shape[2:])}, larger than the calibrated "
            f"{calibrated} per axis"
        )
    call = dict(itemsize=x.element_size(), stride=stride, groups=groups, transposed=transposed,
                half=x.element_size() == 2, backward=backward, fp16=x.dtype == torch.float16)
    unsure = ws.conv_workspace_unsure_bytes(x.shape, w.shape, y.shape, **call)
    if unsure > trace.uncertain_bytes.get("conv_workspace_erratic", 0):
        what = (f"the gradient of a grouped convolution ({groups} groups) over {tuple(x.shape[2:])} in fp16"
                if groups > 1 else f"the filter gradient of a 1x1 convolution {w.shape[1]} -> {w.shape[0]} "
                f"channels over {tuple(x.shape[2:])} in half precision")
        trace.uncertain["conv_workspace_erratic"] = (
            f"{where}: {what}, where cuDNN's workspace was erratic: the bound adds {unsure / 2**20:.0f} MiB")
        trace.uncertain_bytes["conv_workspace_erratic"] = unsure
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
