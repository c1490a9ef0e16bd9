"""The adaptive speculation rule end to end: a real engine on the trained default model
whose clock is a fake one, advanced by each model step by a modelled cost of the step's
rows (and by the proposer by a modelled cost per request it drafts for), so the rule
reads known step times.

Where verify rows cost little the rule keeps drafting; where a row costs nearly a step,
where drafts are rejected, or where the proposer costs more than its drafts save, it
turns drafting (almost) off. Greedy output equals decoding without speculation in every
case. Each "off" case is set against the same workload with the rule off (``adaptive``
false), which drafts every step, so the assertions fail if the rule does nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import SpeculativeConfig
from iterserve.core.spec_decode import COLD_STEPS, SpecDecodeController, SpecDecodeStats
from iterserve.engine.core import EngineCore
from iterserve.spec_decode import DraftRequest, Proposer, make_proposer
from tests.spec_decode.shipped import CODE, needs_shipped_model

pytestmark = needs_shipped_model
# Prompts that repeat themselves: the trained model copies, so n-gram drafts are accepted.
PROMPTS = [CODE + "\n# The same function again:\n" + CODE[:n] for n in (60, 120, 200)]
MAX_NEW = 48
K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


@dataclasses.dataclass
class Cost:
    """Modelled seconds: a step's ``base + per_row * rows`` (every scheduled token is a
    row: decodes, drafts, prefill), plus ``cliff`` for a step of more than ``fused_rows``
    rows (past a fused few-row decoder); a proposer call's ``per_request`` per request."""

    base: float
    per_row: float
    per_request: float = 0.0
    fused_rows: int = 0
    cliff: float = 0.0

    def step(self, rows: int) -> float:
        extra = self.cliff if self.fused_rows and rows > self.fused_rows else 0.0
        return self.base + self.per_row * rows + extra


# Verify rows nearly free: 10 ms a step, 0.1 ms a row.
CHEAP = Cost(10e-3, 0.1e-3)
# A row costs nearly a full step: a step of n rows is n times a one-row step.
COSTLY = Cost(0.5e-3, 10e-3)
# Rows cost enough that only drafts that are likely accepted pay (p > ~0.5 at 3 rows).
MODERATE = Cost(10e-3, 3e-3)
# Rows nearly free, but the proposer costs more per request than a step.
SLOW_PROPOSER = Cost(10e-3, 0.1e-3, per_request=15e-3)
# A runner with an 8-row fused decoder: rows nearly free up to 8, then a step costs
# four times as much (the batched path's overhead).
FUSED = 8
CLIFF = Cost(5e-3, 0.2e-3, fused_rows=FUSED, cliff=15e-3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class PricedProposer(Proposer):
    """A proposer whose calls advance the fake clock by the cost model's seconds."""

    def __init__(self, inner: Proposer, bench: Bench) -> None:
        self.inner = inner
        self.bench = bench
        self.method = inner.method

    def propose(self, req_id, token_ids, k, num_prompt_tokens=0):
        return self.propose_batch([DraftRequest(req_id, token_ids, num_prompt_tokens, k)])[0]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.bench.clock.now += self.bench.cost.per_request * len(requests)
        return self.inner.propose_batch(requests)

    def on_request_finished(self, req_id, token_ids, num_prompt_tokens):
        self.inner.on_request_finished(req_id, token_ids, num_prompt_tokens)


class OracleProposer(Proposer):
    """Drafts the known greedy continuation (``wrong``: each token off by one, so every
    draft is rejected)."""

    method = "ngram"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int, *,
                 wrong: bool) -> None:
        self.refs = refs
        self.vocab = vocab
        self.wrong = wrong

    def propose(self, req_id, token_ids, k, num_prompt_tokens=0):
        done = len(token_ids) - num_prompt_tokens
        truth = self.refs[tuple(token_ids[:num_prompt_tokens])][done : done + k]
        return [(t + 1) % self.vocab for t in truth] if self.wrong else list(truth)


@dataclasses.dataclass
class Run:
    prompt_ids: list[tuple[int, ...]]
    token_ids: list[list[int]]
    stats: SpecDecodeStats
    num_steps: int
    controller: SpecDecodeController | None
    # Rows of each step without prefill tokens.
    decode_rows: list[int]
    # Modelled seconds of the whole run.
    seconds: float


class FusedLayout:
    """The runner as the engine sees it, reporting a fused few-row decoder of
    ``rows`` rows (its step layout), so the cost table splits its regimes there;
    the steps still run on the runner's own path (their time is modelled anyway)."""

    def __init__(self, runner, rows: int) -> None:
        self.runner = runner
        self.kv_cache_groups = getattr(runner, "kv_cache_groups", None)
        self.step_layout = dataclasses.replace(runner.step_layout, decoder_rows=rows)

    def execute(self, so):
        return self.runner.execute(so)


class Bench:
    """One loaded model; each run gets a fresh EngineCore (scheduler, adaptive rule,
    proposer) on the model's runner, with the fake clock and the given cost model."""

    def __init__(self) -> None:
        self.llm = LLM(None, dtype="float32", num_gpu_blocks=64, backend="torch",
                       speculative_config=NGRAM)
        self.clock = FakeClock()
        self.cost = CHEAP
        self.decode_rows: list[int] = []
        self.runner = runner = self.llm.engine.executor
        # The torch runner has no fused few-row decoder (one cost regime past one row).
        execute = runner.execute

        def costed_execute(so):
            rows = so.total_num_scheduled_tokens
            self.clock.now += self.cost.step(rows)
            if so.num_prefill_tokens == 0:
                self.decode_rows.append(rows)
            return execute(so)

        runner.execute = costed_execute

    def run(self, cost: Cost, spec: dict | None, proposer: Proposer | None = None) -> Run:
        llm = self.llm
        cfg = llm.engine_config
        self.cost = cost
        self.decode_rows = []
        sc = SpeculativeConfig(**spec) if spec is not None else None
        if sc is not None:
            inner = proposer or make_proposer(sc, max_model_len=cfg.scheduler.max_model_len)
            proposer = PricedProposer(inner, self)
        executor = FusedLayout(self.runner, cost.fused_rows) if cost.fused_rows else self.runner
        llm.engine = EngineCore(cfg.scheduler, cfg.cache, executor, clock=self.clock,
                                structured_outputs=llm.engine.structured_outputs,
                                speculative_config=sc, proposer=proposer)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        start = self.clock.now
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        spec_ctl = llm.engine.scheduler.spec
        stats = spec_ctl.stats if spec_ctl is not None else SpecDecodeStats()
        return Run([tuple(o.prompt_token_ids) for o in outs],
                   [o.outputs[0].token_ids for o in outs], stats, llm.engine.num_steps, spec_ctl,
                   self.decode_rows, self.clock.now - start)


@pytest.fixture(scope="module")
def bench() -> Bench:
    torch.set_num_threads(1)
    return Bench()


@pytest.fixture(scope="module")
def plain(bench) -> Run:
    return bench.run(CHEAP, None)


@pytest.fixture(scope="module")
def ngram_fixed_k(bench, plain) -> Run:
    """The n-gram workload with K every step (the rule off): what drafting costs at most."""
    run = bench.run(COSTLY, {**NGRAM, "adaptive": False})
    assert run.token_ids == plain.token_ids
    assert run.stats.num_draft_tokens > 40, run.stats
    return run


def test_cheap_rows_keep_speculating(bench, plain, ngram_fixed_k):
    run = bench.run(CHEAP, NGRAM)
    assert run.token_ids == plain.token_ids
    st = run.stats
    print("cheap rows:", st, "fixed K:", ngram_fixed_k.stats)
    assert st.num_draft_tokens >= 0.6 * ngram_fixed_k.stats.num_draft_tokens, st
    assert st.num_accepted_tokens > 20, st
    assert run.num_steps < plain.num_steps


def test_costly_rows_turn_drafting_off(bench, plain, ngram_fixed_k):
    """One step of n rows costs n one-row steps: a draft (accepted with p < 1) never
    pays; the rule tries one verify step, measures it and stops (the steps right after
    the prefill are not measured, COLD_STEPS: they may draft too)."""
    run = bench.run(COSTLY, NGRAM)
    assert run.token_ids == plain.token_ids
    st = run.stats
    print("costly rows:", st, "fixed K:", ngram_fixed_k.stats)
    assert st.num_draft_tokens <= 0.2 * ngram_fixed_k.stats.num_draft_tokens, st
    assert st.num_drafts <= 3 + len(PROMPTS), st
    assert run.seconds < ngram_fixed_k.seconds
    # The engine's clock fed the rule each step's seconds by its rows (decodes and
    # drafts): the table holds the cost model's, a verify step's among them.
    table = run.controller.cost.seconds
    assert any(r > len(PROMPTS) for r in table), table
    for rows, sec in table.items():
        assert sec == pytest.approx(COSTLY.base + COSTLY.per_row * rows, rel=1e-6), table


def test_slow_proposer_turns_drafting_off(bench, plain, ngram_fixed_k):
    """Rows nearly free, but asking the proposer costs more than a step: the measured
    proposer time turns drafting off."""
    run = bench.run(SLOW_PROPOSER, NGRAM)
    assert run.token_ids == plain.token_ids
    st = run.stats
    print("slow proposer:", st, "fixed K:", ngram_fixed_k.stats)
    draft_cost = run.controller.draft_cost
    assert draft_cost.per_request == pytest.approx(SLOW_PROPOSER.per_request, rel=1e-6)
    assert st.num_draft_tokens <= 0.15 * ngram_fixed_k.stats.num_draft_tokens, st


def test_acceptance_decides_under_moderate_row_cost(bench, plain):
    """At 3 ms a row beside a 10 ms step, drafts that are all accepted pay (K every
    step) and drafts that are all rejected do not (the rule stops after measuring a
    few); output is the plain greedy output either way."""
    refs = dict(zip(plain.prompt_ids, plain.token_ids))
    vocab = bench.llm.model_config.vocab_size
    oracle = {"method": "ngram", "num_speculative_tokens": K}
    good = bench.run(MODERATE, oracle, OracleProposer(refs, vocab, wrong=False))
    bad = bench.run(MODERATE, oracle, OracleProposer(refs, vocab, wrong=True))
    bad_fixed = bench.run(MODERATE, {**oracle, "adaptive": False},
                          OracleProposer(refs, vocab, wrong=True))
    print("accepted drafts:", good.stats, "rejected drafts:", bad.stats,
          "rejected, fixed K:", bad_fixed.stats)
    assert good.token_ids == bad.token_ids == bad_fixed.token_ids == plain.token_ids
    assert good.stats.num_accepted_tokens == good.stats.num_draft_tokens > 0
    # All accepted: K drafts for about every request and step until max_tokens is near.
    assert good.num_steps <= plain.num_steps // 3, (good.num_steps, plain.num_steps)
    assert bad.stats.num_accepted_tokens == 0
    assert bad.stats.num_draft_tokens <= 0.15 * bad_fixed.stats.num_draft_tokens, bad.stats


def test_rows_stay_within_the_fused_decoder(bench, plain):
    """All drafts accepted and rows nearly free up to the fused decoder's 8, then a
    cliff: the rule verifies up to 8 rows a step (it may try one step past the cliff
    to measure it, and the steps right after the prefill are not measured), where K
    every step would verify 3 + 3 * 4 = 15."""
    refs = dict(zip(plain.prompt_ids, plain.token_ids))
    vocab = bench.llm.model_config.vocab_size
    oracle = {"method": "ngram", "num_speculative_tokens": K}
    run = bench.run(CLIFF, oracle, OracleProposer(refs, vocab, wrong=False))
    fixed = bench.run(CLIFF, {**oracle, "adaptive": False},
                      OracleProposer(refs, vocab, wrong=False))
    print("cliff:", run.stats, "rows by step:", run.decode_rows)
    print("cliff, fixed K:", fixed.stats, "rows by step:", fixed.decode_rows)
    assert run.token_ids == fixed.token_ids == plain.token_ids
    assert run.controller.cost.fused_rows == FUSED
    past = [r for r in run.decode_rows if r > FUSED]
    assert len(past) <= 2 + COLD_STEPS, run.decode_rows
    assert sum(r > FUSED for r in fixed.decode_rows) >= 5, fixed.decode_rows
    # Speculation kept up to the cap: full fused steps, several tokens a step.
    assert run.decode_rows.count(FUSED) >= 3, run.decode_rows
    assert run.num_steps <= plain.num_steps // 2, (run.num_steps, plain.num_steps)
    # More steps than K every step, but each under the cliff: less time in all (the
    # prefill step, past the cliff either way, included).
    assert run.seconds < 0.85 * fixed.seconds, (run.seconds, fixed.seconds)
