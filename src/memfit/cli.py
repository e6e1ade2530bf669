"""The ``memfit`` command line. Bad input gets one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from memfit.errors import MemfitError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Make PyTorch training fit in GPU memory.")

EXIT_USAGE = 2


def _fail(message: str) -> None:
    typer.echo(f"memfit: error: {message}", err=True)
    raise typer.Exit(EXIT_USAGE)


def _load(spec: str, batch_size: Optional[int], precision: Optional[str]):  # noqa: ANN202
    from memfit.workload import PRECISIONS, load_workload

    if precision is not None and precision not in PRECISIONS:
        _fail(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    if batch_size is not None and batch_size < 1:
        _fail(f"--batch-size must be a positive integer, got {batch_size}.")
    workload = load_workload(spec)
    changes = {k: v for k, v in (("batch_size", batch_size), ("precision", precision)) if v is not None}
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
) -> None:
    """Predict the peak GPU memory of a training step, without a GPU."""
    from memfit.estimate import estimate as run_estimate
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(budget) if budget is not None else None
    w = _load(workload, batch_size, precision)
    if compare:
        import torch

        # before the estimate, which takes seconds: the measurement half cannot run here at all
        if not torch.cuda.is_available():
            _fail("--compare also measures on this machine's GPU, and no CUDA GPU is visible. "
                  "Drop --compare to estimate only, or run it on a GPU machine.")
    est = run_estimate(w, gpu=gpu)
    measured = None
    if compare:
        from memfit.measure import measure

        measured = measure(workload, batch_size=batch_size, precision=precision, hint_bytes=est.fits_in_bytes)
    if json_out:
        import json

        payload = est.to_dict()
        if budget_bytes is not None:
            payload["budget_bytes"] = budget_bytes
            payload["fits_budget"] = est.margin_bytes(budget_bytes) >= 0
            payload["margin_bytes"] = est.margin_bytes(budget_bytes)
        if measured is not None:
            payload["measured"] = measured.to_dict()
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console

    from memfit.render import render_estimate

    render_estimate(est, Console(), budget_bytes=budget_bytes, measured=measured)


@app.command()
def measure(
    workload: str = typer.Argument(..., help="A built-in name or path/to/file.py[:name]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b"),
    precision: Optional[str] = typer.Option(None, "--precision", "-p"),
    bisect: bool = typer.Option(True, "--bisect/--no-bisect", help="Find the smallest cap that runs."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", help="Write a memory snapshot (memory_viz)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Run the same protocol for real on this machine's GPU and report the same fields."""
    from memfit.measure import measure as run_measure

    _load(workload, batch_size, precision)  # validate before starting GPU processes
    m = run_measure(workload, batch_size=batch_size, precision=precision, bisect=bisect, snapshot=snapshot)
    if json_out:
        import json

        typer.echo(json.dumps(m.to_dict(), indent=2))
        return
    from rich.console import Console

    from memfit.render import render_measurement

    render_measurement(m, Console())


@app.command("list")
def list_builtins() -> None:
    """List the built-in workloads."""
    from memfit.zoo import builtin_names

    for name, summary in builtin_names().items():
        typer.echo(f"{name:12s} {summary}")


def main() -> None:
    try:
        # standalone_mode=False hands back typer.Exit codes instead of raising them
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except MemfitError as exc:
        typer.echo(f"memfit: error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.BadParameter as exc:  # pragma: no cover - click formats these
        typer.echo(f"memfit: error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as exc:  # click usage errors and aborts
        import click

        if isinstance(exc, click.exceptions.UsageError):
            typer.echo(f"memfit: error: {exc.format_message()}", err=True)
            sys.exit(EXIT_USAGE)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
