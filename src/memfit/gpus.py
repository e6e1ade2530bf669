"""What memfit knows about each GPU model: capacity, CUDA context, library workspaces, speed.

Numbers marked "measured" come from a device run committed under benchmarks/results/; the others cite a
datasheet or PyTorch source.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import UsageError
from memfit.units import GiB, MiB


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU model, as the estimator needs it."""

    name: str
    """Marketing name, as ``torch.cuda.get_device_name`` reports it."""
    total_bytes: int
    """``torch.cuda.get_device_properties(0).total_memory``: what ``set_per_process_memory_fraction`` scales."""
    compute_capability: tuple[int, int]
    cuda_context_bytes: int
    """Device memory outside the caching allocator once CUDA, cuBLAS and cuDNN are initialised."""
    cublas_workspace_bytes: int
    """cuBLAS workspace per (handle, stream); CublasHandlePool.cpp: 4096*8*1024 on sm90+, 8.125 MiB before."""
    sm_count: int = 132
    """Streaming multiprocessors: CUDA's reductions size their staging buffers by it."""
    bf16_tflops: float = 0.0
    """Dense bf16 tensor-core peak (datasheet), for the speed model."""
    memory_bandwidth_gbs: float = 0.0
    """HBM bandwidth in GB/s (datasheet)."""


# cuBLAS workspace sizes: aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize():
# ":4096:2:16:8" = 2*4 MiB + 8*16 KiB = 8.125 MiB by default; 4096*8 KiB = 32 MiB on compute capability 9.x+.
_CUBLAS_SM90 = 32 * MiB
_CUBLAS_PRE_SM90 = 8 * MiB + 128 * 1024

GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="NVIDIA H100 80GB HBM3",
        # what OOM messages on H100 80GB report ("total capacity of 79.11 GiB"); not measured here
        total_bytes=int(79.11 * GiB),
        compute_capability=(9, 0),
        cuda_context_bytes=768 * MiB,  # assumed equal to the H200's (measured); not measured on an H100
        cublas_workspace_bytes=_CUBLAS_SM90,
        bf16_tflops=989.0,  # H100 SXM datasheet, dense
        memory_bandwidth_gbs=3350.0,
    ),
    "h200": GpuSpec(
        name="NVIDIA H200",
        total_bytes=150_109_880_320,  # measured: get_device_properties(0).total_memory, benchmarks/results
        compute_capability=(9, 0),
        # measured: device used - reserved after the protocol, 641 MiB (no cuBLAS) to 771 MiB (with it),
        # torch 2.11 + CUDA 13.0; benchmarks/results/measurements/*.json, outside_allocator_bytes
        cuda_context_bytes=768 * MiB,
        cublas_workspace_bytes=_CUBLAS_SM90,
        bf16_tflops=989.0,  # H200 SXM datasheet, dense
        memory_bandwidth_gbs=4800.0,
    ),
    "a100": GpuSpec(
        name="NVIDIA A100-SXM4-80GB",
        total_bytes=80 * GiB,
        compute_capability=(8, 0),
        sm_count=108,
        cuda_context_bytes=640 * MiB,  # assumed from the H200 measurement; not measured on this GPU
        cublas_workspace_bytes=_CUBLAS_PRE_SM90,
        bf16_tflops=312.0,
        memory_bandwidth_gbs=2039.0,
    ),
    "rtx4090": GpuSpec(
        name="NVIDIA GeForce RTX 4090",
        total_bytes=24 * GiB,
        compute_capability=(8, 9),
        sm_count=128,
        cuda_context_bytes=640 * MiB,  # assumed from the H200 measurement; not measured on this GPU
        cublas_workspace_bytes=_CUBLAS_PRE_SM90,
        bf16_tflops=165.0,
        memory_bandwidth_gbs=1008.0,
    ),
}
DEFAULT_GPU = "h100"


def gpu_spec(name: str | None = None) -> GpuSpec:
    """The spec for ``name`` (``h100``, ``h200``, ``a100``, ``rtx4090``); default H100."""
    key = (name or DEFAULT_GPU).lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise UsageError(f"unknown GPU {name!r}: choose one of {', '.join(GPUS)}.")
    return GPUS[key]


def detect_gpu() -> GpuSpec | None:
    """The spec of the current CUDA device, from its properties, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    base = next((g for g in GPUS.values() if g.name.split()[1] in props.name), GPUS[DEFAULT_GPU])
    cap = (props.major, props.minor)
    return GpuSpec(
        name=props.name,
        total_bytes=props.total_memory,
        compute_capability=cap,
        cuda_context_bytes=base.cuda_context_bytes,
        cublas_workspace_bytes=_CUBLAS_SM90 if cap >= (9, 0) else _CUBLAS_PRE_SM90,
        sm_count=props.multi_processor_count,
        bf16_tflops=base.bf16_tflops,
        memory_bandwidth_gbs=base.memory_bandwidth_gbs,
    )
