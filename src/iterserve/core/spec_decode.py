"""Speculative decoding, the scheduler's side: which requests get draft tokens, how
many (the load-adaptive K), and the acceptance counters behind vLLM's metrics.

The proposer (``iterserve.spec_decode``, driven by the engine) guesses tokens; this
module decides how many guesses are worth verifying, per request and step:

- A request is *eligible* while it decodes and its next-token distribution depends
  on the drafts in ways the verifier does not apply per position: no grammar
  (structured outputs), no bad words (``min_tokens`` and penalties are applied per
  position).
- Its acceptance rate ``a`` is an EWMA over its verified drafts (accepted drafts /
  drafts that were reached, so a fully accepted run counts no failure).
- The batch's cost ratio ``r = B * dS / S``: ``S`` the predicted time of the next step
  without drafts (the online step-time model, ``slo.StepTimeModel``), ``dS`` the cost
  of one more token, ``B`` the decoding requests. The j-th draft yields ``a**j``
  expected tokens and costs every request ``dS``; it pays while ``a**j > r``, so
  ``k = min(K, floor(log r / log a))``. Small batches (memory-bound steps, ``r`` near 0)
  speculate deep; as the batch grows ``r`` nears 1 and ``k`` reaches 0 for everyone.
- A request at ``k = 0`` from low acceptance still gets one draft every
  ``PROBE_INTERVAL`` steps, so a request whose text turns repetitive is noticed.

The scheduler then fits the drafts into the step's leftover token budget and free KV
blocks (speculation never displaces real work). No clock: step durations arrive from
the scheduler's ``update``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.config import SpeculativeConfig
from iterserve.core.request import Request
from iterserve.core.slo import StepTimeModel

# Steps between one-draft probes of a request whose acceptance rate says k = 0.
PROBE_INTERVAL = 8


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
        # Per request: EWMA of accepted drafts and of drafts reached; steps since a draft.
        self._succ: dict[str, float] = {}
        self._trials: dict[str, float] = {}
        self._idle: dict[str, int] = {}
        self.step_time = StepTimeModel(step_time_prior)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.max_k)
        # Finished requests since the engine last asked (their proposer state can go).
        self.finished: list[Request] = []
        # The cost ratio the last plan used (stats, tests).
        self.last_cost_ratio = 0.0

    # -- the plan ------------------------------------------------------------------

    def acceptance_rate(self, req_id: str) -> float:
        trials = self._trials.get(req_id)
        if trials is None or trials <= 0:
            return self.prior
        return self._succ[req_id] / trials

    def cost_ratio(self, running: Sequence[Request], num_prefill_tokens: int = 0) -> float:
        """``B * dS / S`` for the next step (module docstring)."""
        num_decode = ctx = 0
        for r in running:
            if r.num_computed_tokens >= r.num_prompt_tokens:
                num_decode += 1
                ctx += r.num_computed_tokens + 1
        if num_decode == 0:
            return 1.0
        model = self.step_time
        s = model.predict(num_prefill_tokens, num_decode, ctx + num_prefill_tokens)
        ds = model.predict(num_prefill_tokens + 1, num_decode, ctx + num_prefill_tokens + 1) - s
        if s <= 0:
            return 1.0
        return max(ds, 0.0) * num_decode / s

    def num_drafts_for(self, req_id: str, cost_ratio: float) -> int:
        """K for one request given the batch's cost ratio (the rule above)."""
        k_max = self.max_k
        if not self.config.adaptive:
            return k_max
        if cost_ratio >= 1.0:
            return 0
        a = self.acceptance_rate(req_id)
        if a >= 1.0 or cost_ratio <= 0.0:
            k = k_max
        elif a <= 0.0:
            k = 0
        else:
            k = min(k_max, int(math.log(cost_ratio) / math.log(a)))
        if k == 0:
            idle = self._idle.get(req_id, 0) + 1
            self._idle[req_id] = idle
            if idle >= PROBE_INTERVAL:
                return 1
        return k

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
            self.last_cost_ratio = 1.0
            return []
        r = self.cost_ratio(running, num_prefill_tokens) if cfg.adaptive else 0.0
        self.last_cost_ratio = r
        out: list[tuple[Request, int]] = []
        for req in running:
            if not eligible(req):
                continue
            room = req.max_num_tokens - len(req.all_token_ids) - 1
            if room <= 0:
                continue
            k = self.num_drafts_for(req.request_id, r)
            if k > 0:
                out.append((req, min(k, room)))
        return out

    # -- after the step --------------------------------------------------------------

    def observe_step(
        self, num_prefill_tokens: int, num_decode: int, num_context: int, seconds: float
    ) -> None:
        if seconds > 0:
            self.step_time.observe(num_prefill_tokens, num_decode, num_context, seconds)

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
        self.finished.append(req)

    def pop_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out
