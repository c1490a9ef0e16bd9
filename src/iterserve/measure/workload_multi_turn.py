"""Multi-turn chat sessions over shared per-tenant system prompts: a workload where
routing decides whether the prefix cache pays.

Each session belongs to a tenant and opens with that tenant's system prompt. Turn
``k``'s prompt is turn ``k-1``'s prompt + its answer + a new user message, token for
token, so a replica that served turn ``k-1`` holds all of turn ``k``'s prefix but the
answer's last block, and every replica that served the tenant holds its system
prompt. Prompts are token ids (the block keys of every replica and router line up).

Open loop: turn ``k`` arrives at the session's start + the think times before it +
an estimate of the earlier turns' durations (``est_tpot_s`` per output token), not
when turn ``k-1`` actually ends. A closed-loop client would wait for the answer; a
fixed schedule keeps one workload identical across the simulator, ``bench serve``
and every routing policy compared, at the price of a turn now and then arriving
before its predecessor has finished when a replica is overloaded (it then finds
less of its prefix cached, as it would on a real server behind an open-loop client).

The answer a prompt carries is the workload's, not what a model generated: in the
simulator and on a real server alike, the previous answer's tokens are new to the
replica, and they are cached from the next turn on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from iterserve.measure.arrivals import arrival_times
from iterserve.measure.lengths import LengthDist, parse_length_dist
from iterserve.measure.streams import stream
from iterserve.measure.workload import RequestSpec, Workload

# Token ids drawn from [_ID_LO, vocab_size): low ids are left to special tokens (a
# simulated model's EOS is 0).
_ID_LO = 8


@dataclass(slots=True)
class MultiTurnConfig:
    """The shape of a multi-turn workload; ``--multi-turn-*`` flags map onto it."""

    num_tenants: int = 8
    system_prompt_len: int = 1024
    turns: str = "uniform:2:8"  # turns per session
    user_len: str = "uniform:32:256"  # tokens of each new user message
    output_len: str = "uniform:64:384"  # tokens of each answer
    think_time_s: float = 10.0  # mean (exponential) pause between an answer and the next turn
    est_tpot_s: float = 0.03  # per output token, to place the next turn after an answer
    # Tenants' popularity: Zipf exponent (0: uniform; larger: a few hot tenants).
    tenant_skew: float = 0.0
    vocab_size: int = 32000

    def validate(self) -> None:
        if self.num_tenants < 1:
            raise ValueError(f"multi_turn num_tenants must be >= 1, got {self.num_tenants}")
        if self.system_prompt_len < 0:
            raise ValueError(
                f"multi_turn system_prompt_len must be >= 0, got {self.system_prompt_len}"
            )
        for name in ("think_time_s", "est_tpot_s", "tenant_skew"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"multi_turn {name} must be >= 0, got {getattr(self, name)}")
        if self.vocab_size <= _ID_LO:
            raise ValueError(f"multi_turn vocab_size must be > {_ID_LO}, got {self.vocab_size}")
        for name in ("turns", "user_len", "output_len"):
            try:
                dist = parse_length_dist(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"multi_turn {name}: {e}") from None
            if dist is None:
                raise ValueError(f"multi_turn {name} needs a distribution, not 'trace'")

    def mean_turns(self) -> float:
        dist = parse_length_dist(self.turns)
        assert dist is not None
        return float(dist.sample(np.random.default_rng(0), 4096).mean())


def make_multi_turn_workload(
    num_requests: int,
    config: MultiTurnConfig | None = None,
    *,
    rate: float = 1.0,
    seed: int = 0,
    reveal_output_len: bool = False,
    name: str = "multi-turn",
) -> Workload:
    """``num_requests`` turns of sessions that start as a Poisson process at ``rate /
    mean turns`` per second, so turns arrive at about ``rate`` per second; sorted by
    arrival. The last session is cut short at ``num_requests``."""
    cfg = config or MultiTurnConfig()
    cfg.validate()
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = stream(seed, "sessions")
    vocab = cfg.vocab_size

    def ids(n: int) -> list[int]:
        return rng.integers(_ID_LO, vocab, size=n).tolist() if n > 0 else []

    systems = [ids(cfg.system_prompt_len) for _ in range(cfg.num_tenants)]
    weights = 1.0 / np.arange(1, cfg.num_tenants + 1) ** cfg.tenant_skew
    weights /= weights.sum()
    turns_d, user_d, out_d = (_dist(cfg.turns), _dist(cfg.user_len), _dist(cfg.output_len))
    # Enough session starts for any turns draw (each session has >= 1 turn).
    starts = arrival_times(num_requests, "poisson", rate / cfg.mean_turns(), 1.0, seed)

    reqs: list[RequestSpec] = []
    s = 0
    while len(reqs) < num_requests:
        tenant = int(rng.choice(cfg.num_tenants, p=weights))
        k = min(int(turns_d.sample(rng, 1)[0]), num_requests - len(reqs))
        users, outs = user_d.sample(rng, k), out_d.sample(rng, k)
        thinks = rng.exponential(cfg.think_time_s, size=k) if cfg.think_time_s else np.zeros(k)
        t = float(starts[s])
        prompt = list(systems[tenant])
        for j in range(k):
            if j:
                t += float(outs[j - 1]) * cfg.est_tpot_s + float(thinks[j])
            prompt = prompt + ids(int(users[j]))
            o = int(outs[j])
            reqs.append(RequestSpec(
                arrival_time=t, prompt_len=len(prompt), output_len=o,
                tenant=f"tenant-{tenant}", max_tokens=o if reveal_output_len else None,
                prompt_token_ids=prompt, session_id=f"session-{s}",
            ))
            prompt = prompt + ids(o)  # the answer, carried by the next turn's prompt
        s += 1
    reqs.sort(key=lambda r: r.arrival_time)  # stable: a session's turns keep their order
    t0 = reqs[0].arrival_time
    for r in reqs:
        r.arrival_time -= t0
    return Workload(reqs, name=name, meta={
        "workload": "multi-turn", "rate": rate, "seed": seed, "num_sessions": s,
        "num_tenants": cfg.num_tenants, "system_prompt_len": cfg.system_prompt_len,
        "turns": cfg.turns, "user_len": cfg.user_len, "output_len": cfg.output_len,
        "think_time_s": cfg.think_time_s, "est_tpot_s": cfg.est_tpot_s,
        "tenant_skew": cfg.tenant_skew,
    })


def _dist(spec: str) -> LengthDist:
    d = parse_length_dist(spec)
    assert d is not None  # validate() refused 'trace'
    return d
