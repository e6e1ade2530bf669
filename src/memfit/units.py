"""Byte sizes: one table of units, parsing of user text, rendering.

"24GB" means 24 * 10**9 bytes and "24GiB" means 24 * 2**30 bytes; the two are never confused. A bare number is
bytes.
"""

from __future__ import annotations

import math
import re

from memfit.errors import UsageError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
MAX_BYTES = 1 << 60
"""1 EiB: no size memfit reads is larger (GPU memory is measured in GiB), so anything above is a typo."""

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "k": KiB,  # the PyTorch allocator's own convention (max_split_size_mb etc. are binary)
    "m": MiB,
    "g": GiB,
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, *, at_most: int | None = MAX_BYTES) -> int:
    """Parse a size such as ``"24GiB"``, ``"12 GB"``, ``"512MiB"`` or ``1024`` into bytes.

    ``at_most`` bounds what a user may ask for (1 EiB: a larger budget is a typo); ``None`` reads any finite size,
    as an OOM message may report one (a request of 16 EiB from an overflowed size computation).

    Example:
        >>> parse_bytes("1.5GiB")
        1610612736
    """
    limit = math.inf if at_most is None else at_most
    if isinstance(text, bool):
        raise UsageError(f"a size must be a number of bytes or a string like '24GiB', got {text!r}")
    if isinstance(text, (int, float)):
        if not text > 0:  # also NaN
            raise UsageError(f"a size must be positive, got {text!r}. Example: 24GiB.")
        if text > limit or text == math.inf:
            raise UsageError(f"a size must be at most 1 EiB, got {_shown(text)} bytes. Example: 24GiB.")
        return int(text)
    match = _SIZE.match(str(text))
    if match is None:
        raise UsageError(
            f"cannot read the size {_shown(text)}: write a positive number and a unit, e.g. 24GiB (2^30 bytes) "
            "or 24GB (10^9 bytes)."
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise UsageError(f"unknown unit {_shown(match.group(2))} in {_shown(text)}: use B, KB, MB, GB, KiB, MiB or GiB.")
    scaled = number * _UNITS[unit]  # a float, never an overflow: 400 digits read as inf
    if scaled > limit or scaled == math.inf:
        raise UsageError(f"the size {_shown(text)} is more than 1 EiB, larger than any GPU's memory. "
                         "Example: 24GiB.")
    value = int(round(scaled))
    if value <= 0:
        raise UsageError(f"a size must be positive, got {text!r}. Example: 24GiB.")
    return value


def _shown(value: object) -> str:
    """``value`` for an error message, cut short: a 400-digit size is a typo, not something to print whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def format_bytes(n: int | float, *, signed: bool = False) -> str:
    """Render bytes with a binary unit: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
