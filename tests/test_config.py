"""One configuration: the config dataclasses, the flags generated from them for every
command, resolution into a new frozen config, and the KV sizing rule the server and
the simulator share."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from iterserve.config import (
    SECTIONS,
    BackendConfig,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    num_gpu_blocks_for,
    resolve_max_model_len,
)
from iterserve.engine.builder import engine_config_from_args
from iterserve.entrypoints import cli_calibrate, cli_simulate
from iterserve.entrypoints.cli import build_parser
from iterserve.entrypoints.engine_args import (
    CACHE_ARGS,
    ENGINE_ARGS,
    SCHEDULER_ARGS,
    config_fields,
    engine_args_dict,
    engine_config_from_cli,
    generated_part,
    markdown_reference,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


# The engine arguments each command takes. simulate's own --model (a preset name) and
# --seed (the workload's) are not engine arguments there.
TAKES = {"serve": ENGINE_ARGS, "generate": ENGINE_ARGS,
         "simulate": cli_simulate.SIMULATE_ARGS, "calibrate": cli_calibrate.CALIBRATE_ARGS}


def engine_flags(command: str) -> dict[str, tuple[tuple[str, ...], object]]:
    """Engine argument -> (its option strings, its default) in ``command``'s parser."""
    return {a.dest: (tuple(a.option_strings), a.default)
            for a in subparser(command)._actions if a.dest in TAKES[command]}


def parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *flags])


# -- one set of flags ------------------------------------------------------------------


def test_every_engine_field_is_a_flag_of_serve_with_help():
    serve = engine_flags("serve")
    assert set(serve) == set(ENGINE_ARGS)
    for name, (_title, _cls, f) in config_fields().items():
        assert f.metadata.get("help"), f"{name} has no help text"
    # Every field of every section is an engine argument (adding one adds its flag),
    # unless it is marked programmatic (cli=False).
    for cls in SECTIONS.values():
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
        assert names <= set(ENGINE_ARGS)


@pytest.mark.parametrize("command", ["generate", "simulate", "calibrate"])
def test_engine_flags_match_serve(command):
    """Each engine flag a command accepts has serve's spellings and serve's default
    (simulate's comma-list flags: a one-element list of it)."""
    serve, other = engine_flags("serve"), engine_flags(command)
    for name, (options, default) in other.items():
        assert options == serve[name][0], name
        if name in cli_simulate.SIMULATE_LISTS and command == "simulate":
            default = default[0]
        assert default == serve[name][1], name


def option_strings(command: str) -> set[str]:
    return {o for a in subparser(command)._actions for o in a.option_strings}


def test_each_command_takes_the_flags_it_honours():
    serve = engine_flags("serve")
    assert set(engine_flags("generate")) == set(ENGINE_ARGS)
    # Every scheduler and KV cache flag of serve, each spelling, is accepted by simulate.
    for name in (*SCHEDULER_ARGS, *CACHE_ARGS, "dtype"):
        assert set(serve[name][0]) <= option_strings("simulate"), name
    for name in cli_calibrate.CALIBRATE_ARGS:
        assert set(serve[name][0]) <= option_strings("calibrate"), name
    # The rest are not there to be silently ignored.
    for name in ("device", "tokenizer", "compile", "backend", "gemv"):
        assert not set(serve[name][0]) & option_strings("simulate"), name
    for name in SCHEDULER_ARGS:
        if name not in cli_calibrate.CALIBRATE_ARGS:
            assert not set(serve[name][0]) & option_strings("calibrate"), name


@pytest.mark.parametrize("command, flags", [
    ("simulate", ["--device", "cpu"]),  # the simulator has --hardware
    ("simulate", ["--compile"]),
    ("calibrate", ["--scheduling-policy", "fair"]),  # the grid schedules itself
    ("calibrate", ["--no-enable-prefix-caching"]),
    ("serve", ["--scheduler", "static,continuous"]),  # lists are simulate's
    ("serve", ["--max-num-seqs", "many"]),
    ("serve", ["--kv-cache-memory", "lots"]),
    ("serve", ["--tenant-weights", "a:1"]),
    ("simulate", ["--policy", "fcfs,lottery"]),
])
def test_flags_a_command_would_not_honour_are_refused(command, flags, capsys):
    with pytest.raises(SystemExit):
        parse(command, *flags)
    assert "error" in capsys.readouterr().err


SAME_FLAGS = [
    "--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--max-model-len", "2048",
    "--scheduling-policy", "fair", "--tenant-weights", "a=1,b=3",
    "--aging-rate", "2.5", "--aging-base", "sjf", "--max-preemptions-per-request", "3",
    "--long-prefill-token-threshold", "256", "--preemption-mode", "swap", "--swap-space", "64",
    "--block-size", "32", "--num-gpu-blocks-override", "500", "--no-enable-prefix-caching",
    "--scheduler", "dynamic", "--static-batch-size", "4", "--dynamic-batch-window-ms", "20",
    "--enable-backfill", "--backfill-max-passes", "4", "--ttft-slo-ms", "500",
    "--tpot-slo-ms", "40", "--slo-admission", "--slo-late-penalty", "10",
    "--prefix-caching-hash-algo", "sha256",
]


def test_simulated_config_equals_served_config():
    served = engine_config_from_cli(parse("serve", *SAME_FLAGS))
    args = parse("simulate", *SAME_FLAGS)
    simulated = cli_simulate.engine_config(args, args.scheduler[0], args.scheduling_policy[0])
    assert simulated.scheduler == served.scheduler
    assert simulated.cache == served.cache
    sc = served.scheduler
    assert sc.tenant_weights == {"a": 1.0, "b": 3.0} and sc.aging_rate == 2.5
    assert sc.aging_base == "sjf" and sc.max_preemptions_per_request == 3
    assert sc.dynamic_batch_window_s == pytest.approx(0.02)


@pytest.mark.parametrize("policy", ["aging", "priority"])
def test_simulated_policy_equals_served_policy_with_defaults(policy):
    served = engine_config_from_cli(parse("serve", "--scheduling-policy", policy))
    args = parse("simulate", "--policy", policy)
    simulated = cli_simulate.engine_config(args, "continuous", policy)
    assert simulated == dataclasses.replace(served, seed=simulated.seed)
    assert simulated.scheduler == SchedulerConfig(scheduling_policy=policy)
    assert simulated.cache == CacheConfig()


def test_existing_spellings_are_aliases():
    old = parse("simulate", "--no-prefix-caching", "--no-chunked-prefill", "--policy", "sjf",
                "--batch-size", "16", "--batch-window-ms", "10", "--num-gpu-blocks", "99",
                "--max-model-len", "4096", "--max-num-batched-tokens", "4096")
    new = parse("simulate", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                "--scheduling-policy", "sjf", "--static-batch-size", "16",
                "--dynamic-batch-window-ms", "10", "--num-gpu-blocks-override", "99",
                "--max-model-len", "4096", "--max-num-batched-tokens", "4096")
    assert cli_simulate.engine_config(old, "continuous", "sjf") == \
        cli_simulate.engine_config(new, "continuous", "sjf")
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "static_batch_size",
                 "num_gpu_blocks"):
        assert getattr(old, name) == getattr(new, name)


def test_simulate_comma_lists():
    args = parse("simulate", "--scheduler", "static,continuous", "--policy", "fcfs, fair")
    assert args.scheduler == ["static", "continuous"]
    assert args.scheduling_policy == ["fcfs", "fair"]


def test_kwargs_accept_vllm_names_and_refuse_unknown_ones():
    cfg = engine_config_from_args("m", num_gpu_blocks_override=40, backend="torch",
                                  compile=True, max_num_seqs=7)
    assert cfg.cache.num_gpu_blocks == 40 and cfg.scheduler.max_num_seqs == 7
    assert cfg.backend.backend == "torch" and cfg.backend.compile and cfg.model == "m"
    with pytest.raises(TypeError, match=r"max_num_seqs_.*known:.*max_num_seqs"):
        engine_config_from_args(None, max_num_seqs_=3)


def test_env_sets_backend_defaults(monkeypatch):
    monkeypatch.setenv("ITERSERVE_BACKEND", "torch")
    monkeypatch.setenv("ITERSERVE_FUSED_DECODE", "0")
    monkeypatch.setenv("ITERSERVE_GEMV", "rows")
    cfg = BackendConfig()
    assert (cfg.backend, cfg.fused_decode, cfg.gemv) == ("torch", False, "rows")
    assert cfg == BackendConfig.from_env()
    args = parse("serve")
    assert args.backend == "torch" and args.fused_decode is False and args.gemv == "rows"
    assert parse("serve", "--backend", "cpp").backend == "cpp"  # the flag wins
    monkeypatch.setenv("ITERSERVE_GEMV", "diagonal")
    with pytest.raises(ValueError, match="gemv"):
        BackendConfig()


def test_engine_args_dict_round_trips():
    cfg = engine_config_from_cli(parse("serve", *SAME_FLAGS))
    assert engine_config_from_args(cfg.model, **{
        k: v for k, v in engine_args_dict(cfg).items() if k != "model"}) == cfg


# -- frozen, validated, resolved -------------------------------------------------------


@pytest.mark.parametrize("obj, name, value", [
    (CacheConfig(), "num_gpu_blocks", 10),
    (SchedulerConfig(), "max_model_len", 10),
    (BackendConfig(), "compile", True),
    (EngineConfig(), "dtype", "float32"),
])
def test_configs_are_frozen(obj, name, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, value)


def test_tenant_weights_are_copied():
    weights = {"a": 1.0}
    sc = SchedulerConfig(tenant_weights=weights)
    weights["b"] = 5.0
    assert sc.tenant_weights == {"a": 1.0}


@pytest.mark.parametrize("cls, kwargs, field_name", [
    (CacheConfig, {"block_size": 0}, "block_size"),
    (CacheConfig, {"num_gpu_blocks": -1}, "num_gpu_blocks"),
    (CacheConfig, {"kv_cache_memory": 0}, "kv_cache_memory"),
    (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    (CacheConfig, {"swap_space": -1}, "swap_space"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
    (SchedulerConfig, {"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
    (SchedulerConfig, {"max_model_len": 0}, "max_model_len"),
    (SchedulerConfig, {"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    (SchedulerConfig, {"scheduling_policy": "lottery"}, "scheduling_policy"),
    (SchedulerConfig, {"preemption_mode": "drop"}, "preemption_mode"),
    (SchedulerConfig, {"aging_rate": -1.0}, "aging_rate"),
    (SchedulerConfig, {"aging_base": "fcfs"}, "aging_base"),
    (SchedulerConfig, {"max_preemptions_per_request": -1}, "max_preemptions_per_request"),
    (SchedulerConfig, {"tenant_weights": {"a": 0.0}}, "tenant_weights"),
    (SchedulerConfig, {"scheduler": "eager"}, "scheduler"),
    (SchedulerConfig, {"static_batch_size": 0}, "static_batch_size"),
    (SchedulerConfig, {"dynamic_batch_window_s": -0.1}, "dynamic_batch_window_s"),
    (SchedulerConfig, {"enable_chunked_prefill": False, "max_model_len": 9000},
     "max_num_batched_tokens"),
    (BackendConfig, {"gemv": "fast"}, "gemv"),
    (BackendConfig, {"backend": "tpu"}, "backend"),
    (BackendConfig, {"gemv": "cpp", "backend": "torch"}, "gemv"),
    (CacheConfig, {"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
    (SchedulerConfig, {"ttft_slo_ms": 0.0}, "ttft_slo_ms"),
    (SchedulerConfig, {"backfill_max_passes": -1}, "backfill_max_passes"),
    (SchedulerConfig, {"step_time_coefficients": (1.0,)}, "step_time_coefficients"),
    (EngineConfig, {"dtype": "int4"}, "dtype"),
])
def test_bad_values_raise_naming_the_field(cls, kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        cls(**kwargs)


def test_resolution_makes_a_new_config():
    cfg = engine_config_from_args(None, max_num_seqs=4)
    assert cfg.scheduler.max_model_len is None and cfg.cache.num_gpu_blocks is None
    assert not cfg.is_resolved
    resolved = cfg.resolve(max_model_len=512, num_gpu_blocks=64)
    assert resolved is not cfg and resolved.is_resolved
    assert resolved.scheduler.max_model_len == 512 and resolved.cache.num_gpu_blocks == 64
    assert cfg.scheduler.max_model_len is None and cfg.cache.num_gpu_blocks is None
    assert resolved.scheduler.max_num_seqs == 4
    with pytest.raises(ValueError, match="max_model_len"):  # re-validated
        cfg.resolve(max_model_len=0, num_gpu_blocks=64)


def test_max_model_len_rule():
    assert resolve_max_model_len(SchedulerConfig(), 4096) == 4096
    assert resolve_max_model_len(SchedulerConfig(max_model_len=100), 4096) == 100
    no_chunks = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert resolve_max_model_len(no_chunks, 4096) == 1024
    with pytest.raises(ValueError, match="max_model_len"):
        resolve_max_model_len(SchedulerConfig(max_model_len=8192), 4096)


def test_scheduler_needs_a_resolved_config():
    from iterserve.core.scheduler import Scheduler

    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), CacheConfig(num_gpu_blocks=8))
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        Scheduler(SchedulerConfig(max_model_len=64), CacheConfig())


# -- one KV sizing rule ----------------------------------------------------------------


def test_sizing_rule():
    per_block = 1 << 20
    gib = 1 << 30
    acc = dict(bytes_per_block=per_block, memory_total=80 * gib, on_host=False)
    # 90% of 80 GiB minus the 14 GiB in use (the weights).
    assert num_gpu_blocks_for(CacheConfig(), memory_free=66 * gib, **acc) == int(72 * gib - 14 * gib) // per_block
    assert num_gpu_blocks_for(CacheConfig(kv_cache_memory=10 * per_block + 5),
                              memory_free=0, **acc) == 10
    assert num_gpu_blocks_for(CacheConfig(num_gpu_blocks=3), memory_free=0, **acc) == 3
    host = dict(bytes_per_block=per_block, memory_total=64 * gib, memory_free=64 * gib,
                on_host=True)
    assert num_gpu_blocks_for(CacheConfig(), **host) == (4 * gib) // per_block  # the cap
    # Never more than every sequence at full length.
    assert num_gpu_blocks_for(CacheConfig(), max_num_seqs=2, max_model_len=100, **host) == 2 * 7
    with pytest.raises(ValueError, match="kv_cache_memory"):
        num_gpu_blocks_for(CacheConfig(kv_cache_memory=100), memory_free=0, **acc)


def test_simulator_sizes_kv_as_the_server_does():
    from iterserve.sim.cost_model import HARDWARE_PRESETS, get_model_spec, kv_cache_blocks

    spec, hw = get_model_spec("llama-2-7b"), HARDWARE_PRESETS["h100"]
    cache = engine_config_from_cli(parse("serve")).cache
    expected = num_gpu_blocks_for(
        cache, bytes_per_block=spec.kv_bytes_per_token * cache.block_size,
        memory_total=int(hw.memory_bytes), memory_free=int(hw.memory_bytes) - spec.weight_bytes,
        on_host=False)
    assert kv_cache_blocks(spec, hw, cache=cache) == expected
    # simulate without flags sizes its cache from serve's defaults by that rule.
    args = parse("simulate")
    cfg = cli_simulate.engine_config(args, "continuous", "fcfs")
    assert cli_simulate.num_gpu_blocks(args, cfg, None, 4096) == expected
    half = parse("simulate", "--gpu-memory-utilization", "0.5")
    assert cli_simulate.num_gpu_blocks(half, cli_simulate.engine_config(
        half, "continuous", "fcfs"), None, 4096) < expected


def test_simulate_with_a_profile_takes_the_calibrated_engine_blocks(tmp_path):
    from iterserve.sim.cost_model import CostModel

    profile = tmp_path / "cal.json"
    cost = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8,
                     meta={"num_gpu_blocks": 321})
    cost.save(profile)
    args = parse("simulate", "--profile", str(profile))
    cfg = cli_simulate.engine_config(args, "continuous", "fcfs")
    assert cli_simulate.num_gpu_blocks(args, cfg, CostModel.load(profile), 4096) == 321
    args = parse("simulate", "--profile", str(profile), "--num-gpu-blocks-override", "50")
    cfg = cli_simulate.engine_config(args, "continuous", "fcfs")
    assert cli_simulate.num_gpu_blocks(args, cfg, CostModel.load(profile), 4096) == 50


def test_compare_with_warns_on_different_engine_settings(tmp_path):
    cfg = cli_simulate.engine_config(parse("simulate"), "continuous", "fcfs").resolve(
        max_model_len=4096, num_gpu_blocks=1000)
    recorded = engine_args_dict(cfg) | {"max_num_seqs": 64}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"engine_args": recorded, "records": []}))
    lines = cli_simulate.compare_engine_args(str(path), cfg)
    assert len(lines) == 1 and "max_num_seqs=64" in lines[0]
    path.write_text(json.dumps({"engine_args": engine_args_dict(cfg)}))
    assert cli_simulate.compare_engine_args(str(path), cfg) == []
    path.write_text(json.dumps({"records": []}))
    assert "does not record" in cli_simulate.compare_engine_args(str(path), cfg)[0]


# -- the flag reference ----------------------------------------------------------------


def test_docs_flag_reference_is_generated():
    assert generated_part(str(DOC)) == markdown_reference(), (
        "docs/configuration.md is out of date: run "
        "`python -m iterserve.entrypoints.engine_args --write docs/configuration.md`"
    )


@pytest.mark.parametrize("command", ["serve", "generate", "calibrate"])
def test_a_refused_value_ends_the_command_naming_the_field(command):
    from iterserve.entrypoints.cli import main

    with pytest.raises(SystemExit, match="max_num_seqs must be a positive integer"):
        main([command, "--max-num-seqs", "0"])
