"""One measurement in a fresh Python process that imports memfit from a given source tree: the scripts that set two
trees side by side (``plan/planning_time.py``, ``plan/planning_gc.py``, ``plan/lane_use.py``,
``estimate/estimate_gc.py``) run themselves again with their hidden ``--one`` argument and read what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def child_json(script: str | Path, *args: str, paths: list[str], env: dict[str, str] | None = None) -> Any:
    """``python SCRIPT ARGS`` with ``PYTHONPATH`` set to ``paths`` (and ``env`` added to this process's
    environment): the JSON on the last line it printed. A child that fails raises ``CalledProcessError``."""
    done = subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)})
    return json.loads(done.stdout.strip().splitlines()[-1])
