"""The ``--multi-turn-*`` flags, shared by ``iterserve simulate --workload multi-turn``
and ``iterserve bench serve --dataset-name multi-turn`` (one workload, one set of
flags; see measure/workload_multi_turn.py)."""

from __future__ import annotations

import argparse

from iterserve.measure.workload_multi_turn import MultiTurnConfig

_D = MultiTurnConfig()


def add_multi_turn_args(group: argparse._ArgumentGroup) -> None:
    g = group
    g.add_argument("--multi-turn-tenants", type=int, default=_D.num_tenants,
                   help=f"tenants, each with its own system prompt (default {_D.num_tenants})")
    g.add_argument("--multi-turn-system-prompt-len", type=int, default=_D.system_prompt_len,
                   help=f"tokens of each tenant's system prompt (default {_D.system_prompt_len})")
    g.add_argument("--multi-turn-turns", default=_D.turns,
                   help=f"turns per session, a length distribution (default {_D.turns})")
    g.add_argument("--multi-turn-user-len", default=_D.user_len,
                   help=f"tokens of each new user message (default {_D.user_len})")
    g.add_argument("--multi-turn-output-len", default=_D.output_len,
                   help=f"tokens of each answer (default {_D.output_len})")
    g.add_argument("--multi-turn-think-time", type=float, default=_D.think_time_s,
                   help="mean seconds (exponential) between an answer and the next turn "
                        f"(default {_D.think_time_s:g})")
    g.add_argument("--multi-turn-est-tpot", type=float, default=_D.est_tpot_s,
                   help="seconds per answer token assumed when placing the next turn "
                        f"(open loop; default {_D.est_tpot_s:g})")
    g.add_argument("--multi-turn-tenant-skew", type=float, default=_D.tenant_skew,
                   help="Zipf exponent of tenant popularity (0: uniform; default 0)")


def multi_turn_config(args: argparse.Namespace, vocab_size: int) -> MultiTurnConfig:
    """The flags as a validated config (ValueError naming the bad field)."""
    cfg = MultiTurnConfig(
        num_tenants=args.multi_turn_tenants,
        system_prompt_len=args.multi_turn_system_prompt_len,
        turns=args.multi_turn_turns,
        user_len=args.multi_turn_user_len,
        output_len=args.multi_turn_output_len,
        think_time_s=args.multi_turn_think_time,
        est_tpot_s=args.multi_turn_est_tpot,
        tenant_skew=args.multi_turn_tenant_skew,
        vocab_size=vocab_size,
    )
    cfg.validate()
    return cfg
