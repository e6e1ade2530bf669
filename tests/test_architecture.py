"""The architecture STYLE.md draws, checked: imports run one way without cycles, names other modules need are public,
private torch (and CPython) APIs live in one module each, and fixed vocabularies are defined once."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"


def _modules() -> dict[str, Path]:
    """Every module of memfit, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _trees() -> Iterator[tuple[str, Path, ast.Module]]:
    for name, path in MODULES.items():
        yield name, path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_checked_memfit_is_this_checkout() -> None:
    spec = importlib.util.find_spec("memfit")
    assert spec is not None and spec.origin is not None and Path(spec.origin).resolve() == SRC / "__init__.py"


# ---------------------------------------------------------------------------------------------- import graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_memfit_modules() -> None:
    # Imports under ``if TYPE_CHECKING:`` are left out: they never run, and memfit/__init__.py imports every public
    # name that way for type checkers, which would otherwise close a loop through any module that reads
    # ``memfit.__version__``. Imports inside functions count: a deferred import is still a dependency.
    graph = grimp.build_graph("memfit", exclude_type_checking_imports=True, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_the_layers_contract_is_kept() -> None:
    """import-linter's contract in pyproject.toml: a lower layer never imports a higher one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC.parent), os.environ.get("PYTHONPATH")]))}
    beside_python = Path(sys.executable).with_name("lint-imports")
    lint = str(beside_python) if beside_python.exists() else shutil.which("lint-imports")
    assert lint is not None, "import-linter is in the test extra: pip install -e '.[test]'"
    out = subprocess.run([lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


# ------------------------------------------------------------------------------------------- private names


def _memfit_imports(tree: ast.Module, module: str) -> Iterator[tuple[ast.AST, str]]:
    """(node, dotted name) of every name imported from memfit, ``from .x import y`` resolved against ``module``."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base == "memfit" or base.startswith("memfit."):
                for alias in node.names:
                    yield node, f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("memfit"):
                    yield node, alias.name


def test_no_module_imports_another_modules_private_name() -> None:
    """STYLE.md: a name another module needs is public in its own module (``memfit._io``, a private *module* of the
    package, is fine; ``from memfit.x import _helper`` is not)."""
    bad = []
    for name, path, tree in _trees():
        aliases: dict[str, str] = {}
        for node, full in _memfit_imports(tree, name):
            owner, _, leaf = full.rpartition(".")
            if full in MODULES:
                for alias in getattr(node, "names", []):
                    if full.endswith("." + alias.name) or full == alias.name:
                        aliases[alias.asname or alias.name.split(".")[0]] = full
            elif _private(leaf) and owner != name:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {full}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr) and aliases[node.value.id] != name):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert bad == []


# Private attributes of PyTorch objects that memfit reaches for (nn.Module's registries, an OpOverload's schema,
# tensor internals); reading them anywhere but memfit/_torch_private.py is the mistake this test catches.
_TORCH_PRIVATE_ATTRIBUTES = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_schema", "_is_view", "_base", "_version", "_cdata",
    "_has_symbolic_sizes_strides", "_record_memory_history", "_snapshot", "_overloadpacket",
})
# (module, attribute) of other libraries' private APIs, and the one memfit module allowed each
_ALLOWED_PRIVATE = {
    ("os", "_exit"): None,  # documented: https://docs.python.org/3/library/os.html#os._exit
    ("atexit", "_run_exitfuncs"): "memfit._process",
}
_TORCH_PRIVATE_MODULE = "memfit._torch_private"


def _private_api_uses(name: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, what) of each use of another library's private API in one module."""
    imported: dict[str, str] = {}  # local name -> dotted module or object path
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    imported[alias.asname] = alias.name
                else:
                    imported[alias.name.split(".")[0]] = alias.name.split(".")[0]
                if any(_private(part) for part in alias.name.split(".")) and not alias.name.startswith("memfit"):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "memfit":
                continue
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if any(_private(part) for part in node.module.split(".")) or _private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = [node.attr]
        root: ast.AST = node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        dotted = ".".join(reversed(chain))
        if isinstance(root, ast.Name) and root.id in imported:
            full = f"{imported[root.id]}.{dotted}"
            top = full.split(".")[0]
            key = (imported[root.id], node.attr)
            if key in _ALLOWED_PRIVATE and _ALLOWED_PRIVATE[key] in (None, name):
                continue
            if top != "memfit":
                yield node.lineno, full
        elif node.attr in _TORCH_PRIVATE_ATTRIBUTES and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield node.lineno, f"<object>.{node.attr}"


def test_private_torch_apis_are_used_in_one_module() -> None:
    """STYLE.md: ``torch._subclasses``, ``func._schema``, ``module._parameters`` and the like only in
    memfit/_torch_private.py (behind its version check); CPython's private ``atexit._run_exitfuncs`` only in
    memfit/_process.py."""
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line}: {what}"
           for name, _, tree in _trees() if name != _TORCH_PRIVATE_MODULE
           for line, what in _private_api_uses(name, tree)]
    assert bad == []


@pytest.mark.parametrize("code", [
    "import torch\nx = torch._C._current_autograd_node()",
    "import torch.nn as nn\nB = nn.modules.batchnorm._BatchNorm",
    "from torch._subclasses.fake_tensor import FakeTensorMode",
    "from torch.utils import _pytree",
    "def f(func):\n    return func._schema.name",
    "def f(module):\n    return module._parameters",
    "import atexit\natexit._run_exitfuncs()",
    "import torch.distributed as dist\nn = dist._DEFAULT_FIRST_BUCKET_BYTES",
])
def test_the_private_api_scan_sees(code: str) -> None:
    assert list(_private_api_uses("memfit.somewhere", ast.parse(code)))


@pytest.mark.parametrize("code", [
    "import os\nos._exit(0)",
    "class A:\n    def f(self):\n        return self._buffers",  # memfit's own attribute
    "# torch._C in a comment\nx = 1",
    "import torch\ny = torch.ops.aten.mm.default",
])
def test_the_private_api_scan_lets_pass(code: str) -> None:
    assert list(_private_api_uses("memfit.somewhere", ast.parse(code))) == []


# --------------------------------------------------------------------------------------------- vocabularies


def _string_collections(tree: ast.Module) -> Iterator[tuple[int, set[str]]]:
    """(line, strings) of every tuple, list, set or ``Literal[...]`` written out of string constants."""
    for node in ast.walk(tree):
        elements: list[ast.expr] | None = None
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elements = list(node.elts)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            elements = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if elements and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elements):
            yield node.lineno, {e.value for e in elements}  # type: ignore[attr-defined]


# vocabulary -> the one module that spells it out (others import it); a collection holding this many of its words
# is a second definition
_VOCABULARIES = {
    "precision": ({"fp32", "bf16", "fp16"}, 3, "memfit.workload.spec"),
    "memory category": ({"params", "buffers", "grads", "optimizer_state", "data", "activations", "temporaries",
                         "workspaces", "fragmentation"}, 4, "memfit.estimate.categories"),
    "training change": ({"no", "numerics", "semantics"}, 3, "memfit.explain.fixes"),
    "fix kind": ({"micro_batch", "precision", "checkpointing", "channels_last", "optimizer",
                  "expandable_segments", "patch", "combined"}, 4, "memfit.explain.fixes"),
}


def test_fixed_vocabularies_are_defined_once() -> None:
    bad = []
    for name, path, tree in _trees():
        for line, strings in _string_collections(tree):
            for what, (words, enough, home) in _VOCABULARIES.items():
                if len(strings & words) >= enough and name != home:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: the {what}s again: {sorted(strings & words)}")
    assert bad == []


def test_the_default_forward_is_defined_once() -> None:
    defined = [f"{name}.{node.name}" for name, _, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and "default_forward" in node.name]
    assert defined == ["memfit.workload.spec.default_forward"]
