"""Fine-tuning: frozen backbones (linear probe, partly frozen networks) and LoRA adapters (peft).

The optimizer gets every parameter, frozen or not, as most user code does: frozen ones never get a grad, so the
optimizer keeps no state for them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes import ce, hf_loss, images, lm_forward, tokens  # noqa: E402

from memfit import Workload  # noqa: E402

LIBRARY = "peft"  # the module's heaviest need; the frozen-backbone entries need only timm/torchvision


def _frozen_resnet50() -> torch.nn.Module:
    import torchvision

    model = torchvision.models.resnet50(weights=None, num_classes=37)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("fc."))
    return model


def _linear_probe_vit() -> torch.nn.Module:
    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=100)
    for p in model.parameters():
        p.requires_grad_(False)
    model.reset_classifier(100)  # a fresh head: the only trainable parameters
    return model


def _half_frozen_convnext() -> torch.nn.Module:
    import timm

    model = timm.create_model("convnext_tiny", pretrained=False, num_classes=10)
    for p in model.stem.parameters():
        p.requires_grad_(False)
    for stage in model.stages[:2]:
        for p in stage.parameters():
            p.requires_grad_(False)
    return model


def _gpt2_frozen_embeddings() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    model.transformer.wte.weight.requires_grad_(False)  # tied with lm_head: both frozen
    model.transformer.wpe.weight.requires_grad_(False)
    for block in model.transformer.h[:6]:
        for p in block.parameters():
            p.requires_grad_(False)
    return model


def _lora(build: Callable[[], torch.nn.Module], targets: list[str], task: str, r: int = 16) -> Callable[[], Any]:
    def make() -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(build(), LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05,
                                                  target_modules=targets, task_type=task))

    return make


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config())


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                        num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4))


def _bert_cls() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(num_labels=2))


def _adamw(p: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(p, lr=2e-4)


frozen_tv_resnet50_head = Workload(
    name="frozen_tv_resnet50_head", description="torchvision ResNet-50, all frozen but a 37-class head",
    model=_frozen_resnet50, batch=images(224, 37), loss=ce, optimizer=_adamw, batch_size=64, precision="fp32",
    tags=("torchvision", "frozen", "cnn"),
)
frozen_timm_vit_linear_probe = Workload(
    name="frozen_timm_vit_linear_probe", description="timm ViT-B/16 linear probe (backbone frozen), bf16",
    model=_linear_probe_vit, batch=images(224, 100), loss=ce, optimizer=_adamw, batch_size=128, precision="bf16",
    tags=("timm", "frozen", "transformer"),
)
frozen_timm_convnext_half = Workload(
    name="frozen_timm_convnext_half", description="timm ConvNeXt-T with stem and first two stages frozen",
    model=_half_frozen_convnext, batch=images(224, 10), loss=ce, optimizer=_adamw, batch_size=64,
    precision="fp16", tags=("timm", "frozen", "cnn"),
)
frozen_hf_gpt2_lower_half = Workload(
    name="frozen_hf_gpt2_lower_half", description="GPT-2 small, embeddings and first 6 blocks frozen",
    model=_gpt2_frozen_embeddings, batch=tokens(50257, 1024), forward=lm_forward, loss=hf_loss, optimizer=_adamw,
    batch_size=8, precision="bf16", tags=("transformers", "frozen", "transformer"),
)
lora_hf_gpt2 = Workload(
    name="lora_hf_gpt2", description="GPT-2 small + LoRA r=16 on c_attn (peft)",
    model=_lora(_gpt2, ["c_attn"], "CAUSAL_LM"), batch=tokens(50257, 1024), forward=lm_forward, loss=hf_loss,
    optimizer=_adamw, batch_size=8, precision="bf16", tags=("peft", "lora", "transformers", "transformer"),
)
lora_hf_llama = Workload(
    name="lora_hf_llama", description="Llama (2048 hidden, 8 layers) + LoRA r=16 on q/k/v/o (peft)",
    model=_lora(_llama, ["q_proj", "k_proj", "v_proj", "o_proj"], "CAUSAL_LM"), batch=tokens(32000, 1024),
    forward=lm_forward, loss=hf_loss, optimizer=_adamw, batch_size=4, precision="bf16",
    tags=("peft", "lora", "transformers", "transformer"),
)
lora_hf_llama_fp16 = lora_hf_llama.replace(name="lora_hf_llama_fp16", precision="fp16", batch_size=2)
lora_hf_bert_cls = Workload(
    name="lora_hf_bert_cls", description="BERT-base sequence classifier + LoRA r=8 on query/value (peft)",
    model=_lora(_bert_cls, ["query", "value"], "SEQ_CLS", r=8),
    batch=lambda n: {"input_ids": torch.randint(0, 30522, (n, 256)), "labels": torch.randint(0, 2, (n,))},
    loss=hf_loss, optimizer=_adamw, batch_size=32, precision="fp16",
    tags=("peft", "lora", "transformers", "transformer"),
)
