"""``iterserve serve --data-parallel-size N``: N engine replicas on Ray Serve, one ingress.

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
) -> ClusterEngine:
    """Deploy ``num_replicas`` engines (Ray must be initialised) and return the ingress's
    engine client. ``torch_threads``: per replica; default: the cores split evenly."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from iterserve.cluster import ROUTER_POLICIES
    from iterserve.model.loader import load_tokenizer, resolve_model_path

    if num_replicas < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
    if router_policy not in ROUTER_POLICIES:
        raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, "
                         f"got {router_policy!r}")
    if torch_threads is None:
        torch_threads = max((os.cpu_count() or 1) // num_replicas, 1)
    cache = engine_config.cache
    registry_key = f"{app_name}:engine"
    router_config: dict[str, Any] = {
        "request_router_class": PolicyRequestRouter,
        "request_router_kwargs": {
            "policy": router_policy,
            "policy_options": policy_options or {},
            "block_size": cache.block_size,
            "hash_algo": cache.prefix_caching_hash_algo,
            "registry_key": registry_key,
        },
        "request_routing_stats_period_s": routing_stats_period_s,
    }
    deployment: Any = serve.deployment(EngineReplica, name="engine")
    deployment = deployment.options(
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus_per_replica},
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=RequestRouterConfig(**router_config),
        # A log line per call would be one per request and stream: the engine has its own.
        logging_config={"enable_access_log": False},
    )
    serve.start(proxy_location="Disabled")
    handle = serve.run(
        deployment.bind(config_to_dict(engine_config), model_name=model_name, metrics_prefix=metrics_prefix,
                        step_timeout_s=step_timeout_s, torch_threads=torch_threads),
        name=app_name,
        route_prefix=None,
    )
    info = handle.info.remote().result()
    tokenizer = load_tokenizer(engine_config.tokenizer or resolve_model_path(engine_config.model))

    def replica_texts() -> dict[str, str]:
        router = ROUTERS.get(registry_key)
        if router is None:
            return {}
        return {rid: str(report.get("metrics", ""))
                for rid, report in router.replica_reports().items()}

    def live_replicas() -> int | None:
        router = ROUTERS.get(registry_key)
        return None if router is None else len(router.curr_replicas)

    metrics = ClusterMetrics(model_name, prefix=metrics_prefix, replica_texts=replica_texts)
    return ClusterEngine(handle, tokenizer, info, model_name=model_name, metrics=metrics,
                         live_replicas=live_replicas)


def stop_cluster(app_name: str = APP_NAME) -> None:
    from ray import serve

    serve.delete(app_name)
    ROUTERS.pop(f"{app_name}:engine", None)


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
    # A local instance gets a logical CPU per replica at least (replicas ask for one).
    init_ray(getattr(args, "ray_address", None),
             num_cpus=max(os.cpu_count() or 1, args.data_parallel_size))
    try:
        engine = start_cluster(
            engine_config,
            num_replicas=args.data_parallel_size,
            model_name=name,
            router_policy=getattr(args, "router_policy", "cache_aware"),
            metrics_prefix=args.metrics_prefix,
            step_timeout_s=args.step_timeout,
        )
        app = build_app(engine, server_config)  # type: ignore[arg-type]
        print(f"iterserve: serving {name} on http://{args.host}:{args.port}/v1 "
              f"({args.data_parallel_size} replicas on Ray Serve)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    http=http_protocol(), timeout_graceful_shutdown=10)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
