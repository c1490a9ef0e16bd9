"""The preparation pools run below the engine's priority, and still do their work."""

import os
import sys
import threading

import pytest

from iterserve.engine import background
from iterserve.engine.background import background_pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_background_threads_run_below_the_callers_priority():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = background_pool(1, "test-bg", nice=7)
    try:
        theirs = pool.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(10)
    finally:
        pool.shutdown(wait=True)
    assert theirs == min(19, mine + 7)
    # The caller's own thread is untouched.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_background_pool_runs_work():
    pool = background_pool(2, "test-bg")
    try:
        assert sorted(pool.map(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
    finally:
        pool.shutdown(wait=True)


def _policy_of_pool_thread(pool) -> int:
    return pool.submit(lambda: os.sched_getscheduler(threading.get_native_id())).result(10)


linux_idle = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


@linux_idle
@pytest.mark.parametrize(("policy", "idle", "nice", "expected"), [
    ("idle", True, 7, "SCHED_IDLE"),
    ("idle", False, 7, "SCHED_OTHER"),  # a pool that opts out (small grammars)
    ("idle", True, 0, "SCHED_OTHER"),  # niceness 0: normal priority in every policy
    ("nice", True, 7, "SCHED_OTHER"),
])
def test_the_policy_decides_whether_pool_threads_run_as_sched_idle(policy, idle, nice,
                                                                   expected):
    before = background.background_policy()
    background.set_background_policy(policy)
    pool = background_pool(1, "test-bg", nice=nice, idle=idle)
    try:
        assert _policy_of_pool_thread(pool) == getattr(os, expected)
    finally:
        pool.shutdown(wait=True)
        background.set_background_policy(before)
    # The caller's own thread is untouched.
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="background_policy must be one of idle, nice"):
        background.set_background_policy("realtime")
    assert background.background_policy() == background.BACKGROUND_POLICY == "idle"
