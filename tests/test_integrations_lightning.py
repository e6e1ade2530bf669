"""The Lightning callback in a real ``Trainer.fit`` on CPU: the plan applied, an injected OOM survived with the
parameters of a run that never ran out of memory, and the diagnosis of one that cannot be survived."""

from __future__ import annotations

import atexit
from typing import Any

import pytest
import torch

from integration_models import OomAbove, assert_same_parameters, fake_oom, require, tiny_gpt2, token_data

L = require("lightning.pytorch")

from memfit.errors import StepOOMError, UsageError  # noqa: E402
from memfit.integrations.lightning import MemfitCallback  # noqa: E402


class TinyLM(L.LightningModule):
    """A GPT-2 language model whose train dataloader reads ``self.batch_size``, as BatchSizeFinder expects."""

    def __init__(self, batch_size: int = 8, samples: int = 32) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.batch_size = batch_size
        self.data = token_data(samples)

    def train_dataloader(self) -> Any:
        dataset = torch.utils.data.TensorDataset(self.data)
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(module: TinyLM, callbacks: list[Any], *, steps: int = 3, accumulate: int = 2) -> Any:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                        precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module)
    return trainer


def test_an_injected_oom_is_survived_with_the_parameters_of_a_run_without_it() -> None:
    reference = TinyLM()
    fit(reference, [])
    guarded = TinyLM()
    oom = OomAbove(limit=3).attach(guarded.model)  # micro-batches of 8, and pieces of 4, run out of memory
    callback = MemfitCallback()
    fit(guarded, [callback])
    assert oom.fired == 2  # 8, then 4; the pieces stay at 2 afterwards
    assert callback.window_guard is not None and callback.window_guard.size == 2 and callback.window_guard.ooms == 2
    # every sample of 3 steps × 2 micro-batches × 8 went through a forward that did not fail, once
    assert sum(n for n in oom.sizes if n <= 3) == 3 * 2 * 8
    assert_same_parameters(reference, guarded)
    # the hooks are the module's own again after fit
    assert "training_step" not in vars(guarded) and "backward" not in vars(guarded)


def test_an_oom_in_the_backward_of_the_second_micro_batch_rolls_the_window_back() -> None:
    """When it runs out of memory, the backward of the window's second micro-batch has already added into the
    gradients of the last layers: the window is rolled back and the first micro-batch replayed in pieces."""
    reference = TinyLM(batch_size=4)
    fit(reference, [], steps=2, accumulate=2)
    guarded = TinyLM(batch_size=4)
    state = {"forwards": 0, "fired": 0}

    def arm(module: Any, args: Any, output: Any) -> None:
        state["forwards"] += 1
        hidden = output[0] if isinstance(output, tuple) else output
        if state["forwards"] == 2 and hidden.shape[0] > 2:  # the window's 2nd micro-batch, whole

            def raise_in_backward(grad: torch.Tensor) -> torch.Tensor:
                state["fired"] += 1
                raise fake_oom()

            hidden.register_hook(raise_in_backward)

    # block 0's output: its gradient comes after those of block 1 and the head, already accumulated by then
    guarded.model.transformer.h[0].register_forward_hook(arm)
    callback = MemfitCallback()
    fit(guarded, [callback], steps=2, accumulate=2)
    assert state["fired"] == 1 and callback.window_guard is not None and callback.window_guard.ooms == 1
    assert callback.window_guard.size == 2
    assert_same_parameters(reference, guarded)


def test_an_oom_that_cannot_be_survived_ends_fit_with_the_diagnosis() -> None:
    module = TinyLM(batch_size=2)
    OomAbove(limit=0).attach(module.model)  # even one sample runs out of memory
    with pytest.raises(StepOOMError) as info:
        fit(module, [MemfitCallback()])
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "memfit: training ran out of GPU memory." in notes
    assert "PyTorch asked for 2.00 GiB on GPU 0" in notes  # read from the OOM message the guard quotes
    assert all(p.grad is None for p in module.parameters())  # rolled back: nothing of the window applied


def test_without_the_guard_an_oom_gets_the_diagnosis_too() -> None:
    module = TinyLM(batch_size=2)
    OomAbove(limit=1).attach(module.model)
    with pytest.raises(torch.OutOfMemoryError) as info:
        fit(module, [MemfitCallback(guard=False)])
    assert any("memfit: training ran out of GPU memory." in n for n in getattr(info.value, "__notes__", []))


def test_the_callback_applies_the_plan_it_makes() -> None:
    # slack budget: the fastest plan runs the effective batch of 8 × 4 in one micro-batch
    slack = MemfitCallback(budget="64GiB", gpu="h100")
    module = TinyLM(batch_size=8)
    trainer = fit(module, [slack], steps=1, accumulate=4)
    assert slack.plan is not None and slack.plan.effective_batch == 32
    assert slack.workload is not None and slack.workload.batch_size == 8  # planned from the loader's batch
    assert module.batch_size == slack.plan.chosen.config.micro_batch == 32 and trainer.accumulate_grad_batches == 1
    # a budget just below what that needs binds: the plan needs less (a smaller micro-batch with accumulation, or
    # checkpointed blocks), keeps the effective batch, and the callback applies what it chose
    need = slack.plan.chosen.device_bytes
    budget = int((need - 1) / (1 - slack.plan.margin))
    binding = MemfitCallback(budget=budget, gpu="h100")
    module = TinyLM(batch_size=8)
    trainer = fit(module, [binding], steps=1, accumulate=4)
    assert binding.plan is not None
    config = binding.plan.chosen.config
    assert binding.plan.chosen.device_bytes < need and config != slack.plan.chosen.config
    assert module.batch_size == config.micro_batch and trainer.accumulate_grad_batches == config.accumulation_steps
    assert config.micro_batch * config.accumulation_steps == 32
    for name in config.checkpoint:
        assert getattr(module.get_submodule(name), "_memfit_checkpointed", False), name


class TinyConvNet(L.LightningModule):
    """A small convolutional classifier of bilinearly upsampled images, whose train dataloader reads
    ``self.batch_size``."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.Upsample(scale_factor=8, mode="bilinear"),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
        self.batch_size = batch_size
        self.data = (torch.randn(32, 3, 16, 16), torch.randint(0, 4, (32,)))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*self.data), batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainer_with_deterministic_algorithms_plans_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer(deterministic=True) turns deterministic algorithms on before the callback plans: the estimates it plans
    with run bilinear upsampling as CUDA then runs it (a decomposition that gathers the input four times at the
    output's size), so the plan needs more than the same module's without them."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # Lightning sets these: given back after the test
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    chosen = {}
    for deterministic in (False, True):
        callback = MemfitCallback(budget="64GiB", gpu="h100")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            deterministic=deterministic, callbacks=[callback])
        try:
            trainer.fit(TinyConvNet())
        finally:
            torch.use_deterministic_algorithms(False)
        assert callback.plan is not None
        chosen[deterministic] = callback.plan.chosen
    assert chosen[True].config == chosen[False].config
    gathers = 3 * 8 * 8 * 128 * 128 * 4  # at least three more upsampled-sized blocks of the batch of 8
    assert chosen[True].fits_in_bytes >= chosen[False].fits_in_bytes + gathers


def test_a_budget_nothing_fits_stops_fit_before_training() -> None:
    from memfit.errors import BudgetTooSmallError

    module = TinyLM()
    with pytest.raises(BudgetTooSmallError, match="nothing fits 100.00 MiB"):
        fit(module, [MemfitCallback(budget="100MiB", gpu="h100")], steps=1)


def test_a_plan_with_checkpointing_is_applied_to_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner is replaced by a fixed plan here: what is checked is that each knob reaches Lightning."""
    from memfit.integrations import lightning as integration
    from memfit.plan.records import Candidate, Config, Plan

    config = Config(micro_batch=2, accumulation_steps=8, precision="fp32", checkpoint=("model.transformer.h.0",))
    chosen = Candidate(config=config, device_bytes=1, fits_in_bytes=1, step_time_s=None, samples_per_s=None,
                       verified=True, fits=True)
    fixed = Plan(workload="TinyLM", gpu="H100", budget_bytes=2, margin=0.0, effective_batch=16, chosen=chosen,
                 frontier=[chosen], considered=1, estimates=1, speed_model="none")
    seen: dict[str, Any] = {}

    def fake_plan(workload: Any, **kwargs: Any) -> Plan:
        seen.update(kwargs, workload=workload)
        return fixed

    monkeypatch.setattr(integration, "plan", fake_plan)
    module = TinyLM(batch_size=4)
    forwards = {0: 0, 1: 0}
    for i in forwards:  # a layer inside each block: the recompute of a checkpointed block calls it again
        module.model.transformer.h[i].attn.register_forward_pre_hook(
            lambda m, a, i=i: forwards.__setitem__(i, forwards[i] + 1))
    trainer = fit(module, [MemfitCallback(budget="10GiB", gpu="h100")], steps=1, accumulate=4)
    assert seen["effective_batch"] == 16 and seen["budget_bytes"] == 10 * 2**30
    assert module.batch_size == 2 and trainer.accumulate_grad_batches == 8
    # block 0 is checkpointed: it runs twice per micro-batch (forward, and recomputed in backward); block 1 once
    assert forwards == {0: 2 * 8, 1: 8}


def test_a_module_without_the_batch_size_attribute_is_told_what_to_do() -> None:
    module = TinyLM()
    with pytest.raises(UsageError, match="attribute 'micro_bs'"):
        fit(module, [MemfitCallback(budget="1GiB", batch_arg_name="micro_bs")], steps=1)


def test_bad_arguments_are_one_clear_error() -> None:
    with pytest.raises(UsageError, match="cannot read the size"):
        MemfitCallback(budget="lots")
    with pytest.raises(UsageError, match="effective_batch must be a positive integer"):
        MemfitCallback(effective_batch=0)


def test_pytorch_lightning_trainers_get_their_own_callback() -> None:
    pl = require("pytorch_lightning")
    from memfit.integrations.pytorch_lightning import MemfitCallback as PLCallback

    callback = PLCallback(budget="24GiB")
    assert isinstance(callback, pl.Callback) and callback.lightning is pl and callback.budget_bytes == 24 * 2**30


class OomOnRank:
    """A forward pre-hook: a fake OOM on one rank only, for micro-batches above ``limit`` samples."""

    def __init__(self, rank: int, limit: int) -> None:
        self.rank, self.limit = rank, limit

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        n = int(kwargs["input_ids"].shape[0])
        if torch.distributed.get_rank() == self.rank and n > self.limit:
            raise fake_oom()


@pytest.mark.slow
class DestroyGlooGroupAtExit(L.Callback):
    """Lightning destroys the process group at a worker's exit only for NCCL (lightning_fabric's
    ``_init_dist_connection`` registers ``_destroy_dist_connection`` with ``atexit`` for "nccl" alone). A gloo
    worker that exits with its group alive aborts now and then in interpreter teardown ("terminate called without
    an active exception", pytorch/pytorch#190489): it did so in plain DDP runs without memfit, in 3 of 14 runs of
    this test on one machine. The same ``atexit`` handler for gloo keeps the spawned ranks' exit clean."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_under_ddp_one_ranks_oom_is_agreed_and_gradients_match_plain_ddp() -> None:
    """Two CPU ranks (gloo, ddp_spawn): only rank 1 runs out of memory; both must split, reduce their gradients
    once, and end where plain DDP ends without the OOM."""

    def ddp_fit(module: TinyLM, callbacks: list[Any]) -> None:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2,
                            accumulate_grad_batches=2, precision="64-true", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=callbacks)
        trainer.fit(module)

    reference = TinyLM(batch_size=4)
    ddp_fit(reference, [DestroyGlooGroupAtExit()])
    guarded = TinyLM(batch_size=4)
    guarded.model.register_forward_pre_hook(OomOnRank(rank=1, limit=2), with_kwargs=True)
    ddp_fit(guarded, [MemfitCallback(), DestroyGlooGroupAtExit()])
    assert_same_parameters(reference, guarded)  # rank 0's parameters, returned by ddp_spawn


def test_a_plan_that_changed_precision_switches_lightnings_precision_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner proposes bf16 only with allow_precision_change; the callback then runs bf16-mixed."""
    from memfit.integrations import lightning as integration
    from memfit.plan.records import Candidate, Config, Plan

    config = Config(micro_batch=8, accumulation_steps=1, precision="bf16")
    chosen = Candidate(config=config, device_bytes=1, fits_in_bytes=1, step_time_s=None, samples_per_s=None,
                       verified=True, fits=True)
    fixed = Plan(workload="TinyLM", gpu="H100", budget_bytes=2, margin=0.0, effective_batch=8, chosen=chosen,
                 frontier=[chosen], considered=1, estimates=1, speed_model="none")
    asked: dict[str, Any] = {}
    monkeypatch.setattr(integration, "plan", lambda workload, **kwargs: asked.update(kwargs) or fixed)
    module = TinyLM(batch_size=8)
    module.model.float()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MemfitCallback(budget="10GiB", gpu="h100", allow_precision_change=True)])
    trainer.fit(module)
    assert asked["allow_precision_change"] is True
    assert trainer.precision_plugin.precision == "bf16-mixed"
