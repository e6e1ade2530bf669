"""A fourteenth draw, written down on 2026-11-30 (session 37) before memfit estimated or measured any of it: zoo steps
already measured on the H200, run again with PyTorch's deterministic algorithms, as Lightning's
``Trainer(deterministic="warn")`` sets them for a reproducible run.

That setting is ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a deterministic
implementation warns and runs), cuDNN's deterministic algorithms and no benchmark mode, and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's deterministic workspace). Deterministic algorithms may take other
workspaces than the ones memfit's trace charges (cuDNN's heuristics and the ops' default kernels): memfit does not
model the setting, so its estimate of such a step is the one it makes without it. Every number from this draw is
validation: nothing in ``src`` is fitted to it.

The steps: a seeded sample of ``allocator_draw.candidates()``, of any kind (convolutions, attention, embeddings,
scatter and index ops all have deterministic variants).

    python benchmarks/zoo/deterministic.py      # prints the drawn steps
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator_draw import candidates  # noqa: E402
from variants import variants  # noqa: E402

SEED = 20261132
COUNT = 12
DETERMINISTIC = "deterministic"


def drawn() -> list[str]:
    """The steps of the draw: a seeded sample of the measured candidates, sorted."""
    return sorted(random.Random(SEED).sample(candidates(), COUNT))


def _deterministic() -> None:
    # what lightning.pytorch's _set_torch_flags(deterministic="warn") sets
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    print(",".join(drawn()))
else:
    globals().update(variants(drawn(), "det", _deterministic, "deterministic algorithms (warn only)", DETERMINISTIC))
