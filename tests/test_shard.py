"""Model-state formulas against real tensors (CPU), block finding, and FSDP2 on 2 gloo processes."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.nn as nn

from memfit.distributed.shard import compare_sharding, find_blocks, model_state_memory, shard_model


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(5, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _real_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int, int]:
    params = _tensor_bytes(model.parameters())
    grads = _tensor_bytes(p.grad for p in model.parameters())
    state = _tensor_bytes(v for s in opt.state.values() for v in s.values())
    return params, grads, state


@pytest.mark.parametrize("name,make,kwargs", [
    ("adamw", lambda p: torch.optim.AdamW(p), {}),
    ("adam", lambda p: torch.optim.Adam(p, amsgrad=True), {"amsgrad": True}),
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), {"momentum": 0.9}),
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1), {}),
    ("adagrad", lambda p: torch.optim.Adagrad(p), {}),
    ("rmsprop", lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True), {"momentum": 0.5, "centered": True}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ddp_formula_matches_real_tensors_after_one_step(name, make, kwargs, dtype) -> None:
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    opt = make(model.parameters())
    model(torch.randn(4, 5, dtype=dtype)).float().square().mean().backward()
    opt.step()
    params, grads, state = _real_state_bytes(model, opt)
    formula = model_state_memory(model, strategy="ddp", world_size=1, optimizer=name, param_dtype=dtype,
                                 state_dtype=dtype, **kwargs)
    assert (formula.params_bytes, formula.grads_bytes, formula.optimizer_state_bytes) == (params, grads, state)
    assert formula.buckets_bytes == grads
    assert model_state_memory(model, strategy="ddp", world_size=1, optimizer=name, gradient_as_bucket_view=True,
                              **kwargs).buckets_bytes == 0


def test_find_blocks_picks_repeated_layers_outermost() -> None:
    names = [n for n, _ in find_blocks(TinyTransformer())]
    assert names == ["layers.0", "layers.1", "layers.2"]
    assert [n for n, _ in find_blocks(TinyTransformer(), [nn.LayerNorm])] == [f"layers.{i}.norm" for i in range(3)]


def test_fsdp_shrinks_states_by_world_size_and_reports_transient() -> None:
    model = TinyTransformer(width=64, depth=8)
    cmp = compare_sharding(model, world_size=8, optimizer="adamw")
    # params + grads + 2 Adam buffers, fp32: 16 bytes/param under DDP (+ grad-sized buckets)
    assert cmp.ddp.params_bytes == 4 * cmp.ddp.num_params
    assert cmp.ddp.resident_bytes == 20 * cmp.ddp.num_params + 4 * len(list(model.parameters()))
    assert cmp.fsdp.params_bytes < cmp.ddp.params_bytes / 6  # 1/8 plus dim-0 padding
    block = sum(p.numel() for p in model.layers[0].parameters())
    assert cmp.fsdp.transient_bytes == 3 * 4 * block
    assert cmp.fsdp_saves_bytes > 0 and json.loads(json.dumps(cmp.to_dict()))["schema"] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyTransformer(width=20, depth=3)  # dims not divisible by 2 in places: padding matters
        formula = model_state_memory(model, strategy="fsdp", world_size=world, optimizer="adamw")
        sharding = shard_model(model)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 5)).square().mean().backward()
        opt.step()
        params, grads, state = _real_state_bytes(model, opt)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"real": [params, grads, state], "units": list(sharding.units),
                       "formula": [formula.params_bytes, formula.grads_bytes, formula.optimizer_state_bytes]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_on_two_gloo_processes_matches_formula_on_rank0(tmp_path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["units"] == ["layers.0", "layers.1", "layers.2", ""]
    assert rank0["real"] == rank0["formula"]  # rank 0 holds full ceil(dim0/2) shards: the formula is exact
    assert all(r1 <= r0 for r1, r0 in zip(rank1["real"], rank0["real"], strict=True))
