"""The allocator's event stream of chosen corpus entries on a GPU, to set beside memfit's trace of them.

    python benchmarks/estimate/trace_entries.py c068_hf_encoder c077_hf_seq2seq --out $OUT    # GPU machine
    python benchmarks/estimate/trace_entries.py c032_unet c032_unet@690000000 --out $OUT      # and one capped
    python benchmarks/estimate/trace_entries.py --zoo timm_vgg16_bn hf_mixtral_small --out $OUT  # zoo entries

One protocol run per argument (``memfit.estimate.measure.run_trial`` with ``--trace``: action, address, size and
top Python frame of every event), side by side; ``ID@BYTES`` runs under a memory cap of BYTES
(``set_per_process_memory_fraction``), to see what the allocator did where a capped run ran out of memory. Writes
``entry_traces_<card>.tar.gz`` (``ID.json.gz``, ``ID@BYTES.json.gz``) and the trials' outcomes beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus" / "corpus.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ids", nargs="+")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--zoo", action="store_true", help="the ids are the zoo's entries (benchmarks/zoo/)")
    args = parser.parse_args()
    import torch

    from memfit.estimate.measure import run_trial

    folder = Path(tempfile.mkdtemp())
    if args.zoo:
        sys.path.insert(0, str(HERE.parent / "zoo"))
        from registry import entries

        specs = {e.name: e.spec for e in entries([a.partition("@")[0] for a in args.ids])}
    else:
        specs = {a.partition("@")[0]: f"{CORPUS}:{a.partition('@')[0]}" for a in args.ids}

    def one(arg: str):  # noqa: ANN202
        entry, _, cap = arg.partition("@")
        return run_trial(specs[entry], cap_bytes=int(cap) if cap else None, trace=str(folder / f"{arg}.json.gz"))

    with cf.ThreadPoolExecutor(len(args.ids)) as pool:
        trials = list(pool.map(one, args.ids))
    outcomes = {}
    for i, t in zip(args.ids, trials):
        print(i, t.ok, t.peak_allocated_bytes, t.peak_reserved_bytes, t.num_alloc_retries, t.error[:200])
        outcomes[i] = {"ok": t.ok, "peak_allocated_bytes": t.peak_allocated_bytes,
                       "peak_reserved_bytes": t.peak_reserved_bytes, "num_alloc_retries": t.num_alloc_retries,
                       "error": t.error}
    card = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip().split()[0]
    (Path(args.out) / f"entry_traces_{card}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "trials": outcomes}, indent=1))
    with tarfile.open(Path(args.out) / f"entry_traces_{card}.tar.gz", "w:gz") as tar:
        for f in sorted(folder.iterdir()):
            tar.add(f, arcname=f.name)


if __name__ == "__main__":
    main()
