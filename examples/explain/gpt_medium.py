"""A GPT-2-medium-size decoder (350 M parameters) fine-tuned on 256-token sequences at batch 1: its peak is in
the first optimizer step, where AdamW creates its state while the gradients are alive.

    memfit explain examples/explain/gpt_medium.py --budget 7GiB --report gpt_medium.html
"""

import torch

import memfit
from memfit.workload.models import GPT

workload = memfit.Workload(
    name="gpt-medium",
    description="GPT-2 medium (24 layers, width 1024), 256 tokens, AdamW, bf16 autocast",
    model=lambda: GPT(dim=1024, layers=24, heads=16, seq_len=256),
    batch=lambda n: (torch.randint(0, 50257, (n, 256)), torch.randint(0, 50257, (n, 256))),
    loss=lambda out, batch: torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten()),
    optimizer=lambda params: torch.optim.AdamW(params, lr=3e-5, weight_decay=0.01),
    batch_size=1,
    precision="bf16",
)
