"""Reading and explaining CUDA out-of-memory messages: every format from a real message, logs, bad input.

Each message below is quoted as its source printed it (a GitHub issue, a PR description, a log in a public
repository); the comment names the source and the torch version. Sizes are checked to the byte, which is what
``format_size`` (two decimals) and ``parse_bytes`` give together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.errors import UsageError
from memfit.estimate.predict import Estimate
from memfit.explain.oom_diagnosis import diagnose_oom
from memfit.explain.oom_message import OomMessage, load_oom_text, parse_oom_message
from memfit.units import GiB, KiB, MiB


def b(value: float, unit: int) -> int:
    """Bytes of a printed size, as ``parse_bytes`` rounds it."""
    return int(round(value * unit))


# torch 1.4-1.x, pytorch#32101 (2020): the parenthesised format, "reserved in total by PyTorch".
TORCH_1X = (
    "RuntimeError: CUDA out of memory. Tried to allocate 152.00 MiB (GPU 0; 31.72 GiB total capacity; 24.89 "
    "GiB already allocated; 6.12 MiB free; 30.70 GiB reserved in total by PyTorch)"
)
# torch 1.0, PR #13751 description (2018): "cached" instead of "reserved".
TORCH_1_0_CACHED = (
    "RuntimeError: CUDA out of memory. Tried to allocate 16.00 GiB (GPU 0; 11.93 GiB total capacity; 4.00 "
    "GiB already allocated; 7.33 GiB free; 179.00 KiB cached)"
)
# torch 1.8-2.0 with set_per_process_memory_fraction(0.5), quoted in a public tutorial repository.
TORCH_1X_ALLOWED = (
    "RuntimeError: CUDA out of memory. Tried to allocate 5.59 GiB (GPU 0; 11.17 GiB total capacity; 0 bytes "
    "already allocated; 10.91 GiB free; 5.59 GiB allowed; 0 bytes reserved in total by PyTorch)"
)
# torch 1.10-2.0 with the max_split_size_mb sentence (libtorch under R torch 0.13), mlverse/torch#1222.
TORCH_2_0 = (
    "CUDA out of memory. Tried to allocate 2.93 GiB (GPU 0; 23.80 GiB total capacity; 12.04 GiB already "
    "allocated; 2.82 GiB free; 19.69 GiB reserved in total by Pytorch) If reserved memory is >> allocated "
    "memory try setting max_split_size_mb to avoid fragmentation. See documentation for Memory Management "
    "and PYTORCH_CUDA_ALLOC_CONF"
)
# torch 2.1, PR #99699 description (2023-04), wrapped as the PR shows it: "capacty", NVML processes.
TORCH_2_1_WRAPPED = """torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.
GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.
Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,
this process has 15.32 GiB memory in use. Of the allocated memory
14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved
by PyTorch but unallocated. If reserved but unallocated memory is large
try setting max_split_size_mb to avoid fragmentation.  See documentation
 for Memory Management and PYTORCH_CUDA_ALLOC_CONF"""
# torch 2.1, a sweep log in a public repository: two processes listed, this one not by name (a container).
TORCH_2_1_TWO_PROCESSES = (
    "[sweep] M432_sk3 FAILED: CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacty of "
    "23.52 GiB of which 212.69 MiB is free. Process 224599 has 21.48 GiB memory in use. Process 277412 has "
    "1.75 GiB memory in use. Of the allocated memory 1.15 GiB is allocated by PyTorch, and 143.83 MiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and "
    "PYTORCH_CUDA_ALLOC_CONF"
)
# torch 2.1 on Windows, a public notebook log: NVML_VALUE_NOT_AVAILABLE printed as format_size(UINT64_MAX).
TORCH_2_1_NVML_NA = (
    "CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacty of 23.99 GiB of which 6.72 "
    "GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB memory in use. Of the "
    "allocated memory 14.85 GiB is allocated by PyTorch, and 825.34 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
# torch >= 2.2, a public README (Qwen2-VL generate): expandable_segments hint, pytorch.org link.
TORCH_2_2 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of "
    "23.68 GiB of which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory "
    "in use. Of the allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch >= 2.2 in a container (vLLM issue, Llama-4 Scout on 2xH100 NVL, 2025-04): this process appears only
# as "Process <host pid>"; the issue cut the link short.
TORCH_2_2_CONTAINER = (
    "(VllmWorker rank=1 pid=254) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU "
    "1 has a total capacity of 93.02 GiB of which 1.18 GiB is free. Process 2752205 has 91.82 GiB memory in "
    "use. Of the allocated memory 90.63 GiB is allocated by PyTorch, and 120.54 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. See documentation for Memory "
    "Management (https://pytorch.org/docs/stable/notes/cuda.html#enviro"
)
# torch >= 2.2 with a memory fraction and another process, quoted in a public test file.
TORCH_2_2_ALLOWED = (
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 996.00 MiB. GPU 0 has a total capacity of 44.43 "
    "GiB of which 9.06 GiB is free. Process 2102129 has 17.54 GiB memory in use. Including non-PyTorch "
    "memory, this process has 17.81 GiB memory in use. 17.69 GiB allowed; Of the allocated memory 17.44 GiB "
    "is allocated by PyTorch, and 59.88 MiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation. See documentation for Memory Management "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch main (2025-26, docs.pytorch.org link), a training log from 2026: cap, NVML n/a, heavy fragmentation.
TORCH_MAIN = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.98 GiB. GPU 0 has a total capacity of "
    "31.84 GiB of which 16.30 GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB "
    "memory in use. 17.51 GiB allowed; Of the allocated memory 6.74 GiB is allocated by PyTorch, and 7.02 "
    "GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-"
    "pytorch-cuda-alloc-conf)"
)
# ROCm, PyTorch's own CI log of test_cuda.py: memory fraction and CUDA-graph ("HIP Graphs") private pools.
ROCM_PRIVATE_POOLS = (
    "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 76.00 MiB. GPU 0 has a total capacity of "
    "255.69 GiB of which 252.82 GiB is free. 1.20 GiB allowed; Of the allocated memory 1.14 GiB is allocated "
    "by PyTorch, with 17.00 MiB allocated in private pools (e.g., HIP Graphs), and 18.63 MiB is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# ROCm, a public agent transcript: nothing allocated by PyTorch, "0 bytes", PYTORCH_HIP_ALLOC_CONF.
ROCM_ZERO = (
    "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 978.00 MiB. GPU 0 has a total capacity of "
    "15.98 GiB of which 630.00 MiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 "
    "bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# torch 2.3.0, pytorch#126766: GPU 0's index printed as a NUL char cut the message (fixed by PR #128540).
TORCH_2_3_TRUNCATED = "OutOfMemoryError: CUDA out of memory. Tried to allocate 3725.29 GiB. GPU"
# torchrun log, a public repository: "[rank1]: " prefix and the index printed as an unprintable char.
TORCHRUN_NO_INDEX = (
    "[rank1]: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 274.00 MiB. GPU  has a "
    "total capacity of 4.93 GiB of which 137.69 MiB is free. Including non-PyTorch memory, this process has "
    "4.30 GiB memory in use. Of the allocated memory 4.14 GiB is allocated by PyTorch, and 35.88 MiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://p"
)
# backend:cudaMallocAsync, a ComfyUI failure report (whitespace collapsed by the report, no limit line).
ASYNC_REPORT = """torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)
Currently allocated : 9.43 GiB
Requested           : 640.00 MiB
Device limit        : 11.59 GiB
Free (according to CUDA): 7.12 MiB"""
# backend:cudaMallocAsync as mallocAsync (c10/cuda/CUDAMallocAsyncAllocator.cpp) builds it (not a capture:
# no public log with the limit line was found), with set_per_process_memory_fraction(0.5) on an 80 GiB card.
ASYNC_WITH_LIMIT = """Allocation on device 1 would exceed allowed memory. (out of memory)
Currently allocated     : 39.50 GiB
Requested               : 2.00 GiB
Device limit            : 79.19 GiB
Free (according to CUDA): 38.12 GiB
PyTorch limit (set by user-supplied memory fraction)
                        : 39.59 GiB"""
# C10_CUDA_CHECK outside the allocator, a public training log; suffix lines from c10/cuda/CUDAException.cpp.
RUNTIME = (
    "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
    "other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1."
)
# cuBLAS handle creation, GPTQModel issue (2025-10) and huggingface/transformers#3495.
CUBLAS = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
# both allocators' allocate(): requests of 2^60 bytes and more (seen from a desynchronised all_gather_object).
OVER_1EB = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory."


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        (TORCH_1X, dict(torch_format="torch<=2.0", tried_to_allocate_bytes=152 * MiB, gpu_index=0,
                        total_capacity_bytes=b(31.72, GiB), allocated_by_pytorch_bytes=b(24.89, GiB),
                        free_bytes=b(6.12, MiB), reserved_by_pytorch_bytes=b(30.70, GiB),
                        reserved_unallocated_bytes=b(30.70, GiB) - b(24.89, GiB), allocator="native")),
        (TORCH_1_0_CACHED, dict(torch_format="torch<=2.0", tried_to_allocate_bytes=16 * GiB,
                                allocated_by_pytorch_bytes=4 * GiB, reserved_unallocated_bytes=179 * KiB,
                                reserved_by_pytorch_bytes=4 * GiB + 179 * KiB)),
        (TORCH_1X_ALLOWED, dict(memory_cap_bytes=b(5.59, GiB), allocated_by_pytorch_bytes=0,
                                reserved_by_pytorch_bytes=0, reserved_unallocated_bytes=0)),
        (TORCH_2_0, dict(torch_format="torch<=2.0", reserved_by_pytorch_bytes=b(19.69, GiB),
                         expandable_segments_hint=False)),
        (TORCH_2_1_WRAPPED, dict(torch_format="torch 2.1", tried_to_allocate_bytes=138 * MiB, gpu_index=0,
                                 total_capacity_bytes=b(15.90, GiB), free_bytes=b(8.44, MiB),
                                 other_processes=((1246069, 577 * MiB),), this_process_bytes=b(15.32, GiB),
                                 allocated_by_pytorch_bytes=b(14.12, GiB),
                                 reserved_unallocated_bytes=b(410.41, MiB),
                                 reserved_by_pytorch_bytes=b(14.12, GiB) + b(410.41, MiB),
                                 expandable_segments_hint=False)),
        (TORCH_2_1_TWO_PROCESSES, dict(torch_format="torch 2.1", this_process_bytes=None,
                                       other_processes=((224599, b(21.48, GiB)), (277412, b(1.75, GiB))))),
        (TORCH_2_1_NVML_NA, dict(this_process_bytes=None, allocated_by_pytorch_bytes=b(14.85, GiB))),
        (TORCH_2_2, dict(torch_format="torch>=2.2", tried_to_allocate_bytes=b(19.68, GiB),
                         this_process_bytes=b(11.79, GiB), other_processes=(), memory_cap_bytes=None,
                         expandable_segments_hint=True)),
        (TORCH_2_2_CONTAINER, dict(gpu_index=1, this_process_bytes=None,
                                   other_processes=((2752205, b(91.82, GiB)),))),
        (TORCH_2_2_ALLOWED, dict(memory_cap_bytes=b(17.69, GiB), this_process_bytes=b(17.81, GiB),
                                 other_processes=((2102129, b(17.54, GiB)),))),
        (TORCH_MAIN, dict(torch_format="torch>=2.2", this_process_bytes=None, memory_cap_bytes=b(17.51, GiB),
                          reserved_by_pytorch_bytes=b(6.74, GiB) + b(7.02, GiB))),
        (ROCM_PRIVATE_POOLS, dict(torch_format="torch>=2.2 (ROCm)", private_pools_bytes=17 * MiB,
                                  memory_cap_bytes=b(1.20, GiB), allocated_by_pytorch_bytes=b(1.14, GiB),
                                  reserved_unallocated_bytes=b(18.63, MiB))),
        (ROCM_ZERO, dict(torch_format="torch>=2.2 (ROCm)", allocated_by_pytorch_bytes=0,
                         reserved_by_pytorch_bytes=0, expandable_segments_hint=True)),
        (TORCH_2_3_TRUNCATED, dict(torch_format="torch>=2.1 (truncated)",
                                   tried_to_allocate_bytes=b(3725.29, GiB),
                                   gpu_index=None, total_capacity_bytes=None, allocator="native")),
        (TORCHRUN_NO_INDEX, dict(gpu_index=None, total_capacity_bytes=b(4.93, GiB),
                                 this_process_bytes=b(4.30, GiB))),
        (ASYNC_REPORT, dict(torch_format="cudaMallocAsync", allocator="cudaMallocAsync", gpu_index=0,
                            allocated_by_pytorch_bytes=b(9.43, GiB), tried_to_allocate_bytes=640 * MiB,
                            total_capacity_bytes=b(11.59, GiB), free_bytes=b(7.12, MiB),
                            memory_cap_bytes=None,
                            reserved_by_pytorch_bytes=None)),
        (ASYNC_WITH_LIMIT, dict(gpu_index=1, memory_cap_bytes=b(39.59, GiB), free_bytes=b(38.12, GiB))),
        (RUNTIME, dict(torch_format="CUDA runtime error", allocator=None, tried_to_allocate_bytes=None)),
        (CUBLAS, dict(torch_format="cuBLAS/cuDNN workspace", allocator=None)),
        ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", dict(torch_format="cuBLAS/cuDNN workspace")),
        (OVER_1EB, dict(torch_format="request over 1 EB", tried_to_allocate_bytes=None)),
    ],
)
def test_each_real_format_parses_exactly(text: str, fields: dict) -> None:
    message = parse_oom_message(text)
    assert {name: getattr(message, name) for name in fields} == fields
    json.dumps(message.to_dict())  # versioned and serialisable as is


def test_the_unavailable_marker_is_read_as_unknown_not_as_16_eib() -> None:
    assert parse_oom_message(TORCH_MAIN).this_process_bytes is None
    # cudaMallocAsync's default limit is UINT64_MAX
    limitless = ASYNC_WITH_LIMIT.replace("39.59 GiB", "17179869184.00 GiB")
    assert parse_oom_message(limitless).memory_cap_bytes is None


def test_an_index_printed_as_a_control_character_is_dropped() -> None:
    # torch 2.3-2.4 streamed c10::DeviceIndex as a char (PR #128540): GPU 1 came out as "\x01".
    message = parse_oom_message(TORCH_2_2.replace("GPU 0 has", "GPU \x01 has"))
    assert message.gpu_index is None and message.total_capacity_bytes == b(23.68, GiB)


def test_the_last_oom_of_a_traceback_log_is_read() -> None:
    log = (
        "\x1b[31mepoch 3\x1b[0m loss=0.42\n"
        + TORCH_1X + "\nrecovered, retrying with batch 16\n"
        + "Traceback (most recent call last):\n"
        + '  File "train.py", line 12, in <module>\n    loss.backward()\n'
        + TORCH_2_1_WRAPPED.replace("\n", "\n[rank0]: ") + "\n[rank0]: exiting\n"
    )
    message = parse_oom_message(log)
    assert message.torch_format == "torch 2.1" and message.tried_to_allocate_bytes == 138 * MiB
    assert message.raw.startswith("CUDA out of memory. Tried to allocate 138.00 MiB.")


def test_load_oom_text_returns_the_last_oom_of_a_large_file(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    filler = b"step 100 loss 1.0 \xff\xfe not utf-8\n" * 40_000  # ~1.3 MiB, undecodable bytes included
    # the last OOM straddles the scanner's 1 MiB chunk boundary
    head = filler + TORCH_1X.encode() + b"\n" + filler[: (3 << 20) - len(filler) - len(TORCH_1X) - 60]
    log.write_bytes(head + TORCH_2_2.encode() + b"\n" + filler[:5000])
    text = load_oom_text(str(log))
    assert text.startswith("CUDA out of memory. Tried to allocate 19.68 GiB")
    assert parse_oom_message(text).torch_format == "torch>=2.2"


def test_load_oom_text_finds_an_anchor_cut_by_a_chunk_boundary(tmp_path: Path) -> None:
    log = tmp_path / "cut.log"
    # "RuntimeError: CUDA error: CUBLAS_STATUS..." crosses the 1 MiB chunk boundary
    log.write_bytes(b"x" * ((1 << 20) - 10) + CUBLAS.encode())
    assert parse_oom_message(load_oom_text(str(log))).torch_format == "cuBLAS/cuDNN workspace"


def test_load_oom_text_passes_a_message_through(tmp_path: Path) -> None:
    assert load_oom_text(TORCH_2_2) == TORCH_2_2
    long_message = TORCH_2_2 + " " * 5000  # too long to be a path: still just the message
    assert load_oom_text(long_message) == long_message


@pytest.mark.parametrize("make", ["missing", "directory", "no_oom"])
def test_load_oom_text_names_the_file_it_cannot_use(tmp_path: Path, make: str) -> None:
    path = tmp_path / "run.log"
    if make == "directory":
        path = tmp_path
    elif make == "no_oom":
        path.write_text("epoch 1 done\nepoch 2 done\n")
    with pytest.raises(UsageError, match=str(path).replace("\\", "\\\\")):
        load_oom_text(str(path))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("  \n\t ", "empty"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered",
         "not a CUDA out-of-memory message: 'RuntimeError: CUDA error: an illegal memory access"),
        # pytorch#51776 (torch 1.7.1): a cuDNN size limit, not memory
        ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
         "non-contiguous input.", "not an out-of-memory error"),
        ("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB, max allowed: "
         "18.13 GB).", "format memfit does not read"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "format memfit does not read"),
    ],
)
def test_bad_input_says_what_was_wrong_and_what_to_do(text: str, says: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_oom_message(text)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


# --- diagnosis ---------------------------------------------------------------------------------------------


def test_fragmentation_is_named_with_its_share_and_the_fix_for_that_torch() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_0))
    assert d.causes == ["fragmentation"]
    assert d.findings[0] == "PyTorch asked for 2.93 GiB on GPU 0; the GPU had 2.82 GiB free of 23.80 GiB."
    assert "7.65 GiB (39% of the 19.69 GiB PyTorch reserved) is cached but unallocated" in d.findings[1]
    assert "expandable_segments needs torch >= 2.1" in d.findings[1]  # not available on this torch
    newer = diagnose_oom(parse_oom_message(TORCH_MAIN))
    assert "fragmentation" in newer.causes
    assert any("expandable_segments:True" in f and "pytorch#173049" in f for f in newer.findings)


def test_a_small_unallocated_share_is_said_not_to_be_fragmentation() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_2))
    assert "fragmentation" not in d.causes and d.causes == ["needs_more_memory"]
    assert any(f.startswith("Fragmentation is not the cause: only 43.59 MiB (<1%)") for f in d.findings)
    outside = "this process outside PyTorch (CUDA context, NCCL, libraries) 314.81 MiB"
    assert any(outside in f for f in d.findings)
    assert "31.12 GiB, 131% of the GPU" in d.findings[-2]  # the verdict, then where the memory went
    assert d.findings[-1].startswith("Where the GPU's 23.68 GiB went: live tensors 11.44 GiB")


def test_memory_nvml_does_not_list_is_named_not_guessed() -> None:
    # NVML lists compute processes only: a desktop's graphics memory shows up as the unlisted remainder
    d = diagnose_oom(parse_oom_message(TORCHRUN_NO_INDEX))
    assert "not listed (graphics processes, the driver) 507.43 MiB" in d.findings[-1]


def test_free_memory_at_least_the_request_is_pointed_out() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_1_NVML_NA))
    assert any(f.startswith("The GPU reported 6.72 GiB free, at least the request") for f in d.findings)


def test_memory_of_other_processes_is_not_yours_to_fix() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_1_WRAPPED))
    assert d.causes[0] == "other_processes"
    other = next(f for f in d.findings if f.startswith("Other processes"))
    assert "pid 1246069: 577.00 MiB" in other and "Without them the request would have fit" in other
    assert "DataLoader" in other and "nvidia-smi" in other


def test_this_process_under_its_host_pid_is_recognised() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_2_CONTAINER))
    assert any("Process 2752205" in f and "most likely this process" in f for f in d.findings)
    assert not any(f.startswith("Other processes") for f in d.findings)
    assert d.causes == ["needs_more_memory"]
    two = diagnose_oom(parse_oom_message(TORCH_2_1_TWO_PROCESSES))  # ambiguous: say so, do not pick
    assert any("224599 or 277412 may be it" in f for f in two.findings)


def test_a_per_process_cap_that_binds_while_the_gpu_had_room() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_2_ALLOWED))
    assert d.causes[0] == "memory_cap" and "other_processes" not in d.causes  # 9.06 GiB were free
    cap = next(f for f in d.findings if "per-process cap" in f)
    assert "cap of 17.69 GiB" in cap and "the cap, not the GPU, stopped it" in cap
    rocm = diagnose_oom(parse_oom_message(ROCM_PRIVATE_POOLS))
    assert "memory_cap" in rocm.causes
    assert any("17.00 MiB of the allocated memory is in private pools" in f for f in rocm.findings)
    # the request is printed equal to the cap (both 5.59 GiB): the allocator rounded it up past the cap
    assert diagnose_oom(parse_oom_message(TORCH_1X_ALLOWED)).causes == ["memory_cap"]
    limited = diagnose_oom(parse_oom_message(ASYNC_WITH_LIMIT))
    assert "memory_cap" in limited.causes
    assert any("backend:cudaMallocAsync" in f for f in limited.findings)


def test_memory_outside_pytorch_without_per_process_numbers() -> None:
    d = diagnose_oom(parse_oom_message(ROCM_ZERO))
    assert d.causes == ["memory_outside_pytorch"]
    assert any("does not say whose the last part is" in f for f in d.findings)


@pytest.mark.parametrize(
    ("text", "cause", "says"),
    [
        (OVER_1EB, "request_exceeds_gpu", "all_gather_object"),
        # a public client log (torch >= 2.2, the rest of the message cut here)
        ("CUDA out of memory. Tried to allocate 130206.04 GiB. GPU 0 has a total capacity of 23.56 GiB of "
         "which 16.57 GiB is free.", "request_exceeds_gpu", "larger than the whole GPU"),
        (CUBLAS, "outside_allocator", "CUDA_LAUNCH_BLOCKING=1"),
        (RUNTIME, "outside_allocator", "outside PyTorch's caching allocator"),
    ],
)
def test_requests_no_gpu_serves_and_failures_outside_the_allocator(text: str, cause: str, says: str) -> None:
    d = diagnose_oom(parse_oom_message(text))
    assert d.causes[0] == cause
    assert any(says in f for f in d.findings)


def test_a_truncated_message_says_only_what_it_knows() -> None:
    d = diagnose_oom(parse_oom_message(TORCH_2_3_TRUNCATED))
    assert d.causes == []
    assert d.findings == [
        "PyTorch asked for 3725.29 GiB.",
        "The message stops after the request (torch 2.3-2.4 printed GPU 0's index as a NUL character, which "
        "cut it, pytorch#126766): only the request size is known. Upgrade torch for the full message.",
    ]


def _estimate(*, fits_in: int, device: int, peak: int) -> Estimate:
    return Estimate(
        workload="gpt-small", batch_size=8, precision="bf16", gpu="NVIDIA H100 80GB HBM3",
        peak_allocated_bytes=peak,
        peak_reserved_bytes=fits_in, fits_in_bytes=fits_in, fits_in_replay_bytes=fits_in, device_bytes=device,
        breakdown={"params": 2 * GiB, "activations": peak - 3 * GiB, "optimizer_state": 1 * GiB,
                   "fragmentation": fits_in - peak},
        activations_by_module={}, peak_phase="backward", peak_step=1, peak_op="mm",
        peak_module="blocks.0.mlp",
        largest_tensors=[], timeline=[], param_count=10**9, steps=3,
        fits_in_upper_bytes=fits_in, device_upper_bytes=device,
    )


def test_an_estimate_that_does_not_fit_comes_right_after_the_headline() -> None:
    est = _estimate(fits_in=30 * GiB, device=31 * GiB, peak=29 * GiB)
    d = diagnose_oom(parse_oom_message(TORCH_2_2), est)
    assert d.causes[0] == "estimate_exceeds_gpu"
    assert d.findings[1].startswith("This step needs ~30.00 GiB for PyTorch's allocator (31.00 GiB of device")
    assert "the GPU had 23.36 GiB for PyTorch, 6.64 GiB short" in d.findings[1]  # reserved 11.48 + free 11.88
    assert any("Even empty, this 23.68 GiB GPU is smaller than the 31.00 GiB" in f for f in d.findings)
    assert any("largest part is activations: 26.00 GiB, 90%" in f and "blocks.0.mlp" in f for f in d.findings)


def test_an_estimate_that_fits_points_at_the_run() -> None:
    est = _estimate(fits_in=10 * GiB, device=11 * GiB, peak=9 * GiB)
    d = diagnose_oom(parse_oom_message(TORCH_2_1_WRAPPED), est)
    assert "estimate_fits" in d.causes
    fits = next(f for f in d.findings if f.startswith("This step needs"))
    assert "The workload as estimated fits" in fits
    assert any("so the run holds more than the estimate models" in f for f in d.findings)


def test_diagnosis_with_a_real_estimate_of_a_builtin_workload() -> None:
    from memfit.estimate.predict import estimate
    from memfit.workload.zoo import builtin_workload

    est = estimate(builtin_workload("mlp").replace(batch_size=4))
    d = diagnose_oom(parse_oom_message(TORCH_2_2_CONTAINER), est)
    assert "estimate_fits" in d.causes  # a tiny MLP on a 93 GiB GPU
    top = max((k for k in est.breakdown if k != "fragmentation"), key=est.breakdown.__getitem__)
    assert any(f"largest part is {top}" in f for f in d.findings)
    assert json.loads(json.dumps(d.to_dict()))["schema"] == 1


def test_the_parser_does_not_import_its_consumer() -> None:
    """oom_message reads text into numbers; oom_diagnosis reads numbers. The parser knows nothing of the diagnosis."""
    from memfit.explain import oom_message as om

    assert not hasattr(om, "diagnose_oom") and "diagnose_oom" not in om.__all__
    assert {"load_oom_text", "parse_oom_message"} <= set(om.__all__)


def test_findings_are_plain_sentences_for_every_format() -> None:
    for text in (TORCH_1X, TORCH_1_0_CACHED, TORCH_1X_ALLOWED, TORCH_2_1_NVML_NA, TORCHRUN_NO_INDEX,
                 ASYNC_REPORT, CUBLAS, OVER_1EB, TORCH_2_3_TRUNCATED):
        d = diagnose_oom(parse_oom_message(text))
        assert d.findings, text
        for finding in d.findings:
            assert (finding[0].isupper() or finding[0].isdigit()) and finding.endswith("."), finding
            assert ".." not in finding and "  " not in finding, finding
        assert isinstance(d.message, OomMessage)
