"""Per-rank memory balance on 2 GPUs: DistributedSampler vs BalancedBatchSampler, planted-cause diagnosis, and
FSDP2 vs DDP per-rank peak against the model-state formula.

Run on a 2-GPU host (about 2-3 minutes on 2 H100s):

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/multigpu_balance.py --out "$OUT"

Dry run of the logic on CPU with gloo (memory numbers are then absent):

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/multigpu_balance.py --device cpu --steps 2 \
        --samples 64 --max-side 256 --out /tmp/x

Writes ``multigpu_<ranks>x<card>_torch<X.Y>_<yyyymmdd>.json`` and ``.md`` into ``--out`` (default ``$OUT``, else
benchmarks/results/distributed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import RESULTS, card, stem  # noqa: E402
from memfit.data.balance import BalancedBatchSampler  # noqa: E402
from memfit.distributed.ranks import RankMemory, collect_rank_memory, diagnose, gather_rank_memory  # noqa: E402
from memfit.distributed.shard import model_state_memory, shard_model  # noqa: E402

MiB = 2**20


class UNet2D(nn.Module):
    """A small 2D U-Net (3 levels): activations grow with image area, as in real segmentation."""

    def __init__(self, channels: int = 3, classes: int = 2, width: int = 32) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

        w = width
        self.enc1, self.enc2, self.enc3 = block(channels, w), block(w, 2 * w), block(2 * w, 4 * w)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), block(4 * w, 2 * w)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2), block(2 * w, w)
        self.head = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(e3), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.head(d1)


class VariableImages(torch.utils.data.Dataset):
    """Synthetic images whose sides follow a long-tailed distribution (most ~256, a few up to 1024)."""

    def __init__(self, n: int, seed: int = 0, max_side: int = 1024) -> None:
        rng = np.random.default_rng(seed)
        # square images: padding to the batch's largest then tracks area, the cost the sampler balances
        sides = np.clip(rng.lognormal(np.log(256), 0.5, size=(n, 1)), 64, max_side)
        self.sizes = np.repeat(sides // 8 * 8, 2, axis=1).astype(np.int64)  # divisible by 4 for the U-Net

    def __len__(self) -> int:
        return len(self.sizes)

    def costs(self) -> np.ndarray:
        return (self.sizes[:, 0] * self.sizes[:, 1]).astype(np.float64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = (int(s) for s in self.sizes[i])
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, h, w, generator=g), torch.randint(0, 2, (h, w), generator=g)


def pad_collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the largest image of the batch: the padded batch is what costs GPU memory."""
    h = max(x.shape[1] for x, _ in batch)
    w = max(x.shape[2] for x, _ in batch)
    xs = torch.stack([F.pad(x, (0, w - x.shape[2], 0, h - x.shape[1])) for x, _ in batch])
    ys = torch.stack([F.pad(y, (0, w - y.shape[1], 0, h - y.shape[0]), value=-100) for _, y in batch])
    return xs, ys


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_sampler(mode: str, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict:
    """Train the U-Net under DDP for ``args.steps`` steps with one sampler; per-step peak of every rank."""
    dataset = VariableImages(args.samples, seed=1, max_side=args.max_side)
    if mode == "distributed":
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
        batches = torch.utils.data.BatchSampler(sampler, args.batch_size, drop_last=True)
    else:
        batches = BalancedBatchSampler(dataset.costs(), batch_size=args.batch_size, num_replicas=world, rank=rank,
                                       seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate, num_workers=2)
    torch.manual_seed(0)
    model = UNet2D().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    step_peaks, step_costs, step_padded = [], [], []
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        reset_peak(device)
        loss = F.cross_entropy(ddp(x), y, ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_peaks.append(peak_allocated(device) or 0)
        step_costs.append(float((y != -100).sum()))  # real pixels this rank processed
        step_padded.append(float(y.numel()))
    # peaks are reset every step, so the record's peak is the last step's: its batch is the one to compare
    local = collect_rank_memory(ddp, batch_cost=float(sum(step_costs)), max_batch_cost=step_padded[-1])
    # per-step peaks of all ranks: the rank with the worst batch of a step sets that step's memory
    table = torch.tensor([step_peaks, step_padded], dtype=torch.float64, device=device)  # NCCL needs CUDA tensors
    gathered = [torch.zeros_like(table) for _ in range(world)]
    dist.all_gather(gathered, table)
    report = gather_rank_memory(local)
    peaks = np.stack([g[0].cpu().numpy() for g in gathered])  # (ranks, steps)
    padded = np.stack([g[1].cpu().numpy() for g in gathered])
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result = {
        "sampler": mode,
        "steps": int(peaks.shape[1]),
        "padded_pixels_step_max_over_min_mean": float((padded.max(0) / np.maximum(padded.min(0), 1)).mean()),
        "padded_pixels_total": float(padded.sum()),
        "report": report.to_dict(),
    }
    if device.type == "cuda":
        result["step_peak_max_over_min_mean"] = float((peaks.max(0) / np.maximum(peaks.min(0), 1)).mean())
        result["run_peak_allocated_bytes_per_rank"] = [float(p.max()) for p in peaks]
        result["run_peak_max_over_min"] = float(peaks.max(1).max() / max(peaks.max(1).min(), 1))
    return result


def plant_data_parallel(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict:
    """Rank 0 alone trains with nn.DataParallel over all GPUs; the diagnosis must name it."""
    found: dict = {"planted": "nn.DataParallel"}
    if rank == 0:
        torch.manual_seed(0)
        devices = list(range(world)) if device.type == "cuda" else None
        model = UNet2D().to(device)
        dp = nn.DataParallel(model, device_ids=devices)
        opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)
        for d in devices or []:
            reset_peak(torch.device("cuda", d))
        for _ in range(3):
            side = 384 if device.type == "cuda" else 64
            x = torch.rand(4 * world, 3, side, side, device=device)
            y = torch.randint(0, 2, (4 * world, side, side), device=device)
            F.cross_entropy(dp(x), y).backward()  # outputs and loss are gathered on device_ids[0]
            opt.step()
            opt.zero_grad(set_to_none=True)
        records = [collect_rank_memory(dp, device=d) for d in (devices or [None])]
        findings = diagnose(records)
        found.update(detected=any(f.cause == "data_parallel" for f in findings),
                     findings=[f.to_dict() for f in findings],
                     peak_allocated_bytes_per_gpu=[r.peak_allocated_bytes for r in records])
        del dp, model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return found


def plant_missing_set_device(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict:
    """Rank 1 works on cuda:0, as a rank does when set_device is never called; run last (its context stays)."""
    if device.type != "cuda":
        return {"planted": "missing set_device", "skipped": "needs CUDA"}
    if rank != 0:
        torch.cuda.set_device(0)  # the plant: every non-zero rank ends up on GPU 0
    wrong = torch.device("cuda", torch.cuda.current_device())
    reset_peak(wrong)
    x = torch.randn(64 * MiB // 4, device=wrong)  # 64 MiB of "work"
    y = (x * 2).sum()
    torch.cuda.synchronize(wrong)
    local = collect_rank_memory(batch_cost=None)
    del x, y
    # back to our own GPU before the collective: NCCL's communicator is bound to it (device_id)
    torch.cuda.set_device(device)
    report = gather_rank_memory(local)
    return {"planted": "missing set_device", "detected": any(f.cause == "foreign_context" for f in report.findings),
            "report": report.to_dict()}


class StateHeavy(nn.Module):
    """Wide linear layers, small batch: parameters, grads and Adam state dominate the peak."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def run_sharding(strategy: str, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict:
    """Peak allocated of step 2 (optimizer state exists) under DDP or FSDP2, next to the formula."""
    width, depth = (4096, 16) if device.type == "cuda" else (64, 4)
    torch.manual_seed(0)
    model = StateHeavy(width, depth).to(device)
    # foreach=False: the foreach step adds ~1x params of intermediates (torch.optim docs), not in the formula
    formula = model_state_memory(model, strategy=strategy, world_size=world, optimizer="adamw")
    if strategy == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        shard_model(model)
        wrapped = model
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(8, width, device=device)
    peak = None
    for _ in range(2):
        reset_peak(device)
        wrapped(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = peak_allocated(device)
    del wrapped, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return {"strategy": strategy, "width": width, "depth": depth, "measured_peak_allocated_bytes": peak,
            "formula": formula.to_dict(),
            "measured_over_formula_total": (peak / formula.total_bytes) if peak else None}


def render(report: dict) -> str:
    def mib(b: float | None) -> str:
        return "-" if b is None else f"{b / MiB:,.0f} MiB"

    lines = [f"# Multi-GPU memory balance ({report['date']})", "",
             f"{report['world_size']} x {report['device_name']}, torch {report['torch']}, CUDA {report['cuda']}.", "",
             "## Samplers (U-Net 2D, variable-size images, DDP)", "",
             "| sampler | steps | per-step peak max/min (mean) | run peak per rank | run peak max/min | "
             "padded px max/min per step | padded px total |", "|---|---|---|---|---|---|---|"]
    for s in report["samplers"]:
        peaks = ", ".join(mib(p) for p in s.get("run_peak_allocated_bytes_per_rank", [])) or "-"
        lines.append(f"| {s['sampler']} | {s['steps']} | {s.get('step_peak_max_over_min_mean', '-')!s:.6} | {peaks} "
                     f"| {s.get('run_peak_max_over_min', '-')!s:.6} | "
                     f"{s['padded_pixels_step_max_over_min_mean']:.3f} | {s['padded_pixels_total']:.3g} |")
    lines += ["", "## Planted causes", ""]
    for p in report["planted"]:
        lines.append(f"- {p['planted']}: detected = {p.get('detected', p.get('skipped'))}")
    lines += ["", "## Model states: DDP vs FSDP2 (AdamW, fp32, foreach=False)", "",
              "| strategy | params | measured peak (rank 0) | formula resident | formula total | measured/formula |",
              "|---|---|---|---|---|---|"]
    for s in report["sharding"]:
        f = s["formula"]
        ratio = s["measured_over_formula_total"]
        lines.append(f"| {s['strategy']} | {f['num_params']:,} | {mib(s['measured_peak_allocated_bytes'])} | "
                     f"{mib(f['resident_bytes'])} | {mib(f['total_bytes'])} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Multi-GPU memory balance benchmark (run under torchrun).")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--max-side", type=int, default=1024)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "distributed"))
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # first, before any CUDA work: one context per GPU
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    start = time.perf_counter()
    samplers = [run_sampler(m, args, device, rank, world) for m in ("distributed", "balanced")]
    sharding = [run_sharding(s, args, device, rank, world) for s in ("ddp", "fsdp")]
    planted = [plant_data_parallel(args, device, rank, world), plant_missing_set_device(args, device, rank, world)]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, planted[0])
    planted[0] = gathered[0]  # rank 0 ran the DataParallel plant
    if rank == 0:
        report = {
            "schema": 1, "benchmark": "multigpu_balance", "date": dt.date.today().isoformat(),
            "world_size": world, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "args": vars(args),
            "samplers": samplers, "planted": planted, "sharding": sharding,
            "wall_s": round(time.perf_counter() - start, 1),
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = stem("multigpu", card(report["device_name"] if device.type == "cuda" else None, world),
                    torch.__version__)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / f"{name}.md").write_text(render(report))
        print(render(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    RankMemory  # noqa: B018 - imported for readers: the records the report is made of
    main()
