"""The output processor over a real EngineCore and tokenizer, with a scripted executor
(the token ids each request samples are given, so stop strings and end tokens land
where a test wants them): child ids and seeds, stop strings across steps, EOS vs the
model's extra end tokens, timings, and the typed inbox of the engine thread."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore
from iterserve.engine.core_thread import AddRequests, EngineCoreThread, FinishRequests, Shutdown
from iterserve.engine.output_processor import OutputProcessor, child_request_id
from iterserve.metrics import Metrics
from iterserve.model.default_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


class ScriptedExecutor:
    """Request ``rid`` samples ``script[rid][k]`` as its k-th output token (then 5s);
    each step takes ``delay`` seconds."""

    def __init__(self, script: dict[str, list[int]] | None = None, delay: float = 0.0) -> None:
        self.script = script or {}
        self.delay = delay

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.delay:
            time.sleep(self.delay)
        sampled = {}
        for r, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens):
            if c + n == r.num_tokens:
                ids = self.script.get(r.request_id, [])
                k = r.num_output_tokens
                sampled[r.request_id] = ids[k] if k < len(ids) else 5
        return ModelRunnerOutput(sampled)


def make_engine(executor: ScriptedExecutor, clock=None) -> EngineCore:
    ticks = itertools.count()
    return EngineCore(
        SchedulerConfig(max_num_batched_tokens=256, max_model_len=256, max_num_seqs=8),
        CacheConfig(block_size=4, num_gpu_blocks=128),
        executor,
        clock=clock or (lambda: float(next(ticks))),
    )


def drive(engine: EngineCore, processor: OutputProcessor, clock=None):
    """Step to the end as ``LLM.generate`` does; returns {child id: (text, token ids,
    finish, stop_reason)} and the step at which a stop string was sent to the engine."""
    got: dict[str, list] = {}
    stopped_at: dict[str, int] = {}
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
        assert isinstance(outs, EngineCoreOutputs)
        res = processor.process_outputs(outs, clock() if clock else float(step))
        if res.reqs_to_finish:
            for rid in res.reqs_to_finish:
                stopped_at[rid] = step
            engine.finish_requests(res.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
        for state, d in res.deltas:
            g = got.setdefault(state.request_id, ["", [], None, None])
            g[0] += d.text
            g[1] += d.token_ids
            if d.finish_reason is not None:
                g[2], g[3] = d.finish_reason, d.stop_reason
    return got, stopped_at


def test_n_samples_one_id_scheme_and_seeds(tokenizer):
    proc = OutputProcessor(tokenizer)
    reqs = proc.add_request("r", [[1, 2], [3, 4, 5]], SamplingParams(n=2, seed=10), 0.0)
    assert [r.request_id for r in reqs] == ["0_r", "1_r", "2_r", "3_r"]
    assert [child_request_id("r", k, 4) for k in range(4)] == ["0_r", "1_r", "2_r", "3_r"]
    assert [r.prompt_token_ids for r in reqs] == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    # Sample j of every prompt: seed + j; each child is one sample.
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 10, 11]
    assert all(r.sampling_params.n == 1 for r in reqs)
    assert [s.index for s in proc.request_states.values()] == [0, 1, 2, 3]
    # One child: the parent's own id, its params untouched.
    sp = SamplingParams(seed=3)
    (one,) = proc.add_request("s", [[1]], sp, 0.0)
    assert one.request_id == "s" and one.sampling_params is sp
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request("r", [[1]], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="clashes"):
        proc.add_request("0_r", [[1]], SamplingParams(), 0.0)
    assert proc.num_unfinished_requests == 5


def test_llm_and_server_children_are_the_same(tokenizer):
    """Fan-out through EngineCore: each sample of each prompt is its own request and
    ends once; the parent finishes with its last child."""
    proc = OutputProcessor(tokenizer)
    engine = make_engine(ScriptedExecutor({"1_p": [7, 8, 9]}))
    sp = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    for r in proc.add_request("p", [[1, 2, 3]], sp, 0.0):
        engine.add_request(r)
    parent = proc.parent_requests["p"]
    got, _ = drive(engine, proc)
    assert sorted(got) == ["0_p", "1_p"]
    assert got["1_p"][1] == [7, 8, 9] and got["0_p"][1] == [5, 5, 5]
    assert {g[2] for g in got.values()} == {"length"}
    assert parent.is_finished and "p" not in proc.parent_requests
    assert not proc.has_unfinished_requests()


def test_stop_string_across_steps_finishes_the_request_in_the_scheduler(tokenizer):
    text = "Hello world, the stop word is here and then more text follows"
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stop = "is here"
    # The stop string spans tokens, so it is only seen a few steps after it starts.
    first = next(k for k in range(len(ids)) if stop[:2] in tokenizer.decode(ids[: k + 1]))
    last = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
    assert last > first
    proc = OutputProcessor(tokenizer)
    engine = make_engine(ScriptedExecutor({"a": ids}))
    sp = SamplingParams(max_tokens=len(ids), stop=[stop], ignore_eos=True)
    (req,) = proc.add_request("a", [[1, 2, 3]], sp, 0.0)
    engine.add_request(req)
    got, stopped_at = drive(engine, proc)
    text_out, tokens, finish, stop_reason = got["a"]
    assert (finish, stop_reason) == ("stop", stop)
    assert text_out == full[: full.index(stop)]
    # Tokens up to the one completing the stop string; the request ended then.
    assert tokens == ids[: last + 1]
    assert stopped_at == {"a": last}  # the step after the prefill+first token is step 0
    assert req.status is RequestStatus.FINISHED_STOPPED and req.num_output_tokens == last + 1
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not engine.has_unfinished_requests()


def test_stop_string_on_the_last_token_and_include_stop_str(tokenizer):
    ids = tokenizer.encode("one two three")
    proc = OutputProcessor(tokenizer)
    engine = make_engine(ScriptedExecutor({"a": ids}))
    sp = SamplingParams(max_tokens=len(ids), stop=["three"], include_stop_str_in_output=True,
                        ignore_eos=True)
    for r in proc.add_request("a", [[1]], sp, 0.0):
        engine.add_request(r)
    got, stopped_at = drive(engine, proc)
    # The length limit and the stop string hit together: the stop string decides, and
    # the scheduler had already finished the request (nothing to send it).
    assert got["a"][2:] == ["stop", "three"] and got["a"][0] == "one two three"
    assert stopped_at == {}


def test_eos_and_extra_eos(tokenizer):
    eos = tokenizer.eos_token_id
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eot != eos
    proc = OutputProcessor(tokenizer, [eos, eot])
    assert proc.eos_token_id == eos and proc.extra_eos_token_ids == [eot]
    hi = tokenizer.encode("hi")
    engine = make_engine(ScriptedExecutor({
        "e": [*hi, eos], "x": [*hi, eot], "i": [*hi, eot, eos, *hi],
    }))
    for rid, sp in [
        ("e", SamplingParams(max_tokens=10)),
        ("x", SamplingParams(max_tokens=10)),
        ("i", SamplingParams(max_tokens=len(hi) + 4, ignore_eos=True)),
    ]:
        for r in proc.add_request(rid, [[1, 2]], sp, 0.0):
            engine.add_request(r)
    assert proc.request_states["x"].request.sampling_params.stop_token_ids == [eot]
    assert proc.request_states["i"].request.sampling_params.stop_token_ids == []
    got, _ = drive(engine, proc)
    # EOS: "stop" with no stop_reason; another end token: "stop" naming the token.
    assert got["e"][2:] == ["stop", None] and got["e"][0] == "hi"
    assert got["x"][2:] == ["stop", eot] and got["x"][0] == "hi"
    assert got["i"][2] == "length" and len(got["i"][1]) == len(hi) + 4


def test_extra_eos_already_a_stop_token_is_not_repeated(tokenizer):
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    proc = OutputProcessor(tokenizer, [tokenizer.eos_token_id, eot, eot])
    p = proc.child_params(SamplingParams(stop_token_ids=[eot, 9]), 0)
    assert p.stop_token_ids == [eot, 9]


def test_timings_and_iteration_stats(tokenizer):
    t = [0.0]
    proc = OutputProcessor(tokenizer)
    engine = make_engine(ScriptedExecutor(), clock=lambda: t[0])
    (req,) = proc.add_request("a", [[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), 1.0)
    engine.add_request(req)
    state = proc.request_states["a"]
    stats = []
    for now in (2.0, 4.0, 7.0):
        t[0] = now - 0.5  # the engine schedules a little before the processor sees it
        res = proc.process_outputs(engine.step(), now)
        stats.append(res.stats)
    assert not engine.has_unfinished_requests()
    assert state.arrival_time == 1.0
    assert state.first_scheduled_time == 1.5
    assert state.first_token_time == 2.0 and state.last_token_time == 7.0
    assert state.finished_time == 7.0 and state.finish_reason == "length"
    assert state.queue_time == 0.5 and state.e2e_latency == 6.0
    assert state.num_output_tokens == 3
    assert stats[0].time_to_first_tokens == [1.0] and stats[0].num_prompt_tokens == 3
    assert stats[1].inter_token_latencies == [2.0]
    assert stats[2].inter_token_latencies == [3.0]
    assert [s.num_generation_tokens for s in stats] == [1, 1, 1]


def test_abort_on_the_callers_side_drops_later_outputs(tokenizer):
    ids = tokenizer.encode("abc def ghi")
    proc = OutputProcessor(tokenizer)
    engine = make_engine(ScriptedExecutor({"0_a": ids, "1_a": ids}))
    for r in proc.add_request("a", [[1]], SamplingParams(n=2, max_tokens=8, stop=["zzz"]), 0.0):
        engine.add_request(r)
    proc.process_outputs(engine.step(), 1.0)
    ended = proc.abort_request("a", 2.0)
    assert sorted(s.request_id for s, _ in ended) == ["0_a", "1_a"]
    assert all(d.finish_reason == "abort" and s.finished_time == 2.0 for s, d in ended)
    assert proc.abort_request("a", 3.0) == []
    # The engine still runs them until told; their outputs no longer reach anyone.
    assert proc.process_outputs(engine.step(), 3.0).deltas == []
    engine.abort_requests([s.request_id for s, _ in ended])
    assert not engine.has_unfinished_requests()


def test_engine_core_step_returns_one_type():
    engine = make_engine(ScriptedExecutor())
    empty = engine.step()
    assert isinstance(empty, EngineCoreOutputs) and not empty and list(empty) == []


def test_engine_thread_takes_typed_messages(tokenizer):
    """The engine thread applies AddRequests / FinishRequests / Shutdown from its inbox
    and hands every step's outputs to the loop."""

    async def run() -> tuple[list[str], RequestStatus]:
        loop = asyncio.get_running_loop()
        engine = make_engine(ScriptedExecutor(delay=0.01), clock=lambda: loop.time())
        proc = OutputProcessor(tokenizer)
        finished: list[str] = []

        def on_outputs(outs: EngineCoreOutputs, now: float) -> None:
            res = proc.process_outputs(outs, now)
            for state, d in res.deltas:
                if d.finish_reason is not None:
                    finished.append(f"{state.request_id}:{d.finish_reason}")

        thread = EngineCoreThread(engine, Metrics("t", prefix="t_op"), on_outputs=on_outputs,
                                  on_rejected=lambda r: None, on_dead=lambda e: None)
        thread.start(loop)
        long = proc.add_request("long", [[1, 2]], SamplingParams(max_tokens=200, ignore_eos=True), 0.0)
        short = proc.add_request("short", [[1]], SamplingParams(max_tokens=2, ignore_eos=True), 0.0)
        thread.send(AddRequests(long + short))
        while "short:length" not in finished:
            await asyncio.sleep(0.005)
        # Ended on this side (as by a stop string): the engine must free it too.
        proc.finish_requests(["long"], "stop", loop.time())
        thread.send(FinishRequests(["long"]))
        thread.send(Shutdown())
        await asyncio.to_thread(thread.join, 10.0)
        assert not thread.is_alive and thread.dead_error is None
        return finished, long[0].status

    finished, status = asyncio.run(run())
    assert finished == ["short:length"]
    assert status is RequestStatus.FINISHED_STOPPED


def _deltas(engine: EngineCore, proc: OutputProcessor) -> dict[str, list]:
    """Each child's deltas as (token ids, text, finish reason), one per step that had one."""
    got: dict[str, list] = {}
    for step in itertools.count():
        if not engine.has_unfinished_requests():
            return got
        res = proc.process_outputs(engine.step(), float(step))
        if res.reqs_to_finish:
            engine.finish_requests(res.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
        for state, d in res.deltas:
            got.setdefault(state.request_id, []).append((d.token_ids, d.text, d.finish_reason))
    return got


def test_stream_interval_batches_deltas_first_and_last_at_once(tokenizer):
    """vLLM's --stream-interval: the first token alone, then batches of the interval,
    the last delta whenever the request ends; a request's own interval only raises the
    server's. The text and tokens are those of interval 1, and the engine's token
    timings (the metrics) still count every step."""
    ids = tokenizer.encode("one two three four five six seven eight nine ten")[:8]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    runs = {}
    for server, own in ((1, None), (3, None), (3, 2), (1, 5)):
        proc = OutputProcessor(tokenizer, stream_interval=server)
        engine = make_engine(ScriptedExecutor({"a": ids}))
        (req,) = proc.add_request("a", [[1, 2, 3]],
                                  dataclasses.replace(sp, stream_interval=own), 0.0)
        engine.add_request(req)
        runs[server, own] = _deltas(engine, proc)["a"]
    assert [len(t) for t, _, _ in runs[1, None]] == [1] * 8
    assert [len(t) for t, _, _ in runs[3, None]] == [1, 3, 3, 1]
    assert [len(t) for t, _, _ in runs[3, 2]] == [1, 3, 3, 1]  # raised to the server's 3
    assert [len(t) for t, _, _ in runs[1, 5]] == [1, 5, 2]
    for run in runs.values():
        assert [t for d in run for t in d[0]] == ids
        assert "".join(d[1] for d in run) == "".join(d[1] for d in runs[1, None])
        assert [d[2] for d in run][-1] == "length" and all(d[2] is None for d in run[:-1])


def test_stream_interval_held_tokens_end_with_an_abort_or_a_stop(tokenizer):
    text = "alpha beta gamma delta epsilon zeta eta theta"
    ids = tokenizer.encode(text)
    # A stop string: what was held back comes out with the finish, cut at the stop.
    proc = OutputProcessor(tokenizer, stream_interval=4)
    engine = make_engine(ScriptedExecutor({"s": ids}))
    (req,) = proc.add_request("s", [[1, 2]], SamplingParams(
        max_tokens=len(ids), stop=["delta"], ignore_eos=True), 0.0)
    engine.add_request(req)
    run = _deltas(engine, proc)["s"]
    assert run[-1][2] == "stop" and "".join(d[1] for d in run) == text[: text.index("delta")]
    # An abort: the held tokens are in the abort's delta.
    proc = OutputProcessor(tokenizer, stream_interval=4)
    engine = make_engine(ScriptedExecutor({"b": ids}))
    (req,) = proc.add_request("b", [[1, 2]], SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    engine.add_request(req)
    sent = []
    for step in range(3):  # the first token, then two held
        sent += [t for _, d in proc.process_outputs(engine.step(), float(step)).deltas
                 for t in d.token_ids]
    assert sent == ids[:1]
    ((_, last),) = proc.abort_request("b", 3.0)
    assert last.finish_reason == "abort" and last.token_ids == ids[1:3]
    assert not proc.has_unfinished_requests()
