"""Fleet planning finds the cheapest deployment meeting the goodput target (checked
against every candidate simulated), and the P/D and plan CLI validate their flags."""

from __future__ import annotations

import json

import pytest

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.entrypoints.cli import main
from iterserve.sim.cost_model import CostModel
from iterserve.sim.disagg import KVLink
from iterserve.sim.plan import Deployment, Planner, candidates, plan
from iterserve.sim.workload import make_workload

SC = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096)
CC = CacheConfig(block_size=16, num_gpu_blocks=1500)
# "h100" 3x as fast as "l4" (and ~6x the price at the presets'): which is cheapest
# depends on how many of each the load needs.
FAST = CostModel(t0=4e-3, prefill_token=2e-5, decode_seq=2e-5, context_token=1e-7)
SLOW = CostModel(t0=12e-3, prefill_token=6e-5, decode_seq=6e-5, context_token=3e-7)
SLOS = {"ttft": 400.0, "tpot": 60.0}


def pools(hardware: str, tp: int):
    if hardware == "a100":
        raise ValueError("does not fit")  # a GPU kind the model does not fit
    return (FAST if hardware == "h100" else SLOW), SC, CC


def planner() -> Planner:
    return Planner(pools, kv_bytes_per_token=50_000.0, link=KVLink(100.0, 1e-3), slos_ms=SLOS)


def workload():
    return make_workload(160, rate=50.0, prompt_len="uniform:64:700",
                         output_len="uniform:8:60", seed=3)


def test_deployment_price_and_gpus():
    d = Deployment.disaggregated("h100", 8, 2, "a100", 8, 3)
    assert d.num_gpus == 40
    assert d.price_per_hour == pytest.approx(16 * 4.75 + 24 * 2.20)
    assert d.power_w == 16 * 700 + 24 * 400
    c = Deployment.colocated("a100", 4, 3)
    assert (c.num_gpus, c.price_per_hour) == (12, pytest.approx(12 * 2.20))


def test_plan_finds_the_cheapest_deployment_that_meets_the_target():
    pl, wl = planner(), workload()
    hw, tps = ["l4", "h100", "a100"], {"l4": [1], "h100": [1], "a100": [1]}
    res = plan(pl, wl, 50.0, hardware=hw, tp_sizes=tps, max_gpus=4, target=0.9)
    # a100 "does not fit": no family of it was tried.
    assert all("a100" not in fam for fam in res.best)
    # The oracle: every candidate simulated; the cheapest that meets the target.
    every = [pl.evaluate(d, wl, 50.0) for deps in candidates(hw, tps, 4, fits=pl.fits).values()
             for d in deps]
    ok = [e for e in every if e.goodput_fraction >= 0.9]
    bad = [e for e in every if e.goodput_fraction < 0.9]
    assert ok and bad  # a case where the answer is not trivial
    best = res.cheapest
    assert best is not None
    assert best.deployment.price_per_hour == pytest.approx(
        min(e.deployment.price_per_hour for e in ok))
    assert best.goodput_fraction >= 0.9
    # The one cheapest l4 fleet needs more than one replica: one alone misses.
    one = pl.evaluate(Deployment.colocated("l4", 1, 1), wl, 50.0)
    assert one.goodput_fraction < 0.9
    # A tighter target never makes the plan cheaper.
    strict = plan(pl, wl, 50.0, hardware=hw, tp_sizes=tps, max_gpus=4, target=0.99)
    if strict.cheapest is not None:
        assert strict.cheapest.deployment.price_per_hour >= best.deployment.price_per_hour


def test_plan_skips_hardware_that_cannot_meet_the_slo_unloaded():
    pl = Planner(pools, kv_bytes_per_token=50_000.0, link=KVLink(100.0), slos_ms={"tpot": 10.0})
    assert pl.hopeless(Deployment.colocated("l4", 1, 1))  # a 12 ms step > 10 ms
    assert not pl.hopeless(Deployment.colocated("h100", 1, 1))
    res = plan(pl, workload(), 50.0, hardware=["l4"], tp_sizes={"l4": [1]}, max_gpus=3)
    assert res.cheapest is None and not res.evaluated
    with pytest.raises(ValueError, match="goodput target"):
        plan(pl, workload(), 1.0, hardware=["l4"], tp_sizes={"l4": [1]}, max_gpus=3, target=1.5)


BASE = ["simulate", "--num-requests", "40", "--request-rate", "4", "--prompt-len", "uniform:16:300",
        "--output-len", "fixed:20", "--model", "llama-2-70b", "--hardware", "h100",
        "--tensor-parallel-size", "4", "--plain", "--no-progress"]


@pytest.mark.parametrize("extra,message", [
    (["--num-prefill-replicas", "0", "--num-decode-replicas", "1"], "--num-prefill-replicas must be >= 1"),
    (["--num-prefill-replicas", "1"], "--num-prefill-replicas and --num-decode-replicas go together"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1", "--kv-link-gbps", "0"],
     "--kv-link-gbps must be > 0"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1", "--kv-link-latency-ms", "-1"],
     "--kv-link-latency-ms must be >= 0"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1", "--decode-hardware", "b300"],
     "--decode-hardware: unknown hardware"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1", "--slo-tpot-ms", "-5"],
     "--slo-tpot-ms must be > 0"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1", "--num-replicas", "2"],
     "--num-replicas is for colocated"),
    (["--num-prefill-replicas", "1", "--num-decode-replicas", "1",
      "--decode-router-policy", "nope"], "--decode-router-policy must be one of"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--goodput-target", "0"], "--goodput-target must be in"),
    (["--plan-tensor-parallel-sizes", "4,x"], "--plan-tensor-parallel-sizes wants"),
    (["--plan-modes", "split"], "--plan-modes wants"),
])
def test_bad_flags_name_the_flag(extra, message):
    with pytest.raises(SystemExit, match=message):
        main([*BASE, *extra])


def test_70b_on_one_gpu_says_it_does_not_fit():
    k = BASE.index("--tensor-parallel-size")
    args = BASE[:k] + BASE[k + 2:]
    with pytest.raises(SystemExit, match=r"does not fit one H100.*tensor-parallel-size"):
        main(args)
    with pytest.raises(SystemExit, match="does not fit"):
        main([*args, "--num-prefill-replicas", "1", "--num-decode-replicas", "1"])


def test_pd_cli_and_plan_cli(tmp_path, capsys):
    out = tmp_path / "pd"
    rc = main([*BASE, "--num-prefill-replicas", "1", "--num-decode-replicas", "2",
               "--prefill-hardware", "h100", "--decode-hardware", "a100",
               "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--out", str(out), "--no-plots"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "KV transfer" in text and "TPOT (decode replica)" in text and "$" in text
    doc = json.loads((out / "result.json").read_text())
    m = doc["runs"][0]["metrics"]
    assert m["num_completed"] == 40 and m["goodput"]["slos_ms"] == {"ttft": 2000.0, "tpot": 100.0}
    assert m["phases"]["decode"]["prefill_tokens_recomputed"] == 0
    assert doc["disaggregation"]["num_gpus"] == 12
    plan_out = tmp_path / "plan"
    rc = main([*BASE, "plan", "--plan-hardware", "h100", "--plan-tensor-parallel-sizes", "4",
               "--plan-max-gpus", "8", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
               "--plan-rates", "2,4", "--out", str(plan_out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Cheapest fleet per family" in text and "cheapest: 1 x h100x4" in text
    doc = json.loads((plan_out / "plan.json").read_text())
    assert doc["cheapest"] == "1 x h100x4"
    assert set(doc["curves"]) == {"1 x h100x4", "1P h100x4 + 1D h100x4"}
    assert (plan_out / "plan.png").stat().st_size > 0
