"""Is a condition on tensor values only a check? Read from the source of the statement that asks it.

(And ``int_of_item``: is a number read turned into an integer at once? A random draw read so may not vary at all.)

A condition the trace answers from values it took elsewhere (the batch made for real, one real CPU forward) may go
the other way on the user's data, and the other branch may need more memory: such a trace widens the upper bound
(``value_branch``). Many of the conditions real training steps ask are checks of their inputs, whose other branch
raises (Hugging Face's CTC heads: ``if labels.max() >= vocab_size: raise``; torchvision's detectors:
``if degenerate_boxes.any(): ... torch._assert(False, ...)``; ``assert (x >= 0).all()``) or only warns (Hugging
Face's ``warn_if_padding_and_no_attention_mask``). A step that goes the other way there stops or prints; it needs no
more memory, so such a condition is named (``value_check``) but does not widen the bound.

The rule reads the ``if`` or ``assert`` statement whose test holds the line that asked (Python's ``ast`` on the
file's source). Whether the condition's value made the test true or false is not known here (``not``, ``and``), so
the rule asks only what holds either way: one branch always raises (the trace ran to its end, so it took the other),
or both branches only warn, log or bind strings. A test that asks only whether values are finite
(``if not torch.isfinite(h).all(): h = h.clamp(...)``, DETR's encoder layers) counts too: the values the trace
took it from are finite, and the other branch runs only in a step that has already overflowed. Anything else (a
clamp on other values, a ``return``, a loop, a line that is not such a test, source that cannot be read) is not a
check.
"""

from __future__ import annotations

import ast
import functools
import linecache

__all__ = ["int_of_item", "only_checks"]

_WARNING_CALLS = frozenset({"warn", "warning", "warning_once", "warning_advice", "info", "debug", "log", "print"})
"""Functions a branch may call and still only warn: ``warnings.warn``, a logger's methods, ``print``."""

_ASSERT_CALLS = frozenset({"_assert", "_assert_async"})
"""``torch._assert(False, msg)`` raises: torchvision's detectors end their input checks with it."""


def only_checks(filename: str, lineno: int, *, from_values: bool = True) -> bool:
    """True when the statement asking at ``filename:lineno`` is an ``assert``, or an ``if`` one of whose branches
    always raises or both of whose branches only warn (module docstring).

    Args:
        from_values: the condition was answered from real values (the batch's, one real forward's), which are
            finite: a test of finiteness alone then took the healthy branch. A condition taken as False without
            values may have taken the other one, so there it is not a check.
    """
    node = _statement_testing(filename, lineno)
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.If):
        return (_raises(node.body) or _raises(node.orelse) or (_quiet(node.body) and _quiet(node.orelse))
                or (from_values and _finiteness_guard(node.test)))
    return False


_FINITENESS_TESTS = frozenset({"isfinite", "isnan", "isinf", "isneginf", "isposinf"})
_FINITENESS_CALLS = _FINITENESS_TESTS | {"all", "any"}
"""What a test of finiteness alone may call: the tests, and the reductions of their results."""


def _finiteness_guard(test: ast.expr) -> bool:
    """The test asks only whether values are finite (``not torch.isfinite(h).all()``, ``x.isnan().any()``, beside
    plain flags such as ``self.training``): the values the trace took it from (the batch, one real forward of random
    weights) are finite, so it took the branch every healthy step takes; the other runs only in a step whose
    activations already overflowed (DETR's and Mask2Former's layers then clamp them)."""
    calls = [n for n in ast.walk(test) if isinstance(n, ast.Call)]
    return bool(calls) and all(_call_name(c) in _FINITENESS_CALLS for c in calls) and any(
        _call_name(c) in _FINITENESS_TESTS for c in calls)


@functools.lru_cache(maxsize=64)
def _tree(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    if not source:
        return None
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=1024)
def _statement_testing(filename: str, lineno: int) -> ast.stmt | None:
    """The innermost ``if`` / ``assert`` whose test spans ``lineno``, or None."""
    tree = _tree(filename)
    if tree is None:
        return None
    found: ast.stmt | None = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.Assert)):
            test = node.test
            end = test.end_lineno or test.lineno
            if test.lineno <= lineno <= end and (found is None or node.lineno >= found.lineno):
                found = node
    return found


def _call_name(node: ast.expr) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _raises(body: list[ast.stmt]) -> bool:
    """The branch always raises: its last statement is a ``raise``, ``torch._assert(False, ...)``, or an ``if``
    both of whose branches raise."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.Raise):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and _call_name(last.value) in _ASSERT_CALLS:
        args = last.value.args
        return bool(args) and isinstance(args[0], ast.Constant) and args[0].value is False
    if isinstance(last, ast.If):
        return _raises(last.body) and _raises(last.orelse)
    return False


_LOOKUP_CALLS = frozenset({"getattr", "hasattr", "isinstance", "len", "str", "repr"})
"""Builtins a warning's branch may bind the result of (Hugging Face's padding warning reads
``getattr(self.config, "sep_token_id", None)``), called on names, attributes and constants only."""


def _is_text(node: ast.expr) -> bool:
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        return True
    return isinstance(node, ast.BinOp) and _is_text(node.left) and _is_text(node.right)


def _is_lookup(node: ast.expr) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _LOOKUP_CALLS
            and all(isinstance(a, (ast.Name, ast.Attribute, ast.Constant)) for a in node.args))


def _quiet(body: list[ast.stmt]) -> bool:
    """The branch only warns, logs, prints, binds text or a lookup (``getattr``, ``len``) or checks again (an empty
    branch too)."""
    for stmt in body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and (isinstance(stmt.value, ast.Constant)
                                           or _call_name(stmt.value) in _WARNING_CALLS):
            continue
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets) \
                and (_is_text(stmt.value) or _is_lookup(stmt.value)):
            continue
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and _is_text(stmt.value):
            continue  # more text for the warning
        if isinstance(stmt, ast.If) and all(_raises(b) or _quiet(b) for b in (stmt.body, stmt.orelse)):
            continue  # a nested check (an elif): its own condition is a site of its own
        return False
    return True


@functools.lru_cache(maxsize=256)
def int_of_item(filename: str, lineno: int) -> bool:
    """The number read at ``filename:lineno`` is turned into an integer at once: ``int(<tensor>.item())`` spans the
    line (torchvision's ``torch_choice``: ``int(torch.empty(1).uniform_(0.0, float(len(k))).item())``)."""
    tree = _tree(filename)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int"
                and len(node.args) == 1 and _call_name(node.args[0]) == "item"
                and node.lineno <= lineno <= (node.end_lineno or node.lineno)):
            return True
    return False

