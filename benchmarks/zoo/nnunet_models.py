"""nnU-Net's networks (dynamic_network_architectures): PlainConvUNet and ResidualEncoderUNet, 2-D and 3-D, with
deep supervision and nnU-Net's loss (CE + Dice at every scale, weights halving, lowest scale dropped).
Configurations as nnU-Net plans them for a typical dataset.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import volumes  # noqa: E402

from memfit import Workload  # noqa: E402
from memfit.workload.models import deep_supervision_loss  # noqa: E402

LIBRARY = "dynamic_network_architectures"


def _unet(residual: bool, dims: int, features: list[int], classes: int, in_ch: int = 1) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from dynamic_network_architectures.architectures import unet

        n = len(features)
        conv, norm = (nn.Conv3d, nn.InstanceNorm3d) if dims == 3 else (nn.Conv2d, nn.InstanceNorm2d)
        common: dict[str, Any] = dict(
            input_channels=in_ch, n_stages=n, features_per_stage=features, conv_op=conv,
            kernel_sizes=[[3] * dims] * n, strides=[[1] * dims] + [[2] * dims] * (n - 1), num_classes=classes,
            n_conv_per_stage_decoder=[1 if residual else 2] * (n - 1), conv_bias=True, norm_op=norm,
            norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True},
            deep_supervision=True,
        )
        if residual:  # nnU-Net ResEnc M's blocks per stage
            return unet.ResidualEncoderUNet(n_blocks_per_stage=[1, 3, 4, 6, 6, 6, 6, 6][:n], **common)
        return unet.PlainConvUNet(n_conv_per_stage=[2] * n, **common)

    return build


def _nnunet_sgd(p: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5)


def _ds_loss(out: Any, batch: Any) -> torch.Tensor:
    return deep_supervision_loss(out, batch[1])


def _entry(name: str, residual: bool, dims: int, features: list[int], classes: int, patch: tuple[int, ...],
           batch_size: int, in_ch: int = 1) -> Workload:
    return Workload(
        name=name, description=f"nnU-Net {'ResEnc' if residual else 'Plain'} {dims}-D, patch {patch}",
        model=_unet(residual, dims, features, classes, in_ch), batch=volumes(patch, classes, channels=in_ch),
        loss=_ds_loss, optimizer=_nnunet_sgd, batch_size=batch_size, precision="fp16",
        tags=("dynamic_network_architectures", "cnn", "segmentation", f"{dims}d", "deep_supervision"),
    )


nnunet_plain_3d = _entry("nnunet_plain_3d", False, 3, [32, 64, 128, 256, 320, 320], 4, (128, 128, 128), 2, 4)
nnunet_plain_2d = _entry("nnunet_plain_2d", False, 2, [32, 64, 128, 256, 512, 512, 512], 3, (512, 512), 12)
nnunet_resenc_3d = _entry("nnunet_resenc_3d", True, 3, [32, 64, 128, 256, 320, 320], 14, (96, 160, 160), 2)
nnunet_resenc_2d = _entry("nnunet_resenc_2d", True, 2, [32, 64, 128, 256, 512, 512, 512], 5, (448, 576), 8)
