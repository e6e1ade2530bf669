"""The timeline by category, the pictures and the HTML report, on a real (CPU) estimate of the built-in MLP."""

from __future__ import annotations

import html
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memfit.errors import MissingExtraError, UsageError
from memfit.estimate.categories import MEMORY_CATEGORIES, TRACED_CATEGORIES
from memfit.estimate.predict import Estimate, estimate
from memfit.explain.explanation import BlockMemory, Explanation, Fix, Part
from memfit.explain.oom_diagnosis import OomDiagnosis
from memfit.explain.oom_message import OomMessage
from memfit.report.terminal import render_oom
from memfit.workload.zoo import builtin_workload

pytest.importorskip("matplotlib")

from memfit.report import figures as plots  # noqa: E402
from memfit.report.html import write_pngs, write_report  # noqa: E402

_PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def est() -> Estimate:
    return estimate(builtin_workload("mlp").replace(batch_size=8))


def _fix(base: Estimate, name: str, knob: str, fits_in: int, time_factor: float | None, training: str,
         budget: int | None) -> Fix:
    device = fits_in + (base.device_bytes - base.fits_in_bytes)
    return Fix(name=name, knob=knob, changes={}, allocator=None, peak_allocated_bytes=fits_in, fits_in_bytes=fits_in,
               device_bytes=device, device_upper_bytes=device, saving_bytes=base.fits_in_bytes - fits_in, time_factor=time_factor,
               speed_cost="about none" if time_factor == 1.0 else "", changes_training=training,
               fits_budget=None if budget is None else device <= budget)


def _explanation(base: Estimate, *, budget: int | None, oom: OomDiagnosis | None = None) -> Explanation:
    parts = [Part(c, b, b / base.fits_in_bytes, "detail of " + c) for c, b in base.breakdown.items() if b > 0]
    parts.sort(key=lambda p: -p.nbytes)
    blocks = [BlockMemory(n, b) for n, b in base.activations_by_module.items()]
    f = base.fits_in_bytes
    fixes = [
        _fix(base, "bf16 autocast", "precision", int(f * 0.6), 0.62, "numerics", budget),
        _fix(base, "micro-batch 4 × 2 <accumulation>", "micro_batch", int(f * 0.8), 1.1, "no", budget),
        _fix(base, "fused optimizer", "optimizer", int(f * 0.9), None, "no", budget),
        _fix(base, "patches of 64³", "patch", int(f * 0.5), 1.0, "semantics", budget),
    ]
    return Explanation(
        workload=base.workload, gpu=base.gpu, estimate=base,
        headline=f"This step needs {base.device_bytes} bytes & parameters dominate <really>.",
        parts=parts, blocks=blocks, peak_when="in the optimizer step of step 1", peak_why="state is created",
        scaling=None, scaling_text="Each sample adds a little.", fixes=fixes, budget_bytes=budget,
        fits_budget=None if budget is None else base.device_bytes <= budget, oom=oom,
    )


# --------------------------------------------------------------------------------------- timeline data


def test_timeline_by_category_sums_to_allocated(est: Estimate) -> None:
    assert est.timeline
    for point in est.timeline:
        assert set(point.by_category) == set(TRACED_CATEGORIES)
        assert sum(point.by_category.values()) == point.allocated_bytes
        assert min(point.by_category.values()) >= 0
    assert max(p.allocated_bytes for p in est.timeline) == est.peak_allocated_bytes


def test_phases_mark_each_step(est: Estimate) -> None:
    names = [(name, step) for _, name, step in est.phases]
    for step in range(est.steps):
        for phase in ("forward", "backward", "optimizer"):
            assert (phase, step) in names
    starts = [at for at, _, _ in est.phases]
    assert starts == sorted(starts)
    # each timeline point carries the phase that the phase list says it is in
    for point in est.timeline:
        current = [(name, step) for at, name, step in est.phases if at <= point.event][-1]
        assert (point.phase, point.step) == current


def test_estimate_with_timeline_categories_is_json(est: Estimate) -> None:
    d = json.loads(est.to_json())
    assert d["timeline"][0]["by_category"].keys() == set(TRACED_CATEGORIES)
    assert [tuple(p) for p in d["phases"]] == est.phases


# ------------------------------------------------------------------------------------------- pictures


def _png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=50)
    return buf.getvalue()


@pytest.mark.parametrize("budget", [None, 1 << 30, 1 << 20])
def test_figures_render(est: Estimate, budget: int | None) -> None:
    x = _explanation(est, budget=budget)
    for fig in (plots.timeline_figure(x), plots.blocks_figure(x), plots.breakdown_figure(x), plots.fixes_figure(x)):
        assert _png_bytes(fig).startswith(_PNG)
        assert fig._suptitle is not None and fig._suptitle.get_text()


def test_figures_take_an_estimate_too(est: Estimate) -> None:
    fig = plots.timeline_figure(est, budget_bytes=est.device_bytes * 2)
    assert "peaks at" in fig._suptitle.get_text()
    assert _png_bytes(plots.breakdown_figure(est)).startswith(_PNG)
    assert _png_bytes(plots.blocks_figure(est)).startswith(_PNG)


def test_titles_state_the_answer(est: Estimate) -> None:
    context = est.device_bytes - est.fits_in_bytes
    x = _explanation(est, budget=int(est.fits_in_bytes * 0.85) + context)
    top = max((c for c in est.breakdown if c != "fragmentation"), key=est.breakdown.__getitem__)
    assert plots.CATEGORY_LABELS[top] in plots.timeline_figure(x)._suptitle.get_text()
    assert x.parts[0].category.split("_")[0] in plots.breakdown_figure(x)._suptitle.get_text().lower()
    # three of the four hand-made fixes fit 85 % of today's need; the cheapest in time is bf16 (0.62x)
    fixes_title = plots.fixes_figure(x)._suptitle.get_text()
    assert "3 of 4 fixes fit" in fixes_title and "bf16 autocast" in fixes_title


def test_fixes_figure_without_fixes(est: Estimate) -> None:
    x = _explanation(est, budget=None)
    x = Explanation(**{**x.__dict__, "fixes": []})
    assert "No fix" in plots.fixes_figure(x)._suptitle.get_text()


def test_missing_matplotlib_names_the_extra(est: Estimate, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(MissingExtraError, match=r"memfit\[report\]"):
        plots.timeline_figure(est)
    with pytest.raises(ImportError):  # MissingExtraError is an ImportError too
        write_report(_explanation(est, budget=None), tmp_path / "r.html")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_import_stays_light() -> None:
    """The rendering modules load matplotlib (and never torch) only when a picture is drawn."""
    code = ("import sys, memfit.report.figures, memfit.report.html; "
            "print(','.join(m for m in ('matplotlib', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --------------------------------------------------------------------------------------------- report


def test_report_is_self_contained(est: Estimate, tmp_path: Path) -> None:
    x = _explanation(est, budget=int(est.device_bytes * 0.85))
    path = write_report(x, tmp_path / "report.html")
    page = path.read_text(encoding="utf-8")
    # nothing fetched: no remote or relative src/href, no script, no @import, no url() but data URIs
    links = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page)
    assert len(links) == 4 and all(link.startswith("data:image/png;base64,") for link in links)
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert page.count('src="data:image/png;base64,') == 4
    assert html.escape(x.headline) in page and x.headline not in page  # escaped, never raw HTML
    for fix in x.fixes:
        assert html.escape(fix.name) in page
    assert x.scaling_text in page and x.peak_why in page
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # the temporary file was renamed


def test_report_overwrites_a_file_but_never_a_directory(est: Estimate, tmp_path: Path) -> None:
    x = _explanation(est, budget=None)
    target = tmp_path / "report.html"
    target.write_text("old")
    write_report(x, target)
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    (tmp_path / "folder").mkdir()
    with pytest.raises(UsageError, match="is a directory"):
        write_report(x, tmp_path / "folder")
    with pytest.raises(UsageError, match="does not exist"):
        write_report(x, tmp_path / "missing" / "report.html")


def _oom() -> OomDiagnosis:
    message = OomMessage(torch_format="torch>=2.2", raw="CUDA out of memory. Tried to allocate 2.00 GiB <raw>",
                         tried_to_allocate_bytes=2 << 30, total_capacity_bytes=24 << 30, free_bytes=1 << 30,
                         allocator="native")
    return OomDiagnosis(message=message, findings=["the <cap> was hit", "one", "two"], causes=["memory_cap"])


def test_report_shows_the_oom_diagnosis(est: Estimate, tmp_path: Path) -> None:
    oom = _oom()
    page = write_report(_explanation(est, budget=None, oom=oom), tmp_path / "r.html").read_text(encoding="utf-8")
    assert "out-of-memory" in page and "2.00 GiB" in page and "the &lt;cap&gt; was hit" in page
    assert "out-of-memory" not in write_report(_explanation(est, budget=None), tmp_path / "s.html").read_text(
        encoding="utf-8")
    # rendered for a reader: findings as a list, sizes labelled in words, the message's text escaped; no field names
    assert "<li>one</li><li>two</li>" in page and "tried to allocate" in page and "24.00 GiB" in page
    assert "memory cap" in page and "2.00 GiB &lt;raw&gt;" in page
    assert "tried_to_allocate_bytes" not in page and "torch_format" not in page


def test_terminal_shows_the_oom_diagnosis() -> None:
    from rich.console import Console

    console = Console(record=True, width=200)
    render_oom(_oom(), console)
    text = console.export_text()
    assert "tried to allocate" in text and "2.00 GiB" in text and "GPU capacity" in text and "24.00 GiB" in text
    assert "• the <cap> was hit" in text and "• two" in text and "memory cap" in text
    assert "tried_to_allocate_bytes" not in text


def test_every_category_and_training_change_has_its_words_and_colour() -> None:
    from memfit.explain import explanation
    from memfit.explain.fixes import TRAINING_CHANGES
    from memfit.report import html as page
    from memfit.report import terminal

    assert set(plots.CATEGORY_COLORS) == set(plots.CATEGORY_LABELS) == set(MEMORY_CATEGORIES)
    assert set(explanation._CATEGORY_WORDS) == set(MEMORY_CATEGORIES)
    for words in (plots.TRAINING_COLORS, plots._TRAINING_LABELS, page._TRAINING_WORDS, terminal._TRAINING_WORDS):
        assert set(words) == set(TRAINING_CHANGES)


def test_write_pngs(est: Estimate, tmp_path: Path) -> None:
    paths = write_pngs(_explanation(est, budget=None), tmp_path / "img")
    assert [p.name for p in paths] == ["timeline.png", "breakdown.png", "blocks.png", "fixes.png"]
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(_PNG) and data[12:16] == b"IHDR"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 500 and height > 200
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        write_pngs(_explanation(est, budget=None), tmp_path / "file")


def test_terminal_says_which_reasons_widen_the_bound(est: Estimate) -> None:
    import dataclasses

    from rich.console import Console

    from memfit.estimate.bound import Uncertainty
    from memfit.report.terminal import render_estimate

    reasons = [Uncertainty("value_branch", 0.25, "model.py:12 in forward"),
               Uncertainty("value_check", 0.0, "model.py:7 in forward: only checks")]
    console = Console(record=True, width=250)
    render_estimate(dataclasses.replace(est, uncertainty=reasons), console)
    text = " ".join(console.export_text().replace("│", " ").split())  # the table wraps its notes
    assert "upper bound +25%: value_branch: model.py:12" in text
    assert "noted, bound not widened: value_check: model.py:7" in text
    assert "wider: value_branch" in text and "wider: value_check" not in text
