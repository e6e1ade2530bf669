"""memfit guard in a plain PyTorch loop, on CPU in a few seconds.

A GPU is not needed to see what happens: a forward pre-hook plays the part of a card that runs out of memory
above 8 samples per micro-batch. On a real GPU, delete the hook; the guard reacts to real CUDA OOMs the same way.

Run:  PYTHONPATH=src python examples/guard_example.py
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import memfit

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def pretend_small_gpu(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    if args[0].shape[0] > 8:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (pretend)")


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    model[0].register_forward_pre_hook(pretend_small_gpu)  # remove on a real GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, batch[1])  # a mean over the micro-batch's samples

    step = memfit.TrainStep(model, optimizer, loss_fn, precision="bf16", max_grad_norm=1.0)

    x, y = torch.randn(512, 32), torch.randint(0, 10, (512,))
    for _ in range(6):
        idx = torch.randint(0, 512, (50,))  # 50 samples: halving gives 9 micro-batches of 6, the last of 2
        metrics = step((x[idx], y[idx]))
        print(f"step {metrics.step}: loss {metrics.loss:.4f}, micro-batch {metrics.micro_batch_size} x "
              f"{metrics.micro_batches}, OOMs retried {metrics.ooms}")

    # The size found is part of the checkpoint, so a resumed run does not run out of memory again.
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "guard": step.state_dict()}
    resumed = memfit.TrainStep(model, optimizer, loss_fn, precision="bf16", max_grad_norm=1.0)
    resumed.load_state_dict(checkpoint["guard"])
    print(f"resumed at micro-batch size {resumed.micro_batch_size}; OOMs so far {resumed.total_ooms}")


if __name__ == "__main__":
    main()
