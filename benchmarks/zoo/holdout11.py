"""An eleventh fresh draw of real training steps, written down on 2026-11-30 (session 36) *before* memfit estimated or
measured any of them.

Half-precision networks whose 1x1 convolutions run over an odd number of pixels per image: DeepLab-style
segmentation of 513² crops (33 x 33 or 65 x 65 features), classifiers whose last stage is 7 x 7 or 19 x 19
(224² and 299² images), MobileNetV3, EfficientNet, RegNet and ResNet. Session 36 started charging such a forward
convolution cuDNN's conversion block (input + output) from batch 8 and 128 input channels, from two grids of single
convolutions (``conv_grid_pointwise_odd_h200_torch2.11_20261130_s36.md``); this draw tests that rule on steps that
tuned nothing, predicted by the code before and after it, both committed before the one GPU call that measures
them. Reported on its own (tag ``holdout11``).

Each builder follows its library's usual recipe at a batch one GPU trains; nothing here is resized after a prediction
is seen. Each ran one eager training step on the CPU before being committed (at batch 2; bf16 autocast for fp16).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import adamw, ce, images, timm_model  # noqa: E402
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout11"
HOLDOUT11 = "holdout11"


def _crops(size: int, classes: int) -> Any:
    return lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n, size, size)))


def _sgd(lr: float = 0.01) -> Any:
    return lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=1e-4)


def _seg(name: str, arch: str, size: int, classes: int, batch_size: int, precision: str, optimizer: Any,
         **kwargs: Any) -> Workload:
    return Workload(
        name=name, description=f"torchvision {arch}, {classes} classes, {size}x{size} crops, {precision}",
        model=_tv(arch, weights_backbone=None, num_classes=classes, **kwargs), batch=_crops(size, classes),
        loss=lambda out, b: F.cross_entropy(out["out"], b[1], ignore_index=255), optimizer=optimizer,
        batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("torchvision", HOLDOUT11, "cnn", "segmentation"),
    )


h11_tv_deeplabv3_mnv3_513_bf16 = _seg("h11_tv_deeplabv3_mnv3_513_bf16", "deeplabv3_mobilenet_v3_large", 513, 21, 24,
                                      "bf16", _sgd())
h11_tv_lraspp_mnv3_513_fp16 = _seg("h11_tv_lraspp_mnv3_513_fp16", "lraspp_mobilenet_v3_large", 513, 21, 32, "fp16",
                                   _sgd())
h11_tv_deeplabv3_r50_513_fp16 = _seg("h11_tv_deeplabv3_r50_513_fp16", "deeplabv3_resnet50", 513, 21, 8, "fp16",
                                     _sgd())
h11_tv_fcn_r50_481_bf16 = _seg("h11_tv_fcn_r50_481_bf16", "fcn_resnet50", 481, 19, 8, "bf16", _sgd())


def _cls(name: str, model: str, size: int, batch_size: int, precision: str, optimizer: Any,
         library: str = "timm") -> Workload:
    build = timm_model(model, num_classes=1000) if library == "timm" else _tv(model)
    return Workload(
        name=name, description=f"{library} {model}, {size}x{size} images, {precision}", model=build,
        batch=images(size), loss=ce, optimizer=optimizer, batch_size=batch_size,
        precision=precision,  # type: ignore[arg-type]
        tags=((library,) if library == "timm" else ("torchvision",)) + (HOLDOUT11, "cnn", "classification"),
    )


h11_timm_resnet50_224_fp16 = _cls("h11_timm_resnet50_224_fp16", "resnet50", 224, 192, "fp16", _sgd(0.1))
h11_timm_mnv3_large_224_bf16 = _cls("h11_timm_mnv3_large_224_bf16", "mobilenetv3_large_100", 224, 384, "bf16",
                                    adamw(1e-3, 0.05))
h11_timm_effnet_b0_224_fp16 = _cls("h11_timm_effnet_b0_224_fp16", "efficientnet_b0", 224, 256, "fp16",
                                   adamw(1e-3, 0.05))
h11_timm_regnety_016_288_bf16 = _cls("h11_timm_regnety_016_288_bf16", "regnety_016", 288, 128, "bf16",
                                     adamw(1e-3, 0.05))
h11_tv_resnet50_299_fp16 = _cls("h11_tv_resnet50_299_fp16", "resnet50", 299, 96, "fp16", _sgd(0.1),
                                library="torchvision")


class _ASPPHead(nn.Module):
    """A DeepLab-style head written by hand on a small strided encoder: 1x1 and dilated 3x3 branches over 65 x 65
    features of a 513² crop, concatenated, projected by a 1x1 convolution, upsampled to the crop."""

    def __init__(self, classes: int = 8, width: int = 256) -> None:
        super().__init__()
        chans = (3, 64, 128, 256)
        self.encoder = nn.Sequential(*[
            nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], 3, stride=2, padding=1, bias=False),
                          nn.BatchNorm2d(chans[i + 1]), nn.ReLU(inplace=True))
            for i in range(3)])
        self.branches = nn.ModuleList([nn.Conv2d(256, width, 1, bias=False)] + [
            nn.Conv2d(256, width, 3, padding=d, dilation=d, bias=False) for d in (6, 12, 18)])
        self.project = nn.Sequential(nn.Conv2d(4 * width, width, 1, bias=False), nn.BatchNorm2d(width),
                                     nn.ReLU(inplace=True), nn.Conv2d(width, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        f = self.encoder(x)
        y = self.project(torch.cat([b(f) for b in self.branches], dim=1))
        return F.interpolate(y, size=size, mode="bilinear", align_corners=False)


h11_torch_aspp_513_fp16 = Workload(
    name="h11_torch_aspp_513_fp16", description="hand-written DeepLab-style ASPP head on a strided encoder, 513x513 "
    "crops (65 x 65 features), 8 classes, fp16",
    model=_ASPPHead, batch=_crops(513, 8), loss=ce, optimizer=_sgd(), batch_size=16, precision="fp16",
    tags=(HOLDOUT11, "cnn", "segmentation"),
)
