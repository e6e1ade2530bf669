"""What memory is for: the categories every estimate, explanation and picture splits bytes into.

PyTorch's own taxonomy (``torch.distributed._tools.mem_tracker._MemRefType``: parameters, buffers, gradients,
activations, temporaries, optimizer state) plus what a CUDA training step adds: the batch (``data``), library
workspaces (cuBLAS, cuDNN) and, from the allocator replay, fragmentation (reserved-but-unusable blocks).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MEMORY_CATEGORIES", "TRACED_CATEGORIES", "MemoryCategory", "TracedCategory"]

TracedCategory = Literal[
    "params", "buffers", "grads", "optimizer_state", "data", "activations", "temporaries", "workspaces",
]
"""What the tracer tags each allocation with."""
MemoryCategory = Literal[TracedCategory, "fragmentation"]
"""A part of the memory a step needs: a traced category, or the fragmentation the allocator replay adds."""

TRACED_CATEGORIES: tuple[TracedCategory, ...] = get_args(TracedCategory)
MEMORY_CATEGORIES: tuple[MemoryCategory, ...] = get_args(MemoryCategory)
"""In this order bottom to top in the pictures: what lives the whole run first, then what comes and goes within a
step, fragmentation last."""
