"""A fourth fresh draw of real training steps, written down on 2026-11-29 (session 31) *before* memfit estimated or
measured any of them.

Session 30 fitted the upper bound's base margin (4.3 %) on every step measured outside the corpus's validation half,
the first three draws included, so none of those is held out from it any more. These steps are: architectures no
earlier session traced — timm's Sequencer (bidirectional LSTMs over image rows and columns), FocalNet, VOLO
(outlook attention: fold and unfold), ResNeSt (split attention) and InceptionNeXt; Hugging Face's Qwen2 (a
152k vocabulary, grouped-query attention with biases), Gemma 2 (logit soft-capping, sliding windows), LED
(Longformer encoder-decoder), CLIP's contrastive loss, DPT depth estimation, UperNet on ConvNeXt with its auxiliary
head, PatchTST forecasting and the Audio Spectrogram Transformer; torchvision's SSD300, Mask R-CNN v2,
EfficientNetV2-S with RMSprop and ConvNeXt-S; MONAI's MedNeXt and residual UNet with their own losses; smp's
DeepLabV3 on ResNeXt-50; and two hand-written steps (a graph network whose messages are summed with
``index_add_``, a pre-norm Transformer encoder with a padding mask). They are reported on their own (tag
``holdout4``): nothing was fitted on them, and any fix made after seeing one is said to be so in the results.

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
    detection_batch,
    hf_loss,
    images,
    lm_entry,
    monai_loss,
    monai_net,
    seq2seq_batch,
    seq2seq_forward,
    sgd,
    smp_model,
    sum_of_losses,
    timm_entry,
    volumes,
)
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout4"
HOLDOUT4 = "holdout4"


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT4)

h4_timm_sequencer2d_s = _timm_entry("h4_timm_sequencer2d_s", "sequencer2d_s", 64, "bf16", adamw(), "rnn")
h4_timm_focalnet_tiny = _timm_entry("h4_timm_focalnet_tiny", "focalnet_tiny_srf", 128, "fp16", adamw(), "hybrid")
h4_timm_volo_d1 = _timm_entry("h4_timm_volo_d1", "volo_d1_224", 64, "bf16", adamw(), "transformer")
h4_timm_resnest50d = _timm_entry("h4_timm_resnest50d", "resnest50d", 64, "fp32", sgd(nesterov=True), "cnn")
h4_timm_inception_next_tiny = _timm_entry("h4_timm_inception_next_tiny", "inception_next_tiny", 128, "bf16", adamw(),
                                          "cnn")


# --- transformers: text -------------------------------------------------------------------------------------------

_lm = functools.partial(lm_entry, family=HOLDOUT4, tags=("decoder", "large_vocab"))


h4_hf_qwen2_lm = _lm("h4_hf_qwen2_lm", _hf(
    "Qwen2ForCausalLM", "Qwen2Config", vocab_size=151936, hidden_size=896, num_hidden_layers=8,
    num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=2048,
    tie_word_embeddings=True,
), 151936, 1024, 4, "bf16", "Qwen2 (0.5B's widths, 8 layers, grouped-query attention, tied 152k embeddings)")
h4_hf_gemma2_lm = _lm("h4_hf_gemma2_lm", _hf(
    "Gemma2ForCausalLM", "Gemma2Config", vocab_size=32000, hidden_size=1024, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=4096, sliding_window=512,
    max_position_embeddings=2048,
), 32000, 1024, 4, "bf16", "Gemma 2 (soft-capped logits, alternating sliding-window layers), 6 x 1024")


h4_hf_led = Workload(
    name="h4_hf_led", description="LED (Longformer encoder-decoder, window 256), 6 + 6 layers of 512, 2048 -> 128 "
    "tokens, fp16",
    model=_hf("LEDForConditionalGeneration", "LEDConfig", vocab_size=50265, d_model=512, encoder_layers=6,
              decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
              decoder_ffn_dim=2048, attention_window=256, max_encoder_position_embeddings=2048,
              max_decoder_position_embeddings=256),
    batch=seq2seq_batch(50265, 2048, 128), forward=seq2seq_forward, loss=hf_loss, optimizer=adamw(5e-5, 0.01),
    batch_size=4, precision="fp16", tags=("transformers", HOLDOUT4, "transformer", "encoder_decoder", "sliding_window"),
)


# --- transformers: vision, audio, time series ---------------------------------------------------------------------

def _clip_batch(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 49408, (n, 77)), "pixel_values": torch.randn(n, 3, 224, 224)}


h4_hf_clip = Workload(
    name="h4_hf_clip", description="CLIP ViT-B/32 image and text towers, contrastive loss, 224x224 and 77 tokens, bf16",
    model=_hf("CLIPModel", "CLIPConfig", vision_config={"patch_size": 32}),
    batch=_clip_batch, forward=lambda m, b: m(**b, return_loss=True), loss=hf_loss, optimizer=adamw(5e-4, 0.2),
    batch_size=256, precision="bf16", tags=("transformers", HOLDOUT4, "transformer", "vision", "contrastive"),
)


def _depth_loss(out: Any, batch: Any) -> torch.Tensor:
    return F.l1_loss(out.predicted_depth, batch[1])


h4_hf_dpt_depth = Workload(
    name="h4_hf_dpt_depth", description="DPT (ViT-B/16 backbone, reassemble and fusion stages) depth estimation, "
    "384x384, L1, fp32",
    model=_hf("DPTForDepthEstimation", "DPTConfig", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
              intermediate_size=3072, image_size=384, backbone_out_indices=[2, 5, 8, 11]),
    batch=lambda n: (torch.randn(n, 3, 384, 384), torch.rand(n, 384, 384)),
    forward=lambda m, b: m(pixel_values=b[0]), loss=_depth_loss, optimizer=adamw(1e-4, 0.01), batch_size=8,
    precision="fp32", tags=("transformers", HOLDOUT4, "transformer", "vision", "dense_prediction"),
)

h4_hf_upernet_convnext = Workload(
    name="h4_hf_upernet_convnext", description="UperNet on ConvNeXt-T with the auxiliary FCN head, ADE20K's 150 "
    "classes, 512x512, fp16",
    model=_hf("UperNetForSemanticSegmentation", "UperNetConfig", num_labels=150, use_auxiliary_head=True,
              backbone_config={"model_type": "convnext", "depths": [3, 3, 9, 3],
                               "hidden_sizes": [96, 192, 384, 768],
                               "out_features": ["stage1", "stage2", "stage3", "stage4"]}),
    batch=lambda n: {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 150, (n, 512, 512))},
    loss=hf_loss, optimizer=adamw(6e-5, 0.01), batch_size=8, precision="fp16",
    tags=("transformers", HOLDOUT4, "cnn", "segmentation"),
)

h4_hf_patchtst = Workload(
    name="h4_hf_patchtst", description="PatchTST forecasting (7 channels, 512 steps in patches of 16, 96 ahead), fp32",
    model=_hf("PatchTSTForPrediction", "PatchTSTConfig", num_input_channels=7, context_length=512,
              prediction_length=96, patch_length=16, patch_stride=8, d_model=128, num_attention_heads=16,
              num_hidden_layers=3, ffn_dim=256),
    batch=lambda n: {"past_values": torch.randn(n, 512, 7), "future_values": torch.randn(n, 96, 7)},
    loss=hf_loss, optimizer=adamw(1e-4, 0.0), batch_size=128, precision="fp32",
    tags=("transformers", HOLDOUT4, "transformer", "time_series"),
)

h4_hf_ast = Workload(
    name="h4_hf_ast", description="Audio Spectrogram Transformer (ViT-B over 1024 frames x 128 mel bins), 527 "
    "classes, fp16",
    model=_hf("ASTForAudioClassification", "ASTConfig", num_labels=527),
    batch=lambda n: {"input_values": torch.randn(n, 1024, 128), "labels": torch.randint(0, 527, (n,))},
    loss=hf_loss, optimizer=adamw(1e-5, 0.0), batch_size=12, precision="fp16",
    tags=("transformers", HOLDOUT4, "transformer", "speech"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

h4_tv_ssd300 = Workload(
    name="h4_tv_ssd300", description="torchvision ssd300_vgg16 (hard negative mining), 5 objects per 300x300 image, "
    "fp32",
    model=_tv("ssd300_vgg16", weights_backbone=None, num_classes=91),
    batch=detection_batch(size=300, objects=5, min_side=20), forward=lambda m, b: m(b[0], b[1]), loss=sum_of_losses,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.002, momentum=0.9, weight_decay=5e-4), batch_size=16,
    precision="fp32", tags=("torchvision", HOLDOUT4, "cnn", "detection"),
)
h4_tv_maskrcnn_v2 = Workload(
    name="h4_tv_maskrcnn_v2", description="torchvision maskrcnn_resnet50_fpn_v2, 4 objects with masks per 512x512 "
    "image, fp32",
    model=_tv("maskrcnn_resnet50_fpn_v2", weights_backbone=None, num_classes=91),
    batch=detection_batch(size=512, objects=4, min_side=24, masks=True), forward=lambda m, b: m(b[0], b[1]),
    loss=sum_of_losses, optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4),
    batch_size=2, precision="fp32", tags=("torchvision", HOLDOUT4, "cnn", "detection"),
)
h4_tv_efficientnet_v2_s = Workload(
    name="h4_tv_efficientnet_v2_s", description="torchvision efficientnet_v2_s, 384x384, RMSprop, bf16",
    model=_tv("efficientnet_v2_s"),
    batch=images(384), loss=ce,
    optimizer=lambda p: torch.optim.RMSprop(p, lr=0.016, alpha=0.9, eps=0.001, momentum=0.9, weight_decay=1e-5),
    batch_size=48, precision="bf16", tags=("torchvision", HOLDOUT4, "cnn"),
)
h4_tv_convnext_small = Workload(
    name="h4_tv_convnext_small", description="torchvision convnext_small, 224x224, bf16",
    model=_tv("convnext_small"),
    batch=images(224), loss=ce,
    optimizer=adamw(1e-3), batch_size=96, precision="bf16", tags=("torchvision", HOLDOUT4, "cnn"),
)


# --- MONAI, smp -----------------------------------------------------------------------------------------------------

h4_monai_mednext = Workload(
    name="h4_monai_mednext", description="MONAI MedNeXt (ConvNeXt blocks in 3-D, kernel 3), 3 classes, 128^3, "
    "DiceCE, bf16",
    model=monai_net("MedNeXt", spatial_dims=3, init_filters=32, in_channels=1, out_channels=3),
    batch=volumes((128, 128, 128), classes=3, label_channel=True),
    loss=monai_loss("DiceCELoss", to_onehot_y=True, softmax=True), optimizer=adamw(1e-3, 1e-5), batch_size=2,
    precision="bf16", tags=("monai", HOLDOUT4, "cnn", "3d", "segmentation"),
)
h4_monai_unet_res = Workload(
    name="h4_monai_unet_res", description="MONAI UNet with 2 residual units per level, 4 classes, 96^3, DiceFocal, "
    "fp16",
    model=monai_net("UNet", spatial_dims=3, in_channels=1, out_channels=4, channels=(16, 32, 64, 128, 256),
                    strides=(2, 2, 2, 2), num_res_units=2),
    batch=volumes((96, 96, 96), classes=4, label_channel=True),
    loss=monai_loss("DiceFocalLoss", to_onehot_y=True, softmax=True),
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), batch_size=4, precision="fp16",
    tags=("monai", HOLDOUT4, "cnn", "3d", "segmentation"),
)
h4_smp_deeplabv3_rx50 = Workload(
    name="h4_smp_deeplabv3_rx50", description="smp DeepLabV3 on ResNeXt-50 (dilated), 6 classes, 512x512, fp16",
    model=smp_model("DeepLabV3", "resnext50_32x4d", classes=6),
    batch=lambda n: (torch.randn(n, 3, 512, 512), torch.randint(0, 6, (n, 512, 512))), loss=ce,
    optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), batch_size=8, precision="fp16",
    tags=("segmentation_models_pytorch", HOLDOUT4, "cnn", "segmentation"),
)


# --- plain torch ----------------------------------------------------------------------------------------------------

class _GraphNet(nn.Module):
    """Three graph convolutions: each node sums its neighbours' projected features (``index_add_`` over the edges),
    normalised by its degree, then LayerNorm and ReLU; a linear classifier per node."""

    def __init__(self, features: int = 128, hidden: int = 256, classes: int = 40) -> None:
        super().__init__()
        widths = [features, hidden, hidden, hidden]
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
        self.norms = nn.ModuleList([nn.LayerNorm(b) for b in widths[1:]])
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        degree = torch.zeros(x.shape[0], device=x.device).index_add_(0, dst, torch.ones_like(dst, dtype=x.dtype))
        for layer, norm in zip(self.layers, self.norms):
            h = layer(x)
            summed = torch.zeros_like(h).index_add_(0, dst, h[src])
            x = F.relu(norm(summed / degree.clamp(min=1)[:, None] + h))
        return self.head(x)


def _graph_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # n graphs of 10,000 nodes and 160,000 edges each, as one disconnected graph
    nodes, edges = 10_000, 160_000
    src = torch.randint(0, nodes, (n, edges)) + torch.arange(n)[:, None] * nodes
    dst = torch.randint(0, nodes, (n, edges)) + torch.arange(n)[:, None] * nodes
    return torch.randn(n * nodes, 128), torch.stack([src.flatten(), dst.flatten()]), torch.randint(0, 40, (n * nodes,))


h4_torch_graph_net = Workload(
    name="h4_torch_graph_net", description="hand-written graph network (3 layers of 256, index_add_ message sums), "
    "10k nodes and 160k edges per graph, fp32",
    model=_GraphNet, batch=_graph_batch, forward=lambda m, b: m(b[0], b[1]),
    loss=lambda out, b: F.cross_entropy(out, b[2]), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), batch_size=8,
    precision="fp32", tags=(HOLDOUT4, "graph"),
)


class _PaddedEncoder(nn.Module):
    """Token classifier: embeddings, a 6-layer pre-norm ``nn.TransformerEncoder`` told which positions are padding,
    and the mean of the real tokens into 20 classes."""

    def __init__(self, vocab: int = 32000, width: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 8, 2048, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        self.head = nn.Linear(width, 20)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _padded_batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = torch.randint(128, 513, (n,))
    padding = torch.arange(512)[None, :] >= lengths[:, None]
    return torch.randint(0, 32000, (n, 512)), padding, torch.randint(0, 20, (n,))


h4_torch_padded_encoder = Workload(
    name="h4_torch_padded_encoder", description="nn.TransformerEncoder (6 pre-norm layers of 512) with a padding mask, "
    "512 tokens, fused AdamW, bf16",
    model=_PaddedEncoder, batch=_padded_batch, forward=lambda m, b: m(b[0], b[1]),
    loss=lambda out, b: F.cross_entropy(out, b[2]),
    optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.01, fused=True), batch_size=64,
    precision="bf16", tags=(HOLDOUT4, "transformer", "encoder"),
)
