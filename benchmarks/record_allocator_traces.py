"""Record real CUDA caching-allocator traces to validate memfit's allocator replay (tests/test_allocator.py).

For each small workload defined below (torch only), run a few training steps on the GPU with
``torch.cuda.memory._record_memory_history`` on, and save one gzip JSON file per workload with:

* ``uncapped``: the ordered allocation stream ``[op, key, nbytes, ...]`` (flat), op +1 = ``alloc`` (nbytes is the
  entry's ``size``, which CUDACachingAllocator.cpp records as the raw requested size, before rounding), op -1 =
  ``free_completed`` (the moment the block returns to the pool; on one stream it follows ``free_requested``
  immediately), plus the real ``max_memory_allocated()`` / ``max_memory_reserved()``;
* ``capped``: the same workload again under ``set_per_process_memory_fraction(0.9 x uncapped peak reserved /
  total)``: its own stream, whether and where it ran out of memory, its peaks;
* ``segment_events``: ``[event index, action, addr, size]`` for each segment_alloc/free/map/unmap; the test
  replays with the real ``segment_alloc`` addresses, which decide ties between equal-sized free blocks;
* card name, torch version, CUDA version, date, the allocator settings in force.

Usage (on a CUDA machine; about a minute on one H100):

    python benchmarks/record_allocator_traces.py --out tests/data/allocator_traces

``--out`` defaults to ``$OUT`` when set, else ``tests/data/allocator_traces/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import gzip
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_ENTRIES = 1_000_000
STEPS = 3


# -- workloads ----------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        widths = [64, 128, 256, 512]
        layers, cin = [], 64
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallGPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 512, layers: int = 6, heads: int = 8, seq: int = 256) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def cnn(dtype: torch.dtype | None) -> Callable[[], None]:
    def run() -> None:
        model = SmallResNet().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(STEPS):
            x = torch.randn(64, 3, 96, 96, device="cuda")
            y = torch.randint(0, 100, (64,), device="cuda")
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def gpt() -> None:
    model = SmallGPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    for _ in range(STEPS):
        idx = torch.randint(0, 8192, (16, 256), device="cuda")
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def mlp() -> None:
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.GELU())], nn.Linear(2048, 10))
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        x = torch.randn(1024, 2048, device="cuda")
        loss = F.cross_entropy(model(x), torch.randint(0, 10, (1024,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


# name -> (allocator settings, step function)
WORKLOADS: dict[str, tuple[str, Callable[[], None]]] = {
    "resnet_fp32": ("", cnn(None)),
    "resnet_bf16_autocast": ("", cnn(torch.bfloat16)),
    "gpt_adamw_foreach": ("", gpt),
    "mlp_adam": ("", mlp),
    "gpt_adamw_expandable": ("expandable_segments:True", gpt),
    "gpt_adamw_max_split_32": ("max_split_size_mb:32", gpt),
}


# -- recording ----------------------------------------------------------------------------------------------------


def clean_allocator() -> None:
    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS workspaces are cached allocator blocks kept across steps
    torch.cuda.empty_cache()


def stream_from_trace(trace: list[dict]) -> tuple[list[int], list[list], int | None, int]:
    """Turn ``device_traces`` entries into the flat replay stream, segment events, OOM position, deferred frees."""
    events: list[int] = []
    segments: list[list] = []
    oom_event_index = None
    deferred_frees = 0
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action == "alloc":
            events += [1, entry["addr"], entry["size"]]
        elif action == "free_requested":
            after = trace[i + 1] if i + 1 < len(trace) else None
            if after is None or after["action"] != "free_completed" or after["addr"] != entry["addr"]:
                deferred_frees += 1  # the block waits for another stream: allocated drops before the pool gets it
        elif action == "free_completed":
            events += [-1, entry["addr"], 0]
        elif action == "oom":
            # the failing request never appears as 'alloc'; 'size' here is the rounded request
            oom_event_index = len(events) // 3
            events += [1, -1, entry["size"]]
            break
        elif action.startswith("segment_"):
            segments.append([len(events) // 3, action, entry["addr"], entry["size"]])
    return events, segments, oom_event_index, deferred_frees


def record_pass(step_fn: Callable[[], None], settings: str, capacity_fraction: float | None) -> dict:
    clean_allocator()
    # parseArgs resets max_split etc. but keeps expandable_segments unless named, so always name it (traces
    # recorded before this fix ran gpt_adamw_max_split_32 with the expandable segments of the workload before it)
    if "expandable_segments" not in settings:
        settings = ",".join(filter(None, ["expandable_segments:False", settings]))
    torch.cuda.memory._set_allocator_settings(settings)
    if capacity_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(capacity_fraction)
    torch.cuda.reset_peak_memory_stats()
    initial_reserved = torch.cuda.memory_reserved()
    initial_allocated = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES, clear_history=True
    )
    oom = False
    try:
        step_fn()
    except torch.OutOfMemoryError:
        oom = True
    torch.cuda.synchronize()
    gc.collect()
    snapshot = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)
    if capacity_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(1.0)

    trace = snapshot["device_traces"][torch.cuda.current_device()]
    events, segments, oom_event_index, deferred_frees = stream_from_trace(trace)
    return {
        "capacity_fraction": capacity_fraction,
        "capacity_bytes": None,  # filled by the caller, which knows the total
        "oom": oom,
        "oom_event_index": oom_event_index,
        "max_memory_allocated": stats["allocated_bytes.all.peak"],
        "max_memory_reserved": stats["reserved_bytes.all.peak"],
        "max_requested_bytes": stats.get("requested_bytes.all.peak"),
        "num_alloc_retries": stats["num_alloc_retries"],
        "num_ooms": stats["num_ooms"],
        "initial_reserved_bytes": initial_reserved,
        "initial_allocated_bytes": initial_allocated,
        "truncated": len(trace) >= MAX_ENTRIES,
        "deferred_frees": deferred_frees,
        "num_events": len(events) // 3,
        "events": events,
        "segment_events": segments,
    }


def write_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(payload, f, separators=(",", ":"))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "tests/data/allocator_traces")))
    parser.add_argument("--only", nargs="*", default=None, help=f"workloads to run, of {sorted(WORKLOADS)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script records real GPU traces", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    total = torch.cuda.mem_get_info()[1]
    for name, (settings, step_fn) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        uncapped = record_pass(step_fn, settings, None)
        fraction = 0.9 * uncapped["max_memory_reserved"] / total
        capped = record_pass(step_fn, settings, fraction)
        # CUDACachingAllocator::setMemoryFraction: allowed = size_t(fraction * total from cudaMemGetInfo)
        capped["capacity_bytes"] = int(fraction * total)
        payload = {
            "schema": 1,
            "workload": name,
            "allocator_settings": settings,
            "device": props.name,
            "total_memory_bytes": total,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "steps": STEPS,
            "event_format": "flat [op, key, nbytes]*: +1 alloc (raw requested bytes), -1 free_completed",
            "uncapped": uncapped,
            "capped": capped,
        }
        write_atomic(args.out / f"{name}.json.gz", payload)
        print(
            f"{name:26s} events {uncapped['num_events']:6d}  allocated {uncapped['max_memory_allocated'] / 2**20:8.1f}"
            f" MiB  reserved {uncapped['max_memory_reserved'] / 2**20:8.1f} MiB  | cap {capped['capacity_bytes'] / 2**20:8.1f}"
            f" MiB oom={capped['oom']} reserved {capped['max_memory_reserved'] / 2**20:8.1f} MiB"
            f"  ({time.perf_counter() - start:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
