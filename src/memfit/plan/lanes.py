"""A second lane of traces: a forked child process traces the configuration the search will probably want next.

A plan is a sequence of exact estimates, and most of an estimate's time is its trace (GPT-2 at a 5.5 GiB budget:
26 traces of 0.6-1.2 s each, 24 of the plan's 28-35 s on a 2-core CPU). Which configuration the walk settles next
depends on what the last estimate said, so the traces cannot be listed up front; but the search knows what it will
*probably* ask next (the next checkpointing choice of a structure, the second-fastest candidate's probe). This
module traces that in a child process on the other core while this one traces what it needs now. A guess that is
never asked for costs nothing but the other core's time.

The child is an ``os.fork`` of the planner at the moment of the guess, so it sees the workload and every cache as
they are, and traces with the same code; the ``Trace`` comes back pickled through a file it writes atomically
(about 1 MB for GPT-2: 35-60 ms to load, see ``_unpickle``). A trace is deterministic (a seeded batch, no wall
clock), so the plan is the same with and without the lane (``tests/test_plan_lanes.py``). What the child logged
(memfit's records, Python warnings) is kept with the trace and given to this process's logging and warnings only
when the trace is used, so a guess that is thrown away says nothing. A child that fails for any reason hands back
nothing, and the trace is made here, where its error is the user's to see.

Used only where a fork is safe and pays: POSIX, two or more CPUs for this process, no other Python thread (a
fork copies no other thread, so a lock another thread held would stay locked in the child: a planner called from
inside a training script with loader threads traces alone) but those declared harmless with ``threads_kept_out``
(the CLI's spinner), CUDA not initialised here (a forked child cannot use it; the planner's calibration may have).
The child writes to no stream this process had: its standard streams are /dev/null and every logger but its
own recorder is silenced, so it takes none of those locks. A child that has not finished ``CHILD_TIMEOUT_S`` after
it was asked for is stopped, the trace made here, and the lane closed for the rest of the plan.
``MEMFIT_PLAN_PROCESSES=1`` turns the lane off.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

__all__ = ["CHILD_TIMEOUT_S", "ENV_PROCESSES", "TraceLane", "lane_is_useful", "threads_kept_out"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

ENV_PROCESSES = "MEMFIT_PLAN_PROCESSES"
"""``1`` keeps every trace of a plan in this process."""

CHILD_TIMEOUT_S = 120.0
"""How long ``take`` waits for a child: above any trace the planner makes (the slowest seen, a torchvision
detector's with its real CPU forward, 22-40 s on 2 cores), so it only ends a child that cannot finish."""

_KEPT_OUT: set[int | None] = set()


@contextlib.contextmanager
def threads_kept_out(threads: Iterable[threading.Thread]) -> Iterator[None]:
    """While the block runs, ``threads`` do not keep the lane from forking: they share no lock with a trace (the
    CLI's spinner redraws the terminal, which a child never writes to)."""
    idents = {t.ident for t in threads} - _KEPT_OUT
    _KEPT_OUT.update(idents)
    try:
        yield
    finally:
        _KEPT_OUT.difference_update(idents)


def lane_is_useful() -> bool:
    """Whether a forked second lane can run here and would have a CPU of its own."""
    if os.environ.get(ENV_PROCESSES, "").strip() == "1" or not hasattr(os, "fork"):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS has no affinity call
        cpus = os.cpu_count() or 1
    others = {t.ident for t in threading.enumerate()} - {threading.main_thread().ident} - _KEPT_OUT
    if cpus < 2 or others:
        return False
    torch = sys.modules.get("torch")
    # a child of a process that initialised CUDA cannot use it, and a trace may ask about the device
    return not (torch is not None and torch.cuda.is_initialized())


@dataclass
class _Child:
    key: Any
    pid: int
    path: Path
    result: Any = None
    logged: list[logging.LogRecord] = field(default_factory=list)
    warned: list[tuple[str, type[Warning], str, int]] = field(default_factory=list)


class TraceLane(Generic[K, V]):
    """At most one child tracing a guessed key while this process works; ``take`` hands its trace over.

    ``make(key)`` makes the trace of ``key`` (never None); it is what the child runs. Keys are hashable
    configurations.
    """

    def __init__(self, make: Callable[[K], V]) -> None:
        self._make = make
        self._dir = Path(tempfile.mkdtemp(prefix="memfit-lane-"))
        self._child: _Child | None = None
        self._queue: list[K] = []
        self._skip: Callable[[K], bool] = lambda key: False
        self._ready: dict[K, _Child] = {}
        self._count = 0
        self._closed = False
        self.forked = 0
        """Children started (guesses made), for the tests and the plan's timing."""
        self.used = 0
        """Traces taken from a child instead of made here."""

    def guess(self, keys: Sequence[K], skip: Callable[[K], bool]) -> None:
        """Trace ``keys`` in the child as soon as it is free, *last first*: this process asks for them first to
        last and traces itself what the child has not started, so the two meet in the middle. A later guess
        replaces what has not started. ``skip(key)``: already traced here (checked again before each start)."""
        self._queue = [k for k in dict.fromkeys(keys) if not skip(k) and k not in self._ready
                       and (self._child is None or self._child.key != k)]
        self._skip = skip
        self._start_next()

    def take(self, key: K) -> V | None:
        """The trace of ``key`` if the child made it or is making it (waiting for it), with what the child logged
        passed on now; None if this process must make it. Before it does, the child starts on the next guess, so
        the two work side by side."""
        if key in self._queue:
            self._queue.remove(key)
        if self._child is not None and self._child.key == key:
            self._wait(self._child, block=True)
        child = self._ready.pop(key, None)
        self._start_next()
        if child is None or child.result is None:
            return None
        for record in child.logged:
            logging.getLogger(record.name).handle(record)
        for message, category, filename, lineno in child.warned:
            warnings.warn_explicit(message, category, filename, lineno)
        self.used += 1
        result: V = child.result
        return result

    def close(self) -> None:
        """Stop a child still tracing, and remove the lane's files."""
        self._queue = []
        if self._child is not None:
            self._stop(self._child)
            self._child = None
        self._ready.clear()
        for p in self._dir.iterdir():
            p.unlink(missing_ok=True)
        self._dir.rmdir()

    def __enter__(self) -> TraceLane[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ internals

    @staticmethod
    def _stop(child: _Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child.pid, 0)

    def _start_next(self) -> None:
        if self._child is not None:
            self._wait(self._child, block=False)
        while self._child is None and self._queue and not self._closed:
            key = self._queue.pop()
            if not self._skip(key) and key not in self._ready:
                self._fork(key)

    def _wait(self, child: _Child, *, block: bool) -> None:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        while pid == 0 and block and time.monotonic() < deadline:
            time.sleep(0.002)
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid == 0 and not block:
            return  # still tracing
        self._child = None
        if pid == 0:  # past the deadline: stopped, made here, and no child again
            self._stop(child)
            self._ready[child.key] = child
            self._closed = True
            return
        if os.waitstatus_to_exitcode(status) == 0:
            # written by the child into this process's own private folder (mkdtemp: mode 0700)
            with contextlib.suppress(Exception):  # anything amiss: the trace is made here instead
                child.result, child.logged, child.warned = _unpickle(child.path.read_bytes())
        child.path.unlink(missing_ok=True)
        self._ready[child.key] = child

    def _fork(self, key: K) -> None:
        self._count += 1
        path = self._dir / f"{self._count}.pickle"
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child, which ends with os._exit
            os._exit(_child_main(self._make, key, path))
        self.forked += 1
        self._child = _Child(key, pid, path)


def _unpickle(data: bytes) -> Any:
    """``pickle.loads`` with Python's cyclic garbage collector held off: the thousands of objects a trace unpickles
    into otherwise set off a full collection over the planner's whole heap (models, fake tensors, every trace so
    far): in a GPT-2 plan (2-core CPU, session 23) four of seven loads took 0.29-0.37 s, the others 35-60 ms.
    Nothing the load makes is garbage; the collector runs again at its next threshold."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return pickle.loads(data)
    finally:
        if enabled:
            gc.enable()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args, record.exc_info, record.exc_text = record.getMessage(), None, None, None
        self.records.append(record)


def _child_main(make: Callable[[Any], Any], key: Any, path: Path) -> int:  # pragma: no cover - child
    """Trace ``key``, write ``(trace, log records, warnings)`` to ``path`` atomically; the exit code."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # nothing a guess prints reaches the terminal: what it logs goes back with the trace
        os.dup2(devnull, 2)
        # new stream objects: the parent's may be locked by a thread the fork did not copy (the CLI's spinner)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # never closed: the child ends with os._exit
        for logger in [logging.root, *logging.Logger.manager.loggerDict.values()]:
            if isinstance(logger, logging.Logger):
                logger.handlers = []
        logging.lastResort = None
        torch = sys.modules.get("torch")
        if torch is not None:
            # one thread: the other core is this process's parent's, and OpenMP's pool did not survive the fork
            torch.set_num_threads(1)
        records = _Records()
        memfit_log = logging.getLogger("memfit")
        memfit_log.handlers, memfit_log.propagate = [records], False
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            trace = make(key)
        part = path.with_suffix(".part")
        said = [(str(w.message), w.category, w.filename, w.lineno) for w in warned]
        part.write_bytes(pickle.dumps((trace, records.records, said), protocol=pickle.HIGHEST_PROTOCOL))
        part.rename(path)
        return 0
    except BaseException:  # noqa: BLE001 - the parent traces it again and shows the user the error
        return 1
