"""OOM detection: every known out-of-memory text is recognised, nothing else is."""

from __future__ import annotations

import pytest
import torch

from memfit.errors import OptimizerStepOOMError, StepOOMError
from memfit.guard.oom import is_oom

OOM_MESSAGES = [
    # caching allocator, torch 2.0-2.1
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 75.02 GiB already "
    "allocated; 1.06 GiB free; 76.50 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory "
    "try setting max_split_size_mb to avoid fragmentation.",
    # caching allocator, torch 2.2+ (with a memory fraction set, and CUDA graph pools)
    "CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which 3.06 GiB "
    "is free. Including non-PyTorch memory, this process has 76.12 GiB memory in use. 39.60 GiB allowed; Of the "
    "allocated memory 38.5 GiB is allocated by PyTorch, with 1.2 GiB allocated in private pools (e.g., CUDA "
    "Graphs), and 560.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
    # C10_CUDA_CHECK (plain RuntimeError before torch 2.8)
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so "
    "the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "CUDA driver error: out of memory",
    # backend:cudaMallocAsync
    "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 77.50 GiB\n"
    "Requested               : 2.00 GiB\nDevice limit            : 79.19 GiB\nFree (according to CUDA): 1.1 GiB",
    # cuBLAS / cuDNN allocation failures
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    # other accelerators through the same allocator text
    "HIP out of memory. Tried to allocate 20.00 MiB (GPU 0; 63.98 GiB total capacity)",
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB, max allowed: 18.13 GB).",
]

NOT_OOM_MESSAGES = [
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
    "NCCL error in: ProcessGroupNCCL.cpp:1191, unhandled system error",
    "index 12 is out of bounds for dimension 0 with size 10",
    "selected index k out of range",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`",
    "Expected all tensors to be on the same device",
    "out of memory",  # bare, e.g. a user's own message: not specific enough to retry on
]


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_oom_messages_are_recognised_on_plain_runtime_errors(message: str) -> None:
    assert is_oom(RuntimeError(message))


@pytest.mark.parametrize("message", NOT_OOM_MESSAGES)
def test_other_errors_are_not_oom(message: str) -> None:
    assert not is_oom(RuntimeError(message))


def test_type_wins_whatever_the_message() -> None:
    assert is_oom(torch.OutOfMemoryError("something torch will word differently one day"))
    assert is_oom(torch.cuda.OutOfMemoryError("alias"))


def test_a_value_error_quoting_an_oom_is_not_an_oom() -> None:
    assert not is_oom(ValueError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(MemoryError())  # host memory: a smaller micro-batch is not the fix


def test_chained_exceptions_are_walked() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError as inner:
            raise KeyError("wrapped by a data loader") from inner
    except KeyError as outer:
        assert is_oom(outer)
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError:
            raise ValueError("raised while handling")  # noqa: B904 - implicit __context__ on purpose
    except ValueError as outer:
        assert is_oom(outer)


def test_chain_with_a_cycle_terminates() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert not is_oom(a)


def test_memfit_decisions_stop_the_walk() -> None:
    err = StepOOMError("out of memory at micro-batch 1")
    err.__cause__ = torch.OutOfMemoryError("CUDA out of memory.")
    assert not is_oom(err)
    assert not is_oom(OptimizerStepOOMError("CUDA out of memory inside optimizer.step()"))


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="torch.AcceleratorError needs torch >= 2.8")
def test_accelerator_error_code_2_is_oom() -> None:
    class FakeAcceleratorError(torch.AcceleratorError):  # type: ignore[misc, name-defined]
        def __init__(self, code: int) -> None:
            RuntimeError.__init__(self, "CUDA error: some text")
            self._code = code

        @property
        def error_code(self) -> int:  # type: ignore[override]
            return self._code

    assert is_oom(FakeAcceleratorError(2))
    assert not is_oom(FakeAcceleratorError(700))  # cudaErrorIllegalAddress


def test_extra_patterns_extend_detection() -> None:
    assert not is_oom(RuntimeError("FooAccel: pool exhausted"))
    assert is_oom(RuntimeError("FooAccel: pool exhausted"), extra_patterns=(r"pool exhausted",))
