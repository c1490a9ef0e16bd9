"""Prefill/decode disaggregation on Ray Serve: one prefill and one decode replica, the
usual HTTP server as the ingress. Greedy answers equal one engine's, token for token,
with prefix caching on both sides; streaming, aborts and the OpenAI API as colocated;
a dead prefill replica fails nothing already decoding. The kill test runs last."""

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
from iterserve.engine.llm import LLM
from iterserve.entrypoints.server import ServerConfig, build_app
from iterserve.metrics import parse_metrics
from tests.model.helpers import make_checkpoint

pytestmark = pytest.mark.slow  # a Ray cluster of two replicas: tens of seconds

MODEL = "tiny-llama"
CONTEXT = 2048
# The most one object of KV holds: half of one of the test model's blocks (2 layers x
# K, V x 16 tokens x 2 heads x 16 dims x 4 bytes = 8 KiB), so every request's KV
# travels as several objects, each block split over two.
MAX_MESSAGE_BYTES = 4096
ENGINE = dict(num_gpu_blocks=256, block_size=16, max_model_len=CONTEXT, max_num_seqs=8,
              max_num_batched_tokens=256, device="cpu", dtype="float32")


class PDServer:
    def __init__(self, model_path) -> None:
        import uvicorn

        from iterserve.cluster.ray_pd import RayKVConnector
        from iterserve.cluster.ray_serve import init_ray, start_cluster

        init_ray(num_cpus=2, object_store_memory=100 * 2**20)
        cfg = engine_config_from_args(str(model_path), **ENGINE)
        self.engine = start_cluster(cfg, num_replicas=1, num_decode_replicas=1,
                                    model_name=MODEL, torch_threads=1,
                                    routing_stats_period_s=0.2,
                                    kv_connector=RayKVConnector(MAX_MESSAGE_BYTES))
        app = build_app(self.engine, ServerConfig(  # type: ignore[arg-type]
            served_model_names=[MODEL], shutdown_drain_timeout_s=0.0,
            enable_prompt_tokens_details=True))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)

    def close(self) -> None:
        import ray
        from ray import serve

        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pd-llama")
    make_checkpoint(path, "llama", max_position_embeddings=CONTEXT)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    return LLM(str(model_path), **ENGINE)


@pytest.fixture(scope="module")
def cluster(model_path):
    c = PDServer(model_path)
    yield c
    c.close()


async def collect(engine, prompt, params, rid):
    deltas = [d async for d in engine.generate([prompt], params, rid)]
    return deltas


def ids_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


SYSTEM = [(11 * i) % 90 + 3 for i in range(48)]  # 3 blocks every prompt shares


def test_kv_larger_than_one_message_travels_in_parts(cluster):
    """Blocks over the cap go as several objects (a block may span two) and come back
    the same, through ``ray.get`` and awaited; blocks under it go as one object."""
    import torch

    from iterserve.cluster.ray_pd import RayKVConnector
    from iterserve.engine.kv_transfer import KVBlocks

    conn = RayKVConnector(MAX_MESSAGE_BYTES)
    kv = torch.randn(2, 2, 3, 16, 2, 16)  # 3 blocks, 24 KiB
    blocks = KVBlocks(40, 16, kv)
    handle = conn.send_blocks(blocks)
    assert len(handle.refs) == 6 and handle.layout is not None
    assert torch.equal(conn.recv_blocks(handle).kv, kv)
    got = cluster.run(conn.recv_blocks_async(handle))
    assert got.num_tokens == 40 and torch.equal(got.kv, kv)
    small = KVBlocks(5, 16, kv[:, :, :1, :, :1, :8].contiguous())  # 1 KiB
    handle = conn.send_blocks(small)
    assert len(handle.refs) == 1 and handle.layout is None
    assert torch.equal(conn.recv_blocks(handle).kv, small.kv)
    with pytest.raises(ValueError, match="kv messages"):
        big = conn.send_blocks(blocks)
        big.refs.pop()
        conn.recv_blocks(big)


def test_greedy_answers_equal_one_engines(cluster, reference):
    """Sequential requests over a shared 3-block prefix (the second on hits both
    replicas' prefix caches), prompts ending mid-block and on a block boundary."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [[*SYSTEM, *range(40, 40 + k)] for k in (5, 16, 1, 9)]
    want = [o.token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    got, cached = [], []
    for i, p in enumerate(prompts):
        deltas = cluster.run(collect(cluster.engine, p, params, f"eq-{i}"))
        got.append(ids_of(deltas))
        assert deltas[-1].finish_reason == "length"
        assert deltas[0].finish_reason is None and len(deltas[0].token_ids) == 1
        cached.append(deltas[-1].num_cached_tokens)
    assert got == want
    assert cached[0] == 0 and all(c >= 48 for c in cached[1:]), cached
    # The KV travelled: the prefill replica saved 4 blocks a request; the decode replica
    # loaded all 4 for the first, then only the block past the shared prefix, which its
    # own cache kept (replica reports, a poll period late).
    from iterserve.cluster.adapter import ROUTERS

    deadline = time.monotonic() + 30
    while True:
        saved = sum(r.get("kv_blocks_saved", 0) for r in
                    ROUTERS["iterserve:prefill"].replica_reports().values())
        loaded = sum(r.get("kv_blocks_loaded", 0) for r in
                     ROUTERS["iterserve-decode:decode"].replica_reports().values())
        (sent,) = [r["kv_transfer"] for r in
                   ROUTERS["iterserve:prefill"].replica_reports().values()]
        (received,) = [r["kv_transfer"] for r in
                       ROUTERS["iterserve-decode:decode"].replica_reports().values()]
        if saved >= 16 and loaded >= 7 and sent["num_sent"] >= 4 and received[
                "num_received"] >= 4:
            break
        assert time.monotonic() < deadline, (saved, loaded)
        time.sleep(0.2)
    assert (saved, loaded) == (16, 7)
    # The transfer counters behind the timings: every prompt token out and back in.
    tokens = sum(len(p) for p in prompts)
    assert (sent["role"], sent["num_sent"], sent["num_tokens_saved"]) == ("prefill", 4, tokens)
    assert sent["bytes_saved"] > 0 and sent["export_s"] > 0 and sent["send_s"] > 0
    assert (received["role"], received["num_received"]) == ("decode", 4)
    assert received["num_tokens_loaded"] == tokens
    assert received["recv_s"] > 0 and received["import_s"] > 0


def test_openai_api_stream_and_text(cluster, reference):
    """The official client, streaming and not: the same text as one engine."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    prompt = [*SYSTEM, 7, 8, 9]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = reference.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3)
    assert chat.choices[0].finish_reason == "length"


def test_stop_string_across_the_first_token(cluster, reference):
    """A stop string that begins in the prefill's token and ends in the decode's: the
    held-back text and the cut are a colocated engine's, streamed or not."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="unused")
    prompt = [*SYSTEM, 30, 31, 32]
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    full = reference.generate([{"prompt_token_ids": prompt}], free, use_tqdm=False)[0]
    first = reference.tokenizer.decode(full.token_ids[:1])
    cut = max(len(first) - 1, 0)
    stop = full.text[cut:len(first) + 2]
    assert stop and len(stop) >= 2, (first, full.text)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
    want = reference.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert want.finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text


def test_one_token_and_many_samples(cluster, reference):
    """max_tokens=1 ends on the prefill replica; n=2 runs whole on a decode replica."""
    prompt = [*SYSTEM, 60, 61]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    deltas = cluster.run(collect(cluster.engine, prompt, one, "one"))
    want = reference.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)[0]
    assert ids_of(deltas) == want.token_ids and deltas[-1].finish_reason == "length"
    two = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2)
    deltas = cluster.run(collect(cluster.engine, prompt, two, "two"))
    assert {d.index for d in deltas} == {0, 1}
    assert sum(d.finish_reason == "length" for d in deltas) == 2


def test_leaving_a_stream_aborts_it_on_the_decode_replica(cluster):
    def aborted() -> float:
        return sum(v for k, v in cluster.metrics().items() if k.startswith(
            "iterserve:request_success_total{finished_reason=abort,replica="))

    before = aborted()
    params = SamplingParams(max_tokens=CONTEXT - 40, temperature=0, ignore_eos=True)

    async def leave_early() -> None:
        stream = cluster.engine.generate([[9] * 30], params, "leave-early")
        await anext(stream)  # the prefill's token
        await anext(stream)  # the decode replica's first
        await stream.aclose()

    cluster.run(leave_early())
    deadline = time.monotonic() + 30
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the decode replica never aborted the request"
        time.sleep(0.2)
    assert cluster.engine.num_unfinished_requests == 0


def test_killing_the_prefill_replica_spares_the_decodes(cluster):
    """Requests decoding when the prefill replica dies (their KV already read) finish."""
    import ray

    engine = cluster.engine
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)

    async def run() -> None:
        started = {f"k-{i}": asyncio.Event() for i in range(3)}

        async def one(i: int) -> int:
            n = 0
            async for d in engine.generate([[5 + i] * (20 + i)], params, f"k-{i}"):
                n += len(d.token_ids)
                if n >= 3:
                    started[f"k-{i}"].set()
            return n

        tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 60)
        (prefill,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("SERVE_REPLICA::iterserve#prefill#")]
        ray.kill(ray.get_actor(prefill["name"], namespace=prefill["namespace"]),
                 no_restart=True)
        assert not any(t.done() for t in tasks)  # all still decoding when it died
        assert await asyncio.gather(*tasks) == [600, 600, 600]

    cluster.run(run(), timeout=300)
