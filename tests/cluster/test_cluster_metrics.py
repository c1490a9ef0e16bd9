"""The ingress's /metrics over replicas: each replica's samples under a ``replica``
label, the ingress's own families (admission, routing) once, no Ray needed."""

from __future__ import annotations

from iterserve.cluster.ray_client import ClusterMetrics
from iterserve.metrics import Metrics, SchedulerSnapshot, parse_metrics


def replica_text(running: int, hits: int) -> str:
    m = Metrics("m")
    m.observe_step(SchedulerSnapshot(num_running=running, prefix_cache_queries=100,
                                     prefix_cache_hits=hits), 0)
    m.observe_tokens(10, running)
    return m.render().decode()


def test_replicas_merged_under_their_label():
    texts = {"r0": replica_text(2, 30), "r1": replica_text(5, 60)}
    metrics = ClusterMetrics("m", replica_texts=lambda: texts)
    metrics.observe_routed("r0")
    metrics.num_requests_admitted.set(3)
    got = parse_metrics(metrics.render().decode())
    assert got["iterserve:num_requests_running{replica=r0}"] == 2
    assert got["iterserve:num_requests_running{replica=r1}"] == 5
    assert got["iterserve:prefix_cache_hits_total{replica=r1}"] == 60
    assert got["iterserve:generation_tokens_total{replica=r1}"] == 5
    # The ingress's own families: once, unlabelled by replica; the replicas' idle copies
    # of them are not shown.
    assert got["iterserve:num_requests_admitted"] == 3
    assert not any(k.startswith("iterserve:num_requests_admitted{replica") for k in got)
    assert got["iterserve:cluster_requests_routed_total{replica=r0}"] == 1
    # No unlabelled engine samples when replicas report.
    assert "iterserve:num_requests_running" not in got


def test_before_any_report_the_names_are_there():
    got = parse_metrics(ClusterMetrics("m").render().decode())
    assert "iterserve:num_requests_running" in got


def test_no_live_replica_is_a_503_not_a_hang():
    """With every replica gone Ray Serve would hold a request until a replacement
    starts: the ingress refuses it instead (EngineDeadError: a 503) and /health fails."""
    import pytest

    from iterserve.cluster.ray_client import ClusterEngine
    from iterserve.engine.exceptions import EngineDeadError

    live = [2]
    engine = ClusterEngine(
        None, None, {"max_model_len": 64, "vocab_size": 10, "sampling_defaults": {}},
        model_name="m", metrics=ClusterMetrics("m"), live_replicas=lambda: live[0])
    engine.check_health()
    assert engine.is_healthy
    live[0] = 0
    assert not engine.is_healthy and isinstance(engine.dead_error, EngineDeadError)
    with pytest.raises(EngineDeadError, match="no engine replica"):
        engine.check_health()
