"""The ``memfit`` command line. Bad input gets one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Optional

import typer

if TYPE_CHECKING:
    from memfit.explain.explanation import Explanation

from memfit.errors import MemfitError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Make PyTorch training fit in GPU memory.")

EXIT_USAGE = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"memfit: error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


_DROP_OUTPUT_HELP = ("Predict the loss-only step (the output dropped before backward, as Lightning's training_step "
                     "and HF Trainer do) instead of the plain loop that keeps it alive.")


def _load(spec: str, batch_size: Optional[int], precision: Optional[str], drop_output: bool = False):  # noqa: ANN202
    from memfit.workload.loading import load_workload
    from memfit.workload.spec import PRECISIONS

    if precision is not None and precision not in PRECISIONS:
        _fail(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    if batch_size is not None and batch_size < 1:
        _fail(f"--batch-size must be a positive integer, got {batch_size}.")
    workload = load_workload(spec)
    changes = {k: v for k, v in (("batch_size", batch_size), ("precision", precision)) if v is not None}
    if drop_output:
        changes["keep_output"] = False
    return workload.replace(**changes) if changes else workload


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
) -> None:
    """Predict the peak GPU memory of a training step, without a GPU."""
    from memfit.estimate.predict import estimate as run_estimate
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget) if budget is not None else None
    w = _load(workload, batch_size, precision, drop_output)
    if compare:
        import torch

        # before the estimate, which takes seconds: the measurement half cannot run here at all
        if not torch.cuda.is_available():
            _fail("--compare also measures on this machine's GPU, and no CUDA GPU is visible. "
                  "Drop --compare to estimate only, or run it on a GPU machine.")
    est = run_estimate(w, gpu=gpu)
    measured = None
    if compare:
        from memfit.estimate.measure import measure

        measured = measure(workload, batch_size=batch_size, precision=precision, hint_bytes=est.fits_in_bytes,
                           changes={"keep_output": False} if drop_output else None)
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
    from memfit.estimate.measure import measure as run_measure

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
    from memfit.explain.explanation import explain as run_explain

    w = _load(workload, batch_size, precision, drop_output)
    e = run_explain(w, gpu=gpu, budget_bytes=budget_bytes, oom_text=oom_text, fixes=not no_fixes)
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
    margin: float = typer.Option(0.02, "--margin", help="Keep predicted device memory under budget × (1 - margin)."),
    patch: bool = typer.Option(False, "--patch", help="Search the input patch size (segmentation workloads)."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Time a few micro-batches on this GPU first."),
    save: Optional[str] = typer.Option(None, "--save", help="Write the plan as JSON here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write the frontier (memory vs time) as a PNG here."),
    json_out: bool = typer.Option(False, "--json", help="Print the Plan as versioned JSON."),
) -> None:
    """The fastest training configuration that fits a memory budget, with the frontier of alternatives."""
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget)
    if effective_batch is not None and effective_batch < 1:
        _fail(f"--effective-batch must be a positive integer, got {effective_batch}.")
    if not 0 <= margin < 0.5:
        _fail(f"--margin must be between 0 and 0.5, got {margin}.")
    w = _load(workload, None, precision)
    calibration = None
    if calibrate:
        from memfit.speed.step_time import calibrate as run_calibration

        calibration = run_calibration(w)
    if patch:
        from memfit.plan.patch import plan_patch

        result = plan_patch(w, budget_bytes=budget_bytes, effective_batch=effective_batch, gpu=gpu, margin=margin,
                            calibration=calibration)
    else:
        from memfit.plan.search import plan as run_plan

        result = run_plan(w, budget_bytes=budget_bytes, effective_batch=effective_batch, gpu=gpu, margin=margin,
                          allow_precision_change=allow_precision_change, calibration=calibration)
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


def main() -> None:
    """The ``memfit`` console script. It ends the process (see ``_exit``): call ``app`` to embed the CLI."""
    try:
        # standalone_mode=False hands back typer.Exit codes instead of raising them
        code = app(standalone_mode=False)
        _exit(code if isinstance(code, int) else 0)
    except MemfitError as exc:
        typer.echo(f"memfit: error: {exc}", err=True)
        _exit(EXIT_USAGE)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except typer.BadParameter as exc:  # pragma: no cover - click formats these
        typer.echo(f"memfit: error: {exc}", err=True)
        _exit(EXIT_USAGE)
    except Exception as exc:  # click usage errors and aborts
        import click

        if isinstance(exc, click.exceptions.UsageError):
            typer.echo(f"memfit: error: {exc.format_message()}", err=True)
            _exit(EXIT_USAGE)
        if isinstance(exc, click.exceptions.Abort):
            _exit(130)
        raise


if __name__ == "__main__":
    main()
