"""A fifth fresh draw of real training steps, written down on 2026-11-29 (session 32) *before* memfit estimated or
measured any of them.

Session 32 changed how channels-last convolutions are charged (cuDNN's NHWC kernels take no layout conversion; a
360-call H200 grid) after the fourth draw's DPT showed it, so that draw is no longer held out for it. These steps
are: architectures no earlier session traced — timm's ConvFormer (MetaFormer with separable convolutions), Twins-SVT,
CrossViT (two branches joined by cross-attention), CSP-ResNeXt-50 trained channels-last and RepVGG-A2; Hugging Face's
FNet (Fourier token mixing, fp32 as FFTs want), StarCoder2, CvT, TimeSformer (divided space-time attention on video),
Wav2Vec2-Conformer with CTC and MobileNetV2-DeepLabV3; torchvision's ResNeXt-101 32x8d and EfficientNet-B3 trained
channels-last, MnasNet and ViT-B/32; MONAI's Attention U-Net and SegResNetVAE with their own losses; smp's FPN on
EfficientNet-B3; and two hand-written steps (a channels-last fp32 U-Net decoding with bilinear upsampling, a
convolutional VAE with its KL term). They are reported on their own (tag ``holdout5``): nothing was fitted on them,
and any fix made after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch one GPU trains;
nothing here is resized after a prediction is seen.
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
    monai_loss,
    monai_net,
    sgd,
    smp_model,
    timm_entry,
    volumes,
)
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout5"
HOLDOUT5 = "holdout5"


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT5)

h5_timm_convformer_s18 = _timm_entry("h5_timm_convformer_s18", "convformer_s18", 96, "bf16", adamw(), "cnn")
h5_timm_twins_svt_small = _timm_entry("h5_timm_twins_svt_small", "twins_svt_small", 96, "fp16", adamw(),
                                      "transformer")
h5_timm_crossvit_9 = _timm_entry("h5_timm_crossvit_9", "crossvit_9_240", 128, "bf16", adamw(), "transformer",
                                 size=240)
h5_timm_cspresnext50_cl = _timm_entry("h5_timm_cspresnext50_cl", "cspresnext50", 64, "fp32", sgd(nesterov=True),
                                      "cnn", channels_last=True)
h5_timm_repvgg_a2 = _timm_entry("h5_timm_repvgg_a2", "repvgg_a2", 128, "fp16", sgd(nesterov=False), "cnn")


# --- transformers: text -------------------------------------------------------------------------------------------

h5_hf_starcoder2_lm = lm_entry("h5_hf_starcoder2_lm", _hf(
    "Starcoder2ForCausalLM", "Starcoder2Config", vocab_size=49152, hidden_size=1024, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096, max_position_embeddings=4096,
    sliding_window=None,
), 49152, 2048, 4, "bf16", "StarCoder2 (grouped-query attention, biases, GELU MLP), 8 x 1024", family=HOLDOUT5,
    tags=("decoder",))

h5_hf_fnet_mlm = Workload(
    name="h5_hf_fnet_mlm", description="FNet base (Fourier token mixing) masked LM, 512 tokens, fp32",
    model=_hf("FNetForMaskedLM", "FNetConfig", vocab_size=32000, max_position_embeddings=512),
    batch=lambda n: {"input_ids": torch.randint(0, 32000, (n, 512)), "labels": torch.randint(0, 32000, (n, 512))},
    loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=32, precision="fp32",
    tags=("transformers", HOLDOUT5, "encoder", "fft"),
)


# --- transformers: vision, video, speech --------------------------------------------------------------------------

h5_hf_cvt = Workload(
    name="h5_hf_cvt", description="CvT-13 (convolutional token embeddings and projections), 224x224, fp16",
    model=_hf("CvtForImageClassification", "CvtConfig", num_labels=1000),
    batch=images(224),
    forward=lambda m, b: m(pixel_values=b[0]), loss=logits_ce, optimizer=adamw(1e-3), batch_size=64,
    precision="fp16", tags=("transformers", HOLDOUT5, "hybrid", "vision"),
)
h5_hf_timesformer = Workload(
    name="h5_hf_timesformer", description="TimeSformer (divided space-time attention), 8 frames of 224x224, 400 "
    "classes, bf16",
    model=_hf("TimesformerForVideoClassification", "TimesformerConfig", num_frames=8, num_labels=400),
    batch=lambda n: {"pixel_values": torch.randn(n, 8, 3, 224, 224), "labels": torch.randint(0, 400, (n,))},
    loss=hf_loss, optimizer=adamw(5e-5, 0.01), batch_size=8, precision="bf16",
    tags=("transformers", HOLDOUT5, "transformer", "video"),
)


h5_hf_w2v2_conformer_ctc = Workload(
    name="h5_hf_w2v2_conformer_ctc", description="Wav2Vec2-Conformer (rotary positions, 12 layers of 512) with CTC, "
    "8 s of 16 kHz audio, fp16",
    model=_hf("Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerConfig", vocab_size=32, hidden_size=512,
              num_hidden_layers=12, num_attention_heads=8, intermediate_size=2048,
              position_embeddings_type="rotary", ctc_loss_reduction="mean"),
    batch=ctc_audio(), loss=hf_loss, optimizer=adamw(1e-4, 0.0), batch_size=8, precision="fp16",
    tags=("transformers", HOLDOUT5, "transformer", "speech", "ctc"),
)
h5_hf_mobilenetv2_deeplab = Workload(
    name="h5_hf_mobilenetv2_deeplab", description="MobileNetV2 + DeepLabV3 head (Hugging Face), 21 classes, 512x512, "
    "fp32",
    model=_hf("MobileNetV2ForSemanticSegmentation", "MobileNetV2Config", num_labels=21, image_size=512),
    batch=lambda n: {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 21, (n, 512, 512))},
    loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=16, precision="fp32",
    tags=("transformers", HOLDOUT5, "cnn", "segmentation"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

h5_tv_resnext101_cl = Workload(
    name="h5_tv_resnext101_cl", description="torchvision resnext101_32x8d, 224x224, bf16, channels_last",
    model=_tv("resnext101_32x8d"),
    batch=images(224), loss=ce,
    optimizer=sgd(nesterov=False), batch_size=64, precision="bf16", channels_last=True,
    tags=("torchvision", HOLDOUT5, "cnn", "channels_last"),
)
h5_tv_efficientnet_b3_cl = Workload(
    name="h5_tv_efficientnet_b3_cl", description="torchvision efficientnet_b3, 300x300, fp16, channels_last",
    model=_tv("efficientnet_b3"),
    batch=images(300), loss=ce,
    optimizer=lambda p: torch.optim.RMSprop(p, lr=0.016, alpha=0.9, eps=0.001, momentum=0.9, weight_decay=1e-5),
    batch_size=64, precision="fp16", channels_last=True, tags=("torchvision", HOLDOUT5, "cnn", "channels_last"),
)
h5_tv_mnasnet = Workload(
    name="h5_tv_mnasnet", description="torchvision mnasnet1_0, 224x224, fp16",
    model=_tv("mnasnet1_0"),
    batch=images(224), loss=ce,
    optimizer=sgd(nesterov=True), batch_size=192, precision="fp16", tags=("torchvision", HOLDOUT5, "cnn", "mobile"),
)
h5_tv_vit_b_32 = Workload(
    name="h5_tv_vit_b_32", description="torchvision vit_b_32, 224x224, fp16",
    model=_tv("vit_b_32"),
    batch=images(224), loss=ce,
    optimizer=adamw(3e-3, 0.3), batch_size=256, precision="fp16", tags=("torchvision", HOLDOUT5, "transformer", "vit"),
)


# --- MONAI, smp -----------------------------------------------------------------------------------------------------

h5_monai_attention_unet = Workload(
    name="h5_monai_attention_unet", description="MONAI AttentionUnet (attention gates), 3-D, 3 classes, 96^3, DiceCE, "
    "fp16",
    model=monai_net("AttentionUnet", spatial_dims=3, in_channels=1, out_channels=3, channels=(16, 32, 64, 128, 256),
                    strides=(2, 2, 2, 2)),
    batch=volumes((96, 96, 96), classes=3, label_channel=True),
    loss=monai_loss("DiceCELoss", to_onehot_y=True, softmax=True), optimizer=adamw(1e-4, 1e-5), batch_size=2,
    precision="fp16", tags=("monai", HOLDOUT5, "cnn", "3d", "segmentation"),
)
_dice_ce = monai_loss("DiceCELoss", to_onehot_y=True, softmax=True)


def _seg_and_vae_loss(out: Any, batch: Any) -> torch.Tensor:
    segmentation, vae_loss = out
    return _dice_ce(segmentation, batch) + 0.1 * vae_loss


h5_monai_segresnet_vae = Workload(
    name="h5_monai_segresnet_vae", description="MONAI SegResNetVAE (a VAE branch regularising the encoder), 3 classes, "
    "128^3, DiceCE + 0.1 x its VAE loss, bf16",
    model=monai_net("SegResNetVAE", spatial_dims=3, input_image_size=(128, 128, 128), in_channels=1, out_channels=3,
                    init_filters=16),
    batch=volumes((128, 128, 128), classes=3, label_channel=True), loss=_seg_and_vae_loss,
    optimizer=adamw(1e-4, 1e-5), batch_size=1, precision="bf16", tags=("monai", HOLDOUT5, "cnn", "3d", "segmentation"),
)
h5_smp_fpn_effb3 = Workload(
    name="h5_smp_fpn_effb3", description="smp FPN on EfficientNet-B3, 4 classes, 512x512, fp16",
    model=smp_model("FPN", "efficientnet-b3", classes=4),
    batch=lambda n: (torch.randn(n, 3, 512, 512), torch.randint(0, 4, (n, 512, 512))), loss=ce,
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), batch_size=12, precision="fp16",
    tags=("segmentation_models_pytorch", HOLDOUT5, "cnn", "segmentation"),
)


# --- plain torch ----------------------------------------------------------------------------------------------------

class _BilinearUNet(nn.Module):
    """A 4-level U-Net whose decoder upsamples bilinearly and concatenates the skip (2 convolutions of 3x3 with
    BatchNorm and ReLU per level), trained channels-last: the layout HF's DPT reached through permuted tokens."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128, 256), classes: int = 5) -> None:
        super().__init__()

        def block(a: int, b: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(inplace=True),
                                 nn.Conv2d(b, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(inplace=True))

        self.down = nn.ModuleList([block(3 if i == 0 else widths[i - 1], w) for i, w in enumerate(widths)])
        self.up = nn.ModuleList([block(widths[i] + widths[i + 1], widths[i]) for i in range(len(widths) - 1)])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            x = down(F.max_pool2d(x, 2) if i else x)
            skips.append(x)
        for i in reversed(range(len(self.up))):
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            x = self.up[i](torch.cat([x, skips[i]], dim=1))
        return self.head(x)


h5_torch_bilinear_unet_cl = Workload(
    name="h5_torch_bilinear_unet_cl", description="hand-written U-Net (4 levels, bilinear upsampling), 5 classes, "
    "384x384, fp32, channels_last",
    model=_BilinearUNet, batch=lambda n: (torch.randn(n, 3, 384, 384), torch.randint(0, 5, (n, 384, 384))),
    loss=ce, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), batch_size=8, precision="fp32", channels_last=True,
    tags=(HOLDOUT5, "cnn", "segmentation", "channels_last"),
)


class _ConvVAE(nn.Module):
    """A convolutional VAE on 128x128 images: 4 strided convolutions to a 256-d Gaussian, the reparameterisation
    trick, 4 transposed convolutions back; returns the reconstruction, mean and log-variance."""

    def __init__(self, latent: int = 256) -> None:
        super().__init__()
        widths = [3, 64, 128, 256, 512]
        self.encoder = nn.Sequential(*[layer for a, b in zip(widths, widths[1:])
                                       for layer in (nn.Conv2d(a, b, 4, 2, 1), nn.LeakyReLU(0.2))])
        self.stats = nn.Linear(512 * 8 * 8, 2 * latent)
        self.expand = nn.Linear(latent, 512 * 8 * 8)
        back = widths[::-1]
        layers: list[nn.Module] = []
        for a, b in zip(back, back[1:]):
            layers += [nn.ConvTranspose2d(a, b, 4, 2, 1), nn.LeakyReLU(0.2) if b != 3 else nn.Identity()]
        self.decoder = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_var = self.stats(self.encoder(x).flatten(1)).chunk(2, dim=1)
        z = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
        return self.decoder(self.expand(z).view(-1, 512, 8, 8)), mean, log_var


def _vae_loss(out: Any, batch: Any) -> torch.Tensor:
    recon, mean, log_var = out
    kl = -0.5 * (1 + log_var - mean.square() - log_var.exp()).sum(1).mean()
    return F.mse_loss(recon, batch[0]) + 1e-3 * kl


h5_torch_conv_vae = Workload(
    name="h5_torch_conv_vae", description="hand-written convolutional VAE (256-d latent, KL term), 128x128, bf16",
    model=_ConvVAE, batch=lambda n: (torch.randn(n, 3, 128, 128),), loss=_vae_loss,
    optimizer=lambda p: torch.optim.Adam(p, lr=2e-4), batch_size=128, precision="bf16",
    tags=(HOLDOUT5, "cnn", "generative"),
)
