"""AsyncLLM loads the model on a thread of its own (see ``async_llm._off_this_thread``):
the serving loop's thread must never run torch's parallel kernels, or OpenMP keeps a
second worker team beside the engine thread's."""

from __future__ import annotations

import threading

import pytest

from iterserve.engine import async_llm, builder


def test_load_runs_on_a_thread_that_ends_and_errors_reach_the_caller(monkeypatch):
    seen: list[threading.Thread] = []

    class LoadFailed(Exception):
        pass

    def build_engine(engine_config, step_guard):
        seen.append(threading.current_thread())
        raise LoadFailed(engine_config)

    monkeypatch.setattr(builder, "build_engine", build_engine)
    with pytest.raises(LoadFailed, match="the config"):
        async_llm.AsyncLLM.from_engine_config("the config")
    assert len(seen) == 1
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_off_this_thread_returns_the_result():
    a, b, where = async_llm._off_this_thread(
        lambda a, *, b: (a, b, threading.current_thread()), 1, b=2)
    assert (a, b) == (1, 2) and where is not threading.current_thread()
