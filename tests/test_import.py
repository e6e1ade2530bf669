import subprocess
import sys


def test_import_memfit_stays_light():
    """`import memfit` must not pull torch, rich, typer or matplotlib: they load on first use."""
    code = (
        "import sys, memfit; heavy = [m for m in ('torch', 'rich', 'typer', 'matplotlib') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_names_resolve():
    import memfit

    for name in ("Workload", "estimate", "Estimate", "MemfitError", "load_workload"):
        assert getattr(memfit, name) is not None
