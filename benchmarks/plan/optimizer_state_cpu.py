"""The CPU-side facts behind memfit's optimizer-state model (``memfit.estimate.optimizer_twins``,
``memfit.speed.step_time.HOST_ADAM_BYTES_PER_S``), measured without a GPU:

* the buffers inductor's generated code allocates for one compiled 8-bit Adam update (torchao's ``AdamW8bit`` on a
  1024 × 768 parameter; ``TORCH_LOGS=output_code``): the wrapper's ``call()`` is written out;
* how fast this host's fused ``torch.optim.AdamW`` streams (20M fp32 elements, median of 5 steps).

    PYTHONPATH=src:<torchao> python benchmarks/plan/optimizer_state_cpu.py --out benchmarks/results/plan

Writes ``adamw8bit_inductor_cpu_torch<X.Y>_<date>.txt`` and ``host_adamw_cpu_torch<X.Y>_<date>.json``. About a
minute on a 2-core CPU (the compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _results import stem  # noqa: E402

_COMPILE = """
import torch
from torchao.optim import AdamW8bit
p = torch.nn.Parameter(torch.randn(1024, 768))
p.grad = torch.randn_like(p)
AdamW8bit([p], lr=1e-3).step()
"""


def inductor_call() -> str:
    """The ``call()`` of the wrapper inductor generates for one 8-bit update, from a fresh process's log."""
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, check=True,
                         env={**os.environ, "TORCH_LOGS": "output_code"})
    lines = [line.split("[__output_code]", 1)[1] for line in run.stderr.splitlines() if "[__output_code]" in line]
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("def call(self, args)"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("return"))
    return "\n".join(lines[start:end + 1])


def host_adamw(n: int = 20_000_000) -> dict[str, float]:
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    # parameter, gradient and two moments read, three written: 7 passes of 4 bytes
    return {"numel": n, "median_s": t, "bytes_per_s": 28 * n / t, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    import torchao

    args.out.mkdir(parents=True, exist_ok=True)
    call = inductor_call()
    txt = args.out / f"{stem('adamw8bit_inductor', 'cpu', torch.__version__)}.txt"
    txt.write_text(f"# torch {torch.__version__}, torchao {torchao.__version__}: AdamW8bit on a (1024, 768) fp32 "
                   "parameter, block 256; the generated wrapper's call()\n" + call + "\n")
    host = {"torch": torch.__version__, **host_adamw()}
    path = args.out / f"{stem('host_adamw', 'cpu', torch.__version__)}.json"
    path.write_text(json.dumps(host, indent=2) + "\n")
    print(call)
    print(json.dumps(host, indent=2))


if __name__ == "__main__":
    main()
