"""An nnU-Net-style 3-D U-Net (3d_fullres PlainConvUNet, deep supervision, fp16 + GradScaler) with a 192x192x160
patch at batch 2: too much for a 12 GiB card.

    memfit explain examples/explain/nnunet_3d.py --budget 12GiB --report nnunet_3d.html
"""

import torch

import memfit
from memfit.workload.models import UNet, deep_supervision_loss

workload = memfit.Workload(
    name="nnunet-3d-192",
    description="PlainConvUNet 32..320, 4 modalities, 192x192x160 patches, batch 2, SGD nesterov, fp16",
    model=lambda: UNet(dims=3, in_channels=4, classes=4),
    batch=lambda n, patch: (torch.randn(n, 4, *patch), torch.randint(0, 4, (n, *patch))),
    loss=lambda out, batch: deep_supervision_loss(out, batch[1]),
    optimizer=lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5),
    batch_size=2,
    precision="fp16",
    patch_size=(192, 192, 160),
    patch_multiple=(32, 32, 32),
)
