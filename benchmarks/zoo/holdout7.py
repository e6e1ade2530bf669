"""A seventh fresh draw of real training steps, written down on 2026-11-29 (session 34) *before* memfit estimated or
measured any of them.

Session 34 charged strided fp32 1x1 convolutions (a ResNet's downsampling shortcut) a layout-conversion block that no
rule had charged before, from a 65-call H200 grid of single convolutions, and took channels-last RGB stems as
calibrated up to 1024 per axis. This draw checks both on whole steps that tuned nothing: CNNs trained in fp32 in the
default layout whose shortcuts are strided 1x1 convolutions — torchvision's ResNet-101, ResNet-152, ResNeXt-50 and
Wide ResNet-101, FCN-ResNet-101 at 480x480 and MC3-18 on video clips (3-D shortcuts); timm's RegNetX-3.2GF,
Res2NeXt-50 and GENet-M; Hugging Face's ResNet-50 and RegNet; smp's U-Net on ResNet-50 and LinkNet on ResNet-34 at
512x512; MONAI's 3-D ResNet-18 with shortcut type B; a hand-written CIFAR ResNet-56 with projection shortcuts — a
ResNet-D whose shortcuts average-pool before a stride-1 1x1 (timm's ResNet-34-D), and three trained channels-last
over large images: smp's DeepLabV3 on ResNet-50 at 1024x1024 (bf16), timm's ResNet-50 at 448x448 (fp32) and
EfficientNet-B2 at 640x640 (bf16). They are reported on their own (tag ``holdout7``): nothing was fitted on them, and
any fix made after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch one GPU trains;
nothing here is resized after a prediction is seen. Each ran one eager training step at batch 2 on the CPU before
being committed.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import adamw, ce, images, logits_ce, monai_net, sgd, smp_model, timm_entry  # noqa: E402
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout7"
HOLDOUT7 = "holdout7"


def _adam(lr: float = 1e-4) -> Any:
    return lambda p: torch.optim.Adam(p, lr=lr)


# --- torchvision --------------------------------------------------------------------------------------------------

def _tv_cls(name: str, arch: str, batch_size: int) -> Workload:
    return Workload(
        name=name, description=f"torchvision {arch}, 224x224, fp32", model=_tv(arch), batch=images(224), loss=ce,
        optimizer=sgd(nesterov=False), batch_size=batch_size, precision="fp32",
        tags=("torchvision", HOLDOUT7, "cnn"),
    )


h7_tv_resnet101_fp32 = _tv_cls("h7_tv_resnet101_fp32", "resnet101", 64)
h7_tv_resnet152_fp32 = _tv_cls("h7_tv_resnet152_fp32", "resnet152", 32)
h7_tv_resnext50_fp32 = _tv_cls("h7_tv_resnext50_fp32", "resnext50_32x4d", 64)
h7_tv_wide_resnet101_fp32 = _tv_cls("h7_tv_wide_resnet101_fp32", "wide_resnet101_2", 32)
h7_tv_fcn_resnet101_fp32 = Workload(
    name="h7_tv_fcn_resnet101_fp32", description="torchvision fcn_resnet101 + aux head, 21 classes, 480x480, fp32",
    model=_tv("fcn_resnet101", weights_backbone=None, num_classes=21, aux_loss=True),
    batch=lambda n: (torch.randn(n, 3, 480, 480), torch.randint(0, 21, (n, 480, 480))),
    loss=lambda out, b: F.cross_entropy(out["out"], b[1], ignore_index=255) + 0.5 * F.cross_entropy(
        out["aux"], b[1], ignore_index=255),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4), batch_size=8,
    precision="fp32", tags=("torchvision", HOLDOUT7, "cnn", "segmentation"),
)
h7_tv_mc3_18_fp32 = Workload(
    name="h7_tv_mc3_18_fp32", description="torchvision mc3_18 (mixed 3-D/2-D convolutions), 16 frames of 112x112, "
    "400 classes, fp32",
    model=_tv("mc3_18", num_classes=400),
    batch=lambda n: (torch.randn(n, 3, 16, 112, 112), torch.randint(0, 400, (n,))), loss=ce,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4), batch_size=16,
    precision="fp32", tags=("torchvision", HOLDOUT7, "cnn", "video", "3d"),
)


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT7, kind="cnn")

h7_timm_resnet34d_fp32 = _timm_entry("h7_timm_resnet34d_fp32", "resnet34d", 128, "fp32", sgd(nesterov=False))
h7_timm_regnetx_032_fp32 = _timm_entry("h7_timm_regnetx_032_fp32", "regnetx_032", 64, "fp32", sgd(nesterov=True))
h7_timm_res2next50_fp32 = _timm_entry("h7_timm_res2next50_fp32", "res2next50", 64, "fp32", sgd(nesterov=False))
h7_timm_gernet_m_fp32 = _timm_entry("h7_timm_gernet_m_fp32", "gernet_m", 64, "fp32", adamw())
h7_timm_resnet50_448_cl = _timm_entry("h7_timm_resnet50_448_cl", "resnet50", 32, "fp32", sgd(nesterov=False),
                                      size=448, channels_last=True)
h7_timm_efficientnet_b2_640_cl = _timm_entry("h7_timm_efficientnet_b2_640_cl", "efficientnet_b2", 16, "bf16",
                                             adamw(1e-3, 1e-5), size=640, channels_last=True)


# --- transformers -------------------------------------------------------------------------------------------------

h7_hf_resnet50_fp32 = Workload(
    name="h7_hf_resnet50_fp32", description="Hugging Face ResNet (ResNetConfig's default: ResNet-50's shape), "
    "224x224, fp32",
    model=_hf("ResNetForImageClassification", "ResNetConfig", num_labels=1000),
    batch=images(224), forward=lambda m, b: m(pixel_values=b[0]), loss=logits_ce, optimizer=sgd(nesterov=False),
    batch_size=64, precision="fp32", tags=("transformers", HOLDOUT7, "cnn", "vision"),
)
h7_hf_regnet_fp32 = Workload(
    name="h7_hf_regnet_fp32", description="Hugging Face RegNet (RegNetConfig's default), 224x224, fp32",
    model=_hf("RegNetForImageClassification", "RegNetConfig", num_labels=1000),
    batch=images(224), forward=lambda m, b: m(pixel_values=b[0]), loss=logits_ce, optimizer=adamw(1e-3, 0.05),
    batch_size=64, precision="fp32", tags=("transformers", HOLDOUT7, "cnn", "vision"),
)


# --- smp, MONAI ---------------------------------------------------------------------------------------------------

def _smp(name: str, arch: str, encoder: str, classes: int, size: int, batch_size: int, precision: str,
         optimizer: Any, *, channels_last: bool = False) -> Workload:
    layout = ("channels_last",) if channels_last else ()
    return Workload(
        name=name, description=", ".join((f"smp {arch}({encoder}), {classes} classes, {size}x{size}", precision,
                                          *layout)),
        model=smp_model(arch, encoder, classes=classes),
        batch=lambda n: (torch.randn(n, 3, size, size), torch.randint(0, classes, (n, size, size))), loss=ce,
        optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        channels_last=channels_last,
        tags=("segmentation_models_pytorch", HOLDOUT7, "cnn", "segmentation", *layout),
    )


h7_smp_unet_r50_fp32 = _smp("h7_smp_unet_r50_fp32", "Unet", "resnet50", 3, 512, 8, "fp32", _adam())
h7_smp_linknet_r34_fp32 = _smp("h7_smp_linknet_r34_fp32", "Linknet", "resnet34", 5, 512, 16, "fp32", _adam())
h7_smp_deeplabv3_r50_1024_cl = _smp("h7_smp_deeplabv3_r50_1024_cl", "DeepLabV3", "resnet50", 19, 1024, 2, "bf16",
                                    adamw(1e-4, 1e-4), channels_last=True)
h7_monai_resnet18_3d_fp32 = Workload(
    name="h7_monai_resnet18_3d_fp32", description="MONAI resnet18 (3-D, shortcut type B: strided 1x1x1 "
    "projections), 1-channel 96^3 volumes, 2 classes, fp32",
    model=monai_net("resnet18", spatial_dims=3, n_input_channels=1, num_classes=2, shortcut_type="B"),
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 2, (n,))), loss=ce,
    optimizer=_adam(1e-4), batch_size=8, precision="fp32", tags=("monai", HOLDOUT7, "cnn", "3d"),
)


# --- plain torch ----------------------------------------------------------------------------------------------------

class _Block(nn.Module):
    """A CIFAR ResNet basic block; where the width or the stride changes, a projection shortcut (a strided 1x1
    convolution and batch norm, the paper's option B)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                                  nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class _CifarResNet(nn.Module):
    """ResNet-56 for 32x32 images: three stages of nine blocks at 16, 32 and 64 channels."""

    def __init__(self, blocks: int = 9, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
        cin = 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


h7_torch_cifar_resnet56 = Workload(
    name="h7_torch_cifar_resnet56", description="hand-written CIFAR ResNet-56 (projection shortcuts), 32x32, "
    "10 classes, fp32",
    model=_CifarResNet, batch=images(32, classes=10), loss=ce,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4), batch_size=512,
    precision="fp32", tags=(HOLDOUT7, "cnn"),
)
