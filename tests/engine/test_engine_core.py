"""EngineCore with a stand-in executor: the step loop, failing steps, aborts."""

from __future__ import annotations

import itertools

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore


class CountingExecutor:
    """Samples token 7 for every finished prefill; raises on the steps listed in ``fail_on``."""

    def __init__(self, fail_on: set[int] = frozenset()) -> None:
        self.fail_on = fail_on
        self.calls = 0
        self.finished_seen: list[str] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.calls += 1
        self.finished_seen.extend(out.finished_req_ids)
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault")
        sampled = {
            r.request_id: 7
            for r, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens)
            if c + n == r.num_tokens
        }
        return ModelRunnerOutput(sampled)


def make_engine(executor, **sched):
    clock = itertools.count()
    return EngineCore(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, **sched),
        CacheConfig(block_size=4, num_gpu_blocks=64),
        executor,
        clock=lambda: float(next(clock)),
    )


def req(rid: str, n: int = 5, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def test_step_loop_finishes_everything_and_reports_finished_ids_to_executor():
    ex = CountingExecutor()
    eng = make_engine(ex)
    for i in range(3):
        eng.add_request(req(f"r{i}", max_tokens=3 + i))
    outs = eng.run_until_idle()
    final = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert final == {"r0": "length", "r1": "length", "r2": "length"}
    tokens = {}
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [len(tokens[f"r{i}"]) for i in range(3)] == [3, 4, 5]
    assert set(ex.finished_seen) <= {"r0", "r1"}  # r2 finished in the last step


def test_failing_step_errors_its_requests_and_engine_keeps_serving():
    ex = CountingExecutor(fail_on={2})
    eng = make_engine(ex)
    eng.add_request(req("a"))
    eng.add_request(req("b"))
    eng.step()  # prefill ok
    outs = eng.step()  # raises inside execute
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "error", "b": "error"}
    assert "injected fault" in outs[0].stop_reason
    assert eng.num_failed_steps == 1
    sched = eng.scheduler
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    eng.add_request(req("c"))
    outs = eng.run_until_idle()
    assert [o.finish_reason for o in outs if o.finish_reason] == ["length"]
    sched.check_invariants()


def test_abort_returns_final_output_once():
    eng = make_engine(CountingExecutor())
    eng.add_request(req("a", max_tokens=50))
    eng.step()
    outs = eng.abort_requests(["a", "nope"])
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert eng.abort_requests("a") == []
    assert not eng.has_unfinished_requests()


def test_idle_step_does_not_call_executor():
    ex = CountingExecutor()
    eng = make_engine(ex)
    assert eng.step() == []
    assert ex.calls == 0
