"""The planner's second lane: a forked child traces what the search will probably ask for next.

The lane may only make the plan faster: the same plan, the same frontier, the same numbers, with and without it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import pytest

from conftest import plan_unet
from memfit.estimate.allocator import AllocatorConfig
from memfit.plan import lanes
from memfit.plan.lanes import TraceLane, lane_is_useful

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the lane forks")


def _double(key: int) -> int:
    logging.getLogger("memfit.test_lane").warning("made %d in process %d", key, os.getpid())
    if key < 0:
        raise ValueError("a key the child cannot make")
    if key == 99:
        time.sleep(60)
    return 2 * key


def test_the_child_takes_the_last_guess_and_this_process_the_first(caplog: pytest.LogCaptureFixture):
    with TraceLane(_double) as lane:
        lane.guess([1, 2, 3], skip=lambda key: False)
        assert lane.take(1) is None  # not started by the child (it took 3): made here
        with caplog.at_level(logging.WARNING, logger="memfit"):
            assert lane.take(3) == 6
        child_said = [r.getMessage() for r in caplog.records if r.name == "memfit.test_lane"]
        assert len(child_said) == 1 and child_said[0].startswith("made 3 in process ")
        assert child_said[0] != f"made 3 in process {os.getpid()}"  # it ran in the child, and is said here
        assert lane.take(2) == 4  # the child started it when 3 was handed over
        assert (lane.forked, lane.used) == (2, 2)


def test_a_guess_the_search_never_takes_is_silent(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="memfit"), TraceLane(_double) as lane:
        lane.guess([5], skip=lambda key: False)
        time.sleep(0.5)
        lane.guess([7], skip=lambda key: False)  # 5 is made by now: the child moves on to 7
        assert lane.take(7) == 14
        assert lane.forked == 2
    said = [r.getMessage() for r in caplog.records if r.name == "memfit.test_lane"]
    assert len(said) == 1 and said[0].startswith("made 7 ")  # 5 was made, never taken, never said


def test_a_failing_guess_leaves_the_trace_to_this_process():
    with TraceLane(_double) as lane:
        lane.guess([-1], skip=lambda key: False)
        assert lane.take(-1) is None
        assert lane.used == 0


def test_skip_keeps_made_keys_out_and_close_stops_a_running_child():
    with TraceLane(_double) as lane:
        lane.guess([4, 99], skip=lambda key: key == 4)
        child = lane._child
        assert child is not None and child.key == 99
        assert lane._queue == []  # 4 was skipped
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # killed and reaped: no zombie left behind


def test_planning_one_lane_or_two_gives_the_same_plan(monkeypatch: pytest.MonkeyPatch):
    if not lane_is_useful():
        pytest.skip("no lane here (one CPU, or other threads): plans never fork")
    made: list[TraceLane] = []

    class Counted(TraceLane):
        def __init__(self, make):  # noqa: ANN001
            super().__init__(make)
            made.append(self)

    from memfit.plan import search, search_state

    monkeypatch.setattr(search_state, "TraceLane", Counted)
    workload, allocator = plan_unet(), AllocatorConfig()
    # a budget where the walk settles several structures: the lane has guesses to make
    budget = 700 << 20
    with_lane = search.plan(workload, budget_bytes=budget, allocator=allocator, effective_batch=8)
    monkeypatch.setenv(lanes.ENV_PROCESSES, "1")
    alone = search.plan(workload, budget_bytes=budget, allocator=allocator, effective_batch=8)
    assert len(made) == 1 and made[0].used > 0  # the first plan took traces from the child
    assert dataclasses.replace(with_lane, elapsed_s=0.0) == dataclasses.replace(alone, elapsed_s=0.0)


def test_a_trace_from_the_lane_is_replayed_with_the_allocator_its_configuration_asks_for(
        monkeypatch: pytest.MonkeyPatch):
    """The lane estimates its trace without expandable segments; asked first for the expandable configuration,
    the search must replay the trace with them, not hand over the lane's estimate."""
    if not lane_is_useful():
        pytest.skip("no lane here (one CPU, or other threads): plans never fork")
    from memfit.estimate.gpus import gpu_spec
    from memfit.plan.search_state import Search, Structure

    def search() -> Search:
        return Search(plan_unet().replace(keep_output=False), gpu_spec(None), AllocatorConfig(), 1 << 62, 8, None,
                      False)

    expandable = Structure("fp32").config(8, 8, expandable=True)  # 8 × 1: 186 MiB with them, 208 without
    plain = dataclasses.replace(expandable, expandable_segments=False)
    two = search()
    with two.side_lane():
        assert two.lane is not None
        two.guess([plain])
        from_lane = two.estimate(expandable)
        assert two.lane.used == 1
    monkeypatch.setenv(lanes.ENV_PROCESSES, "1")
    one = search()
    with one.side_lane():
        assert one.lane is None
        alone = one.estimate(expandable)
    assert from_lane.fits_in_bytes == alone.fits_in_bytes and from_lane.peak_reserved_bytes == alone.peak_reserved_bytes
    assert alone.fits_in_bytes != one.estimate(plain).fits_in_bytes  # the allocator setting shows in the numbers


def test_a_child_that_never_finishes_is_stopped_and_the_trace_made_here(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lanes, "CHILD_TIMEOUT_S", 0.5)
    with TraceLane(_double) as lane:
        lane.guess([99], skip=lambda key: False)  # sleeps a minute
        child = lane._child
        assert child is not None
        started = time.monotonic()
        assert lane.take(99) is None
        assert time.monotonic() - started < 30
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)


def test_no_lane_in_a_process_with_other_threads():
    import threading

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not lane_is_useful()
    finally:
        stop.set()
        other.join()


def test_a_trace_is_unpickled_without_a_garbage_collection():
    """Thousands of objects unpickled at once set off collections over the planner's whole heap (0.3 s each in a
    GPT-2 plan): the lane loads with the collector held off, and leaves it as it found it."""
    import gc
    import pickle

    data = pickle.dumps([(i, [i]) for i in range(50_000)])
    collections: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        assert lanes._unpickle(data)[-1] == (49_999, [49_999])
        assert collections == [] and gc.isenabled()
        gc.disable()
        try:
            lanes._unpickle(data)
            assert not gc.isenabled()  # a caller that had it off keeps it off
        finally:
            gc.enable()
        pickle.loads(data)
        assert collections  # the premise: without the hold-off, this load collects
    finally:
        gc.callbacks.remove(seen)
