"""Measure what cuDNN allocates beyond the tensors: convolution workspaces and the LSTM reserve space.

A CPU trace cannot see these (they are allocated inside cuDNN calls), so memfit models them with rules fitted
on a synthetic grid of shapes measured here. The grid deliberately avoids copying the accuracy suite's layers,
so the suite stays an honest test of the fitted rules.

    python benchmarks/calibrate_cudnn.py --out $OUT      # on a CUDA machine; about a minute

Writes ``cudnn_calibration_<card>_torch<X.Y>_<yyyymmdd>.json`` into ``--out`` (default ``$OUT``, else
``benchmarks/results/estimate``): one row per configuration with the transient bytes of
forward and backward (peak during the call minus what stays allocated after it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import RESULTS, card, stem  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _transient(fn):  # noqa: ANN001, ANN202
    """Run fn(); return (result, bytes above max(before, after) at the peak inside it)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    return out, torch.cuda.max_memory_allocated() - max(before, after)


def conv_rows() -> list[dict]:
    rows = []
    grid2d = [
        # (cin, cout, kernel, stride, groups, transposed)
        (3, 64, 7, 2, 1, False), (16, 16, 3, 1, 1, False), (48, 48, 3, 1, 1, False), (96, 96, 3, 1, 1, False),
        (192, 192, 3, 1, 1, False), (384, 384, 3, 1, 1, False), (96, 192, 3, 2, 1, False),
        (48, 192, 1, 1, 1, False), (192, 48, 1, 1, 1, False), (96, 96, 7, 1, 96, False), (144, 144, 3, 1, 144, False),
        (192, 96, 2, 2, 1, True), (3, 384, 16, 16, 1, False),
    ]
    for (cin, cout, k, s, g, tr), hw, n, dname in itertools.product(grid2d, (48, 96, 192), (6, 24), DTYPES):
        rows.append(_conv_case(2, n, cin, cout, k, s, g, tr, hw, dname))
    grid3d = [(2, 24, 3, 1, 1, False), (24, 24, 3, 1, 1, False), (48, 48, 3, 1, 1, False), (96, 96, 3, 2, 1, False),
              (192, 192, 3, 1, 1, False), (96, 48, 2, 2, 1, True), (48, 3, 1, 1, 1, False)]
    for (cin, cout, k, s, g, tr), dhw, n, dname in itertools.product(grid3d, (24, 48, 80), (1, 3), DTYPES):
        rows.append(_conv_case(3, n, cin, cout, k, s, g, tr, dhw, dname))
    return [r for r in rows if r]


def conv_large_rows() -> list[dict]:
    """Convolutions larger than the grid above (2-D 256-512 per axis, 3-D 96-128): where cuDNN's algorithm, and so
    its workspace, can change with size (a U-Net's full-resolution decoder, 3-D patches)."""
    rows = []
    grid2d = [(3, 64, 7, 2, 1, False), (16, 16, 3, 1, 1, False), (32, 16, 3, 1, 1, False), (64, 64, 3, 1, 1, False),
              (128, 128, 3, 1, 1, False), (64, 32, 2, 2, 1, True)]
    for (cin, cout, k, s, g, tr), hw, n, dname in itertools.product(grid2d, (256, 384, 512), (2, 8), DTYPES):
        rows.append(_conv_case(2, n, cin, cout, k, s, g, tr, hw, dname))
    grid3d = [(1, 32, 3, 1, 1, False), (32, 32, 3, 1, 1, False), (64, 64, 3, 1, 1, False), (64, 32, 2, 2, 1, True)]
    for (cin, cout, k, s, g, tr), dhw, n, dname in itertools.product(grid3d, (96, 128), (1, 2), DTYPES):
        rows.append(_conv_case(3, n, cin, cout, k, s, g, tr, dhw, dname))
    return [r for r in rows if r]


def conv_2d_xl_rows() -> list[dict]:
    """2-D convolutions beyond conv_large's 512 per axis (detectors at 800 x 800, satellite tiles at 1024): does the
    rule hold where the bound now widens for extrapolation? The layers conv_large measured, at 640-1024, batch 1-2,
    and a detector's FPN and RPN layers (256 channels) at 256-512 for batch 4."""
    rows = []
    grid2d = [(3, 64, 7, 2, 1, False), (16, 16, 3, 1, 1, False), (32, 16, 3, 1, 1, False), (64, 64, 3, 1, 1, False),
              (128, 128, 3, 1, 1, False), (64, 32, 2, 2, 1, True), (256, 64, 1, 1, 1, False)]
    for (cin, cout, k, s, g, tr), hw, n, dname in itertools.product(grid2d, (640, 800, 1024), (1, 2), DTYPES):
        rows.append(_conv_case(2, n, cin, cout, k, s, g, tr, hw, dname))
    fpn = [(256, 256, 3, 1, 1, False), (256, 256, 1, 1, 1, False), (256, 3, 1, 1, 1, False)]
    for (cin, cout, k, s, g, tr), hw, dname in itertools.product(fpn, (200, 400), DTYPES):
        rows.append(_conv_case(2, 4, cin, cout, k, s, g, tr, hw, dname))
    return [r for r in rows if r]


def conv_3d_xl_rows() -> list[dict]:
    """3-D convolutions beyond conv_large's 128 per axis (nnU-Net patches of 160-224), batch 1-2: does the rule
    hold where the bound now widens for extrapolation?"""
    rows = []
    grid3d = [(1, 32, 3, 1, 1, False), (32, 32, 3, 1, 1, False), (32, 64, 3, 2, 1, False), (64, 32, 2, 2, 1, True),
              (32, 3, 1, 1, 1, False)]
    for (cin, cout, k, s, g, tr), dhw, n, dname in itertools.product(grid3d, (160, 192, 224), (1, 2), DTYPES):
        rows.append(_conv_case(3, n, cin, cout, k, s, g, tr, dhw, dname))
    return [r for r in rows if r]


def conv_narrow_rows() -> list[dict]:
    """2-D convolutions with few channels on one side (a segmentation head's 1-8 classes, an input stem's 1-4
    channels), which tensor-core kernels do not tile: cuDNN may pick other algorithms, with other workspaces.
    Backward is also measured as its two calls alone (``dgrad_ws``: the input's gradient; ``wgrad_ws``: the
    weight's)."""
    rows = []
    grid2d = [(cin, cout, k) for cin in (8, 16, 32, 64) for cout in (1, 2, 3, 5, 8) for k in (1, 3)]
    grid2d += [(cin, 32, 3) for cin in (1, 2, 3, 4)]
    for (cin, cout, k), hw, n, dname in itertools.product(grid2d, (128, 384), (2, 6), DTYPES):
        row = _conv_case(2, n, cin, cout, k, 1, 1, False, hw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_narrow_trigger_rows() -> list[dict]:
    """Where the narrow grid above found half-precision 3x3 data gradients with a workspace of 72 images' input
    and output (Cout 2 and 8, Cin 8-32), the edges of that region: more channel counts, kernel sizes, batch sizes
    from 1 to 96 (is it 72 images whatever the batch?) and sizes around the switch (n=2 at 128² did not take it,
    n=6 did). fp16 only (bf16 measured the same there)."""
    rows = []
    shapes = [(cin, cout, 3) for cin in (4, 8, 24, 32, 40, 48) for cout in (2, 4, 6, 8, 10, 12, 16)]
    shapes += [(16, 2, 5), (16, 2, 7), (16, 8, 5), (16, 4, 1)]
    for (cin, cout, k), (n, hw) in itertools.product(shapes, ((1, 256), (4, 128), (3, 160), (1, 512), (16, 96),
                                                               (96, 64), (12, 256))):
        row = _conv_case(2, n, cin, cout, k, 1, 1, False, hw, "fp16", split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_pointwise_half_rows() -> list[dict]:
    """2-D 1x1 convolutions in half precision, which the rule charged nothing: the filter gradient of some takes
    a workspace (mobilenet_v3's 160 -> 960 at 4 x 4, batch 48: 29.5 MB = batch x Cin x Cout fp32 partial sums;
    a 16 -> 14 head at 512 x 512: 34 MB; corpus fit entries c001 and c032 on an H100). Bottleneck, expansion,
    projection and head layers of real networks at the sizes they run at, stride 2 for ResNet's shortcuts;
    backward also as its two calls alone."""
    rows = []
    shapes = [(16, 14, 1), (32, 3, 1), (64, 256, 1), (256, 64, 1), (128, 512, 1), (512, 128, 1), (160, 960, 1),
              (960, 160, 1), (512, 2048, 1), (2048, 512, 1), (24, 144, 1), (576, 96, 1), (256, 512, 2),
              (1024, 2048, 2)]
    for (cin, cout, s), hw, n, dname in itertools.product(shapes, (4, 7, 14, 28, 56, 112, 224, 512), (2, 8, 16, 48),
                                                          ("bf16", "fp16")):
        if n * max(cin, cout) * hw * hw * 2 > 1 << 30:
            continue  # beyond any layer of the models we size at these batches
        row = _conv_case(2, n, cin, cout, 1, s, 1, False, hw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_pointwise_small_half_rows() -> list[dict]:
    """2-D stride-1 1x1 convolutions in half precision below 28 x 28, where the filter gradient chose between the
    fp32 partial sums (batch x Cin x Cout x 4 bytes) and a conversion block (input + output): the H200 grids had
    ResNet-50's 2048 <-> 512 take the block, while on an H100 InceptionV3's 2048 -> 384 and 1280 -> 320 at 8 x 8,
    NFNet-L0's 1536 -> 384 at 7 x 7 and EfficientNet-B0's 320 -> 1280 head at 7 x 7 took the partial sums (zoo
    streams, zoo_traces_h100_torch2.11_20261127). The widths of real networks' last stages (ResNet, Inception,
    NFNet, EfficientNet, MobileNet, DenseNet, RegNet) at the sizes they run at; both backward calls alone."""
    rows = []
    pairs = [(2048, 512), (512, 2048), (1024, 256), (256, 1024), (2048, 384), (2048, 320), (2048, 448), (2048, 192),
             (1280, 384), (1280, 320), (1280, 192), (768, 192), (768, 128), (1536, 384), (384, 1536), (320, 1280),
             (1280, 320), (1152, 192), (192, 1152), (960, 160), (1024, 128), (1536, 1536), (384, 384), (640, 640),
             (1024, 1024), (512, 512), (2304, 576), (672, 112)]
    for (cin, cout), hw, n, dname in itertools.product(dict.fromkeys(pairs), (4, 7, 8, 14, 17), (8, 16, 32, 64, 96),
                                                       ("fp16", "bf16")):
        row = _conv_case(2, n, cin, cout, 1, 1, 1, False, hw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_big_weight_rows() -> list[dict]:
    """Convolutions whose weight dwarfs their activations (VGG's 7 x 7 classifier convolution 512 -> 4096 on 7 x 7,
    a 3 x 3 4096 -> 4096 on 7 x 7): the order of the backward's blocks decides the peak there (timm VGG-16-BN's
    stream on an H100: grad input, a weight-sized block, then the weight's gradient)."""
    rows = []
    for (cin, cout, k), hw, n, dname in itertools.product(((512, 4096, 7), (4096, 4096, 1), (1024, 2048, 3),
                                                           (512, 1024, 3)), (7, 14), (2, 16, 64),
                                                          ("fp32", "bf16", "fp16")):
        row = _conv_case(2, n, cin, cout, k, 1, 1, False, hw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_odd_channels_half_rows() -> list[dict]:
    """Half-precision convolutions of networks whose widths are not multiples of 16 or 32 (RegNet's 48, 104, 208,
    440; its squeeze-excitation 1x1s at 1 x 1; EfficientNet's 40/240, 112/672) and 3x3 stems from 3 channels at
    stride 2: where fit-side RegNets (probe_cases.py, s1327_tv_cls_regnet*) allocated no workspace in forward and
    less in backward than the pointwise rule charges. Backward also as its two calls alone."""
    rows = []
    pointwise = [(48, 48, 1), (104, 104, 1), (208, 208, 1), (440, 440, 1), (232, 232, 1), (696, 696, 1),
                 (40, 240, 1), (240, 40, 1), (112, 672, 1), (672, 112, 1), (256, 256, 1), (512, 512, 1),
                 (32, 48, 2), (48, 104, 2), (104, 208, 2), (208, 440, 2), (256, 512, 2)]
    for (cin, cout, s), hw, n in itertools.product(pointwise, (1, 4, 8, 16, 32, 64, 128), (2, 16, 32)):
        if n * max(cin, cout) * hw * hw * 2 > 1 << 30 or (hw == 1 and s == 2):
            continue
        row = _conv_case(2, n, cin, cout, 1, s, 1, False, hw, "fp16", split_backward=True)
        if row:
            rows.append(row)
    for (cin, cout), hw, n in itertools.product(((3, 32), (3, 24), (3, 16), (3, 64)), (128, 224, 256), (2, 16, 32)):
        row = _conv_case(2, n, cin, cout, 3, 2, 1, False, hw, "fp16", split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_patchify_rows() -> list[dict]:
    """Non-overlapping "patchify" convolutions (kernel == stride: a ViT's patch embedding) from 3 input channels at
    the batches and image sizes ViTs train at: the first grid measured no forward workspace up to 24 x 3 x 192²,
    but a fit-side frozen ViT-B/16 (probe_cases.py, s1327_frozen_cnn_r501, bf16, 32 x 3 x 224²) took 38.5 MB in
    its patch embedding's forward. With and without gradients (a frozen embedding runs forward only)."""
    rows = []
    for (cout, k), hw, n, dname, grad in itertools.product(
            ((768, 16), (384, 16), (1024, 14), (768, 32)), (224, 384), (1, 8, 16, 32, 64, 128), DTYPES, (True, False)):
        if hw % k:
            hw = hw // k * k
        row = _conv_case(2, n, 3, cout, k, k, 1, False, hw, dname, grad=grad)
        if row:
            rows.append(row)
    return rows


def conv_patchify_wgrad_rows() -> list[dict]:
    """Patch embeddings as models train them: the image needs no gradient, so backward makes the filter gradient's
    call alone (the first patchify grid measured both calls). 2-D (ViT 16² and 14² to 384-1024 filters, ConvNeXt's
    and Swin's 4² stems to 96-128) and 3-D (Video Swin's 2 x 4² to 96 from 16 frames, a ViViT-style 2 x 16² tubelet to
    768), fp32/bf16/fp16. A Video Swin-T's H200 stream (entry_traces_h200_torch2.11_20261128_s26_r3) took a 71.7 MB
    block there, where the rule charged none."""
    rows = []
    cases = [((cout, (k, k)), (side, side), n) for (cout, k), side, n in itertools.product(
        ((768, 16), (384, 16), (1024, 14), (96, 4), (128, 4)), (224,), (1, 8, 32, 64, 128))]
    cases += [((cout, kernel), (16, side, side), n) for (cout, kernel), side, n in itertools.product(
        ((96, (2, 4, 4)), (768, (2, 16, 16))), (224,), (1, 2, 4, 8))]
    for ((cout, kernel), size, n), dname in itertools.product(cases, DTYPES):
        dtype = DTYPES[dname]
        dims = len(kernel)
        conv = getattr(F, f"conv{dims}d")
        row = _filter_gradient_case((n, 3, *size), (cout, 3, *kernel), dtype,
                                    lambda x, w, kernel=kernel, conv=conv: conv(x, w, stride=kernel),
                                    dims=dims, n=n, cin=3, cout=cout, k=list(kernel), stride=list(kernel),
                                    size=list(size), dtype=dname)
        if row:
            rows.append(row)
    return rows


def _filter_gradient_case(x_shape: tuple[int, ...], w_shape: tuple[int, ...], tensor_dtype: torch.dtype,
                          conv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], **fields: Any) -> dict | None:
    """A convolution whose input needs no gradient (a stem over the batch): its forward, then its backward, which
    is the filter gradient's call alone; the row (``fields`` first), or None where the GPU ran out of memory."""
    try:
        x = torch.randn(*x_shape, device="cuda", dtype=tensor_dtype)
        w = torch.randn(*w_shape, device="cuda", dtype=tensor_dtype, requires_grad=True)
        y, fwd = _transient(lambda: conv(x, w))  # noqa: F821 (called at once; deleted below)
        gy = torch.randn_like(y)
        _, wgrad = _transient(lambda: torch.autograd.grad(y, w, gy))  # noqa: F821
        row = dict(kind="conv", **fields, groups=1, transposed=False, input_grad=False,
                   in_bytes=x.numel() * x.element_size(), out_bytes=y.numel() * y.element_size(),
                   w_bytes=w.numel() * w.element_size(), fwd_ws=fwd, wgrad_ws=wgrad)
        del x, w, y, gy
        return row
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def conv_head_half_rows() -> list[dict]:
    """Half-precision 1x1 segmentation heads: a few feature channels to a small class count (2-D and 3-D), at the
    sizes U-Nets train at. A fit-side bf16 2-D U-Net (probe_cases.py, s1327_unet_r500: 32 -> 5 at 4 x 512²) took a
    91.5 MB workspace in the head's backward, where the pointwise rules charge nothing."""
    rows = []
    for (cin, cout), hw, n, dname in itertools.product(
            ((32, 2), (32, 3), (32, 5), (32, 14), (16, 3), (64, 5), (64, 21), (32, 8), (32, 16)), (128, 256, 512),
            (1, 2, 4, 8), ("bf16", "fp16")):
        row = _conv_case(2, n, cin, cout, 1, 1, 1, False, hw, dname, split_backward=True)
        if row:
            rows.append(row)
    for (cin, cout), dhw, n, dname in itertools.product(
            ((32, 2), (32, 3), (32, 5), (32, 14), (16, 3)), (64, 96, 128), (1, 2, 4), ("bf16", "fp16")):
        row = _conv_case(3, n, cin, cout, 1, 1, 1, False, dhw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_3d_half_rows() -> list[dict]:
    """Half-precision 3-D convolutions of a small U-Net (16-64 features, an input layer from 1-4 channels, stride-2
    downsampling, transposed-convolution upsampling, a 1x1 head) at 48-128 per axis, batch 1-2, each backward call
    also alone. A fit-side bf16 3-D U-Net (probe_cases.py, s1327_unet_r505: 16-128 features at 96³, batch 2) took a
    127.8 MB block at its peak where the rule charged 84.9 MB, and the older grids' backward (both calls together)
    came out 1.03-2.2 x the rule's one call."""
    rows = []
    layers = [(4, 16, 3, 1, False), (1, 16, 3, 1, False), (16, 16, 3, 1, False), (32, 16, 3, 1, False),
              (16, 32, 3, 2, False), (32, 32, 3, 1, False), (64, 32, 3, 1, False), (32, 64, 3, 2, False),
              (8, 8, 3, 1, False), (24, 24, 3, 1, False), (48, 48, 3, 1, False), (32, 16, 2, 2, True),
              (64, 32, 2, 2, True), (16, 2, 1, 1, False)]
    for (cin, cout, k, s, tr), dhw, n, dname in itertools.product(layers, (48, 64, 96, 128), (1, 2), ("bf16", "fp16")):
        size = dhw // 2 if tr else dhw  # a transposed convolution upsamples to dhw
        row = _conv_case(3, n, cin, cout, k, s, 1, tr, size, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_3d_head_half_rows() -> list[dict]:
    """3-D half-precision segmentation heads over more channel and class counts than conv_head_half and
    conv_3d_half measured (16 -> 2/3 and 32 -> 2/3/5/14): 8-64 channels to 2-16 classes at 64-128³, batch 1-2,
    each backward call alone."""
    rows = []
    for cin, cout, dhw, n, dname in itertools.product((8, 16, 24, 48, 64), (2, 3, 4, 5, 8, 14, 16), (64, 96, 128),
                                                       (1, 2), ("bf16", "fp16")):
        row = _conv_case(3, n, cin, cout, 1, 1, 1, False, dhw, dname, split_backward=True)
        if row:
            rows.append(row)
    return rows


def conv_fp32_channels_rows() -> list[dict]:
    """fp32 3x3 convolutions over channel pairs, narrowing, equal and widening (16-256 channels at 96-384², batch
    2 and 8), each backward call alone: a fourth-draw step (HF DPT's depth head, 256 -> 128 at 192² and 128 -> 32 at
    384², batch 8) ran both without the layout conversion the grids above measured on every fp32 3x3 call."""
    rows = []
    pairs = [(cin, cout) for cin in (32, 64, 128, 256) for cout in (16, 32, 64, 128, 256) if cout <= cin]
    pairs += [(16, 64), (32, 64), (64, 128), (128, 256)]
    for (cin, cout), hw, n in itertools.product(pairs, (96, 192, 384), (2, 8)):
        row = _conv_case(2, n, cin, cout, 3, 1, 1, False, hw, "fp32", split_backward=True)
        if row:
            rows.append(row)
    return rows


def _channels_last_rows(shapes: list[tuple[int, int, int, int]], sizes: tuple[int, ...],
                        layouts: tuple[str, ...]) -> list[dict]:
    """2-D convolutions (cin, cout, kernel, stride) on channels-last inputs at batch 2 and 8 in every precision,
    forward and each backward call alone (``_conv_case``'s ``channels_last``: "both" or "input")."""
    rows = []
    for (cin, cout, k, s), hw, n, dname, layout in itertools.product(shapes, sizes, (2, 8), DTYPES, layouts):
        row = _conv_case(2, n, cin, cout, k, s, 1, False, hw, dname, split_backward=True, channels_last=layout)
        if row:
            rows.append(row)
    return rows


def conv_channels_last_rows() -> list[dict]:
    """Convolutions on channels-last inputs, with a channels-last weight (``model.to(memory_format=...)``) or an
    NCHW one (a permuted view reaching a plain model: DPT's reassembled ViT tokens, whose 3x3 head convolutions in fp32
    took no layout conversion on an H200 where NCHW inputs of the same shapes took input + output), forward and each
    backward call alone; 2-D only."""
    shapes = [(16, 16, 3, 1), (64, 64, 3, 1), (128, 32, 3, 1), (256, 128, 3, 1), (32, 64, 3, 1), (64, 128, 3, 2),
              (64, 256, 1, 1), (256, 64, 1, 1), (3, 64, 7, 2), (256, 3, 1, 1)]
    return _channels_last_rows(shapes, (56, 192, 384), ("both", "input"))


def conv_channels_last_large_rows() -> list[dict]:
    """Channels-last convolutions at 512 and 1024 per axis, where the grid above stops at 384: the segmentation steps of
    the sixth draw (smp, torchvision DeepLabV3, a PSP head) train at 473-513² and their stems were widened as
    extrapolated. Stems from RGB (7x7 and 3x3, stride 2) and a ResNet block's 3x3 and 1x1 convolutions, input and
    weight channels-last."""
    shapes = [(3, 64, 7, 2), (3, 32, 3, 2), (3, 48, 3, 2), (64, 64, 3, 1), (256, 64, 1, 1), (64, 256, 1, 1)]
    return _channels_last_rows(shapes, (512, 1024), ("both",))


def conv_channels_last_odd_rows() -> list[dict]:
    """Channels-last convolutions whose channel counts are not powers of two (a U-Net decoder's concatenations: 96,
    192, 384; EfficientNet's 24-160): a GPU test found an fp32 96 -> 48 3x3 at 2 x 320² taking an input-sized block
    in forward, where the power-of-two grid above took none."""
    shapes = [(24, 24, 3), (48, 48, 3), (96, 48, 3), (96, 96, 3), (144, 144, 3), (192, 64, 3), (192, 192, 3),
              (384, 128, 3), (80, 80, 3), (160, 160, 3), (96, 192, 1), (40, 240, 1)]
    return _channels_last_rows([(cin, cout, k, 1) for cin, cout, k in shapes], (96, 192, 320), ("both", "input"))


def conv_channels_last_wide_rows() -> list[dict]:
    """Channels-last convolutions from 512-2048 channels (a segmentation head's fusion of concatenated pyramid
    levels): HF UperNet-ConvNeXt's fp16 fpn_bottleneck (2048 -> 512, 3x3, 8 x 128²) took a 658 MiB layout conversion
    on an H200 where the grids above, which stop at 384 input channels, took a few MiB."""
    shapes = [(cin, cout, k, 1) for cin in (512, 1024, 2048) for cout in (256, 512) for k in (3, 1)]
    return _channels_last_rows(shapes, (32, 64, 128), ("both",))


def _conv_case(dims, n, cin, cout, k, s, g, tr, size, dname, split_backward=False, grad=True,  # noqa: ANN001, ANN202
               channels_last=None):
    """``channels_last``: None (NCHW), "input" (the input alone, as a permuted view: DPT's reassembled tokens) or
    "both" (input and weight, as ``model.to(memory_format=torch.channels_last)`` and a channels-last batch)."""
    dtype = DTYPES[dname]
    fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
    try:
        x = torch.randn(n, cin, *([size] * dims), device="cuda", dtype=dtype)
        x = (x.contiguous(memory_format=fmt) if channels_last else x).requires_grad_(grad)
        wshape = (cin, cout // g, *([k] * dims)) if tr else (cout, cin // g, *([k] * dims))
        w = torch.randn(*wshape, device="cuda", dtype=dtype)
        w = (w.contiguous(memory_format=fmt) if channels_last == "both" else w).requires_grad_(grad)
        pad = 0 if (tr or k == 1 or k == s) else k // 2
        conv = getattr(F, f"conv_transpose{dims}d" if tr else f"conv{dims}d")
        y, fwd = _transient(lambda: conv(x, w, stride=s, padding=pad, groups=g))  # noqa: F821 (called at once)
        row = dict(kind="conv", dims=dims, n=n, cin=cin, cout=cout, k=k, stride=s, groups=g, transposed=tr,
                   size=size, dtype=dname, **({} if grad else {"grad": False}),
                   **({"channels_last": channels_last} if channels_last else {}), in_bytes=x.numel() * x.element_size(),
                   out_bytes=y.numel() * y.element_size(), w_bytes=w.numel() * w.element_size(), fwd_ws=fwd)
        if not grad:
            return row  # forward only, as a frozen layer runs
        gy = torch.randn_like(y)
        base = torch.cuda.memory_allocated()
        _, row["bwd_ws"] = _transient(lambda: torch.autograd.grad(y, (x, w), gy, retain_graph=split_backward))  # noqa: F821
        if split_backward:
            # the backward's peak above what was allocated before it: with both gradients and the two calls' blocks,
            # it tells the order (the data call's block before the filter gradient is allocated, or after)
            row["bwd_peak_above_before"] = torch.cuda.max_memory_allocated() - base
            _, row["dgrad_ws"] = _transient(lambda: torch.autograd.grad(y, x, gy, retain_graph=True))  # noqa: F821
            _, row["wgrad_ws"] = _transient(lambda: torch.autograd.grad(y, w, gy))  # noqa: F821
        del x, w, y, gy
        return row
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def conv_3d_stem_rows() -> list[dict]:
    """Video and volume stems: a 3-D convolution from 1-4 channels whose input needs no gradient (the batch), with
    the anisotropic kernels and strides of torchvision's video models (R3D / MC3 3x7x7 stride 1x2x2, R(2+1)D 1x7x7)
    and plain 3x3x3 ones; forward, then the filter gradient (the only backward call of a stem)."""
    rows = []
    shapes = [((3, 7, 7), (1, 2, 2), (1, 3, 3)), ((1, 7, 7), (1, 2, 2), (0, 3, 3)), ((3, 3, 3), (1, 1, 1), (1, 1, 1)),
              ((3, 3, 3), (2, 2, 2), (1, 1, 1))]
    for cin, (k, s, pad), (frames, size), n, dname in itertools.product((1, 2, 3, 4), shapes, ((16, 112), (8, 64)),
                                                                     (2, 16), DTYPES):
        row = _filter_gradient_case((n, cin, frames, size, size), (64, cin, *k), DTYPES[dname],
                                    lambda x, w, s=s, pad=pad: F.conv3d(x, w, stride=s, padding=pad),
                                    dims=3, n=n, cin=cin, cout=64, k=list(k), stride=list(s), padding=list(pad),
                                    frames=frames, size=size, dtype=dname)
        if row:
            rows.append(row)
    return rows


def lstm_rows() -> list[dict]:
    rows = []
    for layers, hidden, seq, n, dname in itertools.product((1, 3), (128, 384, 768), (32, 200), (8, 48), ("fp32", "bf16")):
        dtype = DTYPES[dname]
        lstm = torch.nn.LSTM(hidden, hidden, layers, batch_first=True).cuda().to(dtype)
        x = torch.randn(n, seq, hidden, device="cuda", dtype=dtype, requires_grad=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out, (h, c) = lstm(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before  # outputs + reserve space held for backward
        tensors = sum(t.numel() * t.element_size() for t in (out, h, c))
        _, bwd = _transient(lambda: torch.autograd.grad(out, (x, *lstm.parameters()), torch.randn_like(out)))  # noqa: B023, F821
        rows.append(dict(kind="lstm", layers=layers, hidden=hidden, seq=seq, n=n, dtype=dname,
                         out_bytes=tensors, kept_bytes=kept, reserve_bytes=kept - tensors, bwd_ws=bwd))
        del lstm, x, out, h, c
    return rows


def rnn_rows() -> list[dict]:
    """GRU, tanh RNN and LSTM (one- and two-directional): what forward keeps beyond its outputs (the reserve), and
    the transients of forward and backward. A grid of its own, not the gap cases' shapes."""
    rows = []
    modes = {"GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN, "LSTM": torch.nn.LSTM}
    grid = itertools.product(modes, (1, 2), (1, 3), (96, 384), (40, 500), (4, 24), ("fp32", "bf16"))
    for mode, directions, layers, hidden, seq, n, dname in grid:
        dtype = DTYPES[dname]
        rnn = modes[mode](hidden, hidden, layers, batch_first=True, bidirectional=directions == 2).cuda().to(dtype)
        x = torch.randn(n, seq, hidden, device="cuda", dtype=dtype, requires_grad=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, state = rnn(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        fwd = torch.cuda.max_memory_allocated() - before - kept
        states = state if isinstance(state, tuple) else (state,)
        tensors = sum(t.numel() * t.element_size() for t in (out, *states))
        _, bwd = _transient(lambda: torch.autograd.grad(out, (x, *rnn.parameters()), torch.randn_like(out)))  # noqa: B023, F821
        rows.append(dict(kind="rnn", mode=mode, directions=directions, layers=layers, hidden=hidden, seq=seq, n=n,
                         dtype=dname, out_bytes=tensors, kept_bytes=kept, reserve_bytes=kept - tensors,
                         fwd_ws=fwd, bwd_ws=bwd))
        del rnn, x, out, state, states
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "estimate"))
    parser.add_argument("--only", choices=("conv", "conv_large", "conv_2d_xl", "conv_narrow", "conv_narrow_trigger", "conv_3d_xl",
                                                "conv_pointwise_half", "conv_pointwise_small_half", "conv_big_weight", "conv_odd_channels_half",
                                                "conv_patchify", "conv_patchify_wgrad", "conv_head_half",
                                                "conv_3d_half", "conv_3d_head_half", "conv_3d_stem", "conv_fp32_channels", "conv_channels_last", "conv_channels_last_odd", "conv_channels_last_wide", "conv_channels_last_large", "lstm",
                                                "rnn"),
                        help="measure one family only")
    parser.add_argument("--deterministic", action="store_true",
                        help="with deterministic algorithms, as Lightning's Trainer(deterministic='warn') sets them "
                             "(cuDNN picks among its deterministic algorithms only); the file is named _deterministic")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = False  # PyTorch's default: cuDNN's heuristics pick the algorithm
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS's first handle
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")  # cuBLAS workspace out of the way
    families = {"conv": conv_rows, "conv_large": conv_large_rows, "conv_2d_xl": conv_2d_xl_rows, "conv_narrow": conv_narrow_rows,
                "conv_narrow_trigger": conv_narrow_trigger_rows, "conv_3d_xl": conv_3d_xl_rows,
                "conv_pointwise_half": conv_pointwise_half_rows,
                "conv_pointwise_small_half": conv_pointwise_small_half_rows, "conv_big_weight": conv_big_weight_rows, "conv_odd_channels_half": conv_odd_channels_half_rows,
                "conv_patchify": conv_patchify_rows, "conv_patchify_wgrad": conv_patchify_wgrad_rows,
                "conv_head_half": conv_head_half_rows,
                "conv_3d_half": conv_3d_half_rows, "conv_3d_head_half": conv_3d_head_half_rows,
                "conv_3d_stem": conv_3d_stem_rows, "conv_fp32_channels": conv_fp32_channels_rows,
                "conv_channels_last": conv_channels_last_rows,
                "conv_channels_last_odd": conv_channels_last_odd_rows,
                "conv_channels_last_wide": conv_channels_last_wide_rows,
                "conv_channels_last_large": conv_channels_last_large_rows,
                "lstm": lstm_rows,
                "rnn": rnn_rows}
    rows = [r for name, fn in families.items() if args.only in (None, name) for r in fn()]
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version(), "date": dt.date.today().isoformat(),
              "deterministic": args.deterministic, "rows": rows}
    family = (f"_{args.only}" if args.only else "") + ("_deterministic" if args.deterministic else "")
    path = Path(args.out) / f"{stem('cudnn_calibration' + family, card(props.name), torch.__version__)}.json"
    path.write_text(json.dumps(result, indent=0))
    print(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
