"""What a failed attempt at a step changed, and how to put it back before the retry.

Forward passes change more than activations: BatchNorm updates its running statistics and counter, and dropout
advances the random number generators. A retried step that did not undo these would differ from a step that
never ran out of memory. Gradients are reset by the guard itself (``set_to_none``), and GradScaler needs
nothing: it only changes in ``unscale_``/``step``/``update``, after the last point where a retry can happen.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit._torch_private import NormBase

__all__ = ["Snapshot", "memory_in_use", "resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with an index: ``cuda`` becomes ``cuda:<current device>``.

    Some CUDA calls accept ``torch.device("cuda")`` and mean the current device, others
    (``set_per_process_memory_fraction``, ``get_per_process_memory_fraction``, and in some torch versions the RNG
    and memory-statistics calls) raise ``ValueError: Expected a torch.device with a specified index``. Resolving
    once, when the guard is built, makes every later call unambiguous, and pins the device the user meant even if
    the current device changes later.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Snapshot:
    """Norm-layer statistics and RNG states at the start of a step.

    The copies of the buffers are allocated once; each step only copies into them, so taking a snapshot does
    not allocate on the device (an allocation at the start of every step would move the peak).

    Args:
        module: The model (not its DDP wrapper).
        device: The device forward runs on; its CUDA generator is saved too (dropout draws from it).
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self._buffers = [
            b
            for m in module.modules()
            if isinstance(m, NormBase)  # BatchNorm and InstanceNorm with running stats
            for b in m.buffers(recurse=False)
        ]
        self._saved = [torch.empty_like(b) for b in self._buffers]
        self._device = resolve_device(device)
        self._cpu_rng: torch.Tensor | None = None
        self._cuda_rng: torch.Tensor | None = None

    def take(self) -> None:
        """Record the current state (buffers copied in place on their device; RNG states on the host)."""
        with torch.no_grad():
            for saved, buffer in zip(self._saved, self._buffers):
                saved.copy_(buffer)
        # Both RNG states are host memory: the CPU generator's ~5 KB, and the CUDA Philox generator's seed and
        # offset, which live on the host. Neither call waits for the device, so taking them every step is cheap.
        self._cpu_rng = torch.get_rng_state()
        # Only this device's generator: get_rng_state_all() would create a context on every GPU of the host.
        if self._device.type == "cuda":
            self._cuda_rng = torch.cuda.get_rng_state(self._device.index)

    def restore(self) -> None:
        """Put back what :meth:`take` recorded."""
        with torch.no_grad():
            for saved, buffer in zip(self._saved, self._buffers):
                buffer.copy_(saved)
        if self._cpu_rng is not None:
            torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng, self._device.index)


def memory_in_use(device: torch.device) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes on a CUDA device, else (None, None); host calls only, safe after an OOM."""
    if device.type != "cuda":
        return None, None
    index = resolve_device(device).index
    return torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index)
