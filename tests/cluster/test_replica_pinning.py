"""A replica's ``cpu_sets`` pinning (ray_replica.pin_process), in this process: every
thread moves, cores the machine lacks are refused."""

from __future__ import annotations

import os
import threading

import pytest

from iterserve.cluster.ray_replica import pin_process


def test_pins_every_thread_and_refuses_missing_cores() -> None:
    mine = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        assert pin_process([mine[0]]) == {mine[0]}
        assert os.sched_getaffinity(t.native_id) == {mine[0]}
        assert os.sched_getaffinity(0) == {mine[0]}
        with pytest.raises(ValueError, match="cpu_sets"):
            pin_process([os.cpu_count() or 1])
        with pytest.raises(ValueError, match="cpu_sets"):
            pin_process([])
    finally:
        pin_process(mine)
        stop.set()
        t.join()
    assert sorted(os.sched_getaffinity(0)) == mine
