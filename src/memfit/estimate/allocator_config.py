"""The knobs of PyTorch's CUDA caching allocator, read from ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``.

Only the knobs that change ``max_memory_allocated()`` / ``max_memory_reserved()`` of the native backend are
kept; the rest (pinned-memory options, ``release_lock_on_cudamalloc``...) are accepted and ignored. The parsing
rules and limits follow ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs``) and
``c10/cuda/CUDAAllocatorConfig.h`` (torch 2.13 headers).

Example:
    >>> AllocatorConfig.from_env("expandable_segments:True,max_split_size_mb:128").max_split_size_bytes
    134217728
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from memfit.errors import UsageError
from memfit.units import MiB

log = logging.getLogger(__name__)

# c10/core/AllocatorConfig.cpp: kRoundUpPowerOfTwoIntervals, the per-interval table covers [1 MiB, 64 GiB).
ROUNDUP_INTERVALS = 16
# c10/core/AllocatorConfig.cpp: max_split_size_mb and max_non_split_rounding_mb must be >= kLargeBuffer / 1 MiB.
_MIN_SPLIT_MB = 20

# Keys the real parser accepts that do not change the device allocator's byte counters
# (c10/cuda/CUDAAllocatorConfig.h getKeys(), c10/core/AllocatorConfig.h pinned_* options).
_IGNORED_KEYS = frozenset(
    {
        "release_lock_on_cudamalloc",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "pinned_num_register_threads",
        "pinned_use_background_threads",
        "pinned_max_round_threshold",
        "pinned_max_cached_size",
        "pinned_reserve_segment_size_mb",
        "pinned_free_catch_all",
        "graph_capture_record_stream_reuse",
        "throw_on_cudamalloc_oom",
    }
)


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Settings of the native CUDA caching allocator that shape its memory counters."""

    expandable_segments: bool = False
    """One growing segment per pool, mapped in 2 MiB (small) / 20 MiB (large) pages: reserved stays close to
    allocated (less fragmentation), at the cost of slower first allocations."""

    max_split_size_bytes: int | None = None
    """Free blocks this big or bigger are never split (None = unlimited, the default). Limits fragmentation from
    huge blocks; costs extra segments for the requests those blocks no longer serve."""

    roundup_power2_divisions: int | tuple[int, ...] = 0
    """Round requests up to one of N divisions between powers of two (0/1 = off, plain 512 B rounding). A tuple
    of 16 gives N per size interval [2^k MiB, 2^(k+1) MiB), k = 0..15. Raises allocated, lowers fragmentation."""

    max_non_split_rounding_bytes: int = 20 * MiB
    """A request >= max_split_size may take a cached oversize block at most this much bigger, unsplit."""

    large_segment_size_bytes: int = 20 * MiB
    """Segment size for requests in (1, 10) MiB (kLargeBuffer, option large_segment_size_mb)."""

    garbage_collection_threshold: float = 0.0
    """With a memory cap, free old cached blocks once reserved passes this fraction of the cap (0 = off)."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < _MIN_SPLIT_MB * MiB:
            raise UsageError(
                f"max_split_size_bytes is {self.max_split_size_bytes} but PyTorch requires at least "
                f"{_MIN_SPLIT_MB} MiB ({_MIN_SPLIT_MB * MiB} bytes). Use None for unlimited."
            )
        if self.max_non_split_rounding_bytes < _MIN_SPLIT_MB * MiB:
            raise UsageError(
                f"max_non_split_rounding_bytes is {self.max_non_split_rounding_bytes} but PyTorch requires at "
                f"least {_MIN_SPLIT_MB} MiB."
            )
        if self.large_segment_size_bytes <= 0:
            raise UsageError(f"large_segment_size_bytes must be positive, got {self.large_segment_size_bytes}.")
        if not (self.garbage_collection_threshold == 0.0 or 0.0 < self.garbage_collection_threshold < 1.0):
            raise UsageError(
                f"garbage_collection_threshold is {self.garbage_collection_threshold}; set it in (0.0, 1.0), "
                "or 0 to turn garbage collection off."
            )
        divisions = self.roundup_power2_divisions
        table = divisions if isinstance(divisions, tuple) else (divisions,)
        if isinstance(divisions, tuple) and len(divisions) != ROUNDUP_INTERVALS:
            raise UsageError(
                f"roundup_power2_divisions per interval needs {ROUNDUP_INTERVALS} entries (1 MiB .. 64 GiB), "
                f"got {len(divisions)}."
            )
        for value in table:
            if value < 0 or (value & (value - 1)) != 0:
                raise UsageError(
                    f"roundup_power2_divisions must be 0 or a power of 2, got {value}. Example: 4."
                )

    def divisions_table(self) -> tuple[int, ...]:
        """The 16-entry per-interval form of ``roundup_power2_divisions``."""
        divisions = self.roundup_power2_divisions
        return divisions if isinstance(divisions, tuple) else (divisions,) * ROUNDUP_INTERVALS

    @classmethod
    def from_env(cls, text: str | None = None) -> AllocatorConfig:
        """Parse allocator settings in ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

        Args:
            text: e.g. ``"expandable_segments:True,max_split_size_mb:128"``. None reads
                ``PYTORCH_ALLOC_CONF``, else the deprecated ``PYTORCH_CUDA_ALLOC_CONF`` (the order of
                ``AcceleratorAllocatorConfig::instance``, which parses the keys that matter here).

        Raises:
            UsageError: malformed text, a value PyTorch would reject, or ``backend:cudaMallocAsync`` (its
                counters come from the CUDA driver's pool and cannot be simulated).
        """
        if text is None:
            text = os.environ.get("PYTORCH_ALLOC_CONF")
            if text is None:
                text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            if text is None:
                return cls()
        return cls(**_parse(text))


def _tokens(text: str) -> list[str]:
    # Same lexer as AllocatorConfig::lexArgs: ',', ':', '[', ']' are tokens of their own; spaces vanish.
    out: list[str] = []
    buf = ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif ch != " ":
            buf += ch
    if buf:
        out.append(buf)
    return out


def _bad(text: str, why: str) -> UsageError:
    return UsageError(f"cannot read allocator settings {text!r}: {why}. Example: 'expandable_segments:True'.")


def _int(text: str, token: str, key: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise _bad(text, f"{key} needs an integer, got {token!r}") from None


def _is_pow2_or_zero(value: int) -> bool:
    return value >= 0 and (value & (value - 1)) == 0


def _parse(text: str) -> dict[str, Any]:
    toks = _tokens(text)
    fields: dict[str, Any] = {}  # AllocatorConfig.__post_init__ checks each value
    i = 0

    def value_after_colon() -> str:
        nonlocal i
        if i + 1 >= len(toks) or toks[i + 1] != ":":
            raise _bad(text, f"expected ':' after {toks[i]!r}")
        if i + 2 >= len(toks) or toks[i + 2] in ",:[]" and toks[i + 2] != "[":
            raise _bad(text, f"expected a value for {toks[i]!r}")
        i += 2
        return toks[i]

    while i < len(toks):
        key = toks[i]
        if key == "max_split_size_mb" or key == "max_non_split_rounding_mb":
            mb = _int(text, value_after_colon(), key)
            if mb < _MIN_SPLIT_MB:
                raise _bad(text, f"{key} is {mb} but PyTorch requires >= {_MIN_SPLIT_MB}")
            name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
            fields[name] = mb * MiB
        elif key == "large_segment_size_mb":
            mb = _int(text, value_after_colon(), key)
            if mb <= 0:
                raise _bad(text, f"large_segment_size_mb must be positive, got {mb}")
            fields["large_segment_size_bytes"] = mb * MiB
        elif key == "garbage_collection_threshold":
            token = value_after_colon()
            try:
                threshold = float(token)
            except ValueError:
                raise _bad(text, f"garbage_collection_threshold needs a number, got {token!r}") from None
            if not 0.0 < threshold < 1.0:
                raise _bad(text, f"garbage_collection_threshold is {threshold}; set it in (0.0, 1.0)")
            fields["garbage_collection_threshold"] = threshold
        elif key == "expandable_segments":
            token = value_after_colon()
            if token not in ("True", "False"):  # ConfigTokenizer::toBool is case-sensitive
                raise _bad(text, f"expandable_segments takes True or False, got {token!r}")
            fields["expandable_segments"] = token == "True"
        elif key == "roundup_power2_divisions":
            token = value_after_colon()
            if token == "[":
                fields["roundup_power2_divisions"] = _parse_division_list(text, toks, i)
                while toks[i] != "]":
                    i += 1
            else:
                divisions = _int(text, token, key)
                if not _is_pow2_or_zero(divisions):
                    raise _bad(text, f"roundup_power2_divisions must be a power of 2, got {divisions}")
                fields["roundup_power2_divisions"] = divisions
        elif key == "backend":
            token = value_after_colon()
            if token == "cudaMallocAsync":
                raise UsageError(
                    "backend:cudaMallocAsync is set: its memory is pooled by the CUDA driver, so "
                    "max_memory_reserved() cannot be simulated. Unset it (native backend) for an estimate."
                )
            if token != "native":
                raise _bad(text, f"unknown backend {token!r}; options are native and cudaMallocAsync")
        elif key == "per_process_memory_fraction":
            value_after_colon()
            log.warning(
                "per_process_memory_fraction in the allocator settings is not read here; pass the cap as "
                "capacity_bytes instead."
            )
        elif key in _IGNORED_KEYS:
            value_after_colon()
            log.debug("allocator option %s does not change device memory counters; ignored", key)
        elif key == ",":
            i += 1
            continue
        else:
            log.warning("unknown allocator option %r in %r ignored (PyTorch itself would reject it)", key, text)
            if i + 1 < len(toks) and toks[i + 1] == ":":
                i += 2
                if i < len(toks) and toks[i] == "[":
                    while i < len(toks) and toks[i] != "]":
                        i += 1
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise _bad(text, f"expected ',' before {toks[i]!r}")
            i += 1
    return fields


def _parse_division_list(text: str, toks: list[str], start: int) -> tuple[int, ...]:
    """Parse ``[64:8,256:4,>:1]`` (interval start in MiB : divisions), as parseRoundUpPower2Divisions does."""
    table = [0] * ROUNDUP_INTERVALS
    last_index = 0
    first = True
    i = start + 1
    while i < len(toks) and toks[i] != "]":
        if toks[i] == ",":
            i += 1
            continue
        interval = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise _bad(text, f"roundup_power2_divisions entry {interval!r} needs ':<divisions>'")
        divisions = _int(text, toks[i + 2], "roundup_power2_divisions")
        if not _is_pow2_or_zero(divisions):
            raise _bad(text, f"roundup_power2_divisions must be 0 or a power of 2, got {divisions}")
        if interval == ">":
            for j in range(last_index + 1, ROUNDUP_INTERVALS):  # from the interval after the last one named
                table[j] = divisions
        else:
            mb = _int(text, interval, "roundup_power2_divisions interval")
            if mb <= 0 or not _is_pow2_or_zero(mb):
                raise _bad(text, f"roundup_power2_divisions intervals must be powers of 2 (MiB), got {mb}")
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                for j in range(index):
                    table[j] = divisions
                first = False
            table[index] = divisions
            last_index = index
        i += 3
    if i >= len(toks):
        raise _bad(text, "roundup_power2_divisions list is missing ']'")
    return tuple(table)
