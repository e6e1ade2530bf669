"""DataLoader settings (``num_workers``, ``prefetch_factor``, ``pin_memory``) chosen from the host, with reasons.

Host memory of a loader, per rank (research/techniques.md §6.2, derived from the DataLoader docs):
``num_workers x prefetch_factor`` batches in flight in shared memory (``/dev/shm``), plus one pinned copy of the
batch being transferred when ``pin_memory`` is on, plus whatever each worker copies of the dataset. With several
ranks per host all of it multiplies by the ranks.

Example:
    >>> s = suggest_loader_settings(batch_bytes=64 * 2**20, cpu_count=16, host_memory_bytes=64 * 2**30,
    ...                             shm_bytes=32 * 2**30, ranks_per_host=2, cuda=True)
    >>> (s.num_workers, s.prefetch_factor, s.pin_memory)
    (7, 2, True)
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from memfit.errors import UsageError
from memfit.records import JsonRecord
from memfit.units import format_bytes

logger = logging.getLogger(__name__)

# Beyond ~8 workers per GPU the loader rarely gets faster and every worker costs RAM (nnU-Net caps its augmenter
# processes per GPU at the CPU count, default 12); 8 is a conservative cap, raise it if the GPU starves.
MAX_WORKERS_PER_RANK = 8
# Share of free host RAM the loader's in-flight batches may use; the rest is for the dataset, the model's CPU
# copies and the OS page cache that feeds the files.
HOST_MEMORY_SHARE = 0.25
DEFAULT_PREFETCH_FACTOR = 2  # torch.utils.data.DataLoader's default when num_workers > 0


@dataclass(frozen=True, kw_only=True)
class LoaderSettings(JsonRecord):
    """Suggested DataLoader arguments and why."""

    num_workers: int
    prefetch_factor: int | None
    """``None`` when ``num_workers == 0`` (the DataLoader rejects a prefetch factor without workers)."""
    pin_memory: bool
    persistent_workers: bool
    in_flight_bytes: int
    """Host bytes of batches in flight per rank: workers x prefetch x batch (+ one pinned batch)."""
    reasons: tuple[str, ...]

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader``."""
        kwargs: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
        return kwargs


def _host_facts() -> tuple[int, int, int | None]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        shm: int | None = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm = None
    return cpus, available, shm


def suggest_loader_settings(
    *,
    batch_bytes: int,
    ranks_per_host: int = 1,
    cpu_count: int | None = None,
    host_memory_bytes: int | None = None,
    shm_bytes: int | None = None,
    cuda: bool | None = None,
) -> LoaderSettings:
    """Choose loader settings for one rank from the host's cores, free RAM, ``/dev/shm`` and the batch size.

    Args:
        batch_bytes: Bytes of one collated batch on the host (inputs + targets).
        ranks_per_host: Training processes on this host (e.g. GPUs per node); they share cores and RAM.
        cpu_count: Usable cores; defaults to this process's CPU affinity.
        host_memory_bytes: Available host RAM; defaults to ``psutil.virtual_memory().available``.
        shm_bytes: Free ``/dev/shm``; detected by default (Docker's default is 64 MB, too small for most loaders).
        cuda: Whether batches go to a CUDA device (pinning helps only then); defaults to
            ``torch.cuda.is_available()``.
    """
    if batch_bytes <= 0 or ranks_per_host < 1:
        raise UsageError(f"Need batch_bytes > 0 and ranks_per_host >= 1, got {batch_bytes} and {ranks_per_host}.")
    detected_cpus, detected_ram, detected_shm = _host_facts()
    cpus = cpu_count or detected_cpus
    ram = host_memory_bytes if host_memory_bytes is not None else detected_ram
    shm = shm_bytes if shm_bytes is not None else detected_shm
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    reasons: list[str] = []

    # one core per rank stays with the training loop (it launches kernels and runs the pin thread)
    workers = max(0, min(cpus // ranks_per_host - 1, MAX_WORKERS_PER_RANK))
    reasons.append(f"{cpus} cores / {ranks_per_host} ranks, one left for the training loop, cap "
                   f"{MAX_WORKERS_PER_RANK}: {workers} workers")
    prefetch = DEFAULT_PREFETCH_FACTOR
    budget = int(ram * HOST_MEMORY_SHARE / ranks_per_host)
    pinned = batch_bytes if cuda else 0

    def in_flight(w: int, p: int) -> int:
        return w * p * batch_bytes + pinned

    while workers > 0 and in_flight(workers, prefetch) > budget:
        if prefetch > 1:
            prefetch -= 1
        else:
            workers -= 1
    if in_flight(workers, DEFAULT_PREFETCH_FACTOR) > budget:
        reasons.append(f"in-flight batches limited to {HOST_MEMORY_SHARE:.0%} of free RAM per rank "
                       f"({format_bytes(budget)}): {workers} workers x prefetch {prefetch}")
    if shm is not None and workers > 0:
        # worker batches travel through /dev/shm; all ranks' in-flight batches must fit there together
        shm_limit = shm // ranks_per_host
        while workers > 0 and workers * prefetch * batch_bytes > shm_limit:
            workers -= 1
        if workers * prefetch * batch_bytes > 0 and workers < MAX_WORKERS_PER_RANK:
            reasons.append(f"/dev/shm has {format_bytes(shm)} free: at most {workers} workers fit")
        if workers == 0:
            reasons.append(f"/dev/shm ({format_bytes(shm)}) cannot hold one batch per rank: loading in the main "
                           "process; enlarge it (docker run --shm-size=16g)")
    pin = bool(cuda)
    reasons.append("pin_memory on: the pin thread overlaps host-to-device copies with compute" if pin else
                   "pin_memory off: no CUDA device, pinning would only cost RAM")
    settings = LoaderSettings(
        num_workers=workers,
        prefetch_factor=prefetch if workers > 0 else None,
        pin_memory=pin,
        # re-forking every epoch costs seconds with big datasets; persistent workers keep their RAM instead
        persistent_workers=workers > 0,
        in_flight_bytes=in_flight(workers, prefetch) if workers > 0 else pinned + batch_bytes,
        reasons=tuple(reasons),
    )
    logger.info("loader settings: %s (%s)", settings.as_kwargs(), "; ".join(settings.reasons))
    return settings
