"""Memory that CUDA libraries allocate inside a call, which no CPU trace can see: rules fitted on measurements.

* **cuDNN convolutions.** With PyTorch's default NCHW layout, cuDNN 9 (``benchmark=False``) takes one transient
  block per call the size of input + output + weight: it converts them to NHWC for its tensor-core kernels and
  frees the block when the call returns. 1x1 convolutions (2-D, and 3-D in fp32), grouped/depthwise
  convolutions and non-overlapping "patchify" convolutions run without it. Backward makes two calls (data and
  filter gradients), each with such a block. Measured on an H200, cuDNN 9.19, torch 2.11:
  ``benchmarks/results/cudnn_calibration_h200_20261126.json`` (360 convolution shapes, 2-D and 3-D, fp32/bf16/
  fp16; the rule is within a few percent on the large ones, which are the ones that decide a peak).
* **cuDNN LSTM.** The fused RNN keeps a reserve buffer for backward of T*N*H*(6L-1) elements (4 gates + cell
  per layer and step, plus the outputs of the L-1 inner layers), and its backward takes about (8 + 1.5L) such
  T*N*H blocks transiently. Same calibration file, 48 LSTM shapes.
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


def lstm_reserve_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int, itemsize: int) -> int:
    """The cuDNN LSTM reserve space kept from forward to backward."""
    return seq * batch * hidden * directions * (6 * layers - 1) * itemsize


def lstm_backward_transient_bytes(seq: int, batch: int, hidden: int, layers: int, directions: int,
                                  itemsize: int) -> int:
    """Transient bytes of the cuDNN LSTM backward (beyond the gradients it returns)."""
    return int(seq * batch * hidden * directions * itemsize * (8 + 1.5 * layers))
