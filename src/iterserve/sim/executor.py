"""SimulatedExecutor: the model runner's interface on a cost model and a virtual clock.

It plays the model: every request whose prefill completes this step samples a
token, which is the request's EOS exactly when its hidden output length is
reached and an ordinary token otherwise. The scheduler never learns the length
in advance; it sees EOS arrive as it would from a real model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.sim.cost_model import CostModel

if TYPE_CHECKING:
    from iterserve.sim.speculative import AcceptanceSampler

# Sampled ids: EOS is a sentinel no workload prompt contains, the rest one filler id.
SIM_EOS_TOKEN_ID = 0
SIM_TOKEN_ID = 7
_NEVER = 1 << 62


class VirtualClock:
    """Simulated seconds; EngineCore reads it through ``clock=clock.now``."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def advance_to(self, t: float) -> None:
        if t > self.t:
            self.t = t


class SimulatedExecutor:
    """execute(SchedulerOutput) -> ModelRunnerOutput, advancing ``clock`` by the step time."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock | None = None,
                 acceptance: AcceptanceSampler | None = None) -> None:
        self.cost_model = cost_model
        # Speculative decoding: decides how many of each request's drafts are accepted.
        self.acceptance = acceptance
        self.clock = clock if clock is not None else VirtualClock()
        # request_id -> sequence length (prompt + outputs so far) at which the next
        # sampled token is EOS: prompt + output_len - 1. Hidden from the scheduler.
        self.eos_at: dict[str, int] = {}
        self.num_steps = 0
        self.busy_time = 0.0
        self.last_step_time = 0.0

    def set_output_len(self, request_id: str, num_prompt_tokens: int, output_len: int) -> None:
        """The model will end ``request_id`` after exactly ``output_len`` tokens (EOS
        included); the request must carry an ``eos_token_id``."""
        self.eos_at[request_id] = num_prompt_tokens + output_len - 1

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        cm = self.cost_model
        so = scheduler_output
        # Inlined CostModel.step_time: this runs once per simulated step.
        n_swap = len(so.blocks_to_swap_out) + len(so.blocks_to_swap_in)
        if (cm.lone_t0 and not so.num_spec_tokens
                and cm.layout.is_lone_step(so.total_num_scheduled_tokens)):
            dt = cm.lone_time(so.num_context_tokens) + cm.swap_block * n_swap
        elif so.scheduled_requests or n_swap:
            dt = (
                cm.t0
                + cm.prefill_token * so.num_prefill_tokens
                + cm.decode_seq * so.num_decode_tokens
                + cm.context_token * so.num_context_tokens
                + cm.swap_block * n_swap
            )
            if so.num_spec_tokens:
                # Draft tokens verified: the runner runs each as a row of the decode path
                # (the decoder's few-row step, the paged decode kernel), not as a prefill
                # chunk, whose per-token cost amortises the step over many tokens.
                dt += cm.decode_seq * so.num_spec_tokens
                if self.acceptance is not None:  # and the proposer's time to draft them
                    dt += self.acceptance.acceptance.draft_time(
                        max(len(d) for d in so.scheduled_spec_decode_tokens.values()),
                        so.num_spec_tokens)
            if cm.decode_pad_token or cm.prefill_attn or cm.prefill_attn_masked:
                dt += cm.attention_time(so)
            if cm.has_long_context:
                dt += cm.long_context_time(so)
            if cm.num_experts:
                dt += cm.expert_time(so.total_num_scheduled_tokens)
        else:
            dt = 0.0
        self.clock.t += dt
        self.busy_time += dt
        self.last_step_time = dt
        self.num_steps += 1

        sampled: dict[str, Any] = {}  # EOS is req.eos_token_id (None-able)
        eos_at = self.eos_at
        tok, never = SIM_TOKEN_ID, _NEVER
        reqs = so.scheduled_requests
        if so.num_decode_tokens == len(reqs) and not so.num_prefill_tokens:
            # Every request decodes (about half the steps): each samples at length c + 1.
            for req, c in zip(reqs, so.num_computed_tokens):
                rid = req.request_id
                sampled[rid] = tok if c + 1 < eos_at.get(rid, never) else req.eos_token_id
        else:
            for req, n, c in zip(reqs, so.num_scheduled_tokens, so.num_computed_tokens):
                length = c + n
                if length == len(req.all_token_ids):  # the prefill is complete: sample
                    rid = req.request_id
                    sampled[rid] = tok if length < eos_at.get(rid, never) else req.eos_token_id
        if so.finished_req_ids:
            for rid in so.finished_req_ids:
                self.eos_at.pop(rid, None)
        if so.scheduled_spec_decode_tokens:
            accepted = self._verify(so, sampled)
            return ModelRunnerOutput(sampled, accepted_draft_token_ids=accepted)
        return ModelRunnerOutput(sampled)

    def _verify(self, so: SchedulerOutput, sampled: dict[str, Any]) -> dict[str, list[int]]:
        """Accepted drafts per verifying request, never past its hidden output length:
        the token sampled after them is EOS exactly when that length is reached."""
        if self.acceptance is None:
            raise RuntimeError("the scheduler verified drafts but the simulated executor "
                               "has no acceptance model")
        num_accepted = self.acceptance.num_accepted
        eos_at = self.eos_at
        accepted: dict[str, list[int]] = {}
        for req in so.scheduled_requests:
            rid = req.request_id
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if not drafts:
                continue
            length = len(req.all_token_ids)  # the verify row's first sampled position
            end = eos_at.get(rid, _NEVER)
            a = min(num_accepted(len(drafts)), max(0, end - length))
            accepted[rid] = drafts[:a]
            sampled[rid] = SIM_TOKEN_ID if length + a < end else req.eos_token_id
        return accepted
