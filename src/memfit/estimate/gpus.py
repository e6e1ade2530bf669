"""What memfit knows about each GPU model: capacity, CUDA context, library workspaces, speed.

Numbers marked "measured" come from a device run committed under benchmarks/results/; the others cite a
datasheet or PyTorch source.
"""

from __future__ import annotations

import os
import re
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
    cublas_context_bytes: int = 0
    """The part of ``cuda_context_bytes`` that only a step calling cuBLAS pays (its handles and kernels)."""
    cublas_workspace_bytes: int
    """cuBLAS workspace per (handle, stream); CublasHandlePool.cpp: 4096*8*1024 on sm90+, 8.125 MiB before."""
    sm_count: int = 132
    """Streaming multiprocessors: CUDA's reductions size their staging buffers by it."""
    bf16_tflops: float = 0.0
    """Dense bf16 tensor-core peak in TFLOPS (datasheet), for the speed model (memfit.speed.step_time)."""
    fp16_tflops: float = 0.0
    """Dense fp16 tensor-core peak with fp32 accumulation, TFLOPS (datasheet)."""
    tf32_tflops: float = 0.0
    """Dense TF32 tensor-core peak, TFLOPS (datasheet): fp32 convolutions (cuDNN allows TF32 by default) and fp32
    matmuls where ``torch.backends.cuda.matmul.allow_tf32`` is set."""
    fp32_tflops: float = 0.0
    """Non-tensor-core fp32 peak, TFLOPS (datasheet): fp32 matmuls under PyTorch's default (TF32 off)."""
    memory_bandwidth_gbs: float = 0.0
    """HBM bandwidth in GB/s (datasheet)."""
    host_link_gbs: float = 0.0
    """Host link (PCIe) bandwidth per direction in GB/s (datasheet): what an offloaded optimizer's copies take."""

    def context_bytes(self, uses_cublas: bool) -> int:
        """Device memory outside the allocator for a step that does (or does not) call cuBLAS."""
        return self.cuda_context_bytes - (0 if uses_cublas else self.cublas_context_bytes)


# cuBLAS workspace sizes: aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize():
# ":4096:2:16:8" = 2*4 MiB + 8*16 KiB = 8.125 MiB by default; 4096*8 KiB = 32 MiB on compute capability 9.x+.
_CUBLAS_SM90 = 32 * MiB
_CUBLAS_PRE_SM90 = 8 * MiB + 128 * 1024


def cublas_workspace_bytes(gpu: GpuSpec) -> int:
    """One cuBLAS workspace on ``gpu`` under this process's ``CUBLAS_WORKSPACE_CONFIG``, as PyTorch sizes it
    (CublasHandlePool.cpp, parseChosenWorkspaceSize: the sum of SIZE KiB x COUNT over its ``:SIZE:COUNT`` pairs;
    the card's default where it is unset or has no such pair). Deterministic training sets it (Lightning's
    ``deterministic=True``, HF's ``enable_full_determinism``; importing MONAI sets ``:4096:8`` where it is unset):
    ``:4096:8`` is the default on compute capability 9.x and 32 MiB, not 8.125, on the cards before it."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if not pairs:
        return gpu.cublas_workspace_bytes
    return sum(int(size) * 1024 * int(count) for size, count in pairs)

GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="NVIDIA H100 80GB HBM3",
        # what OOM messages on H100 80GB report ("total capacity of 79.11 GiB"); not measured here
        total_bytes=int(79.11 * GiB),
        compute_capability=(9, 0),
        cuda_context_bytes=768 * MiB,  # assumed equal to the H200's (measured); not measured on an H100
        cublas_context_bytes=128 * MiB,  # as the H200's
        cublas_workspace_bytes=_CUBLAS_SM90,
        # NVIDIA H100 Tensor Core GPU datasheet, SXM column; the datasheet's tensor-core figures are "with
        # sparsity", dense is half: BF16/FP16 1979 -> 989.5, TF32 989 -> 494.5; FP32 67; HBM3 3.35 TB/s
        bf16_tflops=989.5,
        fp16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67.0,
        memory_bandwidth_gbs=3350.0,
        # datasheet: PCIe Gen5 128 GB/s (both directions together)
        host_link_gbs=64.0,
    ),
    "h200": GpuSpec(
        name="NVIDIA H200",
        total_bytes=150_109_880_320,  # measured: get_device_properties(0).total_memory, benchmarks/results/estimate
        compute_capability=(9, 0),
        # measured: device used - reserved after the protocol, 639-641 MiB for convolution-only nets (no cuBLAS)
        # and 767-771 MiB for most steps that call cuBLAS (the MLP 751, Swin-UNETR 705), torch 2.11 + CUDA 13.0;
        # benchmarks/results/estimate/measurements_h200_torch2.11_20261126/*.json, outside_allocator_bytes
        cuda_context_bytes=768 * MiB,
        cublas_context_bytes=128 * MiB,
        cublas_workspace_bytes=_CUBLAS_SM90,
        # NVIDIA H200 Tensor Core GPU datasheet, SXM column: the H100's compute (sparse figures halved, as
        # above) with 4.8 TB/s HBM3e
        bf16_tflops=989.5,
        fp16_tflops=989.5,
        tf32_tflops=494.5,
        fp32_tflops=67.0,
        memory_bandwidth_gbs=4800.0,
        # datasheet: PCIe Gen5 128 GB/s (both directions together)
        host_link_gbs=64.0,
    ),
    "a100": GpuSpec(
        name="NVIDIA A100-SXM4-80GB",
        total_bytes=80 * GiB,
        compute_capability=(8, 0),
        sm_count=108,
        cuda_context_bytes=640 * MiB,  # assumed from the H200 measurement; not measured on this GPU
        cublas_workspace_bytes=_CUBLAS_PRE_SM90,
        # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: BF16/FP16 312, TF32 156 (dense), FP32 19.5,
        # HBM2e 2039 GB/s
        bf16_tflops=312.0,
        fp16_tflops=312.0,
        tf32_tflops=156.0,
        fp32_tflops=19.5,
        memory_bandwidth_gbs=2039.0,
        # datasheet: PCIe Gen4 64 GB/s (both directions together)
        host_link_gbs=32.0,
    ),
    "rtx4090": GpuSpec(
        name="NVIDIA GeForce RTX 4090",
        total_bytes=24 * GiB,
        compute_capability=(8, 9),
        sm_count=128,
        cuda_context_bytes=640 * MiB,  # assumed from the H200 measurement; not measured on this GPU
        cublas_workspace_bytes=_CUBLAS_PRE_SM90,
        # NVIDIA Ada Lovelace GPU Architecture whitepaper (v2.1), appendix table for the RTX 4090, dense: FP16/BF16
        # tensor with FP32 accumulate 165.2, TF32 tensor 82.6, FP32 82.6; GDDR6X 1008 GB/s
        bf16_tflops=165.2,
        fp16_tflops=165.2,
        tf32_tflops=82.6,
        fp32_tflops=82.6,
        memory_bandwidth_gbs=1008.0,
        # PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding, about 31.5 GB/s each way
        host_link_gbs=31.5,
    ),
}
DEFAULT_GPU = "h100"


def gpu_spec(name: str | None = None) -> GpuSpec:
    """The spec for ``name`` (``h100``, ``h200``, ``a100``, ``rtx4090``); default H100."""
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise UsageError(f"name a GPU: one of {', '.join(GPUS)}, got {name!r}.")
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
        cublas_context_bytes=base.cublas_context_bytes,
        cublas_workspace_bytes=_CUBLAS_SM90 if cap >= (9, 0) else _CUBLAS_PRE_SM90,
        sm_count=props.multi_processor_count,
        bf16_tflops=base.bf16_tflops,
        fp16_tflops=base.fp16_tflops,
        tf32_tflops=base.tf32_tflops,
        fp32_tflops=base.fp32_tflops,
        memory_bandwidth_gbs=base.memory_bandwidth_gbs,
        host_link_gbs=base.host_link_gbs,
    )
