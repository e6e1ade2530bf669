"""Real values for the small tensors a training step computes from constants, so reading them is right.

Fake tensors have shapes and no values, so ``.item()``, ``.tolist()`` and ``bool()`` on them have no answer; a
trace that answers 0 changes what the code does next. Many real steps read values that do not depend on data
at all: MONAI's Dice losses take their reduction axes from ``torch.arange(2, ndim).tolist()``, timm's models
their drop-path rates from ``torch.linspace(0, rate, depth).tolist()``, torchvision's RegNet its stage widths from
``torch.arange`` arithmetic. Read as zeros, the first fails ("duplicate value in the list of dims"), the second
turns stochastic depth off, the third builds a model 100 times smaller, silently.

``KnownValues`` follows those values: a tensor made by a deterministic factory (``arange``, ``full``,
``linspace`` ...) from Python numbers, or a real (non-fake) tensor, has a known value, and so has the output of an
op whose tensor inputs all have known values — computed for real on the CPU, beside the fake op. Only small
tensors are followed (``MAX_NUMEL``), so the real work stays negligible next to the trace.

Writes follow aliasing as the real tensors do: the known views of one fake storage have real values that share
one real storage, so ``ret[1] = 300`` (a ``select`` and a ``copy_`` into it) writes into the real ``ret`` too, and
``int(ret[1])`` later reads 300. An op that writes values not known here makes every tensor of the storage it
writes into unknown, the views beside it included: a stale value would be read as if it were real.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memfit import _torch_private as tp

MAX_NUMEL = 1 << 16
"""Tensors of more elements are not followed: index and shape arithmetic is far smaller, data is far larger."""

BATCH_MAX_NUMEL = 1 << 24
"""The limit when the batch's values are followed too (a retry for a step whose sizes depend on the data): a batch
of images or of segmentation labels has millions of elements, and the ops on it before the model's first layer
(normalising, resizing, matching boxes to anchors) are cheap next to the model."""

# factories whose result depends on their arguments alone (no random numbers, no uninitialised memory)
_FACTORIES = frozenset(
    "arange linspace logspace full zeros ones scalar_tensor eye tensor lift_fresh_copy _to_copy".split()
)
# ops that must not run for real on known inputs: random numbers (but see ``KnownValues.run``), or their value is
# the fake tensor's own
_RANDOM = frozenset(
    "bernoulli bernoulli_ rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_ "
    "exponential_ multinomial random_".split()
)
_NEVER = _RANDOM | frozenset("empty empty_like empty_strided new_empty new_empty_strided".split())
# in-place ops whose result does not depend on the tensor they write into: torch.empty(()).fill_(stride) is known
_OVERWRITE = frozenset("fill_ zero_ copy_".split())


_MUTATED: dict[Any, tuple[int, ...]] = {}


def _mutated(func: Any) -> tuple[int, ...]:
    try:
        return _MUTATED[func]
    except KeyError:
        found = _MUTATED[func] = tp.op_mutated_arguments(func)
        return found


def small(out: Any, max_numel: int = MAX_NUMEL) -> bool:
    """Every tensor of an op's output is small enough to follow its value."""
    found = tensors(out)
    return bool(found) and all(t.numel() <= max_numel for t in found)


def tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of an op's arguments or output, nested lists and tuples flattened in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors(item)]
    return []


def _swap(x: Any, filled: torch.Tensor | None, value: Any) -> Any:
    """``x`` with each tensor replaced by ``value(tensor)``, and ``filled`` by fresh memory of its layout.

    A function of the module, not a closure of ``_real_args``: a closure that calls itself is a reference cycle
    (function, cell), which kept the fake tensors it saw (a Faster R-CNN's batched images) alive until Python's
    cyclic collector ran, so the trace freed them whenever the collector happened to run: with it off, never, and
    that estimate's peak was 61 MB higher (``estimate_time_hostcopies_cpu_torch2.14_20261128.md``).
    """
    if x is filled and isinstance(x, torch.Tensor):
        with tp.no_dispatch_modes():
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    if isinstance(x, torch.Tensor):
        return value(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_swap(i, filled, value) for i in x)
    return x


class KnownValues:
    """The real values of the fake tensors that have one (see the module docstring)."""

    def __init__(self, max_numel: int = MAX_NUMEL) -> None:
        self._real: Any = tp.WeakIdKeyDictionary()
        self._by_storage: Any = tp.WeakIdKeyDictionary()
        """fake storage -> {id: fake tensor over it with a known value} (weak values: a WeakSet would compare tensors
        with ``==``, an op): what a write there changes."""
        self.max_numel = max_numel
        """Tensors of more elements are not followed."""

    def small(self, out: Any) -> bool:
        """Every tensor of ``out`` is small enough to follow."""
        return small(out, self.max_numel)

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real CPU tensor ``t`` stands for, or None when its value is not known."""
        if not isinstance(t, tp.FakeTensor):
            return t  # a real tensor (a constant the user's code made outside the fake mode) is its own value
        return self._real.get(t)

    def _real_args(self, name: str, args: Any, kwargs: dict[str, Any], random: bool,
                   ) -> tuple[Any, dict[str, Any], torch.Tensor | None] | None:
        """``args`` and ``kwargs`` with every fake tensor replaced by its value, and the unknown tensor the op
        overwrites, which gets fresh memory instead (None if none); None if a tensor is unknown or big."""
        if name in _NEVER and not (random and name in _RANDOM):
            return None
        found = tensors(args) + tensors(list(kwargs.values()))
        if not found and name not in _FACTORIES and not random:
            return None
        # a fill (``torch.empty(()).fill_(n)``, an in-place random draw) overwrites its tensor: its old values do not
        # matter. A known one is written in place, so that the views beside it see the write (``ret[1] = 300``)
        overwrites = name in _OVERWRITE or (random and name in _RANDOM and name.endswith("_"))
        filled = args[0] if overwrites and args and self.value(args[0]) is None else None
        for t in found:
            if t.numel() > self.max_numel or (self.value(t) is None and t is not filled):
                return None

        return (_swap(args, filled, self.value),
                {k: _swap(v, filled, self.value) for k, v in kwargs.items()}, filled)

    def forget_written(self, func: Any, args: Any) -> None:
        """The op writes into some of its arguments with values not followed here: they are unknown now, and so is
        every other tensor over the same storage."""
        for i in _mutated(func):
            if i < len(args):
                for t in tensors(args[i]):
                    self._forget_storage(t)

    def _forget_storage(self, t: torch.Tensor) -> None:
        self._real.pop(t, None)
        if t.layout != torch.strided:
            return
        aliases = self._by_storage.pop(t.untyped_storage(), None)
        for alias in aliases.values() if aliases is not None else ():
            self._real.pop(alias, None)

    def run(self, func: Any, name: str, args: Any, kwargs: dict[str, Any], *, random: bool = False) -> Any:
        """The op's real result when all its inputs have known values, else None (and what the op writes into
        is unknown from now on). Call it only for ops with small outputs: a factory's output is not checked.
        ``random``: random ops run too, drawing from torch's CPU generator (a batch made for real)."""
        real = self._real_args(name, args, kwargs, random)
        if real is None:
            self.forget_written(func, args)
            return None
        real_args, real_kwargs, filled = real
        if filled is not None:
            # an unknown tensor overwritten into fresh memory: its value is known after the op, but the other
            # tensors over its storage hold values of which only part was written
            self._forget_storage(filled)
        with tp.no_dispatch_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            try:
                return func(*real_args, **real_kwargs)
            except Exception:  # the real op refuses what the fake one took (a device it cannot use): unknown
                return None

    def keep(self, fake_out: Any, real_out: Any) -> None:
        """Remember the values of ``fake_out``'s tensors (small ones only) from ``real_out``."""
        fakes, reals = tensors(fake_out), tensors(real_out)
        if len(fakes) != len(reals):
            return
        for f, r in zip(fakes, reals):
            if isinstance(f, tp.FakeTensor) and r.numel() <= self.max_numel and tuple(f.shape) == tuple(r.shape):
                self._real[f] = r
                if f.layout == torch.strided:
                    storage = f.untyped_storage()
                    aliases = self._by_storage.get(storage)
                    if aliases is None:
                        aliases = self._by_storage[storage] = weakref.WeakValueDictionary()
                    aliases[id(f)] = f

    def write_element(self, t: Any, index: Any, value: Any) -> bool:
        """``t[index] = value`` for a fake ``t`` with a known value, a Python number ``value`` and an index of
        Python ints in range: written into the known value alone, and True. The fake tensor needs no write (it
        has no values, and its shape, dtype and storage stay), so the ops FakeTensorMode would run for it (a
        ``select`` per index, a ``lift_fresh`` and a ``copy_``, about 0.25 ms an element on the 2-core CPU)
        are skipped. False, and nothing done, for anything else: the write then dispatches as usual."""
        if type(value) not in (int, float, bool) or not isinstance(t, tp.FakeTensor) or t.requires_grad:
            return False
        index = index if type(index) is tuple else (index,)
        if len(index) > t.dim() or getattr(t, "constant", None) is not None:
            return False
        for i, size in zip(index, t.shape):
            if type(i) is not int or not -size <= i < size:  # a bool, a slice, a tensor, or out of range
                return False
        real = self._real.get(t)
        if real is None:
            return False
        with tp.no_dispatch_modes():
            try:
                real[index] = value
            except (RuntimeError, OverflowError, TypeError, ValueError):  # the usual path raises what torch raises
                return False
        torch.autograd.graph.increment_version(t)  # as the in-place write would
        return True

    def scalar(self, t: torch.Tensor) -> Any | None:
        """``t.item()`` when ``t``'s value is known, else None."""
        real = self.value(t)
        if real is None:
            return None
        with tp.no_dispatch_modes():  # the fake mode would turn the real tensor into a fake one again
            return real.item()


class KnownElementWrites(TorchFunctionMode):
    """Element writes of Python numbers into tensors with known values (``KnownValues.write_element``) done on the
    known values alone. Active while the model is built: timm's MaxViT fills its relative-position lookup tables in
    its constructor with 2,156 writes ``ret[i, x, v] = 1``, which took about 3 of its 10 s estimate."""

    def __init__(self, known: KnownValues) -> None:
        super().__init__()
        self._known = known

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SETITEM and not kwargs and len(args) == 3 and self._known.write_element(*args):
            return None
        return func(*args, **(kwargs or {}))


_SETITEM = torch.Tensor.__setitem__
