import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    """GPU tests run only where CUDA is present (the device machine); elsewhere they are skipped, not failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


class StrictFakeCuda:
    """The memory, RNG and device calls of ``torch.cuda`` for a pretend GPU ("mock the hardware, not the math").

    As strict about device arguments as the strictest torch versions (``set_per_process_memory_fraction``, and
    ``get_rng_state`` and friends in some releases): an ``int`` or an indexed ``cuda`` device. A bare
    ``torch.device("cuda")`` or ``None`` raises the ``ValueError`` torch raises, so code that relies on torch
    filling in the current device fails on CPU too.
    """

    def __init__(self, current: int) -> None:
        self.current = current
        self.calls: list[tuple[str, int]] = []
        self.rng_state = torch.arange(16, dtype=torch.uint8)
        self.rng_sets: list[torch.Tensor] = []

    def _index(self, name: str, device: object) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            device = device.index
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.calls.append((name, device))
        return device

    def _answer(self, name: str, value: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            device = kwargs.get("device", args[-1] if args else None)
            self._index(name, device)
            if name == "set_rng_state":
                self.rng_sets.append(args[0] if args else kwargs["new_state"])  # type: ignore[arg-type]
            return value() if callable(value) else value

        return call

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "StrictFakeCuda":
        gib = 2**30
        answers: dict[str, object] = {
            "memory_allocated": 3 * gib,
            "memory_reserved": 4 * gib,
            "max_memory_allocated": 5 * gib,
            "reset_peak_memory_stats": None,
            "mem_get_info": (60 * gib, 80 * gib),
            "get_per_process_memory_fraction": 1.0,
            "get_rng_state": self.rng_state.clone,
            "set_rng_state": None,
        }
        for name, value in answers.items():
            monkeypatch.setattr(torch.cuda, name, self._answer(name, value), raising=False)

        def memory_summary(device: object = None, abbreviated: bool = False) -> str:
            self._index("memory_summary", device)
            return "fake summary"

        monkeypatch.setattr(torch.cuda, "memory_summary", memory_summary)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        return self


@pytest.fixture(autouse=True)
def _allocator_settings_given_back():  # noqa: ANN202
    """``Plan.apply`` turns on expandable segments for its process (``PYTORCH_CUDA_ALLOC_CONF``), as a user's script
    wants; a test gives the setting back, so later tests' estimates (``AllocatorConfig.from_env``) replay as
    they would alone."""
    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    yield
    if before is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before


@pytest.fixture
def strict_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> StrictFakeCuda:
    """A pretend GPU whose current device is 1 (so a call that fell back to 0 would show)."""
    return StrictFakeCuda(current=1).install(monkeypatch)


def small_plan():  # noqa: ANN201 - memfit.plan.search.Plan, imported here only when called
    """A Plan built by hand (no search): for the tests of its JSON and of saving it."""
    from memfit.plan.records import Candidate, Config, Plan

    config = Config(micro_batch=4, accumulation_steps=2, precision="bf16", checkpoint=("layers.0",),
                    patch_size=(8, 8, 8))
    chosen = Candidate(config=config, device_bytes=3 << 30, fits_in_bytes=2 << 30, step_time_s=0.1,
                       samples_per_s=80.0, verified=True, fits=True)
    return Plan(workload="w", gpu="H100", budget_bytes=4 << 30, margin=0.02, effective_batch=8, chosen=chosen,
                frontier=[chosen], considered=3, estimates=2, speed_model="roofline", notes=["n"])


PLAN_EFFECTIVE = 8
"""The planner tests' effective batch: 4 micro-batch sizes (1, 2, 4, 8)."""


def plan_unet(**changes):  # noqa: ANN003, ANN201 - a memfit Workload, built here only when called
    """A small 2-D U-Net whose blocks can be checkpointed and whose convolutions try channels_last: every knob of
    the planner applies, and each estimate takes a fraction of a second."""
    from memfit.workload.models import UNet
    from memfit.workload.spec import Workload

    w = Workload(
        name="plan-unet",
        model=lambda: UNet(dims=2, in_channels=3, classes=2, features=(8, 16, 32), norm="batch",
                           deep_supervision=False),
        batch=lambda n, patch: (torch.randn(n, 3, *patch), torch.randint(0, 2, (n, *patch))),
        loss=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1]),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        batch_size=PLAN_EFFECTIVE,
        patch_size=(192, 192),
        patch_multiple=(4, 4),
    )
    return w.replace(**changes) if changes else w
