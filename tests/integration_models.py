"""Tiny random-weight models, data and injected OOMs shared by the integration tests (no downloads).

The OOM is fake ("mock the hardware, not the math"): a forward pre-hook raises ``torch.OutOfMemoryError`` when the
batch reaching the model has more than ``limit`` samples, as a GPU would at a batch too large for it. The
gradients are real, in float64, so runs with and without the injected OOM can be compared tightly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

TIGHT = {"rtol": 0.0, "atol": 1e-12}
VOCAB, SEQ = 100, 16


def require(module: str) -> Any:
    """Import a framework; skipped locally when it is missing, but CI (CI=true) installs the extra and must run."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def fake_oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                  "8.00 GiB of which 0 bytes is free. (injected by the test)")


class OomAbove:
    """A forward pre-hook that raises a fake OOM when the batch is larger than ``limit`` samples."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.fired = 0
        self.sizes: list[int] = []

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[0])
        self.sizes.append(n)
        if self.limit is not None and n > self.limit:
            self.fired += 1
            raise fake_oom()

    def attach(self, model: nn.Module) -> OomAbove:
        model.register_forward_pre_hook(self, with_kwargs=True)
        return self


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """GPT-2 with 2 layers of width 32 over a 100-token vocabulary, no dropout, float64."""
    transformers = require("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).double()


def token_data(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def assert_same_parameters(a: nn.Module, b: nn.Module, **tolerance: float) -> None:
    pairs = list(zip(a.state_dict().items(), b.state_dict().items(), strict=True))
    for (name, x), (_, y) in pairs:
        assert torch.allclose(x, y, **(tolerance or TIGHT)), f"{name} differs by {(x - y).abs().max()}"
