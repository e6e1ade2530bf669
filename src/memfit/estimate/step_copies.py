"""Steps and micro-batches the tracer copies instead of tracing them again.

A step's forward and backward dispatch every op through the fake-tensor modes, the costliest part of a trace. Where
a later step or micro-batch provably allocates what an earlier one did (the same sizes, in the same order, handing
over the same tensors), the tracer appends a renamed copy of the earlier events instead of running it:

- ``replay_forward_backward``: step 1's forward and backward, copied from step 0's (``run_steps``'s ``replay``);
- ``copy_micro_batch``: the third micro-batch of a step, copied from the second (``replay_micro``);
- ``repeat_last_step``: steps from the third on, copied from the second after the trace.

Each checks its condition on the events themselves and answers False where it does not hold: the tracer then
traces as usual. ``tests/test_trace.py`` compares each copy with the stream tracing gives.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from memfit.estimate.allocator import MIN_BLOCK_SIZE
from memfit.estimate.trace_record import Trace, output_tensors

if TYPE_CHECKING:
    from memfit.estimate.recorder import Recorder

__all__ = ["copy_micro_batch", "grad_keys", "repeat_last_step", "replay_forward_backward"]


def repeat_last_step(trace: Trace, times: int) -> bool:
    """Append ``times`` copies of the last traced step; False (trace untouched) if it is not a steady state."""
    marks = trace.phase_marks
    last = max(s for _, name, s in marks if name == "zero_grad")
    start = next(at for at, name, s in marks if name == "zero_grad" and s == last)
    end = len(trace.ops)
    ops, keys = trace.ops[start:end], trace.keys[start:end]
    born_at: dict[int, int] = {}
    alive: set[int] = set()
    for i, (o, k) in enumerate(zip(trace.ops, trace.keys)):
        if o > 0:
            born_at[k] = i
            alive.add(k)
        else:
            alive.discard(k)
    born_here = {k for o, k in zip(ops, keys) if o > 0}
    # what the step frees that earlier steps made (last step's grads...) must match what it leaves behind
    handed_in = sorted((k for o, k in zip(ops, keys) if o < 0 and k not in born_here), key=born_at.__getitem__)
    handed_out = sorted((k for k in born_here if k in alive), key=born_at.__getitem__)
    allocs = trace.allocs
    if len(handed_in) != len(handed_out) or any(
        allocs[a].nbytes != allocs[b].nbytes for a, b in zip(handed_in, handed_out)
    ):
        return False
    step_marks = [(at - start, name, s) for at, name, s in marks if at >= start and name != "end"]
    end_mark = marks[-1]
    del marks[-1]
    carry = dict(zip(handed_in, handed_out))
    for rep in range(1, times + 1):
        offset = len(trace.ops)
        marks.extend((offset + at, name, s + rep) for at, name, s in step_marks)
        renamed: dict[int, int] = {}
        for o, k in zip(ops, keys):
            if o > 0:
                new = len(allocs)
                allocs.append(dataclasses.replace(allocs[k], step=allocs[k].step + rep))
                renamed[k] = new
                trace.ops.append(1)
                trace.keys.append(new)
            else:
                trace.ops.append(-1)
                trace.keys.append(renamed[k] if k in renamed else carry[k])
        carry = {k_in: renamed[k_out] for k_in, k_out in zip(handed_in, handed_out)}
    marks.append((len(trace.ops), "end", end_mark[2] + times))
    return True


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def grad_keys(recorder: Recorder, optimizer: torch.optim.Optimizer) -> list[tuple[int, int]] | None:
    """Which allocation holds each parameter's grad; None if one is not a plain tracked tensor of its own."""
    found = []
    for i, p in enumerate(_params(optimizer)):
        if p.grad is None:
            continue
        key = recorder.key_of(p.grad.untyped_storage()) if p.grad.layout == torch.strided else None
        if key is None or recorder.trace.allocs[key].nbytes != p.numel() * p.element_size():
            return None
        found.append((i, key))
    return found if len({k for _, k in found}) == len(found) else None


def _window_lifetimes(trace: Trace, start: int, end: int) -> tuple[set[int], set[int], list[int]]:
    """Of the events ``start:end``: the keys they allocated, those of them still alive at ``end``, and the keys
    made before ``start`` that they freed, in the order freed."""
    born: set[int] = set()
    alive: set[int] = set()
    earlier: list[int] = []
    for o, k in zip(trace.ops[start:end], trace.keys[start:end], strict=True):
        if o > 0:
            born.add(k)
            alive.add(k)
        elif k in born:
            alive.discard(k)
        else:
            earlier.append(k)
    return born, alive, earlier


def copy_micro_batch(recorder: Recorder, step: int, held: list[Any]) -> bool:
    """Account for the next micro-batch of ``step`` by copying the events of the last one, which has just ended.

    A micro-batch from the second on runs with the grads alive and accumulates into them in place: it allocates
    what the one before it did. The copy holds if the second micro-batch left nothing alive but what the plain
    loop holds (its output and loss) and freed nothing made before it but what the first one held; its events
    are then appended under new keys, the held output and loss of the micro-batch before freed where a traced one
    frees them, and ``held`` given storages of the same sizes under the copy's keys. Otherwise (False) the
    micro-batch is traced.
    """
    trace = recorder.trace
    forwards = [at for at, name, s in trace.phase_marks if name == "forward" and s == step]
    if len(forwards) < 2:
        return False
    start, end = forwards[-1], len(trace.ops)  # the last micro-batch, traced or copied
    held_storages = [t.untyped_storage() for t in output_tensors(held)]
    found = [recorder.key_of(st) for st in held_storages]
    held_keys = [k for k in found if k is not None]
    if len(held_keys) != len(found):
        return False
    # what the first micro-batch held, in the order the second freed it
    _, alive, earlier_freed = _window_lifetimes(trace, start, end)
    now_held = list(reversed(held_keys))  # the protocol lets go of the last held first
    if alive != set(held_keys) or len(earlier_freed) != len(now_held) or any(
            trace.allocs[a].nbytes != trace.allocs[b].nbytes for a, b in zip(earlier_freed, now_held)):
        return False
    instead = dict(zip(earlier_freed, now_held))
    renamed: dict[int, int] = {}
    moved: list[int] = []
    for o, k in zip(trace.ops[start:end], trace.keys[start:end], strict=True):
        moved.append(len(trace.ops))
        if o > 0:
            renamed[k] = len(trace.allocs)
            trace.allocs.append(copy.copy(trace.allocs[k]))
            trace.ops.append(o)
            trace.keys.append(renamed[k])
        else:
            trace.ops.append(-1)
            trace.keys.append(renamed[k] if k in renamed else instead[k])
    trace.phase_marks.extend([(moved[at - start], name, s) for at, name, s in trace.phase_marks
                              if s == step and start <= at < end])
    recorder.silent = True
    try:
        _hand_over_held(recorder, held, held_storages, [renamed[k] for k in held_keys])
    finally:
        recorder.silent = False
    return True


def _hand_over_held(recorder: Recorder, held: list[Any], freed: list[Any], copied_keys: list[int]) -> None:
    """After copied events: the plain loop's held output and loss (``freed``, whose frees are in the copy) give way
    to storages of the same sizes under the copy's keys, freed where the next forward (or the loop's end) lets go
    of them."""
    for storage in freed:
        recorder.disown(storage)
    stand_ins = []
    for key in copied_keys:
        stand_in = torch.empty(recorder.trace.allocs[key].nbytes, dtype=torch.uint8)
        recorder.own(stand_in.untyped_storage(), key)
        stand_ins.append(stand_in)
    held[:] = stand_ins


KEPT_MAX_SHARE = 0.005
"""What the first step's forward and backward may leave alive beyond the grads, the held output and the workspaces
for its copy to be taken (``kept_is_small``), as a share of the step's peak of live bytes. Such tensors are a
module's (Mask2Former's position embeddings, 4.7 MB, which the next forward replaces; Hugging Face's RT-DETR anchors,
0.5 MB, cached; a GradScaler's scale). The copy makes them again and frees the earlier ones at its end: where the
next forward replaces them sooner or reuses them, it over-counts their bytes for a while, no more. Were they a leak
instead (a list of per-step outputs kept by the model), each later step would add its own, which the bound covers
(``step_kept``, twice their bytes: the two steps after the first)."""


def _kept_bytes(trace: Trace, keys: set[int]) -> int:
    """What ``keys`` take of a peak, as the caching allocator rounds them (kMinBlockSize)."""
    return sum(-(-max(trace.allocs[k].nbytes, MIN_BLOCK_SIZE) // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE for k in keys)


def kept_is_small(trace: Trace, keys: set[int], end: int) -> bool:
    """``keys`` (allocations of the first step's forward and backward still alive at event ``end``) are small enough
    for the copy to treat as handed over from step to step (``KEPT_MAX_SHARE``)."""
    if not keys:
        return True
    live = peak = 0
    for o, k in zip(trace.ops[:end], trace.keys[:end], strict=True):
        live += o * trace.allocs[k].nbytes
        peak = max(peak, live)
    return _kept_bytes(trace, keys) <= KEPT_MAX_SHARE * peak


def _name_kept(trace: Trace, keys: set[int]) -> None:
    """The bound's reason for ``keys`` taken as handed over, with the bytes another two of them would add."""
    nbytes = _kept_bytes(trace, keys)
    largest = trace.allocs[max(keys, key=lambda k: trace.allocs[k].nbytes)]
    trace.uncertain.setdefault("step_kept", (
        f"{len(keys)} tensor(s), {nbytes:,} bytes, made in the first step's forward or backward and kept after it "
        f"(the largest by {largest.op} in {largest.module or 'the step'}): taken as replaced by each later step's"))
    trace.uncertain_bytes["step_kept"] = 2 * nbytes


def replay_forward_backward(recorder: Recorder, optimizer: torch.optim.Optimizer, step: int,
                             held: list[Any]) -> bool:
    """Account for the forward and backward of ``step`` by copying the first step's instead of tracing them.

    The first step's forward and backward dispatch every op for the first time, and cost twice what later steps
    do; the second step runs them again only to put the same allocations in the stream with the optimizer state
    alive. They are the same allocations if what the first step's forward and backward leave behind is the
    grads (which ``zero_grad`` has just freed), the cuBLAS workspaces (made once per thread, not again) and a
    little the model keeps (``kept_is_small``: freed at the copy's end), and they free nothing made before them.
    Then the events, phase marks and op costs are copied (less the workspaces), the grads are made again without a
    trace (the optimizer reads them), under the keys of the copied grads, and the step goes on to its optimizer.
    Otherwise (False) the step is traced as usual.

    The plain loop (``keep_output``) also leaves the last output and loss behind, in ``held``; a traced step frees
    them once its forward has made the next output. The copy frees them at that point too, and puts in ``held``
    storages of the same sizes under the keys of the copied output and loss.
    """
    if step == 0 or recorder.grad_keys is None:
        return False
    held_storages = {k: t.untyped_storage() for t in output_tensors(held)
                     if (k := recorder.key_of(t.untyped_storage())) is not None}
    trace = recorder.trace
    marks = trace.phase_marks
    start = next(at for at, name, s in marks if name == "forward" and s == 0)
    end = next(at for at, name, s in marks if name == "optimizer" and s == 0)
    zero_grad = next(at for at, name, s in marks if name == "zero_grad" and s == step)
    born, alive, earlier_freed = _window_lifetimes(trace, start, end)
    if earlier_freed:
        return False  # frees something made before it: the next step may find another
    grads = dict(recorder.grad_keys)
    workspaces = {k for k in alive if trace.allocs[k].op == "cublas_workspace"}
    freed_by_zero_grad = {k for o, k in zip(trace.ops[zero_grad:], trace.keys[zero_grad:], strict=True) if o < 0}
    if step == 1:
        # what the plain loop holds of step 0's allocations (not of the batch, which was made before the step)
        recorder.held_keys = [k for k in held_storages if k in born]
    held_keys = recorder.held_keys
    held_now = held_keys if step == 1 else list(held_storages)
    carried = alive - workspaces - set(grads.values()) - set(held_keys)
    if freed_by_zero_grad != set(grads.values()) or not kept_is_small(trace, carried, end):
        return False
    if len(held_now) != len(held_keys) or any(
        trace.allocs[a].nbytes != trace.allocs[b].nbytes for a, b in zip(held_now, held_keys)
    ):
        return False
    if step == 1 and carried:
        recorder.kept = {k: (k, recorder.storage_of(k)) for k in carried}
        _name_kept(trace, carried)
    # where a traced step frees the last step's output: once its first forward has made the next one
    first_loss = next(at for at, name, s in marks if name == "loss" and s == 0)
    # the events, renamed; cuBLAS's workspaces exist already
    renamed: dict[int, int] = {}
    moved: list[int] = []  # the copy's index of each event of the first step
    for at, (o, k) in enumerate(zip(trace.ops[start:end], trace.keys[start:end], strict=True), start):
        if at == first_loss:
            for key in reversed(held_now):  # the protocol lets go of the last held first
                trace.ops.append(-1)
                trace.keys.append(key)
        moved.append(len(trace.ops))
        if k in workspaces:
            continue
        if o > 0:
            renamed[k] = len(trace.allocs)
            trace.allocs.append(dataclasses.replace(trace.allocs[k], step=step))
        trace.ops.append(o)
        trace.keys.append(renamed[k])
    # what the step before kept goes once this one has made its own (the latest a traced step could free it)
    for first, (previous, storage) in recorder.kept.items():
        trace.ops.append(-1)
        trace.keys.append(previous)
        if storage is not None:  # the model's tensor stands for the copy's from now on, freed already in the stream
            recorder.disown(storage)
            recorder.own(storage, renamed[first])
        recorder.kept[first] = (renamed[first], storage)
    moved.append(len(trace.ops))
    copied = ("forward", "loss", "backward")
    marks.extend([(moved[at - start], name, step) for at, name, s in marks
                  if s == 0 and name in copied and start <= at < end])
    cost_marks = recorder.costs.marks
    c_start = next(at for at, name, s in cost_marks if name == "forward" and s == 0)
    c_end = next(at for at, name, s in cost_marks if name == "optimizer" and s == 0)
    recorder.costs.splice(
        recorder.costs.rows[c_start:c_end],
        [(at - c_start, name, step) for at, name, s in cost_marks if s == 0 and name in copied and c_start <= at < c_end],
    )
    # the optimizer reads the grads: make them again, untraced, under the copied grads' keys
    params = _params(optimizer)
    recorder.silent = True
    try:
        with torch.no_grad():
            for i, key in grads.items():
                grad = torch.empty_like(params[i])
                storage = grad.untyped_storage()
                recorder.own(storage, renamed[key])
                params[i].grad = grad
            # the last output and loss: their frees are in the copy already
            _hand_over_held(recorder, held, [held_storages[k] for k in held_now], [renamed[k] for k in held_keys])
    finally:
        recorder.silent = False
    return True
