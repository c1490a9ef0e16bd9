"""One generator: ``simulate`` and ``bench serve`` draw the same arrivals and lengths
for the same seed, and read the same rows from a trace."""

from __future__ import annotations

import numpy as np
import pytest

from iterserve.bench.datasets import build_requests
from iterserve.bench.serve import BenchConfig, schedule_offsets
from iterserve.measure.lengths import uniform_around
from iterserve.measure.traces import shipped_traces, trace_path
from iterserve.sim.workload import make_workload


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_random_dataset_equals_simulated_workload(seed, burstiness):
    n, rate = 200, 4.0
    reqs = build_requests("random", n, seed=seed, send_token_ids=True, random_input_len=100,
                          random_output_len=40, random_range_ratio=0.5)
    sent = schedule_offsets(reqs, BenchConfig(request_rate=rate, burstiness=burstiness, seed=seed))
    p, o = uniform_around(100, 0.5, 0), uniform_around(40, 0.5, 1)
    wl = make_workload(n, arrival="poisson" if burstiness == 1.0 else "gamma", rate=rate,
                       burstiness=burstiness, prompt_len=p, output_len=o, seed=seed)
    assert [r.prompt_len for r in reqs] == [s.prompt_len for s in wl.requests]
    assert [r.expected_output_len for r in reqs] == [s.output_len for s in wl.requests]
    assert np.array_equal(sent, [s.arrival_time for s in wl.requests])
    # Really random: another seed gives another workload.
    other = make_workload(n, arrival="gamma", rate=rate, burstiness=burstiness, prompt_len=p,
                          output_len=o, seed=seed + 1)
    assert [s.prompt_len for s in other.requests] != [s.prompt_len for s in wl.requests]


def test_trace_dataset_equals_simulated_trace_workload():
    n = 50
    reqs = build_requests("trace", n, send_token_ids=True, dataset_path="splitwise_code",
                          trace_time_scale=0.5)
    wl = make_workload(n, arrival="trace", prompt_len="trace", output_len="trace",
                       trace="splitwise_code", time_scale=0.5)
    assert [r.prompt_len for r in reqs] == [s.prompt_len for s in wl.requests]
    assert [r.expected_output_len for r in reqs] == [s.output_len for s in wl.requests]
    assert [r.arrival_time for r in reqs] == pytest.approx([s.arrival_time for s in wl.requests])


def test_traces_ship_with_the_package():
    assert shipped_traces() == ["splitwise_code", "splitwise_conv", "summarization_long"]
    for name in shipped_traces():
        p = trace_path(name)
        assert p.is_file() and p.parent.name == "traces"
        assert p.read_text().splitlines()[0] == "arrived_at,num_prefill_tokens,num_decode_tokens"
    assert (trace_path("splitwise_conv").parent / "README.md").is_file()
    assert trace_path("splitwise_conv.csv") == trace_path("splitwise_conv")
    with pytest.raises(ValueError, match="not a shipped trace"):
        trace_path("no_such_trace")
