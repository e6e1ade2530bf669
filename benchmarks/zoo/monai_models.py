"""MONAI networks trained with MONAI's own losses (DiceLoss / DiceCELoss / DiceFocalLoss with ``to_onehot_y``
and ``softmax``), 3-D and 2-D. Includes issue 13's Swin-UNETR case (bf16, AdamW, 2 x 1 x 96^3, cross-entropy).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce, volumes  # noqa: E402
from recipes import monai_loss as _monai_loss
from recipes import monai_net as _net

from memfit import Workload  # noqa: E402

LIBRARY = "monai"


def _adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=1e-4, weight_decay=1e-5)


_DICE_CE = _monai_loss("DiceCELoss", to_onehot_y=True, softmax=True)
_TAGS = ("monai", "segmentation")

# issue 13: predicted 7-18 % off
monai_swin_unetr_issue13 = Workload(
    name="monai_swin_unetr_issue13", description="SwinUNETR feature_size 48, 14 organs (BTCV), 96^3, bf16",
    model=_net("SwinUNETR", in_channels=1, out_channels=14, feature_size=48), batch=volumes((96, 96, 96), 14),
    loss=ce, optimizer=_adamw, batch_size=2, precision="bf16", tags=(*_TAGS, "transformer", "3d", "issue13"),
)
monai_swin_unetr_dicece = monai_swin_unetr_issue13.replace(
    name="monai_swin_unetr_dicece", description="SwinUNETR, DiceCELoss(to_onehot_y, softmax), 96^3, fp16",
    batch=volumes((96, 96, 96), 14, label_channel=True), loss=_DICE_CE, precision="fp16", batch_size=1,
    tags=(*_TAGS, "transformer", "3d"),
)
monai_unet3d_dicece = Workload(
    name="monai_unet3d_dicece", description="MONAI UNet 3-D, 2 residual units, DiceCELoss, 128^3",
    model=_net("UNet", spatial_dims=3, in_channels=1, out_channels=3, channels=(16, 32, 64, 128, 256),
               strides=(2, 2, 2, 2), num_res_units=2, norm="batch"),
    batch=volumes((128, 128, 128), 3, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=2,
    precision="fp32", tags=(*_TAGS, "cnn", "3d"),
)
monai_segresnet_dice = Workload(
    name="monai_segresnet_dice", description="SegResNet (BraTS), 4 modalities, 3 classes, DiceLoss, 128^3",
    model=_net("SegResNet", spatial_dims=3, in_channels=4, out_channels=3, init_filters=16,
               blocks_down=(1, 2, 2, 4), blocks_up=(1, 1, 1), dropout_prob=0.2),
    batch=volumes((128, 128, 128), 3, channels=4, label_channel=True),
    loss=_monai_loss("DiceLoss", to_onehot_y=True, softmax=True), optimizer=_adamw, batch_size=1,
    precision="bf16", tags=(*_TAGS, "cnn", "3d"),
)
monai_unetr = Workload(
    name="monai_unetr", description="UNETR (ViT-B encoder), 14 classes, 96^3, DiceCELoss",
    model=_net("UNETR", in_channels=1, out_channels=14, img_size=(96, 96, 96), feature_size=16),
    batch=volumes((96, 96, 96), 14, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=2,
    precision="bf16", tags=(*_TAGS, "transformer", "3d"),
)
monai_basicunet_2d = Workload(
    name="monai_basicunet_2d", description="BasicUNet 2-D, 5 classes, 512x512, DiceFocalLoss",
    model=_net("BasicUNet", spatial_dims=2, in_channels=3, out_channels=5),
    batch=volumes((512, 512), 5, channels=3, label_channel=True),
    loss=_monai_loss("DiceFocalLoss", to_onehot_y=True, softmax=True), optimizer=_adamw, batch_size=8,
    precision="fp16", tags=(*_TAGS, "cnn", "2d"),
)
monai_attention_unet = Workload(
    name="monai_attention_unet", description="AttentionUnet 3-D, 2 classes, 96^3, DiceCELoss",
    model=_net("AttentionUnet", spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128),
               strides=(2, 2, 2)),
    batch=volumes((96, 96, 96), 2, label_channel=True), loss=_DICE_CE, optimizer=_adamw, batch_size=2,
    precision="fp32", tags=(*_TAGS, "cnn", "3d", "attention_gate"),
)


def _dynunet() -> torch.nn.Module:
    from monai.networks.nets import DynUNet

    return DynUNet(spatial_dims=3, in_channels=1, out_channels=3, kernel_size=[3, 3, 3, 3, 3],
                   strides=[1, 2, 2, 2, 2], upsample_kernel_size=[2, 2, 2, 2], deep_supervision=True,
                   deep_supr_num=2, res_block=True)


def _dynunet_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    # DynUNet stacks the full-resolution output and the upsampled deep-supervision heads along dim 1
    loss = _DICE_CE(out[:, 0], batch)
    for i in range(1, out.shape[1]):
        loss = loss + 0.5**i * _DICE_CE(out[:, i], batch)
    return loss


monai_dynunet_ds = Workload(
    name="monai_dynunet_ds", description="DynUNet (nnU-Net-like), residual, deep supervision x2, 128^3",
    model=_dynunet, batch=volumes((128, 128, 128), 3, label_channel=True), loss=_dynunet_loss,
    optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True), batch_size=2,
    precision="fp16", tags=(*_TAGS, "cnn", "3d", "deep_supervision"),
)
monai_densenet121_3d = Workload(
    name="monai_densenet121_3d", description="DenseNet121 3-D classifier, 2 classes, 96^3",
    model=_net("DenseNet121", spatial_dims=3, in_channels=1, out_channels=2),
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 2, (n,))), loss=ce, optimizer=_adamw,
    batch_size=4, precision="fp32", tags=("monai", "classification", "cnn", "3d"),
)
