"""Speculative decoding, the scheduler's side: which requests get draft tokens, how
many (the load-adaptive K), and the acceptance counters behind vLLM's metrics.

The proposer (``iterserve.spec_decode``, driven by the engine) guesses tokens; this
module decides how many guesses are worth verifying, per request and step:

- A request is *eligible* while it decodes and its next-token distribution depends
  on the drafts in ways the verifier does not apply per position: no grammar
  (structured outputs), no bad words (``min_tokens`` and penalties are applied per
  position).
- Its acceptance rate ``a`` is an EWMA over its verified drafts (accepted drafts /
  drafts that were reached, so a fully accepted run counts no failure), and its hit
  rate ``h`` an EWMA of whether the proposer had a draft for it at all.
- The j-th draft of a request yields ``h * a**j`` expected tokens. The plan takes the
  ``n`` most valuable drafts of the batch (each request's a prefix) for the ``n`` that
  maximises the batch's expected tokens per second, ``(B + gain(n)) / (T(B + n) +
  D * m(n))``: ``T`` the measured seconds of a step by row count
  (``spec_cost.StepCostTable``, which knows the fused few-row decoder's row cap and the
  cliff past it), ``D`` the proposer's measured seconds per request it drafts for,
  ``m(n)`` the requests drafting. Where a row count's regime is unmeasured, or the
  step has prefill tokens, ``T`` is the online linear model (``slo.StepTimeModel``).
  Small batches (one cheap fused step for several rows) speculate deep; as rows cost
  more than they yield ``n`` reaches 0 for everyone.
- A request left at ``k = 0`` still gets one draft every ``PROBE_INTERVAL`` steps
  when that costs the step little, so a request whose text turns repetitive is noticed.

The scheduler then fits the drafts into the step's leftover token budget and free KV
blocks (speculation never displaces real work). No clock: the engine measures the
step and proposer times and reports them (``observe_cost``, ``observe_draft_cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.config import SpeculativeConfig
from iterserve.core.request import Request
from iterserve.core.slo import StepTimeModel
from iterserve.core.spec_cost import DraftCost, StepCostTable

# Steps between one-draft probes of a request whose acceptance rate says k = 0.
PROBE_INTERVAL = 8
# Within a cost regime, the rate falling below this share of its best ends the search.
REGIME_STOP = 0.97
# Most share of a step's predicted time a step's probes may add.
PROBE_COST = 0.05
# Steps after one with prefill tokens whose seconds the cost table skips (observe_cost).
COLD_STEPS = 2


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counters (vLLM's ``spec_decode_*`` metrics)."""

    num_drafts: int = 0  # draft sequences verified (one per request per step with drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token i (0-based) was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft sequence, the bonus token included (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def eligible(req: Request) -> bool:
    """Whether drafts for ``req`` can be verified exactly by this engine (see above)."""
    p = req.sampling_params
    return (
        req.num_computed_tokens >= req.num_prompt_tokens
        and req.num_computed_tokens + 1 == len(req.all_token_ids)
        and p.structured_outputs is None
        and not p.bad_words_token_ids
    )


class SpecDecodeController:
    """Owned by the Scheduler when a SpeculativeConfig is given."""

    def __init__(
        self, config: SpeculativeConfig, step_time_prior: tuple[float, ...] = ()
    ) -> None:
        self.config = config
        self.max_k = config.num_speculative_tokens
        self.alpha = config.acceptance_ewma_alpha
        self.prior = config.initial_acceptance_rate
        # Per request: EWMA of accepted drafts and of drafts reached; steps since a
        # draft; EWMA of the proposer having a draft.
        self._succ: dict[str, float] = {}
        self._trials: dict[str, float] = {}
        self._idle: dict[str, int] = {}
        self._hit: dict[str, float] = {}
        self.step_time = StepTimeModel(step_time_prior)
        self.cost = StepCostTable()
        self._cold_steps = 0  # steps left that observe_cost does not count
        self.draft_cost = DraftCost()
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.max_k)
        # Finished requests since the engine last asked (their proposer state can go).
        self.finished: list[Request] = []
        # The last plan's drafts and its predicted tokens per second (stats, tests).
        self.last_num_drafts = 0
        self.last_rate = 0.0

    def set_fused_rows(self, rows: int) -> None:
        """The runner's fused few-row decoder takes steps of at most ``rows`` rows."""
        if rows != self.cost.fused_rows:
            self.cost = StepCostTable(rows)

    # -- the plan ------------------------------------------------------------------

    def acceptance_rate(self, req_id: str) -> float:
        trials = self._trials.get(req_id)
        if trials is None or trials <= 0:
            return self.prior
        return self._succ[req_id] / trials

    def hit_rate(self, req_id: str) -> float:
        return self._hit.get(req_id, 1.0)

    def step_seconds(
        self, num_decode: int, num_drafts: int, num_prefill: int, num_context: int
    ) -> float:
        """Predicted seconds of a step: the measured table for a step of decodes and
        verify runs only, else the linear model."""
        if num_prefill == 0:
            t = self.cost.predict(num_decode + num_drafts)
            if t is not None:
                return t
        extra = num_prefill + num_drafts
        return self.step_time.predict(extra, num_decode, num_context + extra)

    def choose(
        self, cands: Sequence[tuple[str, int]], num_decode: int, num_prefill: int,
        num_context: int,
    ) -> list[int]:
        """Drafts per candidate ``(req_id, most drafts)``: the ``n`` most valuable
        drafts for the ``n`` with the most expected tokens per second (docstring)."""
        marg: list[tuple[float, int]] = []
        hits = [self.hit_rate(rid) for rid, _ in cands]
        for idx, (rid, kmax) in enumerate(cands):
            a = self.acceptance_rate(rid)
            p = hits[idx]
            for _ in range(kmax):
                p *= a
                if p < 1e-3:
                    break
                marg.append((p, idx))
        ks = [0] * len(cands)
        t0 = self.step_seconds(num_decode, 0, num_prefill, num_context)
        best_rate = num_decode / t0 if t0 > 0 else 0.0
        self.last_rate, self.last_num_drafts = best_rate, 0
        if not marg or t0 <= 0:
            return ks
        marg.sort(key=lambda x: -x[0])
        d = self.draft_cost.per_request
        cost = self.cost
        used = [False] * len(cands)
        gain = 0.0
        # A request whose proposer finds no draft verifies nothing: the drafts' rows
        # cost the step only at their requests' hit rates, as their gains count.
        hit_rows = 0.0
        m = best_n = 0
        # Within a regime of the cost table a step's seconds are about linear in its
        # rows and the gain is concave, so the rate rises then falls: once it has
        # fallen clearly below that regime's best, skip to the next regime.
        regime, regime_best, skip = cost.regime(num_decode), best_rate, False
        for n in range(1, len(marg) + 1):
            p, idx = marg[n - 1]
            gain += p
            hit_rows += hits[idx]
            if not used[idx]:
                used[idx] = True
                m += 1
            reg = cost.regime(num_decode + n)
            if reg != regime:
                regime, regime_best, skip = reg, 0.0, False
            if skip:
                continue
            t_all = self.step_seconds(num_decode, n, num_prefill, num_context)
            t = t0 + (t_all - t0) * (hit_rows / n) + d * m
            if t <= 0:
                continue
            rate = (num_decode + gain) / t
            if rate > best_rate:
                best_rate, best_n = rate, n
            if rate > regime_best:
                regime_best = rate
            elif rate < REGIME_STOP * regime_best:
                if reg == 2:
                    break
                skip = True
        for _, idx in marg[:best_n]:
            ks[idx] += 1
        self.last_rate, self.last_num_drafts = best_rate, best_n
        return ks

    def plan(
        self, running: Sequence[Request], num_prefill_tokens: int = 0
    ) -> list[tuple[Request, int]]:
        """(request, most drafts worth verifying) for the next step, k >= 1 only.
        Clears every running request's old drafts (the caller sets the new ones)."""
        for req in running:
            if req.spec_token_ids:
                req.spec_token_ids = []
        cfg = self.config
        if cfg.disable_by_batch_size is not None and len(running) > cfg.disable_by_batch_size:
            self.last_num_drafts = 0
            return []
        reqs: list[Request] = []
        cands: list[tuple[str, int]] = []
        num_decode = ctx = 0
        for req in running:
            if req.num_computed_tokens >= req.num_prompt_tokens:
                num_decode += 1
                ctx += req.num_computed_tokens + 1
            if not eligible(req):
                continue
            room = req.max_num_tokens - len(req.all_token_ids) - 1
            if room > 0:
                reqs.append(req)
                cands.append((req.request_id, min(self.max_k, room)))
        if not cands:
            return []
        if not cfg.adaptive:
            return [(r, k) for r, (_, k) in zip(reqs, cands)]
        ks = self.choose(cands, num_decode, num_prefill_tokens, ctx)
        out: list[tuple[Request, int]] = []
        probes: list[Request] = []
        for req, k in zip(reqs, ks):
            if k > 0:
                out.append((req, k))
                continue
            rid = req.request_id
            idle = self._idle.get(rid, 0) + 1
            self._idle[rid] = idle
            if idle >= PROBE_INTERVAL:
                probes.append(req)
        if probes and self._probes_are_cheap(out, len(probes), len(cands), num_decode,
                                             num_prefill_tokens, ctx):
            for req in probes:
                self._idle[req.request_id] = 0
                out.append((req, 1))
        return out

    def _probes_are_cheap(self, planned: list[tuple[Request, int]], num_probes: int,
                          num_cands: int, num_decode: int, num_prefill: int, ctx: int) -> bool:
        """Whether ``num_probes`` one-draft probes cost the step little: each request
        probes once in PROBE_INTERVAL steps, so over that many steps the probes of all
        ``num_cands`` requests may add PROBE_COST of the step's time."""
        n = sum(k for _, k in planned)
        d = self.draft_cost.per_request
        t = self.step_seconds(num_decode, n, num_prefill, ctx) + d * len(planned)
        t_probe = (self.step_seconds(num_decode, n + num_probes, num_prefill, ctx)
                   + d * (len(planned) + num_probes))
        allowed = PROBE_COST * PROBE_INTERVAL * num_probes / num_cands
        return t_probe - t <= t * allowed

    # -- after the step --------------------------------------------------------------

    def observe_step(
        self, num_prefill_tokens: int, num_decode: int, num_context: int, seconds: float
    ) -> None:
        if seconds > 0:
            self.step_time.observe(num_prefill_tokens, num_decode, num_context, seconds)

    def observe_cost(self, num_prefill_tokens: int, num_rows: int, seconds: float) -> None:
        """A step's measured seconds (the engine's clock): into the table when the step
        had no prefill tokens, ``num_rows`` its decodes and draft tokens, and none of
        the ``COLD_STEPS`` before it had: a prefill's activations and weights evict
        the few-row path's weights from the caches, so the steps after it pay for
        reading them back (the default model on a 2-core CPU: 3x, then 1.8x). The
        first verify step of a request is one of those; priced by it, speculation
        would look unprofitable and, drafting no more, never be measured again."""
        if num_prefill_tokens > 0:
            self._cold_steps = COLD_STEPS
        elif self._cold_steps > 0:
            self._cold_steps -= 1
        else:
            self.cost.observe(num_rows, seconds)

    def observe_draft_cost(self, num_requests: int, seconds: float) -> None:
        """The proposer's measured seconds for one call over ``num_requests``."""
        self.draft_cost.observe(num_requests, seconds)

    def observe_proposal(self, req_id: str, hit: bool) -> None:
        """Whether the proposer had a draft for ``req_id`` when asked."""
        h = self._hit.get(req_id, 1.0)
        self._hit[req_id] = h + self.alpha * ((1.0 if hit else 0.0) - h)

    def observe(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        """One request's verified drafts this step."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_draft
        st.num_accepted_tokens += num_accepted
        per_pos = st.accepted_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
        self._idle[req_id] = 0
        a = self.alpha
        reached = num_accepted + (1 if num_accepted < num_draft else 0)
        succ = self._succ.get(req_id)
        if succ is None:
            succ, trials = self.prior, 1.0
        else:
            trials = self._trials[req_id]
        self._succ[req_id] = (1 - a) * succ + a * num_accepted
        self._trials[req_id] = (1 - a) * trials + a * reached

    def on_finished(self, req: Request) -> None:
        rid = req.request_id
        self._succ.pop(rid, None)
        self._trials.pop(rid, None)
        self._idle.pop(rid, None)
        self._hit.pop(rid, None)
        self.finished.append(req)

    def pop_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out
