"""Re-make the pictures in this folder: ``python docs/img/render.py`` (CPU, about a minute; needs ``chromium``).

Runs ``memfit.explain`` on two built-ins (a 2-D U-Net at batch 1 under a 5 GiB budget, GPT-2 at batch 8 under
8 GiB), writes each report, screenshots it in headless Chromium, and keeps small PNGs (< 300 KB) for the docs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from memfit.explain.explanation import explain
from memfit.report.figures import fixes_figure, timeline_figure
from memfit.report.html import write_report
from memfit.units import GiB
from memfit.workload.zoo import builtin_workload

HERE = Path(__file__).parent
CASES = (("unet2d", 1, 5 * GiB), ("gpt2", 8, 8 * GiB))


def _small(src: Path, dst: Path, width: int) -> None:
    """Trim the empty bottom, scale to ``width`` and store with a 256-colour octree palette (keeps small swatches true)."""
    im = Image.open(src).convert("RGB")
    column = im.crop((im.width // 4, 0, 3 * im.width // 4, im.height)).convert("L")
    ink = column.point(lambda v: 255 if v < 250 else 0).getbbox()  # the box around anything not white
    im = im.crop((0, 0, im.width, min(im.height, (ink[3] if ink else im.height) + 40)))
    im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
    im.quantize(256, method=Image.Quantize.FASTOCTREE).save(dst, optimize=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch, budget in CASES:
            x = explain(builtin_workload(name).replace(batch_size=batch), budget_bytes=budget)
            page = write_report(x, Path(tmp) / f"{name}.html")
            shot = Path(tmp) / f"{name}.png"
            subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--screenshot={shot}", "--window-size=1400,5000", page.as_uri()],
                           check=True, capture_output=True)
            _small(shot, HERE / f"report-{name}.png", 1000)
            for kind, draw in (("timeline", timeline_figure), ("fixes", fixes_figure)):
                raw = Path(tmp) / f"{kind}.png"
                draw(x).savefig(raw, dpi=100)
                _small(raw, HERE / f"{kind}-{name}.png", 1000)
            print(name, x.headline, file=sys.stderr)


if __name__ == "__main__":
    main()
