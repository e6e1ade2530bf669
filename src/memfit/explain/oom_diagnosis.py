"""Say what a CUDA out-of-memory message means: which memory was short, why, and what to do about it.

``diagnose_oom`` reads the numbers of an ``OomMessage`` (``memfit.explain.oom_message``) and, when given, a
workload's ``Estimate``. Each finding states only what the numbers show, with the arithmetic
behind it, most important first: a request larger than the GPU, a per-process cap, memory other processes
hold, fragmentation (reserved but unallocated), memory outside PyTorch's allocator, else "the step needs more
memory than the GPU gives it"; then where the GPU's memory went. docs/explain_oom.md explains each finding
and its sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, get_args

from memfit.explain.oom_message import SCHEMA, OomMessage
from memfit.records import JsonRecord
from memfit.units import format_bytes

# Types only: memfit.estimate.predict imports torch, and a message is explained without it.
if TYPE_CHECKING:
    from memfit.estimate.predict import Estimate

__all__ = ["OOM_CAUSES", "OomCause", "OomDiagnosis", "diagnose_oom"]

OomCause = Literal[
    "request_exceeds_gpu", "memory_cap", "other_processes", "fragmentation", "memory_outside_pytorch",
    "needs_more_memory", "outside_allocator", "estimate_exceeds_gpu", "estimate_fits",
]
"""What ``OomDiagnosis.causes`` holds; docs/explain_oom.md explains each."""
OOM_CAUSES: tuple[OomCause, ...] = get_args(OomCause)

# Reserved-but-unallocated memory counts as fragmentation from this share of the reserve (or when it alone
# exceeds the request): below it the allocator's normal slack explains it (rounding, 2 MiB small-block
# segments, the 20 MiB blocks split for 1-10 MiB requests: kSmallBuffer, kLargeBuffer in
# CUDACachingAllocator.cpp).
FRAGMENTATION_SHARE = 0.10
# Other processes count as a cause from this share of the GPU, even when freeing them alone would not fit the
# request: beyond it they visibly shrink what this job can use.
OTHER_PROCESSES_SHARE = 0.10
# Printed sizes carry +-0.005 of their unit (format_size's two decimals), up to 0.5 % each, so comparisons
# of printed numbers allow 1 % (a request printed equal to the cap did pass it: the allocator rounds up).
_ROUNDING = 0.01
# The findings that name a cause; without one of them the verdict says what filled the GPU.
_CAUSES: frozenset[OomCause] = frozenset({"request_exceeds_gpu", "other_processes", "memory_cap", "fragmentation"})
_SHRINK = ("shrink its peak (smaller batch, activation checkpointing, lower precision, sharded optimizer "
           "state) or use a larger GPU")


@dataclass(frozen=True, kw_only=True)
class OomDiagnosis(JsonRecord):
    """What an OOM message means, as plain sentences, most important first."""

    _schema: ClassVar[int] = SCHEMA  # one version for the message and its diagnosis

    message: OomMessage
    findings: list[str]
    """Sentences a user can act on; only what the numbers show."""
    causes: list[OomCause]
    """Machine-readable tags, most important first: "request_exceeds_gpu", "memory_cap", "other_processes",
    "fragmentation", "memory_outside_pytorch", "needs_more_memory", "outside_allocator", and with an estimate
    "estimate_exceeds_gpu" or "estimate_fits"."""


def diagnose_oom(message: OomMessage, estimate: Estimate | None = None) -> OomDiagnosis:
    """Say what an OOM message means: which memory was short, why, and what to do; tie it to ``estimate``.

    Example:
        >>> from memfit.explain.oom_message import parse_oom_message
        >>> d = diagnose_oom(parse_oom_message("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
        ...     "15.00 GiB total capacity; 8.00 GiB already allocated; 1.00 GiB free; 13.00 GiB reserved in "
        ...     "total by PyTorch)"))
        >>> d.causes
        ['fragmentation']
    """
    findings: list[str] = []
    causes: list[OomCause] = []
    m = message
    if m.torch_format == "request over 1 EB":
        causes.append("request_exceeds_gpu")
        findings.append(
            "The request is over 1 EB (2^60 bytes), which PyTorch refuses outright: a size computation "
            "overflowed, a shape is wrong, or (in distributed code) ranks are out of step so a collective "
            "such as all_gather_object read a garbage size. Check the op in the traceback."
        )
    elif m.allocator is None:
        causes.append("outside_allocator")
        library = m.torch_format == "cuBLAS/cuDNN workspace"
        who = ("The library (cuBLAS or cuDNN), allocating its handle or workspace," if library else
               "A CUDA call outside PyTorch's caching allocator (a kernel launch, a library's cudaMalloc)")
        # These allocations call cudaMalloc / cublasCreate themselves, so memory PyTorch keeps cached is not
        # available to them as it would be to a tensor.
        findings.append(
            f"{who} ran out of memory, so the message has no numbers. Memory PyTorch keeps cached is not "
            "available to it: torch.cuda.empty_cache() before that op can make room. Compare "
            "torch.cuda.memory_reserved() with nvidia-smi just before it, and look for other processes."
        )
        if library:
            findings.append(
                "An earlier asynchronous CUDA error (an out-of-range index, say) can also surface as this "
                "status: rerun with CUDA_LAUNCH_BLOCKING=1 to rule it out."
            )
    else:
        req, free, total = m.tried_to_allocate_bytes, m.free_bytes, m.total_capacity_bytes
        if req is not None:
            where = f" on GPU {m.gpu_index}" if m.gpu_index is not None else ""
            room = ""
            if free is not None and total is not None:
                room = f"; the GPU had {format_bytes(free)} free of {format_bytes(total)}"
            findings.append(f"PyTorch asked for {format_bytes(req)}{where}{room}.")
        _diagnose_allocator(m, findings, causes)
    if estimate is not None:
        _compare_estimate(m, estimate, findings, causes)
    return OomDiagnosis(message=m, findings=findings, causes=causes)


def _diagnose_allocator(m: OomMessage, findings: list[str], causes: list[OomCause]) -> None:
    req, total, free = m.tried_to_allocate_bytes, m.total_capacity_bytes, m.free_bytes
    alloc, reserved, cap = m.allocated_by_pytorch_bytes, m.reserved_by_pytorch_bytes, m.memory_cap_bytes
    unalloc = m.reserved_unallocated_bytes
    fmt = format_bytes
    if total is None and m.allocator == "native":
        findings.append(
            "The message stops after the request (torch 2.3-2.4 printed GPU 0's index as a NUL character, "
            "which cut it, pytorch#126766): only the request size is known. Upgrade torch for the full "
            "message."
        )
        return
    if req is not None and total is not None and req > total:
        causes.append("request_exceeds_gpu")
        findings.append(
            f"The single request ({fmt(req)}) is larger than the whole GPU ({fmt(total)}): no setting or "
            "freed memory can serve it. Check the shapes of the op in the traceback, or split that op into "
            "chunks."
        )
    if alloc is not None and total is not None and alloc > total:
        findings.append(
            f"These numbers do not add up: PyTorch holds {fmt(alloc)} on a {fmt(total)} GPU, which happens "
            "when the driver backs GPU memory with system memory (e.g. the Windows sysmem fallback)."
        )
    # Who holds the rest. In a container NVML reports host PIDs, so PyTorch cannot recognise itself and lists
    # this process as "Process <host pid>" (real messages in tests/test_oom_message.py).
    this = m.this_process_bytes
    others = [(pid, b) for pid, b in m.other_processes if b is not None]
    if this is None and others and reserved is not None:
        big = [pid for pid, b in others if b >= reserved]
        if len(others) == 1 and big:
            (pid, this), others = others[0], []
            findings.append(
                f"Process {pid} holds {fmt(this)}, at least all PyTorch reserved ({fmt(reserved)}): most "
                "likely this process under its host PID (in a container NVML reports host PIDs). It is "
                "counted as this process."
            )
        elif big:
            findings.append(
                f"This process is not listed by name; {' or '.join(map(str, big))} may be it, seen under its "
                "host PID from inside a container."
            )
    # A cap binds when the allocator's own total plus the request passes it (alloc_block in
    # CUDACachingAllocator.cpp: total_allocated_memory + size > allowed_memory_maximum; mallocAsync: used +
    # size > pytorch_memory_limits).
    held = reserved if reserved is not None else alloc
    if cap is not None and req is not None and held is not None and held + req > (1 - _ROUNDING) * cap:
        causes.append("memory_cap")
        findings.append(
            f"A per-process cap of {fmt(cap)} is set (set_per_process_memory_fraction): PyTorch held "
            f"{fmt(held)} and {fmt(req)} more passes it."
            + (f" The GPU had {fmt(free)} free, so the cap, not the GPU, stopped it." if free and free >= req
               else "")
        )
    other_total = sum(b for _, b in others)
    if other_total:
        listing = ", ".join(f"pid {pid}: {fmt(b)}" for pid, b in others[:6])
        would_fit = req is not None and free is not None and free < req <= free + other_total
        # a cause only when the GPU itself was short: with enough free memory something else stopped it
        short = free is not None and req is not None and free < req
        if would_fit or (short and total and other_total >= OTHER_PROCESSES_SHARE * total):
            causes.append("other_processes")
        findings.append(
            f"Other processes hold {fmt(other_total)} of this GPU ({listing})."
            + (" Without them the request would have fit." if would_fit else "")
            + " That memory is not yours to free from here: another job, a second CUDA context (a DataLoader "
            "worker or subprocess that touched CUDA) or a stray .cuda() elsewhere; nvidia-smi lists them."
        )
    if m.allocator == "cudaMallocAsync":
        findings.append(
            "With backend:cudaMallocAsync the message gives only what PyTorch has allocated; the CUDA pool's "
            "cache is not reported, so fragmentation and other processes cannot be read from it."
        )
    elif reserved and unalloc is not None:
        _fragmentation(m, reserved, unalloc, findings, causes)
    if m.private_pools_bytes:
        findings.append(
            f"{fmt(m.private_pools_bytes)} of the allocated memory is in private pools (CUDA Graphs, "
            "torch.compile mode='reduce-overhead'): it stays reserved until the captured graphs are freed."
        )
    if req is not None and free is not None and free >= req and "memory_cap" not in causes:
        findings.append(
            f"The GPU reported {fmt(free)} free, at least the request, yet the allocation failed: the free "
            "figure is read after the failure (memory released in between counts as free), or it was not one "
            "usable block."
        )
    verdict = _verdict(m, other_total, causes)
    if verdict:
        findings.append(verdict)
    if total is not None and free is not None and alloc is not None:
        findings.append(_where_it_went(m, this, other_total))


def _fragmentation(
    m: OomMessage, reserved: int, unalloc: int, findings: list[str], causes: list[OomCause]
) -> None:
    req, fmt = m.tried_to_allocate_bytes, format_bytes
    share = unalloc / reserved
    if share < FRAGMENTATION_SHARE and (req is None or unalloc < req):
        findings.append(
            f"Fragmentation is not the cause: only {fmt(unalloc)} ({_pct(share)}) of the {fmt(reserved)} "
            "PyTorch reserved is unallocated."
        )
        return
    causes.append("fragmentation")
    fix = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA allocation) usually "
           "recovers most of it")
    if m.torch_format.startswith("torch<=2.0"):
        fix = ("expandable_segments needs torch >= 2.1; on this version PYTORCH_CUDA_ALLOC_CONF="
               "max_split_size_mb:512 stops large cached blocks from being split into unusable pieces")
    elif m.expandable_segments_hint:
        fix += "; PyTorch prints that hint even when it is on (pytorch#173049): check whether it already is"
    findings.append(
        f"{fmt(unalloc)} ({_pct(share)} of the {fmt(reserved)} PyTorch reserved) is cached but unallocated: "
        "fragmentation, free pieces each too small for the request"
        + (", though together more than it" if req is not None and unalloc >= req else "") + f". {fix}."
    )


def _verdict(m: OomMessage, other_total: int, causes: list[OomCause]) -> str | None:
    """Without a named cause: memory outside PyTorch's allocator, or PyTorch's own tensors, filled the GPU."""
    req, total, free = m.tried_to_allocate_bytes, m.total_capacity_bytes, m.free_bytes
    alloc = m.allocated_by_pytorch_bytes
    if set(causes) & _CAUSES or alloc is None or req is None or total is None or free is None:
        return None
    if alloc > total:  # the numbers do not add up (said above): no verdict from them
        return None
    fmt = format_bytes
    # Memory neither PyTorch's, free, nor a listed process's: this process's CUDA context and libraries, or
    # (without per-process numbers) anyone's. It is the cause when it is the larger consumer and the request
    # would have fit without it; otherwise PyTorch's own tensors filled the GPU.
    held = m.reserved_by_pytorch_bytes if m.reserved_by_pytorch_bytes is not None else alloc
    outside = total - free - held - other_total
    if free < req <= free + outside and outside > alloc:
        causes.append("memory_outside_pytorch")
        return (
            f"{fmt(outside)} of the GPU is held outside PyTorch's allocator, more than PyTorch's own tensors "
            f"({fmt(alloc)}); without it the request would have fit. Look for other processes (nvidia-smi) "
            "and for libraries that allocate on their own (another framework, a model server, NCCL)."
        )
    causes.append("needs_more_memory")
    return (
        f"Nothing else stands out: PyTorch's live tensors ({fmt(alloc)}) and this request need "
        f"{fmt(alloc + req)}, {_pct((alloc + req) / total)} of the GPU. The step needs more than this GPU "
        f"gives it: {_SHRINK}."
    )


def _where_it_went(m: OomMessage, this: int | None, other_total: int) -> str:
    """Split the GPU's capacity into what the message accounts for; the remainder is named, never guessed."""
    total, free, alloc = m.total_capacity_bytes or 0, m.free_bytes or 0, m.allocated_by_pytorch_bytes or 0
    parts = [("live tensors", alloc)]
    if m.reserved_unallocated_bytes is not None:
        parts.append(("cached but unallocated", m.reserved_unallocated_bytes))
    held = m.reserved_by_pytorch_bytes if m.reserved_by_pytorch_bytes is not None else alloc
    if this is not None:
        # NVML's per-process use minus PyTorch's reserve: the CUDA context, NCCL buffers, cuBLAS/cuDNN handles
        # and any library calling cudaMalloc itself. set_per_process_memory_fraction does not limit it.
        parts.append(("this process outside PyTorch (CUDA context, NCCL, libraries)", max(0, this - held)))
    if other_total:
        parts.append(("other processes", other_total))
    parts.append(("free", free))
    rest = total - sum(b for _, b in parts)
    note = ""
    if rest > _ROUNDING * total:
        if this is not None:
            # NVML's list holds compute processes only (nvmlDeviceGetComputeRunningProcesses in
            # reportProcessMemoryInfo): a desktop's graphics processes and the driver's share are not in it.
            parts.append(("not listed (graphics processes, the driver)", rest))
        else:  # torch <= 2.0, ROCm and cudaMallocAsync messages carry no per-process numbers
            pool = m.allocator == "cudaMallocAsync"
            parts.append(("outside PyTorch's tensors" if pool else "outside PyTorch's allocator", rest))
            note = (" The message does not say whose the last part is: the CUDA context, other libraries, "
                    "other processes" + (" or the pool's cache." if pool else "."))
    shown = ", ".join(f"{name} {format_bytes(b)}" for name, b in parts)
    return f"Where the GPU's {format_bytes(total)} went: {shown}.{note}"


def _compare_estimate(m: OomMessage, est: Estimate, findings: list[str], causes: list[OomCause]) -> None:
    fmt = format_bytes
    # What PyTorch could have held when it failed: its reserve plus what was free (cudaMallocAsync: allocated
    # plus free, its cache unknown), no more than the cap.
    held = m.reserved_by_pytorch_bytes
    if held is None:
        held = m.allocated_by_pytorch_bytes
    avail = held + m.free_bytes if held is not None and m.free_bytes is not None else None
    if m.memory_cap_bytes is not None:
        avail = m.memory_cap_bytes if avail is None else min(avail, m.memory_cap_bytes)
    needs = (f"This step needs ~{fmt(est.fits_in_bytes)} for PyTorch's allocator ({fmt(est.device_bytes)} of "
             f"device memory with the CUDA context) by memfit's estimate of {est.workload} (batch "
             f"{est.batch_size}, {est.precision}, for {est.gpu})")
    if avail is None:
        findings.append(f"{needs}; the message does not say how much the GPU had for PyTorch.")
    elif est.fits_in_bytes > avail:
        causes.insert(0, "estimate_exceeds_gpu")
        findings.insert(1, f"{needs}; the GPU had {fmt(avail)} for PyTorch, "
                           f"{fmt(est.fits_in_bytes - avail)} short: the workload itself does not fit here.")
    else:
        causes.append("estimate_fits")
        findings.append(
            f"{needs}; the GPU had {fmt(avail)} for PyTorch, {fmt(avail - est.fits_in_bytes)} more. The "
            "workload as estimated fits, so look at the findings above or at what differs in the run (longer "
            "inputs, a larger batch, tensors kept across steps)."
        )
    if m.total_capacity_bytes is not None and est.device_bytes > m.total_capacity_bytes:
        findings.append(f"Even empty, this {fmt(m.total_capacity_bytes)} GPU is smaller than the "
                        f"{fmt(est.device_bytes)} the step needs.")
    alloc, req = m.allocated_by_pytorch_bytes, m.tried_to_allocate_bytes
    if alloc is not None and req is not None:
        more = alloc + req > (1 + _ROUNDING) * est.peak_allocated_bytes
        findings.append(
            f"At the failure PyTorch had {fmt(alloc)} allocated and asked for {fmt(req)} more; the estimated "
            f"peak is {fmt(est.peak_allocated_bytes)}"
            + (", so the run holds more than the estimate models." if more else ".")
        )
    categories = {k: v for k, v in est.breakdown.items() if k != "fragmentation" and v > 0}
    if categories and est.peak_allocated_bytes > 0:
        top = max(categories, key=categories.__getitem__)
        share = categories[top] / est.peak_allocated_bytes
        findings.append(
            f"At the estimated peak ({est.peak_phase}, {est.peak_op} in {est.peak_module or 'the model'}) "
            f"the largest part is {top}: {fmt(categories[top])}, {share:.0%} of the allocated memory."
        )


def _pct(share: float) -> str:
    return f"{share:.0%}" if share >= 0.01 or share == 0 else "<1%"
