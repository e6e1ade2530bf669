"""The ``memfit`` command line. Bad input gets one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn, Optional

import typer

if TYPE_CHECKING:
    from memfit.estimate.gpus import GpuSpec
    from memfit.explain.explanation import Explanation
    from memfit.speed.model_choice import CalibrationChoice

from memfit.errors import MemfitError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Make PyTorch training fit in GPU memory.")

EXIT_USAGE = 2
"""Bad input: a usage error, a bad file or value, an error in the user's own code."""
EXIT_BUG = 1
"""memfit's own bug: one line asking for a report (``MEMFIT_TRACEBACK=1`` adds the traceback)."""
EXIT_INTERRUPTED = 130
MAX_COUNT = 2**31 - 1  # memfit.workload.spec.MAX_BATCH_SIZE, without importing it (and torch's types) to start


def _fail(message: str) -> NoReturn:
    typer.echo(f"memfit: error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


_DROP_OUTPUT_HELP = ("Predict the loss-only step (the output dropped before backward, as Lightning's training_step "
                     "and HF Trainer do) instead of the plain loop that keeps it alive.")


def _check_count(option: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        _fail(f"{option} must be a positive integer, got {value}.")
    if value is not None and value > MAX_COUNT:
        shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:27]}..."
        _fail(f"{option} must be at most {MAX_COUNT}, got {shown}.")


def _check_precision(precision: Optional[str]) -> None:
    from memfit.workload.spec import PRECISIONS

    if precision is not None and precision not in PRECISIONS:
        _fail(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")


def _load(spec: str, batch_size: Optional[int], precision: Optional[str], drop_output: bool = False):  # noqa: ANN202
    from memfit.workload.loading import load_workload

    _check_precision(precision)
    _check_count("--batch-size", batch_size)
    workload = load_workload(spec)
    changes = {k: v for k, v in (("batch_size", batch_size), ("precision", precision)) if v is not None}
    if drop_output:
        changes["keep_output"] = False
    return workload.replace(**changes) if changes else workload


def _output_file(path: Optional[str], what: str) -> None:
    """Fail now, not after minutes of work, when ``path`` cannot be written."""
    if path is not None:
        from memfit._io import check_output_path

        check_output_path(path, what)


@contextlib.contextmanager
def _user_output_to_stderr() -> Iterator[None]:
    """While the user's code runs, what it prints goes to stderr: stdout carries memfit's answer alone (``--json``
    must parse). Both Python's ``sys.stdout`` and file descriptor 1 (C extensions print there) are redirected."""
    sys.stdout.flush()
    try:
        saved_fd: Optional[int] = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1 or 2 (a daemon): Python's stdout alone
        saved_fd = None
    saved = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = saved
        if saved_fd is not None:
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


@contextlib.contextmanager
def _progress(what: str) -> Iterator[None]:
    """A spinner on stderr saying what memfit does (its INFO log lines: each trace, each model build) and for
    how long. Only on a terminal: a pipe or a log file gets memfit's warnings as plain lines, nothing else."""
    if not sys.stderr.isatty():
        yield
        return
    import logging
    import threading

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from memfit.plan.lanes import threads_kept_out

    console = Console(stderr=True)
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                   transient=True)
    task = bar.add_task(what)

    class _ToSpinner(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                console.print(f"memfit: warning: {text}", markup=False, highlight=False)
            else:
                bar.update(task, description=f"{what}: {text}")

    logger = logging.getLogger("memfit")
    handler, level = _ToSpinner(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = set(threading.enumerate())
    try:
        # the spinner's refresh thread never touches what a planner's forked trace uses (memfit.plan.lanes)
        with bar, threads_kept_out(set(threading.enumerate()) - before):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def _running(what: str) -> Iterator[None]:
    """Around the work that runs the user's code: their output to stderr, and the spinner."""
    with _user_output_to_stderr(), _progress(what):
        yield


def _show_version(value: bool) -> None:
    if value:
        from memfit import __version__

        typer.echo(f"memfit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                 help="Print memfit's version and exit."),
) -> None:
    """Make PyTorch training fit in GPU memory."""


@app.command()
def estimate(
    workload: str = typer.Argument(..., help="A built-in name (see `memfit list`) or path/to/file.py[:name]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="Override the batch size."),
    precision: Optional[str] = typer.Option(None, "--precision", "-p", help="fp32, bf16 or fp16."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU to predict for: h100, h200, a100, rtx4090."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget, e.g. 24GiB (2^30) or 24GB (10^9)."),
    json_out: bool = typer.Option(False, "--json", help="Print the Estimate as versioned JSON."),
    compare: bool = typer.Option(False, "--compare", help="Also measure on this machine's GPU, side by side."),
    drop_output: bool = typer.Option(False, "--drop-output", help=_DROP_OUTPUT_HELP),
    optimizer_state: Optional[str] = typer.Option(
        None, "--optimizer-state", help="Adam/AdamW's states: full, 8bit (torchao's AdamW8bit) or cpu_offload "
        "(torchao's CPUOffloadOptimizer)."),
) -> None:
    """Predict the peak GPU memory of a training step, without a GPU."""
    from memfit.estimate.gpus import gpu_spec
    from memfit.units import parse_bytes
    from memfit.workload.spec import OPTIMIZER_STATES

    budget_bytes = parse_bytes(budget) if budget is not None else None
    spec = gpu_spec(gpu)
    _check_precision(precision)
    if optimizer_state is not None and optimizer_state not in OPTIMIZER_STATES:
        _fail(f"--optimizer-state must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer_state!r}.")
    _check_count("--batch-size", batch_size)
    if compare:
        import torch

        # before the estimate, which takes seconds: the measurement half cannot run here at all
        if not torch.cuda.is_available():
            _fail("--compare also measures on this machine's GPU, and no CUDA GPU is visible. "
                  "Drop --compare to estimate only, or run it on a GPU machine.")
    from memfit.estimate.predict import estimate as run_estimate

    with _running("estimating"):
        w = _load(workload, batch_size, precision, drop_output)
        changes: dict[str, object] = {"keep_output": False} if drop_output else {}
        if optimizer_state is not None:
            changes["optimizer_state"] = optimizer_state
            w = w.replace(optimizer_state=optimizer_state)
        est = run_estimate(w, gpu=spec)
        measured = None
        if compare:
            from memfit.estimate.measure import measure

            measured = measure(workload, batch_size=batch_size, precision=precision, hint_bytes=est.fits_in_bytes,
                               changes=changes or None)
    if json_out:
        import json

        payload = est.to_dict()
        if budget_bytes is not None:
            payload["budget_bytes"] = budget_bytes
            payload["fits_budget"] = est.fits(budget_bytes)
            payload["margin_bytes"] = est.margin_bytes(budget_bytes)
        if measured is not None:
            payload["measured"] = measured.to_dict()
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console

    from memfit.report.terminal import render_estimate

    render_estimate(est, Console(), budget_bytes=budget_bytes, measured=measured)


@app.command()
def measure(
    workload: str = typer.Argument(..., help="A built-in name or path/to/file.py[:name]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b"),
    precision: Optional[str] = typer.Option(None, "--precision", "-p"),
    bisect: bool = typer.Option(True, "--bisect/--no-bisect", help="Find the smallest cap that runs."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", help="Write a memory snapshot (memory_viz)."),
    json_out: bool = typer.Option(False, "--json"),
    drop_output: bool = typer.Option(False, "--drop-output", help=_DROP_OUTPUT_HELP),
) -> None:
    """Run the same protocol for real on this machine's GPU and report the same fields."""
    _check_precision(precision)
    _check_count("--batch-size", batch_size)
    _output_file(snapshot, "the memory snapshot")
    from memfit.estimate.measure import measure as run_measure

    with _running("measuring"):
        _load(workload, batch_size, precision, drop_output)  # validate before starting GPU processes
        m = run_measure(workload, batch_size=batch_size, precision=precision, bisect=bisect, snapshot=snapshot,
                        changes={"keep_output": False} if drop_output else None)
    if json_out:
        import json

        typer.echo(json.dumps(m.to_dict(), indent=2))
        return
    from rich.console import Console

    from memfit.report.terminal import render_measurement

    render_measurement(m, Console())


@app.command()
def explain(
    workload: Optional[str] = typer.Argument(None, help="A built-in name or path/to/file.py[:name]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help="Override the batch size."),
    precision: Optional[str] = typer.Option(None, "--precision", "-p", help="fp32, bf16 or fp16."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU to predict for: h100, h200, a100, rtx4090."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget, e.g. 12GiB: which fixes fit."),
    oom: Optional[str] = typer.Option(None, "--oom", help="A CUDA OOM message, or a log file holding one."),
    report: Optional[str] = typer.Option(None, "--report", help="Write an HTML report with pictures here."),
    png_dir: Optional[str] = typer.Option(None, "--png-dir", help="Write the pictures as PNG files here."),
    no_fixes: bool = typer.Option(False, "--no-fixes", help="Diagnosis only (each fix costs one estimate)."),
    json_out: bool = typer.Option(False, "--json", help="Print the Explanation as versioned JSON."),
    drop_output: bool = typer.Option(False, "--drop-output", help=_DROP_OUTPUT_HELP),
) -> None:
    """Why the step needs the memory it needs, what to change (each fix re-estimated), and pictures of it."""
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget) if budget is not None else None
    oom_text = None
    if oom is not None:
        from memfit.explain.oom_message import load_oom_text

        oom_text = load_oom_text(oom)
    if workload is None:
        if oom_text is None:
            _fail("give a workload (a built-in name or path/to/file.py) or --oom with a CUDA OOM message.")
        _explain_oom_only(oom_text, json_out)
        return
    from memfit.estimate.gpus import gpu_spec

    spec = gpu_spec(gpu)
    _check_precision(precision)
    _check_count("--batch-size", batch_size)
    _output_file(report, "the report")
    if png_dir is not None:
        from memfit._io import check_output_dir

        check_output_dir(png_dir, "the pictures")
    from memfit.explain.explanation import explain as run_explain

    with _running("explaining"):
        w = _load(workload, batch_size, precision, drop_output)
        e = run_explain(w, gpu=spec, budget_bytes=budget_bytes, oom_text=oom_text, fixes=not no_fixes)
        written = _write_pictures(e, report, png_dir)
    if json_out:
        typer.echo(e.to_json(indent=2))
        return
    from rich.console import Console

    from memfit.report.terminal import render_explanation

    console = Console()
    render_explanation(e, console)
    for path in written:
        console.print(f"wrote {path}")


def _explain_oom_only(oom_text: str, json_out: bool) -> None:
    from memfit.explain.oom_diagnosis import diagnose_oom
    from memfit.explain.oom_message import parse_oom_message

    diagnosis = diagnose_oom(parse_oom_message(oom_text))
    if json_out:
        typer.echo(diagnosis.to_json(indent=2))
        return
    from rich.console import Console

    from memfit.report.terminal import render_oom

    render_oom(diagnosis, Console())


def _write_pictures(e: Explanation, report: Optional[str], png_dir: Optional[str]) -> list[str]:
    written: list[str] = []
    if report is not None:
        from memfit.report.html import write_report

        written.append(str(write_report(e, report)))
    if png_dir is not None:
        from memfit.report.html import write_pngs

        written.extend(str(p) for p in write_pngs(e, png_dir))
    return written


@app.command()
def plan(
    workload: str = typer.Argument(..., help="A built-in name or path/to/file.py[:name]."),
    budget: str = typer.Option(..., "--budget", help="GPU memory for this process, e.g. 24GiB or 24GB."),
    effective_batch: Optional[int] = typer.Option(None, "--effective-batch", help="Samples per optimizer step."),
    precision: Optional[str] = typer.Option(None, "--precision", "-p", help="fp32, bf16 or fp16."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU to plan for: h100, h200, a100, rtx4090."),
    allow_precision_change: bool = typer.Option(False, "--allow-precision-change", help="Also try bf16 autocast."),
    allow_optimizer_state_change: bool = typer.Option(
        False, "--allow-optimizer-state-change",
        help="Also try torchao's 8-bit Adam states and CPU-offloaded Adam (Adam/AdamW only; running them needs "
        "torchao)."),
    margin: float = typer.Option(
        0.0, "--margin", help="Keep the predicted upper bound of device memory under budget × (1 - margin)."),
    patch: bool = typer.Option(False, "--patch", help="Search the input patch size (segmentation workloads)."),
    settle: Optional[bool] = typer.Option(
        None, "--settle/--no-settle",
        help="Decide on this GPU what the estimates cannot: with --patch, run a patch that only the upper bound "
        "keeps out (its best estimate fits) under the budget's cap, and take it if it runs; without, time the "
        "configurations the speed model predicts within 5 % of the fastest, and take the fastest measured "
        "(seconds each). Default: on when this machine has the --gpu card."),
    calibrate: Optional[bool] = typer.Option(
        None, "--calibrate/--roofline",
        help="Speed model that ranks the configurations. Default: --calibrate when this machine has the --gpu card "
        "(a few micro-batches timed, seconds), else the roofline; --roofline never times anything; --calibrate "
        "insists (fails without a CUDA GPU)."),
    save: Optional[str] = typer.Option(None, "--save", help="Write the plan as JSON here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write the frontier (memory vs time) as a PNG here."),
    json_out: bool = typer.Option(False, "--json", help="Print the Plan as versioned JSON."),
) -> None:
    """The fastest training configuration that fits a memory budget, with the frontier of alternatives."""
    from memfit.estimate.gpus import gpu_spec
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget)
    _check_count("--effective-batch", effective_batch)
    if not 0 <= margin < 0.5:
        _fail(f"--margin must be between 0 and 0.5, got {margin}.")
    spec = gpu_spec(gpu)
    _check_precision(precision)
    _output_file(save, "the plan")
    _output_file(plot, "the picture")
    with _running("planning"):
        w = _load(workload, None, precision)
        # the patch search is decided by memory alone: by default it does not spend GPU time on a speed model
        calibration: CalibrationChoice = "roofline" if calibrate is False or (calibrate is None and patch) else "auto"
        if calibrate:
            from memfit.speed.step_time import calibrate as run_calibration

            calibration = run_calibration(w)
        if patch:
            from memfit.plan.patch import plan_patch, trials_on_this_gpu

            settled = trials_on_this_gpu(workload) if _settle_here(settle, spec) else None
            result = plan_patch(w, budget_bytes=budget_bytes, effective_batch=effective_batch, gpu=spec,
                                margin=margin, calibration=calibration, settle=settled)
        else:
            from memfit.plan.search import plan as run_plan

            result = run_plan(w, budget_bytes=budget_bytes, effective_batch=effective_batch, gpu=spec, margin=margin,
                              allow_precision_change=allow_precision_change, calibration=calibration,
                              allow_optimizer_state_change=allow_optimizer_state_change,
                              race=_settle_here(settle, spec) if settle is not None else None)
        written = []
        if save is not None:
            written.append(str(result.save(save)))
        if plot is not None:
            from memfit.report.figures import save_frontier_png

            written.append(str(save_frontier_png(result, plot)))
    if json_out:
        typer.echo(result.to_json(indent=2))
        return
    from rich.console import Console

    from memfit.report.terminal import render_plan

    console = Console()
    render_plan(result, console)
    for path in written:
        console.print(f"wrote {path}")


def _settle_here(asked: bool | None, planned: GpuSpec) -> bool:
    """Whether the plan may run configurations on this machine's GPU (patch rungs, near-ties): asked for (and there
    is one), or by default when it is the card planned for."""
    from memfit.estimate.gpus import detect_gpu
    from memfit.speed.model_choice import same_card

    if asked is False:
        return False
    here = detect_gpu()
    if asked and here is None:
        _fail("--settle runs configurations on this machine's GPU, and there is no CUDA GPU here. Drop --settle.")
    return here is not None and (bool(asked) or same_card(planned, here))


nnunet_app = typer.Typer(no_args_is_help=True, help="nnU-Net v2: plans whose patch and batch fit a memory budget.")
app.add_typer(nnunet_app, name="nnunet")


@nnunet_app.command("plan")
def nnunet_plan(
    dataset: str = typer.Argument(..., help="nnU-Net dataset id (4) or folder name (Dataset004_Hippocampus)."),
    budget: str = typer.Option(..., "--budget", help="GPU memory for the training process, e.g. 24GiB or 24GB."),
    gpu: str = typer.Option("h100", "--gpu", help="GPU to plan for: h100, h200, a100, rtx4090."),
    plans: str = typer.Option("nnUNetPlans", "--plans", help="The plans identifier to start from."),
    name: Optional[str] = typer.Option(None, "--name", help="The new plans identifier [default: "
                                       "<plans>_memfit_<budget>]."),
    margin: float = typer.Option(
        0.02, "--margin", help="Keep the predicted upper bound of device memory under budget × (1 - margin): "
        "room for the workspaces cudnn.benchmark tries, which nnU-Net turns on."),
    settle: Optional[bool] = typer.Option(
        None, "--settle/--no-settle",
        help="Run a patch that only the upper bound keeps out (its best estimate fits) for three steps of "
        "nnUNetTrainer's step under the budget's cap on this GPU, and take it if it runs (seconds each). Default: "
        "on when this machine has the --gpu card."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as versioned JSON."),
) -> None:
    """Write an nnU-Net plans file whose 3d_fullres patch and batch memfit chose for BUDGET (nnUNet_raw and
    nnUNet_preprocessed set, as for nnUNetv2_plan_and_preprocess); print the nnUNetv2_train command."""
    from memfit.estimate.gpus import gpu_spec
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget)
    if not 0 <= margin < 0.5:
        _fail(f"--margin must be between 0 and 0.5, got {margin}.")
    spec = gpu_spec(gpu)
    from memfit.integrations.nnunet.plan import plan_nnunet

    with _running("planning nnU-Net"):
        result = plan_nnunet(dataset, budget=budget_bytes, gpu=spec, source_plans=plans, name=name, margin=margin,
                             settle=_settle_here(settle, spec))
    if json_out:
        typer.echo(result.to_json(indent=2))
        return
    for line in result.summary():
        typer.echo(line)


@app.command("list")
def list_builtins() -> None:
    """List the built-in workloads."""
    from memfit.workload.zoo import builtin_names

    for name, summary in builtin_names().items():
        typer.echo(f"{name:12s} {summary}")


def _exit(code: int) -> NoReturn:
    """End the process without the interpreter's teardown, after the atexit handlers (``memfit._process``)."""
    from memfit._process import exit_now

    exit_now(code)


def _usage_error_type() -> type[Exception]:
    """The ``UsageError`` class that typer raises. Recent typer releases bundle their own copy of click
    (``typer._click``, 0.29 here), so ``click.exceptions.UsageError`` from an installed click is another class
    that never matches; typer's public ``BadParameter`` derives from the right one, with either layout."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _usage_line(exc: Exception) -> str:
    """A click usage error as one line: the message, then where to look."""
    text = " ".join(ln.strip() for ln in exc.format_message().splitlines() if ln.strip())  # type: ignore[attr-defined]
    value = _value_given(getattr(exc, "param", None))
    if value is not None and repr(value) not in text and value not in text:
        text = f"{text.rstrip('.')} (got {value!r})."
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "memfit"
    end = "" if text.endswith((".", "?", "!")) else "."
    return f"{text}{end} See `{command} --help`."


def _value_given(param: object) -> Optional[str]:
    """What the command line gave the option ``param`` (click's message does not always repeat it)."""
    opts = getattr(param, "opts", None) or []
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(opt + "="):
                return arg[len(opt) + 1:]
    return None


def _bug(exc: BaseException) -> NoReturn:
    """memfit's own failure: one line that says so, the traceback only when asked for."""
    from memfit.workload.user_errors import memfit_place, one_line

    if os.environ.get("MEMFIT_TRACEBACK"):
        import traceback

        traceback.print_exception(exc)
    typer.echo(f"memfit: error: this is a memfit bug, please report it: {one_line(exc)} at {memfit_place(exc)}. "
               "Set MEMFIT_TRACEBACK=1 to print the traceback.", err=True)
    _exit(EXIT_BUG)


def _error(message: str, code: int = EXIT_USAGE) -> NoReturn:
    typer.echo(f"memfit: error: {message}", err=True)
    _exit(code)


def main() -> None:
    """The ``memfit`` console script. It ends the process (see ``_exit``): call ``app`` to embed the CLI.

    Exit codes: 0 success; 2 bad input (usage, values, files, an error in the user's code), one line on stderr;
    1 a memfit bug, one line asking for a report; 130 interrupted.
    """
    try:
        # standalone_mode=False hands back typer.Exit codes instead of raising them
        code = app(standalone_mode=False, prog_name="memfit")  # also as `python -m memfit.cli`
        if code == EXIT_INTERRUPTED:  # click turned a Ctrl-C into this code, silently
            _error("interrupted.", EXIT_INTERRUPTED)
        _exit(code if isinstance(code, int) else 0)
    except MemfitError as exc:
        _error(" ".join(str(exc).split("\n")).strip())
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _error("interrupted.", EXIT_INTERRUPTED)
    except SystemExit as exc:
        from memfit.workload.user_errors import system_exit_message, user_place

        if user_place(exc) is None:  # not from the user's code: let it end the process as asked
            raise
        _error(system_exit_message(exc, "the workload"))
    except Exception as exc:
        if isinstance(exc, _usage_error_type()):
            if type(exc).__name__ == "NoArgsIsHelpError":  # bare `memfit`: the help, as click shows it
                typer.echo(exc.format_message(), err=True)  # type: ignore[attr-defined]
                _exit(EXIT_USAGE)
            _error(_usage_line(exc))
        from memfit.workload.user_errors import user_code_error

        error = user_code_error(exc, during="your code", require_user_frame=True)
        if error is not None:
            _error(str(error))
        if isinstance(exc, OSError) and not isinstance(exc, (ConnectionError, TimeoutError)):
            where = f" ({exc.filename})" if exc.filename else ""
            _error(f"{exc.strerror or exc}{where}. Check the path and its permissions, and free disk space.")
        if isinstance(exc, MemoryError):
            _error("the host ran out of memory. Close other programs, or try a smaller batch or model.")
        _bug(exc)


if __name__ == "__main__":
    main()
