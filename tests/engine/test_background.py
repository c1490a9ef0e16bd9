"""The preparation pools run below the engine's priority, and still do their work."""

import os
import sys
import threading

import pytest

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
