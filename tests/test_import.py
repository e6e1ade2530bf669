import subprocess
import sys

import pytest


@pytest.mark.parametrize("package", ["memfit", "memfit.data"])
def test_import_memfit_stays_light(package):
    """`import memfit` (and `memfit.data`) must not pull torch, numpy, rich, typer or matplotlib."""
    code = (
        f"import sys, {package}; heavy = [m for m in ('torch', 'rich', 'typer', 'matplotlib', 'numpy') "
        "if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_names_resolve():
    import memfit

    for name in ("Workload", "estimate", "Estimate", "MemfitError", "load_workload"):
        assert getattr(memfit, name) is not None


def test_lazy_exports_load_once_and_reject_unknown_names():
    import memfit
    import memfit.data

    with pytest.raises(AttributeError, match="module 'memfit' has no attribute 'nope'"):
        memfit.nope  # noqa: B018
    with pytest.raises(AttributeError, match="module 'memfit.data' has no attribute 'nope'"):
        memfit.data.nope  # noqa: B018
    value = memfit.data.LoaderSettings
    assert vars(memfit.data)["LoaderSettings"] is value  # kept on the package: the next lookup is a plain one
    assert memfit.LoaderSettings is value
