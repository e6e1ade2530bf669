"""Read a CUDA out-of-memory message: find it in a log and turn its text into numbers (an ``OomMessage``).

``memfit explain --oom`` chains ``load_oom_text`` (a log file -> its last OOM), ``parse_oom_message``
(text -> ``OomMessage``) and ``memfit.explain.oom_diagnosis.diagnose_oom`` (numbers -> what they mean). Telling
whether an *exception* is an OOM is ``memfit.guard.oom``'s job; this module only reads text, so it needs no torch,
and a change in torch's wording breaks explaining, never recovering.

Formats read, each tested with a real message (sources at each pattern; docs/explain_oom.md has the table):
the caching allocator of torch <= 2.0, 2.1 and >= 2.2 (CUDA and ROCm), ``backend:cudaMallocAsync``, a failed
CUDA runtime call, and cuBLAS/cuDNN failing to allocate their workspace. Every size comes from
``format_size`` in c10/cuda/CUDACachingAllocator.cpp: "N bytes" up to 1 KiB, else two decimals of KiB, MiB
or GiB, so a parsed size is exact only to +-0.005 of its unit (+-5 MiB for GiB).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from memfit.errors import UsageError
from memfit.records import JsonRecord
from memfit.units import parse_bytes

__all__ = ["OomMessage", "load_oom_text", "parse_oom_message"]

SCHEMA = 1
_S = r"\d+(?:\.\d+)? ?(?:bytes|KiB|MiB|GiB)"  # one format_size() value: "0 bytes", "512.00 KiB", "1.23 GiB"
_SIZE_PARTS = re.compile(r"(\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)", re.IGNORECASE)
# format_size(UINT64_MAX) = "17179869184.00 GiB": NVML_VALUE_NOT_AVAILABLE for a process's usage
# (Windows/WDDM) and cudaMallocAsync's "no limit" default (pytorch_memory_limits = UINT64_MAX): "not known".
_NOT_AVAILABLE_BYTES = 1 << 63

# Where an OOM message starts. Whitespace is \s+ so the raw text of a wrapped log line matches too.
_ANCHOR = re.compile(
    r"\b(?:CUDA|HIP)\s+out\s+of\s+memory\."
    r"|\bAllocation\s+on\s+device\s+\d*\s*would\s+exceed\s+allowed\s+memory"
    r"|\b(?:CUDA|HIP)(?:\s+driver)?\s+error:\s+out\s+of\s+memory"
    r"|\bCUBLAS_STATUS_ALLOC_FAILED\b|\bCUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)\b",
    re.IGNORECASE,
)
_ANCHOR_BYTES = re.compile(_ANCHOR.pattern.encode(), re.IGNORECASE)

# Caching allocator, torch 1.0-2.0: CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc (PR #13751,
# 2018: "... cached)", later "reserved in total by PyTorch"; "N allowed; " since
# set_per_process_memory_fraction, PR #48172; the max_split_size_mb sentence in 1.x-2.0).
_PAREN = re.compile(
    rf"(?P<device>CUDA|HIP) out of memory\. Tried to allocate (?P<req>{_S}) \(GPU (?P<gpu>\d+); "
    rf"(?P<total>{_S}) total capacity(?:; (?P<alloc>{_S}) already allocated; (?P<free>{_S}) free;(?: "
    rf"(?P<allowed>{_S}) allowed;)? (?:(?P<reserved>{_S}) reserved in total by PyTorch|(?P<cached>{_S}) "
    rf"cached))?",
    re.IGNORECASE,
)
# Caching allocator, torch >= 2.1: CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc and
# reportProcessMemoryInfo (PR #99699, torch 2.1: NVML per-process usage, "total capacty" typo,
# max_split_size_mb hint; PR #113481, torch 2.2: "capacity", expandable_segments hint; private pools and the
# docs.pytorch.org link: main @ eb42ad6).
# Every part after the request is optional: torch 2.3-2.4 printed GPU 0's index as a NUL char, which cut the
# message right after "GPU" (pytorch#126766, fixed by PR #128540).
_NATIVE = re.compile(
    rf"(?P<device>CUDA|HIP) out of memory\. Tried to allocate (?P<req>{_S})\.?"
    rf"(?: GPU(?: (?P<gpu>\d+))? has a total (?P<capacity>capacity|capacty) of (?P<total>{_S}) of which "
    rf"(?P<free>{_S}) is free\.)?"
    rf"(?P<procs>(?: (?:Process \d+|Including non-PyTorch memory, this process) has {_S} memory in use\.)*)"
    rf"(?: (?P<allowed>{_S}) allowed;)?"
    rf"(?: Of the allocated memory (?P<alloc>{_S}) is allocated by PyTorch,"
    rf"(?: with (?P<private>{_S}) allocated in private pools \(e\.g\., \w+ Graphs\),)?"
    rf" and (?P<unalloc>{_S}) is reserved by PyTorch but unallocated\.)?"
    r"(?: If reserved but unallocated memory is large try setting (?:(?P<tip_es>\w+=expandable_segments:True)"
    r"|(?P<tip_ms>max_split_size_mb)))?",
    re.IGNORECASE,
)
_PROCESS = re.compile(
    rf"(?:Process (?P<pid>\d+)|this process) has (?P<size>{_S}) memory in use", re.IGNORECASE
)
# Both allocators' allocate() (CUDACachingAllocator.cpp, CUDAMallocAsyncAllocator.cpp) refuse >= 2^60 bytes.
_OVER_1EB = re.compile(r"CUDA out of memory\. Tried to allocate more than 1EB memory", re.IGNORECASE)
# backend:cudaMallocAsync, torch >= 1.13: CUDAMallocAsyncAllocator.cpp, mallocAsync (same text at 0345947 and
# c3342c1); one value per line, joined here by _flatten.
_ASYNC = re.compile(
    rf"Allocation on device (?:(?P<gpu>\d+) )?would exceed allowed memory\. \(out of memory\)"
    rf"(?: Currently allocated ?: (?P<alloc>{_S}))?(?: Requested ?: (?P<req>{_S}))?"
    rf"(?: Device limit ?: (?P<total>{_S}))?(?: Free \(according to CUDA\) ?: (?P<free>{_S}))?"
    rf"(?: PyTorch limit \(set by user-supplied memory fraction\) ?: (?P<allowed>{_S}))?",
    re.IGNORECASE,
)
# C10_CUDA_CHECK outside the caching allocator: c10/cuda/CUDAException.cpp, "CUDA error: " + error string.
_RUNTIME = re.compile(r"(?P<device>CUDA|HIP)(?: driver)? error: out of memory", re.IGNORECASE)
# aten/src/ATen/cuda/Exceptions.h (TORCH_CUDABLAS_CHECK, "... when calling `cublasCreate(handle)`") and
# aten/src/ATen/cudnn/Exceptions.h (AT_CUDNN_CHECK).
_LIBRARY = re.compile(
    r"(?P<status>CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE)"
    r"(?: when calling `[^`]*`)?",
    re.IGNORECASE,
)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# DeviceIndex is a char in some versions, so GPU 1 prints as "\x01" (PR #128540): drop control characters.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_LINE_PREFIX = re.compile(r"^[ \t]*(?:\[rank\d+\]:|#|>)[ \t]?", re.MULTILINE)  # torchrun, comments, quotes
_LOG_SUFFIXES = (".log", ".txt")
_CHUNK_BYTES = 1 << 20
_OVERLAP_BYTES = 512  # longer than any anchor, so one cut by a chunk boundary is still found
_EXCERPT_BYTES = 16 << 10  # the longest message (many processes listed) is well under 2 KiB


@dataclass(frozen=True, kw_only=True)
class OomMessage(JsonRecord):
    """The numbers of one out-of-memory message. ``None`` where the message does not say."""

    _schema: ClassVar[int] = SCHEMA

    torch_format: str
    """Which message family matched: "torch<=2.0", "torch 2.1", "torch>=2.2", "... (ROCm)", "... (truncated)",
    "cudaMallocAsync", "CUDA runtime error", "cuBLAS/cuDNN workspace" or "request over 1 EB"."""
    raw: str
    """The matched text, whitespace collapsed."""
    tried_to_allocate_bytes: int | None = None
    """The request that failed, rounded up by the allocator (2 MiB blocks above 10 MiB)."""
    gpu_index: int | None = None
    total_capacity_bytes: int | None = None
    """The GPU's memory as ``cudaMemGetInfo`` reports it (cudaMallocAsync: "Device limit")."""
    free_bytes: int | None = None
    """Free on the device when the allocation failed, for every process (``cudaMemGetInfo``)."""
    allocated_by_pytorch_bytes: int | None = None
    """Held by live tensors (torch >= 2.1: including CUDA-graph private pools)."""
    reserved_by_pytorch_bytes: int | None = None
    """All the caching allocator holds: allocated plus cached-but-unallocated."""
    reserved_unallocated_bytes: int | None = None
    """Reserved but not allocated: cached blocks no tensor uses (fragmentation when a request still fails)."""
    private_pools_bytes: int | None = None
    """Of the allocated memory, how much sits in private pools (CUDA Graphs)."""
    this_process_bytes: int | None = None
    """This process's whole use per NVML: PyTorch's reserve plus the CUDA context and other libraries."""
    other_processes: tuple[tuple[int, int | None], ...] = ()
    """(pid, bytes) of every other process NVML lists on this GPU; bytes ``None`` when NVML cannot tell."""
    memory_cap_bytes: int | None = None
    """The per-process limit ("N allowed" / "PyTorch limit") from ``set_per_process_memory_fraction``."""
    allocator: str | None = None
    """"native" (caching allocator) or "cudaMallocAsync"; ``None`` when the OOM came from outside either."""
    expandable_segments_hint: bool = False
    """The message suggests expandable_segments (printed whether or not it is already on, pytorch#173049)."""

    def sizes(self) -> list[tuple[str, int]]:
        """The sizes the message states, labelled in words, in the order a reader needs them (for reports)."""
        rows = [(label, getattr(self, name)) for name, label in _SIZE_LABELS if getattr(self, name) is not None]
        others = [b for _, b in self.other_processes if b is not None]
        if others:
            rows.append((f"other processes ({len(self.other_processes)})", sum(others)))
        return rows


# OomMessage fields -> how a report labels them
_SIZE_LABELS = (
    ("tried_to_allocate_bytes", "tried to allocate"),
    ("total_capacity_bytes", "GPU capacity"),
    ("free_bytes", "free on the GPU"),
    ("allocated_by_pytorch_bytes", "allocated by PyTorch"),
    ("reserved_by_pytorch_bytes", "reserved by PyTorch"),
    ("reserved_unallocated_bytes", "reserved but unallocated"),
    ("private_pools_bytes", "in private pools (CUDA Graphs)"),
    ("this_process_bytes", "this process, all memory"),
    ("memory_cap_bytes", "per-process cap"),
)


def load_oom_text(arg: str) -> str:
    """The text of the last OOM in the log file ``arg`` names, or ``arg`` itself when it names no file.

    The file is scanned in 1 MiB chunks, so a log of any size works; undecodable bytes are replaced. What
    comes back starts at the last OOM and runs on for at most 16 KiB (a message spans lines in some formats);
    ``parse_oom_message`` reads the message out of it, and ``OomMessage.raw`` is the message alone.

    Raises:
        UsageError: ``arg`` looks like a log path (.log/.txt) that does not exist, is a directory, or names
            a file that holds no CUDA out-of-memory message.
    """
    if not arg.strip():
        return arg  # parse_oom_message says it is empty
    path = _existing_file(arg)
    if path is None:
        if "\n" not in arg and arg.strip().lower().endswith(_LOG_SUFFIXES):
            raise UsageError(f"no such log file: {arg}. Check the path, or paste the OOM message in quotes.")
        return arg
    try:
        return _excerpt(arg, path)
    except OSError as exc:
        raise UsageError(f"cannot read the log {arg}: {exc.strerror or exc}. Check its permissions, or paste the "
                         "OOM message in quotes.") from None


def _excerpt(arg: str, path: Path) -> str:
    offset = _last_anchor_offset(path)
    if offset is None:
        raise UsageError(
            f"{arg} holds no CUDA out-of-memory message (looked for 'CUDA out of memory', 'would exceed "
            "allowed memory', 'CUDA error: out of memory', 'CUBLAS_STATUS_ALLOC_FAILED'). Give the log of "
            "the failed run."
        )
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(_EXCERPT_BYTES).decode("utf-8", errors="replace")


def _existing_file(arg: str) -> Path | None:
    try:
        path = Path(arg).expanduser()
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError):  # a pasted message can be too long, or hold a NUL, for a path
        return None
    if is_dir:
        raise UsageError(f"{arg} is a directory: give the log file of the failed run, or paste the message.")
    return path if is_file else None


def parse_oom_message(text: str) -> OomMessage:
    """Read the last out-of-memory message in ``text`` (a message, a traceback or a whole log).

    Raises:
        UsageError: ``text`` is empty, holds no OOM, or holds an OOM in a format memfit does not know.

    Example:
        >>> m = parse_oom_message("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
        ...     "GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is free.")
        >>> m.tried_to_allocate_bytes, m.free_bytes, m.torch_format
        (20971520, 0, 'torch>=2.2')
    """
    flat = _flatten(text or "")
    if not flat:
        raise UsageError(
            "the OOM message is empty. Paste the line starting 'torch.OutOfMemoryError: CUDA out of memory' "
            "(in quotes), or give the log file that holds it."
        )
    anchors = list(_ANCHOR.finditer(flat))
    if not anchors:
        if re.search(r"CUDNN_STATUS_NOT_SUPPORTED", flat, re.IGNORECASE):
            # cuDNN says NOT_SUPPORTED for inputs past its size limits (pytorch#2917, #19911, #51776); it also
            # goes away at a smaller batch, which is why Composer and torch-max-mem treat it as an OOM, but
            # nothing in it is a memory number, so memfit cannot explain it.
            raise UsageError(
                "CUDNN_STATUS_NOT_SUPPORTED is not an out-of-memory error: cuDNN rejects inputs past its "
                "size or layout limits (e.g. a very large batch in BatchNorm, pytorch#19911). Try "
                ".contiguous() inputs, a smaller batch, or torch.backends.cudnn.enabled = False for that op."
            )
        if re.search(r"out of memory|OutOfMemoryError", flat, re.IGNORECASE):
            raise UsageError(
                f"this out-of-memory message is in a format memfit does not read: {flat[:80]!r}. It reads "
                "the CUDA/ROCm caching allocator, cudaMallocAsync, CUDA runtime and cuBLAS/cuDNN messages."
            )
        raise UsageError(
            f"this is not a CUDA out-of-memory message: {flat[:80]!r}. Paste the line starting "
            "'torch.OutOfMemoryError: CUDA out of memory' (or 'RuntimeError: CUDA out of memory'), or give "
            "the log file."
        )
    start = anchors[-1].start()  # the last OOM: an earlier one in a log was recovered from, or repeated
    for pattern, build in _READERS:
        match = pattern.match(flat, start)
        if match:
            return build(match)
    raise UsageError(
        f"this CUDA out-of-memory message is in a format memfit does not read: {flat[start:start + 80]!r}. "
        "Paste the whole message (it continues 'Tried to allocate ...'); if it is whole, please report it."
    )


def _flatten(text: str) -> str:
    """One line, single spaces: wrapped lines, log prefixes, colour codes and control characters removed."""
    text = _LINE_PREFIX.sub("", _CONTROL.sub(" ", _ANSI.sub("", text)))
    return " ".join(text.split())


def _bytes(size: str | None) -> int | None:
    """A format_size() value in bytes; None when absent or NVML/cudaMallocAsync's "not known" (UINT64_MAX)."""
    match = _SIZE_PARTS.fullmatch(size) if size is not None else None
    if match is None:
        return None
    number, unit = match.groups()
    value = int(number) if unit.lower() == "bytes" else parse_bytes(f"{number}{unit}", at_most=None)
    return None if value >= _NOT_AVAILABLE_BYTES else value


def _read_paren(m: re.Match[str]) -> OomMessage:
    alloc, reserved, cached = _bytes(m["alloc"]), _bytes(m["reserved"]), _bytes(m["cached"])
    if reserved is None and cached is not None and alloc is not None:  # torch <= 1.3: "cached" = unallocated
        reserved = alloc + cached
    unalloc = max(0, reserved - alloc) if reserved is not None and alloc is not None else None
    return OomMessage(
        torch_format="torch<=2.0" + (" (ROCm)" if m["device"].upper() == "HIP" else ""), raw=m[0],
        tried_to_allocate_bytes=_bytes(m["req"]), gpu_index=int(m["gpu"]),
        total_capacity_bytes=_bytes(m["total"]), free_bytes=_bytes(m["free"]),
        allocated_by_pytorch_bytes=alloc, reserved_by_pytorch_bytes=reserved,
        reserved_unallocated_bytes=unalloc,
        memory_cap_bytes=_bytes(m["allowed"]), allocator="native",
    )


def _read_native(m: re.Match[str]) -> OomMessage:
    this, others = None, []
    for p in _PROCESS.finditer(m["procs"]):
        if p["pid"]:
            others.append((int(p["pid"]), _bytes(p["size"])))
        else:
            this = _bytes(p["size"])
    if m["tip_ms"] or (m["capacity"] or "").lower() == "capacty":
        label = "torch 2.1"  # PR #99699 wording, before PR #113481
    else:
        label = "torch>=2.2" if m["total"] else "torch>=2.1 (truncated)"
    alloc, unalloc = _bytes(m["alloc"]), _bytes(m["unalloc"])
    return OomMessage(
        torch_format=label + (" (ROCm)" if m["device"].upper() == "HIP" else ""), raw=m[0],
        tried_to_allocate_bytes=_bytes(m["req"]), gpu_index=int(m["gpu"]) if m["gpu"] else None,
        total_capacity_bytes=_bytes(m["total"]), free_bytes=_bytes(m["free"]),
        allocated_by_pytorch_bytes=alloc,
        # reserved = (allocated + private) + (reserved - allocated - private): the two printed terms
        reserved_by_pytorch_bytes=alloc + unalloc if alloc is not None and unalloc is not None else None,
        reserved_unallocated_bytes=unalloc, private_pools_bytes=_bytes(m["private"]), this_process_bytes=this,
        other_processes=tuple(others), memory_cap_bytes=_bytes(m["allowed"]), allocator="native",
        expandable_segments_hint=bool(m["tip_es"]),
    )


def _read_async(m: re.Match[str]) -> OomMessage:
    return OomMessage(
        torch_format="cudaMallocAsync", raw=m[0], tried_to_allocate_bytes=_bytes(m["req"]),
        gpu_index=int(m["gpu"]) if m["gpu"] else None, total_capacity_bytes=_bytes(m["total"]),
        free_bytes=_bytes(m["free"]), allocated_by_pytorch_bytes=_bytes(m["alloc"]),
        # an unset cap prints as UINT64_MAX, which _bytes reads as None
        memory_cap_bytes=_bytes(m["allowed"]), allocator="cudaMallocAsync",
    )


_READERS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], OomMessage]], ...] = (
    (_OVER_1EB, lambda m: OomMessage(torch_format="request over 1 EB", raw=m[0])),
    (_PAREN, _read_paren),
    (_NATIVE, _read_native),
    (_ASYNC, _read_async),
    (_RUNTIME, lambda m: OomMessage(torch_format="CUDA runtime error", raw=m[0])),
    (_LIBRARY, lambda m: OomMessage(torch_format="cuBLAS/cuDNN workspace", raw=m[0])),
)


def _last_anchor_offset(path: Path) -> int | None:
    """Byte offset of the last OOM anchor in ``path``, reading it in chunks (logs can be many GiB)."""
    last, base, tail = None, 0, b""
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            buf = tail + chunk
            for match in _ANCHOR_BYTES.finditer(buf):
                last = base - len(tail) + match.start()
            base += len(chunk)
            tail = buf[-_OVERLAP_BYTES:]
    return last
