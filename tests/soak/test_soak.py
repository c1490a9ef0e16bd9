"""The soak test: a real server over capacity with good, bad and vanishing clients and
injected step faults; nothing lost, nothing leaked, greedy outputs unchanged.

The short version runs in the default suite (~30 s); the long one is ``-m slow``
(``ITERSERVE_SOAK_SECONDS``, default 300). benchmarks/soak.py runs it by hand.
"""

from __future__ import annotations

import os

import pytest
from benchmarks.soak_harness import SoakConfig, SoakReport, run_soak

from tests.model.helpers import make_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("soak-llama")
    make_checkpoint(path, "llama")
    return path


def check(report: SoakReport, cfg: SoakConfig, rss_slack: float) -> None:
    print()
    print(report.table())
    assert not report.problems, "\n".join(report.problems[:30])
    assert report.lost == 0 and report.duplicates == 0 and report.blocks_leaked == 0
    assert report.accepted == report.completed + report.aborted + report.errored
    # The mix really happened: overload refused, clients left, faults failed requests,
    # the small KV pool preempted, shared prefixes hit the cache.
    assert report.rejected.get(429, 0) > 0 and report.rejected.get(400, 0) > 0
    assert report.rejected.get(401, 0) > 0
    assert report.aborted > 0 and report.errored > 0 and report.completed > 0
    assert report.preemptions > 0 and report.prefix_cache_hit_rate > 0
    assert report.greedy_checked > 0 and report.greedy_mismatches == 0
    assert report.health_failures == 0
    # Memory. Python objects (where a per-request leak would show) are counted exactly;
    # RSS is noisier: native caches (oneDNN primitives per batch shape, allocator arenas)
    # warm up for the first ~25 s and then stay flat (docs/serving.md, reliability), so
    # the short run allows that warm-up and the long run holds RSS to a few percent.
    assert report.objects_after - report.objects_before < 2000, report.table()
    assert report.rss_growth_mib < rss_slack * report.rss_first_mib, report.table()


def test_soak_short(model_path, tmp_path):
    cfg = SoakConfig(duration_s=16.0, calibrate_s=2.5)
    check(run_soak(model_path, cfg, tmp_path), cfg, rss_slack=0.10)


@pytest.mark.slow
def test_soak_long(model_path, tmp_path):
    cfg = SoakConfig(duration_s=float(os.environ.get("ITERSERVE_SOAK_SECONDS", "300")),
                     raise_at=(0.2, 0.4, 0.6, 0.8), hang_at=(0.3, 0.7))
    check(run_soak(model_path, cfg, tmp_path), cfg, rss_slack=0.03)
