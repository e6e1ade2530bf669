"""A tenth fresh draw of real training steps, written down on 2026-11-30 (session 36) *before* memfit estimated or
measured any of them.

Decoders that upsample: the segmentation networks people train on large images whose backward runs CUDA's upsampling
kernels (nearest, bilinear, trilinear) on gradients that are *not* a concatenation's slices — FPN's and PAN's
pyramids summed after upsampling, PSPNet's and DeepLabV3's final resize, MAnet, a U-Net whose last decoder block has no
skip, torchvision's FCN and LR-ASPP, MONAI's FlexibleUNet and SegResNet, HF UperNet, and a hand-written U-Net with
additive skips. Session 36 found that memfit charges such a backward a block the size of its gradient that the GPU
does not take (the ninth draw's U-Net at 2048², ``benchmarks/results/estimate/op_blocks_*_s36``); this draw was
written to test a change to that rule on steps that tuned nothing, predicted by the code before and after the change,
both committed before the one GPU call that measures them. Reported on its own (tag ``holdout10``).

Each builder follows its library's usual recipe (optimizer, precision, loss) at a batch one GPU trains; nothing here is
resized after a prediction is seen. Each ran one eager training step on the CPU before being committed: at batch 1;
at batch 2 for the four whose pooled branch's batch norm refuses a batch of one (PAN, DeepLabV3 and both UperNets);
the fp16 steps under bf16 autocast, but FPN, which ran in fp16 (585 s: the CPU's fp16 convolutions are slow).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import adamw, ce, double_conv, encoder, hf_model, monai_loss, monai_net, volumes  # noqa: E402
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout10"
HOLDOUT10 = "holdout10"


def _tiles(size: int, bands: int, classes: int) -> Any:
    """``n -> (n images of bands x size x size, int64 labels (n, size, size))``."""
    return lambda n: (torch.randn(n, bands, size, size), torch.randint(0, classes, (n, size, size)))


def _adam(lr: float = 1e-4) -> Any:
    return lambda p: torch.optim.Adam(p, lr=lr)


def _sgd(lr: float = 0.01) -> Any:
    return lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=1e-4)


# --- segmentation_models_pytorch -------------------------------------------------------------------------------------

def _smp_net(arch: str, encoder: str, bands: int, classes: int) -> Any:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder, encoder_weights=None, in_channels=bands, classes=classes)

    return build


def _smp(name: str, arch: str, encoder: str, bands: int, classes: int, size: int, batch_size: int, precision: str,
         optimizer: Any) -> Workload:
    return Workload(
        name=name, description=f"smp {arch}({encoder}), {bands} bands, {classes} classes, {size}x{size}, {precision}",
        model=_smp_net(arch, encoder, bands, classes), batch=_tiles(size, bands, classes), loss=ce,
        optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("segmentation_models_pytorch", HOLDOUT10, "cnn", "segmentation"),
    )


h10_smp_fpn_r34_1024_fp16 = _smp("h10_smp_fpn_r34_1024_fp16", "FPN", "resnet34", 3, 6, 1024, 8, "fp16", _adam())
h10_smp_pspnet_r50_1536_bf16 = _smp("h10_smp_pspnet_r50_1536_bf16", "PSPNet", "resnet50", 4, 9, 1536, 8, "bf16",
                                    adamw(1e-4, 1e-4))
h10_smp_pan_r34_1024_fp16 = _smp("h10_smp_pan_r34_1024_fp16", "PAN", "resnet34", 3, 5, 1024, 8, "fp16", _adam())
h10_smp_manet_r34_1024_fp16 = _smp("h10_smp_manet_r34_1024_fp16", "MAnet", "resnet34", 3, 4, 1024, 4, "fp16",
                                   _adam())
h10_smp_deeplabv3_r34_1024_fp32 = _smp("h10_smp_deeplabv3_r34_1024_fp32", "DeepLabV3", "resnet34", 3, 7, 1024, 4,
                                       "fp32", _sgd())
h10_smp_unet_r18_2048_bf16 = _smp("h10_smp_unet_r18_2048_bf16", "Unet", "resnet18", 4, 3, 2048, 2, "bf16",
                                  adamw(1e-4, 1e-4))
h10_smp_upernet_r50_1024_bf16 = _smp("h10_smp_upernet_r50_1024_bf16", "UPerNet", "resnet50", 3, 12, 1024, 4, "bf16",
                                     adamw(1e-4, 0.01))


# --- torchvision, Hugging Face -------------------------------------------------------------------------------------

h10_tv_fcn_r50_1024_fp16 = Workload(
    name="h10_tv_fcn_r50_1024_fp16", description="torchvision fcn_resnet50, 21 classes, 1024x1024, fp16",
    model=_tv("fcn_resnet50", weights_backbone=None, num_classes=21),
    batch=_tiles(1024, 3, 21), loss=lambda out, b: F.cross_entropy(out["out"], b[1]),
    optimizer=_sgd(), batch_size=4, precision="fp16", tags=("torchvision", HOLDOUT10, "cnn", "segmentation"),
)
h10_tv_lraspp_mnv3_2048_fp16 = Workload(
    name="h10_tv_lraspp_mnv3_2048_fp16", description="torchvision lraspp_mobilenet_v3_large, 4 classes, 2048x2048, "
    "fp16",
    model=_tv("lraspp_mobilenet_v3_large", weights_backbone=None, num_classes=4),
    batch=_tiles(2048, 3, 4), loss=lambda out, b: F.cross_entropy(out["out"], b[1]),
    optimizer=_sgd(), batch_size=4, precision="fp16", tags=("torchvision", HOLDOUT10, "cnn", "segmentation"),
)


def _upernet_loss(out: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out.logits, batch[1])


h10_hf_upernet_convnext_t_768_bf16 = Workload(
    name="h10_hf_upernet_convnext_t_768_bf16", description="Hugging Face UperNet with a ConvNeXt-T backbone, 19 classes, "
    "768x768, bf16",
    model=hf_model("UperNetForSemanticSegmentation", "UperNetConfig", num_labels=19, use_auxiliary_head=False,
                   backbone_config={"model_type": "convnext", "depths": [3, 3, 9, 3],
                                    "hidden_sizes": [96, 192, 384, 768],
                                    "out_features": ["stage1", "stage2", "stage3", "stage4"]}),
    batch=_tiles(768, 3, 19), forward=lambda m, b: m(pixel_values=b[0]), loss=_upernet_loss,
    optimizer=adamw(6e-5, 0.01), batch_size=8, precision="bf16",
    tags=("transformers", HOLDOUT10, "cnn", "segmentation"),
)


# --- MONAI ---------------------------------------------------------------------------------------------------------

_DICE_CE = monai_loss("DiceCELoss", to_onehot_y=True, softmax=True)

h10_monai_flexunet_r34_1024_fp16 = Workload(
    name="h10_monai_flexunet_r34_1024_fp16", description="MONAI FlexibleUNet (ResNet-34 encoder, nearest upsampling), "
    "2-D, 3 classes, 1024x1024, DiceCELoss, fp16",
    model=monai_net("FlexibleUNet", in_channels=1, out_channels=3, backbone="resnet34", spatial_dims=2),
    batch=volumes((1024, 1024), 3, label_channel=True), loss=_DICE_CE, optimizer=_adam(1e-4), batch_size=8,
    precision="fp16", tags=("monai", HOLDOUT10, "cnn", "segmentation", "medical"),
)
h10_monai_segresnet_nontrainable_160_bf16 = Workload(
    name="h10_monai_segresnet_nontrainable_160_bf16", description="MONAI SegResNet (trilinear upsampling), 4 input "
    "channels, 3 classes, 160^3, DiceCELoss, bf16",
    model=monai_net("SegResNet", spatial_dims=3, in_channels=4, out_channels=3, init_filters=16,
                    upsample_mode="nontrainable"),
    batch=volumes((160, 160, 160), 3, channels=4, label_channel=True), loss=_DICE_CE, optimizer=adamw(1e-4, 1e-5),
    batch_size=2, precision="bf16", tags=("monai", HOLDOUT10, "cnn", "segmentation", "medical", "3d"),
)


# --- plain torch ---------------------------------------------------------------------------------------------------

class _AdditiveUNet(nn.Module):
    """A U-Net whose skips are added, not concatenated (as in LinkNet-style and residual U-Nets): each decoder stage
    upsamples by nearest neighbour, adds the encoder's features and refines them."""

    def __init__(self, bands: int = 3, classes: int = 2, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        self.enc = encoder(bands, widths)
        self.lateral = nn.ModuleList(nn.Conv2d(widths[i + 1], widths[i], 1) for i in range(len(widths) - 1))
        self.dec = nn.ModuleList(double_conv(widths[i], widths[i]) for i in range(len(widths) - 1))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = []
        for i, stage in enumerate(self.enc):
            x = stage(x if i == 0 else F.max_pool2d(x, 2))
            feats.append(x)
        for i in reversed(range(len(self.dec))):
            x = F.interpolate(self.lateral[i](x), scale_factor=2, mode="nearest") + feats[i]
            x = self.dec[i](x)
        return self.head(x)


h10_torch_additive_unet_2048_bf16 = Workload(
    name="h10_torch_additive_unet_2048_bf16", description="hand-written U-Net with additive skips and nearest "
    "upsampling, 3 bands, 2 classes, 2048x2048, bf16",
    model=_AdditiveUNet, batch=_tiles(2048, 3, 2), loss=ce, optimizer=_adam(1e-3), batch_size=4, precision="bf16",
    tags=(HOLDOUT10, "cnn", "segmentation"),
)
