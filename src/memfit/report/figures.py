"""Pictures of an estimate: the memory timeline, activations per block, the breakdown at the peak, the fixes.

Each function returns a matplotlib ``Figure`` whose title states the answer, so a reader sees it before reading a
number. Every chart gives a category the same colour (``CATEGORY_COLORS``). matplotlib is an optional extra
(``pip install 'memfit[report]'``), imported here only, when a figure is drawn; figures are built on the Agg canvas
without pyplot, so no global figure state is kept and nothing needs a display.

Example:
    >>> from memfit.estimate.predict import estimate
    >>> from memfit.workload.zoo import builtin_workload
    >>> fig = timeline_figure(estimate(builtin_workload("mlp").replace(batch_size=8)))  # doctest: +SKIP
    >>> fig.savefig("timeline.png")  # doctest: +SKIP
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit._io import check_output_path, write_atomic
from memfit.errors import MissingExtraError
from memfit.estimate.categories import TRACED_CATEGORIES
from memfit.units import GiB, KiB, MiB, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from memfit.estimate.predict import Estimate
    from memfit.explain.explanation import Explanation, Fix
    from memfit.explain.fixes import TrainingChange
    from memfit.plan.records import Plan

# Tableau 10: distinguishable with the common colour-vision deficiencies, and print well in grey
CATEGORY_COLORS = {
    "params": "#4E79A7",
    "buffers": "#76B7B2",
    "grads": "#59A14F",
    "optimizer_state": "#B07AA1",
    "data": "#9C755F",
    "activations": "#F28E2B",
    "temporaries": "#EDC948",
    "workspaces": "#E15759",
    "fragmentation": "#BAB0AC",
}
CATEGORY_LABELS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer_state": "optimizer state",
    "data": "batch",
    "activations": "activations",
    "temporaries": "temporaries",
    "workspaces": "library workspaces",
    "fragmentation": "fragmentation",
}
# how much a fix changes training: the same mathematics, other rounding, or another algorithm
TRAINING_COLORS: dict[TrainingChange, str] = {"no": "#59A14F", "numerics": "#EDC948", "semantics": "#E15759"}
_TRAINING_LABELS: dict[TrainingChange, str] = {
    "no": "same training",
    "numerics": "other rounding",
    "semantics": "changes training",
}
_PHASE_COLORS = {"forward": "#D6E4F2", "backward": "#F9DCC4", "optimizer": "#E6DAEF"}
_PHASE_OTHER = "#EEEEEE"
_BUDGET_COLOR = "#C0392B"
_NEED_COLOR = "#333333"
_INK = "#222222"
_MUTED = "#666666"
_TOP_BLOCKS = 14
PNG_DPI = 110


def _matplotlib() -> Any:
    """Import matplotlib with the Agg canvas, or say how to install it."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401  (the canvas savefig uses)
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            "memfit's pictures need matplotlib, which is not installed: pip install 'memfit[report]'"
        ) from e
    return matplotlib


def _figure(width: float, height: float) -> Figure:
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _split(obj: Estimate | Explanation) -> tuple[Estimate, Explanation | None]:
    """(estimate, explanation or None) from either; plots accept both."""
    if hasattr(obj, "fixes") and hasattr(obj, "estimate"):
        return obj.estimate, obj  # type: ignore[union-attr, return-value]
    return obj, None  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------- axes


def _unit(max_bytes: float) -> tuple[int, str]:
    for size, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if max_bytes >= size:
            return size, name
    return 1, "B"


def _byte_axis(axis: Any, max_bytes: float) -> None:
    """Ticks at round numbers of one binary unit (0, 2 GiB, 4 GiB, ...), about six of them."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    unit, name = _unit(max_bytes)
    span = max(max_bytes / unit, 1e-9)
    step = next((s for s in (0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000) if span / s <= 7),
                10 ** len(str(int(span))))
    axis.set_major_locator(MultipleLocator(step * unit))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / unit:g} {name}" if v else "0"))


def _clean(ax: Axes) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(colors=_MUTED, labelcolor=_INK)


def _title(fig: Figure, text: str, subtitle: str = "") -> None:
    import textwrap

    text = textwrap.fill(text, 100)  # about what 14 pt bold holds across a 12-inch figure
    fig.suptitle(text, x=0.01, ha="left", fontsize=14, fontweight="bold", color=_INK)
    if subtitle:
        # a second line under the title: what the picture shows, in smaller grey type
        fig.text(0.01, 1.0, subtitle, ha="left", va="bottom", fontsize=10, color=_MUTED,
                 transform=fig.transSubfigure)


def _is_are(category: str) -> str:
    """``"activations are"``, ``"optimizer state is"``: the category's label with its verb."""
    label = CATEGORY_LABELS.get(category, category)
    return f"{label} {'is' if category in ('optimizer_state', 'data', 'fragmentation') else 'are'}"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole > 0 else "–"


# ----------------------------------------------------------------------------------------------- timeline


def _segments(phases: list[tuple[int, str, int]], end: int) -> list[tuple[int, int, str, int]]:
    """(start, stop, phase, step) runs; the loss is drawn as part of forward, zero_grad as part of the step's start."""
    merged: list[tuple[int, int, str, int]] = []
    for i, (at, name, step) in enumerate(phases):
        if name == "end":
            break
        stop = phases[i + 1][0] if i + 1 < len(phases) else end
        name = {"loss": "forward", "zero_grad": "forward" if stop == at else name}.get(name, name)
        if merged and merged[-1][2] == name and merged[-1][3] == step:
            merged[-1] = (merged[-1][0], stop, name, step)
        elif stop > at:
            merged.append((at, stop, name, step))
    return merged


def timeline_figure(estimate: Estimate | Explanation, *, budget_bytes: int | None = None) -> Figure:
    """The allocated memory over the traced steps, stacked by category, phases marked and the peak annotated.

    Args:
        estimate: an ``Estimate`` (or an ``Explanation``, whose estimate and budget are used).
        budget_bytes: the memory the GPU has for this process, drawn as a line (default: the explanation's).
    """
    est, expl = _split(estimate)
    if budget_bytes is None and expl is not None:
        budget_bytes = expl.budget_bytes
    fig = _figure(12, 6.2)
    strip, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 11], "hspace": 0.0})
    points = est.timeline
    xs = [p.event for p in points]
    end = max([xs[-1] + 1 if xs else 1] + [at for at, _, _ in est.phases])
    # bottom to top: what lives all run first, then what comes and goes within a step
    present = [c for c in TRACED_CATEGORIES if any(p.by_category.get(c, 0) for p in points)]
    if present:
        ys = [[p.by_category.get(c, 0) for p in points] for c in present]
        ax.stackplot(xs, ys, colors=[CATEGORY_COLORS[c] for c in present], step="post",
                     labels=[CATEGORY_LABELS[c] for c in present], linewidth=0)
    else:  # a timeline without categories (TimelinePoint.by_category empty): its total, in one colour
        ax.fill_between(xs, [p.allocated_bytes for p in points], step="post", color=CATEGORY_COLORS["params"])
    ax.step(xs, [p.allocated_bytes for p in points], where="post", color=_INK, linewidth=0.6)

    # phases: a coloured strip above the plot, and faint bands through it
    segments = _segments(est.phases, end)
    for start, stop, name, _step in segments:
        color = _PHASE_COLORS.get(name, _PHASE_OTHER)
        strip.axvspan(start, stop, color=color, linewidth=0)
        if name in _PHASE_COLORS:
            ax.axvspan(start, stop, color=color, alpha=0.35, linewidth=0, zorder=0)
        label = _phase_label(name, (stop - start) / end)
        if label:
            strip.text((start + stop) / 2, 0.5, label, ha="center", va="center", fontsize=9, color=_INK)
    steps: dict[int, tuple[int, int]] = {}
    for start, stop, name, step in segments:
        if name in _PHASE_COLORS:
            lo, hi = steps.get(step, (start, stop))
            steps[step] = (min(lo, start), max(hi, stop))
    for step, (lo, hi) in sorted(steps.items()):
        ax.axvline(lo, color="#999999", linewidth=0.8, linestyle=":", zorder=1)
        strip.text((lo + hi) / 2, 1.15, f"step {step + 1}", ha="center", va="bottom", fontsize=10,
                   fontweight="bold", color=_INK)
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    for side in ("top", "right", "left", "bottom"):
        strip.spines[side].set_visible(False)
    strip.tick_params(bottom=False)

    # the peak, what the GPU needs, and the budget; the two lines are labelled in the right margin, the higher
    # label above its line and the lower below, so they never overlap
    peak = max(points, key=lambda p: p.allocated_bytes) if points else None
    top = max([est.device_bytes, est.peak_allocated_bytes] + ([budget_bytes] if budget_bytes else []))
    ax.set_ylim(0, top * 1.22)
    ax.set_xlim(0, end)
    margin = ax.get_yaxis_transform()  # x in axes fractions, y in bytes
    need_above = budget_bytes is None or est.device_bytes >= budget_bytes
    ax.axhline(est.device_bytes, color=_NEED_COLOR, linestyle="--", linewidth=1.2)
    ax.text(1.005, est.device_bytes, f"needs {format_bytes(est.device_bytes)}\non the GPU",
            va="bottom" if need_above else "top", ha="left", fontsize=9, color=_NEED_COLOR, transform=margin)
    if budget_bytes:
        ax.axhline(budget_bytes, color=_BUDGET_COLOR, linewidth=2)
        fits = est.fits(budget_bytes)
        ax.text(1.005, budget_bytes, f"budget {format_bytes(budget_bytes)}\n{'fits' if fits else 'does not fit'}",
                va="top" if need_above else "bottom", ha="left", fontsize=10, color=_BUDGET_COLOR,
                fontweight="bold", transform=margin)
    if peak is not None:
        where = est.peak_op + (f" in {est.peak_module}" if est.peak_module else "")
        text = f"peak {format_bytes(peak.allocated_bytes)}\n{est.peak_phase}, step {est.peak_step + 1}\n{where}"
        left = peak.event > end * 0.6
        ax.plot([peak.event], [peak.allocated_bytes], marker="v", color=_INK, markersize=9, zorder=5)
        ax.annotate(text, (peak.event, peak.allocated_bytes), xytext=(-20 if left else 20, -10),
                    textcoords="offset points", ha="right" if left else "left", va="top", fontsize=10,
                    color=_INK, bbox={"boxstyle": "round,pad=0.4", "fc": "white", "ec": "#999999", "alpha": 0.92},
                    zorder=6)
    _byte_axis(ax.yaxis, top * 1.22)
    ax.set_xticks([])
    ax.set_xlabel("time through the traced steps (allocator events) →", color=_MUTED)
    ax.set_ylabel("allocated memory", color=_MUTED)
    _clean(ax)
    handles, labels = ax.get_legend_handles_labels()
    # below the plot, left to right in stacking order (bottom of the stack first)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)
    _title(fig, _timeline_title(est))
    return fig


def _phase_label(phase: str, width: float) -> str:
    """The phase's name if it fits ``width`` (a fraction of the axis), else an abbreviation, else nothing."""
    full = {"init": "build", "data": "batch"}.get(phase, phase)
    short = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}.get(phase, "")
    # about 0.6 % of a 12-inch axis per character at 9 pt, plus padding
    for label in (full, short):
        if label and width > 0.0065 * len(label) + 0.006:
            return label
    return ""


def _timeline_title(est: Estimate) -> str:
    at_peak = {c: b for c, b in est.breakdown.items() if c != "fragmentation"}
    total = sum(at_peak.values())
    when = f"{_phase_words(est.peak_phase)} of step {est.peak_step + 1}"
    if not at_peak or total <= 0:
        return f"Memory peaks at {format_bytes(est.peak_allocated_bytes)} in {when}"
    top = max(at_peak, key=at_peak.__getitem__)
    return (f"Memory peaks at {format_bytes(est.peak_allocated_bytes)} in {when}: "
            f"{_is_are(top)} {_share(at_peak[top], total)} of it")


def _phase_words(phase: str) -> str:
    return {"forward": "the forward pass", "loss": "the loss", "backward": "the backward pass",
            "optimizer": "the optimizer step", "data": "placing the batch", "init": "building the model"}.get(
        phase, phase)


# ------------------------------------------------------------------------------------------------- blocks


def _block_list(obj: Estimate | Explanation) -> list[tuple[str, int]]:
    est, expl = _split(obj)
    if expl is not None and expl.blocks:
        return [(b.name, b.nbytes) for b in expl.blocks]
    return sorted(est.activations_by_module.items(), key=lambda kv: -kv[1])


def _block_words(name: str) -> str:
    return {"(loss)": "The loss", "(model)": "The model's top level"}.get(name, f"Block {name}")


def blocks_figure(explanation: Explanation | Estimate, *, top: int = _TOP_BLOCKS) -> Figure:
    """Activation bytes held for backward at the end of forward, per block, largest first.

    Args:
        explanation: an ``Explanation`` (its ``blocks``) or an ``Estimate`` (its ``activations_by_module``).
        top: blocks drawn one by one; the rest are summed into one bar.
    """
    blocks = _block_list(explanation)
    total = sum(b for _, b in blocks)
    shown = blocks[:top]
    rest = blocks[top:]
    if rest:
        shown = shown + [(f"{len(rest)} more blocks", sum(b for _, b in rest))]
    fig = _figure(12, max(2.6, 1.2 + 0.36 * len(shown)))
    ax = fig.subplots()
    if not shown:
        ax.text(0.5, 0.5, "No activations are held for backward.", ha="center", va="center",
                transform=ax.transAxes, fontsize=12, color=_MUTED)
        ax.set_axis_off()
        _title(fig, "No activations are held for backward")
        return fig
    names = [n for n, _ in shown][::-1]
    sizes = [b for _, b in shown][::-1]
    colors = [CATEGORY_COLORS["activations"]] * len(shown)
    if rest:
        colors[-1] = "#F8C79A"  # the summed remainder, lighter: not one block
    colors = colors[::-1]
    bars = ax.barh(range(len(names)), sizes, color=colors, height=0.72)
    bars[-1].set_edgecolor(_INK)
    bars[-1].set_linewidth(1.2)
    for i, size in enumerate(sizes):
        ax.text(size, i, f"  {format_bytes(size)}  ({_share(size, total)})", va="center", fontsize=9,
                color=_INK)
    ax.set_yticks(range(len(names)), names, fontsize=10)
    ax.set_xlim(0, max(sizes) * 1.28)
    _byte_axis(ax.xaxis, max(sizes) * 1.28)
    ax.set_xlabel("activation memory held for backward at the end of forward", color=_MUTED)
    ax.grid(axis="x", color="#E5E5E5", linewidth=0.8)
    ax.set_axisbelow(True)
    _clean(ax)
    _title(fig, _blocks_title(blocks, total))
    return fig


def _blocks_title(blocks: list[tuple[str, int]], total: int) -> str:
    name, size = blocks[0]
    # blocks within 2 % of the largest are named together: "encoder.0 and decoder.3 hold 1.00 GiB each"
    tied = [n for n, b in blocks[1:3] if b >= size * 0.98]
    if tied:
        names = ", ".join([name] + tied[:-1]) + f" and {tied[-1]}"
        return (f"Blocks {names} hold the most activations: {format_bytes(size)} each of "
                f"{format_bytes(total)} ({_share(size, total)} each)")
    return (f"{_block_words(name)} holds the most activations: {format_bytes(size)} of "
            f"{format_bytes(total)} ({_share(size, total)})")


# ---------------------------------------------------------------------------------------------- breakdown


def _parts(obj: Estimate | Explanation) -> tuple[list[tuple[str, int, str]], int]:
    """[(category, bytes, detail)], largest first, and the whole they share (``fits_in_bytes``)."""
    est, expl = _split(obj)
    if expl is not None and expl.parts:
        parts = [(p.category, p.nbytes, p.detail) for p in expl.parts if p.nbytes > 0]
    else:
        parts = [(c, b, "") for c, b in est.breakdown.items() if b > 0]
    return sorted(parts, key=lambda p: -p[1]), est.fits_in_bytes


def _short_detail(detail: str, limit: int = 64) -> str:
    """At most ``limit`` characters, cut between list items (``a, b, c``) rather than inside one."""
    if len(detail) <= limit:
        return detail
    kept = ""
    for item in detail.split(", "):
        if len(kept) + len(item) + 2 > limit - 2:
            break
        kept = f"{kept}, {item}" if kept else item
    return (kept or detail[: limit - 1]) + " …"


def breakdown_figure(explanation: Explanation | Estimate) -> Figure:
    """What the memory at the peak is made of, by category, largest first, with each one's share."""
    est, _ = _split(explanation)
    parts, whole = _parts(explanation)
    has_details = any(d for _, _, d in parts)
    fig = _figure(12, max(3.0, 1.6 + 0.42 * len(parts)))
    if has_details:
        # a second column, aligned with the bars, says what is inside each category
        ax, notes = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [2.2, 1.5], "wspace": 0.0})
    else:
        ax, notes = fig.subplots(), None
    rows = parts[::-1]  # largest at the top
    ys = range(len(rows))
    sizes = [b for _, b, _ in rows]
    bars = ax.barh(ys, sizes, color=[CATEGORY_COLORS.get(c, "#888888") for c, _, _ in rows], height=0.72)
    for bar, (c, _, _) in zip(bars, rows, strict=True):
        if c == "fragmentation":  # not memory anything holds: cached blocks too small or split to reuse
            bar.set_hatch("///")
            bar.set_edgecolor("white")
    biggest = max(sizes) if sizes else 1
    for y, (_, size, _) in zip(ys, rows, strict=True):
        ax.text(size, y, f"  {format_bytes(size)}  ({_share(size, whole)})", va="center", fontsize=10,
                color=_INK, fontweight="bold" if y == len(rows) - 1 else "normal")
    ax.set_yticks(list(ys), [CATEGORY_LABELS.get(c, c) for c, _, _ in rows], fontsize=10)
    ax.set_xlim(0, biggest * 1.35)
    _byte_axis(ax.xaxis, biggest * 1.35)
    ax.grid(axis="x", color="#E5E5E5", linewidth=0.8)
    ax.set_axisbelow(True)
    _clean(ax)
    if notes is not None:
        for y, (_, _, detail) in zip(ys, rows, strict=True):
            if detail:
                notes.text(0.02, y, _short_detail(detail), va="center", ha="left", fontsize=9, color=_MUTED)
        notes.set_axis_off()
    context = est.device_bytes - est.fits_in_bytes
    ax.set_xlabel(f"memory at the peak; shares of the {format_bytes(whole)} the allocator needs "
                  f"(+ {format_bytes(context)} CUDA context = {format_bytes(est.device_bytes)} on the GPU)",
                  color=_MUTED, loc="left")
    if parts:
        c, b, _ = parts[0]
        _title(fig, f"{_is_are(c).capitalize()} {_share(b, whole)} of the "
                    f"{format_bytes(whole)} this step needs at its peak")
    else:
        _title(fig, "Nothing is allocated at the peak")
    return fig


# -------------------------------------------------------------------------------------------------- fixes


def _fix_rows(expl: Explanation) -> list[Fix]:
    rows = list(expl.fixes)
    if expl.combination is not None and all(f.name != expl.combination.name for f in rows):
        rows.append(expl.combination)
    return rows


def _cheapest_fitting(fixes: list[Fix], budget_bytes: int) -> Fix | None:
    fitting = [f for f in fixes if f.device_upper_bytes <= budget_bytes]
    order = {"no": 0, "numerics": 1, "semantics": 2}
    return min(fitting, default=None, key=lambda f: (
        f.time_factor is None, f.time_factor or 0.0, order.get(f.changes_training, 3), f.device_bytes))


def _time_words(factor: float | None) -> str:
    if factor is None:
        return "time not modelled"
    if abs(factor - 1) < 0.005:
        return "same time"
    return f"{factor:.2f}× step time"


def fixes_figure(explanation: Explanation) -> Figure:
    """Each fix's predicted GPU memory beside its cost in step time, coloured by how much it changes training."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    est = explanation.estimate
    budget = explanation.budget_bytes
    fixes = _fix_rows(explanation)
    labels = ["now"] + [f.name for f in fixes]
    needs = [est.device_bytes] + [f.device_bytes for f in fixes]
    factors: list[float | None] = [1.0, *(f.time_factor for f in fixes)]
    colors = ["#9E9E9E"] + [TRAINING_COLORS.get(f.changes_training, "#888888") for f in fixes]
    n = len(labels)
    fig = _figure(12, max(2.8, 1.7 + 0.42 * n))
    mem, cost = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1.25], "wspace": 0.04})
    ys = list(range(n))[::-1]  # "now" on top, then the fixes in the explanation's order
    bars = mem.barh(ys, needs, color=colors, height=0.68)
    top = max(needs + ([budget] if budget else []))
    for bar, y, need, label in zip(bars, ys, needs, labels, strict=True):
        saving = est.device_bytes - need
        extra = "" if label == "now" else f"  ({format_bytes(-saving, signed=True)})"
        fits = budget is not None and need <= budget
        if budget is not None and not fits:
            bar.set_alpha(0.45)  # faded: does not fit; what fits stands out before any number is read
        # a white box so the budget line does not cross the numbers
        mem.annotate(f"{format_bytes(need)}{extra}" + ("  ✓ fits" if fits else ""), (need, y), xytext=(5, 0),
                     textcoords="offset points", va="center", fontsize=9, color=_INK,
                     fontweight="bold" if fits else "normal", zorder=4,
                     bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    if budget:
        mem.axvline(budget, color=_BUDGET_COLOR, linewidth=2)
        mem.text(budget, n - 0.35, f" budget {format_bytes(budget)}", color=_BUDGET_COLOR, fontsize=10,
                 fontweight="bold", va="bottom", ha="left")
    mem.set_yticks(ys, labels, fontsize=10)
    mem.set_ylim(-0.6, n - 0.1)
    mem.set_xlim(0, top * 1.32)
    _byte_axis(mem.xaxis, top * 1.32)
    mem.set_xlabel("predicted GPU memory (device: fits in + CUDA context)", color=_MUTED)
    mem.grid(axis="x", color="#E5E5E5", linewidth=0.8)
    mem.set_axisbelow(True)
    _clean(mem)

    known = [f for f in factors if f is not None]
    hi = max(known + [1.0])
    for y, factor, color in zip(ys, factors, colors, strict=True):
        if factor is None:
            cost.text(1.0, y, "  not modelled", va="center", fontsize=9, color=_MUTED, style="italic")
            continue
        cost.plot([1.0, factor], [y, y], color=color, linewidth=3, solid_capstyle="butt")
        cost.plot([factor], [y], marker="o", color=color, markersize=7)
        faster = factor < 0.995
        # the label on the far side of the dot from the 1.0 line
        cost.text(factor, y, f"{factor:.2f}×  " if faster else f"  {factor:.2f}×", va="center",
                  ha="right" if faster else "left", fontsize=9, color=_INK)
    cost.axvline(1.0, color="#999999", linewidth=1)
    lo = min(known + [1.0])
    cost.set_xlim(min(0.8, lo - 0.2), max(1.4, hi + 0.25))
    span = cost.get_xlim()[1] - cost.get_xlim()[0]
    # a narrow panel: three or four ticks
    cost.xaxis.set_major_locator(MultipleLocator(0.25 if span <= 0.8 else 0.5 if span <= 2.0 else 1.0))
    cost.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}×"))
    cost.set_xlabel("step time vs now\n← faster   slower →", color=_MUTED)
    cost.tick_params(left=False)
    cost.grid(axis="x", color="#E5E5E5", linewidth=0.8)
    cost.set_axisbelow(True)
    _clean(cost)
    cost.spines["left"].set_visible(False)

    used = sorted({f.changes_training for f in fixes}, key=list(TRAINING_COLORS).index)
    handles = [Patch(color="#9E9E9E", label="current step")] + [
        Patch(color=TRAINING_COLORS[c], label=_TRAINING_LABELS[c]) for c in used if c in TRAINING_COLORS]
    if budget:
        handles.append(Patch(color="#9E9E9E", alpha=0.45, label="faded: does not fit the budget"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)
    _title(fig, _fixes_title(explanation, fixes))
    return fig


def _fixes_title(expl: Explanation, fixes: list[Fix]) -> str:
    est = expl.estimate
    if not fixes:
        return f"No fix was found: the step needs {format_bytes(est.device_bytes)}"
    budget = expl.budget_bytes
    if budget:
        fitting = [f for f in fixes if f.device_upper_bytes <= budget]
        if est.fits(budget):
            return f"It already fits the {format_bytes(budget)} budget; {len(fitting)} of {len(fixes)} fixes keep it"
        best = _cheapest_fitting(fixes, budget)
        if best is not None and best.time_factor is None:
            # no step-time model says which is cheapest: name the ones that fit
            names = ", ".join(f.name for f in fitting[:2]) + (f" and {len(fitting) - 2} more" if len(fitting) > 2 else "")
            return f"{len(fitting)} of {len(fixes)} fixes fit the {format_bytes(budget)} budget: {names}"
        if best is None:
            low = min(fixes, key=lambda f: f.device_bytes)
            return (f"No fix fits the {format_bytes(budget)} budget; the best, {low.name}, needs "
                    f"{format_bytes(low.device_bytes)}")
        return (f"{len(fitting)} of {len(fixes)} fixes fit the {format_bytes(budget)} budget; cheapest: "
                f"{best.name} ({_time_words(best.time_factor)})")
    best = max(fixes, key=lambda f: f.saving_bytes)
    return (f"Largest saving: {best.name}, {format_bytes(est.device_bytes)} → {format_bytes(best.device_bytes)} "
            f"({_time_words(best.time_factor)})")


# -------------------------------------------------------------------------------------------- plan frontier


def frontier_figure(plan: Plan) -> Figure:
    """Throughput against predicted memory for the plan's frontier, with the budget and the choice marked."""
    fig = _figure(10, 5.2)
    ax = fig.add_subplot()
    _clean(ax)
    points = [c for c in plan.frontier if c.samples_per_s is not None]
    if plan.chosen not in points and plan.chosen.samples_per_s is not None:
        points.append(plan.chosen)
    xs = [c.device_bytes for c in points]
    ys = [c.samples_per_s or 0.0 for c in points]
    colors = [_CHECKPOINT_COLOR if c.config.checkpoint else _PLAIN_COLOR for c in points]
    ax.scatter(xs, ys, c=colors, s=[60 if c.verified else 30 for c in points],
               edgecolors=[_INK if c.verified else "none" for c in points], zorder=3)
    for c, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(f"{c.config.micro_batch}×{c.config.accumulation_steps}", (x, y), textcoords="offset points",
                    xytext=(5, 4), fontsize=8, color=_MUTED)
    chosen = plan.chosen
    if chosen.samples_per_s is not None:
        ax.scatter([chosen.device_bytes], [chosen.samples_per_s], s=260, facecolors="none",
                   edgecolors=_BUDGET_COLOR, linewidths=2, zorder=4)
    limit = plan.budget_bytes * (1 - plan.margin)
    ax.axvline(plan.budget_bytes, color=_BUDGET_COLOR, linewidth=2)
    ax.axvline(limit, color=_BUDGET_COLOR, linewidth=1, linestyle=":")
    ax.text(plan.budget_bytes, ax.get_ylim()[1], f" budget {format_bytes(plan.budget_bytes)}",
            color=_BUDGET_COLOR, va="top", fontsize=9)
    _byte_axis(ax.xaxis, max(xs + [plan.budget_bytes]))
    ax.set_xlim(0, max(xs + [plan.budget_bytes]) * 1.1)
    ax.set_ylim(0, max(ys + [1.0]) * 1.15)
    ax.set_xlabel("predicted GPU memory (fits in + CUDA context)", color=_MUTED)
    ax.set_ylabel(f"predicted samples/s ({plan.speed_model})", color=_MUTED)
    ax.grid(color="#E5E5E5", linewidth=0.8)
    ax.set_axisbelow(True)
    from matplotlib.lines import Line2D

    ax.legend(handles=[
        Line2D([], [], marker="o", linestyle="", color=_PLAIN_COLOR, label="no checkpointing"),
        Line2D([], [], marker="o", linestyle="", color=_CHECKPOINT_COLOR, label="checkpointed blocks"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor=_BUDGET_COLOR,
               markersize=12, label="chosen"),
    ], frameon=False, loc="lower right", fontsize=9)
    _title(fig, f"{plan.workload}: {chosen.config.label()} is the fastest that fits {format_bytes(plan.budget_bytes)}",
           "labels: micro-batch × accumulation steps; outlined points were estimated, the others read off a line")
    return fig


def save_frontier_png(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``frontier_figure(plan)`` as a PNG, atomically."""
    return write_atomic(check_output_path(path, "the picture"), png_bytes(frontier_figure(plan)), what="the picture")


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes, the same bytes for the same figure."""
    buf = io.BytesIO()
    # metadata: no software version or date in the file, so the same explanation gives the same bytes
    fig.savefig(buf, format="png", dpi=PNG_DPI, metadata={"Software": None})
    return buf.getvalue()


_PLAIN_COLOR = "#4C72B0"
_CHECKPOINT_COLOR = "#DD8452"
