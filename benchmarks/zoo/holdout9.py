"""A ninth fresh draw of real training steps, written down on 2026-11-29 (session 35) *before* memfit estimated or
measured any of them.

memfit is also for people training on huge satellite and aerial tiles. This draw is of such steps only, at sizes no
earlier set had (1024² to 4096² per tile) and with the band counts those images have (4 for RGB + near-infrared, 12-13
for Sentinel-2): segmentation_models_pytorch's U-Net, U-Net++, LinkNet, FPN, DeepLabV3+ and SegFormer; Hugging Face's
SegFormer; torchvision's DeepLabV3; a scene classifier (timm's ConvNeXt-T on 1024² tiles); and a hand-written siamese
change-detection U-Net on two dates of one tile. fp16 and bf16 as such jobs train, some channels-last, two in fp32.
They are reported on their own (tag ``holdout9``): nothing was fitted on them, and any fix made after seeing one is
said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, loss) at a batch one GPU trains; nothing here
is resized after a prediction is seen. Each ran one eager training step on the CPU before being committed: at batch 1;
the two DeepLabs at batch 2 over 1024² tiles (their pooled branch's batch norm refuses a batch of one, and the
2-core VM's 24 GiB do not hold a 2048² step in fp32); the LinkNet over one 2048² tile (the same, at 4096²).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import adamw, ce, double_conv, encoder, hf_model, timm_model  # noqa: E402
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout9"
HOLDOUT9 = "holdout9"


def _tiles(size: int, bands: int, classes: int) -> Any:
    """``n -> (n tiles of bands x size x size, int64 labels (n, size, size))``."""
    return lambda n: (torch.randn(n, bands, size, size), torch.randint(0, classes, (n, size, size)))


# --- segmentation_models_pytorch -------------------------------------------------------------------------------------

def _smp_net(arch: str, encoder: str, bands: int, classes: int, **kwargs: Any) -> Any:
    def build() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder, encoder_weights=None, in_channels=bands, classes=classes, **kwargs)

    return build


def _adam(lr: float = 1e-4) -> Any:
    return lambda p: torch.optim.Adam(p, lr=lr)


def _smp(name: str, arch: str, encoder: str, bands: int, classes: int, size: int, batch_size: int, precision: str,
         optimizer: Any, *, channels_last: bool = False) -> Workload:
    layout = ("channels_last",) if channels_last else ()
    return Workload(
        name=name, description=", ".join((f"smp {arch}({encoder}), {bands} bands, {classes} classes, "
                                          f"{size}x{size} tiles", precision, *layout)),
        model=_smp_net(arch, encoder, bands, classes), batch=_tiles(size, bands, classes), loss=ce,
        optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        channels_last=channels_last,
        tags=("segmentation_models_pytorch", HOLDOUT9, "cnn", "segmentation", "satellite", *layout),
    )


h9_smp_unet_r34_s2_2048_fp16 = _smp("h9_smp_unet_r34_s2_2048_fp16", "Unet", "resnet34", 13, 10, 2048, 4, "fp16",
                                    _adam())
h9_smp_unetpp_r34_1536_fp16 = _smp("h9_smp_unetpp_r34_1536_fp16", "UnetPlusPlus", "resnet34", 4, 6, 1536, 2, "fp16",
                                   _adam())
h9_smp_linknet_r18_4096_fp16 = _smp("h9_smp_linknet_r18_4096_fp16", "Linknet", "resnet18", 4, 2, 4096, 1, "fp16",
                                    _adam(3e-4))
h9_smp_fpn_rx50_2560_bf16 = _smp("h9_smp_fpn_rx50_2560_bf16", "FPN", "resnext50_32x4d", 3, 8, 2560, 2, "bf16",
                                 adamw(1e-4, 1e-4))
h9_smp_deeplabv3p_r50_2048_cl = _smp("h9_smp_deeplabv3p_r50_2048_cl", "DeepLabV3Plus", "resnet50", 4, 6, 2048, 4,
                                     "bf16", adamw(1e-4, 1e-4), channels_last=True)
h9_smp_segformer_b2_1024_bf16 = _smp("h9_smp_segformer_b2_1024_bf16", "Segformer", "mit_b2", 3, 7, 1024, 8, "bf16",
                                     adamw(6e-5, 0.01))
h9_smp_unet_r50_s2_1024_fp32_cl = _smp("h9_smp_unet_r50_s2_1024_fp32_cl", "Unet", "resnet50", 12, 11, 1024, 8, "fp32",
                                       _adam(), channels_last=True)


# --- Hugging Face, torchvision, timm -------------------------------------------------------------------------------

def _segformer_loss(out: Any, batch: Any) -> torch.Tensor:
    # SegFormer predicts at a quarter of the tile; the logits are upsampled to the labels, as transformers' own loss does
    logits = F.interpolate(out.logits, size=batch[1].shape[-2:], mode="bilinear", align_corners=False)
    return F.cross_entropy(logits, batch[1], ignore_index=255)


h9_hf_segformer_b2_1024_bf16 = Workload(
    name="h9_hf_segformer_b2_1024_bf16", description="Hugging Face SegFormer (MiT-b2 sizes), 6 classes, 1024x1024 "
    "tiles, bf16",
    model=hf_model("SegformerForSemanticSegmentation", "SegformerConfig", num_labels=6, depths=[3, 4, 6, 3],
                   hidden_sizes=[64, 128, 320, 512], decoder_hidden_size=768),
    batch=_tiles(1024, 3, 6), forward=lambda m, b: m(pixel_values=b[0]), loss=_segformer_loss,
    optimizer=adamw(6e-5, 0.01), batch_size=8, precision="bf16",
    tags=("transformers", HOLDOUT9, "transformer", "segmentation", "satellite"),
)
h9_tv_deeplabv3_r50_2048_fp16 = Workload(
    name="h9_tv_deeplabv3_r50_2048_fp16", description="torchvision deeplabv3_resnet50 (output stride 8), 5 classes, "
    "2048x2048 tiles, fp16",
    model=_tv("deeplabv3_resnet50", weights_backbone=None, num_classes=5),
    batch=_tiles(2048, 3, 5), loss=lambda out, b: F.cross_entropy(out["out"], b[1]),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4), batch_size=2,
    precision="fp16", tags=("torchvision", HOLDOUT9, "cnn", "segmentation", "satellite"),
)
h9_timm_convnext_t_1024_bf16 = Workload(
    name="h9_timm_convnext_t_1024_bf16", description="timm convnext_tiny scene classifier, 1024x1024 tiles, "
    "45 classes, bf16",
    model=timm_model("convnext_tiny", num_classes=45),
    batch=lambda n: (torch.randn(n, 3, 1024, 1024), torch.randint(0, 45, (n,))), loss=ce,
    optimizer=adamw(1e-3, 0.05), batch_size=16, precision="bf16",
    tags=("timm", HOLDOUT9, "cnn", "classification", "satellite"),
)


# --- plain torch ---------------------------------------------------------------------------------------------------

class _SiameseChangeUNet(nn.Module):
    """Change detection on two dates of one tile (FC-Siam-diff): one encoder for both dates, the absolute difference
    of their features at each level as the decoder's skip connections, bilinear upsampling."""

    def __init__(self, bands: int = 4, widths: tuple[int, ...] = (32, 64, 128, 256)) -> None:
        super().__init__()
        self.enc = encoder(bands, widths)
        self.dec = nn.ModuleList(double_conv(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(len(widths) - 1)))
        self.head = nn.Conv2d(widths[0], 2, 1)

    def _encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = []
        for i, stage in enumerate(self.enc):
            x = stage(x if i == 0 else F.max_pool2d(x, 2))
            feats.append(x)
        return feats

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        before, after = pair.chunk(2, dim=1)
        diffs = [(a - b).abs() for a, b in zip(self._encode(before), self._encode(after))]
        x = diffs[-1]
        for dec, skip in zip(self.dec, reversed(diffs[:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = dec(torch.cat([x, skip], dim=1))
        return self.head(x)


h9_torch_siamese_change_1024_fp32 = Workload(
    name="h9_torch_siamese_change_1024_fp32", description="hand-written siamese change-detection U-Net (FC-Siam-diff), "
    "two dates of 4 bands, 1024x1024 tiles, fp32",
    model=_SiameseChangeUNet, batch=_tiles(1024, 8, 2), loss=ce, optimizer=_adam(1e-3), batch_size=8,
    precision="fp32", tags=(HOLDOUT9, "cnn", "segmentation", "satellite"),
)
