"""Hostile and mistaken input, as a new user gives it: one clear line, never a traceback, nothing lost.

memfit's rule: bad input gets one line on stderr (what was wrong, the value, what to do), exit code 2, no
traceback, and no file the user owns is damaged or left half-written; a memfit bug gets exit 1 and one line that
says so. Each test below is one class of bad input (issue 14), driven through the real CLI in a subprocess or the
Python API. Cases that need a trace use the built-in ``mlp`` or a few-parameter model in ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import memfit
from memfit.data import PatchDataset, PatchSampler, PreprocessCache, TileDataset, grid_windows
from memfit.errors import BudgetTooSmallError, DataError, UsageError, UserCodeError, WorkloadError
from memfit.units import format_bytes, parse_bytes

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


LAZY = """\
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 4)
        self.idle = torch.nn.LazyLinear(4)
    def forward(self, x):
        return self.used(x)
"""
"""A model with a lazy module (its size from its first input), which its forward does not use."""


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        preexec: Any = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memfit.cli", *args], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env=env, preexec_fn=preexec)


def assert_one_error(out: subprocess.CompletedProcess[str], *needles: str, code: int = 2) -> str:
    """Exit ``code``, stderr one ``memfit: error:`` line holding every needle, no traceback, nothing on stdout."""
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out.stdout == ""
    return lines[0]


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------------------------- CLI usage


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("estimat", "mlp"), ("No such command 'estimat'", "estimate", "memfit --help")),
        (("estimate", "mlp", "--budgett", "4GiB"), ("--budgett", "--budget")),
        (("estimate", "mlp", "--batch-size"), ("'--batch-size' requires an argument",)),
        (("estimate", "mlp", "extra"), ("unexpected extra argument", "extra")),
        (("estimate", "mlp", "--batch-size", "2.5"), ("--batch-size", "2.5")),
        (("estimate", "mlp", "--batch-size", "99999999999999999999999"), ("--batch-size must be at most",)),
        (("estimate", "mlp", "--batch-size", "0"), ("--batch-size must be a positive integer, got 0",)),
        (("estimate", "mlp", "--budget", "9" * 400 + "GiB"), ("more than 1 EiB",)),
        (("estimate", "mlp", "--budget", "lots"), ("cannot read the size 'lots'",)),
        (("plan", "mlp"), ("--budget",)),
        (("plan", "mlp", "--budget", "8GiB", "--margin", "0.7"), ("--margin must be between 0 and 0.5",)),
        (("plan", "mlp", "--budget", "8GiB", "--margin", "nan"), ("--margin",)),
        (("plan", "mlp", "--budget", "8GiB", "--effective-batch", "-4"), ("--effective-batch",)),
        (("plan", "mlp", "--budget", "8GiB", "--effective-batch", "10" + "0" * 30), ("--effective-batch must be",)),
        (("estimate", "mlp", "--precision", "fp8"), ("--precision must be one of",)),
        (("estimate", "mlp", "--gpu", "tpu"), ("unknown GPU 'tpu'",)),
        (("explain",), ("give a workload",)),
    ],
)
def test_cli_usage_errors_are_one_line_with_exit_2(args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    assert_one_error(run(*args), *needles)


def test_bare_memfit_shows_the_help_not_a_traceback() -> None:
    out = run()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "estimate" in out.stdout + out.stderr and "plan" in out.stdout + out.stderr


def test_help_does_not_import_torch() -> None:
    code = "import sys, memfit.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- output files, checked first


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("plan", "mlp", "--budget", "8GiB", "--save", "{tmp}/missing/plan.json"), ("does not exist",)),
        (("plan", "mlp", "--budget", "8GiB", "--save", "{tmp}"), ("is a directory",)),
        (("plan", "mlp", "--budget", "8GiB", "--save", "/sys/memfit-plan.json"), ("not writable",)),
        (("plan", "mlp", "--budget", "8GiB", "--plot", "{tmp}/missing/frontier.png"), ("does not exist",)),
        (("explain", "mlp", "--report", "{tmp}/missing/report.html"), ("does not exist",)),
        (("explain", "mlp", "--report", "/sys/memfit-report.html"), ("not writable",)),
        (("explain", "mlp", "--png-dir", "{tmp}/a-file"), ("it is a file",)),
        (("explain", "mlp", "--png-dir", "/sys/memfit-pictures"), ("not writable",)),
        (("measure", "mlp", "--snapshot", "{tmp}/missing/snap.pickle"), ("does not exist",)),
    ],
)
def test_output_paths_are_checked_before_the_work(tmp_path: Path, args: tuple[str, ...],
                                                  needles: tuple[str, ...]) -> None:
    (tmp_path / "a-file").write_text("mine")
    before = files_in(tmp_path)
    out = run(*(a.format(tmp=tmp_path) for a in args))
    assert_one_error(out, *needles)
    assert files_in(tmp_path) == before and (tmp_path / "a-file").read_text() == "mine"


def _full_disk() -> None:
    """In the child: any file past 1 KiB fails with EFBIG, as on a full disk (SIGXFSZ ignored, so no kill)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_full_disk_is_one_line_and_leaves_no_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    out = run("plan", "mlp", "--budget", "8GiB", "--save", str(target), preexec=_full_disk)
    assert_one_error(out, "cannot write the plan", str(target))
    assert files_in(tmp_path) == set()  # no plan.json, no .plan.json.tmp


def test_an_existing_plan_survives_a_failed_save(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text('{"mine": true}')
    out = run("plan", "mlp", "--budget", "8GiB", "--save", str(target), preexec=_full_disk)
    assert_one_error(out, "cannot write the plan")
    assert target.read_text() == '{"mine": true}' and files_in(tmp_path) == {"plan.json"}


def test_ctrl_c_is_one_line_exit_130_and_writes_nothing(tmp_path: Path) -> None:
    started = tmp_path / "started"
    write(tmp_path, "slow.py", textwrap.dedent(f"""\
        import pathlib, time
        def slow():
            pathlib.Path({str(started)!r}).touch()
            time.sleep(60)
        """) + TINY.replace("lambda: torch.nn.Linear(8, 4)", "slow"))
    child = subprocess.Popen([sys.executable, "-m", "memfit.cli", "plan", "slow.py", "--budget", "8GiB", "--save",
                              "plan.json"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert_one_error(subprocess.CompletedProcess(child.args, child.returncode, out, err), "interrupted", code=130)
    assert files_in(tmp_path) == {"slow.py", "started"}


# ------------------------------------------------------------------------------------------- input files


@pytest.mark.parametrize(
    ("make", "args", "needles"),
    [
        (lambda d: None, ("estimate", "{tmp}/nope.py"), ("workload file not found",)),
        (lambda d: (d / "x.py").mkdir(), ("estimate", "{tmp}/x.py"), ("is a folder, not a workload file",)),
        (lambda d: (d / "notes.txt").write_text("hi"), ("estimate", "{tmp}/notes.txt"), ("not a Python file",)),
        (lambda d: (d / "bad.py").write_bytes(b'x = "\xff\xfe"\n'), ("estimate", "{tmp}/bad.py"), ("SyntaxError",)),
        (lambda d: (d / "syntax.py").write_text("def f(:\n"), ("estimate", "{tmp}/syntax.py"),
         ("SyntaxError", "syntax.py:1")),
        (lambda d: None, ("explain", "--oom", "/proc/self/mem"), ("cannot read the log",)),
        (lambda d: None, ("explain", "--oom", "{tmp}"), ("is a directory",)),
        (lambda d: None, ("explain", "--oom", "{tmp}/missing.log"), ("no such log file",)),
    ],
)
def test_unreadable_input_files_are_one_line(tmp_path: Path, make: Any, args: tuple[str, ...],
                                             needles: tuple[str, ...]) -> None:
    make(tmp_path)
    assert_one_error(run(*(a.format(tmp=tmp_path) for a in args)), *needles)


# ----------------------------------------------------------------------------------------- the user's code

SHAPE_BUG = """\
import torch, memfit
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(15, 4))

    def forward(self, x):
        return self.encoder(x)
workload = memfit.Workload(model=Net, batch=lambda n: (torch.randn(n, 8), torch.randn(n, 4)),
                           loss=lambda o, b: ((o - b[1]) ** 2).mean(),
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
"""


@pytest.mark.parametrize(
    ("name", "text", "spec", "needles"),
    [
        ("step.py", SHAPE_BUG, "step.py",
         ("step.py:8 in forward", "module encoder.1", "op addmm", "a and b must have same reduction dim")),
        ("boom.py", "import torch\nraise RuntimeError('no data here')\n", "boom.py",
         ("importing boom.py failed at boom.py:2 in <module>", "RuntimeError: no data here")),
        ("factory.py", TINY + "def make():\n    raise ValueError('factory exploded')\n", "factory.py:make",
         ("factory.py:10 in make", "factory exploded")),
        ("args.py", TINY + "def make(size):\n    return workload\n", "args.py:make", ("needs arguments (size)",)),
        ("exit0.py", "import sys\nsys.exit(0)\n" + TINY, "exit0.py",
         ("called sys.exit(0)", "exit0.py:2", '__name__ == "__main__"')),
        ("cli.py", "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
         "args = p.parse_args()\n" + TINY, "cli.py", ("sys.exit(2)", "required: --lr")),
        ("fwdexit.py", "import sys, torch\nclass Net(torch.nn.Linear):\n    def forward(self, x):\n"
         "        sys.exit(3)\n" + TINY.replace("torch.nn.Linear(8, 4)", "Net(8, 4)"), "fwdexit.py",
         ("sys.exit(3)", "fwdexit.py:4 in forward")),
        ("lazy.py", LAZY + TINY.replace("torch.nn.Linear(8, 4)", "Net()"), "lazy.py",
         ("lazy module idle got no input", "nn.Linear(in_features, out_features)")),
        ("lazyitem.py", LAZY.replace("self.used(x)", "self.idle(x) * x.sum().item()")
         + TINY.replace("torch.nn.Linear(8, 4)", "Net()"), "lazyitem.py",
         ("lazy modules", "on shapes alone (meta tensors) and it failed at lazyitem.py:8 in forward", "item()")),
    ],
)
def test_errors_in_the_users_code_name_the_place(tmp_path: Path, name: str, text: str, spec: str,
                                                 needles: tuple[str, ...]) -> None:
    write(tmp_path, name, text)
    line = assert_one_error(run("estimate", spec, cwd=tmp_path), *needles)
    assert "FakeTensor" not in line and "memfit bug" not in line


def test_a_memfit_bug_is_exit_1_and_says_so() -> None:
    # plant a bug inside memfit: the replay calls a function with the wrong arguments, from memfit's own frame
    code = ("import importlib, sys, memfit.cli; p = importlib.import_module('memfit.estimate.predict'); "
            "p._analyse = divmod; "
            "sys.argv = ['memfit', 'estimate', 'mlp', '--batch-size', '2']; memfit.cli.main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    line = assert_one_error(out, "this is a memfit bug, please report it", "TypeError: divmod",
                            "memfit/estimate/predict.py", "MEMFIT_TRACEBACK=1", code=1)
    assert "your" not in line
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                           env={**os.environ, "MEMFIT_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback" in shown.stderr


def test_a_valid_zero_dim_softmax_is_estimated(tmp_path: Path) -> None:
    # softmax backward's scratch rule takes the softmax dimension modulo the rank: a 0-d input has rank 0
    write(tmp_path, "softmax0.py", textwrap.dedent("""
        import torch
        class Net(torch.nn.Linear):
            def forward(self, x):
                y = super().forward(x)
                return torch.softmax(y.sum(), 0) * y
        """) + TINY.replace("torch.nn.Linear(8, 4)", "Net(8, 4)"))
    out = run("estimate", "softmax0.py", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peak_allocated_bytes"] > 0


def test_json_stdout_stays_json_when_the_workload_prints(tmp_path: Path) -> None:
    write(tmp_path, "chatty.py", textwrap.dedent("""
        import os, torch, memfit
        print("importing the workload")
        os.write(1, b"straight to file descriptor 1\\n")
        def model():
            print("building the model")
            return torch.nn.Linear(8, 4)
        workload = memfit.Workload(model=model, batch=lambda n: (torch.randn(n, 8), torch.randn(n, 4)),
                                   loss=lambda o, b: ((o - b[1]) ** 2).mean(),
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4)
        """))
    out = run("estimate", "chatty.py", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batch_size"] == 4  # stdout is the JSON alone
    for said in ("importing the workload", "straight to file descriptor 1", "building the model"):
        assert said in out.stderr


def test_workload_files_load_like_python_runs_them(tmp_path: Path) -> None:
    # a sibling import from another working directory, a folder with a colon, argparse with defaults,
    # a training loop under __main__, .cuda() / .to(device) / .half() / device="cuda" in the factories
    folder = tmp_path / "run:2024-01-01T10:00"
    write(folder, "bi14_sibling.py", "import torch\ndef make():\n    return torch.nn.Linear(1024, 1024).cuda().half()\n")
    write(folder, "step.py", textwrap.dedent("""
        import argparse, torch, memfit
        import bi14_sibling
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()
        device = torch.device("cuda")
        workload = memfit.Workload(
            model=lambda: bi14_sibling.make().to(device),
            batch=lambda n: (torch.randn(n, 1024, device="cuda").half(), torch.randn(n, 1024).to(device)),
            loss=lambda o, b: ((o.float() - b[1]) ** 2).mean(),
            optimizer=lambda p: torch.optim.SGD(p, lr=args.lr), batch_size=4)
        if __name__ == "__main__":
            raise SystemExit("the training loop must not run")
        """))
    out = run("estimate", str(folder / "step.py") + ":workload", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["param_count"] == 1024 * 1025 and data["breakdown"]["params"] < 3 * 2**20  # fp16: 2 MiB, not 4


# ------------------------------------------------------------------------------------------------- plan


def test_plan_finds_the_true_minimum_before_saying_nothing_fits() -> None:
    from memfit.estimate.allocator_config import AllocatorConfig
    from memfit.estimate.predict import estimate
    from memfit.plan.search import DEFAULT_MARGIN, plan

    mlp = memfit.builtin_workload("mlp")
    # the case (1.47 GiB before the bound's slack): micro-batch 256 x 1 with the fused optimizer just fits
    # a budget made from its own upper bound; the memory lines (fitted with accumulation on) put it over, and only
    # an exact estimate of it finds it
    need = estimate(mlp.replace(keep_output=False, batch_size=256, accumulation_steps=1,
                                optimizer_impl="fused")).device_upper_bytes
    p = plan(mlp, budget_bytes=int(need / (1 - DEFAULT_MARGIN)) + (4 << 20))
    c = p.chosen.config
    assert (c.micro_batch, c.accumulation_steps, c.optimizer_impl) == (256, 1, "fused") and p.chosen.verified
    # the plan runs through TrainStep (the output dropped before backward) and decides "fits" with the upper bound
    exact = estimate(mlp.replace(keep_output=False, **c.changes()))
    assert p.chosen.device_bytes == exact.device_upper_bytes == need <= p.budget_bytes * (1 - p.margin)
    # below it nothing fits, and the error says what the smallest configuration needs, exactly
    with pytest.raises(BudgetTooSmallError) as caught:
        plan(mlp, budget_bytes=2**30)
    message = str(caught.value)
    assert "\n" not in message and "micro-batch 256 × 1, fp32, fused optimizer" in message
    expandable = dataclasses.replace(AllocatorConfig.from_env(), expandable_segments=True)
    least = min(exact.device_upper_bytes,
                estimate(mlp.replace(keep_output=False, **c.changes()), allocator=expandable).device_upper_bytes)
    assert f"needs {format_bytes(least)}" in message
    accumulated = estimate(mlp.replace(keep_output=False,
                                       **dataclasses.replace(c, micro_batch=1, accumulation_steps=256).changes()))
    assert least < accumulated.device_upper_bytes  # micro-batch 1 is not the smallest here: its grads live in forward


def _plan_dict() -> dict[str, Any]:
    config = {"micro_batch": 8, "accumulation_steps": 2, "precision": "fp32", "checkpoint": [],
              "optimizer_impl": "fused", "channels_last": False, "expandable_segments": False, "patch_size": None}
    candidate = {"config": config, "device_bytes": 2**30, "fits_in_bytes": 2**29, "step_time_s": 0.01,
                 "samples_per_s": 1600.0, "verified": True, "fits": True}
    return {"workload": "mlp", "gpu": "H100", "budget_bytes": 2**31, "margin": 0.02, "effective_batch": 16,
            "chosen": candidate, "frontier": [candidate], "considered": 9, "estimates": 3, "speed_model": "roofline",
            "notes": [], "elapsed_s": 1.0, "schema": 1}


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    data = _plan_dict()
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"[1, 2]", "JSON object, got a list"),
        (b'"a plan"', "JSON object, got a string"),
        (b"null", "JSON object, got null"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"schema": 1', "not JSON"),
        (json.dumps(_with(["chosen"], KeyError)).encode(), "missing chosen"),
        (json.dumps(_with(["extra"], 1)).encode(), "unknown extra"),
        (json.dumps(_with(["chosen", "config", "micro_batch"], -5)).encode(), "micro_batch must be a positive"),
        (json.dumps(_with(["chosen", "config", "micro_batch"], "64")).encode(), "micro_batch must be a number"),
        (json.dumps(_with(["chosen", "config", "precision"], "fp8")).encode(), "precision must be one of"),
        (json.dumps(_with(["frontier"], {"a": 1})).encode(), "frontier must be a list"),
        (json.dumps(_with(["margin"], 0.9)).encode(), "out of range"),
        (json.dumps(_with(["schema"], 7)).encode(), "schema 7"),
    ],
)
def test_plan_load_rejects_what_is_not_a_plan(tmp_path: Path, payload: bytes, needle: str) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(payload)
    with pytest.raises(UsageError) as caught:
        memfit.Plan.load(path)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_plan_load_reads_a_saved_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_dict()))
    plan = memfit.Plan.load(path)
    assert plan.chosen.config.checkpoint == () and plan.chosen.config.micro_batch == 8


# ---------------------------------------------------------------------------------------------- Python API


def _tiny(**changes: Any) -> memfit.Workload:
    fields: dict[str, Any] = dict(model=lambda: torch.nn.Linear(8, 4), batch=lambda n: (torch.randn(n, 8),),
                                  loss=lambda o, b: o.sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                                  batch_size=4)
    return memfit.Workload(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"channels_last": "no"}, "channels_last must be True or False"),
        ({"checkpoint": None}, "checkpoint must be a tuple of module names"),
        ({"checkpoint": "layers.0"}, "checkpoint must be a tuple of module names"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"batch_size": 10**30}, "batch_size must be at most 2147483647"),
        ({"accumulation_steps": True}, "accumulation_steps must be a positive integer"),
        ({"precision": ["fp32"]}, "precision must be one of"),
        ({"patch_size": (1.5, 2)}, "patch_size must be a tuple of positive integers"),
        ({"name": 3}, "name must be a string"),
    ],
)
def test_workload_fields_are_checked(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(WorkloadError, match=needle):
        _tiny(**changes)


def test_workload_takes_numpy_integers() -> None:
    w = _tiny(batch_size=np.int64(4), accumulation_steps=np.int32(2), channels_last=np.bool_(False))
    assert type(w.batch_size) is int and w.effective_batch_size == 8 and w.channels_last is False


def test_load_workload_api_errors_are_typed(tmp_path: Path) -> None:
    write(tmp_path, "raises.py", "raise KeyError('setting')\n")
    with pytest.raises(UserCodeError, match=r"raises.py:1 in <module>: KeyError: 'setting'"):
        memfit.load_workload(str(tmp_path / "raises.py"))
    with pytest.raises(WorkloadError, match="name a workload"):
        memfit.load_workload("")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"micro_batch_size": "2"}, "micro_batch_size must be an integer"),
        ({"micro_batch_size": 0}, "micro_batch_size must be at least 1"),
        ({"max_grad_norm": "1"}, "max_grad_norm must be a positive number"),
        ({"agree_timeout_s": float("nan")}, "agree_timeout_s must be positive"),
        ({"micro_batch": 2}, "unknown keyword argument(s) micro_batch"),
    ],
)
def test_train_step_options_are_checked(kwargs: dict[str, Any], needle: str) -> None:
    model = torch.nn.Linear(4, 1)
    with pytest.raises(UsageError) as caught:
        memfit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda o, mb: o.sum(), **kwargs)
    assert needle in str(caught.value)


def test_train_step_on_an_empty_batch_is_a_zero_sample_step() -> None:
    model = torch.nn.Linear(4, 1)
    before = model.weight.detach().clone()
    step = memfit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            lambda o, mb: torch.nn.functional.mse_loss(o, mb[1]), micro_batch_size=2)
    metrics = step((torch.zeros(0, 4), torch.zeros(0, 1)))
    assert metrics.skipped and metrics.samples == 0 and metrics.micro_batches == 0
    assert torch.equal(model.weight, before)
    assert step((torch.randn(5, 4), torch.randn(5, 1))).micro_batches == 3  # and training goes on


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda s: {"schema": 1, "steps": 3}, "missing micro_batch_size"),
        (lambda s: {**s, "steps": "three"}, "steps must be an integer"),
        (lambda s: {**s, "micro_batch_size": -1}, "micro_batch_size must be an integer of at least 1"),
        (lambda s: {**s, "failed_sizes": [[1]]}, "malformed"),
        (lambda s: [s], "takes the dict"),
    ],
)
def test_train_step_load_state_dict_rejects_partial_states(change: Any, needle: str) -> None:
    model = torch.nn.Linear(4, 1)
    step = memfit.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda o, mb: o.sum(),
                            micro_batch_size=2)
    state = step.state_dict()
    with pytest.raises(UsageError, match=needle):
        step.load_state_dict(change(state))
    assert step.state_dict() == state  # nothing half-loaded


@pytest.mark.parametrize(
    ("text", "needle"),
    [("9" * 400 + "GiB", "more than 1 EiB"), (float("inf"), "at most 1 EiB"), (float("nan"), "positive"),
     (10**400, "at most 1 EiB"), ("1e3GiB", "cannot read the size")],
)
def test_sizes_out_of_range_are_usage_errors(text: Any, needle: str) -> None:
    with pytest.raises(UsageError, match=needle) as caught:
        parse_bytes(text)
    assert len(str(caught.value)) < 300


# ------------------------------------------------------------------------------------------ data utilities


def test_a_damaged_raster_names_the_file_and_the_window(tmp_path: Path) -> None:
    tifffile = pytest.importorskip("tifffile")
    path = tmp_path / "scene.tif"
    tifffile.imwrite(path, (np.random.default_rng(0).random((3, 256, 256)) * 255).astype(np.uint8),
                     tile=(128, 128), compression="zlib", photometric="minisblack")
    tiles = TileDataset.grid([path], size=128)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 7 // 8])  # the last tile cut off after the dataset was made: mid-epoch
    with pytest.raises(DataError) as caught:
        [tiles[i] for i in range(len(tiles))]
    assert str(path) in str(caught.value) and "(rows 128-256, columns " in str(caught.value)
    (tmp_path / "junk.tif").write_bytes(b"not a tiff" * 20)
    with pytest.raises(DataError, match="cannot open the raster .*junk.tif"):
        TileDataset.grid([tmp_path / "junk.tif"], size=64)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda d: ("raster", np.zeros((3, 0, 100), np.uint8)), "the raster is empty"),
        (lambda d: ("volume", (np.zeros((0, 8, 8), np.uint8), np.zeros((0, 8, 8), np.uint8))), "at least one voxel"),
        (lambda d: ("volume", (np.zeros((8, 8, 8), np.float32), np.zeros((8, 8, 6), np.uint8))),
         "spatial shapes (z, y, x) must be equal"),
    ],
)
def test_empty_or_misaligned_data_is_refused(tmp_path: Path, make: Any, needle: str) -> None:
    kind, arrays = make(tmp_path)
    if kind == "raster":
        np.save(tmp_path / "r.npy", arrays)
        with pytest.raises(DataError, match=needle):
            TileDataset.grid([tmp_path / "r.npy"], size=64)
        return
    np.save(tmp_path / "image.npy", arrays[0])
    np.save(tmp_path / "label.npy", arrays[1])
    with pytest.raises(DataError) as caught:
        PatchDataset([tmp_path / "image.npy"], [tmp_path / "label.npy"],
                     sampler=PatchSampler(patch_size=(4, 4, 4)), samples_per_epoch=2)
    assert needle in str(caught.value) and "label.npy" in str(caught.value)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: PatchSampler(patch_size=(1.5, 16, 16)), "patch_size must be three positive ints"),
        (lambda: grid_windows(100, 100, size=1.5), "whole number of pixels"),
        (lambda: grid_windows(100, 100, size=32, overlap=2.5), "overlap must be a whole number"),
    ],
)
def test_fractional_sizes_are_errors_not_truncated(build: Any, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        build()


def _tuple_of(sample: int, count: int) -> tuple[np.ndarray, ...]:
    return tuple(np.full(1, i + sample) for i in range(count))


def test_the_preprocessing_cache_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    cache = PreprocessCache(tmp_path / "cache", _tuple_of, params={"count": 3})
    # more than 10,000 arrays come back in order ("t_10000" sorts before "t_1001" as text)
    many = PreprocessCache(tmp_path / "cache", _tuple_of, params={"count": 10_002})
    assert [int(a[0]) for a in many.get(0, lambda: 0)] == list(range(10_002))
    shutil.rmtree(tmp_path / "cache")  # deleted while in use
    assert [int(a[0]) for a in cache.get(1, lambda: 1)] == [1, 2, 3] and cache.path(1).exists()
    cache.path(1).write_bytes(b"half an npz")  # damaged: computed again and replaced
    assert [int(a[0]) for a in cache.get(1, lambda: 1)] == [1, 2, 3]
    assert [int(a[0]) for a in cache.get(1, lambda: 99)] == [1, 2, 3]  # read back from the repaired file
    unwritable = PreprocessCache("/sys/memfit-cache", _tuple_of, params={"count": 2})  # read-only: uncached
    assert [int(a[0]) for a in unwritable.get(5, lambda: 5)] == [5, 6]
    assert "cannot be written" in caplog.text
    with pytest.raises(UsageError, match="cannot fill the preprocessing cache"):
        unwritable.fill([0], lambda i: i)


def test_measure_files_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.estimate import measure

    target = tmp_path / "trace.json.gz"
    target.write_bytes(b"the previous trace")
    snap = {"device_traces": [[{"action": "alloc", "addr": 0, "size": 512, "frames": []}]]}

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(measure.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure._write_compact_trace(snap, str(target), {})
    assert target.read_bytes() == b"the previous trace" and files_in(tmp_path) == {"trace.json.gz"}
    monkeypatch.undo()
    measure._write_compact_trace(snap, str(target), {"allocated_bytes.all.peak": 512})
    import gzip

    assert json.loads(gzip.decompress(target.read_bytes()))["events"][0][2] == 512

