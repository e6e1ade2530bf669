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

A fifteenth draw, written down on 2026-11-30 (session 38) after the fourteenth had set the bound's
``deterministic_algorithms`` width (15 %) and before memfit estimated or measured any of its steps: fresh steps (none
of the fourteenth's) to judge that width. The fourteenth found only half-precision dense-output convolutional
networks moving, so the draw is stratified: ``FRESH_DENSE`` steps whose name marks a dense output (segmentation,
registration, super-resolution, depth: ``DENSE_MARKS``) and ``FRESH_OTHER`` of the rest, each a seeded sample.
Every number from it is validation of that width: nothing in ``src`` is fitted to it.

A sixteenth draw, written down on 2026-11-30 (session 38) after the fifteenth had shown the width failing (HF DPT's
bound 11.8 % under its cap) and memfit had since traced bilinear and trilinear upsampling as CUDA runs them under
deterministic algorithms, with the width set to 0, and before memfit estimated or measured any of its steps:
``SIXTEENTH_DENSE`` dense and ``SIXTEENTH_OTHER`` other steps that neither earlier draw took, to judge that change.

A seventeenth draw, written down on 2026-11-30 (session 39) after the sixteenth had set the bound's
``deterministic_roi_align`` width (1.0) on torchvision's Faster and Mask R-CNN v2 and before memfit estimated or
measured any of its steps: not a sample but every other zoo step whose training calls torchvision's ``roi_align``
(``SEVENTEENTH``), none of them measured on the H200 before, to judge that width. Every number from it is validation
of the width: nothing in ``src`` is fitted to it.

    python benchmarks/zoo/deterministic.py           # prints the fourteenth draw's steps
    python benchmarks/zoo/deterministic.py fresh     # prints the fifteenth's
    python benchmarks/zoo/deterministic.py sixteenth # prints the sixteenth's
    python benchmarks/zoo/deterministic.py seventeenth
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

FRESH_SEED = 20261138
FRESH_DENSE = 12
FRESH_OTHER = 8
DENSE_MARKS = ("smp_", "nnunet", "unet", "fcn", "lraspp", "deeplab", "superres", "voxelmorph", "localnet", "dpt",
               "upernet", "segresnet", "conv_vae")
"""Name fragments of the zoo's steps with a dense (per-pixel or per-voxel) output."""
SIXTEENTH_SEED = 20261139
SIXTEENTH_DENSE = 10
SIXTEENTH_OTHER = 6
SEVENTEENTH = ["ho_tv_keypointrcnn", "tv_fasterrcnn_mobilenet", "tv_fasterrcnn_resnet50_fpn", "tv_maskrcnn_resnet50_fpn"]
"""The zoo's steps through torchvision's ``MultiScaleRoIAlign`` other than the two R-CNN v2 steps the width was
chosen on (``grep -rn rcnn benchmarks/zoo``)."""


def drawn() -> list[str]:
    """The steps of the fourteenth draw: a seeded sample of the measured candidates, sorted."""
    return sorted(random.Random(SEED).sample(candidates(), COUNT))


def _stratified(taken: list[str], seed: int, dense_count: int, other_count: int) -> list[str]:
    """Of the candidates not in ``taken``, a seeded sample of the dense ones and one of the rest, sorted."""
    left = sorted(set(candidates()) - set(taken))
    dense = [n for n in left if any(mark in n for mark in DENSE_MARKS)]
    other = [n for n in left if n not in dense]
    rng = random.Random(seed)
    return sorted(rng.sample(dense, dense_count) + rng.sample(other, other_count))


def drawn_fresh() -> list[str]:
    """The steps of the fifteenth draw: of the candidates the fourteenth did not take, a seeded sample of the dense
    ones and one of the rest, sorted."""
    return _stratified(drawn(), FRESH_SEED, FRESH_DENSE, FRESH_OTHER)


def drawn_sixteenth() -> list[str]:
    """The steps of the sixteenth draw: the same, of the candidates neither the fourteenth nor the fifteenth took."""
    return _stratified(drawn() + drawn_fresh(), SIXTEENTH_SEED, SIXTEENTH_DENSE, SIXTEENTH_OTHER)


def _deterministic() -> None:
    # what lightning.pytorch's _set_torch_flags(deterministic="warn") sets
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    print(",".join({"fresh": drawn_fresh, "sixteenth": drawn_sixteenth, "seventeenth": lambda: SEVENTEENTH}.get(
        sys.argv[1] if sys.argv[1:] else "", drawn)()))
else:
    globals().update(variants(drawn(), "det", _deterministic, "deterministic algorithms (warn only)", DETERMINISTIC))
    globals().update(variants(drawn_fresh(), "det2", _deterministic, "deterministic algorithms (warn only)",
                              DETERMINISTIC))
    globals().update(variants(drawn_sixteenth(), "det3", _deterministic, "deterministic algorithms (warn only)",
                              DETERMINISTIC))
    globals().update(variants(SEVENTEENTH, "det4", _deterministic, "deterministic algorithms (warn only)",
                              DETERMINISTIC))
