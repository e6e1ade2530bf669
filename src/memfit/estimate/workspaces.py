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


def reduction_staging_bytes(numel: int, out_numel: int, sm_count: int) -> int:
    """``sum`` over leading dims (bias and norm-weight gradients): CUDA's two-pass reduction stages partial
    sums in global memory, 8 bytes per input element, up to 4 KiB per SM for each of up to 256 output columns;
    narrower outputs use a vectorised layout that stages a quarter of that. Matched all 28 measured calls (80
    to 256+ columns, 0.3 to 82 M elements) within 7 %, most exactly."""
    if out_numel >= 128:
        return min(8 * numel, min(out_numel, 256) * sm_count * 4096)
    if out_numel >= 64:
        return min(2 * numel, out_numel * sm_count * 2048)
    return min(numel // 2, 3 * MiB)


def softmax_backward_bytes(input_bytes: int, last_dim: bool) -> int:
    """``_softmax_backward_data``: one input-sized buffer over the last dim, two over another dim (nnU-Net's
    channel softmax). Matched 7 calls exactly (nnU-Net, Swin-UNETR)."""
    return input_bytes if last_dim else 2 * input_bytes


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
