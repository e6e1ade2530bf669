"""The accuracy suite: real models from timm, torchvision, transformers, MONAI, segmentation-models-pytorch and
dynamic-network-architectures (nnU-Net's networks), plus memfit's built-ins. Random weights, nothing downloaded.

Each name is loadable as ``benchmarks/workloads.py:NAME`` by ``memfit estimate`` and ``memfit measure``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit import Workload
from memfit.workload.models import deep_supervision_loss
from memfit.workload.zoo import builtin_workload


def _ce(out, batch):  # noqa: ANN001, ANN202
    return F.cross_entropy(out, batch[1])


def _images(n: int, size: int = 224, classes: int = 1000):  # noqa: ANN202
    return torch.randn(n, 3, size, size), torch.randint(0, classes, (n,))


def _tv_resnet50():  # noqa: ANN202
    import torchvision

    return torchvision.models.resnet50(weights=None)


def _timm(name: str):  # noqa: ANN202
    def build():  # noqa: ANN202
        import timm

        return timm.create_model(name, pretrained=False)

    return build


def _gpt2(checkpointing: bool):  # noqa: ANN202
    def build():  # noqa: ANN202
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(attn_implementation="sdpa"))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    return build


def _smp_unet():  # noqa: ANN202
    import segmentation_models_pytorch as smp

    return smp.Unet("resnet34", encoder_weights=None, in_channels=3, classes=1)


def _dna_plainconvunet():  # noqa: ANN202
    from dynamic_network_architectures.architectures.unet import PlainConvUNet
    from torch import nn

    return PlainConvUNet(
        input_channels=4, n_stages=6, features_per_stage=[32, 64, 128, 256, 320, 320], conv_op=nn.Conv3d,
        kernel_sizes=[[3, 3, 3]] * 6, strides=[[1, 1, 1]] + [[2, 2, 2]] * 5, n_conv_per_stage=[2] * 6,
        num_classes=4, n_conv_per_stage_decoder=[2] * 5, conv_bias=True, norm_op=nn.InstanceNorm3d,
        norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True},
        deep_supervision=True,
    )


def _swin_unetr():  # noqa: ANN202
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(in_channels=1, out_channels=14, feature_size=48)


def _monai_unet():  # noqa: ANN202
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(16, 32, 64, 128, 256),
                strides=(2, 2, 2, 2), num_res_units=2)


tv_resnet50 = Workload(
    name="tv_resnet50", model=_tv_resnet50, batch=_images, loss=_ce, batch_size=64, precision="fp32",
    optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4), tags=("cnn",),
)
timm_convnext_tiny = Workload(
    name="timm_convnext_tiny", model=_timm("convnext_tiny"), batch=_images, loss=_ce, batch_size=64,
    precision="bf16", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), tags=("cnn",),
)
timm_efficientnet_b0 = Workload(
    name="timm_efficientnet_b0", model=_timm("efficientnet_b0"), batch=_images, loss=_ce, batch_size=128,
    precision="fp16", optimizer=lambda p: torch.optim.RMSprop(p, lr=1e-3), tags=("cnn",),
)
timm_vit_b16 = Workload(
    name="timm_vit_b16", model=_timm("vit_base_patch16_224"), batch=_images, loss=_ce, batch_size=64,
    precision="bf16", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), tags=("transformer",),
)
hf_gpt2 = Workload(
    name="hf_gpt2", model=_gpt2(False), batch=lambda n: torch.randint(0, 50257, (n, 1024)),
    forward=lambda m, b: m(input_ids=b, labels=b), loss=lambda out, b: out.loss, batch_size=8,
    precision="bf16", optimizer=lambda p: torch.optim.AdamW(p, lr=6e-4), tags=("transformer", "decoder"),
)
hf_gpt2_ckpt = hf_gpt2.replace(name="hf_gpt2_ckpt", model=_gpt2(True))


def _t5_small():  # noqa: ANN202
    from transformers import T5Config, T5ForConditionalGeneration

    # t5-small's shape; its relative-position bias is a parameter that reaches SDPA as attn_mask
    return T5ForConditionalGeneration(T5Config(
        d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128, decoder_start_token_id=0,
        pad_token_id=0, attn_implementation="sdpa",
    ))


# not in the suite: checks the learned-bias attention rule (memfit/estimate/cuda_emulation.py: _cuda_sdpa)
hf_t5_small = Workload(
    name="hf_t5_small", model=_t5_small, batch=lambda n: torch.randint(0, 32128, (n, 512)),
    forward=lambda m, b: m(input_ids=b, labels=b), loss=lambda out, b: out.loss, batch_size=16,
    precision="bf16", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), tags=("transformer",),
)
smp_unet_r34 = Workload(
    name="smp_unet_r34", model=_smp_unet,
    batch=lambda n: (torch.randn(n, 3, 512, 512), torch.randint(0, 2, (n, 1, 512, 512)).float()),
    loss=lambda out, b: F.binary_cross_entropy_with_logits(out, b[1]), batch_size=8, precision="fp16",
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), tags=("cnn", "segmentation", "2d"),
)
nnunet_3d_fullres = Workload(
    name="nnunet_3d_fullres", model=_dna_plainconvunet,
    batch=lambda n: (torch.randn(n, 4, 128, 128, 128), torch.randint(0, 4, (n, 128, 128, 128))),
    loss=lambda out, b: deep_supervision_loss(out, b[1]), batch_size=2, precision="fp16",
    optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5),
    tags=("cnn", "segmentation", "3d"),
)
monai_swin_unetr = Workload(
    name="monai_swin_unetr", model=_swin_unetr,
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 14, (n, 96, 96, 96))),
    loss=lambda out, b: F.cross_entropy(out, b[1]), batch_size=1, precision="bf16",
    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), tags=("transformer", "segmentation", "3d"),
)
monai_unet3d = Workload(
    name="monai_unet3d", model=_monai_unet,
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 3, (n, 96, 96, 96))),
    loss=lambda out, b: F.cross_entropy(out, b[1]), batch_size=2, precision="fp32",
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), tags=("cnn", "segmentation", "3d"),
)
lstm_lm = builtin_workload("lstm")
unet2d_tiles = builtin_workload("unet2d").replace(name="unet2d_tiles", precision="bf16", batch_size=2)
mlp = builtin_workload("mlp")
# memfit's GPT with torch.utils.checkpoint per block. Hugging Face's own gradient checkpointing is hf_gpt2_ckpt,
# which needs transformers >= 5.24 on torch 2.11: with 5.17 its backward crashes on the GPU ("run_backward
# returned NULL without setting an exception"), in a plain training step, without memfit.
gpt2_ckpt = builtin_workload("gpt2-ckpt").replace(name="gpt2_ckpt")

SUITE = [
    "tv_resnet50", "timm_convnext_tiny", "timm_efficientnet_b0", "timm_vit_b16", "hf_gpt2", "hf_gpt2_ckpt",
    "gpt2_ckpt", "smp_unet_r34", "nnunet_3d_fullres", "monai_swin_unetr", "monai_unet3d", "lstm_lm",
    "unet2d_tiles", "mlp",
]

# The suite's measurements (results/estimate/measurements_*) ran the loss-only step, the output dropped before
# backward: each workload here is that loop, so its estimates stay comparable with them. The corpus
# (benchmarks/corpus/) measures both loops.
for _name in SUITE:
    globals()[_name] = globals()[_name].replace(keep_output=False)
