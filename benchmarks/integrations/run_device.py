"""Each memfit integration trains a GPT-2 on the GPU under a memory cap equal to its budget.

For Lightning (``MemfitCallback``), the Hugging Face Trainer (``plan_training_arguments`` + ``MemfitTrainer``) and
Accelerate (``find_executable_batch_size``), two runs, each in a fresh process:

* ``planned``: memfit plans the effective batch under ``--budget`` and the run uses the planned configuration;
  it must finish without running out of memory (``ooms == 0``), peak under the cap;
* ``recover``: no plan, the whole effective batch as one micro-batch, which does not fit under the cap: the
  integration must survive real OOMs and finish every step (``ooms > 0``, ``ok``).

The cap is the budget minus this process's CUDA context (measured after the first matmul), given to
``torch.cuda.set_per_process_memory_fraction``: the budget is the device memory the process may use, as memfit
plans it. The model is GPT-2 small (12 layers, width 768, 50257 tokens), sequences of 1024, bf16 autocast, AdamW,
an effective batch of 32 per optimizer step, ``--steps`` optimizer steps.

Usage (about 4 minutes on an H100, most of it planning on the host and imports)::

    PYTHONPATH=src python benchmarks/integrations/run_device.py --out DIR [--budget 16GiB] [--steps 3]
    PYTHONPATH=src python benchmarks/integrations/run_device.py --device cpu --out DIR   # dry run, tiny model

Needs lightning, transformers and accelerate: without them it stops and names the wheels to install (e.g.
``pip install --no-index --find-links .whl lightning transformers accelerate``). Results:
``integrations_<card>_torch<X.Y>_<yyyymmdd>.json`` in ``--out``, one record per run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/_results.py

NEEDED = ("lightning", "transformers", "accelerate")
INTEGRATIONS = ("lightning", "huggingface", "accelerate")
MODES = ("planned", "recover")
EFFECTIVE = 32


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


# ------------------------------------------------------------------------------------------------ one run


class Setup:
    """The model, data and sizes of a run: GPT-2 small on the GPU, a tiny GPT-2 for the CPU dry run."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.gpu = device == "cuda"
        self.seq = 1024 if self.gpu else 16
        self.vocab = 50257 if self.gpu else 100

    def model(self) -> Any:
        import torch
        import transformers

        torch.manual_seed(0)
        if self.gpu:
            config = transformers.GPT2Config(n_positions=self.seq)
        else:
            config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=self.vocab,
                                             n_positions=self.seq)
        return transformers.GPT2LMHeadModel(config)

    def data(self, n: int) -> Any:
        import torch

        g = torch.Generator().manual_seed(1)
        return torch.randint(0, self.vocab, (n, self.seq), generator=g)


def _inject_oom_above(model: Any, limit: int) -> None:
    """CPU dry run only: a forward pre-hook that raises an OOM above ``limit`` samples, as a cap would."""
    import torch

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (dry run)")

    model.register_forward_pre_hook(hook, with_kwargs=True)


def run_lightning(setup: Setup, mode: str, budget_bytes: int, steps: int) -> dict[str, Any]:
    import lightning.pytorch as L
    import torch

    from memfit.integrations.lightning import MemfitCallback

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = setup.model()
            self.batch_size = EFFECTIVE
            self.ids = setup.data(EFFECTIVE * steps)

        def train_dataloader(self) -> Any:
            dataset = torch.utils.data.TensorDataset(self.ids)
            return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    module = LM()
    if mode == "recover" and not setup.gpu:
        _inject_oom_above(module.model, EFFECTIVE // 4)
    callback = MemfitCallback(budget=budget_bytes if mode == "planned" else None)
    trainer = L.Trainer(accelerator="gpu" if setup.gpu else "cpu", devices=1, max_steps=steps,
                        accumulate_grad_batches=1, precision="bf16-mixed" if setup.gpu else "32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(module)
    guard = callback.window_guard
    return {"plan": callback.plan.chosen.config.label() if callback.plan else None,
            "plan_device_bytes": callback.plan.chosen.device_bytes if callback.plan else None,
            "micro_batch": module.batch_size, "accumulation_steps": trainer.accumulate_grad_batches,
            "optimizer_steps": trainer.global_step, "ooms": guard.ooms if guard else None,
            "final_piece_size": guard.size if guard else None}


def _hf_arguments(setup: Setup, out: Path, **changes: Any) -> Any:
    import transformers

    settings: dict[str, Any] = dict(
        output_dir=str(out / "hf_tmp"), per_device_train_batch_size=EFFECTIVE, gradient_accumulation_steps=1,
        learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        seed=0, disable_tqdm=True, bf16=setup.gpu, use_cpu=not setup.gpu,
    )
    settings.update(changes)
    return transformers.TrainingArguments(**settings)


class _Tokens:
    def __init__(self, ids: Any) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_huggingface(setup: Setup, mode: str, budget_bytes: int, steps: int, out: Path) -> dict[str, Any]:
    from memfit.integrations.huggingface import MemfitTrainer, plan_training_arguments

    model = setup.model()
    ids = setup.data(EFFECTIVE * steps)
    args = _hf_arguments(setup, out, max_steps=steps)
    summary = None
    if mode == "planned":
        batch = {"input_ids": ids[:EFFECTIVE], "labels": ids[:EFFECTIVE]}
        args, summary = plan_training_arguments(model, args, batch, budget=budget_bytes)
    elif not setup.gpu:
        _inject_oom_above(model, EFFECTIVE // 4)
    trainer = MemfitTrainer(model=model, args=args, train_dataset=_Tokens(ids))
    trainer.train()
    guard = trainer.memfit_guard
    return {"plan": summary, "micro_batch": args.per_device_train_batch_size,
            "accumulation_steps": args.gradient_accumulation_steps, "optimizer_steps": trainer.state.global_step,
            "ooms": guard.ooms if guard else None, "final_piece_size": guard.size if guard else None}


def run_accelerate(setup: Setup, mode: str, budget_bytes: int, steps: int, out: Path) -> dict[str, Any]:
    import accelerate
    import torch

    from memfit.integrations.accelerate import find_executable_batch_size
    from memfit.integrations.huggingface import workload_from_model
    from memfit.plan.search import plan
    from memfit.workload.knobs import apply_checkpointing

    ids = setup.data(EFFECTIVE * steps)
    micro, acc, checkpoint, fused, label, need = EFFECTIVE, 1, (), False, None, None
    if mode == "planned":
        example = setup.model()
        args = _hf_arguments(setup, out)
        workload = workload_from_model(example, args, {"input_ids": ids[:EFFECTIVE], "labels": ids[:EFFECTIVE]})
        # the roofline, as the committed results were planned (on the device, plan's default would calibrate)
        chosen = plan(workload, budget_bytes=budget_bytes, effective_batch=EFFECTIVE, calibration="roofline")
        config = chosen.chosen.config
        micro, acc, checkpoint = config.micro_batch, config.accumulation_steps, config.checkpoint
        fused, label, need = config.optimizer_impl == "fused", config.label(), chosen.chosen.device_bytes
        del example
    # after the plan: TrainingArguments (used to describe the step) resets Accelerate's shared state
    accelerator = accelerate.Accelerator(mixed_precision="bf16" if setup.gpu else "no", cpu=not setup.gpu)
    state: dict[str, Any] = {"attempts": []}

    @find_executable_batch_size(starting_batch_size=micro, starting_accumulation_steps=acc, accelerator=accelerator)
    def train(batch_size: int, gradient_accumulation_steps: int) -> int:
        state["attempts"].append([batch_size, gradient_accumulation_steps])
        accelerator.free_memory()
        model = setup.model()
        if checkpoint:
            apply_checkpointing(model, checkpoint)
        if mode == "recover" and not setup.gpu:
            _inject_oom_above(model, EFFECTIVE // 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        taken = 0
        for (batch,) in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=batch, labels=batch).loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            taken += int(accelerator.sync_gradients)
        return taken

    taken = train()
    final = state["attempts"][-1]
    return {"plan": label, "plan_device_bytes": need, "micro_batch": final[0], "accumulation_steps": final[1],
            "optimizer_steps": taken, "ooms": len(state["attempts"]) - 1, "attempts": state["attempts"]}


def one_run(integration: str, mode: str, device: str, budget_bytes: int, steps: int, out: Path) -> dict[str, Any]:
    """Run one integration in this process under the cap; the record, also when it fails."""
    import torch

    setup = Setup(device)
    record: dict[str, Any] = {"integration": integration, "mode": mode, "device": device, "budget_bytes": budget_bytes,
                              "effective_batch": EFFECTIVE, "steps": steps, "torch": torch.__version__}
    for name in NEEDED:
        record[f"{name}_version"] = __import__(name).__version__
    if setup.gpu:
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # the context and cuBLAS's handle
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        context = total - free - torch.cuda.memory_reserved()
        cap = budget_bytes - context
        torch.cuda.set_per_process_memory_fraction(cap / total)
        torch.cuda.reset_peak_memory_stats()
        record.update(gpu=torch.cuda.get_device_name(), context_bytes=context, cap_bytes=cap, total_bytes=total)
    started = time.perf_counter()
    try:
        runner = {"lightning": lambda: run_lightning(setup, mode, budget_bytes, steps),
                  "huggingface": lambda: run_huggingface(setup, mode, budget_bytes, steps, out),
                  "accelerate": lambda: run_accelerate(setup, mode, budget_bytes, steps, out)}[integration]
        record.update(runner())
        record["ok"] = record.get("optimizer_steps") == steps
        record["error"] = None if record["ok"] else f"{record.get('optimizer_steps')} of {steps} optimizer steps"
    except Exception as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500],
                      traceback=traceback.format_exc()[-3000:])
    record["elapsed_s"] = round(time.perf_counter() - started, 2)
    if setup.gpu:
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        record["under_cap"] = record["peak_reserved_bytes"] <= record["cap_bytes"]
    return record


# ------------------------------------------------------------------------------------------------ driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/integrations")))
    parser.add_argument("--budget", default="16GiB", help="device memory per run, CUDA context included")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # "integration:mode", the child process
    opts = parser.parse_args()
    missing = missing_packages()
    if missing:
        print(f"missing packages: {', '.join(missing)}. Install the wheels carried in .whl (they were downloaded "
              "for Python 3.12 with their dependencies, torch excluded):\n"
              "    pip install --no-index --find-links .whl lightning transformers accelerate", file=sys.stderr)
        return 2
    from memfit.units import parse_bytes

    budget_bytes = parse_bytes(opts.budget)
    if opts.only:
        integration, mode = opts.only.split(":")
        print(json.dumps(one_run(integration, mode, opts.device, budget_bytes, opts.steps, opts.out)))
        return 0
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a dry run", file=sys.stderr)
        return 2
    from _results import card, torch_tag
    from memfit._io import write_atomic

    opts.out.mkdir(parents=True, exist_ok=True)
    records = []
    for integration in INTEGRATIONS:
        for mode in MODES:
            command = [sys.executable, __file__, "--only", f"{integration}:{mode}", "--budget", opts.budget,
                       "--steps", str(opts.steps), "--device", opts.device, "--out", str(opts.out)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            record = json.loads(lines[-1]) if lines else {
                "integration": integration, "mode": mode, "ok": False,
                "error": f"the run exited {done.returncode}", "stderr": done.stderr[-3000:]}
            records.append(record)
            print(f"{integration:12s} {mode:8s} ok={record.get('ok')} ooms={record.get('ooms')} "
                  f"micro={record.get('micro_batch')}x{record.get('accumulation_steps')} "
                  f"peak_reserved={record.get('peak_reserved_bytes')} cap={record.get('cap_bytes')} "
                  f"error={record.get('error')}", flush=True)
    machine = card(torch.cuda.get_device_name() if opts.device == "cuda" else None)
    name = f"integrations_{machine}_{torch_tag(torch.__version__)}_{dt.date.today():%Y%m%d}.json"
    payload = {"schema": 1, "benchmark": "integrations", "budget": opts.budget, "records": records}
    path = write_atomic(opts.out / name, json.dumps(payload, indent=2), what="the results")
    print(f"wrote {path}")
    return 0 if all(r.get("ok") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
