"""The slo policy under targets no schedule can meet: it serves at full throughput.

A TPOT target below the shortest step there is (one decode) is missed by every
schedule, so goodput is zero whatever the policy does; the policy must then not trade
throughput (or latency) for it. The property: under any linear step-cost model and any
saturating workload, with such targets slo's output throughput is within 10% of fcfs's
on the same run. The simulator's cost model and virtual clock make each run
deterministic and fast."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cost_model import CostModel
from iterserve.sim.simulator import Simulator, compute_metrics
from iterserve.sim.workload import make_workload


def _run(policy: str, cost: CostModel, workload, *, tpot_ms: float, ttft_ms: float,
         prior: bool) -> dict:
    coeffs = (cost.t0, cost.prefill_token, cost.decode_seq, cost.context_token) if prior else ()
    sc = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096,
                         scheduling_policy=policy, tpot_slo_ms=tpot_ms, ttft_slo_ms=ttft_ms,
                         step_time_coefficients=coeffs)
    cc = CacheConfig(block_size=16, num_gpu_blocks=2048)
    return compute_metrics(Simulator(sc, cc, cost, record_itl=False).run(workload))


costs = st.builds(
    CostModel,
    t0=st.floats(1e-3, 0.3),
    prefill_token=st.floats(0.0, 2e-4),
    decode_seq=st.floats(0.0, 2e-3),
    context_token=st.floats(0.0, 1e-6),
    swap_block=st.just(0.0),
)


# derandomize: the same examples on every run, so CI's verdict is the code's. Random
# search once found rare counterexamples (the no-prior case below); 6,000 random
# examples now pass.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(cost=costs, below=st.floats(0.05, 0.95), ttft_ms=st.sampled_from([1.0, 100.0, 2000.0]),
       prior=st.booleans(), seed=st.integers(0, 2**16))
def test_slo_keeps_fcfs_throughput_when_the_tpot_target_is_infeasible(cost, below, ttft_ms,
                                                                       prior, seed):
    shortest = cost.t0 + cost.decode_seq  # one decode step: no step is shorter
    tpot_ms = shortest * below * 1e3
    # Arrivals well above what the engine serves one at a time: the policy's choices
    # decide the throughput.
    rate = 20.0 / shortest
    wl = make_workload(120, rate=rate, prompt_len="uniform:16:300", output_len="uniform:4:80",
                       seed=seed)
    fcfs = _run("fcfs", cost, wl, tpot_ms=tpot_ms, ttft_ms=ttft_ms, prior=prior)
    slo = _run("slo", cost, wl, tpot_ms=tpot_ms, ttft_ms=ttft_ms, prior=prior)
    assert slo["num_completed"] == fcfs["num_completed"] == 120
    assert slo["output_token_throughput"] >= 0.9 * fcfs["output_token_throughput"], (slo, fcfs)


def test_slo_keeps_fcfs_throughput_under_a_constant_step_cost_with_no_prior():
    """A counterexample random search found: every step 1 ms whatever it holds, the
    TPOT target 0.92 ms, no cost-model prior. The untrained model believed the
    target feasible for ~170 steps and held batches small (0.63x fcfs's throughput)
    until shaped steps that kept missing turned shaping off."""
    cost = CostModel(t0=1e-3, prefill_token=0.0, decode_seq=0.0, context_token=0.0,
                     swap_block=0.0)
    wl = make_workload(120, rate=20.0 / 1e-3, prompt_len="uniform:16:300",
                       output_len="uniform:4:80", seed=457)
    fcfs = _run("fcfs", cost, wl, tpot_ms=0.923, ttft_ms=1.0, prior=False)
    slo = _run("slo", cost, wl, tpot_ms=0.923, ttft_ms=1.0, prior=False)
    assert slo["output_token_throughput"] >= 0.9 * fcfs["output_token_throughput"]


def test_the_reported_collapse_is_gone():
    """The held-out check's case: default targets (TTFT 2 s, TPOT 100 ms), every step
    over 100 ms. slo served about one token per step (15x under fcfs)."""
    cost = CostModel(t0=0.15, prefill_token=2e-5, decode_seq=3e-4, context_token=2e-7,
                     swap_block=0.0)
    wl = make_workload(200, rate=50.0, prompt_len="uniform:16:400", output_len="uniform:8:100",
                       seed=1)
    fcfs = _run("fcfs", cost, wl, tpot_ms=100.0, ttft_ms=2000.0, prior=False)
    slo = _run("slo", cost, wl, tpot_ms=100.0, ttft_ms=2000.0, prior=False)
    assert slo["output_token_throughput"] >= 0.9 * fcfs["output_token_throughput"]
    assert slo["mean_batch_size"] >= 0.9 * fcfs["mean_batch_size"]
    assert slo["ttft_ms"]["mean"] <= 1.1 * fcfs["ttft_ms"]["mean"]
