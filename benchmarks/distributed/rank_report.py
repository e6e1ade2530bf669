"""The per-rank report on real GPUs: no cause named on a clean run, the right cause for each planted one.

Four runs of a small GPT-like transformer (torch.nn only), each one process group of its own, each under a minute:

* ``clean`` — DDP, ``TrainStep`` + :class:`memfit.data.BalancedBatchSampler` on variable-length sequences, rank 1
  capped after a warm-up step (``set_per_process_memory_fraction``) so that it runs out of memory and every rank
  retries at a smaller micro-batch, as issue 16 measured. Per-rank peaks differ; no cause may be named.
* ``stray_context`` — rank 1 allocates on GPU 0 before ``torch.cuda.set_device``, then trains on its own GPU.
  Expected: ``foreign_context`` on rank 1 from NVML's pids.
* ``uneven_shapes`` — a length-sorted dataset cut into contiguous shards, so the last rank gets the longest
  sequences. Expected: ``uneven_batches`` on the last rank from ``max_batch_shape``.
* ``data_parallel`` — one process, ``nn.DataParallel`` over every GPU (run with plain ``python``, not torchrun).
  Expected: ``data_parallel`` from the module and the per-GPU peaks.

Each run writes ``ranks_<scenario>.json`` (the per-rank table, the report's JSON, what was expected and whether it
matched, plus the non-allocator spread the old rule used, device used - *peak* reserved). ``--summarize`` merges them
into ``rank_report_<machine>_torch<X.Y>_<date>.{json,md}``. ``benchmarks/distributed/ranks_device.sh`` runs all.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 4 benchmarks/distributed/rank_report.py --scenario clean
    PYTHONPATH=src python benchmarks/distributed/rank_report.py --scenario data_parallel
    PYTHONPATH=src python benchmarks/distributed/rank_report.py --summarize

CPU dry run of the code paths (gloo, tiny model, no cap and no plant: the expectations are not checked):

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/distributed/rank_report.py --device cpu \
        --scenario uneven_shapes --out /tmp/ranks
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _results import RESULTS, card, stem  # noqa: E402
from memfit.data.balance import BalancedBatchSampler  # noqa: E402
from memfit.distributed.ranks import RankMemory, RankReport, collect_rank_memory, diagnose, gather_rank_memory  # noqa: E402
from memfit.guard.microbatch import count_tokens  # noqa: E402
from memfit.guard.step import TrainStep  # noqa: E402

PAD = -100
MiB = 2**20
SCENARIOS = ("clean", "stray_context", "uneven_shapes", "data_parallel")
# the rule the report used before issue 16: > 200 MiB more (device used - peak reserved) on one GPU = a context
OLD_CONTEXT_THRESHOLD = 200 * MiB


class Shape:
    def __init__(self, cuda: bool) -> None:
        self.vocab, self.d_model, self.layers, self.heads = (8192, 768, 6, 12) if cuda else (64, 32, 2, 4)
        self.max_len, self.min_len, self.median_len = (1024, 32, 256) if cuda else (64, 4, 16)
        self.batch, self.samples, self.steps = (16, 2048, 12) if cuda else (4, 128, 3)


class TinyGPT(nn.Module):
    """Pre-norm causal transformer language model, sequences up to ``max_len``."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.zeros(s.max_len, s.d_model))
        layer = nn.TransformerEncoderLayer(s.d_model, s.heads, 4 * s.d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        x = self.blocks(self.embed(tokens) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.norm(x))


def token_loss(logits: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), mb[1].flatten(), ignore_index=PAD)


class Sequences(torch.utils.data.Dataset):
    """Random token sequences with log-normal lengths (most near the median, a long tail up to ``max_len``)."""

    def __init__(self, s: Shape, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.exp(torch.randn(s.samples, generator=g) * 0.6) * s.median_len
        self.lengths = lengths.clamp(s.min_len, s.max_len).long().tolist()
        self.vocab = s.vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.lengths[i],), generator=torch.Generator().manual_seed(i))


def pad_collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the batch's longest sequence: the padded shape is what costs memory."""
    n = max(len(x) for x in samples)
    tokens = torch.zeros(len(samples), n, dtype=torch.long)
    labels = torch.full((len(samples), n), PAD, dtype=torch.long)
    for i, x in enumerate(samples):
        tokens[i, : len(x)] = x
        labels[i, : len(x) - 1] = x[1:]
    return tokens, labels


def batches(scenario: str, s: Shape, rank: int, world: int) -> torch.utils.data.DataLoader:
    data = Sequences(s)
    if scenario == "uneven_shapes":
        # the plant: sorted by length (to cut padding), then cut into contiguous shards, so the last rank holds the
        # longest sequences (DistributedSampler would interleave; a hand-made shard does not)
        order = sorted(range(len(data)), key=lambda i: data.lengths[i])
        shard = order[rank * len(order) // world:(rank + 1) * len(order) // world]
        g = torch.Generator().manual_seed(rank)
        shard = [shard[i] for i in torch.randperm(len(shard), generator=g).tolist()]
        sampler: Any = [shard[i:i + s.batch] for i in range(0, len(shard) - s.batch + 1, s.batch)]
    else:
        sampler = BalancedBatchSampler(data.lengths, batch_size=s.batch, num_replicas=world, rank=rank, seed=0)
    return torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=pad_collate)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_ddp(scenario: str, s: Shape, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """Train under DDP through TrainStep; the largest micro-batch each rank attempted, the sizes it settled on."""
    torch.manual_seed(0)
    model = TinyGPT(s).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    step = TrainStep(ddp, torch.optim.AdamW(model.parameters(), lr=1e-4), token_loss, device=device,
                     precision="bf16" if device.type == "cuda" else "fp32", count_fn=count_tokens(1, ignore_index=PAD),
                     agree_timeout_s=120)
    # warm-up, the same on every rank, at the median length: optimizer state exists, and the cap below (60 % of this
    # step's growth) makes a typical padded batch (the longest of 16 samples, above the median) run out of memory
    # whole, while one row of the longest sequence (1/4 of the warm-up's tokens) still fits
    warm = pad_collate([torch.randint(0, s.vocab, (s.median_len,)) for _ in range(s.batch)])
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step(warm)
    capped = None
    if scenario == "clean" and rank == 1 and device.type == "cuda":
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        capped = torch.cuda.memory_reserved(device) + int(0.6 * (peak - before))  # the whole batch no longer fits
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(capped / total, device)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    largest: tuple[int, tuple[int, int]] = (0, (0, 0))
    sizes, ooms = [], 0
    for i, (tokens, labels) in enumerate(batches(scenario, s, rank, world)):
        if i >= s.steps:
            break
        # every rank attempts the size agreed so far (None: the whole batch) first: that sets its peak
        rows = tokens.shape[0] if step.micro_batch_size is None else min(step.micro_batch_size, tokens.shape[0])
        largest = max(largest, (rows * tokens.shape[1], (rows, tokens.shape[1])))
        metrics = step((tokens, labels))
        sizes.append(metrics.micro_batch_size)
        ooms += metrics.ooms
    sync(device)
    local = collect_rank_memory(ddp, max_batch_cost=float(largest[0]), max_batch_shape=largest[1])
    report = gather_rank_memory(local)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return {"report": report, "micro_batch_sizes": sizes, "ooms": ooms, "cap_bytes_rank1": capped}


def run_torchrun(args: argparse.Namespace) -> dict[str, Any] | None:
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    stray = None
    if cuda and args.scenario == "stray_context" and rank == 1:
        # the plant: a CUDA call before set_device lands on GPU 0 and creates a context there (kept alive)
        stray = torch.ones(64 * MiB // 4, device="cuda:0")
    if cuda:
        torch.cuda.set_device(local)  # first thing (apart from the plant): one context per GPU
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    result = train_ddp(args.scenario, Shape(cuda), device, rank, world)
    if rank == 0 and cuda:  # every rank is still alive (the barrier below): nvidia-smi's view, to cross-check NVML
        result["nvidia_smi_compute_apps"] = nvidia_smi_apps()
    del stray
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def run_data_parallel(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    s = Shape(cuda)
    devices = list(range(torch.cuda.device_count())) if cuda else []
    torch.manual_seed(0)
    model = TinyGPT(s).to("cuda:0" if cuda else "cpu")
    dp = nn.DataParallel(model, device_ids=devices or None)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-4)
    rows, length = s.batch * max(len(devices), 1), s.max_len // 2
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    for _ in range(4):
        tokens, labels = pad_collate([torch.randint(0, s.vocab, (length,)) for _ in range(rows)])
        if cuda:
            tokens, labels = tokens.cuda(0), labels.cuda(0)
        token_loss(dp(tokens), (tokens, labels)).backward()  # outputs gathered on device_ids[0], the loss there
        opt.step()
        opt.zero_grad(set_to_none=True)
    for d in devices:
        torch.cuda.synchronize(d)
    # one record per GPU of the process; each GPU's own micro-batch is rows / GPUs of the batch
    shape = (rows // max(len(devices), 1), length)
    records = [collect_rank_memory(dp, device=d, max_batch_shape=shape) for d in (devices or [None])]
    return {"report": RankReport(ranks=tuple(records), findings=diagnose(records)), "micro_batch_sizes": [rows],
            "ooms": 0, "nvidia_smi_compute_apps": nvidia_smi_apps() if cuda else None}


def expectation(scenario: str, world: int) -> dict[str, Any]:
    return {"clean": {"cause": None},
            "stray_context": {"cause": "foreign_context", "ranks": [1], "evidence": ["nvml_pids"]},
            # the rule prefers the batch's cost to its shape when both are recorded: either is the right evidence
            "uneven_shapes": {"cause": "uneven_batches", "ranks": [world - 1],
                              "evidence": ["max_batch_cost", "max_batch_shape"]},
            "data_parallel": {"cause": "data_parallel", "ranks": [0], "evidence": ["per_gpu_peaks"]}}[scenario]


def matches(expected: dict[str, Any], findings: list[dict[str, Any]]) -> bool:
    """The report's findings (as JSON) name the expected cause, on the expected ranks, from one of its evidence."""
    named = [f for f in findings if f["names_cause"]]
    if expected["cause"] is None:
        return not named
    return any(f["cause"] == expected["cause"] and list(f["ranks"]) == expected["ranks"]
               and set(expected["evidence"]) & set(f["evidence"]) for f in named)


def old_rule(ranks: tuple[RankMemory, ...]) -> dict[str, Any]:
    """What the pre-issue-16 rule saw: device used - *peak* reserved, against the current reserve."""
    old = [None if r.device_used_bytes is None or r.peak_reserved_bytes is None else
           r.device_used_bytes - r.peak_reserved_bytes for r in ranks]
    new = [r.non_allocator_bytes for r in ranks]
    known = [o for o in old if o is not None]
    return {"used_minus_peak_reserved_bytes": old, "used_minus_reserved_bytes": new,
            "old_rule_spread_bytes": max(known) - min(known) if len(known) >= 2 else None,
            "old_rule_would_name_foreign_context": len(known) >= 2 and max(known) - min(known) > OLD_CONTEXT_THRESHOLD}


def nvidia_smi_apps() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {exc}"


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def summarize(out: Path) -> None:
    runs = [json.loads(p.read_text()) for s in SCENARIOS if (p := out / f"ranks_{s}.json").exists()]
    if not runs:
        raise SystemExit(f"no ranks_<scenario>.json in {out}: run the scenarios first.")
    first = runs[0]
    gpus = max(r["world_size"] for r in runs)
    machine = card(first["device_name"] if first["device"] == "cuda" else None, gpus)
    name = stem("rank_report", machine, first["torch"], first["date"])
    merged = {"schema": 1, "benchmark": "rank_report", "machine": machine, "torch": first["torch"], "runs": runs}
    write(out / f"{name}.json", json.dumps(merged, indent=1) + "\n")
    lines = [f"# Per-rank report on {machine} ({first['date']}, torch {first['torch']})", "",
             "| run | ranks | expected | named (evidence) | right | old rule's spread (used - peak reserved) |",
             "|---|---|---|---|---|---|"]
    for r in runs:  # judged again here, so that every run is judged by the current expectations
        r["expected"] = expectation(r["scenario"], r["world_size"])
        r["matches"] = matches(r["expected"], r["report"]["findings"])
    for r in runs:
        named = "; ".join(f"{f['cause']} {f['ranks']} ({', '.join(f['evidence'])})"
                          for f in r["report"]["findings"] if f["names_cause"]) or "none"
        spread = r["old_rule"]["old_rule_spread_bytes"]
        lines.append(f"| {r['scenario']} | {r['world_size']} | {r['expected']['cause'] or 'no cause'} | {named} | "
                     f"{r['matches']} | {'-' if spread is None else f'{spread / MiB:.0f} MiB'} |")
    for r in runs:
        lines += ["", f"## {r['scenario']}", "", "```", r["table"], "```"]
    write(out / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS)
    parser.add_argument("--summarize", action="store_true", help="merge the ranks_<scenario>.json files in --out")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "distributed"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        summarize(out)
        return
    if args.scenario is None:
        parser.error("give --scenario or --summarize")
    start = time.perf_counter()
    if args.scenario == "data_parallel":
        result = run_data_parallel(args)
    elif "RANK" not in os.environ:
        parser.error(f"--scenario {args.scenario} runs under torchrun (torchrun --nproc-per-node N ...)")
    else:
        result = run_torchrun(args)
    if result is None:  # not rank 0
        return
    report: RankReport = result.pop("report")
    expected = expectation(args.scenario, len(report.ranks))
    cuda = args.device == "cuda"
    record = {
        "scenario": args.scenario, "date": dt.date.today().isoformat(), "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "world_size": len(report.ranks), "expected": expected, "matches": matches(expected, report.to_dict()["findings"]),
        "dry_run": not cuda, "wall_s": round(time.perf_counter() - start, 1), **result,
        "old_rule": old_rule(report.ranks), "table": report.format_table(), "report": report.to_dict(),
    }
    write(out / f"ranks_{args.scenario}.json", json.dumps(record, indent=1, default=str) + "\n")
    print(f"== {args.scenario}: expected {expected}, matches={record['matches']} ({record['wall_s']} s)")
    print(record["table"])


if __name__ == "__main__":
    main()
