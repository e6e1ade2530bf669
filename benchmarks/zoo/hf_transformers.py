"""Hugging Face transformers, built from configs with random weights (nothing downloaded).

Decoder LMs (GPT-2 small's real config; small configs of Llama, Mistral, Qwen2, Gemma, Phi, OPT, GPT-NeoX and of
the MoE models Mixtral, Qwen2-MoE, OLMoE), encoders (BERT-base, RoBERTa, DistilBERT, DeBERTa-v2, ModernBERT),
encoder-decoders (T5-small, BART-base), speech (Whisper-tiny, wav2vec2-base CTC) and vision (ViT, Swin,
ConvNeXt, SegFormer, CLIP). The model computes its own loss from ``labels``, as ``Trainer`` has it do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import hf_loss, lm_forward, tokens  # noqa: E402
from recipes import hf_model as _hf

from memfit import Workload  # noqa: E402

LIBRARY = "transformers"


def _adamw(lr: float = 3e-4) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1)


def _lm(name: str, model: Callable[[], torch.nn.Module], vocab: int, seq: int, batch_size: int,
        precision: str = "bf16", tags: tuple[str, ...] = ()) -> Workload:
    return Workload(
        name=name, description=f"causal LM, vocab {vocab}, {seq} tokens, {precision}", model=model,
        batch=tokens(vocab, seq), forward=lm_forward, loss=hf_loss, optimizer=_adamw(), batch_size=batch_size,
        precision=precision, tags=("transformers", "transformer", "decoder", *tags),  # type: ignore[arg-type]
    )


_LLAMA_SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)

hf_gpt2 = _lm("hf_gpt2", _hf("GPT2LMHeadModel", "GPT2Config"), 50257, 1024, 8)
hf_gpt2_fp16 = _lm("hf_gpt2_fp16", _hf("GPT2LMHeadModel", "GPT2Config"), 50257, 512, 8, "fp16")
hf_gpt2_fp32 = _lm("hf_gpt2_fp32", _hf("GPT2LMHeadModel", "GPT2Config"), 50257, 512, 4, "fp32")
hf_llama_small = _lm("hf_llama_small", _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_SMALL), 32000, 1024, 4,
                     tags=("gqa", "rope"))
hf_llama_small_ckpt = _lm("hf_llama_small_ckpt", _hf("LlamaForCausalLM", "LlamaConfig", True, **_LLAMA_SMALL),
                          32000, 1024, 8, tags=("gqa", "rope", "checkpointing"))
hf_mistral_small = _lm("hf_mistral_small", _hf("MistralForCausalLM", "MistralConfig", **{
    **_LLAMA_SMALL, "sliding_window": 512}), 32000, 1024, 4, tags=("gqa", "sliding_window"))
hf_qwen2_small = _lm("hf_qwen2_small", _hf(
    "Qwen2ForCausalLM", "Qwen2Config", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=6, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
), 151936, 512, 4, tags=("gqa", "large_vocab"))
hf_gemma_small = _lm("hf_gemma_small", _hf(
    "GemmaForCausalLM", "GemmaConfig", vocab_size=256000, hidden_size=512, intermediate_size=2048,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1, head_dim=64,
), 256000, 512, 2, tags=("mqa", "large_vocab"))
hf_phi_small = _lm("hf_phi_small", _hf(
    "PhiForCausalLM", "PhiConfig", vocab_size=51200, hidden_size=1024, intermediate_size=4096,
    num_hidden_layers=8, num_attention_heads=16,
), 51200, 1024, 4, "fp16", tags=("partial_rope",))
hf_opt_125m = _lm("hf_opt_125m", _hf("OPTForCausalLM", "OPTConfig"), 50272, 1024, 8)
hf_gpt_neox_small = _lm("hf_gpt_neox_small", _hf(
    "GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=50304, hidden_size=768, intermediate_size=3072,
    num_hidden_layers=6, num_attention_heads=12,
), 50304, 1024, 4)
hf_mixtral_small = _lm("hf_mixtral_small", _hf(
    "MixtralForCausalLM", "MixtralConfig", vocab_size=32000, hidden_size=512, intermediate_size=1024,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
    num_experts_per_tok=2, output_router_logits=True,
), 32000, 512, 4, tags=("moe",))
hf_qwen2_moe_small = _lm("hf_qwen2_moe_small", _hf(
    "Qwen2MoeForCausalLM", "Qwen2MoeConfig", vocab_size=151936, hidden_size=512, intermediate_size=1408,
    moe_intermediate_size=256, shared_expert_intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, num_experts=16, num_experts_per_tok=4,
    output_router_logits=True,
), 151936, 512, 2, tags=("moe", "large_vocab"))
hf_olmoe_small = _lm("hf_olmoe_small", _hf(
    "OlmoeForCausalLM", "OlmoeConfig", vocab_size=50304, hidden_size=512, intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=8, num_experts=16, num_experts_per_tok=4,
), 50304, 512, 4, tags=("moe",))


def _encoder_batch(vocab: int, seq: int, labels: str) -> Callable[[int], dict[str, torch.Tensor]]:
    """A tokenised batch as a collator makes it: ids, an all-ones attention mask, labels per sequence or token."""
    def make(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq))
        lab = ids.clone() if labels == "tokens" else torch.randint(0, 3, (n,))
        return {"input_ids": ids, "attention_mask": torch.ones(n, seq, dtype=torch.long), "labels": lab}

    return make


def _encoder(name: str, model: Callable[[], torch.nn.Module], vocab: int, seq: int, batch_size: int,
             labels: str, precision: str = "fp16", tags: tuple[str, ...] = ()) -> Workload:
    return Workload(
        name=name, description=f"encoder, {seq} tokens, labels per {labels}", model=model,
        batch=_encoder_batch(vocab, seq, labels), loss=hf_loss, optimizer=_adamw(5e-5), batch_size=batch_size,
        precision=precision, tags=("transformers", "transformer", "encoder", *tags),  # type: ignore[arg-type]
    )


hf_bert_base_mlm = _encoder("hf_bert_base_mlm", _hf("BertForMaskedLM", "BertConfig"), 30522, 512, 32, "tokens")
hf_roberta_cls = _encoder("hf_roberta_cls", _hf("RobertaForSequenceClassification", "RobertaConfig",
                                                 vocab_size=50265, num_labels=3, max_position_embeddings=514),
                          50265, 256, 32, "sequence")
hf_distilbert_cls = _encoder("hf_distilbert_cls", _hf("DistilBertForSequenceClassification", "DistilBertConfig",
                                                       num_labels=3), 30522, 512, 32, "sequence", "bf16")
hf_deberta_v3_small = _encoder("hf_deberta_v3_small", _hf(
    "DebertaV2ForSequenceClassification", "DebertaV2Config", vocab_size=128100, hidden_size=768,
    num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072, relative_attention=True,
    position_buckets=256, pos_att_type=["p2c", "c2p"], max_relative_positions=-1, position_biased_input=False,
    num_labels=3,
), 128100, 256, 16, "sequence", "bf16", ("relative_attention",))
hf_modernbert_mlm = _encoder("hf_modernbert_mlm", _hf(
    "ModernBertForMaskedLM", "ModernBertConfig", vocab_size=50368, hidden_size=768, intermediate_size=1152,
    num_hidden_layers=8, num_attention_heads=12,
), 50368, 512, 16, "tokens", "bf16", ("unpadding",))


def _seq2seq_batch(vocab: int, src: int, tgt: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda n: {"input_ids": torch.randint(0, vocab, (n, src)), "labels": torch.randint(0, vocab, (n, tgt))}


hf_t5_small = Workload(
    name="hf_t5_small", description="t5-small's shape, 512 source / 128 target tokens", batch_size=32,
    model=_hf("T5ForConditionalGeneration", "T5Config", d_model=512, d_ff=2048, num_layers=6, num_heads=8,
              vocab_size=32128, decoder_start_token_id=0, pad_token_id=0),
    batch=_seq2seq_batch(32128, 512, 128), loss=hf_loss, optimizer=_adamw(1e-4), precision="bf16",
    tags=("transformers", "transformer", "encoder_decoder", "attention_bias"),
)
hf_bart_base = Workload(
    name="hf_bart_base", description="bart-base's shape, 512 source / 128 target tokens", batch_size=16,
    model=_hf("BartForConditionalGeneration", "BartConfig", vocab_size=50265, d_model=768, encoder_layers=6,
              decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
              decoder_ffn_dim=3072),
    batch=_seq2seq_batch(50265, 512, 128), loss=hf_loss, optimizer=_adamw(5e-5), precision="fp16",
    tags=("transformers", "transformer", "encoder_decoder"),
)
hf_whisper_tiny = Workload(
    name="hf_whisper_tiny", description="whisper-tiny's shape: 30 s of 80-bin log-mel, 128 target tokens",
    model=_hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=51865, d_model=384,
              encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
              encoder_ffn_dim=1536, decoder_ffn_dim=1536, num_mel_bins=80),
    batch=lambda n: {"input_features": torch.randn(n, 80, 3000), "labels": torch.randint(0, 51865, (n, 128))},
    loss=hf_loss, optimizer=_adamw(1e-5), batch_size=16, precision="bf16",
    tags=("transformers", "transformer", "speech", "encoder_decoder"),
)


def _ctc_batch(n: int) -> dict[str, torch.Tensor]:
    # 5 s of 16 kHz audio and 80 characters per sample (no padding: -100 marks none)
    return {"input_values": torch.randn(n, 80000), "labels": torch.randint(1, 32, (n, 80))}


hf_wav2vec2_ctc = Workload(
    name="hf_wav2vec2_ctc", description="wav2vec2-base's shape, CTC over 32 characters, 5 s clips",
    model=_hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=32, mask_time_prob=0.0),
    batch=_ctc_batch, loss=hf_loss, optimizer=_adamw(1e-4), batch_size=8, precision="fp16",
    tags=("transformers", "transformer", "speech", "ctc"),
)


def _image_batch(size: int, classes: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda n: {"pixel_values": torch.randn(n, 3, size, size), "labels": torch.randint(0, classes, (n,))}


hf_vit_base = Workload(
    name="hf_vit_base", description="ViT-Base/16 classifier, 224x224", batch=_image_batch(224, 1000),
    model=_hf("ViTForImageClassification", "ViTConfig", num_labels=1000), loss=hf_loss, optimizer=_adamw(1e-4),
    batch_size=64, precision="bf16", tags=("transformers", "transformer", "vision", "vit"),
)
hf_swin_tiny = Workload(
    name="hf_swin_tiny", description="Swin-T classifier, 224x224", batch=_image_batch(224, 1000),
    model=_hf("SwinForImageClassification", "SwinConfig", num_labels=1000), loss=hf_loss, optimizer=_adamw(1e-4),
    batch_size=32, precision="fp16", tags=("transformers", "transformer", "vision", "swin"),
)
hf_convnext_tiny = Workload(
    name="hf_convnext_tiny", description="ConvNeXt-T classifier, 224x224", batch=_image_batch(224, 1000),
    model=_hf("ConvNextForImageClassification", "ConvNextConfig", num_labels=1000), loss=hf_loss,
    optimizer=_adamw(1e-4), batch_size=32, precision="fp32", tags=("transformers", "cnn", "vision"),
)
hf_segformer_b0 = Workload(
    name="hf_segformer_b0", description="SegFormer-B0, 150 classes (ADE20k), 512x512",
    model=_hf("SegformerForSemanticSegmentation", "SegformerConfig", num_labels=150),
    batch=lambda n: {"pixel_values": torch.randn(n, 3, 512, 512), "labels": torch.randint(0, 150, (n, 512, 512))},
    loss=hf_loss, optimizer=_adamw(6e-5), batch_size=8, precision="bf16",
    tags=("transformers", "transformer", "vision", "segmentation", "2d"),
)


def _clip() -> torch.nn.Module:
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(
        text_config={"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
                     "num_attention_heads": 8, "vocab_size": 49408},
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 6,
                       "num_attention_heads": 12, "patch_size": 32, "image_size": 224},
        projection_dim=512,
    ))


hf_clip_small = Workload(
    name="hf_clip_small", description="CLIP ViT-B/32 (6 layers each), contrastive loss over the batch",
    model=_clip,
    batch=lambda n: {"input_ids": torch.randint(0, 49408, (n, 77)), "pixel_values": torch.randn(n, 3, 224, 224),
                     "return_loss": True},
    loss=hf_loss, optimizer=_adamw(5e-4), batch_size=128, precision="bf16",
    tags=("transformers", "transformer", "vision", "contrastive"),
)


hf_hubert_ctc_no_layerdrop = Workload(
    name="hf_hubert_ctc_no_layerdrop", description="the second fresh draw's HuBERT CTC (h2_hf_hubert_ctc) with "
    "LayerDrop off: every layer runs in every step, as memfit's trace takes it; a diagnostic beside the draw's entry",
    model=_hf("HubertForCTC", "HubertConfig", vocab_size=32, mask_time_prob=0.0, layerdrop=0.0),
    batch=lambda n: {"input_values": torch.randn(n, 64000), "labels": torch.randint(1, 32, (n, 60))},
    loss=hf_loss, optimizer=_adamw(1e-4), batch_size=8, precision="fp16",
    tags=("transformers", "transformer", "speech", "ctc"),
)
