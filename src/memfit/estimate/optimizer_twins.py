"""Stand-ins for torchao's 8-bit and CPU-offloaded Adam in a trace: the GPU memory and work they cause, without
torchao.

torchao's optimizers cannot run on fake tensors: ``AdamW8bit`` builds each state's code book with ``.tolist()`` of
a computed tensor (``create_dynamic_map``, which a fake tensor cannot answer: ``DataDependentOutputException``
under ``FakeTensorMode``, torch 2.13, torchao 0.18.0) and updates each parameter with a ``torch.compile``'d
function; ``CPUOffloadOptimizer`` asserts CUDA and makes CUDA streams in its constructor. The stand-ins allocate
what they allocate on the GPU, in the same order, from the layout constants of ``memfit.workload.optimizer_state``:

* **8-bit** (``AdamW8bit``/``Adam8bit``): per parameter, at its first update, each moment as ``uint8`` codes of the
  parameter's shape, one fp32 scale per 256 elements and a 256-entry fp32 code book, or a plain tensor of the
  parameter's dtype when it is small (``quantized``); the step count stays on the host. Each update is one
  compiled kernel, whose scratch is a rule: see ``EIGHT_BIT_SCRATCH_FP32``.
* **CPU offload** (``CPUOffloadOptimizer``): parameters of 4096 elements or more have no GPU state (their states,
  a pinned copy and a pinned gradient are host memory); the rest are updated on the GPU by the same optimizer
  class (fused for AdamW), traced as usual. The gradients stay on the GPU until ``zero_grad`` (torchao's
  default ``offload_gradients=False``, which gradient accumulation needs). The transfers and the host update are
  counted for the speed model (``Trace.offload``), not run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from memfit.workload.optimizer_state import (
    EIGHT_BIT_BLOCK,
    EIGHT_BIT_QMAP,
    AdamSettings,
    adam_settings,
    offloaded,
    quantized,
)

EIGHT_BIT_SCRATCH_FP32 = 2
"""fp32 buffers of the parameter's size that one compiled 8-bit update allocates and frees (with one fp32 block
scale buffer per quantized moment): the new first and second moments before they are re-quantized. Read off the
code inductor generated for ``single_param_adam`` on the CPU (torch 2.13, torchao 0.18.0:
``buf1``/``buf5`` of shape (numel/256, 256), ``buf0``/``buf4`` of numel/256,
benchmarks/results/plan/adamw8bit_inductor_cpu_torch2.13_20261126.txt). A Triton kernel may keep them in
registers (a persistent reduction over each 256-element block) and need none: the rule is the larger of the two,
and ``benchmarks/plan/optimizer_state_device.py`` records what the GPU's code allocates."""
COMPILED_CALL_DISPATCHES = 40
"""CPU dispatches one call of a ``torch.compile``'d 8-bit update costs (dynamo's guards, the AOT wrapper, the
launches), in units of ``SpeedParams.optimizer_dispatch_s`` (8 us): about 0.33 ms. Fitted on GPT-2 alone (40.6:
torchao's AdamW8bit added 45.0 ms to its 42.8 ms bf16 step on an H200, 50 compiled calls), judged on the 2-D U-Net
(benchmarks/plan/optimizer_state_fit.py -> benchmarks/results/plan/optimizer_state_h200_torch2.11_20261127_fit.json;
was 4, a placeholder, which predicted GPT-2's 8-bit step 6 % slower than full instead of 105 %)."""


@dataclass(frozen=True)
class OffloadTraffic:
    """What ``CPUOffloadOptimizer`` moves and computes off the GPU, for the speed model."""

    d2h_bytes: int
    """Gradients copied to pinned host memory, per micro-batch (its backward hook runs at each accumulation)."""
    h2d_bytes: int
    """Parameters copied back after the host update, per optimizer step."""
    host_update_bytes: int
    """Bytes the host's Adam streams per step: parameter, gradient and two moments read, three written."""
    tensors: int = 0
    """Parameters offloaded: torchao steps one host optimizer per parameter, with a copy and a wait each."""


def stand_in(optimizer: torch.optim.Optimizer, state: str, recorder: Any) -> torch.optim.Optimizer:
    """The trace's optimizer for ``Workload.optimizer_state`` (the ``keep_states`` of ``protocol.build``)."""
    if state == "full":
        return optimizer
    settings = adam_settings(optimizer)
    if state == "8bit":
        return EightBitAdam(settings, recorder)
    return OffloadedAdam(settings, recorder)


class EightBitAdam(torch.optim.Optimizer):
    """The GPU side of torchao's ``AdamW8bit``/``Adam8bit``: its states, its scratch and its kernels' traffic."""

    def __init__(self, settings: AdamSettings, recorder: Any) -> None:
        super().__init__(settings.groups, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                           "amsgrad": False})
        self._recorder = recorder
        recorder.note_rule("optimizer_state_rule",
                           f"the compiled 8-bit Adam update's scratch: {EIGHT_BIT_SCRATCH_FP32} fp32 copies of each "
                           "parameter, from inductor's CPU code (a GPU kernel may need none)")

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0  # torchao's is a host tensor: no GPU memory
                    for name in moments:
                        state.update(_new_moment(name, p))
                state["step"] += 1
                self._update(p, p.grad, moments)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, moments: tuple[str, ...]) -> None:
        """One ``torch.compile(single_param_adam)`` call: scratch for its lifetime, one kernel's traffic."""
        n, size = p.numel(), p.numel() * p.element_size()
        traffic = 2 * size + grad.numel() * grad.element_size()  # parameter read and written, gradient read
        scratch = []
        if quantized(n):
            # the new moments in fp32 and their block scales, written then read once more to quantize
            scratch = [torch.empty(n, dtype=torch.float32) for _ in range(EIGHT_BIT_SCRATCH_FP32)]
            scratch += [torch.empty(n // EIGHT_BIT_BLOCK, dtype=torch.float32) for _ in moments]
            per_moment = 2 * n + 2 * 4 * (n // EIGHT_BIT_BLOCK) + 4 * EIGHT_BIT_QMAP  # codes and scales r/w
            traffic += len(moments) * per_moment + 2 * sum(t.numel() * 4 for t in scratch[:EIGHT_BIT_SCRATCH_FP32])
        else:
            traffic += len(moments) * 2 * size  # plain moments read and written
        self._recorder.record_kernel(traffic, COMPILED_CALL_DISPATCHES)
        del scratch


def _new_moment(name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """One moment as torchao's ``_new_buffer`` makes it: codes, block scales and code book, or a plain tensor."""
    if not quantized(p.numel()):
        return {name: torch.zeros_like(p)}
    return {
        f"{name}.codes": torch.zeros(p.shape, dtype=torch.uint8),
        f"{name}.scale": torch.zeros(p.numel() // EIGHT_BIT_BLOCK),
        f"{name}.qmap": torch.zeros(EIGHT_BIT_QMAP),
    }


class OffloadedAdam(torch.optim.Optimizer):
    """The GPU side of torchao's ``CPUOffloadOptimizer``: the small parameters' optimizer, and nothing for the rest."""

    def __init__(self, settings: AdamSettings, recorder: Any) -> None:
        small: list[dict[str, Any]] = []
        # no Optimizer.__init__, as torchao's: param_groups is the two optimizers' groups
        self.offloaded: list[torch.Tensor] = []
        for group in settings.groups:
            keep = [p for p in group["params"] if p.requires_grad and not offloaded(p)]
            self.offloaded += [p for p in group["params"] if offloaded(p)]
            if keep:
                small.append({**group, "params": keep})
        # torchao: "default to fused CPU AdamW", the same keyword arguments for the on-device optimizer
        kwargs: dict[str, Any] = {"fused": True} if settings.torch_class is torch.optim.AdamW else {}
        self.d_opt = settings.torch_class(small, **kwargs) if small else None
        self.state = self.d_opt.state if self.d_opt is not None else defaultdict(dict)
        self.defaults = self.d_opt.defaults if self.d_opt is not None else {}
        self._offloaded_group = {"params": self.offloaded}
        grad_bytes = sum(p.numel() * p.element_size() for p in self.offloaded)
        recorder.trace.offload = OffloadTraffic(
            d2h_bytes=grad_bytes, h2d_bytes=grad_bytes,
            host_update_bytes=sum(7 * p.numel() * p.element_size() for p in self.offloaded),
            tensors=len(self.offloaded))

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [*(self.d_opt.param_groups if self.d_opt is not None else []), self._offloaded_group]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self.d_opt is not None:
            self.d_opt.step()
        # the offloaded parameters: their gradients went to the host in backward, the host updates them and copies
        # them back in place: no GPU allocation (OffloadTraffic has the time)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.offloaded:
            p.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=True)

