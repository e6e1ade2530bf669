"""Memory that CUDA libraries allocate inside a call, which no CPU trace can see: rules fitted on measurements.

* **cuDNN convolutions.** With PyTorch's default NCHW layout, cuDNN 9 (``benchmark=False``) takes one transient
  block per call the size of input + output + weight: it converts them to NHWC for its tensor-core kernels and
  frees the block when the call returns. 1x1 convolutions (2-D, and 3-D in fp32), grouped/depthwise
  convolutions and non-overlapping "patchify" convolutions run without it, but for strided fp32 1x1 ones and any
  1x1 one beyond 2^31 - 1 input elements (session 34). Backward makes two calls (data and filter gradients), each
  with such a block; fp32 3x3 filter gradients over small images at large batches take a larger one. Measured on
  an H200, cuDNN 9.19, torch 2.11:
  ``benchmarks/results/estimate/cudnn_calibration_h200_torch2.11_20261126.json`` (360 convolution shapes, 2-D and
  3-D, fp32/bf16/fp16; the rule is within a few percent on the large ones, which are the ones that decide a peak).
* **cuDNN RNNs** are sized in ``memfit.estimate.cudnn_rnn``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memfit.estimate import pointwise_wgrad


def _nbytes(shape: Sequence[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


STEM_MAX_CHANNELS, STEM_MAX_BATCH = 4, 64
"""A 2-D 3x3 stride-2 convolution from at most 4 channels in half precision took no forward workspace on all 36
such calls of the odd-channel grid (3 -> 16/24/32/64, 128-256 per side, batch 2-32, fp16:
cudnn_calibration_conv_odd_channels_half_h200_torch2.11_20261127.json) and in a fit-side frozen EfficientNet-B0's
stream (bf16, batch 64 at 224², s1327_frozen_cnn_r502, where the charged 105 MB block made its cap 7.8 % high).
Larger batches were not measured and keep the conversion block. Backward converts (input padded to 8 channels)."""
VOLUME_INPUT_MAX_CHANNELS = 3
"""A 3-D convolution from at most this many channels (a U-Net's input layer on CT or MRI volumes, a video model's
stem), whose kernel is not its stride, forward. 3x3x3 stride 1 from 1-2 channels (32 calls of three grids: 1 -> 32
at 96-224³, 2 -> 24 at 24-80³, batch 1-3): no conversion in fp32 and bf16, and in fp16 the output (and the input
from 2 channels) + 2-3 KB; the padded conversion charged before was 7x the input too much there, and a fit-side bf16
3-D U-Net (probe_cases.py, s1327_unet_r504, 1 channel at 64³) had its cap 5 % high from it
(cudnn_calibration_{h200,conv_large_h200,conv_3d_xl_h200}_torch2.11_20261126.json). Stems from 1-3 channels to 64
(3x7x7 and 1x7x7 at stride 1x2x2 as torchvision's video models, 3x3x3 at stride 1 and 2; 8x64² and 16x112², batch 2
and 16; 144 calls: cudnn_calibration_conv_3d_stem_h200_torch2.11_20261129.json): fp16 the same on all 48 (the input
unpadded from 2-3 channels, where the generic rule pads it to 8: R3D-18's 3-channel stem was charged 147 MiB for
116); bf16 none, but 1x7x7 kernels at batch 16 took the generic padded conversion + up to 44 KB (6 of 6; charged at
every batch); fp32 none for 3x3x3 kernels (24 of 24), the unpadded conversion for the others (24 of 24, two of them
1.3-1.5 % more; the generic rule pads to 4). From 4 channels the generic rule held (half) or was above (fp32).
Kernels other than 3x3x3 at stride 1 were not measured: none assumed there, as 3x3x3 ones took."""
LARGE_3D_POINTWISE_FP32 = 80
"""The largest size per axis at which 3-D 1x1 fp32 convolutions were measured to run backward without a workspace."""
HEAD_FP32_MAX_COUT, HEAD_FP32_MIN_CIN = 8, 16
"""A 2-D fp32 1x1 stride-1 convolution to at most 8 channels (a segmentation head, an RPN's objectness layer) from at
least 16 takes about its input + output in each backward call: 1.00-1.30 x on 68 of the 72 such calls of two H200
grids (16-64 -> 1-8 at 2-6 x 128-384², 256 -> 3 at 4 x 200-400²: cudnn_calibration_conv_narrow_h200_torch2.11_
20261126.json, cudnn_calibration_conv_2d_xl_h200_torch2.11_20261127.json), where the rule charged nothing; none on
the other 4 (64 -> 2-8 at 2 x 128², 8 MiB of input), nor from 64 channels to one (4 of 4), which it leaves out. From 8
channels it was erratic (none at batch 6, up to 18 MiB at batch 2): left out. cuDNN can do without it under a cap."""


INT32_LIMIT = 2**31 - 1
"""The most elements a tensor can have for cuDNN's 32-bit-indexed kernels (``split_batch_dim_to_32bit_out`` in
PyTorch's cuDNN convolutions compares each tensor's ``numel()`` with ``std::numeric_limits<int>::max()``)."""
POINTWISE_WGRAD_EXTRA_BYTES = 16 << 20
"""What the filter gradient of a strided fp32 1x1 convolution, or of a 1x1 one beyond INT32_LIMIT, took beyond the
input + output that its data gradient took: up to an eighth of input + output, and at most 16 MiB (79 calls
of conv_grid_{second,strided}_h200_torch2.11_20261129_s34.json; 16 MiB for the one sample of 2^31 elements)."""


def _pointwise_block(input_shape: Sequence[int], output_shape: Sequence[int], itemsize: int, *, backward: bool,
                     with_output: bool = False) -> int:
    """In backward input + output (not the weight: 8 MiB of it at 1024 -> 2048 channels were not taken) and the
    filter gradient's few MiB more (POINTWISE_WGRAD_EXTRA_BYTES); in forward the input, or input + output where
    ``with_output``."""
    io = _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize)
    if backward:
        return io + min(POINTWISE_WGRAD_EXTRA_BYTES, io // 8)
    return io if with_output else _nbytes(input_shape, itemsize)


def _beyond_int32_images(input_shape: Sequence[int]) -> int:
    """How many images of a batch cuDNN runs at once beyond INT32_LIMIT: as many as hold 2^31 input elements."""
    return min(input_shape[0], max(1, (INT32_LIMIT + 1) // math.prod(input_shape[1:])))


def _beyond_int32(input_shape: Sequence[int]) -> bool:
    return math.prod(input_shape) > INT32_LIMIT


def _beyond_int32_pointwise_bytes(input_shape: Sequence[int], output_shape: Sequence[int], *, itemsize: int,
                                  half: bool, backward: bool, channels_last: bool) -> int | None:
    """A 1x1 convolution whose input has more than INT32_LIMIT elements: the layout-conversion block cuDNN takes for
    the images it runs at once, or None where the call took what it takes below the limit.

    Measured on an H200 (conv_grid_{first,second}_h200_torch2.11_20261129_s34.json: 1x1 from 256, 96 and 2048
    channels, strided and not, 1-D, 2-D and 3-D, fp32/bf16/fp16, NCHW and channels-last, just below and just beyond
    the limit): nothing below it; beyond it the block is sized for as many images as hold 2^31 input elements (21 of
    22 images of 96 x 1024², all 8 of 256 x 1024²), all of them for a single image beyond it. NCHW took input +
    output in each backward call; in forward, fp32 took the input on four shapes and input + output on two
    (charged the input, the bound the output: ``pointwise_fp32_forward_unsure_bytes``), half precision nothing but
    for a single image (input + output). Channels-last took nothing in backward and in half precision, and input +
    output in fp32 forward on the two unstrided shapes of several images (charged on all). A tensor whose output
    alone is beyond the limit (64 -> 256 channels) took nothing."""
    if not _beyond_int32(input_shape):
        return None
    images = _beyond_int32_images(input_shape)
    one_image = math.prod(input_shape[1:]) > INT32_LIMIT
    chunk_in, chunk_out = (images, *input_shape[1:]), (images, *output_shape[1:])
    if channels_last:
        return _pointwise_block(chunk_in, chunk_out, itemsize, backward=False, with_output=True) if (
            not backward and not half) else None
    if backward or not half or one_image:
        return _pointwise_block(chunk_in, chunk_out, itemsize, backward=backward, with_output=half)
    return None


def _pointwise_fp32(weight_shape: Sequence[int], *, groups: int, transposed: bool, half: bool) -> bool:
    """An fp32 1x1 convolution, neither grouped nor transposed."""
    return not half and not transposed and groups == 1 and all(k == 1 for k in weight_shape[2:])


def _strided_pointwise_fp32(weight_shape: Sequence[int], stride: Sequence[int], *, groups: int, transposed: bool,
                            half: bool) -> bool:
    """A strided fp32 1x1 convolution (a ResNet's downsampling shortcut) in NCHW: cuDNN took input + output in
    backward, and in forward the input or input + output by shape (by no rule found: 256 -> 512 at 56² took input +
    output at batch 8 and the input at 32 and 64; charged the input, the bound the output), 2-D and 3-D, on every
    shape but one (64 -> 256 at 4 x 512², none) of 10 ResNet-shortcut shapes from 14² to 1024² and two 3-D ones,
    batch 1-128 (conv_grid_strided_h200_torch2.11_20261129_s34.json; 64 -> 128 at 56² took it in the filter gradient
    alone). Before that grid no strided fp32 1x1 convolution had been measured, and the rule charged them nothing.
    A frozen fp32 ResNet-50 at batch 64 (the zoo's frozen_tv_resnet50_head, whose peak is in forward) measured on an
    H100 what the trace gives with its shortcuts' forward charged the input, not input + output (fit data)."""
    return _pointwise_fp32(weight_shape, groups=groups, transposed=transposed, half=half) and any(x > 1 for x in stride)


def pointwise_fp32_forward_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                        output_shape: Sequence[int], *, itemsize: int, stride: Sequence[int],
                                        groups: int, transposed: bool, half: bool) -> int:
    """The output an NCHW fp32 1x1 convolution's forward may take beside the input charged for it, where it is
    strided or beyond INT32_LIMIT (input + output on some shapes, the input on others); 0 elsewhere."""
    if not _pointwise_fp32(weight_shape, groups=groups, transposed=transposed, half=half):
        return 0
    if _beyond_int32(input_shape):
        return _nbytes((_beyond_int32_images(input_shape), *output_shape[1:]), itemsize)
    return _nbytes(output_shape, itemsize) if any(x > 1 for x in stride) else 0


# Channels-last 2-D convolutions (the input, or the input and the weight, in NHWC: ``model.to(memory_format=
# torch.channels_last)``, or a permuted view reaching a plain model, as DPT's reassembled ViT tokens reach its
# neck and head) run cuDNN's NHWC kernels on the data as it is: no layout conversion. Measured on 360 calls (3x3
# from 16-256 to 16-256 channels, stride 1 and 2, 1x1 64 <-> 256 and 256 -> 3, a 7x7 stride-2 stem from 3 channels;
# 56-384², batch 2 and 8; fp32, bf16, fp16; input and weight channels-last, or the input alone; each backward call
# alone): cudnn_calibration_conv_channels_last_h200_torch2.11_20261129.json. What they took is a few MiB whatever the
# size, but for a stem from at most 4 channels, and the filter gradient in fp32 from at most 16, which grow with the
# activations. An NCHW weight reaching a channels-last input is copied by PyTorch (``weight.contiguous(format)``,
# ConvShared.cpp) in forward and for the input's gradient: ``kernel_scratch.conv_workspace`` adds it. HF DPT's depth
# head (fp32, 128 -> 32 at 8 x 384²) had been charged 720 MiB of conversion where the H200 took 12 MB (fourth draw,
# entry_traces_holdout4_h200_torch2.11_20261129_s31.tar.gz); the same call on an NCHW input took the conversion
# (dpt_head_alone_h200_torch2.11_20261129.txt).
CHANNELS_LAST_BACKWARD_BYTES = 3_441_664
"""What a channels-last backward call took, the median of the first grid's 312 outside the proportional cases below
(the larger of each backward's two calls; 3,539,456 over both grids' 624); the forward took nothing on 296 of them
(the median of the 624: 512 bytes). The estimate charges these typical
sizes: where the workspaces fall decides which cached blocks the allocator splits, and charging the grid's largest
everywhere put the replayed reserved peak of HF DPT's traced stream 3.8 % above its H200 stream's (11 MB blocks in
forward where the GPU took 2.4, the weight's copy); with the typical sizes, 0.2 % under."""
CHANNELS_LAST_FORWARD_MAX_BYTES = 9_437_696
"""The most a channels-last forward call took outside the proportional and fp32 odd-width cases, over both grids
(fp16 96 -> 96 at 2 x 192²): what the upper bound allows for beyond the typical size, once
(``channels_last_unsure_bytes``)."""
CHANNELS_LAST_BACKWARD_MAX_BYTES = 19_337_728
"""The most a channels-last backward call took outside them (the filter gradient of bf16 256 -> 3 at 8 x 384²)."""
CHANNELS_LAST_FP32_ODD_RATIO = 1.08
"""fp32 k x k (k > 1) channels-last convolutions whose channel counts are not both powers of two took, by channel
pair and whatever the size, nothing (80, 96, 192, 384 -> 128), the input in forward and the output in the input's
gradient (48 -> 48, 96 -> 48), or input + output in the filter gradient (24, 144, 160: 1.01-1.08 x at 96-320² from
batch 8 or side 192, up to 1.31 x, 29 MiB, below): 432-call grid cudnn_calibration_conv_channels_last_odd_h200_
torch2.11_20261129.json, after a GPU test's fp32 96 -> 48 at 2 x 320² took a 76 MiB forward block the typical size
did not charge, and the fifth draw's channels-last fp32 U-Net (96, 192, 384 channels after its concatenations) had
its cap 3.2 % under. No rule over the widths was found: they are charged the NCHW conversion (input + output), and
the bound allows this part of input + output, plus the backward's largest constant."""
CHANNELS_LAST_STEM_MAX_CIN = 4
"""A stem: from at most this many channels. Its calls grew with the activations: at most 0.17 (fp32) and 0.43 (half)
of input + output in forward, 1.18 (fp32) and 0.64 (half) in backward, beyond the constants above; at 512 and 1024
per axis (cudnn_calibration_conv_channels_last_large_h200_torch2.11_20261129.json, 36 stem calls: 7x7 and 3x3 at
stride 2 from 3 channels to 32-64) at most 0.16, 0.42, 1.11 and 0.75 (a half-precision 3 -> 32 3x3 at 8 x 512²)."""
CHANNELS_LAST_STEM_RATIOS = {(False, False): 0.17, (False, True): 1.2, (True, False): 0.45, (True, True): 0.76}
"""(half, backward) -> the part of input + output a stem is charged (each measured ratio rounded up)."""
CHANNELS_LAST_CALIBRATED_SIZE = 384
"""The largest size per axis of the channels-last grid: beyond it the trace says the workspace is extrapolated."""
CHANNELS_LAST_STEM_CALIBRATED_SIZE, CHANNELS_LAST_STEM_KERNELS = 1024, ((3, 3), (7, 7))
"""... but for stems of these kernels at stride 2, which the grid at 512 and 1024 per axis measured (above): the
sixth draw's channels-last segmentation steps run theirs over 473-513² (smp, torchvision's DeepLabV3, a PSP head)."""
CHANNELS_LAST_FP32_NARROW_MAX_CIN, CHANNELS_LAST_FP32_NARROW_RATIO = 16, 1.1
"""fp32 from at most this many channels (k > 1): the filter gradient took 1.01-1.06 x input + output at 192-384² (up
to 1.37 x on smaller ones, within the constant); charged this part of it."""


def channels_last_calibrated_size(input_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> int:
    """The largest size per axis the channels-last grids measured a 2-D convolution of this kind at."""
    if (input_shape[1] <= CHANNELS_LAST_STEM_MAX_CIN and tuple(kernel) in CHANNELS_LAST_STEM_KERNELS
            and tuple(stride) == (2, 2)):
        return CHANNELS_LAST_STEM_CALIBRATED_SIZE
    return CHANNELS_LAST_CALIBRATED_SIZE


def _channels_last_ratio(input_shape: Sequence[int], kernel: Sequence[int], *, half: bool, backward: bool) -> float:
    """The part of input + output a channels-last call is charged where it grows with them (stems, fp32 from few
    channels); 0 elsewhere."""
    if any(k > 1 for k in kernel):
        if input_shape[1] <= CHANNELS_LAST_STEM_MAX_CIN:
            return CHANNELS_LAST_STEM_RATIOS[(half, backward)]
        if backward and not half and input_shape[1] <= CHANNELS_LAST_FP32_NARROW_MAX_CIN:
            return CHANNELS_LAST_FP32_NARROW_RATIO
    return 0.0


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def channels_last_fp32_odd(input_shape: Sequence[int], output_shape: Sequence[int], kernel: Sequence[int], *,
                           half: bool) -> bool:
    """An fp32 k x k channels-last convolution from more than 16 channels whose channel counts are not both powers
    of two (``CHANNELS_LAST_FP32_ODD_RATIO``): charged the NCHW conversion."""
    return (not half and any(k > 1 for k in kernel) and input_shape[1] > CHANNELS_LAST_FP32_NARROW_MAX_CIN
            and not (_is_power_of_two(input_shape[1]) and _is_power_of_two(output_shape[1])))


def channels_last_strided_pointwise_fp32(input_shape: Sequence[int], output_shape: Sequence[int],
                                         kernel: Sequence[int], *, half: bool, backward: bool) -> bool:
    """The forward of a strided fp32 1x1 channels-last convolution: none on 12 of 14 calls, and input + output at
    64 -> 256 over 512² (1 and 4 images; conv_grid_strided_h200_torch2.11_20261129_s34.json): charged none, the
    bound input + output."""
    return (not half and not backward and all(k == 1 for k in kernel)
            and tuple(output_shape[2:]) != tuple(input_shape[2:]))


def _channels_last_bytes(input_shape: Sequence[int], output_shape: Sequence[int], kernel: Sequence[int], *,
                         itemsize: int, half: bool, backward: bool, largest: bool = False) -> int:
    """A 2-D channels-last convolution's call (``CHANNELS_LAST_*``), a backward's two calls charged alike (the
    recorder takes one block per backward): the typical size, or with ``largest`` the grid's largest, which no call
    of the grid exceeded (``tests/test_cuda_emulation.py``)."""
    io = _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize)
    if channels_last_fp32_odd(input_shape, output_shape, kernel, half=half):
        converted = _padded_nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize)
        if not largest:
            return converted
        return max(converted, math.ceil(CHANNELS_LAST_FP32_ODD_RATIO * io) + CHANNELS_LAST_BACKWARD_MAX_BYTES)
    if largest:
        constant = CHANNELS_LAST_BACKWARD_MAX_BYTES if backward else CHANNELS_LAST_FORWARD_MAX_BYTES
        if channels_last_strided_pointwise_fp32(input_shape, output_shape, kernel, half=half, backward=backward):
            constant = max(constant, io)
    else:
        constant = CHANNELS_LAST_BACKWARD_BYTES if backward else 0
    return max(constant, math.ceil(_channels_last_ratio(input_shape, kernel, half=half, backward=backward) * io))


def channels_last_unsure_bytes(input_shape: Sequence[int], output_shape: Sequence[int], kernel: Sequence[int], *,
                               itemsize: int, half: bool, backward: bool) -> int:
    """How much more than ``conv_workspace_bytes`` charges a 2-D channels-last call took at most on the grid."""
    largest, typical = (_channels_last_bytes(input_shape, output_shape, kernel, itemsize=itemsize, half=half,
                                             backward=backward, largest=big) for big in (True, False))
    return largest - typical


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
    backward: bool = False,
    fp16: bool = False,
    channels_last: bool = False,
) -> int:
    """Transient bytes one cuDNN convolution call takes (forward, or one of the two backward calls); ``half`` for
    fp16 and bf16, ``fp16`` for fp16 alone (the few rules that tell them apart); ``channels_last`` where cuDNN runs
    it in NHWC (``cudnn_conv_suggest_memory_format``: the input or the weight channels-last)."""
    kernel = tuple(weight_shape[2:])
    dims = len(kernel)
    if groups > 1:
        return 0  # depthwise/grouped kernels: no layout conversion measured
    if all(k == 1 for k in kernel) and not transposed:
        beyond = _beyond_int32_pointwise_bytes(input_shape, output_shape, itemsize=itemsize, half=half,
                                               backward=backward, channels_last=channels_last)
        if beyond is not None:
            return beyond
    if channels_last and dims == 2 and not transposed:
        return _channels_last_bytes(input_shape, output_shape, kernel, itemsize=itemsize, half=half,
                                    backward=backward)
    if (not backward and dims == 3 and not transposed and input_shape[1] <= VOLUME_INPUT_MAX_CHANNELS
            and any(k > 1 for k in kernel) and tuple(stride) != kernel):
        # a 3-D input layer or stem from 1-3 channels (CT, MRI, video; VOLUME_INPUT_MAX_CHANNELS): fp16 converts the
        # output, and the input unless it has one channel (then NCDHW is already NDHWC), without padding it
        if fp16:
            converted_input = _nbytes(input_shape, itemsize) if input_shape[1] > 1 else 0
            return converted_input + _nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)
        # bf16 and fp32 as measured; from stride 1 everywhere as 3 x 3 x 3 kernels were (none), whatever the kernel
        strided = any(x > 1 for x in stride)
        if half:  # bf16: none, but in-plane kernels (1 x k x k, strided) took the padded conversion at batch 16
            return _padded_conversion(input_shape, weight_shape, output_shape, itemsize) if (
                kernel[0] == 1 and strided) else 0
        if len(set(kernel)) == 1 or not strided:  # fp32: none for a cubic kernel
            return 0
        return _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)
    if _is_pointwise_half(weight_shape, groups=groups, transposed=transposed, half=half):
        return _pointwise_half_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize, stride=stride,
                                     backward=backward, fp16=fp16)
    if _is_volume_head_half(weight_shape, groups=groups, transposed=transposed, half=half, stride=stride):
        return _volume_head_half_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize,
                                       backward=backward, fp16=fp16)
    if (backward and dims == 2 and not half and all(k == 1 for k in kernel) and all(x == 1 for x in stride)
            and not transposed and HEAD_FP32_MIN_CIN <= input_shape[1] and output_shape[1] <= HEAD_FP32_MAX_COUT
            and not (output_shape[1] == 1 and input_shape[1] >= 64)):
        # a head's filter/data gradient in fp32 (HEAD_FP32_*): a conversion block of input + output
        return _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)
    if _strided_pointwise_fp32(weight_shape, stride, groups=groups, transposed=transposed, half=half):
        return _pointwise_block(input_shape, output_shape, itemsize, backward=backward)
    if all(k == 1 for k in kernel) and (dims == 2 or not half):
        if backward and dims == 3 and not half and max(input_shape[2:]) > LARGE_3D_POINTWISE_FP32:
            # ... but not the backward of a large 3-D one in fp32: 1.03 x input + output at 160-224 per axis
            # (6 of 6 shapes, cudnn_calibration_conv_3d_xl_h200_torch2.11_20261126.json; 0 up to 80 per axis in
            # cudnn_calibration_h200_*; 96-128 unmeasured, so charged from 81 on)
            return math.ceil(1.03 * (_nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize)
                                     + _nbytes(weight_shape, itemsize)))
        return 0  # 1x1 convolutions are GEMMs on the NCHW data
    if not transposed and tuple(stride) == kernel and any(k > 1 for k in kernel):
        return 0 if backward else _patchify_forward_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize)
    if (not backward and half and dims == 2 and kernel == (3, 3) and tuple(stride) == (2, 2)
            and input_shape[1] <= STEM_MAX_CHANNELS and input_shape[0] <= STEM_MAX_BATCH):
        return 0  # a 3x3 stride-2 stem from RGB (EfficientNet, MobileNet, RegNet): no conversion in forward
    conversion = _padded_conversion(input_shape, weight_shape, output_shape, itemsize)
    if backward and _small_image_wgrad(input_shape, weight_shape, stride, half=half, channels_last=channels_last):
        return max(conversion, small_image_wgrad_bytes(input_shape, itemsize))
    return conversion


# fp32 3x3 stride-1 convolutions over small images at large batches (a CIFAR ResNet), NCHW: the filter gradient
# took either the conversion block (2 x input) or (17 + 16 / side) x input (17.5 x at 32², 18 x at 16², 19 x at 8²),
# on the 60 fp32 NCHW calls of a 140-call H200 grid (16-128 -> as many channels, 8-32², batch 64-1024:
# conv_grid_small_wgrad_h200_torch2.11_20261129_s34.json), after the seventh draw's CIFAR ResNet-56 (fp32, batch 512)
# peaked 5.8 % above its estimate at a 152 MiB filter-gradient workspace. Which one, by the input's elements: from
# 2^20 at 16 channels and from 2^19 at 32 (every call above, none below), between 2^20 and 2^21 at 64 (4 of 4 in,
# 5 of 5 around out), never at 128 (15 of 15). bf16 took the conversion only; 48² and larger images (16-64
# channels, cudnn_calibration_h200/conv_large/conv_2d_xl/conv_fp32_channels grids) never took the large block.
SMALL_IMAGE_WGRAD_MAX_SIDE = 32
SMALL_IMAGE_WGRAD_ELEMENTS = {16: (1 << 20, None), 32: (1 << 19, None), 64: (1 << 20, 1 << 21)}
"""Channels (in = out) -> (fewest, most) input elements at which the large filter-gradient block was taken."""
SMALL_IMAGE_WGRAD_UNSURE_MIN_ELEMENTS = 1 << 19
"""Other channel pairs from 16 to 64 (not measured): the bound allows the large block from this many elements."""


def _small_image_wgrad_candidate(input_shape: Sequence[int], weight_shape: Sequence[int], stride: Sequence[int], *,
                                 half: bool, channels_last: bool) -> bool:
    """An fp32 NCHW 3x3 stride-1 2-D convolution over images of at most SMALL_IMAGE_WGRAD_MAX_SIDE per axis, between
    16 and 64 channels in and out."""
    return (not half and not channels_last and len(input_shape) == 4 and tuple(weight_shape[2:]) == (3, 3)
            and tuple(stride) == (1, 1) and max(input_shape[2:]) <= SMALL_IMAGE_WGRAD_MAX_SIDE
            and 16 <= weight_shape[1] <= 64 and 16 <= weight_shape[0] <= 64)


def _small_image_wgrad(input_shape: Sequence[int], weight_shape: Sequence[int], stride: Sequence[int], *,
                       half: bool, channels_last: bool) -> bool:
    """Where the grid's calls took the large filter-gradient block (channels in = out, 16, 32 or 64)."""
    if not _small_image_wgrad_candidate(input_shape, weight_shape, stride, half=half, channels_last=channels_last):
        return False
    window = SMALL_IMAGE_WGRAD_ELEMENTS.get(weight_shape[1]) if weight_shape[0] == weight_shape[1] else None
    if window is None:
        return False
    fewest, most = window
    return math.prod(input_shape) >= fewest and (most is None or math.prod(input_shape) <= most)


def small_image_wgrad_bytes(input_shape: Sequence[int], itemsize: int, *, largest: bool = False) -> int:
    """The large filter-gradient block: (17 + 16 / side) x the input where the side is a power of two (the grid's
    17.5, 18 and 19 x at 32, 16 and 8), (8 + 12 / side) x elsewhere (8.55 x at 24² and 9.0 x at 12², found by the
    GPU test after the rule was written from the grid: tests/test_cuda_emulation.py; gpu_tests_conv_small_h200_
    torch2.11_20261129_s34.log; its second run, on new shapes, took 8.6 x at 20² and 6.6 x at 28², 29 % below the
    charge: gpu_tests_conv_small_r2_h200_torch2.11_20261129_s34.log); ``largest``: the power-of-two size whatever
    the side, which the bound allows."""
    side = min(input_shape[2:])
    power_of_two = side & (side - 1) == 0 and max(input_shape[2:]) == side
    factor = 17 + 16 / side if power_of_two or largest else 8 + 12 / side
    return math.ceil(factor * _nbytes(input_shape, itemsize))


def small_image_wgrad_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                   output_shape: Sequence[int], *, itemsize: int, stride: Sequence[int],
                                   half: bool) -> int:
    """What the bound allows beyond the charge where the grid did not say: channel pairs from 16 to 64 other than
    16, 32 or 64 in and out, from SMALL_IMAGE_WGRAD_UNSURE_MIN_ELEMENTS input elements; and sides that are not
    powers of two, measured on four shapes by the GPU test, up to the power-of-two size."""
    if not _small_image_wgrad_candidate(input_shape, weight_shape, stride, half=half, channels_last=False):
        return 0
    largest = small_image_wgrad_bytes(input_shape, itemsize, largest=True)
    if _small_image_wgrad(input_shape, weight_shape, stride, half=half, channels_last=False):
        return largest - small_image_wgrad_bytes(input_shape, itemsize)
    if ((weight_shape[0] == weight_shape[1] and weight_shape[1] in SMALL_IMAGE_WGRAD_ELEMENTS)
            or math.prod(input_shape) < SMALL_IMAGE_WGRAD_UNSURE_MIN_ELEMENTS):
        return 0
    return max(0, largest - _padded_conversion(input_shape, weight_shape, output_shape, itemsize))


def _padded_conversion(input_shape: Sequence[int], weight_shape: Sequence[int], output_shape: Sequence[int],
                       itemsize: int) -> int:
    """The generic layout-conversion block: input and output with their channels padded, and the weight."""
    return _padded_nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)


# Non-overlapping "patchify" convolutions (kernel == stride > 1: a ViT's patch embedding) from 3 channels, forward,
# measured on 288 calls (768 and 384 filters of 16², 1024 of 14², 768 of 32²; 224-384 per axis, batch 1-128; fp32,
# bf16, fp16, with and without gradients, which change nothing): cudnn_calibration_conv_patchify_h200_torch2.11_
# 20261127.json. The first grid (batch 6-24, 48-192 per axis, 384 filters) had measured none, and a fit-side frozen
# ViT-B/16 (probe_cases.py, s1327_frozen_cnn_r501, bf16, 32 x 224²) took 38.5 MB there.
PATCHIFY_HALF_MIN_FILTERS = 512
"""Half precision: 384 filters took no workspace at any size measured; 768 and 1024 took the layout conversion."""
PATCHIFY_HALF_MAX_PADDED_INPUT = 256 << 20
"""... unless the padded input passed this (batch 128 at 378-384², 292-302 MB: a few KiB; 146-151 MB: converted)."""
PATCHIFY_FP32_MIN_FILTERS = 384
"""fp32 below this many filters: none assumed (the grid's smallest, 384, converted from batch 64; a ConvNeXt-T's
96-filter 4 x 4 stem at batch 64, fit entry c106, measured a cap 4 % under what charging it predicts)."""
PATCHIFY_FP32_MIN_BATCH = 64
"""fp32: the conversion (channels padded to 4) from this batch on, on all four filter shapes; none below it with
16 x 16 and 32 x 32 kernels; the 14 x 14 kernel converted without padding from batch 8 (none at 1)."""


def _patchify_forward_bytes(input_shape: Sequence[int], weight_shape: Sequence[int], output_shape: Sequence[int],
                            *, itemsize: int) -> int:
    """The forward workspace of a patchify convolution (``PATCHIFY_*``): exact to 512 bytes on 264 of the grid's
    288 calls, under by at most 1 MiB on the other 24 (batch 16 in half precision, 0.2-0.6 MB; fp32 at 384², 1 MiB)."""
    n, filters = input_shape[0], weight_shape[0]
    converted = (_padded_nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize)
                 + _padded_nbytes(weight_shape, itemsize))
    if itemsize == 2:
        if filters < PATCHIFY_HALF_MIN_FILTERS or _padded_nbytes(input_shape, itemsize) > PATCHIFY_HALF_MAX_PADDED_INPUT:
            return 0
        return converted
    if filters < PATCHIFY_FP32_MIN_FILTERS:
        return 0
    if n >= PATCHIFY_FP32_MIN_BATCH:
        return converted
    if weight_shape[2] % 16 != 0 and n > 1:
        return _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize) + _nbytes(weight_shape, itemsize)
    return 0


# 3-D segmentation heads in half precision: a 1x1x1 convolution to a few classes, measured on 526 calls (8-64
# channels to 2-16 classes at 48-128³, batch 1-4, bf16 and fp16, each backward call alone;
# cudnn_calibration_conv_{head_half,3d_half,3d_head_half}_h200_torch2.11_20261127.json). The data gradient took
# nothing on all of them, and the forward nothing but in fp16 from 32 or more channels to 2-3 classes (the input and
# output converted). The filter gradient took, below 32 channels, the input and the output converted twice over
# (2 x input + output) with an even class count, and the input and the output padded to 8 channels with an odd one
# (3 or 5 classes; at 64³ some took twice over, within 4 MiB of it); from 32 channels the input and the padded output,
# or next to nothing at batch 1 from 96³ up. The rule is within 4 MiB on 454 of the 526 calls and over-asks on the
# other 72 (those at batch 1); the bound covers all (``_volume_head_half_unsure_bytes``). The rule before charged the padded
# input and output in forward and in each backward call: 41 MB short at the filter gradient of a fit-side bf16
# U-Net's 16 -> 2 head at 2 x 96³ (probe_cases.py, s1327_unet_r505, 4 % under in peak allocated).
VOLUME_HEAD_MAX_CLASSES = 16
"""Output channels up to which a 3-D half-precision 1x1 convolution is sized as a head (2-16 measured)."""
VOLUME_HEAD_NARROW_CIN = 32
"""Below this many input channels (8, 16 and 24 measured) the filter gradient converts twice with even classes."""
VOLUME_HEAD_MEASURED_CIN = 64
"""Up to this many input channels the bound adds only ``VOLUME_HEAD_SLACK_BYTES`` (and, below
``VOLUME_HEAD_NARROW_CIN``, the double conversion the rule did not charge); beyond, the 2-D heads' allowance."""
VOLUME_HEAD_FP16_FORWARD = (32, 3)
"""From these input channels, up to these classes, fp16's forward converted the input and the output."""
VOLUME_HEAD_ODD_TWICE_MAX_VOXELS = 64**3
"""Up to this many voxels per image a head from fewer than 32 channels to an odd class count sometimes converted
twice (8 -> 3 and 8 -> 5 at 64³: 6 of the 30 such calls up to 64³); from 96³ up none did (0 of 60)."""
VOLUME_HEAD_SLACK_BYTES = 12 << 20
"""The bound's allowance for a measured head: the grid's 4 MiB beyond the rule and ``POINTWISE_ERRATIC_SLACK_BYTES``."""


def _is_volume_head_half(weight_shape: Sequence[int], *, groups: int, transposed: bool, half: bool,
                         stride: Sequence[int]) -> bool:
    """A 3-D half-precision 1x1x1 stride-1 convolution to at most ``VOLUME_HEAD_MAX_CLASSES`` channels."""
    return (half and groups == 1 and not transposed and tuple(weight_shape[2:]) == (1, 1, 1)
            and all(s == 1 for s in stride) and weight_shape[0] <= VOLUME_HEAD_MAX_CLASSES)


def _volume_head_half_bytes(input_shape: Sequence[int], weight_shape: Sequence[int], output_shape: Sequence[int], *,
                            itemsize: int, backward: bool, fp16: bool) -> int:
    """A 3-D half-precision head's workspace (``VOLUME_HEAD_*``): the filter gradient's, charged to both backward
    calls (they run one after the other, so the peak sees the larger), or the forward's."""
    cin, classes = input_shape[1], weight_shape[0]
    io = _nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize)
    if not backward:
        converts = fp16 and cin >= VOLUME_HEAD_FP16_FORWARD[0] and classes <= VOLUME_HEAD_FP16_FORWARD[1]
        return io if converts else 0
    if cin < VOLUME_HEAD_NARROW_CIN and classes % 2 == 0:
        return 2 * io
    return _nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize)


def _volume_head_half_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                   output_shape: Sequence[int], *, itemsize: int) -> int:
    """What the bound adds to a 3-D half-precision head's filter gradient (``VOLUME_HEAD_MEASURED_CIN``)."""
    cin = input_shape[1]
    if cin > VOLUME_HEAD_MEASURED_CIN:  # channel counts no grid measured: the 2-D heads' erratic allowance
        return _erratic_allowance(input_shape, output_shape, itemsize, POINTWISE_HEAD_ERRATIC_FACTOR)
    if cin >= VOLUME_HEAD_NARROW_CIN:
        return VOLUME_HEAD_SLACK_BYTES
    if math.prod(input_shape[2:]) > VOLUME_HEAD_ODD_TWICE_MAX_VOXELS:
        return VOLUME_HEAD_SLACK_BYTES
    twice = 2 * (_nbytes(input_shape, itemsize) + _nbytes(output_shape, itemsize))
    charged = _volume_head_half_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize, backward=True,
                                      fp16=False)
    return VOLUME_HEAD_SLACK_BYTES + max(0, twice - charged)


def _is_pointwise_half(weight_shape: Sequence[int], *, groups: int, transposed: bool, half: bool) -> bool:
    """A 2-D 1x1 half-precision convolution without groups: the calls ``_pointwise_half_bytes`` sizes."""
    return half and groups == 1 and not transposed and tuple(weight_shape[2:]) == (1, 1)


def conv_workspace_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                output_shape: Sequence[int], *, itemsize: int, stride: Sequence[int], groups: int,
                                transposed: bool, half: bool, backward: bool = False, fp16: bool = False) -> int:
    """Bytes one cuDNN convolution call may take beyond ``conv_workspace_bytes``, where cuDNN's choice was
    erratic on a calibration grid (``pointwise_half_unsure_bytes``, ``pointwise_fp32_forward_unsure_bytes``); 0
    elsewhere. Same arguments."""
    if not backward:
        return pointwise_fp32_forward_unsure_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize,
                                                   stride=stride, groups=groups, transposed=transposed, half=half)
    if groups > 1 and fp16 and not transposed:
        return GROUPED_FP16_UNSURE_FACTOR * math.prod(input_shape) * itemsize
    if groups == 1 and not transposed:
        small = small_image_wgrad_unsure_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize,
                                               stride=stride, half=half)
        if small:
            return small
    if _is_volume_head_half(weight_shape, groups=groups, transposed=transposed, half=half, stride=stride):
        return _volume_head_half_unsure_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize)
    if not _is_pointwise_half(weight_shape, groups=groups, transposed=transposed, half=half):
        return 0
    return pointwise_half_unsure_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize, stride=stride,
                                       fp16=fp16)


GROUPED_FP16_UNSURE_FACTOR = 4
"""A grouped (depthwise) convolution's backward in fp16 takes no workspace at most sizes and one of up to 4 x its
input's bytes at others, by no rule we found (so ``conv_workspace_bytes`` charges none, and the bound this): on the
H200 grid (cudnn_calibration_h200_torch2.11_20261126.json, 36 depthwise calls) 144 channels 3 x 3 took 2.0-2.1 x
the input at 48 x 48 and at 192 x 192 with batch 6, none at 96 x 96 or at 192 x 192 with batch 24, bf16 and fp32 none
at all; in a network, timm ConvNeXt-T's 7 x 7 depthwise backward at 14 x 14, 384 channels, batch 64 took two blocks
of 4.0 x the input one after the other (an H200 stream of the zoo's frozen_timm_convnext_half,
zoo_traces_caps_h200_torch2.11_20261127.tar.gz; zoo data)."""


# 2-D 1x1 convolutions in half precision, measured on 776 shapes (14 layer shapes of real networks: bottleneck,
# expansion, projection, heads, ResNet's strided shortcuts; 4-512 per axis, batch 2-48, bf16 and fp16; each call
# alone): cudnn_calibration_conv_pointwise_half_h200_torch2.11_20261126.json.
POINTWISE_NARROW_CIN = 24
"""Input channels up to which a stride-1 1x1 filter gradient at batch <= 8 takes the layout-conversion block."""
POINTWISE_MIN_PIXELS = 28 * 28
"""From this many pixels per image the per-image partial sums were taken whatever their size (all 14 shapes)."""
POINTWISE_NARROW_FACTOR = 1.1
"""The narrow filter gradient's block as a multiple of input + output (16 -> 14 channels: 1.1 from 112 x 112 up,
1.3 at 28-56; 24 -> 144: 1.0-1.2)."""
POINTWISE_PARTIAL_SUMS_SMALL = 32 << 20
"""Below this many bytes of partial sums, images smaller than 28 x 28 took them too (mobilenet_v3's 160 -> 960 at
4 x 4); larger ones (ResNet-50's 2048 <-> 512 at 7 x 7) took a conversion block no larger than input + output."""
POINTWISE_WIDE_PRODUCT = 190_000
"""Cin x Cout from which images smaller than 28 x 28 took the conversion block (at most input + output) whatever
the partial sums' size, with channel counts that are not multiples of 32: 440 -> 440 and 696 -> 696 at 4-8 pixels
a side, batch 2-32, did (exactly input + output), at 16 up to 1.44 x input + output or the partial sums (3 MiB
more than charged at most); 232 -> 232 (54k) and mobilenet_v3's 160 -> 960 (154k) took the partial sums, and so did
512 -> 2048 at batch 2 (cudnn_calibration_conv_odd_channels_half_h200_torch2.11_
20261127.json; a RegNet's 440 -> 440 at 8 x 8 had been charged 12.4 MB for 1.7, fit-side probe s1327_tv_cls_regnet02)."""
POINTWISE_ERRATIC_FACTOR, POINTWISE_ERRATIC_SLACK_BYTES = 1.2, 8 << 20
"""The bound's allowance for an erratic filter gradient (``pointwise_half_unsure_bytes``)."""
POINTWISE_ERRATIC_BATCH = 16
"""Batch up to which a filter gradient from 28 x 28 up with channel counts that are not multiples of 32 (and more
than ``POINTWISE_NARROW_CIN`` on both sides) may take
the conversion block (input + output) instead of the partial sums: cuDNN's choice there was erratic at batch 2 and
16 and always the partial sums at 32 (same grid). The estimate keeps the partial sums; the bound adds the
difference (``pointwise_half_unsure_bytes``)."""


POINTWISE_HEAD_MAX_CIN, POINTWISE_HEAD_BATCH, POINTWISE_HEAD_ERRATIC_FACTOR = 64, 8, 2.1
"""A segmentation head (a 1x1 convolution to at most ``POINTWISE_NARROW_CIN`` classes) from up to 64 channels at
batch <= 8, from 28 x 28 up: its filter gradient took a few KiB or a block of 1.0-2.0 x input + output, erratically
in batch, size and class count (32 -> 2...16 at 512², batch 4: 2.0 x; batch 8: a few KiB; 216 such 2-D calls,
cudnn_calibration_conv_head_half_h200_torch2.11_20261127.json; a fit-side bf16 U-Net's 32 -> 5 head took 91.5 MB,
s1327_unet_r500). The estimate keeps its rule; the bound adds 2.1 x input + output + 8 MiB."""


def _pointwise_half_bytes(input_shape: Sequence[int], weight_shape: Sequence[int], output_shape: Sequence[int], *,
                          itemsize: int, stride: Sequence[int], backward: bool, fp16: bool = False) -> int:
    """What a 2-D 1x1 half-precision convolution call takes.

    * Strided (ResNet's shortcuts): the layout conversion of every other convolution, in forward and in both
      backward calls (input + output + weight: 1.0-1.1 x in+out on all 112 strided shapes).
    * Stride 1, forward: none (a GEMM on the NCHW data; none on 615 of 664 calls).
    * Stride 1, backward: the filter gradient sums per image in fp32 first, batch x Cin x Cout x 4 bytes
      (mobilenet_v3's 160 -> 960 at 4 x 4, batch 48: 29.5 MB in corpus fit entry c001's H100 stream), except below
      28 x 28 when those sums are large (then at most input + output), and for narrow inputs (<= 24 channels) at
      batch <= 8 from 28 x 28 up, which take a conversion block of about 1.1 x input + output instead (a U-Net's
      16 -> 14 head at 512 x 512, batch 2: 34 MB, fit entry c032). On the grid's 664 stride-1 filter gradients
      this is under by more than 1 MiB on 12 (at most 17 MiB), over by up to 141 MiB. Channel counts that are
      not multiples of 32 (RegNet's 232/440/696, EfficientNet's 40/240, 112/672; a second grid of 252 such filter
      gradients, cudnn_calibration_conv_odd_channels_half_h200_torch2.11_20261127.json): nothing at 1 x 1 images
      (a squeeze-excitation layer), the conversion block for wide layers below 28 x 28
      (``POINTWISE_WIDE_PRODUCT``), and from 28 x 28 up an erratic choice between the partial sums and an input +
      output block (up to 666 MiB more at 696 -> 696 on 128 x 128, batch 16) that the estimate charges as partial
      sums and the bound covers (``pointwise_half_unsure_bytes``). The data gradient's conversion block appears
      erratically (mostly at 4-14 per axis, where it is small; on a few 112 x 112 shapes with 512-2048 input
      channels, up to 0.98 GB): not charged, the bound's margin covers it.
    * Stride 1, backward, below 28 x 28, at a measured width and image side (``pointwise_wgrad.CHOICES``): what
      cuDNN took there, at the nearest measured batch (``measured_pointwise_choice``).
    """
    io = _padded_nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize)
    if any(s > 1 for s in stride):
        return io + _nbytes(weight_shape, itemsize)
    if not backward:
        return 0
    n, cin = input_shape[0], input_shape[1]
    partial_sums = n * cin * weight_shape[0] * 4
    pixels = math.prod(input_shape[2:])
    if pixels == 1:
        return 0  # a squeeze-excitation layer's 1 x 1 images: none on all 36 such calls (odd-channel grid)
    small = pixels < POINTWISE_MIN_PIXELS
    measured = measured_pointwise_choice(input_shape, weight_shape, fp16=fp16) if small else None
    if measured is not None:
        return {"P": partial_sums, "0": 0, "X": io + min(io, POINTWISE_X_EXTRA_BYTES)}.get(measured[0], io)
    if cin <= POINTWISE_NARROW_CIN and n <= 8 and pixels >= POINTWISE_MIN_PIXELS:
        return max(partial_sums, math.ceil(POINTWISE_NARROW_FACTOR * io))
    if pixels >= POINTWISE_MIN_PIXELS:
        return partial_sums
    odd = cin % 32 != 0 or weight_shape[0] % 32 != 0
    if partial_sums < POINTWISE_PARTIAL_SUMS_SMALL and not (odd and cin * weight_shape[0] >= POINTWISE_WIDE_PRODUCT):
        return partial_sums
    return min(partial_sums, io)


def pointwise_half_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                output_shape: Sequence[int], *, itemsize: int, stride: Sequence[int],
                                fp16: bool = False) -> int:
    """How much more than charged the filter gradient of a 2-D 1x1 half-precision convolution may take where
    cuDNN's choice was erratic on the H200 grid (``POINTWISE_ERRATIC_BATCH``), 0 elsewhere: the conversion block,
    about input + output but up to 3 x that plus 6.6 MiB at small sizes (112 -> 672 at 32 x 32, batch 2: 9.7 MB
    for 3.1), so 1.2 x input + output + 8 MiB, which covers all 60 such calls of the grid; and a segmentation head's
    (``POINTWISE_HEAD_*``)."""
    n, cin, cout = input_shape[0], input_shape[1], weight_shape[0]
    pixels = math.prod(input_shape[2:])
    if all(s == 1 for s in stride) and 1 < pixels < POINTWISE_MIN_PIXELS:
        return _small_pointwise_unsure_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize, fp16=fp16)
    if (cout <= POINTWISE_NARROW_CIN and cin <= POINTWISE_HEAD_MAX_CIN and n <= POINTWISE_HEAD_BATCH
            and all(s == 1 for s in stride) and math.prod(input_shape[2:]) >= POINTWISE_MIN_PIXELS):
        return _erratic_allowance(input_shape, output_shape, itemsize, POINTWISE_HEAD_ERRATIC_FACTOR)
    if (any(s > 1 for s in stride) or n > POINTWISE_ERRATIC_BATCH or (cin % 32 == 0 and cout % 32 == 0)
            or min(cin, cout) <= POINTWISE_NARROW_CIN or math.prod(input_shape[2:]) < POINTWISE_MIN_PIXELS):
        return 0  # other narrow layers (24 -> 144) kept to the rule on the first grid
    return _erratic_allowance(input_shape, output_shape, itemsize, POINTWISE_ERRATIC_FACTOR)


# Below 28 x 28 the filter gradient of a stride-1 1x1 half-precision convolution takes either the fp32 partial sums
# or a conversion block, and which one follows no rule we could find: on an H100 grid of 28 widths of real networks'
# last stages at 4-17 pixels a side, batch 8-96 (cudnn_calibration_conv_pointwise_small_half_h100_torch2.11_
# 20261127.json), ResNet-50's 2048 <-> 512 took the block at every size and batch, InceptionV3's 2048 -> 384 and
# EfficientNet-B0's 320 -> 1280 head the partial sums (96 and 150 MiB in their zoo streams, where the rule had
# charged the 10-15 MB block: 2.7-3.7 % under in peak allocated), and 1280 -> 384 at 7 x 7 took them at batch 8,
# 16 and 64 but not 32 or 96. The H200's grids agree call for call where they overlap (44 shapes). So the measured
# choices are looked up (``pointwise_wgrad.CHOICES``), and the bound adds the other choice wherever the call was
# not measured at its batch and both were seen at its width and side, or not measured at all.


POINTWISE_X_EXTRA_BYTES = 8 << 20
"""A conversion block larger than input + output (``X``) took up to this much more, or input + output again where
that is less (1024 -> 1024 at 8-14 pixels a side, batch 8-96: input + output + 8.0 MiB on all ten calls; 1536 -> 1536
at 8: + 3.0 / 6.0 / 8.0 / 8.0 / 7.5 MiB; H100 grid)."""


def measured_pointwise_choice(input_shape: Sequence[int], weight_shape: Sequence[int], *,
                              fp16: bool) -> tuple[str, frozenset[str], bool] | None:
    """What cuDNN's filter gradient took for this stride-1 1x1 half-precision convolution on the grids (``P``
    partial sums, ``I`` conversion block, ``X`` a larger conversion block, ``0`` none) at the measured batch nearest
    to this one; every choice measured at its width and side (only the one taken where this batch was measured);
    and whether this batch was. None where its width and side were not measured, or not at batches on both sides of
    this one."""
    if len(input_shape) != 4 or input_shape[2] != input_shape[3]:
        return None
    row = pointwise_wgrad.CHOICES.get((input_shape[1], weight_shape[0], input_shape[2]))
    column = 0 if fp16 else 1
    taken = {batch: classes[column] for batch, classes in (row or {}).items() if classes[column] != "-"}
    if not taken:
        return None
    n = input_shape[0]
    if n in taken:
        return taken[n], frozenset(taken[n]), True
    if not min(taken) < n < max(taken):
        return None  # beyond the batches measured: the choice flips with the batch (EfficientNet-B0's 320 -> 1280
        # head took the partial sums from batch 8 to 96 on the grid, the conversion block at 128 in timm's zoo entry)
    nearest = min(taken, key=lambda batch: (abs(math.log(batch / n)), -batch))
    return taken[nearest], frozenset(taken.values()), False


POINTWISE_NEIGHBOUR_RATIO = 2.0
"""A call not measured at its batch is bounded by the choices measured for widths and image sides each within this
factor of its own, its own width and side included (1536 -> 2304 by 1536 -> 1536; 1280 -> 448 by 1280 -> 384, which
took the partial sums at 8 x 8; 768 -> 768 at 10 x 10 by 640 -> 640 and 1024 -> 1024 at 8 and 14); with none that
near, by every choice. With each call's batch left out of the grids this bound was within 1 MiB of or above what the
call took on all 1746 calls; with its width left out at its side, on all 1746; at every side, on all but 6 (384 -> 384
at 4-8 pixels a side, by at most 44 MiB; with 1.5 instead of 2: 0, 6 and 10 missed):
cudnn_pointwise_wgrad_leave_out_torch2.11_20261127.json, from benchmarks/estimate/pointwise_table.py --check."""


def _neighbours_choices(input_shape: Sequence[int], weight_shape: Sequence[int], *, fp16: bool) -> frozenset[str]:
    """Every choice measured at this image side for widths within ``POINTWISE_NEIGHBOUR_RATIO`` of this one (its own
    included, at every batch), or ``P`` and ``X`` (the two largest) where none is."""
    cin, cout, column = input_shape[1], weight_shape[0], 0 if fp16 else 1
    seen: set[str] = set()
    if len(input_shape) == 4 and input_shape[2] == input_shape[3]:
        for (c_in, c_out, side), row in pointwise_wgrad.CHOICES.items():
            if (max(side / input_shape[2], input_shape[2] / side) <= POINTWISE_NEIGHBOUR_RATIO
                    and max(c_in / cin, cin / c_in) <= POINTWISE_NEIGHBOUR_RATIO
                    and max(c_out / cout, cout / c_out) <= POINTWISE_NEIGHBOUR_RATIO):
                seen.update(classes[column] for classes in row.values() if classes[column] != "-")
    return frozenset(seen) if seen else frozenset("PX")


def _small_pointwise_unsure_bytes(input_shape: Sequence[int], weight_shape: Sequence[int],
                                  output_shape: Sequence[int], *, itemsize: int, fp16: bool) -> int:
    """Below 28 x 28: the largest block a choice seen at this width and side (every choice where none was measured)
    would take, beyond what the estimate charged."""
    io = _padded_nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize)
    partial_sums = input_shape[0] * input_shape[1] * weight_shape[0] * 4
    measured = measured_pointwise_choice(input_shape, weight_shape, fp16=fp16)
    exact = measured is not None and measured[2]  # this batch was measured: its choice alone
    seen = measured[1] if measured is not None and exact else _neighbours_choices(input_shape, weight_shape,
                                                                                  fp16=fp16)
    # the classes' own tolerances (pointwise_table.py: P within 2 %, I within 5 %); a conversion block measured at
    # another batch may come out larger here (X: 1.07-1.3 x input + output)
    block = math.ceil(1.05 * io) if exact and "I" in seen else (
        _erratic_allowance(input_shape, output_shape, itemsize, POINTWISE_ERRATIC_FACTOR) if seen & {"I", "X"} else 0)
    worst = max(math.ceil(1.02 * partial_sums) if "P" in seen else 0, block)
    charged = _pointwise_half_bytes(input_shape, weight_shape, output_shape, itemsize=itemsize, stride=(1, 1),
                                    backward=True, fp16=fp16)
    return max(0, worst - charged)


def _erratic_allowance(input_shape: Sequence[int], output_shape: Sequence[int], itemsize: int, factor: float) -> int:
    """What the bound adds where cuDNN's choice was erratic: ``factor`` x the padded input and output (the
    conversion block's size) and ``POINTWISE_ERRATIC_SLACK_BYTES``."""
    io = _padded_nbytes(input_shape, itemsize) + _padded_nbytes(output_shape, itemsize)
    return math.ceil(factor * io) + POINTWISE_ERRATIC_SLACK_BYTES


def _padded_nbytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of an activation in the layout cuDNN converts it to: channels padded to a multiple of 8 in half
    precision, 4 in fp32. Without it the rule was under by 7 x the input of a 1-channel 3-D input layer in half
    precision (3 x in fp32) and 5/3 x the output of a 3-class head; with it, the largest shortfall on the three
    calibration grids fell from 302 MiB (21 %) to 17 MiB (0.1 %) for 3-D and from 26 to 8 MiB for 2-D beyond 128
    per axis (cudnn_calibration_{h200,conv_large_h200,conv_3d_xl_h200}_torch2.11_20261126.json)."""
    multiple = 8 if itemsize == 2 else 4
    channels = -(-shape[1] // multiple) * multiple
    return math.prod(shape) // shape[1] * channels * itemsize


# Narrow 3x3 convolutions in half precision. For the input's gradient of a 2-D 3x3 convolution (stride 1, no
# groups) with 2 or 8 output channels and at most 40 input channels, cuDNN 9.19's heuristics (benchmark=False)
# pick a kernel whose workspace holds input + output channels of 72 images per 16 of the batch, whatever the batch
# below 16: 72 * ceil(N/16) * H * W * (Cin + Cout) elements. Exact to 1 MiB on all 106 such shapes of
# benchmarks/results/estimate/cudnn_calibration_conv_narrow{,_trigger}_h200_torch2.11_20261126.json (Cin 4-40,
# N 1-96, 64-512 per axis, fp16 and bf16); not taken with 48 input channels or more, with 1, 4, 6, 10, 12 or 16
# output channels in fp16, with other kernel sizes, nor below 32,768 output pixels (N*H*W; taken from 65,536). It
# is the smp U-Net's 2-class head: 679 MB at 8 x 512 x 512, the gap case's missing 18 % (gap_cases_h200_*).
# bf16 layers with 3 or 5 output channels took it at one size of four (6 x 128 x 128): those are named as
# uncertain (``NARROW_DGRAD_UNSURE``) rather than charged.
NARROW_DGRAD_COUT = (2, 8)
NARROW_DGRAD_MAX_CIN = 40
NARROW_DGRAD_MIN_PIXELS = 32768
NARROW_DGRAD_IMAGES = 72
NARROW_DGRAD_BATCH_TILE = 16


def narrow_dgrad_workspace_bytes(input_shape: Sequence[int], weight_shape: Sequence[int], *, itemsize: int,
                                 stride: Sequence[int], dilation: Sequence[int], groups: int,
                                 transposed: bool) -> int:
    """The workspace of the input-gradient call of a narrow half-precision 3x3 convolution (0 where not taken)."""
    if not _narrow_3x3(input_shape, weight_shape, itemsize, stride, dilation, groups, transposed):
        return 0
    n, cin, h, w = input_shape
    cout = weight_shape[0]
    if cout not in NARROW_DGRAD_COUT or n * h * w <= NARROW_DGRAD_MIN_PIXELS:
        return 0
    tiles = -(-n // NARROW_DGRAD_BATCH_TILE)
    return NARROW_DGRAD_IMAGES * tiles * h * w * (cin + cout) * itemsize


def narrow_dgrad_unsure(input_shape: Sequence[int], weight_shape: Sequence[int], *, itemsize: int,
                        stride: Sequence[int], dilation: Sequence[int], groups: int, transposed: bool) -> bool:
    """A narrow 3x3 half-precision convolution whose input gradient may take the 72-image workspace at some sizes
    (measured for bf16 with 3 and 5 output channels; other odd counts below 16 are unmeasured)."""
    if not _narrow_3x3(input_shape, weight_shape, itemsize, stride, dilation, groups, transposed):
        return False
    cout = weight_shape[0]
    return cout not in NARROW_DGRAD_COUT and cout % 2 == 1 and 1 < cout < 16


def _narrow_3x3(input_shape: Sequence[int], weight_shape: Sequence[int], itemsize: int, stride: Sequence[int],
                dilation: Sequence[int], groups: int, transposed: bool) -> bool:
    return (itemsize == 2 and not transposed and groups == 1 and len(input_shape) == 4
            and tuple(weight_shape[2:]) == (3, 3) and all(s == 1 for s in stride)
            and all(d == 1 for d in dilation) and weight_shape[1] <= NARROW_DGRAD_MAX_CIN)


# ----------------------------------------------------------------------------------------------------------
# Transients of other CUDA kernels, measured op by op with benchmarks/profile_transients.py on an H200
# (torch 2.11, cuDNN 9.19): benchmarks/results/estimate/transients_h200_torch2.11_20261126.json. Each rule says
# what it matched.
# ----------------------------------------------------------------------------------------------------------

MiB = 1 << 20

# The largest spatial size per axis the convolution rule was checked on (calibrate_cudnn.py: 2-D 48-512, 3-D
# 24-128; up to 512 and 128 by --only conv_large, where the rule was at most 61 MB under the measured workspace:
# benchmarks/results/estimate/cudnn_calibration_conv_large_h200_torch2.11_20261126.json): larger convolutions use
# the rule by extrapolation, which widens the estimate's upper bound. 2-D measured up to 1024 per axis
# (cudnn_calibration_conv_2d_xl_h200_torch2.11_20261127.json: conv_large's layers at 640-1024, batch 1-2, and a
# detector's 256-channel FPN/RPN layers at 4 x 200-400²): the rule within 16 MiB on all 288 calls, once the
# fp32 heads' backward (HEAD_FP32_*: an RPN's 256 -> 3 objectness layer took 635 MiB at 4 x 400², which the rule
# had left out at every size) was charged. 3-D measured up to 224 per axis
# (cudnn_calibration_conv_3d_xl_h200_torch2.11_20261126.json: 32->32, strided and 1-channel 3x3x3 layers,
# transposed 2x2x2 ones, 1x1x1 heads): with channels padded as cuDNN lays them out (_padded_nbytes) the rule is at
# most 17 MiB (0.1 %) under every one of its 180 calls.
CALIBRATED_CONV_SIZE = {1: 512, 2: 1024, 3: 224}


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


EFFICIENT_GRAD_Q_TILE = ((64, 64), (128, 64))
"""Rows (queries) and columns (head dimension) of one tile of the memory-efficient attention backward's fp32 grad-query
workspace on sm80 and later, for heads up to 64 and for larger ones: ``kBlockSizeI`` and
``MatmulGradQ::ThreadblockShape::kN`` of the fp32 kernels the head size picks
(aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_backward.h, ``workspace_elements_gq``); each tile
is a ``GradQTempStorage``, 16 bytes of lock, counter and padding before its floats. Measured on an H200 to the byte
at heads of 8, 64 and 72 (``tests/test_trace.py``, GPU; 72 took 128-query tiles:
benchmarks/results/tests/gpu_tests_h200_torch2.11_20261129_s31.log, where 64-query tiles were predicted 32 KiB over)."""


def efficient_attention_backward_fp32_bytes(batch: int, heads: int, queries: int, head_dim: int) -> int:
    """What the memory-efficient attention kernel's backward takes beyond its gradients in fp32, as one block.

    Before the kernel, ``delta = (grad_out * out).sum(-1)`` made contiguous (attention_backward.cu): a query-sized
    product freed before the kernel, the sum and its contiguous copy (a float per row each, one freed). The kernel's
    workspace (``workspace_size``) is then ``batch x heads`` strides of the grad-query tiles alone: fp32 kernels
    accumulate the key and value gradients in place, and the query's in tiles of 64 x 64 floats however small the
    head, so a head of 8 takes 8 times its query's size. The H200 streams agree to the byte: HF PatchTST (896
    sequences x 16 heads of 63 x 8: 235,110,400 B, the fourth draw, entry_traces_holdout4_h200_torch2.11_20261129_s31)
    and the fit probe p_enc_fp32_prenorm (24 x 8 heads of 192 x 64: 9,446,400 B,
    gap_traces_probes_h200_torch2.11_20261126.tar.gz)."""
    rows_i, cols = EFFICIENT_GRAD_Q_TILE[head_dim > 64]
    tile = 16 + 4 * rows_i * cols
    workspace = batch * heads * _div_up(queries, rows_i) * _div_up(head_dim, cols) * tile
    query = 4 * batch * heads * queries * head_dim
    delta = 4 * batch * heads * queries
    return max(query + 2 * delta, delta + workspace)
