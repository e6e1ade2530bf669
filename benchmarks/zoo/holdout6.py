"""A sixth fresh draw of real training steps, written down on 2026-11-29 (session 33) *before* memfit estimated or
measured any of them.

Session 33 changed how the fake tensors lay out pointwise outputs of tensors that are contiguous and channels-last at
once (an (N, C, 1, 1) tensor after global pooling of a channels-last map), so half of this draw trains channels-last
through such a tensor: a pooled branch that goes through a pointwise op and is then upsampled and concatenated, or
multiplied back onto the map. These steps are: torchvision's DeepLabV3-ResNet-101 (ASPP's image-pooling branch) and
a hand-written PSPNet head (pyramid pooling at 1, 2, 3 and 6 bins) on torchvision's dilated ResNet-50; smp's PSPNet
on SE-ResNeXt-50, DeepLabV3+ on EfficientNet-B4 (squeeze-excitation in every block), PAN on ResNet-101 (the global
branches of its feature pyramid attention and upsampling units) and MAnet on DPN-68 (squeeze-excitation in its
decoder); timm's SE-ResNeXt-50, SK-ResNeXt-50 (selective kernels: a softmax over branches from a pooled descriptor)
and VoVNet-39 with effective squeeze-excitation; MONAI's SE-ResNet-50 on 3-D volumes (channels_last_3d) — all ten
trained channels-last — and, in the default layout: Hugging Face's mBART (large, vocabulary 250,027), OLMo 2 (query
and key norms, norms after the sublayers), ConvBERT (span-based dynamic convolutions) in fp32, WavLM with CTC (gated
relative position bias), Data2Vec-Vision with its UperNet head on 512x512 and BiT (weight-standardised convolutions
with GroupNorm); timm's Transformer-in-Transformer; torchvision's SqueezeNet 1.1 in fp32; MONAI's VoxelMorph
(diffeomorphic registration: scaling and squaring, warping by grid sampling) in fp32; and a hand-written Perceiver
(cross-attention from 512 latents to 50,176 pixels, weights shared over two passes). They are reported on their own
(tag ``holdout6``): nothing was fitted on them, and any fix made after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch one GPU trains;
nothing here is resized after a prediction is seen. Each ran one eager training step at batch 2 on the CPU before
being committed; none had to be replaced.
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
from recipes import (  # noqa: E402
    adamw,
    ce,
    ctc_audio,
    hf_loss,
    images,
    lm_entry,
    logits_ce,
    monai_net,
    seq2seq_batch,
    seq2seq_forward,
    sgd,
    smp_model,
    timm_entry,
)
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout6"
HOLDOUT6 = "holdout6"


def _adam(lr: float = 1e-4) -> Any:
    return lambda p: torch.optim.Adam(p, lr=lr)


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT6)


_timm_cl = functools.partial(_timm_entry, kind="cnn", channels_last=True)


h6_timm_seresnext50_cl = _timm_cl("h6_timm_seresnext50_cl", "seresnext50_32x4d", 128, "fp16", sgd(nesterov=True))
h6_timm_skresnext50_cl = _timm_cl("h6_timm_skresnext50_cl", "skresnext50_32x4d", 128, "bf16", sgd(nesterov=False))
h6_timm_ese_vovnet39b_cl = _timm_cl("h6_timm_ese_vovnet39b_cl", "ese_vovnet39b", 128, "bf16", adamw())
h6_timm_tnt_s = _timm_entry("h6_timm_tnt_s", "tnt_s_patch16_224", 128, "fp16", adamw(), "transformer")


# --- transformers: text -------------------------------------------------------------------------------------------

h6_hf_mbart = Workload(
    name="h6_hf_mbart", description="mBART large (12 + 12 layers, 1024, vocab 250,027), 256 -> 256 tokens, fp16",
    model=_hf("MBartForConditionalGeneration", "MBartConfig", vocab_size=250027, d_model=1024, encoder_layers=12,
              decoder_layers=12, encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
              decoder_ffn_dim=4096, max_position_embeddings=1024, scale_embedding=True),
    batch=seq2seq_batch(250027, 256, 256), forward=seq2seq_forward, loss=hf_loss, optimizer=adamw(3e-5, 0.01),
    batch_size=16, precision="fp16", tags=("transformers", HOLDOUT6, "transformer", "encoder_decoder"),
)
h6_hf_olmo2_lm = lm_entry("h6_hf_olmo2_lm", _hf(
    "Olmo2ForCausalLM", "Olmo2Config", vocab_size=100352, hidden_size=1024, num_hidden_layers=12,
    num_attention_heads=16, num_key_value_heads=16, intermediate_size=4096, max_position_embeddings=4096,
), 100352, 2048, 8, "bf16", "OLMo 2 (QK-norm, RMSNorm after attention and MLP), 12 x 1024", family=HOLDOUT6,
    tags=("decoder",))
h6_hf_convbert_mlm = Workload(
    name="h6_hf_convbert_mlm", description="ConvBERT base (span-based dynamic convolution heads) masked LM, 512 "
    "tokens, fp32",
    model=_hf("ConvBertForMaskedLM", "ConvBertConfig", vocab_size=30522, max_position_embeddings=512),
    batch=lambda n: {"input_ids": torch.randint(0, 30522, (n, 512)), "labels": torch.randint(0, 30522, (n, 512))},
    loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=32, precision="fp32",
    tags=("transformers", HOLDOUT6, "encoder", "convolution"),
)


# --- transformers: speech, vision ---------------------------------------------------------------------------------

h6_hf_wavlm_ctc = Workload(
    name="h6_hf_wavlm_ctc", description="WavLM base's shape (gated relative position bias) with CTC over 32 "
    "characters, 8 s of 16 kHz audio, no LayerDrop or time masking, fp16",
    model=_hf("WavLMForCTC", "WavLMConfig", vocab_size=32, mask_time_prob=0.0, layerdrop=0.0,
              ctc_loss_reduction="mean"),
    batch=ctc_audio(), loss=hf_loss, optimizer=adamw(1e-4, 0.0), batch_size=8, precision="fp16",
    tags=("transformers", HOLDOUT6, "transformer", "speech", "ctc"),
)
h6_hf_data2vec_vision_seg = Workload(
    name="h6_hf_data2vec_vision_seg", description="Data2Vec-Vision base (relative position bias) + UperNet and "
    "auxiliary FCN heads, 150 classes, 512x512, bf16",
    model=_hf("Data2VecVisionForSemanticSegmentation", "Data2VecVisionConfig", image_size=512, num_labels=150,
              use_relative_position_bias=True),
    batch=lambda n: {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 150, (n, 512, 512))},
    loss=hf_loss, optimizer=adamw(6e-5, 0.05), batch_size=16, precision="bf16",
    tags=("transformers", HOLDOUT6, "transformer", "segmentation"),
)
h6_hf_bit = Workload(
    name="h6_hf_bit", description="BiT-M R50x1 (weight-standardised convolutions, GroupNorm, SAME padding), "
    "384x384, fp16",
    model=_hf("BitForImageClassification", "BitConfig", global_padding="SAME", embedding_dynamic_padding=True,
              num_labels=1000),
    batch=images(384), forward=lambda m, b: m(pixel_values=b[0]), loss=logits_ce,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.003, momentum=0.9), batch_size=64, precision="fp16",
    tags=("transformers", HOLDOUT6, "cnn", "vision"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

h6_tv_deeplabv3_r101_cl = Workload(
    name="h6_tv_deeplabv3_r101_cl", description="torchvision deeplabv3_resnet101 + aux head, 21 classes, 480x480, "
    "bf16, channels_last",
    model=_tv("deeplabv3_resnet101", weights_backbone=None, num_classes=21, aux_loss=True),
    batch=lambda n: (torch.randn(n, 3, 480, 480), torch.randint(0, 21, (n, 480, 480))),
    loss=lambda out, b: F.cross_entropy(out["out"], b[1], ignore_index=255) + 0.5 * F.cross_entropy(
        out["aux"], b[1], ignore_index=255),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4), batch_size=16,
    precision="bf16", channels_last=True, tags=("torchvision", HOLDOUT6, "cnn", "segmentation", "channels_last"),
)
h6_tv_squeezenet = Workload(
    name="h6_tv_squeezenet", description="torchvision squeezenet1_1, 224x224, fp32",
    model=_tv("squeezenet1_1"),
    batch=images(224), loss=ce,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.04, momentum=0.9, weight_decay=2e-4), batch_size=512,
    precision="fp32", tags=("torchvision", HOLDOUT6, "cnn", "mobile"),
)


# --- MONAI, smp -----------------------------------------------------------------------------------------------------

h6_monai_seresnet50_3d_cl = Workload(
    name="h6_monai_seresnet50_3d_cl", description="MONAI SEResNet50, 3-D classification of 96^3 volumes, 2 classes, "
    "fp16, channels_last_3d",
    model=monai_net("SEResNet50", spatial_dims=3, in_channels=1, num_classes=2),
    batch=lambda n: (torch.randn(n, 1, 96, 96, 96), torch.randint(0, 2, (n,))), loss=ce,
    optimizer=adamw(1e-4, 1e-5), batch_size=16, precision="fp16", channels_last=True,
    tags=("monai", HOLDOUT6, "cnn", "3d", "channels_last"),
)
_diffusion: list[Any] = []


def _registration_loss(out: Any, batch: Any) -> torch.Tensor:
    """VoxelMorph's unsupervised loss: MSE of the warped moving image against the fixed one, plus 0.01 x the
    diffusion regulariser of the displacement field."""
    if not _diffusion:
        from monai.losses import DiffusionLoss

        _diffusion.append(DiffusionLoss())
    warped, ddf = out
    return F.mse_loss(warped, batch[1]) + 0.01 * _diffusion[0](ddf)


h6_monai_voxelmorph = Workload(
    name="h6_monai_voxelmorph", description="MONAI VoxelMorph (the paper's U-Net, 7 scaling-and-squaring steps), "
    "moving and fixed 160x192x224 volumes, MSE + diffusion, fp32",
    model=monai_net("VoxelMorph"),
    batch=lambda n: (torch.rand(n, 1, 160, 192, 224), torch.rand(n, 1, 160, 192, 224)),
    forward=lambda m, b: m(b[0], b[1]), loss=_registration_loss, optimizer=_adam(1e-4), batch_size=2,
    precision="fp32", tags=("monai", HOLDOUT6, "cnn", "3d", "registration"),
)


def _smp_cl(name: str, arch: str, encoder: str, classes: int, batch_size: int, precision: str,
            optimizer: Any) -> Workload:
    return Workload(
        name=name, description=f"smp {arch}({encoder}), {classes} classes, 512x512, {precision}, channels_last",
        model=smp_model(arch, encoder, classes=classes),
        batch=lambda n: (torch.randn(n, 3, 512, 512), torch.randint(0, classes, (n, 512, 512))), loss=ce,
        optimizer=optimizer, batch_size=batch_size, precision=precision,  # type: ignore[arg-type]
        channels_last=True, tags=("segmentation_models_pytorch", HOLDOUT6, "cnn", "segmentation", "channels_last"),
    )


h6_smp_pspnet_seresnext50_cl = _smp_cl("h6_smp_pspnet_seresnext50_cl", "PSPNet", "se_resnext50_32x4d", 8, 16,
                                       "fp16", _adam())
h6_smp_deeplabv3plus_effb4_cl = _smp_cl("h6_smp_deeplabv3plus_effb4_cl", "DeepLabV3Plus", "efficientnet-b4", 19,
                                        12, "bf16", adamw(1e-4, 1e-4))
h6_smp_pan_resnet101_cl = _smp_cl("h6_smp_pan_resnet101_cl", "PAN", "resnet101", 6, 8, "fp32", _adam())
h6_smp_manet_dpn68_cl = _smp_cl("h6_smp_manet_dpn68_cl", "MAnet", "dpn68", 4, 12, "fp16", adamw(1e-4, 1e-4))


# --- plain torch ----------------------------------------------------------------------------------------------------

class _PSPNet(nn.Module):
    """PSPNet as its paper builds it: torchvision's ResNet-50 dilated to output stride 8, a pyramid pooling module
    (average pooling to 1, 2, 3 and 6 bins, each a 1x1 convolution with BatchNorm and ReLU, upsampled bilinearly and
    concatenated with the map), a 3x3 fusion convolution, and an auxiliary FCN head on the third stage."""

    def __init__(self, classes: int = 21, bins: tuple[int, ...] = (1, 2, 3, 6)) -> None:
        super().__init__()
        import torchvision

        r = torchvision.models.resnet50(weights=None, replace_stride_with_dilation=[False, True, True])
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4
        self.pyramid = nn.ModuleList([
            nn.Sequential(nn.AdaptiveAvgPool2d(b), nn.Conv2d(2048, 512, 1, bias=False), nn.BatchNorm2d(512),
                          nn.ReLU(inplace=True)) for b in bins])
        self.fuse = nn.Sequential(nn.Conv2d(2048 + 512 * len(bins), 512, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(512), nn.ReLU(inplace=True), nn.Dropout2d(0.1),
                                  nn.Conv2d(512, classes, 1))
        self.aux = nn.Sequential(nn.Conv2d(1024, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256),
                                 nn.ReLU(inplace=True), nn.Dropout2d(0.1), nn.Conv2d(256, classes, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = x.shape[-2:]
        c3 = self.layer3(self.layer2(self.layer1(self.stem(x))))
        c4 = self.layer4(c3)
        pooled = [F.interpolate(stage(c4), size=c4.shape[-2:], mode="bilinear", align_corners=False)
                  for stage in self.pyramid]
        out = self.fuse(torch.cat([c4, *pooled], dim=1))
        return (F.interpolate(out, size=size, mode="bilinear", align_corners=False),
                F.interpolate(self.aux(c3), size=size, mode="bilinear", align_corners=False))


def _psp_loss(out: Any, batch: Any) -> torch.Tensor:
    main, aux = out
    return F.cross_entropy(main, batch[1], ignore_index=255) + 0.4 * F.cross_entropy(aux, batch[1], ignore_index=255)


h6_torch_pspnet_r50_cl = Workload(
    name="h6_torch_pspnet_r50_cl", description="hand-written PSPNet (pyramid pooling 1/2/3/6, aux head) on "
    "torchvision's dilated ResNet-50, 21 classes, 473x473, fp32, channels_last",
    model=_PSPNet, batch=lambda n: (torch.randn(n, 3, 473, 473), torch.randint(0, 21, (n, 473, 473))),
    loss=_psp_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4),
    batch_size=16, precision="fp32", channels_last=True,
    tags=("torchvision", HOLDOUT6, "cnn", "segmentation", "channels_last"),
)


class _Perceiver(nn.Module):
    """A Perceiver classifier on raw pixels: each of the 224 x 224 pixels a token (its RGB projected to 256, plus a
    learned position), 512 latents of 512 that cross-attend to them with one head, then 6 latent self-attention
    layers; the cross-attention and the latent stack run twice with the same weights; the mean latent is classified."""

    def __init__(self, size: int = 224, latents: int = 512, width: int = 512, token_width: int = 256,
                 layers: int = 6, passes: int = 2, classes: int = 1000) -> None:
        super().__init__()
        self.passes = passes
        self.pixel = nn.Linear(3, token_width)
        self.position = nn.Parameter(torch.randn(size * size, token_width) * 0.02)
        self.latents = nn.Parameter(torch.randn(latents, width) * 0.02)
        self.norm_q, self.norm_kv = nn.LayerNorm(width), nn.LayerNorm(token_width)
        self.cross = nn.MultiheadAttention(width, 1, kdim=token_width, vdim=token_width, batch_first=True)
        self.cross_mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                       nn.Linear(width, width))
        self.latent_stack = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True), layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm_kv(self.pixel(x.flatten(2).transpose(1, 2)) + self.position)
        z = self.latents.expand(x.shape[0], -1, -1)
        for _ in range(self.passes):
            z = z + self.cross(self.norm_q(z), tokens, tokens, need_weights=False)[0]
            z = z + self.cross_mlp(z)
            z = self.latent_stack(z)
        return self.head(z.mean(1))


h6_torch_perceiver = Workload(
    name="h6_torch_perceiver", description="hand-written Perceiver (512 latents cross-attending to 50,176 pixels, "
    "6 latent layers, 2 weight-shared passes), 224x224, bf16",
    model=_Perceiver, batch=images(224), loss=ce, optimizer=_adam(5e-4), batch_size=64, precision="bf16",
    tags=(HOLDOUT6, "transformer", "cross_attention"),
)
