"""`bench serve --dataset-name multi-turn` against the stub server: token-id prompts, at
the workload's own times, one X-Session-Id per session."""

from __future__ import annotations

from iterserve.entrypoints.cli import main
from iterserve.measure.workload_multi_turn import MultiTurnConfig, make_multi_turn_workload


def test_bench_serve_sends_the_multi_turn_sessions(stub, capsys):
    rc = main(["bench", "serve", "--base-url", stub.base_url, "--model", "stub-model",
               "--dataset-name", "multi-turn", "--num-prompts", "12", "--request-rate", "40",
               "--multi-turn-tenants", "2", "--multi-turn-system-prompt-len", "32",
               "--multi-turn-turns", "fixed:3", "--multi-turn-output-len", "fixed:4",
               "--multi-turn-user-len", "fixed:8", "--multi-turn-think-time", "0.05",
               "--multi-turn-est-tpot", "0.01", "--disable-tqdm"])
    assert rc == 0
    assert "Replaying the trace's arrival times" in capsys.readouterr().out
    cfg = MultiTurnConfig(num_tenants=2, system_prompt_len=32, turns="fixed:3",
                          output_len="fixed:4", user_len="fixed:8", think_time_s=0.05,
                          est_tpot_s=0.01, vocab_size=256)
    wl = make_multi_turn_workload(12, cfg, rate=40.0, seed=0)
    sent = sorted((b["prompt"] for b in stub.bodies), key=len)
    assert sent == sorted((r.prompt_token_ids for r in wl.requests), key=len)
    assert all(b["max_tokens"] == 4 for b in stub.bodies)
    sessions = {h["X-Session-Id"] for h in stub.headers}
    assert sessions == {r.session_id for r in wl.requests} and len(sessions) == 4
