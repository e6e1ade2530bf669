"""The Accelerate drop-in on CPU, one process: an injected OOM halves the micro-batch, doubles the accumulation,
and the training loop ends with the parameters of a plain Accelerate loop that never ran out of memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from integration_models import OomAbove, assert_same_parameters, require, tiny_gpt2, token_data

accelerate = require("accelerate")

from memfit.errors import StepOOMError, UsageError  # noqa: E402
from memfit.integrations.accelerate import _next_size, find_executable_batch_size  # noqa: E402

DATA = token_data(32)


def one_epoch(accelerator: Any, batch_size: int, oom: OomAbove | None = None) -> torch.nn.Module:
    """The user's loop, as Accelerate's docs write it: build, prepare, accumulate, step."""
    model = tiny_gpt2()
    if oom is not None:
        oom.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(DATA), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for (ids,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model)


def test_an_oom_halves_the_micro_batch_and_keeps_the_effective_batch() -> None:
    reference = one_epoch(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), 8)
    accelerator = accelerate.Accelerator(cpu=True)
    oom = OomAbove(limit=3)  # micro-batches of 8 and 4 run out of memory
    seen: list[tuple[int, int, int]] = []

    @find_executable_batch_size(starting_batch_size=8, starting_accumulation_steps=2, accelerator=accelerator)
    def train(batch_size: int, gradient_accumulation_steps: int) -> torch.nn.Module:
        seen.append((batch_size, gradient_accumulation_steps, accelerator.gradient_accumulation_steps))
        accelerator.free_memory()
        return one_epoch(accelerator, batch_size, oom)

    guarded = train()
    assert seen == [(8, 2, 2), (4, 4, 4), (2, 8, 8)]  # effective batch 16 every time
    assert oom.fired == 2
    # transformers computes the causal-LM loss in float32 (logits.float()): micro-batches of 2 instead of 8 change
    # its rounding, ~1e-7 of a gradient, 1e-9 of a parameter after 2 SGD steps at lr 1e-2
    assert_same_parameters(reference, guarded, rtol=0.0, atol=1e-9)


def test_the_micro_batch_stays_a_divisor_of_the_effective_batch() -> None:
    sizes, micro = [], 24
    while micro:
        sizes.append(micro)
        micro = _next_size(micro, 24)
    assert sizes == [24, 12, 6, 3, 1]
    assert _next_size(5, 10) == 2 and _next_size(1, 10) == 0


def test_an_oom_at_a_micro_batch_of_one_is_the_end() -> None:
    calls: list[int] = []

    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int, gradient_accumulation_steps: int) -> None:
        calls.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    with pytest.raises(StepOOMError, match="micro-batch of 1"):
        train()
    assert calls == [4, 2, 1]


def test_errors_that_are_not_ooms_pass_through_untouched() -> None:
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int, gradient_accumulation_steps: int) -> None:
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels"):
        train()
    with pytest.raises(UsageError, match="starting_batch_size must be a positive integer"):
        find_executable_batch_size(starting_batch_size=0)


def _rank_worker(rank: int, world: int, port: int, limit: int | None, out: str) -> None:
    """One rank of a 2-process CPU (gloo) DDP job, the single-process test's loop; a fake OOM on rank 1 only, above
    ``limit`` samples."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = accelerate.Accelerator(cpu=True)
    assert accelerator.num_processes == world
    seen: list[tuple[int, int]] = []

    @find_executable_batch_size(starting_batch_size=8, starting_accumulation_steps=2, accelerator=accelerator)
    def train(batch_size: int, gradient_accumulation_steps: int) -> torch.nn.Module:
        seen.append((batch_size, gradient_accumulation_steps))
        accelerator.free_memory()
        return one_epoch(accelerator, batch_size, OomAbove(limit) if rank == 1 else None)  # rank 1's OOMs only

    model = train()
    torch.save({"seen": seen, "state": model.state_dict()}, f"{out}.rank{rank}")
    torch.distributed.destroy_process_group()
    # the result is on disk: leave without C++ teardown, where a DDP/gloo worker thread left joinable after the
    # injected OOM aborted the process once in CI ("terminate called without an active exception")
    os._exit(0)


@pytest.mark.slow
def test_under_ddp_one_ranks_oom_restarts_every_rank_at_the_same_size(tmp_path: Any) -> None:
    """Two CPU ranks (gloo): only rank 1 runs out of memory; both leave the function, restart at the same smaller
    micro-batch, and end with the parameters of plain DDP without the OOM."""
    import socket

    import torch.multiprocessing as mp

    def launch(limit: int | None, out: str) -> list[dict[str, Any]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_worker, args=(2, port, limit, out), nprocs=2, join=True)
        return [torch.load(f"{out}.rank{r}") for r in range(2)]

    reference = launch(None, str(tmp_path / "reference"))
    guarded = launch(2, str(tmp_path / "guarded"))
    assert [r["seen"] for r in reference] == [[(8, 2)]] * 2
    assert [r["seen"] for r in guarded] == [[(8, 2), (4, 4), (2, 8)]] * 2  # rank 0 followed rank 1's OOMs
    for name, value in guarded[0]["state"].items():
        assert torch.equal(value, guarded[1]["state"][name]), name  # the ranks agree exactly
        # rank 0 never ran out of memory, yet restarted: same data, same mean gradient (float32 loss rounding)
        assert torch.allclose(value, reference[0]["state"][name], rtol=0.0, atol=1e-9), name
