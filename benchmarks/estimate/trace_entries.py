"""The allocator's event stream of chosen corpus entries on a GPU, to set beside memfit's trace of them.

    python benchmarks/estimate/trace_entries.py c068_hf_encoder c077_hf_seq2seq --out $OUT    # GPU machine

One uncapped protocol run per entry (``memfit.estimate.measure.run_trial`` with ``--trace``: action, address,
size and top Python frame of every event), side by side; writes ``entry_traces_<card>.tar.gz``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus" / "corpus.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ids", nargs="+")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    import torch

    from memfit.estimate.measure import run_trial

    folder = Path(tempfile.mkdtemp())
    with cf.ThreadPoolExecutor(len(args.ids)) as pool:
        trials = list(pool.map(lambda i: run_trial(f"{CORPUS}:{i}", trace=str(folder / f"{i}.json.gz")), args.ids))
    for i, t in zip(args.ids, trials):
        print(i, t.ok, t.peak_allocated_bytes, t.peak_reserved_bytes, t.error[:200])
    card = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().split()[0]
    with tarfile.open(Path(args.out) / f"entry_traces_{card}.tar.gz", "w:gz") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f.name)


if __name__ == "__main__":
    main()
