"""The scheduler's two speculative-decoding steps, kept out of the hot loops.

``schedule_drafts`` runs after admission: each running decode that carries draft
tokens (``Request.spec_token_ids``) grows from 1 to ``1 + k`` scheduled tokens, with
``k`` cut to the budget left over, the request's remaining ``max_tokens`` and the
blocks that are free (the lookahead slots: never a preemption for a guess).

``update_spec_request`` runs in ``update`` for such a request: it appends the accepted
drafts and the bonus / correction token one at a time under the usual stop rules
(EOS, stop token ids, max_tokens, max_model_len: tokens after a stop are dropped),
sets ``num_computed_tokens`` to the accepted length only, so the prefix cache never
hashes a rejected token, and gives back the blocks only the rejected tail used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from iterserve.core.request import Request

if TYPE_CHECKING:
    from iterserve.core.outputs import SchedulerOutput
    from iterserve.core.scheduler import Scheduler


def schedule_drafts(
    s: Scheduler, out: SchedulerOutput, num_from_running: int, step_budget: int
) -> None:
    reqs, nums, comps = out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens
    left = step_budget - sum(nums)
    if left <= 0:
        return
    kv = s.kv
    bs = s.block_size
    spec_rows = out.scheduled_spec_decode_tokens
    num_spec = 0
    for j in range(num_from_running):
        req = reqs[j]
        drafts = req.spec_token_ids
        if not drafts or nums[j] != 1:
            continue
        c = comps[j]
        if c < req.num_prompt_tokens or c + 1 != len(req.all_token_ids):
            continue  # not a decode (a prompt's last token, or stale drafts)
        # Accepting all k and the bonus token must not pass the request's end.
        k = min(len(drafts), left, req.max_num_tokens - len(req.all_token_ids) - 1)
        if k <= 0:
            continue
        if c + 1 + k > len(req.block_ids) * bs and kv.allocate_slots(req, 1 + k) is None:
            continue  # no free blocks for the lookahead: verify nothing, decode as usual
        nums[j] = 1 + k
        spec_rows[req.request_id] = drafts[:k] if k < len(drafts) else drafts
        num_spec += k
        left -= k
        if left <= 0:
            break
    out.num_spec_tokens = num_spec


def update_spec_request(
    s: Scheduler,
    req: Request,
    spec_rows: dict[str, list[int]],
    runner_output: ModelRunnerOutput,
    outputs: EngineCoreOutputs,
    now: float,
) -> bool:
    """Apply one verified request's tokens; True when it finished."""
    rid = req.request_id
    drafts = spec_rows[rid]
    req.spec_token_ids = []
    token = runner_output.sampled_token_ids.get(rid)
    if token is None:
        # An executor that does not verify drafts (none of ours): nothing advances; the
        # lookahead blocks go back and the request decodes plainly next step.
        s.kv.trim(req, req.num_computed_tokens)
        return False
    accepted = runner_output.accepted_draft_token_ids.get(rid, [])
    num_accepted = len(accepted)
    if num_accepted > len(drafts) or accepted != drafts[:num_accepted]:
        raise RuntimeError(f"request {rid}: accepted tokens are not a prefix of its drafts")
    assert s.spec is not None
    s.spec.observe(rid, len(drafts), num_accepted)

    new_tokens = [*accepted, token]
    all_ids = req.all_token_ids
    status = None
    emitted = 0
    for t in new_tokens:
        all_ids.append(t)
        emitted += 1
        if len(all_ids) >= req.max_num_tokens or t in req.stop_token_set:
            status = s._check_stop(req, t, len(all_ids) - req.num_prompt_tokens)
            if status is not None:
                break
    # KV now holds every kept token but the newest, exactly as after a plain decode.
    req.num_computed_tokens = len(all_ids) - 1
    kv = s.kv
    if kv.enable_caching and req.num_computed_tokens // s.block_size > req.num_cached_blocks:
        kv.cache_full_blocks(req)
    kept = new_tokens[:emitted]
    if req.first_token_time is None:
        req.first_token_time = now
    lps = None
    lp_last = runner_output.logprobs.get(rid) if runner_output.logprobs else None
    if lp_last is not None:
        lps = [*runner_output.accepted_draft_logprobs.get(rid, []), lp_last][:emitted]
    last = kept[-1]
    # The columns carry each request's last token; the full list is in the object.
    outputs.sampled[rid] = last
    outputs.req_ids.append(rid)
    if lps is not None:
        if outputs.logprobs is None:
            outputs.logprobs = {}
        outputs.logprobs[rid] = lps[-1]
    if status is not None:
        s._finish(req, status, now)
        s.running.remove(req)
        outputs.add_final(EngineCoreOutput(rid, kept, lps, req.finish_reason, req.stop_reason))
        return True
    # Blocks past the kept KV held only rejected drafts: back to the pool.
    kv.trim(req, req.num_computed_tokens)
    if emitted > 1:
        outputs.multi[rid] = EngineCoreOutput(rid, kept, lps)
    return False
