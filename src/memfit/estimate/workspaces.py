"""Memory that CUDA libraries allocate inside a call, which no CPU trace can see: rules fitted on measurements.

* **cuDNN convolutions.** With PyTorch's default NCHW layout, cuDNN 9 (``benchmark=False``) takes one transient
  block per call the size of input + output + weight: it converts them to NHWC for its tensor-core kernels and
  frees the block when the call returns. 1x1 convolutions (2-D, and 3-D in fp32), grouped/depthwise
  convolutions and non-overlapping "patchify" convolutions run without it. Backward makes two calls (data and
  filter gradients), each with such a block. Measured on an H200, cuDNN 9.19, torch 2.11:
  ``benchmarks/results/estimate/cudnn_calibration_h200_torch2.11_20261126.json`` (360 convolution shapes, 2-D and
  3-D, fp32/bf16/fp16; the rule is within a few percent on the large ones, which are the ones that decide a peak).
* **cuDNN RNNs.** The fused RNN keeps a reserve buffer for backward of T*N*H*D*(kL-1) elements: k = 6 for an
  LSTM (4 gates + cell per layer and step, and the outputs of the L-1 inner layers), 7 for a GRU, 2 for a tanh or
  ReLU RNN. Measured exactly (within 0.5 % on the large shapes) on a grid of 192 shapes, 1-3 layers, one and two
  directions: ``benchmarks/results/estimate/cudnn_calibration_rnn_h200_torch2.11_20261126.json``. Forward and
  backward take about (8 + 1.5L) such T*N*H*D blocks transiently (fitted on 48 LSTM shapes, the calibration file
  above). GRU and tanh/ReLU RNN transients follow a power law in the shape fitted on the RNN grid's fp32 rows of
  1 MB and more (within ±32 %; the issue-13 1000-step GRU, outside the grid, +28 % forward, +53 % backward), so
  an RNN widens the upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _nbytes(shape: Sequence[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


def conv_workspace_bytes(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    *,
    itemsize: int,
    stride: Sequence[int],
    groups: int,
    transposed: bool,
    half: bool,
) -> int:
    """Transient bytes one cuDNN convolution call takes (forward, or one of the two backward calls)."""
    kernel = tuple(weight_shape[2:])
    dims = len(kernel)
    if groups > 1:
        return 0  # depthwise/grouped kernels: no layout conversion measured
    if all(k == 1 for k in kernel) and (dims == 2 or not half):
        return 0  # 1x1 convolutions are GEMMs on the NCHW data
    if not transposed and tuple(stride) == kernel and any(k > 1 for k in kernel):
        return 0  # patchify (kernel == stride), e.g. ViT's patch embedding
    return (
        _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)
    )


RNN_RESERVE_PER_LAYER = {"LSTM": 6, "GRU": 7, "RNN_TANH": 2, "RNN_RELU": 2}


def rnn_reserve_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int, itemsize: int,
                      mode: str = "LSTM") -> int:
    """The cuDNN RNN reserve space kept from forward to backward."""
    return seq * batch * hidden * directions * (RNN_RESERVE_PER_LAYER[mode] * layers - 1) * itemsize


def lstm_reserve_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int, itemsize: int) -> int:
    """The cuDNN LSTM reserve space kept from forward to backward."""
    return rnn_reserve_bytes(seq, batch, hidden, layers, directions, itemsize, "LSTM")


def lstm_backward_transient_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int,
                                  itemsize: int) -> int:
    """Transient bytes of the cuDNN LSTM backward (beyond the gradients it returns)."""
    return int(seq * batch * hidden * directions * itemsize * (8 + 1.5 * layers))


# ----------------------------------------------------------------------------------------------------------
# Transients of other CUDA kernels, measured op by op with benchmarks/profile_transients.py on an H200
# (torch 2.11, cuDNN 9.19): benchmarks/results/estimate/transients_h200_torch2.11_20261126.json. Each rule says
# what it matched.
# ----------------------------------------------------------------------------------------------------------

MiB = 1 << 20

# The largest spatial size per axis the convolution rule was checked on (calibrate_cudnn.py: 2-D 48-512, 3-D
# 24-128; up to 512 and 128 by --only conv_large, where the rule was at most 61 MB under the measured workspace:
# benchmarks/results/estimate/cudnn_calibration_conv_large_h200_torch2.11_20261126.json): larger convolutions use
# the rule by extrapolation, which widens the estimate's upper bound.
CALIBRATED_CONV_SIZE = {1: 512, 2: 512, 3: 128}


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def max_threads_per_sm(compute_capability: tuple[int, int]) -> int:
    """Resident threads per SM (CUDA C Programming Guide, "Technical Specifications per Compute Capability"):
    2048 on 7.0, 8.0 and 9.0 (V100, A100, H100/H200), 1536 on 8.6 and 8.9 (RTX 30xx/40xx, L4), 1024 on 7.5."""
    major, minor = compute_capability
    return {(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536}.get((major, minor), 2048)


def reduction_staging_bytes(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int], itemsize: int,
                            sm_count: int, threads_per_sm: int = 2048) -> int:
    """Global-memory staging that CUDA's reduction kernel (``sum``) takes for one call, and its semaphores.

    The kernel (ATen/native/cuda/Reduce.cuh, ``setReduceConfig``) splits a reduction across thread blocks when each
    output has many inputs and there are few outputs for the GPU's SMs; the blocks' partial results then go through
    a buffer of ``accumulator size x outputs x blocks per output`` (x the block width and output vector width when
    each thread owns its own outputs). This follows that launch configuration step by step for a tensor of
    ``shape`` and element ``strides`` summed over ``dims`` (float accumulation; ``itemsize`` is the input's).
    The semaphores it also takes (4 bytes per column of blocks, in the small pool) are left out.
    Checked against 28 measured ``sum`` calls of 80 to 3072 columns (timm ConvNeXt, its channels-last layer
    scale included; benchmarks/results/estimate/transients_h200_torch2.11_20261126.json) and a BERT-MLM bias
    gradient over a 30522-wide vocabulary (62.5 MB where the earlier rule said 132 MiB), all to the byte on an H200.
    """
    ndim = len(shape)
    reduced = {d % ndim for d in dims} if ndim else set()
    # TensorIterator: reduced dimensions first, each group fastest-moving first; size-1 dimensions drop out
    order = sorted((d for d in range(ndim) if shape[d] != 1), key=lambda d: (d not in reduced, strides[d]))
    sizes: list[int] = []
    steps: list[int] = []
    kinds: list[bool] = []
    for d in order:  # coalesce neighbours that one stride walks through (never a reduced with a kept one)
        if sizes and kinds[-1] == (d in reduced) and steps[-1] * sizes[-1] == strides[d]:
            sizes[-1] *= shape[d]
        else:
            sizes.append(shape[d])
            steps.append(strides[d])
            kinds.append(d in reduced)
    numel = math.prod(shape) if ndim else 1
    outputs = math.prod(n for n, r in zip(sizes, kinds) if not r)
    if numel == 0 or outputs == numel:
        return 0
    inputs = numel // outputs
    acc = 8 if itemsize == 8 else 4  # float accumulation (double for float64)
    n_reduce = sum(kinds)
    on_fastest = n_reduce == len(sizes) or steps[0] < steps[n_reduce]
    if on_fastest:
        dim0, dim1, fastest = inputs, outputs, steps[0]
    else:
        dim0, dim1, fastest = outputs, inputs, steps[n_reduce]
    vec_out = 1
    if fastest == 1:
        if on_fastest and dim0 >= 128 and n_reduce == 1:
            dim0 //= 4  # vectorised along the input (vt0 = 4)
        elif not on_fastest:  # vectorised along the output: 4, halved until it divides the sizes and strides
            vec_out = 4
            for n in [sizes[n_reduce]] + [s for i, s in enumerate(steps) if i != n_reduce]:
                while n % vec_out:
                    vec_out //= 2
            dim0 //= vec_out
    max_threads = 512 // vec_out
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_height = min(dim1_pow2, max_threads // min(dim0_pow2, 32))
    block_width = min(dim0_pow2, max_threads // block_height)
    step_input = step_output = 1
    if on_fastest:
        step_input *= block_width
    else:
        step_output *= block_width
    split_warps = _div_up(inputs, step_input) >= min(block_height * 16, 256)
    if split_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    grid_x = _div_up(outputs // vec_out, step_output)
    target_grid = sm_count * (threads_per_sm // (block_width * block_height))
    values_per_thread = _div_up(inputs, step_input)
    if not (split_warps and values_per_thread >= 256 and grid_x <= target_grid):
        return 0
    ctas = min(max(_div_up(target_grid, grid_x), _div_up(values_per_thread, 256)), _div_up(values_per_thread, 16))
    if ctas <= 1:
        return 0
    return acc * outputs * ctas * (1 if on_fastest else block_width * vec_out)


def attention_backward_bytes(query_bytes: int, batch_heads_len: int) -> int:
    """Fused (cuDNN/flash) attention backward: about two query-sized fp32-accumulation blocks plus a float
    per row. Matched ViT-B/16 (38.0 MiB) and GPT-2 (24.4 MiB) within 3 %."""
    return 2 * query_bytes + 4 * batch_heads_len


def lstm_forward_transient_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int,
                                 itemsize: int) -> int:
    """cuDNN LSTM forward workspace: measured equal to its backward transient (338.5 vs 339.0 MiB)."""
    return lstm_backward_transient_bytes(seq, batch, hidden, layers, directions, itemsize)


# ln(bytes) = c0 + c1 ln(T*N) + c2 ln(H) + c3 L + c4 ln(D), fp32, least squares in log space on the RNN grid
# (benchmarks/results/estimate/cudnn_calibration_rnn_h200_torch2.11_20261126.json); other dtypes scale by size.
_RNN_POWER_LAW = {
    ("GRU", "forward"): (10.298, 0.641, 0.352, 0.226, 0.918),
    ("GRU", "backward"): (9.907, 0.633, 0.472, 0.231, 0.884),
    ("RNN_TANH", "forward"): (7.549, 0.741, 0.767, 0.190, 0.679),
    ("RNN_TANH", "backward"): (9.275, 0.682, 0.485, 0.219, 0.912),
}


def rnn_transient_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int, itemsize: int,
                        mode: str, phase: str) -> int:
    """Transient bytes of a cuDNN RNN call (``phase``: forward or backward): the LSTM rule for an LSTM, the
    power law above for a GRU or a plain RNN (ReLU taken as tanh)."""
    if mode == "LSTM":
        return lstm_backward_transient_bytes(seq, batch, hidden, layers, directions, itemsize)
    c0, c1, c2, c3, c4 = _RNN_POWER_LAW["GRU" if mode == "GRU" else "RNN_TANH", phase]
    fp32 = math.exp(c0 + c1 * math.log(seq * batch) + c2 * math.log(hidden) + c3 * layers + c4 * math.log(directions))
    return int(fp32 * itemsize / 4)
