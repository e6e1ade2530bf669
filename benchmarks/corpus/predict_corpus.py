"""Estimate every corpus entry on this CPU machine: one fresh ``memfit estimate`` process each, ``-j`` at a time.

    python benchmarks/corpus/predict_corpus.py -j 2                  # -> results/estimate/corpus_predictions_cpu_torch*_<date>/
    python benchmarks/corpus/predict_corpus.py --split validation --ids c003_tv_cls,c040_hf_lm

Resumable: an entry whose ``<id>.json`` exists is skipped unless ``--force``. Each record holds the whole
estimate JSON but its timeline and per-tensor lists, the torch version, and the process's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _results import RESULTS, stem  # noqa: E402

_DROP = ("timeline", "largest_tensors", "phases", "activations_by_module")


def predict_one(entry_id: str, out: Path, gpu: str, timeout_s: float) -> dict[str, Any]:
    spec = f"{HERE / 'corpus.py'}:{entry_id}"
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "memfit.cli", "estimate", spec, "--json", "--gpu", gpu],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        record: dict[str, Any] = {"id": entry_id, "error": f"timeout after {timeout_s:.0f} s", "wall_s": timeout_s}
    else:
        wall = round(time.perf_counter() - started, 2)
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if ln.startswith("memfit: error:")), lines[-1] if lines else "")
            record = {"id": entry_id, "error": err.removeprefix("memfit: error:").strip(), "exit_code": proc.returncode,
                      "wall_s": wall}
        else:
            est = json.loads(proc.stdout[proc.stdout.index("{"):])
            record = {"id": entry_id, "wall_s": wall, "estimate": {k: v for k, v in est.items() if k not in _DROP}}
    import torch

    record.update(torch=torch.__version__, machine=f"{os.cpu_count()} CPU cores", gpu=gpu, libraries=_libraries())
    (out / f"{entry_id}.json").write_text(json.dumps(record, indent=1))
    return record


def _libraries() -> dict[str, str]:
    """Versions of the model libraries the estimate ran with (they must match the measuring machine's)."""
    from importlib import metadata

    found = {}
    for name in ("transformers", "timm", "torchvision", "monai", "segmentation-models-pytorch", "peft"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import torch

    parser.add_argument("--out", default=str(RESULTS / "estimate" / stem("corpus_predictions", "cpu", torch.__version__)))
    parser.add_argument("--split", choices=("fit", "validation"))
    parser.add_argument("--ids", help="comma-separated entry ids")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--force", action="store_true", help="estimate again entries already predicted")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    import corpus

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = [e["id"] for e in corpus.entries(args.split) if not args.ids or e["id"] in args.ids.split(",")]
    todo = [i for i in ids if args.force or not (out / f"{i}.json").exists()]
    print(f"{len(todo)} of {len(ids)} entries to estimate, {args.jobs} at a time", flush=True)

    def one(entry_id: str) -> None:
        r = predict_one(entry_id, out, args.gpu, args.timeout)
        if "error" in r:
            print(f"{entry_id}: FAILED {r['error'][:160]}", flush=True)
        else:
            e = r["estimate"]
            print(f"{entry_id}: allocated {e['peak_allocated_bytes'] / 2**30:.2f} GiB, fits in "
                  f"{e['fits_in_bytes'] / 2**30:.2f} GiB ({r['wall_s']:.0f} s)", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, todo))


if __name__ == "__main__":
    main()
