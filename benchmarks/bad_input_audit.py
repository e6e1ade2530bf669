"""Audit: bad and hostile inputs as a new user gives them, through the CLI and the Python API (issue 14).

    python benchmarks/bad_input_audit.py --out benchmarks/results/cli     # CPU only; about 4 minutes on 2 cores

memfit's rule for bad input is one line (what was wrong, the value, what to do), exit code 2 in the CLI, no
traceback, nothing the user owns lost or half-written; a valid input gets the right answer. Each case is judged:

* ``ok``: the rule held (or, for a valid input, exit 0 and the right answer);
* ``traceback``: a traceback, several lines, or (API) an exception that is not a ``MemfitError``;
* ``silent-wrong``: exit 0 or no exception where an error was due, or a wrong answer;
* ``leftover``: files left behind (a temporary file, a half-written output);
* ``hang``: no answer in ``HANG_S`` seconds;
* ``other``: the right kind of message with the wrong exit code, or a message missing what it must say.

Writes ``bad_input_audit_cpu_torch<x.y>_<yyyymmdd>.json`` (one row per case) and ``.md`` (the summary and every failure). The
cases are not the test suite's (tests/test_bad_inputs.py): most are other inputs of the same classes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 180  # the slowest case takes about 10 s on 2 cores

TINY = """\
import torch, memfit
workload = memfit.Workload(
    model=lambda: torch.nn.Linear(8, 4),
    batch=lambda n: (torch.randn(n, 8), torch.randn(n, 4)),
    loss=lambda out, batch: ((out - batch[1]) ** 2).mean(),
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    batch_size=4,
)
"""


def tiny(**replace: str) -> str:
    text = TINY
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


def net(forward: str, init: str = "self.a = torch.nn.Linear(8, 4)") -> str:
    """A workload file whose model is ``Net``: ``init`` after ``super().__init__()``, then ``forward``'s body
    (lines 4 and 6 of the file; a second line of either is indented by the caller)."""
    return ("import sys, torch, memfit\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
            f"        super().__init__(); {init}\n    def forward(self, x):\n        {forward}\n"
            + tiny(**{"lambda: torch.nn.Linear(8, 4)": "Net"}))


@dataclasses.dataclass
class Case:
    name: str
    group: str
    args: tuple[str, ...] = ()
    """CLI arguments ({d} is the case's folder); empty for an API case."""
    api: Callable[[Path], Any] | None = None
    files: dict[str, str | bytes] = dataclasses.field(default_factory=dict)
    """Files to create in the case's folder first (name -> text or bytes; a name ending in / is a folder)."""
    expect: str = "error"
    """``error``: one line, exit ``code``; ``ok``: exit 0 and ``check`` passes."""
    needle: str = ""
    """Text the error line must hold."""
    code: int = 2
    check: Callable[[Any, Path], bool] | None = None
    """For ``expect="ok"``: CLI (CompletedProcess, folder) or API (result, folder) -> right answer."""
    full_disk: bool = False
    interrupt: bool = False
    """Send Ctrl-C (SIGINT) once the file ``started`` appears in the folder."""
    writes: tuple[str, ...] = ()
    """Files a successful run may leave in the folder."""


def _json_ok(key: str = "peak_allocated_bytes") -> Callable[[Any, Path], bool]:
    def check(out: Any, d: Path) -> bool:
        try:
            return json.loads(out.stdout)[key] is not None
        except (ValueError, KeyError):
            return False

    return check


def _plan_check(micro: int, acc: int, impl: str) -> Callable[[Any, Path], bool]:
    def check(out: Any, d: Path) -> bool:
        c = json.loads(out.stdout)["chosen"]["config"]
        return (c["micro_batch"], c["accumulation_steps"], c["optimizer_impl"]) == (micro, acc, impl)

    return check


# ----------------------------------------------------------------------------------------------- CLI cases

SHAPE_BUG = net("return self.encoder(x)",
                "self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(15, 4))")
PLAN = ("plan", "mlp", "--budget", "8GiB")

CLI: list[Case] = [
    # usage
    Case("misspelled command", "usage", ("estimat", "mlp"), needle="No such command 'estimat'"),
    Case("missing argument", "usage", ("estimate",), needle="Missing argument"),
    Case("misspelled option", "usage", ("estimate", "mlp", "--budgett", "4GiB"), needle="--budgett"),
    Case("option without value", "usage", ("estimate", "mlp", "-b"), needle="requires an argument"),
    Case("extra argument", "usage", ("estimate", "mlp", "extra"), needle="extra"),
    Case("bare memfit", "usage", (), needle="", code=2),
    Case("--version", "usage", ("--version",), expect="ok", check=lambda o, d: o.stdout.startswith("memfit ")),
    Case("batch 2.5", "usage", ("estimate", "mlp", "--batch-size", "2.5"), needle="2.5"),
    Case("batch -3", "usage", ("estimate", "mlp", "--batch-size", "-3"), needle="-3"),
    Case("batch 10^23", "usage", ("estimate", "mlp", "--batch-size", "99999999999999999999999"),
         needle="at most"),
    Case("batch abc", "usage", ("estimate", "mlp", "--batch-size", "abc"), needle="abc"),
    Case("batch 2^31-1", "usage", ("estimate", "mlp", "--batch-size", "2147483647", "--json"), expect="ok",
         check=_json_ok()),
    Case("budget 400 digits", "usage", ("estimate", "mlp", "--budget", "9" * 400 + "GiB"), needle="1 EiB"),
    Case("budget negative", "usage", ("estimate", "mlp", "--budget", "-1GiB"), needle="-1GiB"),
    Case("budget zero", "usage", ("estimate", "mlp", "--budget", "0"), needle="positive"),
    Case("budget unit XB", "usage", ("estimate", "mlp", "--budget", "24XB"), needle="XB"),
    Case("budget empty", "usage", ("estimate", "mlp", "--budget", ""), needle="cannot read the size"),
    Case("budget nan", "usage", ("estimate", "mlp", "--budget", "nan"), needle="nan"),
    Case("budget inf", "usage", ("estimate", "mlp", "--budget", "inf"), needle="inf"),
    Case("precision FP32", "usage", ("estimate", "mlp", "--precision", "FP32"), needle="FP32"),
    Case("gpu empty", "usage", ("estimate", "mlp", "--gpu", ""), needle="name a GPU"),
    Case("plan without budget", "usage", ("plan", "mlp"), needle="--budget"),
    Case("margin negative", "usage", (*PLAN, "--margin", "-0.1"), needle="--margin"),
    Case("margin inf", "usage", (*PLAN, "--margin", "1e309"), needle="--margin"),
    Case("effective batch 0", "usage", (*PLAN, "--effective-batch", "0"), needle="--effective-batch"),
    Case("effective batch 2.5", "usage", (*PLAN, "--effective-batch", "2.5"), needle="2.5"),
    Case("effective batch 10^12", "usage", (*PLAN, "--effective-batch", "1000000000000"), needle="at most"),
    Case("list extra", "usage", ("list", "extra"), needle="extra"),
    Case("unknown workload 300 chars", "usage", ("estimate", "x" * 300), needle="unknown built-in workload"),
    Case("workload with newline", "usage", ("estimate", "ml\np"), needle="unknown built-in workload"),
    Case("builtin alias in capitals", "usage", ("estimate", "MLP", "--json"), expect="ok", check=_json_ok()),
    # answers that must be right
    Case("plan at 1.47 GiB", "silent-wrong", ("plan", "mlp", "--budget", "1.47GiB", "--json"), expect="ok",
         check=_plan_check(256, 1, "fused")),
    Case("plan at 100 MiB: the true minimum", "silent-wrong", ("plan", "mlp", "--budget", "100MiB"),
         needle="micro-batch 256 × 1"),
    Case("plan --patch without a patch", "usage", (*PLAN, "--patch"), needle="patch"),
    Case("estimate --json with a budget", "silent-wrong", ("estimate", "mlp", "--json", "--budget", "1GiB"),
         expect="ok", check=lambda o, d: json.loads(o.stdout)["fits_budget"] is False),
    # output paths
    Case("--save into a missing folder", "paths", (*PLAN, "--save", "{d}/no/plan.json"), needle="does not exist"),
    Case("--save onto a folder", "paths", (*PLAN, "--save", "{d}"), needle="directory"),
    Case("--save read-only", "paths", (*PLAN, "--save", "/sys/memfit-audit.json"), needle="not writable"),
    Case("--save full disk", "paths", (*PLAN, "--save", "{d}/plan.json"), needle="cannot write the plan",
         full_disk=True),
    Case("--save full disk over an old plan", "paths", (*PLAN, "--save", "{d}/old.json"),
         files={"old.json": "{}"}, needle="cannot write the plan", full_disk=True),
    Case("--plot into a missing folder", "paths", (*PLAN, "--plot", "{d}/no/f.png"), needle="does not exist"),
    Case("--report into a missing folder", "paths", ("explain", "mlp", "--report", "{d}/no/r.html"),
         needle="does not exist"),
    Case("--report read-only", "paths", ("explain", "mlp", "--report", "/sys/memfit-r.html"),
         needle="not writable"),
    Case("--png-dir is a file", "paths", ("explain", "mlp", "--png-dir", "{d}/f"), files={"f": "x"},
         needle="file"),
    Case("--png-dir read-only", "paths", ("explain", "mlp", "--png-dir", "/sys/memfit-png"),
         needle="not writable"),
    Case("--snapshot into a missing folder", "paths", ("measure", "mlp", "--snapshot", "{d}/no/s.pickle"),
         needle="does not exist"),
    Case("stdout is a full device", "paths", ("list",), needle="No space left", code=2),
    Case("Ctrl-C while planning with --save", "paths", ("plan", "{d}/slow.py", "--budget", "8GiB", "--save",
                                                        "{d}/plan.json"),
         files={"slow.py": "import pathlib, time\ndef slow():\n    pathlib.Path(__file__).with_name('started')"
                ".touch()\n    time.sleep(60)\n" + tiny(**{"lambda: torch.nn.Linear(8, 4)": "slow"})},
         needle="interrupted", code=130, interrupt=True, writes=("started",)),
    # input files
    Case("--oom unreadable", "files", ("explain", "--oom", "/proc/self/mem"), needle="cannot read the log"),
    Case("--oom a folder", "files", ("explain", "--oom", "{d}"), needle="directory"),
    Case("--oom missing log", "files", ("explain", "--oom", "{d}/train.log"), needle="no such log file"),
    Case("--oom empty", "files", ("explain", "--oom", ""), needle="empty"),
    Case("--oom text without an OOM", "files", ("explain", "--oom", "loss went to nan"), needle="not a CUDA"),
    Case("--oom binary log", "files", ("explain", "--oom", "{d}/bin.log"), files={"bin.log": b"\xff\x00" * 50},
         needle="holds no CUDA out-of-memory"),
    Case("explain without anything", "files", ("explain",), needle="give a workload"),
    Case("measure without GPU", "files", ("measure", "mlp"), needle="CUDA GPU"),
    Case("--compare without GPU", "files", ("estimate", "mlp", "--compare"), needle="--compare"),
    Case("missing file", "files", ("estimate", "{d}/nope.py"), needle="not found"),
    Case("folder named x.py", "files", ("estimate", "{d}/x.py"), files={"x.py/": ""}, needle="folder"),
    Case("not a .py file", "files", ("estimate", "{d}/notes.txt"), files={"notes.txt": "hi"},
         needle="not a Python file"),
    Case("syntax error", "files", ("estimate", "{d}/s.py"), files={"s.py": "def f(:\n"}, needle="SyntaxError"),
    Case("not UTF-8", "files", ("estimate", "{d}/u.py"), files={"u.py": b"x = '\xff'\n"}, needle="utf-8"),
    Case("empty file", "files", ("estimate", "{d}/e.py"), files={"e.py": ""}, needle="defines no memfit.Workload"),
    Case("two workloads", "files", ("estimate", "{d}/two.py"), files={"two.py": TINY + "other = workload\n"},
         needle="several workloads"),
    Case("name not in file", "files", ("estimate", "{d}/w.py:nope"), files={"w.py": TINY}, needle="'nope'"),
    Case("name is an int", "files", ("estimate", "{d}/w.py:x"), files={"w.py": TINY + "x = 3\n"},
         needle="not a memfit.Workload"),
    Case("name is a class", "files", ("estimate", "{d}/w.py:C"), files={"w.py": TINY + "class C: pass\n"},
         needle="class C"),
    Case("name is not a name", "files", ("estimate", "{d}/w.py:1x"), files={"w.py": TINY}, needle="'1x'"),
    Case("factory needs arguments", "files", ("estimate", "{d}/w.py:make"),
         files={"w.py": TINY + "def make(n, m):\n    return workload\n"}, needle="needs arguments"),
    Case("factory raises", "user-code", ("estimate", "{d}/w.py:make"),
         files={"w.py": TINY + "def make():\n    return {}['cfg']\n"}, needle="w.py:10 in make"),
    Case("factory returns None", "files", ("estimate", "{d}/w.py:make"),
         files={"w.py": TINY + "def make():\n    pass\n"}, needle="returned a NoneType"),
    # the user's code
    Case("missing module", "user-code", ("estimate", "{d}/w.py"), files={"w.py": "import nonexistent_pkg\n"},
         needle="No module named 'nonexistent_pkg'"),
    Case("sys.exit(0) at import", "user-code", ("estimate", "{d}/w.py"), files={"w.py": "import sys\nsys.exit(0)\n"},
         needle="sys.exit(0)"),
    Case("exit() builtin at import", "user-code", ("estimate", "{d}/w.py"), files={"w.py": "exit(5)\n"},
         needle="sys.exit(5)"),
    Case("argparse required", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": "import argparse\na = argparse.ArgumentParser()\na.add_argument('--data', required=True)\n"
                "a.parse_args()\n" + TINY}, needle="--data"),
    Case("argparse defaults", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": "import argparse\na = argparse.ArgumentParser()\na.add_argument('--lr', default=1)\n"
                "args = a.parse_args()\n" + TINY}, expect="ok", check=_json_ok()),
    Case("sibling import", "user-code", ("estimate", "{d}/pkg/step.py", "--json"),
         files={"pkg/helper_bi_audit.py": "import torch\nmake = lambda: torch.nn.Linear(8, 4)\n",
                "pkg/step.py": "import helper_bi_audit\n" + tiny(**{"lambda: torch.nn.Linear(8, 4)":
                                                                    "helper_bi_audit.make"})},
         expect="ok", check=_json_ok()),
    Case("path with a colon", "user-code", ("estimate", "{d}/a:b/w.py", "--json"), files={"a:b/w.py": TINY},
         expect="ok", check=_json_ok()),
    Case("path with a colon and a name", "user-code", ("estimate", "{d}/a:b/w.py:workload", "--json"),
         files={"a:b/w.py": TINY}, expect="ok", check=_json_ok()),
    Case(".cuda() model", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": tiny(**{"torch.nn.Linear(8, 4)": "torch.nn.Linear(8, 4).cuda()"})}, expect="ok",
         check=_json_ok()),
    Case(".to(device) model", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": tiny(**{"torch.nn.Linear(8, 4)": "torch.nn.Linear(8, 4).to(torch.device('cuda:0'))"})},
         expect="ok", check=_json_ok()),
    Case(".half() model", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": tiny(**{"torch.nn.Linear(8, 4)": "torch.nn.Linear(8, 4).half()",
                                "((out - batch[1]) ** 2)": "((out.float() - batch[1]) ** 2)",
                                "torch.randn(n, 8)": "torch.randn(n, 8).half()"})}, expect="ok", check=_json_ok()),
    Case("batch on device='cuda'", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": tiny(**{"torch.randn(n, 8)": "torch.randn(n, 8, device='cuda')"})}, expect="ok",
         check=_json_ok()),
    Case("shape bug", "user-code", ("estimate", "{d}/w.py"), files={"w.py": SHAPE_BUG},
         needle="w.py:6 in forward (module encoder.1, op addmm)"),
    Case("loss raises", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"((out - batch[1]) ** 2).mean()": "out['logits']"})}, needle="w.py:5"),
    Case("batch factory raises", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"(torch.randn(n, 8), torch.randn(n, 4))": "torch.load('missing.pt')"})},
         needle="w.py:4"),
    Case("batch is a string", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"(torch.randn(n, 8), torch.randn(n, 4))": "'a batch'"})}, needle="failed"),
    Case("optimizer factory raises", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"torch.optim.SGD(params, lr=0.1)": "torch.optim.SGD(params, lr=-1)"})},
         needle="w.py:6"),
    Case("model has no parameters", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"torch.nn.Linear(8, 4)": "torch.nn.Identity()"})}, needle="parameter"),
    Case("model factory returns a function", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"lambda: torch.nn.Linear(8, 4)": "lambda: print"})}, needle="not a torch.nn.Module"),
    Case("loss not a scalar", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"((out - batch[1]) ** 2).mean()": "out - batch[1]"})}, needle="scalar"),
    Case("sys.exit in forward", "user-code", ("estimate", "{d}/w.py"), files={"w.py": net("sys.exit(3)")},
         needle="sys.exit(3)"),
    Case("endless recursion in forward", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": net("return self.forward(x)")}, needle="RecursionError"),
    Case(".cuda() in forward", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": net("return self.a(x) + torch.zeros(4, device='cuda')")}, needle="x.device"),
    Case("torch.unique in forward", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": net("return self.a(x)[: torch.unique(x).numel() % 3 + 1]")}, needle="unique"),
    Case(".item() in forward", "user-code", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": net("return self.a(x) * float(x.sum().item() > 0)")}, expect="ok", check=_json_ok()),
    Case("0-d softmax", "silent-wrong", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": net("y = self.a(x)\n        return torch.softmax(y.sum(), 0) * y")}, expect="ok",
         check=_json_ok()),
    Case("Workload(batch_size='8') in the file", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"batch_size=4": "batch_size='8'"})}, needle="w.py:2"),
    Case("Workload(channels_last='no') in the file", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"batch_size=4": "batch_size=4, channels_last='no'"})}, needle="channels_last"),
    Case("dict batch with unknown keys", "user-code", ("estimate", "{d}/w.py"),
         files={"w.py": tiny(**{"(torch.randn(n, 8), torch.randn(n, 4))": "{'image': torch.randn(n, 8)}",
                                "((out - batch[1]) ** 2).mean()": "out.sum()"})}, needle="image"),
    Case("prints at import (--json)", "silent-wrong", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": "print('hello')\n" + TINY}, expect="ok", check=_json_ok()),
    Case("prints to fd 1 in the factory (--json)", "silent-wrong", ("estimate", "{d}/w.py", "--json"),
         files={"w.py": "import os\n" + tiny(**{"lambda: torch.nn.Linear(8, 4)":
                                                "lambda: (os.write(1, b'x\\n'), torch.nn.Linear(8, 4))[1]"})},
         expect="ok", check=_json_ok()),
    Case("prints during plan (--json)", "silent-wrong", ("plan", "{d}/w.py", "--budget", "1GiB", "--json"),
         files={"w.py": tiny(**{"lambda: torch.nn.Linear(8, 4)": "lambda: print('built') or torch.nn.Linear(8, 4)"})},
         expect="ok", check=_json_ok("chosen")),
    Case("explain --json with a printing workload", "silent-wrong", ("explain", "{d}/w.py", "--json", "--no-fixes"),
         files={"w.py": "print('hello')\n" + TINY}, expect="ok", check=_json_ok("estimate")),
]


# ----------------------------------------------------------------------------------------------- API cases


def _plan_file(d: Path, payload: bytes) -> Any:
    import memfit

    (d / "plan.json").write_bytes(payload)
    return memfit.Plan.load(d / "plan.json")


def _good_plan() -> dict[str, Any]:
    config = {"micro_batch": 8, "accumulation_steps": 2, "precision": "fp32", "checkpoint": [],
              "optimizer_impl": "fused", "channels_last": False, "expandable_segments": False, "patch_size": None}
    cand = {"config": config, "device_bytes": 2**30, "fits_in_bytes": 2**29, "step_time_s": 0.01,
            "samples_per_s": 1600.0, "verified": True, "fits": True}
    return {"workload": "mlp", "gpu": "H100", "budget_bytes": 2**31, "margin": 0.02, "effective_batch": 16,
            "chosen": cand, "frontier": [cand], "considered": 9, "estimates": 3, "speed_model": "roofline",
            "notes": [], "elapsed_s": 1.0, "schema": 1}


def _plan_with(edit: Callable[[dict[str, Any]], None]) -> bytes:
    data = _good_plan()
    edit(data)
    return json.dumps(data).encode()


def _w(**changes: Any) -> Any:
    import torch

    import memfit

    base: dict[str, Any] = dict(model=lambda: torch.nn.Linear(8, 4), batch=lambda n: (torch.randn(n, 8),),
                                loss=lambda o, b: o.sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                batch_size=4)
    return memfit.Workload(**{**base, **changes})


def _step(**kwargs: Any) -> Any:
    import torch

    import memfit

    model = torch.nn.Linear(4, 1)
    return memfit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda o, mb: torch.nn.functional.mse_loss(o, mb[1]), **kwargs)


def _tif(d: Path, cut: float) -> Any:
    import numpy as np
    import tifffile

    from memfit.data import TileDataset

    path = d / "scene.tif"
    tifffile.imwrite(path, (np.random.default_rng(0).random((3, 256, 256)) * 255).astype(np.uint8),
                     tile=(64, 64), compression="zlib", photometric="minisblack")
    tiles = TileDataset.grid([path], size=64)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    return [tiles[i] for i in range(len(tiles))]


def _npy(d: Path, name: str, shape: tuple[int, ...], dtype: str = "uint8") -> Path:
    import numpy as np

    np.save(d / name, np.zeros(shape, dtype=dtype))
    return d / name


def _patches(d: Path, image: tuple[int, ...], label: tuple[int, ...], patch: Any = (4, 4, 4)) -> Any:
    from memfit.data import PatchDataset, PatchSampler

    return PatchDataset([_npy(d, "i.npy", image, "float32")], [_npy(d, "l.npy", label)],
                        sampler=PatchSampler(patch_size=patch), samples_per_epoch=2)


def _cache_deleted(d: Path) -> bool:
    import shutil

    import numpy as np

    from memfit.data import PreprocessCache

    cache = PreprocessCache(d / "c", lambda x, k: x * k, params={"k": 2})
    shutil.rmtree(d / "c")
    return float(cache.get(0, lambda: np.ones(2)).sum()) == 4.0 and cache.path(0).exists()


def _cache_corrupt(d: Path) -> bool:
    import numpy as np

    from memfit.data import PreprocessCache

    cache = PreprocessCache(d / "c", lambda x, k: x * k, params={"k": 2})
    cache.get(0, lambda: np.ones(2))
    cache.path(0).write_bytes(b"PK\x03\x04 truncated")
    return float(cache.get(0, lambda: np.ones(2)).sum()) == 4.0 and float(cache.get(0, lambda: None).sum()) == 4.0


def _cache_readonly(d: Path) -> bool:
    import numpy as np

    from memfit.data import PreprocessCache

    cache = PreprocessCache("/sys/memfit-audit-cache", lambda x, k: x * k, params={"k": 2})
    return float(cache.get(0, lambda: np.ones(2)).sum()) == 4.0


def _cache_many(d: Path) -> bool:
    import numpy as np

    from memfit.data import PreprocessCache

    cache = PreprocessCache(d / "c", lambda x, n: tuple(np.full(1, i) for i in range(n)), params={"n": 10_050})
    return [int(a[0]) for a in cache.get(0, lambda: 0)] == list(range(10_050))


def _plan_min(d: Path) -> bool:
    import memfit

    p = memfit.plan(memfit.builtin_workload("mlp"), budget_bytes=int(1.47 * 2**30))
    c = p.chosen.config
    return (c.micro_batch, c.accumulation_steps, c.optimizer_impl) == (256, 1, "fused")


def _interrupted_trace(d: Path) -> bool:
    from memfit.estimate import measure

    target = d / "t.json.gz"
    target.write_bytes(b"old")
    real = measure.json.dump

    def boom(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    measure.json.dump = boom  # type: ignore[assignment]
    try:
        measure._write_compact_trace({"device_traces": [[]]}, str(target), {})
    except KeyboardInterrupt:
        pass
    finally:
        measure.json.dump = real  # type: ignore[assignment]
    return target.read_bytes() == b"old" and sorted(p.name for p in d.iterdir()) == ["t.json.gz"]


def _empty_step(d: Path) -> bool:
    import torch

    m = _step(micro_batch_size=2)((torch.zeros(0, 4), torch.zeros(0, 1)))
    return m.skipped and m.samples == 0


def A(name: str, group: str, fn: Callable[[Path], Any], needle: str = "", expect: str = "error",  # noqa: N802
      check: Callable[[Any, Path], bool] | None = None) -> Case:
    return Case(name, group, api=fn, needle=needle, expect=expect, check=check)


def _ok(result: Any, d: Path) -> bool:
    return result is True


API: list[Case] = [
    A("Plan.load a list", "api", lambda d: _plan_file(d, b"[1]"), "got a list"),
    A("Plan.load a string", "api", lambda d: _plan_file(d, b'"x"'), "got a string"),
    A("Plan.load null", "api", lambda d: _plan_file(d, b"null"), "got null"),
    A("Plan.load missing key", "api", lambda d: _plan_file(d, _plan_with(lambda p: p.pop("chosen"))), "missing"),
    A("Plan.load extra key", "api", lambda d: _plan_file(d, _plan_with(lambda p: p.update(x=1))), "unknown x"),
    A("Plan.load invalid UTF-8", "api", lambda d: _plan_file(d, b"\xff{}"), "UTF-8"),
    A("Plan.load deep nesting", "api", lambda d: _plan_file(d, b"[" * 50_000 + b"]" * 50_000), "nests"),
    A("Plan.load micro_batch -5", "api",
      lambda d: _plan_file(d, _plan_with(lambda p: p["chosen"]["config"].update(micro_batch=-5))), "-5"),
    A("Plan.load micro_batch '64'", "api",
      lambda d: _plan_file(d, _plan_with(lambda p: p["chosen"]["config"].update(micro_batch="64"))), "'64'"),
    A("Plan.load checkpoint a string", "api",
      lambda d: _plan_file(d, _plan_with(lambda p: p["chosen"]["config"].update(checkpoint="layers.0"))),
      "checkpoint"),
    A("Plan.load budget NaN", "api", lambda d: _plan_file(d, _plan_with(lambda p: p.update(margin=float("nan")))),
      "margin"),
    A("Plan.load a folder", "api", lambda d: __import__("memfit").Plan.load(d), "directory"),
    A("Plan.load a missing file", "api", lambda d: __import__("memfit").Plan.load(d / "no.json"), "not found"),
    A("Plan.from_dict(None)", "api", lambda d: __import__("memfit").Plan.from_dict(None), "JSON object"),
    A("Plan.save into a missing folder", "api",
      lambda d: __import__("memfit").Plan.from_dict(_good_plan()).save(d / "no" / "p.json"), "does not exist"),
    A("Workload(batch_size=np.int64(4))", "api", lambda d: _w(batch_size=__import__("numpy").int64(4)).batch_size == 4,
      expect="ok", check=_ok),
    A("Workload(channels_last='no')", "api", lambda d: _w(channels_last="no"), "channels_last"),
    A("Workload(checkpoint=None)", "api", lambda d: _w(checkpoint=None), "checkpoint"),
    A("Workload(checkpoint=['a', 3])", "api", lambda d: _w(checkpoint=["a", 3]), "checkpoint"),
    A("Workload(batch_size=0)", "api", lambda d: _w(batch_size=0), "batch_size"),
    A("Workload(batch_size=inf)", "api", lambda d: _w(batch_size=float("inf")), "batch_size"),
    A("Workload(model=instance)", "api", lambda d: _w(model=__import__("torch").nn.Linear(2, 2)), "factory"),
    A("Workload(precision=None)", "api", lambda d: _w(precision=None), "precision"),
    A("Workload(optimizer_impl=['fused'])", "api", lambda d: _w(optimizer_impl=["fused"]), "optimizer_impl"),
    A("Workload(patch_size=(0, 4))", "api", lambda d: _w(patch_size=(0, 4)), "patch_size"),
    A("Workload(patch_size='128')", "api", lambda d: _w(patch_size="128"), "patch_size"),
    A("Workload(description=None)", "api", lambda d: _w(description=None), "description"),
    A("load_workload(None)", "api", lambda d: __import__("memfit").load_workload(None), "name a workload"),
    A("TrainStep empty batch", "api", _empty_step, expect="ok", check=_ok),
    A("TrainStep(micro_batch_size='2')", "api", lambda d: _step(micro_batch_size="2"), "'2'"),
    A("TrainStep(micro_batch_size=-1)", "api", lambda d: _step(micro_batch_size=-1), "-1"),
    A("TrainStep(grow_after=0.5)", "api", lambda d: _step(grow_after=0.5), "grow_after"),
    A("TrainStep(on_nonfinite='warn')", "api", lambda d: _step(on_nonfinite="warn"), "warn"),
    A("TrainStep(precision='fp8')", "api", lambda d: _step(precision="fp8"), "fp8"),
    A("TrainStep(lr=0.1)", "api", lambda d: _step(lr=0.1), "lr"),
    A("TrainStep partial state", "api", lambda d: _step().load_state_dict({"schema": 1}), "missing"),
    A("TrainStep state None", "api", lambda d: _step().load_state_dict(None), "NoneType"),
    A("TrainStep batch of mismatched sizes", "api",
      lambda d: _step()((__import__("torch").zeros(3, 4), __import__("torch").zeros(2, 1))), "disagree"),
    A("TrainStep batch a string", "api", lambda d: _step()("not a batch"), "batch dimension"),
    A("parse_bytes 400 digits", "api", lambda d: __import__("memfit.units").units.parse_bytes("9" * 400), "1 EiB"),
    A("parse_bytes -1", "api", lambda d: __import__("memfit.units").units.parse_bytes(-1), "positive"),
    A("parse_bytes True", "api", lambda d: __import__("memfit.units").units.parse_bytes(True), "True"),
    A("parse_bytes None", "api", lambda d: __import__("memfit.units").units.parse_bytes(None), "None"),
    A("estimate(gpu='tpu')", "api", lambda d: __import__("memfit").estimate(_w(), gpu="tpu"), "tpu"),
    A("plan(budget_bytes=-1)", "api", lambda d: __import__("memfit").plan(_w(), budget_bytes=-1), "-1"),
    A("plan(effective_batch=0)", "api", lambda d: __import__("memfit").plan(_w(), budget_bytes=2**30, effective_batch=0),
      "effective batch"),
    A("plan(budget_bytes='1GiB')", "api", lambda d: __import__("memfit").plan(_w(), budget_bytes="1GiB"), "'1GiB'"),
    A("plan at 1.47 GiB finds 256 x 1 fused", "silent-wrong", _plan_min, expect="ok", check=_ok),
    A("explain(budget_bytes='1GiB')", "api",
      lambda d: __import__("memfit").explain(_w(), budget_bytes="1GiB", fixes=False), "budget"),
    A("truncated TIFF mid-epoch", "data", lambda d: _tif(d, 0.9), "rows"),
    A("TIFF cut to its header", "data", lambda d: _tif(d, 0.05), "scene.tif"),
    A("zero-size raster", "data",
      lambda d: __import__("memfit.data").data.TileDataset.grid([_npy(d, "z.npy", (0, 5))], size=4), "empty"),
    A("window size 1.5", "data",
      lambda d: __import__("memfit.data").data.TileDataset.grid([_npy(d, "r.npy", (8, 8))], size=1.5), "1.5"),
    A("raster file missing", "data",
      lambda d: __import__("memfit.data").data.TileDataset.grid([d / "missing.npy"], size=4), "missing.npy"),
    A("raster .png", "data",
      lambda d: __import__("memfit.data").data.TileDataset.grid([d / "scene.png"], size=4), ".png"),
    A("RandomTileDataset length -1", "data",
      lambda d: __import__("memfit.data").data.RandomTileDataset([_npy(d, "r.npy", (8, 8))], size=4, length=-1),
      "length"),
    A("zero-size volume", "data", lambda d: _patches(d, (0, 8, 8), (0, 8, 8)), "voxel"),
    A("label shape differs", "data", lambda d: _patches(d, (8, 8, 8), (8, 8, 7)), "l.npy"),
    A("2-channel image, same spatial shape", "data", lambda d: _patches(d, (2, 8, 8, 8), (8, 8, 8)) is not None,
      expect="ok", check=_ok),
    A("patch size 1.5", "data", lambda d: _patches(d, (8, 8, 8), (8, 8, 8), (1.5, 4, 4)), "1.5"),
    A("foreground fraction 2", "data",
      lambda d: __import__("memfit.data").data.PatchSampler(patch_size=(4, 4, 4), foreground_fraction=2), "[0, 1]"),
    A("volume file missing", "data",
      lambda d: __import__("memfit.data").data.PatchDataset([d / "i.npy"], [d / "l.npy"],
                                                            sampler=__import__("memfit.data").data.PatchSampler(
                                                                patch_size=(4, 4, 4)), samples_per_epoch=1), "l.npy"),
    A("cache folder deleted", "data", _cache_deleted, expect="ok", check=_ok),
    A("cache item corrupt", "data", _cache_corrupt, expect="ok", check=_ok),
    A("cache read-only", "data", _cache_readonly, expect="ok", check=_ok),
    A("cache tuple of 10,050 arrays", "data", _cache_many, expect="ok", check=_ok),
    A("cache params not JSON", "data",
      lambda d: __import__("memfit.data").data.PreprocessCache(d, lambda x: x, params={"f": object()}), "JSON"),
    A("--trace file interrupted", "files", _interrupted_trace, expect="ok", check=_ok),
    A("load_oom_text unreadable", "files",
      lambda d: importlib.import_module("memfit.explain.oom_message").load_oom_text("/proc/self/mem"),
      "cannot read"),
    A("parse_oom_message('')", "files",
      lambda d: importlib.import_module("memfit.explain.oom_message").parse_oom_message(""), "empty"),
]


# ------------------------------------------------------------------------------------------------- runner


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def _setup(case: Case, d: Path) -> None:
    for name, content in case.files.items():
        path = d / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _full_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def _users_own(lines: list[str], d: Path) -> list[str]:
    """Lines the user's own code wrote to stderr: a Python warning raised in their file, and its source line."""
    own = []
    for i, line in enumerate(lines[:-1]):
        if line.startswith(str(d)) and "Warning:" in line:
            own.append(line)
            if i + 1 < len(lines) - 1 and lines[i + 1].startswith("  "):
                own.append(lines[i + 1])
    return own


def run_cli(case: Case, d: Path) -> dict[str, Any]:
    args = [a.replace("{d}", str(d)) for a in case.args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    stdout: Any = subprocess.PIPE
    if case.name == "stdout is a full device":
        stdout = open("/dev/full", "w")  # noqa: SIM115
    if case.interrupt:
        child = subprocess.Popen([sys.executable, "-m", "memfit.cli", *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=d, env=env,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 300
        while not (d / "started").exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        so, se = child.communicate(timeout=120)
        out = subprocess.CompletedProcess(child.args, child.returncode, so, se)
    else:
        try:
            out = subprocess.run([sys.executable, "-m", "memfit.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                                 text=True, timeout=HANG_S, cwd=d, env=env,
                                 preexec_fn=_full_disk if case.full_disk else None)
        except subprocess.TimeoutExpired:  # killed: a hang (an endless loop over a huge batch, say)
            return {"exit": None, "stderr": f"no answer in {HANG_S} s", "verdict": "hang"}
    if stdout is not subprocess.PIPE:
        stdout.close()
    lines = out.stderr.strip().splitlines()
    row: dict[str, Any] = {"exit": out.returncode, "stderr": out.stderr[-600:], "stdout_head": (out.stdout or "")[:200]}
    if "Traceback" in out.stderr:
        row["verdict"] = "traceback"
    elif case.expect == "ok":
        right = out.returncode == 0
        if right and case.check is not None:
            try:
                right = bool(case.check(out, d))
            except Exception as exc:  # a wrong answer (unparsable JSON, say)
                row["check_error"] = f"{type(exc).__name__}: {exc}"
                right = False
        row["verdict"] = "ok" if right else ("silent-wrong" if out.returncode == 0 else "other")
    elif out.returncode == 0:
        row["verdict"] = "silent-wrong"
    elif case.name == "bare memfit":
        row["verdict"] = "ok" if out.returncode == 2 and "Usage" in (out.stdout or "") + out.stderr else "other"
    elif not lines or not lines[-1].startswith("memfit: error: ") or len(lines) != 1 + len(_users_own(lines, d)):
        row["verdict"] = "traceback"  # several lines of memfit's, or none
    elif out.returncode != case.code or case.needle not in lines[-1]:
        row["verdict"] = "other"
    else:
        row["verdict"] = "ok"
    return row


def run_api(case: Case, d: Path) -> dict[str, Any]:
    from memfit.errors import MemfitError

    assert case.api is not None
    row: dict[str, Any] = {}
    try:
        result = case.api(d)
    except MemfitError as exc:
        text = str(exc)
        row["error"] = f"{type(exc).__name__}: {text[:400]}"
        if case.expect == "ok":
            row["verdict"] = "other"
        elif "\n" in text or case.needle not in text:
            row["verdict"] = "other"
        else:
            row["verdict"] = "ok"
        return row
    except Exception as exc:  # not memfit's: the user would see this exception's traceback
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        row["verdict"] = "traceback"
        return row
    if case.expect == "ok":
        row["verdict"] = "ok" if case.check is None or case.check(result, d) else "silent-wrong"
    else:
        row["verdict"] = "silent-wrong"
        row["returned"] = repr(result)[:200]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import logging

    logging.disable(logging.WARNING)  # the cache's fallback warning is expected; the verdict is what counts
    rows = []
    started = time.perf_counter()
    for case in CLI + API:
        if args.only and args.only not in case.name:
            continue
        with tempfile.TemporaryDirectory(prefix="memfit-audit-") as tmp:
            d = Path(tmp)
            _setup(case, d)
            before = _files(d)
            t0 = time.perf_counter()
            row = run_cli(case, d) if case.api is None else run_api(case, d)
            extra = _files(d) - before - set(case.writes)
            if case.api is None and row["verdict"] == "ok" and extra and case.expect == "error":
                row["verdict"] = "leftover"
            if extra:
                row["left"] = sorted(extra)[:5]
            if case.group == "silent-wrong" and row["verdict"] in ("other", "traceback"):
                row["verdict"] = "silent-wrong"  # e.g. "nothing fits" where something does: a wrong answer
        row.update(name=case.name, group=case.group, kind="cli" if case.api is None else "api",
                   seconds=round(time.perf_counter() - t0, 2))
        rows.append(row)
        print(f"{row['verdict']:>12}  {row['kind']}  {case.name}", flush=True)
    counts = Counter(r["verdict"] for r in rows)
    stamp = dt.date.today().strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"date": stamp, "python": sys.version.split()[0], "inputs": len(rows), "verdicts": dict(counts),
               "elapsed_s": round(time.perf_counter() - started, 1), "rows": rows}
    import torch
    import typer

    summary.update(torch=torch.__version__, typer=typer.__version__)
    (out / f"bad_input_audit_cpu_{_torch_tag()}_{stamp}.json").write_text(json.dumps(summary, indent=1))
    failures = [r for r in rows if r["verdict"] != "ok"]
    md = [f"# Bad-input audit, {stamp}", "",
          f"{len(rows)} inputs ({sum(r['kind'] == 'cli' for r in rows)} through the CLI, "
          f"{sum(r['kind'] == 'api' for r in rows)} through the API); torch {torch.__version__}, typer "
          f"{typer.__version__}, CPU only, {summary['elapsed_s']} s.", "",
          "| verdict | inputs |", "|---|---|", *[f"| {k} | {v} |" for k, v in sorted(counts.items())], ""]
    md += ["## Not ok", ""] + ([f"- **{r['name']}** ({r['kind']}, {r['verdict']}): "
                                f"{(r.get('error') or r.get('stderr') or r.get('check_error') or '').strip()[:300]}"
                                for r in failures] or ["none"])
    (out / f"bad_input_audit_cpu_{_torch_tag()}_{stamp}.md").write_text("\n".join(md) + "\n")
    print(f"{len(rows)} inputs: {dict(counts)}")


def _torch_tag() -> str:
    import torch

    return "torch" + ".".join(torch.__version__.split("+")[0].split(".")[:2])


if __name__ == "__main__":
    main()
