"""Host memory of a 4-worker DataLoader over 1 M samples' metadata: Python list of dicts vs memfit SampleTable.

Each mode runs in a fresh interpreter. After one full epoch (persistent workers, so they are still alive) it
sums RSS, PSS and USS of the worker processes with psutil. PSS splits shared pages between the processes that
map them and USS counts only a process's private pages, so copy-on-read shows up as USS/PSS growth; RSS counts
shared pages in every worker and overstates. CPU only; about a minute on 2 cores.

Run: PYTHONPATH=src python benchmarks/data_host_memory.py [--samples 1000000] [--out DIR]

Writes ``data_host_memory_cpu_torch<X.Y>_<yyyymmdd>.{json,md}`` into ``--out`` (default benchmarks/results/data).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from _results import RESULTS, stem

MiB = 2**20


def _make_records(n: int) -> list[dict]:
    return [{"path": f"scenes/tile_{i:07d}.tif", "height": 256 + i % 512, "width": 256 + i % 384,
             "label": i % 21} for i in range(n)]


class ListDataset:
    """The common pattern: annotations parsed into a list of dicts."""

    def __init__(self, n: int) -> None:
        self.samples = _make_records(n)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        s = self.samples[i]  # reading touches the dict's and the strings' refcounts: their pages get copied
        return len(s["path"]) + s["height"] * s["width"] + s["label"]


class TableDataset:
    """The same metadata in a memfit SampleTable: a handful of NumPy arrays."""

    def __init__(self, n: int) -> None:
        from memfit.data.storage import SampleTable

        records = _make_records(n)
        self.table = SampleTable({k: [r[k] for r in records] for k in records[0]})
        del records

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> int:
        s = self.table[i]
        return len(s["path"]) + s["height"] * s["width"] + s["label"]


def _measure(mode: str, n: int, workers: int) -> dict:
    import gc

    import psutil
    import torch.utils.data

    dataset = ListDataset(n) if mode == "list" else TableDataset(n)
    gc.collect()
    gc.freeze()  # keep the parent's GC from touching (and un-sharing) the objects; workers still do on read
    parent = psutil.Process()
    parent_rss = parent.memory_info().rss
    loader = torch.utils.data.DataLoader(dataset, batch_size=1024, shuffle=True, num_workers=workers,
                                         persistent_workers=True,
                                         multiprocessing_context="fork")
    start = time.perf_counter()
    total = 0
    for batch in loader:
        total += int(batch.sum())
    epoch_s = time.perf_counter() - start
    children = parent.children(recursive=True)
    per_worker = []
    for child in children:
        info = child.memory_full_info()
        per_worker.append({"rss": info.rss, "pss": getattr(info, "pss", None), "uss": info.uss})
    result = {
        "mode": mode,
        "samples": n,
        "workers": len(per_worker),
        "parent_rss_bytes": parent_rss,
        "workers_rss_bytes": sum(w["rss"] for w in per_worker),
        "workers_pss_bytes": sum(w["pss"] or 0 for w in per_worker),
        "workers_uss_bytes": sum(w["uss"] for w in per_worker),
        "epoch_s": round(epoch_s, 2),
        "checksum": total,
    }
    del loader
    return result


def _machine() -> dict:
    import psutil
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "data"))
    parser.add_argument("--child", choices=["list", "table"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.samples, args.workers)))
        return
    results = []
    for mode in ("list", "table"):
        cmd = [sys.executable, __file__, "--child", mode, "--samples", str(args.samples), "--workers",
               str(args.workers)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    if results[0]["checksum"] != results[1]["checksum"]:
        raise SystemExit("the two datasets returned different data; the comparison would be meaningless")
    machine = _machine()
    name = stem("data_host_memory", "cpu", machine["torch"])
    report = {"schema": 1, "benchmark": "data_host_memory", "date": dt.date.today().isoformat(),
              "machine": machine, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# DataLoader host memory, {args.samples:,} samples' metadata, {args.workers} workers ({report['date']})",
        "",
        f"Machine: {report['machine']['cores']} cores, {report['machine']['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"{report['machine']['os']}, Python {report['machine']['python']}, torch {report['machine']['torch']}.",
        "Measured after one full shuffled epoch (batch 1024) with persistent workers; sums over the worker processes.",
        "",
        "| storage | parent RSS | workers RSS | workers PSS | workers USS | epoch s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['mode']} | {r['parent_rss_bytes'] / MiB:.0f} MiB | {r['workers_rss_bytes'] / MiB:.0f} "
                     f"MiB | {r['workers_pss_bytes'] / MiB:.0f} MiB | {r['workers_uss_bytes'] / MiB:.0f} MiB | "
                     f"{r['epoch_s']} |")
    lines += ["", "USS is memory private to the workers: for the list it is the metadata copied on read (a shuffled "
              "epoch touches pages all over the list in every worker). The table pays more Python per row "
              "(building a dict from arrays), hence the slower epoch.", ""]
    (out / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
