"""An eighth fresh draw of real training steps, written down on 2026-11-29 (session 35) *before* memfit estimated or
measured any of them.

memfit is for people whose 3-D volumes do not fit: nnU-Net, MONAI and hand-written 3-D networks. This draw is of
such steps only, at shapes no earlier set had: nnU-Net's plain and residual-encoder U-Nets (dynamic_network_architectures)
at anisotropic patches (64x192x160, 96x160x128), at 128^3 and at 160^3 with one volume, and a 2-D one at 896x768, in
fp16 as nnU-Net trains (one in bf16); MONAI's Swin-UNETR v2, DynUNet with anisotropic kernels and strides and deep
supervision, SegResNet at 224x224x144, UNet trained channels-last (``channels_last_3d``), BasicUNet++ with deep
supervision in fp32, UNETR at 128^3 and LocalNet registering two volumes; torchvision's R(2+1)D-18 and MViT-v2-S on
video clips; and a hand-written 3-D U-Net with transposed convolutions in fp32. They are reported on their own (tag
``holdout8``): nothing was fitted on them, and any fix made after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, loss) at a batch one GPU trains; nothing here
is resized after a prediction is seen. Each ran one eager training step on the CPU (at batch 1) before being
committed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from monai_models import _DICE_CE, _adamw, _dynunet_loss  # noqa: E402
from nnunet_models import _ds_loss, _nnunet_sgd, _unet  # noqa: E402
from recipes import adamw, ce, double_conv, monai_loss, monai_net, volumes  # noqa: E402
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout8"
HOLDOUT8 = "holdout8"


# --- nnU-Net's networks (dynamic_network_architectures) --------------------------------------------------------------

def _nnunet(name: str, residual: bool, dims: int, features: list[int], classes: int, patch: tuple[int, ...],
            batch_size: int, precision: str = "fp16", in_ch: int = 1) -> Workload:
    return Workload(
        name=name, description=f"nnU-Net {'ResEnc' if residual else 'Plain'} {dims}-D, {classes} classes, patch "
        f"{'x'.join(map(str, patch))}, deep supervision, {precision}",
        model=_unet(residual, dims, features, classes, in_ch), batch=volumes(patch, classes, channels=in_ch),
        loss=_ds_loss, optimizer=_nnunet_sgd, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        tags=("dynamic_network_architectures", HOLDOUT8, "cnn", "segmentation", f"{dims}d", "deep_supervision"),
    )


_FEATURES_3D = [32, 64, 128, 256, 320, 320]
h8_nnunet_plain_3d_64x192x160 = _nnunet("h8_nnunet_plain_3d_64x192x160", False, 3, _FEATURES_3D, 3, (64, 192, 160), 2)
h8_nnunet_plain_3d_96x160x128_bf16 = _nnunet("h8_nnunet_plain_3d_96x160x128_bf16", False, 3, _FEATURES_3D, 2,
                                             (96, 160, 128), 2, precision="bf16")
h8_nnunet_resenc_3d_128 = _nnunet("h8_nnunet_resenc_3d_128", True, 3, _FEATURES_3D, 4, (128, 128, 128), 2)
h8_nnunet_resenc_3d_160_b1 = _nnunet("h8_nnunet_resenc_3d_160_b1", True, 3, _FEATURES_3D, 3, (160, 160, 160), 1)
h8_nnunet_plain_2d_896x768 = _nnunet("h8_nnunet_plain_2d_896x768", False, 2, [32, 64, 128, 256, 512, 512, 512], 4,
                                     (896, 768), 6)


# --- MONAI -------------------------------------------------------------------------------------------------------------

_MONAI = ("monai", HOLDOUT8, "segmentation", "3d")


h8_monai_swin_unetr_v2_bf16 = Workload(
    name="h8_monai_swin_unetr_v2_bf16", description="SwinUNETR v2 (feature_size 24), 14 organs, 128^3, DiceCELoss, "
    "bf16",
    model=monai_net("SwinUNETR", in_channels=1, out_channels=14, feature_size=24, use_v2=True),
    batch=volumes((128, 128, 128), 14, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=1,
    precision="bf16", tags=(*_MONAI, "transformer"),
)


def _dynunet_aniso() -> nn.Module:
    from monai.networks.nets import DynUNet

    return DynUNet(spatial_dims=3, in_channels=1, out_channels=4,
                   kernel_size=[[3, 3, 1], [3, 3, 3], [3, 3, 3], [3, 3, 3], [3, 3, 3]],
                   strides=[[1, 1, 1], [2, 2, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]],
                   upsample_kernel_size=[[2, 2, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]], norm_name="instance",
                   deep_supervision=True, deep_supr_num=2, res_block=True)


h8_monai_dynunet_aniso_fp16 = Workload(
    name="h8_monai_dynunet_aniso_fp16", description="DynUNet, anisotropic kernels and strides (in-plane first), "
    "residual blocks, deep supervision x2, 192x192x48, fp16",
    model=_dynunet_aniso, batch=volumes((192, 192, 48), 4, label_channel=True), loss=_dynunet_loss,
    optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5), batch_size=2,
    precision="fp16", tags=(*_MONAI, "cnn", "deep_supervision"),
)
h8_monai_segresnet_224x224x144_fp16 = Workload(
    name="h8_monai_segresnet_224x224x144_fp16", description="SegResNet (init_filters 32), 4 modalities, 3 classes, "
    "224x224x144, DiceFocalLoss, fp16",
    model=monai_net("SegResNet", spatial_dims=3, in_channels=4, out_channels=3, init_filters=32,
                    blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), dropout_prob=0.2),
    batch=volumes((224, 224, 144), 3, channels=4, label_channel=True),
    loss=monai_loss("DiceFocalLoss", to_onehot_y=True, softmax=True), optimizer=_adamw, batch_size=1,
    precision="fp16", tags=(*_MONAI, "cnn"),
)
h8_monai_unet_cl3d_bf16 = Workload(
    name="h8_monai_unet_cl3d_bf16", description="MONAI UNet 3-D (32-512 channels, 2 residual units, instance norm), "
    "5 classes, 128^3, DiceCELoss, bf16, channels_last_3d",
    model=monai_net("UNet", spatial_dims=3, in_channels=1, out_channels=5, channels=(32, 64, 128, 256, 512),
                    strides=(2, 2, 2, 2), num_res_units=2, norm="instance"),
    batch=volumes((128, 128, 128), 5, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=2,
    precision="bf16", channels_last=True, tags=(*_MONAI, "cnn", "channels_last"),
)
h8_monai_basicunetpp_ds_fp32 = Workload(
    name="h8_monai_basicunetpp_ds_fp32", description="BasicUNetPlusPlus 3-D, deep supervision (4 heads), 3 classes, "
    "96^3, DiceCELoss, fp32",
    model=monai_net("BasicUNetPlusPlus", spatial_dims=3, in_channels=1, out_channels=3, deep_supervision=True),
    batch=volumes((96, 96, 96), 3, label_channel=True),
    loss=monai_loss("DiceCELoss", deep_supervision=True, to_onehot_y=True, softmax=True), optimizer=_adamw,
    batch_size=1, precision="fp32", tags=(*_MONAI, "cnn", "deep_supervision"),
)
h8_monai_unetr_128_fp16 = Workload(
    name="h8_monai_unetr_128_fp16", description="UNETR (ViT-B encoder, 16^3 patches: 512 tokens), 8 classes, 128^3, "
    "DiceCELoss, fp16",
    model=monai_net("UNETR", in_channels=1, out_channels=8, img_size=(128, 128, 128), feature_size=16),
    batch=volumes((128, 128, 128), 8, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=1,
    precision="fp16", tags=(*_MONAI, "transformer"),
)


class _Registration(nn.Module):
    """MONAI's LocalNet predicting a dense displacement field from a moving and a fixed volume, and the moving volume
    warped by it (MONAI's registration tutorials)."""

    def __init__(self) -> None:
        super().__init__()
        from monai.networks.blocks import Warp
        from monai.networks.nets import LocalNet

        self.net = LocalNet(spatial_dims=3, in_channels=2, out_channels=3, num_channel_initial=32,
                            extract_levels=(0, 1, 2, 3))
        self.warp = Warp(mode="bilinear", padding_mode="border")

    def forward(self, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ddf = self.net(pair)
        return self.warp(pair[:, :1], ddf), ddf


def _registration_loss(out: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
    from monai.losses import BendingEnergyLoss

    warped, ddf = out
    return F.mse_loss(warped, batch[1]) + 0.5 * BendingEnergyLoss()(ddf)


def _volume_pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pair = torch.randn(n, 2, 128, 128, 128)
    return pair, pair[:, 1:].clone()


h8_monai_localnet_registration_fp32 = Workload(
    name="h8_monai_localnet_registration_fp32", description="MONAI LocalNet + Warp, moving/fixed 128^3 pairs, MSE + "
    "bending energy, fp32",
    model=_Registration, batch=_volume_pairs, loss=_registration_loss, optimizer=lambda p: torch.optim.Adam(p, 1e-4),
    batch_size=2, precision="fp32", tags=("monai", HOLDOUT8, "registration", "3d", "cnn"),
)


# --- torchvision video ---------------------------------------------------------------------------------------------

h8_tv_r2plus1d_18_fp16 = Workload(
    name="h8_tv_r2plus1d_18_fp16", description="torchvision r2plus1d_18, 16 frames of 112x112, 400 classes, fp16",
    model=_tv("r2plus1d_18", num_classes=400),
    batch=lambda n: (torch.randn(n, 3, 16, 112, 112), torch.randint(0, 400, (n,))), loss=ce,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4), batch_size=16,
    precision="fp16", tags=("torchvision", HOLDOUT8, "cnn", "video", "3d"),
)
h8_tv_mvit_v2_s_bf16 = Workload(
    name="h8_tv_mvit_v2_s_bf16", description="torchvision mvit_v2_s (multiscale video transformer), 16 frames of "
    "224x224, 400 classes, bf16",
    model=_tv("mvit_v2_s", num_classes=400),
    batch=lambda n: (torch.randn(n, 3, 16, 224, 224), torch.randint(0, 400, (n,))), loss=ce,
    optimizer=adamw(1e-4, 0.05), batch_size=4, precision="bf16", tags=("torchvision", HOLDOUT8, "video", "3d",
                                                                          "transformer"),
)


# --- plain torch ---------------------------------------------------------------------------------------------------

class _UNet3d(nn.Module):
    """A 3-D U-Net (Çiçek et al.): four levels of two 3x3x3 convolutions with batch norm, max-pool down, transposed
    2x2x2 convolutions up, skip connections concatenated."""

    def __init__(self, cin: int = 1, classes: int = 3, base: int = 32) -> None:
        super().__init__()
        widths = [base, base * 2, base * 4, base * 8]
        self.down = nn.ModuleList()
        c = cin
        for w in widths:
            self.down.append(double_conv(c, w, dims=3))
            c = w
        self.bottom = double_conv(widths[-1], widths[-1] * 2, dims=3)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        c = widths[-1] * 2
        for w in reversed(widths):
            self.up.append(nn.ConvTranspose3d(c, w, 2, stride=2))
            self.dec.append(double_conv(2 * w, w, dims=3))
            c = w
        self.head = nn.Conv3d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool3d(x, 2)
        x = self.bottom(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


h8_torch_unet3d_fp32 = Workload(
    name="h8_torch_unet3d_fp32", description="hand-written 3-D U-Net (32-512 channels, transposed convolutions), "
    "3 classes, 112^3, fp32",
    model=_UNet3d, batch=volumes((112, 112, 112), 3), loss=ce,
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), batch_size=2, precision="fp32",
    tags=(HOLDOUT8, "cnn", "segmentation", "3d"),
)
