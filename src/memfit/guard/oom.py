"""Recognise a device out-of-memory error, and nothing else.

Detection only: telling *whether* an exception is an OOM. Reading the numbers out of the message (tried to
allocate, free, reserved) belongs to ``memfit explain``, which parses; keep the two apart so a change in
torch's wording can break parsing without breaking recovery.

Order of evidence, strongest first:

1. The type: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is an alias since torch 2.4), raised
   by the caching allocator.
2. ``torch.AcceleratorError`` with ``error_code == 2`` (``cudaErrorMemoryAllocation`` / ``hipErrorOutOfMemory``):
   a failed ``cudaMalloc`` outside the caching allocator (a kernel launch, a library's own allocation).
3. The message of a ``RuntimeError``, for paths that raise a plain ``RuntimeError``: ``C10_CUDA_CHECK`` before
   torch 2.8, ``cudaMallocAsync`` ("would exceed allowed memory. (out of memory)"), cuBLAS and cuDNN handles that
   failed to allocate their workspace.

Every exception in the ``__cause__``/``__context__`` chain is examined, because wrappers (DataLoader workers,
``torch.compile``, user code) often re-raise. A memfit error in the chain stops the walk: a
``StepOOMError`` or ``OptimizerStepOOMError`` is a decision already taken, not an OOM to recover from again.
"""

from __future__ import annotations

import re

import torch

from memfit.errors import MemfitError

__all__ = ["OOM_MESSAGE_PATTERNS", "is_oom"]

# cudaErrorMemoryAllocation in cuda_runtime_api.h; hipErrorOutOfMemory has the same value in hip_runtime_api.h.
_CUDA_ERROR_MEMORY_ALLOCATION = 2

# Each pattern is specific to an allocation failure, so a message merely *mentioning* memory ("index out of
# range", "illegal memory access", "device-side assert") never matches.
OOM_MESSAGE_PATTERNS: tuple[re.Pattern[str], ...] = (
    # caching allocator, every torch version: "CUDA out of memory. Tried to allocate ..."; also HIP, XPU.
    re.compile(r"\b(CUDA|HIP|XPU) out of memory"),
    # MPS allocator: "MPS backend out of memory (MPS allocated: ...)"
    re.compile(r"\bMPS backend out of memory"),
    # C10_CUDA_CHECK: "CUDA error: out of memory"; driver API: "CUDA driver error: out of memory"
    re.compile(r"\b(CUDA|HIP)( driver)? error: out of memory"),
    # backend:cudaMallocAsync: "Allocation on device 0 would exceed allowed memory. (out of memory)"
    re.compile(r"would exceed allowed memory\. \(out of memory\)"),
    # cuBLAS handle or workspace allocation: "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"
    re.compile(r"\bCUBLAS_STATUS_ALLOC_FAILED\b"),
    # cuDNN: "cuDNN error: CUDNN_STATUS_ALLOC_FAILED" and "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE" (the
    # workspace could not be allocated). CUDNN_STATUS_NOT_SUPPORTED, which Composer treats as an OOM, is not
    # matched: it also means a genuinely unsupported input, and retrying would hide that.
    re.compile(r"\bCUDNN_STATUS_(ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)\b"),
)


def is_oom(exc: BaseException, *, extra_patterns: tuple[str, ...] = ()) -> bool:
    """Tell whether an exception, or one it was raised from, is a device out-of-memory error.

    Args:
        exc: The exception caught.
        extra_patterns: Regular expressions that also mean "out of memory" for a backend memfit does not know.

    Returns:
        ``True`` when ``exc`` or an exception in its ``__cause__``/``__context__`` chain is an OOM.

    Example:
        >>> import torch
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
        False
    """
    extra = tuple(re.compile(p) for p in extra_patterns)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemfitError):
            return False
        if _is_oom_one(current, extra):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_oom_one(exc: BaseException, extra: tuple[re.Pattern[str], ...]) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        if getattr(exc, "error_code", None) == _CUDA_ERROR_MEMORY_ALLOCATION:
            return True
    # Torch raises allocation failures as RuntimeError; a ValueError that quotes an OOM message is not one.
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return any(p.search(message) for p in OOM_MESSAGE_PATTERNS + extra)
