"""Prefill/decode disaggregation under faults: one prefill and two decode replicas on a
Ray instance of two CPUs. An abort while a request's KV travels, or while it decodes,
ends it once, with ``abort``, and leaves every replica's blocks free; the largest prompt's KV (shared
memory, not an inline message) arrives intact; a decode replica killed mid-run fails
only the requests it was decoding, once each, and the rest, and later requests, equal
one engine's answers. The kill test runs last."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest
import ray.serve  # noqa: F401  (the test extra installs ray[serve])

from iterserve.cluster.ray_pd import RayKVConnector
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.builder import engine_config_from_args
from iterserve.engine.exceptions import EngineDeadError
from iterserve.engine.llm import LLM
from tests.cluster.test_ray_pd import CONTEXT, ENGINE, MODEL, ids_of
from tests.model.helpers import make_checkpoint

pytestmark = pytest.mark.slow  # a Ray cluster of three replicas: tens of seconds

PREFILL_KEY, DECODE_KEY = "iterserve:prefill", "iterserve-decode:decode"
SLOW_TOKENS = 37  # prompts of this length wait a minute for their KV (SlowKVConnector)
# Ray returns objects under 100 KiB inline in the reply; larger ones go through the
# object store's shared memory (``max_direct_call_object_size``).
INLINE_LIMIT = 100 * 1024


class SlowKVConnector(RayKVConnector):
    """The object store, but the decode replica's read of a ``slow_tokens``-token
    prompt's KV first waits ``delay_s``: a transfer long enough to abort it midway."""

    def __init__(self, slow_tokens: int, delay_s: float) -> None:
        self.slow_tokens = slow_tokens
        self.delay_s = delay_s

    async def recv_blocks_async(self, handle):
        if handle.num_tokens == self.slow_tokens:
            await asyncio.sleep(self.delay_s)
        return await super().recv_blocks_async(handle)


class PDCluster:
    def __init__(self, model_path) -> None:
        from ray import cloudpickle

        from iterserve.cluster.ray_serve import init_ray, start_cluster

        # The replicas import iterserve, not this test module: its connector travels
        # by value.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        init_ray(num_cpus=2, object_store_memory=100 * 2**20)
        cfg = engine_config_from_args(str(model_path), **ENGINE)
        self.engine = start_cluster(
            cfg, num_replicas=1, num_decode_replicas=2, num_cpus_per_replica=0.5,
            model_name=MODEL, torch_threads=1, routing_stats_period_s=0.2,
            kv_connector=SlowKVConnector(SLOW_TOKENS, 60.0))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def reports(self, key: str) -> dict[str, dict]:
        from iterserve.cluster.adapter import ROUTERS

        router = ROUTERS.get(key)  # made by the first call through its handle
        return {} if router is None else router.replica_reports()

    def free_blocks(self) -> dict[str, int]:
        """Every replica's free KV blocks, as of its latest report."""
        return {rid: r["num_free_blocks"] for key in (PREFILL_KEY, DECODE_KEY)
                for rid, r in self.reports(key).items() if "num_free_blocks" in r}

    def decode_ids(self) -> set[str]:
        from iterserve.cluster.adapter import ROUTERS

        return {r.replica_id.unique_id for r in ROUTERS[DECODE_KEY].curr_replicas.values()}

    def close(self) -> None:
        import ray
        from ray import cloudpickle, serve

        serve.shutdown()
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def wait_for(cond, what: str, timeout: float = 60.0, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return value


async def await_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pd-faults-llama")
    make_checkpoint(path, "llama", max_position_embeddings=CONTEXT)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    return LLM(str(model_path), **ENGINE)


@pytest.fixture(scope="module")
def cluster(model_path):
    c = PDCluster(model_path)
    # One request through both pools: each handle's router exists from its first call.
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert finishes(c.run(_collect(c.engine, [3, 4, 5], params, "warm"))) == ["length"]
    yield c
    c.close()


@pytest.fixture(scope="module")
def idle_free_blocks(cluster):
    """Each replica's free blocks when idle (all three have reported)."""
    return wait_for(lambda: f if len(f := cluster.free_blocks()) == 3 else None,
                    "the three replicas' first reports")


def want_of(reference, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def finishes(deltas) -> list[str]:
    return [d.finish_reason for d in deltas if d.finish_reason is not None]


def assert_blocks_return(cluster, idle: dict[str, int]) -> None:
    """Every replica's free blocks come back to their idle count (a report or so late;
    cached prompt blocks count as free)."""
    got: dict[str, int] = {}

    def back() -> bool:
        got.update(cluster.free_blocks())
        return all(got.get(rid) == n for rid, n in idle.items())

    deadline = time.monotonic() + 30
    while not back():
        assert time.monotonic() < deadline, (got, idle)
        time.sleep(0.2)


def test_abort_while_the_kv_travels(cluster, idle_free_blocks):
    """The ingress aborts a request whose decode replica waits for its KV: the stream
    ends at once with one ``abort`` after the prefill's token, and the blocks of both
    replicas are free again (the prefill's freed at its end, the decode's never held)."""
    engine = cluster.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    decodes = cluster.decode_ids()

    async def run():
        stream = engine.generate([[7] * SLOW_TOKENS], params, "abort-kv")
        first = await anext(stream)  # the prefill's token; the decode call starts next
        rest = asyncio.ensure_future(_drain(stream))
        await await_for(lambda: engine.replica_of.get("abort-kv") in decodes,
                        "the decode replica to take the request")
        t0 = time.monotonic()
        engine.abort("abort-kv")
        deltas = await asyncio.wait_for(rest, 30)
        return [first, *deltas], time.monotonic() - t0

    deltas, took = cluster.run(run())
    assert len(ids_of(deltas)) == 1 and finishes(deltas) == ["abort"], deltas
    assert took < 30  # not the transfer's minute
    assert engine.num_unfinished_requests == 0
    assert_blocks_return(cluster, idle_free_blocks)


def test_direct_abort_of_a_request_waiting_for_its_kv(cluster, idle_free_blocks):
    """The replica-side abort (which backs up a dropped stream cancel) reaches a decode
    still waiting for its KV, before its engine knows the request: it ends there with
    ``abort`` at once, rather than decoding the whole answer a minute later."""
    engine = cluster.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    decodes = cluster.decode_ids()

    async def run():
        stream = engine.generate([[8] * SLOW_TOKENS], params, "abort-direct")
        first = await anext(stream)
        rest = asyncio.ensure_future(_drain(stream))
        await await_for(lambda: engine.replica_of.get("abort-direct") in decodes,
                        "the decode replica to take the request")
        replica = engine.replica_of["abort-direct"]
        assert await engine.decode_handle.abort.remote(
            request_id="abort-direct", target_replica=replica) is True
        return [first, *await asyncio.wait_for(rest, 30)]

    deltas = cluster.run(run())
    assert len(ids_of(deltas)) == 1 and finishes(deltas) == ["abort"], deltas
    assert engine.num_unfinished_requests == 0
    assert_blocks_return(cluster, idle_free_blocks)


def test_abort_while_decoding(cluster, idle_free_blocks):
    """An abort once the decode replica's engine holds the request: one ``abort``
    after the tokens streamed so far, and the decode replica's blocks free again."""
    engine = cluster.engine
    params = SamplingParams(max_tokens=CONTEXT - 64, temperature=0, ignore_eos=True)

    async def run():
        stream = engine.generate([[9] * 40], params, "abort-decoding")
        deltas = [await anext(stream), await anext(stream)]  # prefill's, then decode's
        engine.abort("abort-decoding")
        return deltas + await asyncio.wait_for(_drain(stream), 30)

    deltas = cluster.run(run())
    assert finishes(deltas) == ["abort"] and deltas[-1].finish_reason == "abort", deltas
    assert 2 <= len(ids_of(deltas)) < CONTEXT - 64
    assert engine.num_unfinished_requests == 0
    assert_blocks_return(cluster, idle_free_blocks)


def test_the_longest_prompts_kv_arrives_intact(cluster, reference):
    """A prompt at the context's end (127 blocks, chunked over 8 prefill steps): its KV
    is one object of about 1 MiB, ten times what Ray sends inline, read from shared
    memory; the decode's greedy answer is one engine's."""
    engine = cluster.engine
    prompt = [(13 * i) % 97 + 3 for i in range(CONTEXT - 16)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (want,) = want_of(reference, [prompt], params)
    before = sum(r["kv_transfer"]["bytes_saved"] for r in cluster.reports(PREFILL_KEY).values()
                 if "kv_transfer" in r)
    deltas = cluster.run(_collect(engine, prompt, params, "long"))
    assert ids_of(deltas) == want and finishes(deltas) == ["length"]

    # layers x (K, V) x kv heads x head dim x float32, for every slot of its blocks
    # (make_checkpoint's shape).
    nbytes = 2 * 2 * 2 * 16 * 4 * -(-len(prompt) // 16) * 16
    assert nbytes > 10 * INLINE_LIMIT

    def moved() -> int:  # ``before`` may be a report late: never more than it says
        return sum(r["kv_transfer"]["bytes_saved"]
                   for r in cluster.reports(PREFILL_KEY).values()) - before

    wait_for(lambda: moved() >= nbytes, f"the prefill replica's report of {nbytes} bytes")


def test_a_killed_decode_replica_fails_only_its_own_requests(cluster, reference):
    """Four requests over both decode replicas; one replica dies mid-decode. Its
    requests fail with ``EngineDeadError``, once each and without a finish reason; the
    other replica's finish with one engine's greedy answer, and so do requests sent
    after the death."""
    import ray

    engine = cluster.engine
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 90 + 3 for j in range(20 + i)] for i in range(4)]
    want = want_of(reference, prompts, params)

    async def run():
        seen: dict[str, list] = {f"kill-{i}": [] for i in range(4)}
        on: dict[str, str] = {}
        decodes = cluster.decode_ids()

        async def one(i: int) -> None:
            rid = f"kill-{i}"
            async for d in engine.generate([prompts[i]], params, rid):
                seen[rid].append(d)
                if (r := engine.replica_of.get(rid)) in decodes:
                    on[rid] = r

        tasks = {rid: asyncio.ensure_future(one(i)) for i, rid in enumerate(seen)}
        await await_for(lambda: len(on) == 4 and all(len(ids_of(s)) >= 3
                                                     for s in seen.values()),
                        "all four requests decoding")
        assert len(set(on.values())) == 2, f"the router used one decode replica: {on}"
        assert not any(t.done() for t in tasks.values())
        victim = on["kill-0"]
        (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"] == f"SERVE_REPLICA::iterserve-decode#decode#{victim}"]
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]),
                 no_restart=True)
        results = dict(zip(tasks, await asyncio.gather(*tasks.values(),
                                                       return_exceptions=True)))
        return seen, on, victim, results

    seen, on, victim, results = cluster.run(run(), timeout=300)
    for i, rid in enumerate(seen):
        if on[rid] == victim:
            assert isinstance(results[rid], EngineDeadError), (rid, results[rid])
            assert finishes(seen[rid]) == [], seen[rid]
            assert ids_of(seen[rid]) == want[i][:len(ids_of(seen[rid]))]
        else:
            assert results[rid] is None, (rid, results[rid])
            assert ids_of(seen[rid]) == want[i] and finishes(seen[rid]) == ["length"]
    assert engine.num_unfinished_requests == 0
    # Requests after the death (once the router has dropped the dead replica): on the
    # survivor, or the dead one's replacement.
    wait_for(lambda: victim not in cluster.decode_ids(), "the router to drop the dead replica")
    later = [[(7 * i + j) % 90 + 3 for j in range(25)] for i in range(3)]
    short = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def after():
        return await asyncio.gather(*(_collect(engine, p, short, f"after-{i}")
                                      for i, p in enumerate(later)))

    got = cluster.run(after(), timeout=300)
    assert [ids_of(d) for d in got] == want_of(reference, later, short)
    assert all(finishes(d) == ["length"] for d in got)


async def _drain(stream) -> list:
    return [d async for d in stream]


async def _collect(engine, prompt, params, rid) -> list:
    return [d async for d in engine.generate([prompt], params, rid)]
