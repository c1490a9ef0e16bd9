"""The prefill/decode flags of ``iterserve serve`` (no Ray): simulate's spellings and
defaults, their checks, and vLLM's ``--kv-transfer-config`` mapped or refused."""

from __future__ import annotations

import argparse
import json

import pytest

from iterserve.cluster.cli import (
    DEFAULT_KV_BUFFER_SIZE,
    check_cluster_args,
    kv_transfer_settings,
    wants_pd,
)
from iterserve.entrypoints.cli import build_parser
from iterserve.entrypoints.cli_serve import run

PD_FLAGS = ("num_prefill_replicas", "num_decode_replicas", "decode_router_policy")


def actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_serve_takes_simulates_pd_flags():
    serve, simulate = actions("serve"), actions("simulate")
    for dest in PD_FLAGS:
        assert serve[dest].option_strings == simulate[dest].option_strings, dest
        assert serve[dest].default == simulate[dest].default, dest


def test_pd_flags_are_checked():
    ok = serve_args("--num-prefill-replicas", "2", "--num-decode-replicas", "1")
    assert wants_pd(ok)
    check_cluster_args(ok)
    assert not wants_pd(serve_args("-dp", "2"))
    with pytest.raises(ValueError, match="takes both"):
        check_cluster_args(serve_args("--num-prefill-replicas", "2"))
    with pytest.raises(ValueError, match="num_decode_replicas must be >= 1"):
        check_cluster_args(serve_args("--num-prefill-replicas", "1",
                                      "--num-decode-replicas", "0"))
    with pytest.raises(ValueError, match="data_parallel_size"):
        check_cluster_args(serve_args("-dp", "2", "--num-prefill-replicas", "1",
                                      "--num-decode-replicas", "1"))
    # The serve command says so before anything starts.
    with pytest.raises(SystemExit, match="takes both"):
        run(serve_args("--num-decode-replicas", "1"))


def test_kv_transfer_config_maps_where_it_can():
    assert kv_transfer_settings(None).kv_buffer_size == DEFAULT_KV_BUFFER_SIZE
    s = kv_transfer_settings({"kv_connector": "RayConnector", "kv_role": "kv_both",
                              "kv_buffer_size": 5e8, "kv_buffer_device": "cpu"})
    assert (s.kv_connector, s.kv_buffer_size) == ("RayConnector", 500_000_000)
    assert s.max_message_bytes is None
    s = kv_transfer_settings({"kv_connector_extra_config": {"max_message_bytes": 2**20}})
    assert s.max_message_bytes == 2**20
    args = serve_args("--num-prefill-replicas", "1", "--num-decode-replicas", "1",
                      "--kv-transfer-config", json.dumps({"kv_role": "kv_both"}))
    check_cluster_args(args)


@pytest.mark.parametrize(("config", "field"), [
    ({"kv_connector": "NixlConnector"}, "kv_connector"),
    ({"kv_role": "kv_producer"}, "kv_role"),
    ({"kv_role": "kv_consumer"}, "kv_role"),
    ({"kv_role": "both"}, "kv_role"),
    ({"kv_buffer_device": "cuda"}, "kv_buffer_device"),
    ({"kv_buffer_size": "big"}, "kv_buffer_size"),
    ({"kv_buffer_size": 10}, "kv_buffer_size"),
    ({"kv_port": 14579}, "kv_port"),
    ({"kv_connector_extra_config": {"x": 1}}, "kv_connector_extra_config.x"),
    ({"kv_connector_extra_config": [1]}, "kv_connector_extra_config"),
    ({"kv_connector_extra_config": {"max_message_bytes": 100}},
     "kv_connector_extra_config.max_message_bytes"),
    ({"kv_connector_extra_config": {"max_message_bytes": "1M"}},
     "kv_connector_extra_config.max_message_bytes"),
])
def test_kv_transfer_config_refusals_name_the_field(config, field):
    with pytest.raises(ValueError, match=f"kv_transfer_config.{field}"):
        kv_transfer_settings(config)


def test_kv_transfer_config_alone_asks_for_the_pools():
    with pytest.raises(SystemExit, match="num_prefill_replicas"):
        run(serve_args("--kv-transfer-config", '{"kv_role": "kv_both"}'))
    with pytest.raises(SystemExit):
        serve_args("--kv-transfer-config", "[1]")  # not a JSON object


def test_pd_replica_checks_its_role_and_connector():
    """Refused by name before an engine is built (no Ray needed)."""
    from iterserve.cluster.ray_pd import PDEngineReplica

    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        PDEngineReplica({}, role="both", model_name="m")
    with pytest.raises(ValueError, match="kv_connector: expected a KVConnector, got dict"):
        PDEngineReplica({}, role="decode", kv_connector={}, model_name="m")
