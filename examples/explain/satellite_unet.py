"""A 2-D U-Net on 1024 x 1024 four-band satellite tiles that runs out of memory at batch size 1 on a 6 GiB card.

    memfit explain examples/explain/satellite_unet.py --budget 6GiB --report satellite_unet.html
"""

import torch

import memfit
from memfit.workload.models import UNet

workload = memfit.Workload(
    name="satellite-unet",
    description="2-D U-Net (64..1024 features, BatchNorm), 4-band 1024x1024 tiles, 6 classes, AdamW, fp32",
    model=lambda: UNet(dims=2, in_channels=4, classes=6, features=(64, 128, 256, 512, 1024), norm="batch",
                       deep_supervision=False),
    batch=lambda n, patch: (torch.randn(n, 4, *patch), torch.randint(0, 6, (n, *patch))),
    loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    batch_size=1,
    patch_size=(1024, 1024),
    patch_multiple=(16, 16),
)
