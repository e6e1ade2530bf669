"""The user's device and dtype calls while the tracer builds the model and the batch: ``.cuda()``,
``.to(device)``, ``device="cuda"``, ``.half()``.

Training scripts build their model with ``Net().cuda()`` or ``Net().to(device)``, and their batch with
``torch.randn(..., device="cuda")``. memfit traces on fake *CPU* tensors that stand for the GPU, so inside the
factories a CUDA device means the device being simulated: the CPU. Two things stand in the way, and this module
removes both for the duration of the build:

* a CPU-only torch refuses any CUDA device before dispatch ("not linked with support for cuda devices"): a
  ``TorchFunctionMode`` rewrites CUDA devices in ``Tensor.cuda``/``Tensor.to`` and ``device=`` arguments to the CPU;
* ``Module._apply`` (behind ``.to()``, ``.cuda()``, ``.half()``) swaps each fake parameter in place with
  ``torch.utils.swap_tensors``, which FakeTensorMode's weak references forbid ("_apply(): Couldn't swap
  Linear.weight"): here it puts a new ``Parameter`` in the module instead, one per old parameter so tied weights
  stay tied. Nothing holds the parameters yet (the optimizer is built after the model).

Example::

    with user_device_calls():
        model = workload.model()  # Net().cuda() builds on the simulated device
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memfit import _torch_private as tp

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0].strip() == "cuda"
    return False


def _to_cpu(value: Any) -> Any:
    return _CPU if _is_cuda(value) else value


class _CudaIsTheSimulatedDevice(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]  # already on the device being simulated
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def user_device_calls() -> Iterator[None]:
    """Inside: CUDA devices are the CPU, and ``Module.to``/``.cuda()``/``.half()`` work on fake parameters."""
    with tp.module_apply_without_swap(), _CudaIsTheSimulatedDevice():
        yield
