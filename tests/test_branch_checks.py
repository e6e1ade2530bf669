"""Which conditions only check values (memfit.estimate.branch_checks): read from the statement's source."""

from __future__ import annotations

import linecache
from pathlib import Path

import pytest

from memfit.estimate.branch_checks import int_of_item, only_checks

SOURCE = '''\
import logging, warnings
import torch
logger = logging.getLogger(__name__)

def f(x, labels, boxes, vocab):
    if labels is not None and labels.max() >= vocab:
        raise ValueError(f"labels must be < {vocab}")
    if (boxes[:, 2:] <= boxes[:, :2]).any():
        bad = torch.where(boxes[:, 2] <= boxes[:, 0])[0][0]
        torch._assert(False, f"degenerate box {bad}")
    assert (x >= 0).all(), "negative input"
    if x.isnan().any():
        text = "nan " + "seen"
        sep = getattr(logger, "sep", None)
        if sep is not None and len(text) > 3:
            text += f" ({sep})"
        logger.warning_once(text)
        warnings.warn(f"{text}")
    if (x > 100).any():
        scale = x.abs().max()
        logger.warning(f"inf, scale {scale}")
    if not torch.isfinite(x).all():
        x = torch.clamp(x, -1e4, 1e4)
    if x.isnan().any() or x.sum() > 5:
        x = torch.nan_to_num(x)
    if x.sum() > 0:
        return x
    if x.mean() > 1:
        y = x * 2
    else:
        raise RuntimeError("small")
    if x.max() > 2:
        pass
    elif x.min() < -2:
        raise ValueError("low")
    if x.min() < -3:
        torch._assert(True, "never")
    z = x if x.any() else -x
    while x.sum() > 10:
        x = x / 2
    index = int(torch.empty(1).uniform_(0.0, 3.0).item())
    scale = float(torch.empty(1).uniform_(0.0, 3.0).item())
    return x
'''


@pytest.fixture()
def source(tmp_path: Path) -> str:
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    linecache.checkcache(str(path))
    return str(path)


def _line(text: str) -> int:
    return next(i for i, line in enumerate(SOURCE.splitlines(), 1) if text in line)


@pytest.mark.parametrize(("line", "check"), [
    ("labels.max() >= vocab", True),  # the other branch raises
    ("(boxes[:, 2:] <= boxes[:, :2]).any()", True),  # ends in torch._assert(False, ...): torchvision's box check
    ("assert (x >= 0).all()", True),
    ("x.isnan().any()", True),  # warns and logs only (Hugging Face's padding warning)
    ("(x > 100).any()", False),  # computes with a tensor before it warns
    ("not torch.isfinite(x).all()", True),  # a clamp only once values overflowed (DETR's encoder layers)
    ("x.isnan().any() or x.sum() > 5", False),  # a finiteness test beside a test of the values themselves
    ("if x.sum() > 0", False),  # returns early: the rest of the function is skipped one way
    ("x.mean() > 1", True),  # the else raises: the trace, which ran on, took the body
    ("x.max() > 2", True),  # pass, or an elif whose branches raise or do nothing
    ("x.min() < -2", True),
    ("x.min() < -3", False),  # torch._assert(True, ...) does not raise
    ("x if x.any() else -x", False),  # a conditional expression is not a statement's test
    ("while x.sum() > 10", False),
])
def test_only_checks(source: str, line: str, check: bool) -> None:
    assert only_checks(source, _line(line)) is check


def test_unreadable_source_is_not_a_check(tmp_path: Path) -> None:
    assert not only_checks(str(tmp_path / "gone.py"), 3)
    broken = tmp_path / "broken.py"
    broken.write_text("if x.any(:\n    raise ValueError\n")
    assert not only_checks(str(broken), 1)


def test_a_finiteness_test_taken_as_false_without_values_is_not_a_check(source: str) -> None:
    # without values a read is taken as False, which for `not torch.isfinite(x).all()` is the overflowed branch
    line = _line("not torch.isfinite(x).all()")
    assert only_checks(source, line) and not only_checks(source, line, from_values=False)
    assert only_checks(source, _line("labels.max() >= vocab"), from_values=False)  # a raise needs no values


def test_a_number_made_an_integer_at_once(source: str) -> None:
    assert int_of_item(source, _line("index = int("))
    assert not int_of_item(source, _line("scale = float("))
    assert not int_of_item(source, _line("x.sum() > 0"))

