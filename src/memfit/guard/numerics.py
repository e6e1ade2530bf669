"""Whether a step's losses are finite, read without stalling the GPU.

The guard must know before ``optimizer.step()`` whether any micro-batch loss is NaN/inf (to raise or skip with
nothing applied), and knowing it on the host needs a device-to-host copy. Where that copy waits matters:

- ``bool(torch.isfinite(losses).all())`` after the last backward makes the host wait for the *whole* backward,
  then launch the optimizer into an idle GPU: the optimizer's Python and launch time become GPU idle time
  (measured +2.3 % step time over a hand-written loop on an H200 for a 168M-parameter GPT at micro-batch 16,
  torch 2.11: ``benchmarks/guard_benchmark.py`` check (c), commit b6c4879; with the copy below, -1.6 %,
  ``benchmarks/results/guard/guard_h200_torch2.11_20261126.md``).
- Queued right after the last *forward*, into pinned host memory, with an event behind it, the copy completes
  while the GPU runs the last backward. The host waits on that event only after it has queued the backward, so
  the GPU still has the backward to run and never idles.
"""

from __future__ import annotations

import torch

__all__ = ["LossWatch"]


class LossWatch:
    """Finiteness of the weighted micro-batch losses of one attempt, copied to the host asynchronously.

    Example:
        >>> watch = LossWatch()
        >>> watch.record([torch.tensor(0.5), torch.tensor(float("nan"))])
        >>> watch.all_finite(), watch.first_nonfinite()
        (False, 1)
    """

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._flag: torch.Tensor | None = None  # on the host: pinned when the losses are on a GPU
        self._pinned: torch.Tensor | None = None  # allocated once; a pinned allocation is slow
        self._event: torch.cuda.Event | None = None

    def record(self, losses: list[torch.Tensor]) -> None:
        """Start copying ``all(isfinite(losses))`` to the host; returns without waiting for the device."""
        self._losses = list(losses)
        self._event = None
        finite = torch.isfinite(torch.stack(losses)).all()
        if finite.device.type != "cuda":
            self._flag = finite
            return
        if self._pinned is None:
            self._pinned = torch.empty((), dtype=torch.bool, pin_memory=True)
        with torch.cuda.device(finite.device):  # the event must follow the stream that runs the copy
            # Stream-ordered after the last forward; a pinned destination makes the copy truly asynchronous.
            self._pinned.copy_(finite, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._flag = self._pinned

    def all_finite(self) -> bool:
        """Whether every recorded loss is finite; waits only for the copy queued by :meth:`record`."""
        if self._flag is None:
            return True
        if self._event is not None:
            self._event.synchronize()
        return bool(self._flag)

    def first_nonfinite(self) -> int | None:
        """Position of the first non-finite loss in the recorded list (one sync per loss: the rare path)."""
        return next((i for i, loss in enumerate(self._losses) if not bool(torch.isfinite(loss))), None)

    def clear(self) -> None:
        """Forget the recorded losses (so that no device tensor outlives the step)."""
        self._losses, self._flag, self._event = [], None, None
