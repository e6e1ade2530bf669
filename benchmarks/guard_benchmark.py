"""Benchmark and proof for ``memfit guard`` on a real GPU (one, or two with ``--distributed``).

Measures, on a small GPT-style transformer built from torch alone (bf16 autocast, AdamW):

(a) recovery: a cap from ``torch.cuda.set_per_process_memory_fraction`` makes the whole batch run out of memory
    while a quarter of it fits; training continues, and after N steps the parameters equal those of a run that
    started at the size the guard found, on the same data from the same initial weights. Both runs use
    deterministic kernels (``torch.use_deterministic_algorithms``): by default cuDNN attention's backward is not
    deterministic, and AdamW turns its last-bit differences into whole-``lr`` differences wherever a gradient is
    near zero: without deterministic kernels two *clean* runs already differ by 0.55 (per-tensor max difference
    relative to the tensor's max) on the zero-initialised attention biases (H200, torch 2.11), which would hide
    a recovery bug. A repeat of the reference run gives the noise floor of the comparison;
(b) no leak: ``memory_allocated()`` right after each of 20 forced OOMs equals its value before the step;
(c) overhead without OOM against a hand-written accumulation loop on the same model and sizes, interleaved
    step by step with alternating order, after a warm-up, in several repeats; the median over repeats of the
    ratio of medians (target <= 1 %). The guard with ``on_nonfinite="ignore"`` is timed too, for information;
(d) the cost of one recovery, in clean-step times (target <= 2).

With ``--distributed`` and 2 GPUs it also runs 2 NCCL ranks (spawned here, no torchrun) where only rank 1 is
capped, and checks that both ranks end with identical parameters.

Usage (about 2 minutes on an H100)::

    PYTHONPATH=src python benchmarks/guard_benchmark.py [--out DIR] [--distributed]
    PYTHONPATH=src python benchmarks/guard_benchmark.py --device cpu   # dry run: injected OOMs, tiny model

Results: ``guard_<card>_torch<X.Y>_<yyyymmdd>.json`` and ``.md`` (``guard_2x<card>_...`` when the 2-rank check ran,
``guard_dry_run_cpu_...`` for ``--device cpu``) in ``--out`` (default ``$OUT``, else ``benchmarks/results/guard``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _results import RESULTS, card, stem
from memfit.guard.microbatch import count_tokens
from memfit.guard.step import TrainStep

SCHEMA = 1
PAD = -100
# Check (a): the largest difference between the guarded run and the reference, relative to how far training moved
# the parameters, that still counts as equal. bf16 keeps 8 significant bits (unit roundoff 2**-8 = 3.9e-3): allow
# a few roundings. With deterministic kernels the difference is exactly 0 (measured on the H200, torch 2.11); a
# recovery bug (a failed attempt's gradients kept, the RNG not restored) changes whole steps: 1e-1 and more.
BF16_RTOL_TO_UPDATE = 1e-2


# -- the model ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int  # the effective batch per step
    start_micro: int  # micro-batch size of the overhead comparison (fits without a cap)


GPU_SHAPE = Shape(vocab=8192, d_model=1024, layers=12, heads=16, seq=512, batch=64, start_micro=16)
CPU_SHAPE = Shape(vocab=64, d_model=32, layers=2, heads=4, seq=16, batch=16, start_micro=4)


class TinyGPT(nn.Module):
    """Pre-norm transformer language model; LayerNorm only, so results do not depend on the micro-batch."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Parameter(torch.zeros(s.seq, s.d_model))
        layer = nn.TransformerEncoderLayer(s.d_model, s.heads, 4 * s.d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, s.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(s.seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


def token_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten(), ignore_index=PAD)


def forward_tokens(module: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    return module(mb["tokens"])


def make_data(s: Shape, steps: int, device: torch.device, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        labels[:, -1] = PAD
        out.append({"tokens": tokens.to(device), "labels": labels.to(device)})
    return out


def make_model(s: Shape, device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(s).to(device)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with its state created now: lazy creation in the first step() is a classic first-step OOM."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    decay = [g["weight_decay"] for g in opt.param_groups]
    for group in opt.param_groups:
        group["weight_decay"] = 0.0  # with zero gradients and no decay, this step leaves parameters unchanged
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for group, wd in zip(opt.param_groups, decay):
        group["weight_decay"] = wd
    return opt


# -- helpers --------------------------------------------------------------------------------------------------


class Env:
    """The device, plus how to make it run out of memory: a real cap on CUDA, an injected OOM on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.fake_limit: int | None = None  # CPU dry run: micro-batches above this many samples "OOM"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def cap(self, cap_bytes: int | None, fake_limit: int | None) -> None:
        """Set (or lift, with None) the memory cap."""
        if self.cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(1.0 if cap_bytes is None else cap_bytes / total, self.device)
        else:
            self.fake_limit = fake_limit

    def forward(self, module: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.fake_limit is not None and mb["tokens"].shape[0] > self.fake_limit:
            raise torch.OutOfMemoryError("CUDA out of memory. (injected by the --device cpu dry run)")
        return module(mb["tokens"])


def guard_for(model: nn.Module, opt: torch.optim.Optimizer, env: Env, micro: int | None,
              **options: Any) -> TrainStep:
    return TrainStep(model, opt, token_loss, forward_fn=env.forward, precision="bf16", micro_batch_size=micro,
                     count_fn=count_tokens("labels", ignore_index=PAD), **options)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels (cuDNN attention's backward included), only for the runs that are compared.

    cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG``, set by ``main`` before CUDA starts.
    """
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def param_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def compare(run: torch.Tensor, reference: torch.Tensor, initial: torch.Tensor) -> dict[str, Any]:
    """How far ``run`` is from ``reference``: absolute, relative to the largest parameter, relative to the update.

    Relative to the update (how far training moved the reference from ``initial``) is the one to judge: the
    parameters themselves are dominated by their initial values, and a per-tensor ratio is meaningless for tensors
    that start at zero (attention biases), which after a few AdamW steps are a few ``lr`` in size.
    """
    diff = run - reference
    return {
        "bitwise_equal": bool(torch.equal(run, reference)),
        "max_abs_diff": float(diff.abs().max()),
        "max_rel_diff": float(diff.abs().max()) / (float(reference.abs().max()) or 1.0),
        "rel_diff_to_update": float(diff.norm()) / (float((reference - initial).norm()) or 1.0),
    }


def restart_at(step: TrainStep, micro: int | None) -> None:
    """Forget what the guard learned, so the next step starts at ``micro`` again (a forced OOM)."""
    state = step.state_dict()
    step.load_state_dict({**state, "micro_batch_size": micro, "failed_sizes": []})


def hand_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], micro: int,
              device: torch.device) -> float:
    """The loop users write by hand: accumulate token-weighted micro-batch losses, one step, read the loss."""
    opt.zero_grad(set_to_none=True)
    tokens, labels = batch["tokens"].split(micro), batch["labels"].split(micro)
    counts = torch.stack([(y != PAD).sum() for y in labels]).tolist()  # one sync, like the guard
    total = sum(counts)
    loss_sum = torch.zeros((), device=device)
    for t, y, count in zip(tokens, labels, counts):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = token_loss(model(t), {"labels": y})
        weight = count / total
        (loss * weight).backward()
        loss_sum += loss.detach() * weight
    opt.step()
    return float(loss_sum)


class AllocatedAtRecovery(logging.Handler):
    """Reads memory_allocated() when the guard logs a shrink, i.e. right after its cleanup."""

    def __init__(self, env: Env) -> None:
        super().__init__(logging.WARNING)
        self.env, self.values = env, []

    def emit(self, record: logging.LogRecord) -> None:
        if "micro-batch size" in record.getMessage():
            self.values.append(self.env.allocated())


# -- the measurements -----------------------------------------------------------------------------------------


def calibrate_cap(s: Shape, base: nn.Module, data: list[dict[str, torch.Tensor]], env: Env) -> dict[str, int]:
    """Cap = what one step at ``start_micro`` needs, plus 40 %: that size fits, twice it does not."""
    model = copy.deepcopy(base)
    probe = guard_for(model, make_optimizer(model), env, s.start_micro)
    probe(data[0])  # warm-up: cuBLAS workspaces, kernels chosen
    probe.optimizer.zero_grad(set_to_none=True)
    env.sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(env.device)
    before = torch.cuda.memory_allocated(env.device)
    reserved = torch.cuda.memory_reserved(env.device)
    probe(data[1])
    peak = torch.cuda.max_memory_allocated(env.device)
    del probe, model
    torch.cuda.empty_cache()
    # grads + activations at start_micro, times 1.4; twice the micro-batch adds ~activations, more than 40 %
    cap = reserved + int(1.4 * (peak - before))
    return {"allocated_before_step_bytes": before, "reserved_before_step_bytes": reserved, "peak_bytes": peak,
            "cap_bytes": cap}


def measure_single(s: Shape, env: Env, log: logging.Logger) -> dict[str, Any]:
    device = env.device
    base = make_model(s, device)
    data = make_data(s, 6, device)
    results: dict[str, Any] = {}
    cap_bytes = None
    if env.cuda:
        results["calibration"] = calibrate_cap(s, base, data, env)
        cap_bytes = results["calibration"]["cap_bytes"]

    # (a) under the cap, starting from the whole batch
    model = copy.deepcopy(base)
    step = guard_for(model, make_optimizer(model), env, None)
    steps_a = 5
    env.sync()
    if env.cuda:
        torch.cuda.empty_cache()  # the cap counts reserved memory: start from what is really in use
    env.cap(cap_bytes, fake_limit=s.start_micro)
    try:
        with deterministic():
            sizes_a = [step(b).micro_batch_size for b in data[:steps_a]]
        ooms_a, found = step.total_ooms, step.micro_batch_size
        params_a = param_vector(model)
        log.info("(a) sizes %s, %d OOMs", sizes_a, ooms_a)

        # (b) 20 forced OOMs; memory read right after each cleanup, compared with the step's start
        handler = AllocatedAtRecovery(env)
        logging.getLogger("memfit.guard.step").addHandler(handler)
        leaks: list[int | None] = []
        forced, i = 0, 0
        try:
            while forced < 20 and i < 40:
                restart_at(step, s.batch)
                handler.values.clear()
                step.optimizer.zero_grad(set_to_none=True)
                env.sync()
                baseline = env.allocated()
                forced += step(data[i % len(data)]).ooms
                leaks += [None if v is None or baseline is None else v - baseline for v in handler.values]
                i += 1
        finally:
            logging.getLogger("memfit.guard.step").removeHandler(handler)
        log.info("(b) %d forced OOMs, allocated - baseline: %s", forced, sorted(set(leaks), key=str))

        # (d) a step that first fails at twice the found size, vs a clean step at the found size
        clean_s: list[float] = []
        recovery_s: list[float] = []
        if found is None:  # the cap did not bite: (a) fails below; time (d) at half the batch instead
            log.warning("(a) no OOM under the cap; the calibration is off for this card")
            found = s.batch // 2
        for i in range(6):
            for forced_oom in (False, True):
                restart_at(step, found * 2 if forced_oom else found)
                env.sync()
                t0 = time.perf_counter()
                ooms = step(data[i % len(data)]).ooms
                env.sync()
                if i > 0:  # the first pair warms up the slow path
                    (recovery_s if forced_oom else clean_s).append(time.perf_counter() - t0)
                if ooms != int(forced_oom):
                    log.warning("(d) expected %d OOMs, got %d", int(forced_oom), ooms)
    finally:
        env.cap(None, fake_limit=None)
    del step, model
    if env.cuda:
        torch.cuda.empty_cache()

    # reference for (a): the same batches from the same weights, starting at the found size, no cap; run twice,
    # the second time to measure how far two runs that should be identical are apart (the noise floor)
    references: list[torch.Tensor] = []
    ref_sizes: list[int | None] = []
    for _ in range(2):
        ref_model = copy.deepcopy(base)
        ref_step = guard_for(ref_model, make_optimizer(ref_model), env, found)
        with deterministic():
            ref_sizes = [ref_step(b).micro_batch_size for b in data[:steps_a]]
        references.append(param_vector(ref_model))
        del ref_step, ref_model
    initial = param_vector(base)
    vs_reference = compare(params_a, references[0], initial)
    noise_floor = compare(references[1], references[0], initial)
    del params_a, references, initial
    results["a_recovery"] = {
        "batch": s.batch, "sizes_per_step": sizes_a, "found_micro_batch_size": found, "ooms": ooms_a,
        "reference_sizes": ref_sizes, "deterministic_kernels": True, **vs_reference,
        "noise_floor": noise_floor, "rel_diff_to_update_tolerance": BF16_RTOL_TO_UPDATE,
        "pass": (ooms_a >= 1 and found < s.batch and sizes_a[-1] == found
                 and vs_reference["rel_diff_to_update"] <= BF16_RTOL_TO_UPDATE),
    }
    log.info("(a) vs reference %s; noise floor %s", vs_reference, noise_floor)
    results["b_leak"] = {
        "forced_ooms": forced, "allocated_minus_baseline_bytes": leaks,
        "pass": env.cuda and forced >= 20 and all(v == 0 for v in leaks),
    }
    clean_med, rec_med = statistics.median(clean_s), statistics.median(recovery_s)
    cost = (rec_med - clean_med) / clean_med
    results["d_recovery_cost"] = {
        "clean_step_s": clean_s, "step_with_one_recovery_s": recovery_s,
        "recovery_cost_in_step_times": cost, "target": 2.0, "pass": cost <= 2.0,
    }

    # (c) overhead without OOM: guard vs hand loop, interleaved on the same model and optimizer. Each round runs
    # every arm once, in a rotated order (drift and "who runs after whom" hit all arms alike); each repeat gives
    # a ratio of medians; the reported overhead is the median over repeats.
    model = copy.deepcopy(base)
    opt = make_optimizer(model)
    arms = {
        "hand": lambda b: hand_step(model, opt, b, s.start_micro, device),
        "guard": guard_for(model, opt, env, s.start_micro),
        "guard_ignore_nonfinite": guard_for(model, opt, env, s.start_micro, on_nonfinite="ignore"),
    }
    names = list(arms)
    warmup, repeats, rounds = (10, 5, 10) if env.cuda else (1, 2, 3)
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(repeats)] for name in names}
    for i in range(warmup + repeats * rounds):
        batch = data[i % len(data)]
        for name in names[i % len(names):] + names[: i % len(names)]:
            env.sync()
            t0 = time.perf_counter()
            result = arms[name](batch)
            if not isinstance(result, float):
                result.loss  # noqa: B018 - read the loss (a sync), as the hand loop does
            env.sync()
            if i >= warmup:
                times[name][(i - warmup) // rounds].append(time.perf_counter() - t0)

    def overhead_of(name: str) -> tuple[float, list[float]]:
        per_repeat = [statistics.median(g) / statistics.median(h) - 1 for g, h in zip(times[name], times["hand"])]
        return statistics.median(per_repeat), per_repeat

    overhead, per_repeat = overhead_of("guard")
    overhead_ignore, _ = overhead_of("guard_ignore_nonfinite")
    flat = {name: [t for rep in times[name] for t in rep] for name in names}
    results["c_overhead"] = {
        "micro_batch_size": s.start_micro, "warmup_rounds": warmup, "repeats": repeats, "rounds": rounds,
        "hand_step_s": flat["hand"], "guard_step_s": flat["guard"],
        "guard_ignore_nonfinite_step_s": flat["guard_ignore_nonfinite"],
        "hand_median_s": statistics.median(flat["hand"]), "guard_median_s": statistics.median(flat["guard"]),
        "overhead_per_repeat": per_repeat, "overhead": overhead,
        "overhead_ignore_nonfinite": overhead_ignore,
        "target": 0.01, "pass": overhead <= 0.01,
    }
    log.info("single-device measurements done")
    return results


# -- distributed: 2 ranks, NCCL, only rank 1 capped -----------------------------------------------------------


def _rank_run(label: str, rank: int, s: Shape, device: torch.device, env: Env, half: int, data: list,
              results: dict[str, Any], found: int | None) -> int | None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(s, device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
    step = TrainStep(ddp, make_optimizer(model), token_loss, forward_fn=env.forward, precision="bf16",
                     count_fn=count_tokens("labels", ignore_index=PAD), agree_timeout_s=120)
    # warm-up step at the whole per-rank batch, uncapped, identical in both runs
    if env.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = env.allocated()
    step(data[0])
    cap_bytes = None
    if label == "capped_rank1" and rank == 1 and env.cuda:
        assert before is not None
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.empty_cache()
        # 60 % of what the whole batch needed: half the batch fits, the whole does not
        cap_bytes = torch.cuda.memory_reserved(device) + int(0.6 * (peak - before))
    if label == "reference":
        restart_at(step, found)  # start where the capped run settled
    env.cap(cap_bytes, fake_limit=half // 2 if label == "capped_rank1" and rank == 1 else None)
    try:
        sizes = [step(b).micro_batch_size for b in data[1:]]
    finally:
        env.cap(None, fake_limit=None)
    found = step.micro_batch_size if label == "capped_rank1" else found
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    results[label] = {"sizes": sizes, "ooms": step.total_ooms,
                      "identical_across_ranks": bool(torch.equal(flat, other)), "params": flat.cpu()}
    del step, ddp, model, flat, other
    return found


def _rank_main(rank: int, port: int, s: Shape, out_file: str, device_type: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"  # gloo: the --device cpu dry run
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    env = Env(device)
    half = s.batch // 2
    data = [{k: v[rank * half:(rank + 1) * half] for k, v in b.items()} for b in make_data(s, 4, device)]
    results: dict[str, Any] = {}
    found = None
    for label in ("capped_rank1", "reference"):
        with deterministic():  # both runs compared bit for bit: no cuDNN-attention backward noise
            found = _rank_run(label, rank, s, device, env, half, data, results, found)
    if rank == 0:
        diff = float((results["capped_rank1"]["params"] - results["reference"]["params"]).abs().max())
        summary: dict[str, Any] = {k: {kk: vv for kk, vv in v.items() if kk != "params"} for k, v in results.items()}
        summary["max_abs_diff_capped_vs_reference"] = diff
        Path(out_file).write_text(json.dumps(summary))
    dist.destroy_process_group()


def measure_distributed(s: Shape, device_type: str) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "dist.json")
        mp.spawn(_rank_main, args=(port, s, out_file, device_type), nprocs=2, join=True)
        summary = json.loads(Path(out_file).read_text())
    capped = summary["capped_rank1"]
    summary["pass"] = bool(capped["identical_across_ranks"] and summary["reference"]["identical_across_ranks"]
                           and capped["ooms"] >= 1 and summary["max_abs_diff_capped_vs_reference"] <= 1e-5)
    return summary


# -- report ---------------------------------------------------------------------------------------------------


def render_markdown(report: dict[str, Any]) -> str:
    r = report["results"]
    lines = [
        f"# memfit guard benchmark — {report['device_name']}",
        "",
        f"date {report['date']}, torch {report['torch']}, CUDA {report['cuda']}, model {report['model']}",
        "",
    ]
    for section, error in r.get("errors", {}).items():
        lines += [f"**{section} failed:**", "", "```", error.strip(), "```", ""]
    if "a_recovery" not in r:
        return "\n".join(lines)
    lines += ["| check | result | target | pass |", "| --- | --- | --- | --- |"]
    a, b, c, d = r["a_recovery"], r["b_leak"], r["c_overhead"], r["d_recovery_cost"]
    lines.append(f"| (a) recovery under a cap | sizes {a['sizes_per_step']}, {a['ooms']} OOMs; vs start-at-"
                 f"{a['found_micro_batch_size']} run: bitwise equal {a['bitwise_equal']}, max abs diff "
                 f"{a['max_abs_diff']:.2e}, max rel {a['max_rel_diff']:.2e}, rel. to update "
                 f"{a['rel_diff_to_update']:.2e} (noise floor {a['noise_floor']['rel_diff_to_update']:.2e}) | "
                 f"continue, rel. to update <= {a['rel_diff_to_update_tolerance']:.0e} | {a['pass']} |")
    nonzero = [v for v in b["allocated_minus_baseline_bytes"] if v]
    lines.append(f"| (b) leak after forced OOMs | {b['forced_ooms']} OOMs, {len(nonzero)} with allocated != "
                 f"baseline {nonzero[:5]} | 0 bytes | {b['pass']} |")
    lines.append(f"| (c) overhead without OOM | guard {c['guard_median_s'] * 1e3:.2f} ms vs hand "
                 f"{c['hand_median_s'] * 1e3:.2f} ms: {c['overhead'] * 100:+.2f} % (median of "
                 f"{c['repeats']} repeats; on_nonfinite='ignore': {c['overhead_ignore_nonfinite'] * 100:+.2f} %) | "
                 f"<= 1 % | {c['pass']} |")
    lines.append(f"| (d) cost of one recovery | {d['recovery_cost_in_step_times']:.2f} step times | <= 2 | "
                 f"{d['pass']} |")
    if isinstance(r.get("distributed"), dict):
        dd = r["distributed"]
        lines.append(f"| 2-rank DDP, rank 1 capped | sizes {dd['capped_rank1']['sizes']}, identical ranks "
                     f"{dd['capped_rank1']['identical_across_ranks']}, max diff vs uncapped "
                     f"{dd['max_abs_diff_capped_vs_reference']:.2e} | identical | {dd['pass']} |")
    lines += ["", "Raw step times and per-OOM memory readings are in the JSON file beside this one.", ""]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS / "guard"),
                   help="directory for the JSON and markdown results (default: $OUT, else benchmarks/results/guard)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run on a tiny model with injected OOMs, to test this script")
    p.add_argument("--distributed", action="store_true",
                   help="also run the 2-rank check: NCCL on 2 GPUs, or gloo with --device cpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("guard_benchmark")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("No CUDA device: run on a GPU, or pass --device cpu for a dry run.", file=sys.stderr)
        return 2
    # Deterministic cuBLAS for check (a) needs this before CUDA starts; 8 x 4 MiB is also torch's default
    # workspace on sm90+ (CublasHandlePool.cpp), so it changes no timing on an H100/H200.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    started = time.perf_counter()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    # Keep going after a failure, so that the files always say what happened.
    try:
        results.update(measure_single(shape, Env(device), log))
    except Exception:
        errors["single"] = traceback.format_exc()
        log.error("single-device measurements failed:\n%s", errors["single"])
    if args.distributed:
        if device.type == "cuda" and torch.cuda.device_count() < 2:
            log.warning("--distributed needs 2 CUDA GPUs; skipped")
        else:
            try:
                results["distributed"] = measure_distributed(shape, device.type)
            except Exception:
                errors["distributed"] = traceback.format_exc()
                log.error("distributed check failed:\n%s", errors["distributed"])
    if errors:
        results["errors"] = errors
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-dry-run"
    today = datetime.date.today()
    report = {
        "schema": SCHEMA,
        "device_name": name,
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": today.isoformat(),
        "model": f"TinyGPT {shape}",
        "params": sum(p.numel() for p in TinyGPT(shape).parameters()),
        "wall_s": time.perf_counter() - started,
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = 2 if "distributed" in results else 1
    name_stem = (stem("guard", card(name, ranks), torch.__version__, today) if device.type == "cuda"
                 else stem("guard_dry_run", "cpu", torch.__version__, today))
    write_atomic(out / f"{name_stem}.json", json.dumps(report, indent=2, default=str))
    write_atomic(out / f"{name_stem}.md", render_markdown(report))
    print(render_markdown(report))
    print(f"wrote {out / name_stem}.json and .md")
    ok = not errors and all(v.get("pass", True) for k, v in results.items() if isinstance(v, dict) and k != "errors")
    return 0 if ok or (device.type == "cpu" and not errors) else 1


if __name__ == "__main__":
    sys.exit(main())
