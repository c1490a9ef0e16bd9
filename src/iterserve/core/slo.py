"""The slo policy: serve the most requests within their latency targets (goodput).

- Order: earliest TTFT deadline first (``arrival + ttft_slo``), in windows of half a
  target, shortest prompt first within a window (when not all can make it, more do
  this way). A request that can
  no longer meet its deadline even if it started now is *late*: it moves back as
  if its deadline were ``slo_late_penalty`` TTFT targets later, so it stops
  dragging on-time requests past theirs, yet still ages to the front (it never
  waits without bound: new arrivals' deadlines pass its late deadline).
- Feasibility (Moore-Hodgson): each step the first SHED_WINDOW on-time requests
  are walked in order with the prefill time ahead of each; when one would miss,
  the longest prompt walked so far is made late, so one long prompt does not
  make several short ones miss.
- Step size: each step's token budget is what keeps the step within the tightest
  running TPOT target (prefill chunks sized as Sarathi-Serve does), by the
  step-time model below.
- Batch size: a request is admitted only while a decode step with it still fits
  the TPOT target.
- Infeasible targets: a TPOT target below the shortest step there is (one decode, by
  the model) can be met by no schedule. Goodput is zero either way, so it must cost
  no throughput: such targets are set aside, and with none left the steps take the
  whole budget and the batch fills as under fcfs.
- Shaping that does not pay: a model fitted on few or narrow steps can believe a
  target feasible that is not (it extrapolates the shortest step). When most steps
  shaped for a target (a smaller budget, an admission held back) still miss it, the
  policy stops shaping for a while (``SHAPING_BACKOFF`` steps, doubling while each
  retry fails too) and serves at full throughput, learning meanwhile.
- Optional refusal at admission (``slo_admission``): a request whose TTFT target
  the queue already rules out (every waiting prompt, late ones included: they are
  served too, within their bound) is refused (AdmissionRefused; HTTP 429).

StepTimeModel: seconds = c0 + c1 * prefill tokens + c2 * decoding sequences
+ c3 * context tokens, fitted online by recursive least squares on the step
durations the engine measures (or the simulator's cost model produces), seeded
from a cost model's coefficients when there is one. No clock here: durations
are passed in.
"""

from __future__ import annotations

import heapq
from typing import Any

from iterserve.config import SchedulerConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.core.policy import HeapPolicy
from iterserve.core.request import Request

# Feature units: the model is fitted in these so every coefficient is of the order
# of a step's seconds (RLS is then well conditioned): 1 step, 1k prefill tokens,
# 100 decoding sequences, 100k context tokens.
_SCALE = (1.0, 1e-3, 1e-2, 1e-5)
# A guess for an engine with no prior (a 7B model on one GPU), learned away quickly.
_DEFAULT_PRIOR = (8e-3, 2e-5, 1e-5, 2e-8)
# How many waiting requests (in policy order) the per-step feasibility pass walks.
SHED_WINDOW = 64
# Steps without shaping after shaped steps kept missing their target (doubling, up to
# SHAPING_BACKOFF_MAX, while each retry fails), and how many shaped steps decide.
SHAPING_BACKOFF = 64
SHAPING_BACKOFF_MAX = 4096
SHAPING_PROBE_STEPS = 4


class AdmissionRefused(ValueError):
    """The request cannot meet its latency target under the current queue (HTTP 429)."""


class StepTimeModel:
    """Linear step time, fitted online by recursive least squares with forgetting."""

    def __init__(
        self, prior: tuple[float, ...] = (), forgetting: float = 0.995, confident: bool = False
    ) -> None:
        coeffs = tuple(prior) if prior else _DEFAULT_PRIOR
        # Coefficients in scaled units.
        self.theta: list[float] = [c / s for c, s in zip(coeffs, _SCALE)]
        # Initial covariance: small around a cost model's coefficients, large (the
        # first steps decide) around the generic guess.
        p0 = 1e-2 if (prior or confident) else 1e2
        self.p0 = p0
        self.P: list[list[float]] = [[p0 if i == j else 0.0 for j in range(4)] for i in range(4)]
        self.forgetting = forgetting
        self.num_observations = 0

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        t = self.theta
        return (t[0] * _SCALE[0], t[1] * _SCALE[1], t[2] * _SCALE[2], t[3] * _SCALE[3])

    def predict(self, num_prefill: float, num_decode: float, num_context: float) -> float:
        t = self.theta
        return (
            t[0]
            + t[1] * num_prefill * 1e-3
            + t[2] * num_decode * 1e-2
            + t[3] * num_context * 1e-5
        )

    def observe(
        self, num_prefill: float, num_decode: float, num_context: float, seconds: float
    ) -> None:
        x = (1.0, num_prefill * 1e-3, num_decode * 1e-2, num_context * 1e-5)
        P = self.P
        px = [P[i][0] * x[0] + P[i][1] * x[1] + P[i][2] * x[2] + P[i][3] * x[3] for i in range(4)]
        lam = self.forgetting
        denom = lam + x[0] * px[0] + x[1] * px[1] + x[2] * px[2] + x[3] * px[3]
        k = [v / denom for v in px]
        t = self.theta
        err = seconds - (t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3])
        for i in range(4):
            t[i] += k[i] * err
        # Forgetting inflates P (so the fit follows a drifting machine); stop at the
        # size of an uninformed start, so steps that excite only some features (long
        # runs of pure decodes) cannot blow the others' uncertainty up.
        trace = 0.0
        for i in range(4):
            row = P[i]
            ki = k[i]
            for j in range(4):
                row[j] -= ki * px[j]
            trace += row[i]
        if trace < 4e2:
            inv = 1.0 / lam
            for i in range(4):
                row = P[i]
                for j in range(4):
                    row[j] *= inv
        self.num_observations += 1


class SLOPolicy(HeapPolicy):
    """Earliest TTFT deadline first, late requests deprioritised, TPOT-sized steps."""

    name = "slo"

    def __init__(self, config: SchedulerConfig, block_size: int = 16) -> None:
        super().__init__(config)
        self.ttft_default = config.ttft_slo_ms * 1e-3
        self.tpot_default = config.tpot_slo_ms * 1e-3
        self.late_penalty = config.slo_late_penalty
        self.admission = config.slo_admission
        self.model = StepTimeModel(config.step_time_coefficients)
        self.max_budget = config.max_num_batched_tokens
        self.threshold = config.long_prefill_token_threshold or config.max_num_batched_tokens
        self.block_size = block_size
        self.late: set[str] = set()
        self.num_late = 0  # requests ever found past hope
        # Prompt tokens waiting, late requests' included, for the admission estimate.
        self.waiting_tokens = 0
        # Running-set state the scheduler reports (begin_step, on_start, on_stop).
        self.now = 0.0
        self.num_context = 0  # the last step's context tokens
        self.tpot_running: dict[str, float] = {}
        self.tpot_min = self.tpot_default
        # Seconds per prefill token at the current step shape (admission estimate).
        self.step_budget = self.max_budget
        self.prefill_pending = 0
        self.sec_per_prefill_token = self.model.predict(self.max_budget, 0, 0) / self.max_budget
        # Whether shaping pays (module doc): the target this step was shaped for (None:
        # not shaped), shaped steps seen and missed in the current probe, the step
        # count, until when shaping is off, and the next backoff.
        self.shaped_for: float | None = None
        self.probe_steps = 0
        self.probe_misses = 0
        self.num_steps = 0
        self.unshaped_until = 0
        self.backoff = SHAPING_BACKOFF

    # -- targets ---------------------------------------------------------------------
    def ttft_slo(self, request: Request) -> float:
        v = request.sampling_params.ttft_slo_ms
        return self.ttft_default if v is None else v * 1e-3

    def tpot_slo(self, request: Request) -> float:
        v = request.sampling_params.tpot_slo_ms
        return self.tpot_default if v is None else v * 1e-3

    def deadline(self, request: Request) -> float:
        d = request.arrival_time + self.ttft_slo(request)
        if request.request_id in self.late:
            d += self.late_penalty * self.ttft_slo(request)
        return d

    # -- waiting queue (HeapPolicy's heap, keyed by deadline) ------------------------------
    def key(self, request: Request) -> tuple[Any, ...]:
        # Deadlines in windows of half the TTFT target, shortest prompt first within a
        # window: EDF at that granularity, and more requests through when all cannot be.
        d = self.deadline(request)
        window = 0.5 * self.ttft_slo(request)
        return (int(d / window), request.num_prompt_tokens, d)

    def add(self, request: Request) -> None:
        # A preempted request (push_front) keeps its past deadline: it returns to the front.
        super().add(request)
        self.waiting_tokens += request.num_prompt_tokens

    def _forget(self, request: Request) -> None:
        self.waiting_tokens -= request.num_prompt_tokens

    def pop(self) -> Request:
        request = super().pop()
        self._forget(request)
        return request

    def remove(self, request: Request) -> None:
        # (Backfill starts requests through here, so a late one stays late; ids of
        # aborted ones are pruned below.)
        super().remove(request)
        self._forget(request)
        late = self.late
        if len(late) > 2 * (len(self.entries) + len(self.tpot_running)) + 64:
            self.late = {r for r in late if r in self.entries or r in self.tpot_running}

    def rank(self, request: Request) -> tuple[Any, ...]:
        # Victims: the latest effective deadline (late requests first).
        return (self.deadline(request),)

    # -- the step ------------------------------------------------------------------------
    def _prefill_time(self, num_tokens: int, num_running: int) -> float:
        """Seconds to prefill ``num_tokens`` at this step shape (chunks of the budget)."""
        chunk = max(self.step_budget - num_running, 1)
        chunk = min(chunk, self.threshold)
        steps = -(-num_tokens // chunk)
        return steps * self.model.predict(min(chunk, num_tokens), num_running, self.num_context)

    def begin_step(
        self, now: float, num_running: int, max_budget: int, num_prefill_pending: int
    ) -> int:
        self.now = now
        self.prefill_pending = num_prefill_pending
        self.num_steps += 1
        self.shaped_for = None
        model = self.model
        ctx = self.num_context
        # The token budget that keeps this step within the tightest running TPOT target
        # that any schedule can meet.
        c0, c1, c2, c3 = model.coefficients
        fixed = c0 + c2 * num_running + c3 * ctx
        tpot = self._feasible_tpot(None) if num_running else None
        room = (tpot if tpot is not None else 0.0) - fixed
        floor = max(num_running, 1) + self.block_size  # decodes plus some progress
        if tpot is None or room <= 0 or c1 <= 0:
            # Nobody decodes, no target can be met, or the running decodes alone already
            # miss it (a smaller step would miss it too, and cost throughput): full steps.
            budget = max_budget
        else:
            budget = num_running + int(room / c1)
        budget = min(max_budget, max(floor, budget))
        if budget < max_budget and tpot is not None:
            self.shaped_for = tpot
        self.step_budget = budget
        chunk = max(budget - num_running, 1)
        self.sec_per_prefill_token = model.predict(chunk, num_running, ctx) / chunk
        # Demote heads that cannot meet their deadline even if they started now.
        heap = self.heap
        while True:
            self._clean()
            if not heap:
                break
            entry = heap[0]
            req: Request = entry[-1]
            rid = req.request_id
            if rid in self.late or req.first_token_time is not None:
                break
            # Running prefills share the budget with it: their tokens come first.
            remaining = len(req.all_token_ids) - req.num_computed_tokens + num_prefill_pending
            if now + self._prefill_time(remaining, num_running) <= entry[2]:
                break
            self._demote(req)
        self._shed(now, num_prefill_pending)
        return budget

    def _demote(self, req: Request) -> None:
        self.late.add(req.request_id)
        self.num_late += 1
        self.entries[req.request_id][-1] = None  # rekey, keeping waiting_tokens
        HeapPolicy.add(self, req)

    def _shed(self, now: float, num_prefill_pending: int) -> None:
        """Moore-Hodgson over the first SHED_WINDOW on-time waiting requests: walk
        them in order, accumulating the prefill time ahead of each; when one would
        miss its deadline, demote the longest prompt walked so far (not necessarily
        the one that misses). For one server and a common release time this keeps
        the most requests on time (Moore 1968); here it stops one long prompt from
        making several short ones late, while every request that can still make
        its deadline alongside the rest keeps its place."""
        entries = [e for e in heapq.nsmallest(SHED_WINDOW + 8, self.heap) if e[-1] is not None]
        spt = self.sec_per_prefill_token
        t = now + num_prefill_pending * spt
        walked: list[tuple[int, int, Request]] = []  # max-heap by remaining tokens
        late = self.late
        for i, entry in enumerate(entries[:SHED_WINDOW]):
            req: Request = entry[-1]
            if req.request_id in late or req.first_token_time is not None:
                continue
            remaining = len(req.all_token_ids) - req.num_computed_tokens
            heapq.heappush(walked, (-remaining, i, req))
            t += remaining * spt
            if t > entry[2]:
                neg, _, longest = heapq.heappop(walked)
                t += neg * spt
                self._demote(longest)

    def _feasible_tpot(self, extra: float | None) -> float | None:
        """The tightest TPOT target of the running requests (and ``extra``) that some
        schedule can meet: none below the shortest step there is, a one-sequence decode.
        None when no target is feasible."""
        if self.num_steps < self.unshaped_until:
            return None  # shaping did not pay lately: served as if none could be met
        c0, _, c2, _ = self.model.coefficients
        shortest = c0 + c2
        tpot = self.tpot_min if extra is None else min(self.tpot_min, extra)
        if tpot >= shortest:
            return tpot
        targets = [t for t in self.tpot_running.values() if t >= shortest]
        if extra is not None and extra >= shortest:
            targets.append(extra)
        return min(targets, default=None)

    def can_admit(self, request: Request, num_running: int) -> bool:
        if num_running == 0:
            return True
        tpot = self._feasible_tpot(self.tpot_slo(request))
        if tpot is None:
            return True  # no target can be met: nothing to protect by waiting
        # A decode step with this request added (and its prompt as context) must fit.
        ctx = self.num_context + len(request.all_token_ids)
        if self.model.predict(self.block_size, num_running + 1, ctx) <= tpot:
            return True
        self.shaped_for = tpot if self.shaped_for is None else min(self.shaped_for, tpot)
        return False

    def check_admission(self, request: Request) -> None:
        if not self.admission:
            return
        ttft = self.ttft_slo(request)
        ahead = self.prefill_pending + self.waiting_tokens + request.num_prompt_tokens
        est = ahead * self.sec_per_prefill_token
        if est > ttft:
            raise AdmissionRefused(
                f"cannot meet ttft_slo_ms={ttft * 1e3:g}: about {est * 1e3:.0f} ms of prefill "
                f"is queued ahead ({self.waiting_tokens} prompt tokens waiting)"
            )

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        self.num_context = out.num_context_tokens
        if seconds > 0.0:
            self.model.observe(
                out.num_prefill_tokens, out.num_decode_tokens, out.num_context_tokens, seconds
            )
            if self.shaped_for is not None:
                self._judge_shaping(seconds > self.shaped_for)

    def _judge_shaping(self, missed: bool) -> None:
        """Count a shaped step; after SHAPING_PROBE_STEPS of them, shaping stays on if
        most met their target, else it goes off for the backoff (which doubles while
        retries keep failing, and resets once one pays)."""
        self.probe_steps += 1
        self.probe_misses += missed
        if self.probe_steps < SHAPING_PROBE_STEPS:
            return
        if 2 * self.probe_misses > self.probe_steps:
            self.unshaped_until = self.num_steps + self.backoff
            self.backoff = min(2 * self.backoff, SHAPING_BACKOFF_MAX)
        else:
            self.backoff = SHAPING_BACKOFF
        self.probe_steps = self.probe_misses = 0

    # -- running set ---------------------------------------------------------------------
    def on_start(self, request: Request) -> None:
        # A late request stays late while it runs: it is the first victim when memory
        # runs short (it has missed its target; an on-time one has not) and returns
        # behind on-time requests if preempted.
        tpot = self.tpot_slo(request)
        self.tpot_running[request.request_id] = tpot
        if tpot < self.tpot_min:
            self.tpot_min = tpot

    def on_stop(self, request: Request) -> None:
        if request.is_finished:
            self.late.discard(request.request_id)
        tpot = self.tpot_running.pop(request.request_id, self.tpot_default)
        if tpot < self.tpot_default and tpot <= self.tpot_min:
            # The tightest target may have left: recompute (only a tighter-than-default
            # target can be the minimum, so this is rare).
            self.tpot_min = min(self.tpot_running.values(), default=self.tpot_default)
            if self.tpot_min > self.tpot_default:
                self.tpot_min = self.tpot_default
