"""The Hugging Face integration on CPU: a plan as TrainingArguments, and a real ``Trainer.train`` that survives an
injected OOM with the parameters of a plain ``transformers.Trainer`` run that never ran out of memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from integration_models import OomAbove, assert_same_parameters, require, tiny_gpt2, token_data

transformers = require("transformers")

from memfit.errors import StepOOMError  # noqa: E402
from memfit.integrations.huggingface import (  # noqa: E402
    MemfitTrainer,
    plan_training_arguments,
    training_arguments_for,
)
from memfit.plan.records import Candidate, Config, Plan  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """Token sequences with labels; ``pad`` masks the tail of every other sample with -100 (uneven counts)."""

    def __init__(self, n: int, *, pad: bool = False) -> None:
        self.ids = token_data(n)
        self.labels = self.ids.clone()
        if pad:
            for i in range(0, n, 2):
                self.labels[i, 4 + i % 7:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def arguments(tmp_path: Path, **changes: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=1e-2, optim="sgd", use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    settings.update(changes)
    return transformers.TrainingArguments(**settings)


def train(trainer_class: type, model: torch.nn.Module, args: Any, data: Any, *, loss_kwargs: bool = True) -> Any:
    trainer = trainer_class(model=model, args=args, train_dataset=data)
    if not loss_kwargs:  # as for a model whose forward takes no num_items_in_batch: the loss is a mean
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return trainer


@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["sum-over-items", "mean-per-micro-batch"])
def test_an_injected_oom_is_survived_with_the_parameters_of_a_run_without_it(tmp_path: Path,
                                                                             loss_kwargs: bool) -> None:
    data = Samples(48, pad=True)  # uneven label counts: pieces must be weighted by tokens, not samples
    reference = tiny_gpt2()
    train(transformers.Trainer, reference, arguments(tmp_path), data, loss_kwargs=loss_kwargs)
    guarded = tiny_gpt2()
    oom = OomAbove(limit=3).attach(guarded)  # micro-batches of 8 and pieces of 4 run out of memory
    trainer = train(MemfitTrainer, guarded, arguments(tmp_path), data, loss_kwargs=loss_kwargs)
    assert oom.fired == 2 and trainer.memfit_guard.size == 2 and trainer.memfit_guard.ooms == 2
    assert sum(n for n in oom.sizes if n <= 3) == 3 * 2 * 8  # every sample once, in pieces that fit
    # transformers computes the causal-LM loss in float32 (logits.float()): pieces change its rounding, ~1e-7 of the
    # gradient, 1e-9 of a parameter after three SGD steps at lr 1e-2 (a wrong weight moves them by ~1e-4)
    assert_same_parameters(reference, guarded, rtol=0.0, atol=1e-9)


def test_an_oom_that_cannot_be_survived_raises_with_the_oom_quoted(tmp_path: Path) -> None:
    model = tiny_gpt2()
    OomAbove(limit=0).attach(model)
    with pytest.raises(StepOOMError, match="pieces of 1 sample .*CUDA out of memory"):
        train(MemfitTrainer, model, arguments(tmp_path, max_steps=1), Samples(16))


def _fixed_plan(config: Config) -> Plan:
    chosen = Candidate(config=config, device_bytes=20 << 30, fits_in_bytes=19 << 30, step_time_s=None,
                       samples_per_s=None, verified=True, fits=True)
    return Plan(workload="GPT2LMHeadModel", gpu="NVIDIA H100", budget_bytes=24 << 30, margin=0.02,
                effective_batch=config.effective_batch, chosen=chosen, frontier=[chosen], considered=1,
                estimates=1, speed_model="roofline")


def test_a_plan_becomes_training_arguments(tmp_path: Path) -> None:
    args = arguments(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=1, optim="adamw_torch")
    config = Config(micro_batch=4, accumulation_steps=4, precision="fp32",
                    checkpoint=("transformer.h.0", "transformer.h.1"), optimizer_impl="fused")
    updated, summary = training_arguments_for(_fixed_plan(config), args)
    assert (updated.per_device_train_batch_size, updated.gradient_accumulation_steps) == (4, 4)
    assert updated.gradient_checkpointing is True and updated.optim == "adamw_torch_fused"
    assert not updated.bf16 and not updated.fp16  # the plan kept the precision
    assert args.per_device_train_batch_size == 16 and args.optim == "adamw_torch"  # the original is unchanged
    assert "per_device_train_batch_size 16 -> 4" in summary and "checkpoints 2 blocks" in summary
    # a precision change (planned only with allow_precision_change) turns bf16 on
    bf16, summary = training_arguments_for(_fixed_plan(Config(micro_batch=16, accumulation_steps=1,
                                                               precision="bf16")), args)
    assert bf16.bf16 is True and bf16.gradient_checkpointing is False and "bf16 autocast -> on" in summary
    # an optimizer memfit does not switch is left alone, and the summary says so
    other, summary = training_arguments_for(_fixed_plan(config), arguments(tmp_path, optim="adafactor"))
    assert other.optim == "adafactor" and "optim stays 'adafactor'" in summary


def test_a_plan_with_the_chunked_loss_swaps_it_into_the_model(tmp_path: Path) -> None:
    config = Config(micro_batch=8, accumulation_steps=2, precision="fp32", loss_impl="chunked")
    model = tiny_gpt2()
    batch = {"input_ids": token_data(4), "labels": token_data(4)}
    expected = model(**batch).loss
    _, summary = training_arguments_for(_fixed_plan(config), arguments(tmp_path), model=model)
    assert "loss -> chunked cross-entropy" in summary
    out = model(**batch)  # the Trainer's call: the loss, computed in chunks, and no logits
    assert out.logits is None and out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # without the model, the summary says what to do: TrainingArguments cannot carry it
    _, summary = training_arguments_for(_fixed_plan(config), arguments(tmp_path))
    assert "use_chunked_cross_entropy(model)" in summary


def test_plan_training_arguments_plans_the_models_step(tmp_path: Path) -> None:
    model = tiny_gpt2()
    batch = {"input_ids": token_data(8), "labels": token_data(8)}
    args = arguments(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=4)
    updated, summary = plan_training_arguments(model, args, batch, budget="64GiB", gpu="h100")
    # a slack budget: the fastest configuration, the effective batch of 32 kept
    assert updated.per_device_train_batch_size * updated.gradient_accumulation_steps == 32
    assert updated.per_device_train_batch_size == 32 and "memfit plan under 64.00 GiB" in summary
    assert next(model.parameters()).device.type == "cpu"  # the model itself was not moved or copied


class ConvClassifier(torch.nn.Module):
    """A small image classifier (its features upsampled bilinearly) that returns its loss as a Hugging Face model
    does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8, 4)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.nn.functional.interpolate(self.conv(pixel_values), scale_factor=8, mode="bilinear")
        logits = self.head(features.mean((2, 3)))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_full_determinism_is_planned_for_before_the_trainer_turns_it_on(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments(full_determinism=True): the Trainer turns deterministic algorithms on when it is made,
    which may be after the plan; the plan's estimates run with them on (bilinear upsampling as the decomposition CUDA
    then runs, which gathers the input four times at the output's size), and the process's settings are given back."""
    from memfit.integrations import huggingface as integration

    planned: list[Plan] = []
    real_plan = integration.plan
    monkeypatch.setattr(integration, "plan", lambda *a, **k: planned.append(real_plan(*a, **k)) or planned[-1])
    batch = {"pixel_values": torch.randn(8, 3, 16, 16), "labels": torch.randint(0, 4, (8,))}
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    for determinism in (False, True):
        args = arguments(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                         full_determinism=determinism)
        plan_training_arguments(ConvClassifier(), args, batch, budget="64GiB", gpu="h100")
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic) == before
    plain, strict = (p.chosen for p in planned)
    assert strict.config.micro_batch == plain.config.micro_batch  # (the memory format may differ: a speed choice)
    assert strict.fits_in_bytes >= plain.fits_in_bytes + 8 * 8 * 112 * 112 * 4  # at least one more upsampled block


def _rank_worker(rank: int, world: int, port: int, limit: int | None, out: str, guarded: bool) -> None:
    """One rank of a 2-process CPU (gloo) DDP Trainer; a fake OOM on rank 1 only, above ``limit`` samples."""
    import os
    import tempfile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    args = arguments(Path(tempfile.mkdtemp()), per_device_train_batch_size=4, max_steps=2, ddp_backend="gloo")
    model = tiny_gpt2()

    def oom_on_rank_1(module: Any, args: Any, kwargs: Any) -> None:
        if limit is not None and rank == 1 and kwargs["input_ids"].shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")

    model.register_forward_pre_hook(oom_on_rank_1, with_kwargs=True)
    trainer = (MemfitTrainer if guarded else transformers.Trainer)(model=model, args=args,
                                                                   train_dataset=Samples(32, pad=True))
    trainer.train()
    guard = getattr(trainer, "memfit_guard", None)
    torch.save({"ooms": guard.ooms if guard else None, "size": guard.size if guard else None,
                "state": model.state_dict()}, f"{out}.rank{rank}")
    # the result is on disk: leave without C++ teardown, where a gloo worker thread left joinable after an injected
    # OOM can abort the process ("terminate called without an active exception", seen once in CI's Accelerate twin)
    os._exit(0)


@pytest.mark.slow
def test_under_ddp_one_ranks_oom_is_agreed_and_gradients_match_plain_ddp(tmp_path: Path) -> None:
    """Two CPU ranks (gloo): only rank 1 runs out of memory; both split and replay, reduce once per step, and end
    with the parameters of a plain DDP Trainer without the OOM."""
    import socket

    import torch.multiprocessing as mp

    def launch(limit: int | None, guarded: bool, out: str) -> list[dict[str, Any]]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_worker, args=(2, port, limit, out, guarded), nprocs=2, join=True)
        return [torch.load(f"{out}.rank{r}") for r in range(2)]

    reference = launch(None, False, str(tmp_path / "reference"))
    guarded = launch(2, True, str(tmp_path / "guarded"))
    assert [(r["ooms"], r["size"]) for r in guarded] == [(1, 2), (1, 2)]  # rank 0 split with rank 1
    for name, value in guarded[0]["state"].items():
        assert torch.equal(value, guarded[1]["state"][name]), name
        assert torch.allclose(value, reference[0]["state"][name], rtol=0.0, atol=1e-9), name
