"""Two real engine replicas on Ray Serve behind the policy router, with the usual HTTP
server as the ingress. Ray and the cluster start once for the module (the expensive
part); the replica-killing test runs last."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import ray.serve  # noqa: F401  (the test extra installs ray[serve])

from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.builder import engine_config_from_args
from iterserve.engine.exceptions import EngineDeadError
from iterserve.entrypoints.server import ServerConfig, build_app
from iterserve.metrics import parse_metrics
from tests.model.helpers import make_checkpoint

MODEL = "tiny-llama"
# Long enough that a request left early is still running when its abort lands: the
# tiny model decodes a few hundred tokens a second, faster than a busy ingress cancels.
CONTEXT = 4096


class ClusterServer:
    """Ray (2 CPUs, a small object store), 2 replicas, the app on a free local port."""

    def __init__(self, model_path) -> None:
        import uvicorn

        from iterserve.cluster.ray_serve import init_ray, start_cluster

        init_ray(num_cpus=2, object_store_memory=100 * 2**20)
        cfg = engine_config_from_args(
            str(model_path), num_gpu_blocks=320, block_size=16, max_model_len=CONTEXT,
            max_num_seqs=8, max_num_batched_tokens=256, device="cpu",
        )
        self.engine = start_cluster(cfg, num_replicas=2, model_name=MODEL, torch_threads=1,
                                    routing_stats_period_s=0.2)
        app = build_app(self.engine, ServerConfig(  # type: ignore[arg-type]
            served_model_names=[MODEL], shutdown_drain_timeout_s=0.0,
            enable_prompt_tokens_details=True))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)

    def routed(self) -> dict[str, float]:
        """Requests per replica (the ingress's own counter: fresh, not a report)."""
        return {k.split("replica=")[1].rstrip("}"): v for k, v in self.metrics().items()
                if k.startswith("iterserve:cluster_requests_routed_total")}

    def close(self) -> None:
        import ray
        from ray import serve

        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster-llama")
    make_checkpoint(path, "llama", max_position_embeddings=CONTEXT)
    c = ClusterServer(path)
    yield c
    c.close()


def test_openai_client_unchanged_and_requests_split(cluster):
    """The official client, as against one server; prompts with nothing in common take
    turns over both replicas, and /metrics shows each replica under its label."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    # Both replicas reporting before the first request, and a report period (0.2 s) or
    # two between requests: the load the router weighs is then the replicas' own, not a
    # report still showing the last request running (a busy machine delays reports).
    deadline = time.monotonic() + 30
    while sum(k.startswith("iterserve:engine_healthy{replica=") for k in cluster.metrics()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = cluster.routed()
    for i in range(6):
        r = client.completions.create(model=MODEL, prompt=f"{i} " + "word " * (8 + i),
                                      max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        time.sleep(0.5)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        stream=True)
    chunks = list(chat)
    assert chunks[-1].choices[0].finish_reason == "length"
    after = cluster.routed()
    split = {rid: after[rid] - before.get(rid, 0) for rid in after}
    assert len(split) == 2 and sum(split.values()) == 7
    assert min(split.values()) >= 3, split
    # Replicas report every 0.2 s, through the Serve controller: wait for both reports
    # to cover these requests.
    keys = [f"iterserve:engine_healthy{{replica={rid}}}" for rid in split]
    deadline = time.monotonic() + 30
    while True:
        metrics = cluster.metrics()
        finished = sum(v for k, v in metrics.items() if k.startswith(
            "iterserve:request_success_total{finished_reason=length,replica="))
        if all(k in metrics for k in keys) and finished >= 7:
            break
        assert time.monotonic() < deadline, (finished, [k for k in metrics if "healthy" in k])
        time.sleep(0.2)
    assert all(metrics[k] == 1.0 for k in keys)


def test_shared_prefix_stays_on_one_replica(cluster):
    """cache_aware: sequential requests sharing a 4-block prefix all go where it is
    cached, and hit it there."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    system = list(range(300, 364))
    before = cluster.routed()
    cached = []
    for i in range(4):
        r = client.completions.create(model=MODEL, prompt=[*system, 500 + i], max_tokens=2,
                                      temperature=0)
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    after = cluster.routed()
    grew = {rid for rid in after if after[rid] > before.get(rid, 0)}
    assert len(grew) == 1, (before, after)
    assert cached == [0, 64, 64, 64]


def test_leaving_a_stream_aborts_it_on_its_replica(cluster):
    """The ingress cancels the call; the replica's engine aborts the request and frees
    it (seen in the replicas' reports: abort counted, nothing left running)."""

    def aborted() -> float:
        return sum(v for k, v in cluster.metrics().items() if k.startswith(
            "iterserve:request_success_total{finished_reason=abort,replica="))

    before = aborted()
    # As long as the context allows, so the cancel reaches the replica well before the
    # request could end on its own.
    params = SamplingParams(max_tokens=CONTEXT - 30, temperature=0, ignore_eos=True)

    async def leave_early() -> None:
        # Close the stream at once, as the server does when a client leaves (a bare
        # ``break`` leaves the close to the garbage collector, at some later time).
        stream = cluster.engine.generate([[9] * 30], params, "leave-early")
        await anext(stream)
        await stream.aclose()

    asyncio.run_coroutine_threadsafe(leave_early(), _loop_of(cluster)).result(timeout=60)
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the replica never aborted the request"
        time.sleep(0.2)
    assert cluster.engine.num_unfinished_requests == 0


def test_abort_call_is_pinned_to_the_requests_replica(cluster):
    """The direct abort that backs up a dropped stream cancel: the router sends it to
    the replica named in the call, which aborts the request there."""
    engine = cluster.engine
    params = SamplingParams(max_tokens=CONTEXT - 30, temperature=0, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate([[11] * 30], params, "pinned-abort")
        await anext(stream)
        here = engine.replica_of["pinned-abort"]
        others = [rid for rid in cluster.routed() if rid != here]
        assert others
        # Pinned to the other replica, where the request is not: it runs on.
        assert await engine.handle.abort.remote(
            request_id="pinned-abort", target_replica=others[0]) is True
        # A replica that is gone: answered anywhere, as a no-op.
        assert await engine.handle.abort.remote(
            request_id="pinned-abort", target_replica="gone") is False
        assert (await anext(stream)).finish_reason is None
        assert await engine.handle.abort.remote(
            request_id="pinned-abort", target_replica=here) is True
        rest = [d async for d in stream]
        assert rest and rest[-1].finish_reason == "abort"
        assert engine.num_unfinished_requests == 0

    asyncio.run_coroutine_threadsafe(run(), _loop_of(cluster)).result(timeout=60)


def test_killing_a_replica_fails_only_its_requests(cluster):
    """Streams in flight on both replicas; one replica is killed: its requests fail
    (EngineDeadError, a 503), the other replica's complete, and new requests are served."""
    import ray

    engine = cluster.engine
    params = SamplingParams(max_tokens=220, temperature=0, ignore_eos=True)

    async def run() -> None:
        started = {f"kill-{i}": asyncio.Event() for i in range(6)}

        async def one(i: int) -> int:
            rid = f"kill-{i}"
            n = 0
            async for d in engine.generate([[7 + i] * (20 + i)], params, rid):
                n += len(d.token_ids)
                started[rid].set()
            return n

        tasks = [asyncio.ensure_future(one(i)) for i in range(6)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        where = dict(engine.replica_of)
        assert set(where) == set(started) and len(set(where.values())) == 2, where
        victim = sorted(set(where.values()))[0]
        actor = ray.get_actor(f"SERVE_REPLICA::iterserve#engine#{victim}", namespace="serve")
        ray.kill(actor, no_restart=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = []
        for i, res in enumerate(results):
            if where[f"kill-{i}"] != victim:
                assert res == 220, res  # the survivor's requests are untouched
            elif isinstance(res, EngineDeadError):
                failed.append(i)
            else:
                assert res == 220, res  # it finished before the kill landed
        assert failed, "no request was in flight on the killed replica"
        assert engine.is_healthy  # one replica is enough
        # New requests are served (by the survivor, or the replacement Serve starts).
        for i in range(3):
            out = [d async for d in engine.generate([[40 + i] * 10], SamplingParams(
                max_tokens=3, temperature=0), f"after-{i}")]
            assert out[-1].finish_reason == "length"

    fut = asyncio.run_coroutine_threadsafe(run(), _loop_of(cluster))
    fut.result(timeout=300)


def _loop_of(cluster) -> asyncio.AbstractEventLoop:
    """The ingress's event loop (uvicorn's), where the engine client lives."""
    loop = getattr(cluster, "_loop", None)
    if loop is None:
        loop = cluster._loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop
