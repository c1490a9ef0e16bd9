"""The ``iterserve serve`` flags of the Ray Serve cluster (no Ray import here: a
single-replica server never loads Ray)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from iterserve.cluster import ROUTER_POLICIES

# vLLM's --kv-transfer-config connector names this deployment answers to: KV moves
# through Ray's object store between the replicas it starts itself.
KV_CONNECTORS = ("RayConnector",)
# Bytes of object store a local Ray instance gets for KV in flight (vLLM's default
# kv_buffer_size, 1e9).
DEFAULT_KV_BUFFER_SIZE = 10**9


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (Ray Serve)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas; above 1 they run on Ray Serve behind a routing "
                   "policy, the HTTP server in this process (vLLM's flag)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local Ray instance)")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="how requests are spread over replicas (docs/cluster.md)")
    # The spellings and defaults of `iterserve simulate`'s (cli_simulate_pd.add_pd_args).
    g.add_argument("--num-prefill-replicas", type=int, default=None,
                   help="prefill/decode disaggregation: replicas that only prefill (with "
                        "--num-decode-replicas); routed by --router-policy")
    g.add_argument("--num-decode-replicas", type=int, default=None,
                   help="replicas that decode from the transferred KV")
    g.add_argument("--decode-router-policy", default="least_kv", choices=ROUTER_POLICIES,
                   help="routing among decode replicas (default least_kv; prefill replicas "
                        "use --router-policy)")
    g.add_argument("--kv-transfer-config", type=_json_object, default=None,
                   help="vLLM's KV transfer JSON, where it maps: kv_connector "
                        f"{'/'.join(KV_CONNECTORS)}, kv_role kv_both (this deployment runs "
                        "both pools), kv_buffer_size (object store bytes for KV in flight), "
                        "kv_connector_extra_config.max_message_bytes (the most one object "
                        "of KV holds; larger KV goes as several)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


@dataclass(frozen=True, slots=True)
class KVTransferSettings:
    """What ``--kv-transfer-config`` resolves to."""

    kv_connector: str = KV_CONNECTORS[0]
    kv_buffer_size: int = DEFAULT_KV_BUFFER_SIZE
    # The most bytes one object of KV holds (None: a request's KV is one object).
    max_message_bytes: int | None = None


def kv_transfer_settings(config: dict[str, Any] | None) -> KVTransferSettings:
    """vLLM's ``KVTransferConfig`` fields, mapped or refused (ValueError naming the
    field). Each vLLM instance has one role; here one launch runs both pools, so the
    role is ``kv_both``; a producer or consumer alone has no peer to talk to."""
    if not config:
        return KVTransferSettings()
    known = {"kv_connector", "kv_role", "kv_buffer_size", "kv_buffer_device",
             "kv_connector_extra_config"}
    for key in config:
        if key not in known:
            raise ValueError(
                f"kv_transfer_config.{key}: not supported (this deployment wires its own "
                f"replicas; supported: {', '.join(sorted(known))})")
    connector = config.get("kv_connector") or KV_CONNECTORS[0]
    if connector not in KV_CONNECTORS:
        raise ValueError(
            f"kv_transfer_config.kv_connector: {connector!r} is not available; KV moves "
            f"between the replicas through Ray's object store ({', '.join(KV_CONNECTORS)})")
    role = config.get("kv_role", "kv_both")
    if role in ("kv_producer", "kv_consumer"):
        raise ValueError(
            f"kv_transfer_config.kv_role: {role!r} makes one server half of a pair, with a "
            "proxy in front; iterserve runs both pools behind one endpoint: pass "
            "kv_both (or no kv_role) with --num-prefill-replicas P --num-decode-replicas D")
    if role != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role must be kv_both, got {role!r}")
    device = config.get("kv_buffer_device", "cpu")
    if device != "cpu":
        raise ValueError(f"kv_transfer_config.kv_buffer_device: {device!r}: KV in flight "
                         "lives in Ray's object store, in host memory: pass cpu")
    extra = config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
    for key in extra:
        if key != "max_message_bytes":
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}: not "
                             "supported (RayConnector takes max_message_bytes)")
    cap = extra.get("max_message_bytes")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 4096):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.max_message_bytes "
                         f"must be an integer >= 4096, got {cap!r}")
    size = config.get("kv_buffer_size", DEFAULT_KV_BUFFER_SIZE)
    if isinstance(size, bool) or not isinstance(size, int | float) or size < 2**20:
        raise ValueError(f"kv_transfer_config.kv_buffer_size must be a number of bytes "
                         f">= 1 MiB, got {size!r}")
    return KVTransferSettings(connector, int(size), cap)


def wants_pd(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "num_prefill_replicas", None)
                or getattr(args, "num_decode_replicas", None)
                or getattr(args, "kv_transfer_config", None))


def check_cluster_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    if not wants_pd(args):
        return
    p, d = args.num_prefill_replicas, args.num_decode_replicas
    if p is None or d is None:
        raise ValueError("num_prefill_replicas and num_decode_replicas: prefill/decode "
                         "disaggregation takes both")
    for name, n in (("num_prefill_replicas", p), ("num_decode_replicas", d)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if args.data_parallel_size != 1:
        raise ValueError("data_parallel_size: give it or --num-prefill-replicas / "
                         "--num-decode-replicas, not both")
    kv_transfer_settings(args.kv_transfer_config)
