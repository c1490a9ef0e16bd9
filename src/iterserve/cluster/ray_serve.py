"""``iterserve serve --data-parallel-size N``: N engine replicas on Ray Serve, one ingress
(or, with ``--num-prefill-replicas P --num-decode-replicas D``, a prefill pool and a
decode pool, KV moving between them through Ray's object store: ray_pd.py).

- Ray: a local instance (``ray.init``), or an existing cluster (``--ray-address``).
- Replicas: the ``EngineReplica`` deployment (ray_replica.py), N copies, each an
  ``AsyncLLM`` with ``torch_threads`` threads, routed by ``PolicyRequestRouter``
  (ray_router.py) through ``--router-policy``.
- Ingress: this process runs the usual FastAPI app (entrypoints/server.py) on a
  ``ClusterEngine`` (ray_client.py): tokenization, validation and admission here, the
  engine work on the replicas. Serve's own HTTP proxy is off.

This package's other modules never import Ray; this one and its ray_* siblings do.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from iterserve.cluster.adapter import ROUTERS
from iterserve.cluster.cli import kv_transfer_settings
from iterserve.cluster.ray_client import ClusterEngine, ClusterMetrics
from iterserve.cluster.ray_replica import EngineReplica
from iterserve.cluster.ray_router import PolicyRequestRouter
from iterserve.engine.builder import config_to_dict

logger = logging.getLogger("iterserve.cluster")

APP_NAME = "iterserve"


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             object_store_memory: int = 200 * 2**20) -> None:
    """Join ``address``, or start a small local instance (no dashboard; the object
    store holds only small messages: deltas and stats). A no-op when Ray is up."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
                 object_store_memory=object_store_memory)


def start_cluster(
    engine_config: Any,
    *,
    num_replicas: int,
    model_name: str,
    router_policy: str = "cache_aware",
    policy_options: dict[str, Any] | None = None,
    metrics_prefix: str = "iterserve",
    step_timeout_s: float | None = None,
    torch_threads: int | None = None,
    num_cpus_per_replica: float = 1.0,
    routing_stats_period_s: float = 1.0,
    max_ongoing_requests: int = 1024,
    app_name: str = APP_NAME,
    num_decode_replicas: int = 0,
    decode_router_policy: str = "least_kv",
    cpu_sets: list[list[int]] | None = None,
    kv_connector: Any = None,
) -> ClusterEngine:
    """Deploy ``num_replicas`` engines (Ray must be initialised) and return the ingress's
    engine client. ``torch_threads``: per replica; default: the cores split evenly.

    ``num_decode_replicas`` > 0: prefill/decode disaggregation, ``num_replicas`` prefill
    replicas (routed by ``router_policy``) and that many decode replicas (routed by
    ``decode_router_policy``), each pool an application of its own (cluster/ray_pd.py).

    ``cpu_sets``: one list of cores per replica (the first ``num_replicas`` for the
    colocated or prefill replicas, then the decode replicas'); each replica pins its
    process to its set and runs that many torch threads (a single node's cores).

    ``kv_connector``: the replicas' ``KVConnector`` (a picklable instance, copied to
    each); default ``RayKVConnector``, the object store."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from iterserve.cluster import ROUTER_POLICIES
    from iterserve.model.loader import load_tokenizer, resolve_model_path

    if num_replicas < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
    if num_decode_replicas < 0:
        raise ValueError(f"num_decode_replicas must be >= 0, got {num_decode_replicas}")
    for flag, policy in (("router_policy", router_policy),
                         ("decode_router_policy", decode_router_policy)):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"{flag} must be one of {', '.join(ROUTER_POLICIES)}, "
                             f"got {policy!r}")
    total = num_replicas + num_decode_replicas
    if cpu_sets is not None and (len(cpu_sets) != total or not all(cpu_sets)):
        raise ValueError(f"cpu_sets must hold one non-empty list of cores per replica "
                         f"({total}), got {cpu_sets!r}")
    if torch_threads is None:
        torch_threads = max((os.cpu_count() or 1) // total, 1)
    init = dict(model_name=model_name, metrics_prefix=metrics_prefix,
                step_timeout_s=step_timeout_s, torch_threads=torch_threads)

    def deploy(cls: Any, name: str, app: str, count: int, policy: str,
               **extra: Any) -> tuple[Any, str]:
        cache = engine_config.cache
        registry_key = f"{app}:{name}"
        router_config: dict[str, Any] = {
            "request_router_class": PolicyRequestRouter,
            "request_router_kwargs": {
                "policy": policy,
                "policy_options": policy_options or {},
                "block_size": cache.block_size,
                "hash_algo": cache.prefix_caching_hash_algo,
                "registry_key": registry_key,
            },
            "request_routing_stats_period_s": routing_stats_period_s,
        }
        deployment: Any = serve.deployment(cls, name=name)
        deployment = deployment.options(
            num_replicas=count,
            ray_actor_options={"num_cpus": num_cpus_per_replica},
            max_ongoing_requests=max_ongoing_requests,
            request_router_config=RequestRouterConfig(**router_config),
            # A log line per call would be one per request and stream: the engine has its own.
            logging_config={"enable_access_log": False},
        )
        handle = serve.run(deployment.bind(config_to_dict(engine_config), **init, **extra),
                           name=app, route_prefix=None)
        return handle, registry_key

    serve.start(proxy_location="Disabled")
    decode_handle = None
    if num_decode_replicas:
        from iterserve.cluster.ray_pd import PDEngineReplica

        handle, key = deploy(PDEngineReplica, "prefill", app_name, num_replicas,
                             router_policy, role="prefill", kv_connector=kv_connector,
                             cpu_sets=cpu_sets[:num_replicas] if cpu_sets else None)
        decode_handle, decode_key = deploy(PDEngineReplica, "decode", f"{app_name}-decode",
                                           num_decode_replicas, decode_router_policy,
                                           role="decode", kv_connector=kv_connector,
                                           cpu_sets=cpu_sets[num_replicas:] if cpu_sets else None)
        keys = [key, decode_key]
    else:
        handle, key = deploy(EngineReplica, "engine", app_name, num_replicas, router_policy,
                             cpu_sets=cpu_sets)
        keys = [key]
    info = handle.info.remote().result()
    tokenizer = load_tokenizer(engine_config.tokenizer or resolve_model_path(engine_config.model))

    def replica_texts() -> dict[str, str]:
        texts: dict[str, str] = {}
        for k in keys:
            router = ROUTERS.get(k)
            if router is not None:
                texts.update({rid: str(report.get("metrics", ""))
                              for rid, report in router.replica_reports().items()})
        return texts

    def live_replicas() -> int | None:
        # Each pool is needed: the fewest live replicas of the two.
        counts = [None if (r := ROUTERS.get(k)) is None else len(r.curr_replicas)
                  for k in keys]
        known = [c for c in counts if c is not None]
        return min(known) if known else None

    metrics = ClusterMetrics(model_name, prefix=metrics_prefix, replica_texts=replica_texts)
    return ClusterEngine(handle, tokenizer, info, model_name=model_name, metrics=metrics,
                         live_replicas=live_replicas, decode_handle=decode_handle)


def stop_cluster(app_name: str = APP_NAME) -> None:
    from ray import serve

    apps = serve.status().applications
    for app in (app_name, f"{app_name}-decode"):
        if app in apps:
            serve.delete(app)
    for key in [k for k in ROUTERS if k.split(":")[0] in (app_name, f"{app_name}-decode")]:
        ROUTERS.pop(key, None)


def serve_cluster(args: argparse.Namespace, engine_config: Any, server_config: Any) -> int:
    """The ``iterserve serve`` path for ``--data-parallel-size`` > 1: ``args`` are the
    parsed serve flags (``data_parallel_size``, ``ray_address``, ``router_policy``,
    ``metrics_prefix``, ``step_timeout``, ``host``, ``port``, ``log_level``),
    ``engine_config`` the replicas' ``EngineConfig``, ``server_config`` the ingress's
    ``ServerConfig``. Blocks until the server stops; returns the exit code."""
    import ray
    import uvicorn
    from ray import serve

    from iterserve.entrypoints.http_protocol import http_protocol
    from iterserve.entrypoints.server import build_app

    if server_config.enable_test_hooks:
        raise ValueError("enable_test_hooks is not supported with data_parallel_size > 1")
    name = server_config.served_model_names[0]
    num_prefill = getattr(args, "num_prefill_replicas", None)
    num_decode = getattr(args, "num_decode_replicas", None) or 0
    num_replicas = num_prefill or args.data_parallel_size
    object_store = 200 * 2**20
    kv_connector = None
    if num_decode:
        from iterserve.cluster.ray_pd import RayKVConnector

        kv = kv_transfer_settings(getattr(args, "kv_transfer_config", None))
        # The KV of requests between their prefill and their decode waits there.
        object_store += kv.kv_buffer_size
        kv_connector = RayKVConnector(kv.max_message_bytes)
    # A local instance gets a logical CPU per replica at least (replicas ask for one).
    init_ray(getattr(args, "ray_address", None),
             num_cpus=max(os.cpu_count() or 1, num_replicas + num_decode),
             object_store_memory=object_store)
    try:
        engine = start_cluster(
            engine_config,
            num_replicas=num_replicas,
            model_name=name,
            router_policy=getattr(args, "router_policy", "cache_aware"),
            metrics_prefix=args.metrics_prefix,
            step_timeout_s=args.step_timeout,
            num_decode_replicas=num_decode,
            decode_router_policy=getattr(args, "decode_router_policy", "least_kv"),
            kv_connector=kv_connector,
        )
        app = build_app(engine, server_config)  # type: ignore[arg-type]
        pools = (f"{num_replicas} prefill + {num_decode} decode replicas" if num_decode
                 else f"{num_replicas} replicas")
        print(f"iterserve: serving {name} on http://{args.host}:{args.port}/v1 "
              f"({pools} on Ray Serve)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    http=http_protocol(), timeout_graceful_shutdown=10)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
