"""Grouped-query attention decoders larger than the zoo's, written after session 15's grouped-key fix and predicted
before any was measured: they check that fix on steps that tuned nothing (the fix was found on the zoo's Mixtral).

    PYTHONPATH=/path/to/transformers-5.17:src python -m memfit.cli estimate benchmarks/estimate/gqa_cases.py:NAME --json
    python3 -m memfit.cli measure benchmarks/estimate/gqa_cases.py:NAME --json          # GPU

Hugging Face passes ``enable_gqa=True`` to SDPA when there is no attention mask (``use_gqa_in_sdpa``), as here: the
ids are their own labels and no padding mask is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
from recipes import hf_loss, lm_forward, tokens  # noqa: E402

from memfit import Workload  # noqa: E402


def _model(model_class: str, config_class: str, **config: object):  # noqa: ANN202
    def build() -> torch.nn.Module:
        import transformers

        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))

    return build


def _decoder(name: str, model, vocab: int, seq: int, batch_size: int) -> Workload:  # noqa: ANN001
    return Workload(name=name, model=model, batch=tokens(vocab, seq), forward=lm_forward, loss=hf_loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True), batch_size=batch_size,
                    precision="bf16")


llama_gqa_4k = _decoder("llama_gqa_4k", _model(
    "LlamaForCausalLM", "LlamaConfig", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
), 32000, 4096, 2)
"""A Llama-style decoder (TinyLlama's widths, 8 layers), 4 query heads per key head, 2 x 4096 tokens."""

qwen2_gqa_2k = _decoder("qwen2_gqa_2k", _model(
    "Qwen2ForCausalLM", "Qwen2Config", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=12, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
), 151936, 2048, 4)
"""Qwen2-0.5B's widths (12 of its 24 layers), 7 query heads per key head, 4 x 2048 tokens."""
