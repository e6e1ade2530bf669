"""A thirteenth draw, written down on 2026-11-30 (session 37) before memfit estimated or measured any of it:
convolutional zoo steps already measured on the H200, run again with ``torch.backends.cudnn.benchmark = True``.

nnU-Net turns cuDNN's benchmark mode on, so do timm's training script, Lightning's ``Trainer(benchmark=True)`` and
many hand-written loops. In it PyTorch times every algorithm of each new convolution shape with a workspace as large
as the largest algorithm asks, halved until the caching allocator grants it (``get_plans_from_find`` in
aten/src/ATen/native/cudnn/Conv_v8.cpp), empties the cache, and runs the fastest algorithm whose workspace it can then
allocate. memfit's trace charges the workspaces of the heuristics' choice (benchmark mode off), so its estimate of
such a step is the one it makes without the flag; this draw measures whether that holds. Every number from it is
validation: nothing in ``src`` is fitted to it.

Each entry is a zoo step drawn with a fixed seed from ``allocator_draw.candidates()`` tagged ``cnn``, its model built
after the flag is set (as a training script sets it before its first step). The flag is the process's: the
measurement runs each step in a fresh process (``memfit.estimate.measure.run_trial``).

    python benchmarks/zoo/cudnn_benchmark.py      # prints the drawn steps
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator_draw import candidates  # noqa: E402
from variants import variants, zoo_steps  # noqa: E402

SEED = 20261131
COUNT_2D, COUNT_3D = 10, 4
"""Steps drawn from the 2-D and the 3-D candidates (3-D training, nnU-Net's, is where benchmark mode is on most)."""
BENCHMARK = "cudnn_benchmark"


def drawn() -> list[str]:
    """The steps of the draw: seeded samples of the measured candidates tagged ``cnn``, 2-D and ``3d``, sorted."""
    steps = zoo_steps()
    names = [n for n in candidates() if "cnn" in steps[n].tags]
    rng = random.Random(SEED)
    flat = rng.sample([n for n in names if "3d" not in steps[n].tags], COUNT_2D)
    return sorted(flat + rng.sample([n for n in names if "3d" in steps[n].tags], COUNT_3D))


def _benchmark_on() -> None:
    torch.backends.cudnn.benchmark = True


if __name__ == "__main__":
    print(",".join(drawn()))
else:
    globals().update(variants(drawn(), "cb", _benchmark_on, "cudnn.benchmark on", BENCHMARK))
