"""Fit-side probes of the classes the validation half found farthest off, built by hand with other shapes.

The validation half tunes nothing, so its worst entries (an fp32 LSTM language model's cap -12.8 %, a bf16 GRU's
+16 %, fp32 ``nn.TransformerEncoder`` steps +14 % and +7.5 %) are studied here on steps of the same families
with different sizes, optimizers and loops, measured with their allocator streams
(``diagnose_gap.py --cases probe_cases.py``). Each is a corpus-shaped entry, built by the corpus's own families.

    memfit estimate benchmarks/estimate/probe_cases.py:p_lstm_fp32_keep
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "corpus"))

from corpus import entry_workload  # noqa: E402
from generate import draw_supplement  # noqa: E402

import memfit  # noqa: E402


def _e(id_: str, family: str, params: dict[str, Any], precision: str, optimizer: dict[str, Any], batch: int,
       keep: bool) -> dict[str, Any]:
    return {"id": id_, "split": "fit", "family": family, "description": f"probe {id_}", "params": params,
            "precision": precision, "optimizer": optimizer, "batch_size": batch, "keep_output": keep}


PROBES = {e["id"]: e for e in (
    _e("p_lstm_fp32_keep", "rnn", {"cell": "lstm", "task": "lm", "hidden": 320, "layers": 3, "seq": 48,
                                   "vocab": 12000, "embed": 320},
       "fp32", {"name": "AdamW", "impl": "for-loop", "lr": 1e-3, "weight_decay": 0.01}, 48, True),
    _e("p_lstm_fp32_drop", "rnn", {"cell": "lstm", "task": "lm", "hidden": 256, "layers": 2, "seq": 96,
                                   "vocab": 8000, "embed": 256},
       "fp32", {"name": "Adam", "impl": "foreach", "lr": 1e-3}, 80, False),
    _e("p_gru_bf16", "rnn", {"cell": "gru", "task": "lm", "hidden": 384, "layers": 1, "seq": 192, "vocab": 12000,
                             "embed": 384},
       "bf16", {"name": "Adam", "impl": "fused", "lr": 1e-3}, 96, False),
    _e("p_enc_fp32_ckpt", "torch_encoder", {"dim": 384, "heads": 6, "layers": 3, "vocab": 12000, "seq": 384,
                                            "norm_first": False, "checkpoint": True},
       "fp32", {"name": "AdamW", "impl": "for-loop", "lr": 1e-3, "weight_decay": 0.01}, 48, False),
    _e("p_enc_fp32_prenorm", "torch_encoder", {"dim": 512, "heads": 8, "layers": 4, "vocab": 12000, "seq": 192,
                                               "norm_first": True, "checkpoint": False},
       "fp32", {"name": "Adam", "impl": "fused", "lr": 1e-3}, 24, True),
    # the second round: 3-layer fp32 LSTMs that keep the output, and a long bf16 GRU, nearer the two RNN entries the
    # validation half still finds farthest off (c098 cap -12.8 %, c095 +16 %), with other sizes and optimizers
    _e("p_lstm3_fp32_a", "rnn", {"cell": "lstm", "task": "lm", "hidden": 256, "layers": 3, "seq": 48, "vocab": 12000,
                                 "embed": 256},
       "fp32", {"name": "Adam", "impl": "for-loop", "lr": 1e-3, "weight_decay": 0.01}, 96, True),
    _e("p_lstm3_fp32_b", "rnn", {"cell": "lstm", "task": "lm", "hidden": 192, "layers": 3, "seq": 80, "vocab": 8000,
                                 "embed": 192},
       "fp32", {"name": "Adam", "impl": "foreach", "lr": 1e-3}, 64, True),
    _e("p_lstm3_fp32_c", "rnn", {"cell": "lstm", "task": "lm", "hidden": 320, "layers": 3, "seq": 64, "vocab": 9000,
                                 "embed": 320},
       "fp32", {"name": "AdamW", "impl": "for-loop", "lr": 1e-3, "weight_decay": 0.01}, 48, True),
    _e("p_gru_bf16_long", "rnn", {"cell": "gru", "task": "lm", "hidden": 256, "layers": 1, "seq": 320, "vocab": 12000,
                                  "embed": 384},
       "bf16", {"name": "AdamW", "impl": "fused", "lr": 1e-3, "weight_decay": 0.01}, 96, False),
)}
# the third round (2026-11-27): not built by hand but drawn by the corpus's generator with another seed, all fit
# data: 16 RNN steps (the two validation entries above still off) and 6 fp16 torchvision classifiers (c005, a
# fp16 RegNet, +3.4 % allocated)
PROBES.update({e["id"]: e for e in draw_supplement("rnn", 16) + draw_supplement("tv_cls", 6, precision="fp16")})
# the fourth round: the validation half's two entries still farthest off after the third (c095, a one-layer bf16 GRU
# language model whose cap is +16 % over; c005, an fp16 RegNet whose allocated peak is +3.4 % over), the same
# generator narrowed to their class: GRU language models, and fp16 RegNets (batches, optimizers and loops drawn)
PROBES.update({e["id"]: e for e in draw_supplement(
    "rnn", 6, tag="gru_lm", where=lambda e: e["params"]["cell"] == "gru" and e["params"]["task"] == "lm")})
PROBES.update({e["id"]: e for e in draw_supplement(
    "tv_cls", 4, precision="fp16", tag="regnet", where=lambda e: e["params"]["arch"].startswith("regnet"))})

# the fifth round (2026-11-27, session 11): c095's cap stayed +16 % over while every GRU language model drawn or built
# so far landed at +1 %, and memfit's allocator replay of c095 opens a second fp32-logits segment in step 2 that the
# GPU did not. The hypothesis is about block reuse around large bf16 logits and their fp32 copies: one-layer GRU
# language models near that size, one knob moved at a time (vocabulary, batch, embedding, cell, optimizer), all
# fit data; memfit's replay opens the extra segment in each of them
_P5_BASE = {"cell": "gru", "task": "lm", "hidden": 256, "layers": 1, "seq": 256, "vocab": 10000, "embed": 512}
_P5_ADAMW = {"name": "AdamW", "impl": "fused", "lr": 1e-3, "weight_decay": 0.01}
PROBES.update({e["id"]: e for e in (
    _e("p5_gru_v9000", "rnn", {**_P5_BASE, "vocab": 9000}, "bf16", _P5_ADAMW, 128, False),
    _e("p5_gru_v11000", "rnn", {**_P5_BASE, "vocab": 11000}, "bf16", _P5_ADAMW, 128, False),
    _e("p5_gru_b112", "rnn", _P5_BASE, "bf16", _P5_ADAMW, 112, False),
    _e("p5_gru_b144", "rnn", _P5_BASE, "bf16", _P5_ADAMW, 144, False),
    _e("p5_gru_e384", "rnn", {**_P5_BASE, "embed": 384}, "bf16", _P5_ADAMW, 128, False),
    _e("p5_lstm", "rnn", {**_P5_BASE, "cell": "lstm"}, "bf16", _P5_ADAMW, 128, False),
    _e("p5_gru_foreach", "rnn", _P5_BASE, "bf16", {**_P5_ADAMW, "impl": "foreach"}, 128, False),
    _e("p5_gru_h320", "rnn", {**_P5_BASE, "hidden": 320}, "bf16", _P5_ADAMW, 128, False),
)})

# and, after that rule, the validation half's farthest entries were over-asks in three other families (a frozen
# EfficientNet +9.1 %, an fp32 MLP +8.4 %, a bf16 3-D U-Net +6.0 %): the generator's plain draws of those families
PROBES.update({e["id"]: e for family in ("frozen_cnn", "mlp", "unet") for e in draw_supplement(family, 6, tag="r5")})


def __getattr__(name: str) -> memfit.Workload:
    if name in PROBES:
        return entry_workload(PROBES[name])
    raise AttributeError(name)
