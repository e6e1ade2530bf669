"""Terminal rendering of results with rich. Only the CLI calls this; the library never prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.estimate.categories import MEMORY_CATEGORIES
from memfit.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from memfit.estimate.measure import Measurement
    from memfit.estimate.predict import Estimate
    from memfit.explain.explanation import Explanation
    from memfit.explain.fixes import TrainingChange
    from memfit.explain.oom_diagnosis import OomDiagnosis
    from memfit.plan.records import Plan



def _bar(fraction: float, width: int = 24) -> str:
    filled = max(0, min(width, round(fraction * width)))
    return "█" * filled + "·" * (width - filled)


def _module_rollup(by_module: dict[str, int], depth: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, size in by_module.items():
        key = ".".join(name.split(".")[:depth]) if name else "(model)"
        out[key] = out.get(key, 0) + size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def render_estimate(est: Estimate, console: Console, *, budget_bytes: int | None = None,
                    measured: Measurement | None = None) -> None:
    from rich.panel import Panel
    from rich.table import Table

    title = f"{est.workload} · batch {est.batch_size} · {est.precision} · {est.gpu}"
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_column(justify="right")
    rows = [
        ("peak allocated", est.peak_allocated_bytes, "torch.cuda.max_memory_allocated()",
         measured.peak_allocated_bytes if measured else None),
        ("peak reserved", est.peak_reserved_bytes, "torch.cuda.max_memory_reserved(), no cap",
         measured.peak_reserved_bytes if measured else None),
        ("fits in", est.fits_in_bytes, "smallest allocator cap that runs without OOM",
         measured.fits_in_bytes if measured else None),
        ("device", est.device_bytes, "fits in + CUDA context: what the GPU must have",
         measured.device_bytes if measured else None),
        ("device, upper bound", est.device_upper_bytes, "what a \"fits\" verdict promises is enough"
         + "".join(f"; wider: {u.reason}" for u in est.uncertainty if u.widen or u.bytes), None),
    ]
    for label, value, note, meas in rows:
        extra = ""
        if meas:
            extra = f"measured {format_bytes(meas)} ({(value - meas) / meas:+.1%})"
        head.add_row(label, format_bytes(value), note, extra)
    console.print(Panel(head, title=title, expand=False))

    total = max(est.fits_in_bytes, 1)
    cats = Table(title=f"At the peak: {est.peak_phase} of step {est.peak_step + 1}, op {est.peak_op}"
                 + (f" in {est.peak_module}" if est.peak_module else ""), title_justify="left")
    cats.add_column("category")
    cats.add_column("bytes", justify="right")
    cats.add_column("share", justify="right")
    cats.add_column("")
    for cat in MEMORY_CATEGORIES:
        size = est.breakdown.get(cat, 0)
        if size:
            cats.add_row(cat, format_bytes(size), f"{size / total:.1%}", _bar(size / total))
    console.print(cats)

    if est.activations_by_module:
        mods = Table(title="Activations saved for backward, by module (end of forward)", title_justify="left")
        mods.add_column("module")
        mods.add_column("bytes", justify="right")
        mods.add_column("")
        top = _module_rollup(est.activations_by_module, 1)
        biggest = max(top.values())
        for name, size in list(top.items())[:10]:
            mods.add_row(name, format_bytes(size), _bar(size / biggest, 16))
        console.print(mods)

    tensors = Table(title="Largest tensors alive at the peak", title_justify="left")
    for col in ("bytes", "category", "made by", "op", "shape", "dtype"):
        tensors.add_column(col, justify="right" if col == "bytes" else "left")
    for t in est.largest_tensors[:8]:
        tensors.add_row(format_bytes(t.nbytes), t.category, t.module or t.phase, t.op,
                        "×".join(map(str, t.shape)), t.dtype)
    console.print(tensors)

    for w in est.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    for unsure in est.uncertainty:
        if not (unsure.widen or unsure.bytes):  # named for the record (an input check, LayerDrop): nothing to doubt
            console.print(f"[dim]noted, bound not widened:[/] {unsure.reason}: {unsure.detail}")
            continue
        by = f"+{format_bytes(unsure.bytes)}" if unsure.bytes else f"+{unsure.widen:.0%}"
        console.print(f"[yellow]upper bound {by}:[/] {unsure.reason}: {unsure.detail}")
    if budget_bytes is not None:
        margin = est.margin_bytes(budget_bytes)
        if margin >= 0:
            console.print(f"[green]Fits[/] a budget of {format_bytes(budget_bytes)} with "
                          f"{format_bytes(margin)} ({margin / budget_bytes:.1%}) to spare.")
        else:
            console.print(f"[red]Does not fit[/] a budget of {format_bytes(budget_bytes)}: needs up to "
                          f"{format_bytes(est.device_upper_bytes)}, {format_bytes(-margin)} too much. "
                          "`memfit explain` with the same --budget ranks the fixes that make it fit.")
    console.print(f"[dim]{est.param_count / 1e6:.1f} M parameters · {est.steps} steps simulated in "
                  f"{est.elapsed_s:.1f} s · {est.method}[/]")


def render_measurement(m: Measurement, console: Console) -> None:
    from rich.table import Table

    t = Table(title=f"{m.workload} measured on {m.gpu} (torch {m.torch_version}, CUDA {m.cuda_version})")
    t.add_column("")
    t.add_column("bytes", justify="right")
    rows: list[tuple[str, Any]] = [
        ("peak allocated", m.peak_allocated_bytes),
        ("peak reserved", m.peak_reserved_bytes),
        ("fits in", m.fits_in_bytes),
        ("outside allocator", m.outside_allocator_bytes),
        ("device", m.device_bytes),
    ]
    for label, value in rows:
        t.add_row(label, "—" if value is None else format_bytes(value))
    console.print(t)
    if m.cudnn_benchmark:
        console.print("cudnn.benchmark was on: the peaks count its search for the fastest algorithms, which takes "
                      "what memory the GPU has free; 'fits in' is what the step needs.")
    if m.snapshot_path:
        console.print(f"memory snapshot: {m.snapshot_path} (open it at pytorch.org/memory_viz)")


_TRAINING_WORDS: dict[TrainingChange, str] = {"no": "[green]same maths[/]", "numerics": "[yellow]numerics[/]", "semantics": "[red]semantics[/]"}


def render_explanation(e: Explanation, console: Console) -> None:
    """The diagnosis in words, then the fixes, ranked by saving."""
    from rich.panel import Panel
    from rich.table import Table

    est = e.estimate
    lines = [f"[bold]{e.headline}[/]", ""]
    total = max(est.fits_in_bytes, 1)
    made = ", ".join(
        f"{p.category.replace('_', ' ')} {p.share:.0%}" + (f" ({p.detail})" if p.detail and p.share >= 0.05 else "")
        for p in e.parts if p.nbytes / total >= 0.01
    )
    lines.append(f"[bold]What the peak is made of:[/] {made}.")
    lines.append(f"[bold]When:[/] {e.peak_when}; {e.peak_why}.")
    if e.scaling_text:
        lines.append(f"[bold]How it scales:[/] {e.scaling_text}")
    title = f"{e.workload} · micro-batch {est.batch_size} · {est.precision} · {e.gpu}"
    console.print(Panel("\n".join(lines), title=title, expand=False))
    if e.fixes:
        t = Table(title="Fixes, each re-estimated (largest saving first)", title_justify="left")
        for col in ("fix", "needs", "saves", "time", "training", "fits"):
            t.add_column(col, justify="right" if col in ("needs", "saves", "time") else "left")
        for f in e.fixes:
            fits = "" if f.fits_budget is None else ("[green]yes[/]" if f.fits_budget else "[red]no[/]")
            time_text = "" if f.time_factor is None else f"{f.time_factor:.2f}×"
            t.add_row(f.name, format_bytes(f.device_bytes), format_bytes(f.saving_bytes), time_text,
                      _TRAINING_WORDS.get(f.changes_training, f.changes_training), fits)
        console.print(t)
        for f in e.fixes[:3]:
            console.print(f"[dim]{f.name}: {f.speed_cost}" + (f"; {f.caveat}" if f.caveat else "") + "[/]")
    if e.not_helping:
        tried = ", ".join(f"{f.name} ({format_bytes(-f.saving_bytes)} more)" if f.saving_bytes < 0 else f.name
                          for f in e.not_helping)
        console.print(f"[dim]Tried, no saving: {tried}.[/]")
    if e.combination is not None:
        c = e.combination
        console.print(f"[green]Fits {format_bytes(e.budget_bytes or 0)}[/] with {c.name}: needs "
                      f"{format_bytes(c.device_bytes)}.")
    for note in e.notes:
        console.print(f"[yellow]note:[/] {note}")
    if e.oom:
        render_oom(e.oom, console)
    n_tried = len(e.fixes) + len(e.not_helping)
    console.print(f"[dim]{n_tried} fixes re-estimated in {e.elapsed_s:.1f} s; 'needs' is device memory "
                  "(allocator cap + CUDA context)[/]")


def render_oom(diagnosis: OomDiagnosis, console: Console) -> None:
    """A parsed CUDA OOM message: the numbers it gives, then what they mean."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    sizes = Table.grid(padding=(0, 2))
    sizes.add_column(style="bold")
    sizes.add_column(justify="right")
    for label, nbytes in diagnosis.message.sizes():
        sizes.add_row(label, format_bytes(nbytes))
    findings = Table.grid(padding=(0, 1))  # a bullet column: wrapped lines stay indented under their sentence
    findings.add_column()
    findings.add_column()
    for line in diagnosis.findings:
        findings.add_row("•", escape(line))
    causes = ", ".join(c.replace("_", " ") for c in diagnosis.causes)
    body = Group(
        sizes,
        "",
        findings if diagnosis.findings else "The message holds no numbers to diagnose.",
        *([f"[dim]causes: {causes}[/]"] if causes else []),
    )
    title = f"The out-of-memory message ({escape(diagnosis.message.torch_format)})"
    console.print(Panel(body, title=title, expand=False))


def render_plan(p: Plan, console: Console) -> None:
    """The chosen configuration, then the frontier of alternatives."""
    from rich.panel import Panel
    from rich.table import Table

    c = p.chosen
    cfg = c.config
    lines = [
        f"[bold]{cfg.label()}[/]",
        f"micro-batch {cfg.micro_batch} × {cfg.accumulation_steps} accumulation steps = effective batch "
        f"{cfg.effective_batch}",
    ]
    if cfg.checkpoint:
        lines.append(f"checkpoint: {', '.join(cfg.checkpoint)}")
    lines.append(f"needs {format_bytes(c.device_bytes)} of {format_bytes(p.budget_bytes)} "
                 f"(kept under {1 - p.margin:.0%} of it)")
    if c.step_time_s is not None:
        lines.append(f"predicted {c.step_time_s * 1e3:.0f} ms per optimizer step, {c.samples_per_s:.1f} samples/s "
                     f"({p.speed_model} speed model)")
    if c.measured_step_s is not None:
        lines.append(f"ran {c.measured_step_s * 1e3:.0f} ms per optimizer step on this GPU, the fastest of the "
                     "near-ties timed (see the notes)")
    console.print(Panel("\n".join(lines), title=f"plan for {p.workload} on {p.gpu}", expand=False))
    t = Table(title="Frontier: no other configuration is both smaller and faster", title_justify="left")
    for col in ("micro × acc", "checkpoint", "optimizer", "format", "needs", "ms/step", "samples/s", "memory from"):
        t.add_column(col, justify="right" if col in ("needs", "ms/step", "samples/s") else "left")
    for f in p.frontier:
        k = f.config
        mark = "[bold]→ [/]" if k == cfg else ""
        t.add_row(
            f"{mark}{k.micro_batch} × {k.accumulation_steps}" + (f" ({'×'.join(map(str, k.patch_size))})"
                                                                 if k.patch_size else ""),
            f"{len(k.checkpoint)} blocks" if k.checkpoint else "none",
            k.optimizer_impl, ("channels_last" if k.channels_last else "default") + (
                " + expandable" if k.expandable_segments else ""),
            format_bytes(f.device_bytes),
            "" if f.step_time_s is None else f"{f.step_time_s * 1e3:.0f}",
            "" if f.samples_per_s is None else f"{f.samples_per_s:.1f}",
            "estimate" if f.verified else "line",
        )
    console.print(t)
    for note in p.notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"[dim]{p.considered} configurations scored, {p.estimates} traced, in {p.elapsed_s:.1f} s[/]")
