"""What a user's type checker sees of ``import memfit``: the real types, not ``Any``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = '''
import memfit


def check(w: memfit.Workload, step: memfit.TrainStep) -> None:
    reveal_type(w)
    est = memfit.estimate(w)
    reveal_type(est)
    reveal_type(memfit.explain(w))
    reveal_type(memfit.plan(w, budget_bytes=24 * 2**30))
    reveal_type(step)
    reveal_type(est.to_dict())
    memfit.estimate(w, gpu=80)
'''
# memfit's own modules are read (errors in them are not the user's: follow_imports=silent); torch is skipped, which
# takes the check from ~11 s to ~2.5 s on a 2-core CPU and changes nothing memfit's names reveal
MYPY_CONFIG = """[mypy]
ignore_missing_imports = True
follow_imports = silent
[mypy-torch.*]
follow_imports = skip
"""


def test_the_public_api_is_typed_for_a_users_type_checker(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
         "--config-file", str(tmp_path / "mypy.ini"), "user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    revealed = re.findall(r'Revealed type is "([^"]+)"', out.stdout)
    assert revealed == [
        "memfit.workload.spec.Workload",
        "memfit.estimate.predict.Estimate",
        "memfit.explain.explanation.Explanation",
        "memfit.plan.records.Plan",
        "memfit.guard.step.TrainStep",
        "dict[str, Any]",
    ], out.stdout + out.stderr
    # the signature is checked too: a GPU is a name or a GpuSpec, not a number
    assert re.search(r'user.py:13: error: Argument "gpu" to "estimate" has incompatible type "int"', out.stdout), (
        out.stdout)


def test_the_package_says_it_is_typed() -> None:
    """PEP 561: the ``py.typed`` marker, shipped with the package, or installed memfit is all ``Any``."""
    assert (ROOT / "src" / "memfit" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is Python 3.11+; memfit supports 3.10
    assert re.search(r'\[tool\.setuptools\.package-data\]\n(?:#.*\n)*memfit = \["py\.typed"\]', pyproject)
