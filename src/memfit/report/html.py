"""``write_report()``: an explanation as one self-contained HTML page; ``write_pngs()``: its pictures as PNG files.

The page needs nothing but itself: the four pictures are embedded as base64 PNGs, the style is inline, and no
script or font is fetched, so it opens offline, attaches to an issue or a mail, and archives as one file. Files are
written atomically (a temporary file in the same directory, then a rename), so a reader never sees half a report
and an interrupted run leaves the previous one in place.

Example:
    >>> from memfit.explain.explanation import explain
    >>> from memfit.workload.zoo import builtin_workload
    >>> e = explain(builtin_workload("mlp").replace(batch_size=8), fixes=False)  # doctest: +SKIP
    >>> write_report(e, "report.html")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit import __version__
from memfit._io import check_output_dir, check_output_path, write_atomic
from memfit.errors import UsageError
from memfit.report import figures
from memfit.report.figures import CATEGORY_COLORS, CATEGORY_LABELS, png_bytes
from memfit.units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from memfit.explain.explanation import Explanation, Fix
    from memfit.explain.fixes import TrainingChange
    from memfit.explain.oom_diagnosis import OomDiagnosis

# (file stem, figure function in memfit.report.figures, what the picture answers)
_PICTURES = (
    ("timeline", "timeline_figure", "When the memory peaks, and what it is made of over the step"),
    ("breakdown", "breakdown_figure", "What the memory at the peak is made of"),
    ("blocks", "blocks_figure", "Which blocks hold the activations"),
    ("fixes", "fixes_figure", "What each fix would need, and what it costs"),
)
_TRAINING_WORDS: dict[TrainingChange, str] = {"no": "no: same mathematics", "numerics": "rounding only", "semantics": "yes"}
# 110 dpi: sharp on a laptop screen, and each picture stays near 100 KB (the page holds four)


def write_report(explanation: Explanation, path: str | os.PathLike[str]) -> Path:
    """Write ``explanation`` as one self-contained HTML file at ``path`` and return the path.

    An existing file at ``path`` is replaced (atomically); a directory there is an error.

    Raises:
        UsageError: ``path`` is a directory, or its parent directory does not exist.
        MissingExtraError: matplotlib is not installed (``pip install 'memfit[report]'``).
    """
    target = check_output_path(path, "the report")
    images = {stem: png_bytes(_draw(func, explanation)) for stem, func, _ in _PICTURES}
    write_atomic(target, _html(explanation, images).encode("utf-8"))
    return target


def write_pngs(explanation: Explanation, directory: str | os.PathLike[str]) -> list[Path]:
    """Write the four pictures as ``timeline.png``, ``breakdown.png``, ``blocks.png`` and ``fixes.png``.

    ``directory`` is created if missing; existing PNGs of those names are replaced.

    Raises:
        UsageError: ``directory`` exists and is not a directory, or one of the names is a directory.
        MissingExtraError: matplotlib is not installed (``pip install 'memfit[report]'``).
    """
    folder = check_output_dir(directory, "the pictures")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the folder {str(folder)!r} for the pictures: {exc.strerror or exc}. "
                         "Name a folder you can write to.") from None
    written = []
    for stem, func, _ in _PICTURES:
        target = check_output_path(folder / f"{stem}.png", "a picture")
        write_atomic(target, png_bytes(_draw(func, explanation)))
        written.append(target)
    return written


# -------------------------------------------------------------------------------------------------- files


def _draw(func: str, explanation: Explanation) -> Figure:
    return getattr(figures, func)(explanation)


# --------------------------------------------------------------------------------------------------- HTML


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html(x: Explanation, images: dict[str, bytes]) -> str:
    est = x.estimate
    title = f"{est.workload} · batch {est.batch_size} · {est.precision} · {est.gpu}"
    verdict = ""
    if x.budget_bytes is not None:
        fits = x.fits_budget if x.fits_budget is not None else est.fits(x.budget_bytes)
        word = "fits" if fits else "does not fit"
        verdict = (f'<p class="verdict {"ok" if fits else "no"}">Needs {_e(format_bytes(est.device_bytes))}: '
                   f'{word} the {_e(format_bytes(x.budget_bytes))} budget</p>')
    parts = "".join(
        f'<tr><td><span class="sw" style="background:{CATEGORY_COLORS.get(p.category, "#888")}"></span>'
        f"{_e(CATEGORY_LABELS.get(p.category, p.category))}</td><td class=num>{_e(format_bytes(p.nbytes))}</td>"
        f"<td class=num>{p.share:.0%}</td><td class=detail>{_e(p.detail)}</td></tr>"
        for p in x.parts
    )
    pictures = {stem: _img(images[stem], caption) for stem, _, caption in _PICTURES if stem in images}
    notes = "".join(f"<li>{_e(n)}</li>" for n in x.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="memfit {_e(__version__)}">
<title>memfit: {_e(title)}</title>
<style>{_CSS}</style></head>
<body><main>
<p class="kicker">memfit explain · {_e(title)}</p>
<h1>{_e(x.headline)}</h1>
{verdict}
{_oom_section(x.oom)}
{pictures.get("timeline", "")}
<section class="why">
<h2>Why</h2>
<p><b>The peak comes {_e(x.peak_when)}</b>{": " + _e(x.peak_why) if x.peak_why else ""}.</p>
{f"<p>{_e(x.scaling_text)}</p>" if x.scaling_text else ""}
{pictures.get("breakdown", "")}
<details><summary>The memory at the peak, in numbers</summary>
<table class="parts"><thead><tr><th>category</th><th>memory</th><th>share</th><th></th></tr></thead>
<tbody>{parts}</tbody></table></details>
{pictures.get("blocks", "")}
</section>
<section><h2>Fixes</h2>
{pictures.get("fixes", "")}
{_fixes_table(x)}</section>
{f'<section><h2>Notes</h2><ul>{notes}</ul></section>' if notes else ""}
<footer>memfit {_e(__version__)} · {_e(est.method)} · needs {_e(format_bytes(est.device_bytes))} on the GPU =
fits in {_e(format_bytes(est.fits_in_bytes))} + CUDA context · peak allocated
{_e(format_bytes(est.peak_allocated_bytes))} · explained in {x.elapsed_s:.1f} s</footer>
</main></body></html>
"""


def _img(png: bytes, caption: str) -> str:
    """A picture inline as a data URI: the page carries its images, so it works offline and as one file."""
    return f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{base64.b64encode(png).decode()}"></figure>'


def _fixes_table(x: Explanation) -> str:
    fixes = list(x.fixes)
    combined = x.combination
    if combined is not None and all(f.name != combined.name for f in fixes):
        fixes.append(combined)
    if not fixes:
        return "<p>No fix was estimated.</p>"
    budget = x.budget_bytes
    head = ("<tr><th>fix</th><th>needs on the GPU</th><th>fits in</th><th>saves</th><th>step time</th>"
            "<th>changes training</th>" + ("<th>fits the budget</th>" if budget is not None else "") + "</tr>")
    rows = "".join(_fix_row(f, budget, f is combined) for f in fixes)
    return f'<table class="fixes"><thead>{head}</thead><tbody>{rows}</tbody></table>'


def _fix_row(f: Fix, budget: int | None, combined: bool) -> str:
    time = "not modelled" if f.time_factor is None else f"{f.time_factor:.2f}×"
    if f.speed_cost:
        time += f'<div class="sub">{_e(f.speed_cost)}</div>'
    name = _e(f.name) + (' <span class="tag">combined</span>' if combined else "")
    if f.allocator and f.allocator not in f.name:
        name += f'<div class="sub"><code>PYTORCH_CUDA_ALLOC_CONF={_e(f.allocator)}</code></div>'
    if f.caveat:
        name += f'<div class="sub">{_e(f.caveat)}</div>'
    fits = ""
    if budget is not None:
        ok = f.fits_budget if f.fits_budget is not None else f.device_upper_bytes <= budget
        fits = f'<td class="{"ok" if ok else "no"}">{"yes" if ok else "no"}</td>'
    return (f"<tr><td>{name}</td><td class=num>{_e(format_bytes(f.device_bytes))}</td>"
            f"<td class=num>{_e(format_bytes(f.fits_in_bytes))}</td>"
            f"<td class=num>{_e(format_bytes(f.saving_bytes))}</td><td>{time}</td>"
            f'<td class="train-{_e(f.changes_training)}">{_e(_TRAINING_WORDS.get(f.changes_training, f.changes_training))}'
            f"</td>{fits}</tr>")


def _oom_section(oom: OomDiagnosis | None) -> str:
    """What the OOM message means (the findings, most important first), then the numbers it gave and its text."""
    if oom is None:
        return ""
    m = oom.message
    findings = "".join(f"<li>{_e(f)}</li>" for f in oom.findings) or "<li>The message holds no numbers to diagnose.</li>"
    causes = " ".join(f'<span class="tag">{_e(c.replace("_", " "))}</span>' for c in oom.causes)
    sizes = "".join(f"<tr><td>{_e(label)}</td><td class=num>{_e(format_bytes(b))}</td></tr>" for label, b in m.sizes())
    where = [f"GPU {m.gpu_index}" if m.gpu_index is not None else "",
             f"{m.allocator} allocator" if m.allocator else "", f"{m.torch_format} message"]
    source = " · ".join(_e(w) for w in where if w)
    return ('<section class="oom"><h2>The out-of-memory error</h2>'
            + (f'<p class="causes">{causes}</p>' if causes else "")
            + f"<ul>{findings}</ul>"
            + "<details><summary>What the message says</summary>"
            + (f'<table class="parts"><tbody>{sizes}</tbody></table>' if sizes else "")
            + f'<p class="sub">{source}</p><pre>{_e(m.raw)}</pre></details></section>')


_CSS = """
body{margin:0;background:#fafafa;color:#222;font:15px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif}
main{max-width:1240px;margin:0 auto;padding:24px 32px 48px;background:#fff}
.kicker{color:#666;margin:0 0 4px;font-size:14px}
h1{font-size:26px;line-height:1.3;margin:0 0 12px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #eee;padding-bottom:4px}
.verdict{display:inline-block;font-weight:600;padding:4px 12px;border-radius:4px;margin:0 0 8px}
.verdict.ok{background:#e3f1df;color:#2d6a1f}.verdict.no{background:#fbe3e1;color:#a12b1f}
table{border-collapse:collapse;margin:8px 0}
th,td{padding:5px 12px 5px 0;text-align:left;vertical-align:top;border-bottom:1px solid #f0f0f0}
th{font-weight:600;color:#555;font-size:13px}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.detail,.sub{color:#666;font-size:13px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:8px;vertical-align:-1px}
td.ok{color:#2d6a1f;font-weight:600}td.no{color:#a12b1f}
.train-no{color:#2d6a1f}.train-numerics{color:#8a6d00}.train-semantics{color:#a12b1f}
.tag{background:#eef;color:#335;font-size:12px;padding:1px 6px;border-radius:3px}
figure{margin:16px 0 28px}figure img{max-width:100%;height:auto;display:block}
summary{cursor:pointer;color:#555;font-size:14px}
.oom pre{white-space:pre-wrap;font-size:12px;color:#555;background:#f6f6f6;padding:8px}
footer{margin-top:32px;color:#888;font-size:12px}
code{font-size:13px}
"""
