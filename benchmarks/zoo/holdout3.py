"""A third fresh draw of real training steps, written down on 2026-11-28 (session 25) *before* memfit estimated or
measured any of them.

The second draw (``holdout2.py``) was measured in session 24; since then the estimator changed how its real CPU
forward stands in for a detector's products (session 25), so this draw also checks that work on steps it never saw.
These are architectures no earlier session traced: timm's HGNetV2, EfficientViT-M (cascaded group attention),
StarNet, CoAtNet, CrossViT (two token scales) and Twins-SVT; Hugging Face's BigBird (block-sparse attention),
ViT-MAE pretraining (random masking), Switch Transformers (top-1 experts with a capacity), Mask2Former (Hungarian
matching on sampled points), Deformable DETR, RT-DETR (denoising queries), YOLOS, SigLIP's contrastive loss,
LongT5 (transient-global attention), Funnel (pooled sequence), Swin2SR super-resolution and Data2Vec-Audio CTC;
torchvision's MViT v1 (video), Faster R-CNN v2 and DeepLabV3 on MobileNetV3. They are reported on their own (tag
``holdout3``): nothing was fitted on them, and any fix made after seeing one is said to be so in the results.

Each builder follows its library's usual recipe (optimizer, precision, input size) at a batch one GPU trains;
nothing here is resized after a prediction is seen.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import (  # noqa: E402
    adamw,
    box_labels,
    ce,
    detection_batch,
    hf_loss,
    seq2seq_batch,
    seq2seq_forward,
    sgd,
    sum_of_losses,
    timm_entry,
)
from recipes import hf_model as _hf
from recipes import tv_model as _tv

from memfit import Workload  # noqa: E402

LIBRARY = "holdout3"
HOLDOUT3 = "holdout3"


_sgd = sgd(nesterov=True)


# --- timm ---------------------------------------------------------------------------------------------------------

_timm_entry = functools.partial(timm_entry, family=HOLDOUT3)


h3_timm_hgnetv2_b0 = _timm_entry("h3_timm_hgnetv2_b0", "hgnetv2_b0", 128, "fp16", _sgd, "cnn")
h3_timm_efficientvit_m0 = _timm_entry("h3_timm_efficientvit_m0", "efficientvit_m0", 256, "bf16", adamw(),
                                      "transformer")
h3_timm_starnet_s1 = _timm_entry("h3_timm_starnet_s1", "starnet_s1", 128, "fp32", adamw(3e-3), "cnn")
h3_timm_coatnet_0 = _timm_entry("h3_timm_coatnet_0", "coatnet_0_rw_224", 64, "bf16", adamw(), "hybrid")
h3_timm_crossvit_tiny = _timm_entry("h3_timm_crossvit_tiny", "crossvit_tiny_240", 128, "fp16", adamw(), "transformer",
                                    size=240)
h3_timm_twins_svt_small = _timm_entry("h3_timm_twins_svt_small", "twins_svt_small", 64, "bf16", adamw(),
                                      "transformer")


# --- transformers: text ---------------------------------------------------------------------------------------------

def _mlm_batch(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, vocab, (n, seq))
        labels = torch.full((n, seq), -100)
        labels[:, ::7] = ids[:, ::7]  # about 15 % of the tokens scored, as MLM masking does
        ids[:, ::7] = 4  # and replaced by a mask token
        return {"input_ids": ids, "labels": labels}

    return make


h3_hf_bigbird_mlm = Workload(
    name="h3_hf_bigbird_mlm", description="BigBird MLM (block-sparse attention, 64-token blocks), 8 x 768, 2048 tokens, "
    "bf16",
    model=_hf("BigBirdForMaskedLM", "BigBirdConfig", vocab_size=50358, hidden_size=768, num_hidden_layers=8,
              num_attention_heads=12, intermediate_size=3072, max_position_embeddings=2048,
              attention_type="block_sparse", block_size=64, num_random_blocks=3),
    batch=_mlm_batch(50358, 2048), loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=4, precision="bf16",
    tags=("transformers", HOLDOUT3, "transformer", "encoder"),
)
h3_hf_funnel_mlm = Workload(
    name="h3_hf_funnel_mlm", description="Funnel Transformer MLM (pooled blocks 4-4-4, upsampled back), 512 tokens, "
    "fp16",
    model=_hf("FunnelForMaskedLM", "FunnelConfig", vocab_size=30522, block_sizes=[4, 4, 4], d_model=768, n_head=12,
              d_inner=3072),
    batch=_mlm_batch(30522, 512), loss=hf_loss, optimizer=adamw(1e-4, 0.01), batch_size=16, precision="fp16",
    tags=("transformers", HOLDOUT3, "transformer", "encoder"),
)


h3_hf_switch_base8 = Workload(
    name="h3_hf_switch_base8", description="Switch Transformer (8 experts every other layer, top-1 with capacity), "
    "6 + 6 layers of 512, 512 -> 128 tokens, bf16",
    model=_hf("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", vocab_size=32128, d_model=512,
              d_ff=2048, d_kv=64, num_heads=8, num_layers=6, num_decoder_layers=6, num_experts=8,
              encoder_sparse_step=2, decoder_sparse_step=2, expert_capacity=64, decoder_start_token_id=0, pad_token_id=0),
    batch=seq2seq_batch(32128, 512, 128), forward=seq2seq_forward, loss=hf_loss, optimizer=adamw(1e-4, 0.0),
    batch_size=8, precision="bf16", tags=("transformers", HOLDOUT3, "transformer", "encoder_decoder", "moe"),
)
h3_hf_longt5_tglobal = Workload(
    name="h3_hf_longt5_tglobal", description="LongT5 with transient-global attention, 6 + 6 layers of 512, 4096 -> 256 "
    "tokens, bf16",
    model=_hf("LongT5ForConditionalGeneration", "LongT5Config", vocab_size=32128, d_model=512, d_ff=1024, d_kv=64,
              num_heads=8, num_layers=6, num_decoder_layers=6, encoder_attention_type="transient-global",
              local_radius=127, global_block_size=16, decoder_start_token_id=0, pad_token_id=0),
    batch=seq2seq_batch(32128, 4096, 256), forward=seq2seq_forward, loss=hf_loss, optimizer=adamw(1e-4, 0.0),
    batch_size=2, precision="bf16", tags=("transformers", HOLDOUT3, "transformer", "encoder_decoder"),
)


# --- transformers: vision, audio ------------------------------------------------------------------------------------

h3_hf_vitmae_pretrain = Workload(
    name="h3_hf_vitmae_pretrain", description="ViT-MAE-B pretraining (75 % of patches masked at random, 8-layer "
    "decoder), 224x224, bf16",
    model=_hf("ViTMAEForPreTraining", "ViTMAEConfig"),
    batch=lambda n: {"pixel_values": torch.randn(n, 3, 224, 224)}, loss=hf_loss, optimizer=adamw(1.5e-4),
    batch_size=64, precision="bf16", tags=("transformers", HOLDOUT3, "transformer", "vision", "vit"),
)


def _siglip_batch(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 32000, (n, 64)), "pixel_values": torch.randn(n, 3, 224, 224)}


h3_hf_siglip = Workload(
    name="h3_hf_siglip", description="SigLIP-B/16 image and text towers trained with the sigmoid contrastive loss, "
    "224x224 and 64 tokens, bf16",
    model=_hf("SiglipModel", "SiglipConfig", text_config={"vocab_size": 32000, "max_position_embeddings": 64},
              vision_config={"image_size": 224, "patch_size": 16}),
    batch=_siglip_batch, forward=lambda m, b: m(**b, return_loss=True), loss=hf_loss, optimizer=adamw(1e-4, 0.1),
    batch_size=64, precision="bf16", tags=("transformers", HOLDOUT3, "transformer", "vision", "contrastive"),
)


def _ctc_batch(n: int) -> dict[str, torch.Tensor]:
    # 5 s of 16 kHz audio and 80 characters per sample
    return {"input_values": torch.randn(n, 80000), "labels": torch.randint(1, 32, (n, 80))}


h3_hf_data2vec_audio_ctc = Workload(
    name="h3_hf_data2vec_audio_ctc", description="Data2Vec-Audio base's shape, CTC over 32 characters, 5 s clips, fp16",
    model=_hf("Data2VecAudioForCTC", "Data2VecAudioConfig", vocab_size=32, mask_time_prob=0.0, layerdrop=0.0),
    batch=_ctc_batch, loss=hf_loss, optimizer=adamw(1e-4), batch_size=8, precision="fp16",
    tags=("transformers", HOLDOUT3, "transformer", "speech", "ctc"),
)


def _sr_loss(out: Any, batch: Any) -> torch.Tensor:
    return F.l1_loss(out.reconstruction, batch[1])


h3_hf_swin2sr_x2 = Workload(
    name="h3_hf_swin2sr_x2", description="Swin2SR x2 super-resolution (6 stages of 6 Swin V2 layers, 180 wide), "
    "64x64 -> 128x128 patches, L1, fp32",
    model=_hf("Swin2SRForImageSuperResolution", "Swin2SRConfig", upscale=2, embed_dim=180, depths=[6] * 6,
              num_heads=[6] * 6, window_size=8, upsampler="pixelshuffle"),
    batch=lambda n: (torch.rand(n, 3, 64, 64), torch.rand(n, 3, 128, 128)),
    forward=lambda m, b: m(pixel_values=b[0]), loss=_sr_loss, optimizer=adamw(2e-4, 0.0), batch_size=8,
    precision="fp32", tags=("transformers", HOLDOUT3, "transformer", "super_resolution"),
)


# --- transformers: detection and segmentation ------------------------------------------------------------------------

def _detection(size: int, objects: int, classes: int) -> Callable[[int], Any]:
    return lambda n: (torch.rand(n, 3, size, size), box_labels(n, objects, classes))


def _hf_detection_forward(model: Any, batch: Any) -> Any:
    return model(pixel_values=batch[0], labels=batch[1])


_RESNET50 = {"model_type": "resnet", "depths": [3, 4, 6, 3], "layer_type": "bottleneck",
             "hidden_sizes": [256, 512, 1024, 2048], "out_features": ["stage2", "stage3", "stage4"]}

h3_hf_deformable_detr = Workload(
    name="h3_hf_deformable_detr", description="Deformable DETR (ResNet-50, multi-scale deformable attention, random "
    "weights), Hungarian matching, 2 x 640^2, fp32",
    model=_hf("DeformableDetrForObjectDetection", "DeformableDetrConfig", use_timm_backbone=False,
              use_pretrained_backbone=False, backbone_config=_RESNET50, num_labels=91),
    batch=_detection(640, 12, 91), forward=_hf_detection_forward, loss=hf_loss, optimizer=adamw(2e-4, 1e-4),
    batch_size=2, precision="fp32", tags=("transformers", HOLDOUT3, "detection", "transformer"),
)
h3_hf_rtdetr = Workload(
    name="h3_hf_rtdetr", description="RT-DETR (ResNet-50-D backbone, hybrid encoder, denoising queries), 4 x 640^2, "
    "fp32",
    model=_hf("RTDetrForObjectDetection", "RTDetrConfig", num_labels=80),
    batch=_detection(640, 12, 80), forward=_hf_detection_forward, loss=hf_loss, optimizer=adamw(1e-4, 1e-4),
    batch_size=4, precision="fp32", tags=("transformers", HOLDOUT3, "detection", "transformer"),
)
h3_hf_yolos_small = Workload(
    name="h3_hf_yolos_small", description="YOLOS-S (a ViT with 100 detection tokens), Hungarian matching, 2 x 512x704, "
    "fp32",
    model=_hf("YolosForObjectDetection", "YolosConfig", hidden_size=384, num_attention_heads=6, intermediate_size=1536,
              image_size=[512, 704], num_labels=91),
    batch=lambda n: (torch.rand(n, 3, 512, 704), box_labels(n, 10, 91)), forward=_hf_detection_forward,
    loss=hf_loss, optimizer=adamw(2.5e-5, 1e-4), batch_size=2, precision="fp32",
    tags=("transformers", HOLDOUT3, "detection", "transformer", "vit"),
)


def _mask2former_batch(n: int) -> dict[str, Any]:
    masks, classes = [], []
    for _ in range(n):
        objects = 6
        m = torch.zeros(objects, 384, 384)
        for k in range(objects):  # a rectangle per object
            y, x = torch.randint(0, 256, (2,)).tolist()
            m[k, y : y + 96, x : x + 96] = 1.0
        masks.append(m)
        classes.append(torch.randint(0, 133, (objects,)))
    return {"pixel_values": torch.randn(n, 3, 384, 384), "mask_labels": masks, "class_labels": classes}


h3_hf_mask2former = Workload(
    name="h3_hf_mask2former", description="Mask2Former (Swin-T backbone, 100 queries, 133 classes), point-sampled mask "
    "losses after Hungarian matching, 2 x 384^2, fp32",
    model=_hf("Mask2FormerForUniversalSegmentation", "Mask2FormerConfig", num_labels=133, use_pretrained_backbone=False,
              backbone_config={"model_type": "swin", "embed_dim": 96, "depths": [2, 2, 6, 2],
                               "num_heads": [3, 6, 12, 24], "out_features": ["stage1", "stage2", "stage3", "stage4"]}),
    batch=_mask2former_batch, loss=hf_loss, optimizer=adamw(1e-4), batch_size=2, precision="fp32",
    tags=("transformers", HOLDOUT3, "segmentation", "transformer"),
)


# --- torchvision --------------------------------------------------------------------------------------------------

h3_tv_fasterrcnn_v2 = Workload(
    name="h3_tv_fasterrcnn_v2", description="torchvision fasterrcnn_resnet50_fpn_v2 (GroupNorm box head), 6 objects per "
    "512x512 image, fp32",
    model=_tv("fasterrcnn_resnet50_fpn_v2", weights_backbone=None, num_classes=91),
    batch=detection_batch(objects=6, min_side=24), forward=lambda m, b: m(b[0], b[1]), loss=sum_of_losses,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4), batch_size=4,
    precision="fp32", tags=("torchvision", HOLDOUT3, "cnn", "detection"),
)
h3_tv_mvit_v1_b = Workload(
    name="h3_tv_mvit_v1_b", description="torchvision mvit_v1_b (multiscale pooling attention), 16 x 224^2 clips, "
    "Kinetics-400, bf16",
    model=_tv("mvit_v1_b", num_classes=400),
    batch=lambda n: (torch.randn(n, 3, 16, 224, 224), torch.randint(0, 400, (n,))), loss=ce,
    optimizer=adamw(1e-3), batch_size=4, precision="bf16", tags=("torchvision", HOLDOUT3, "transformer", "video"),
)
h3_tv_deeplabv3_mobilenet = Workload(
    name="h3_tv_deeplabv3_mobilenet", description="torchvision deeplabv3_mobilenet_v3_large + aux head, 21 classes, "
    "520x520, fp16",
    model=_tv("deeplabv3_mobilenet_v3_large", weights_backbone=None, num_classes=21, aux_loss=True),
    batch=lambda n: (torch.randn(n, 3, 520, 520), torch.randint(0, 21, (n, 520, 520))),
    loss=lambda out, b: F.cross_entropy(out["out"], b[1]) + 0.5 * F.cross_entropy(out["aux"], b[1]),
    optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-4), batch_size=16,
    precision="fp16", tags=("torchvision", HOLDOUT3, "cnn", "segmentation"),
)
