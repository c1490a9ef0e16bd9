"""The soak run and its audit (what the package docstring of ``server`` lists)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from .clients import Driver, Workload, _drain_log, _poll_health, _sample_rss, count_objects
from .server import (
    _ENGINE_ID,
    AUTH,
    MODEL,
    ServerProcess,
    SoakConfig,
    read_metrics,
    read_state,
    wait_idle,
)

# --- the run and its audit -----------------------------------------------------------


@dataclass(slots=True)
class SoakReport:
    duration_s: float
    sustained_rps: float
    offered_rps: float
    num_sent: int
    accepted: int
    completed: int
    aborted: int
    errored: int
    rejected: dict[int, int]
    cancelled_before_engine: int
    lost: int
    duplicates: int
    blocks_leaked: int
    num_blocks: int
    preemptions: float
    prefix_cache_hit_rate: float
    health_max_s: float
    health_failures: int
    rss_first_mib: float
    rss_second_mib: float
    greedy_checked: int
    greedy_mismatches: int
    problems: list[str]
    finish_counts: dict[str, int]
    metric_deltas: dict[str, float]
    rss_trace_mib: list[tuple[float, float]]  # (seconds into the run, RSS), ~20 points
    # Live Python objects in the server before and after the run (both idle).
    objects_before: int = 0
    objects_after: int = 0

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_second_mib - self.rss_first_mib

    def table(self) -> str:
        rej = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items()))
        rows = [
            ("duration", f"{self.duration_s:.0f} s"),
            ("offered load", f"{self.offered_rps:.1f} req/s "
                             f"({self.offered_rps / max(self.sustained_rps, 1e-9):.1f}x the "
                             f"{self.sustained_rps:.1f} req/s it sustains)"),
            ("requests sent", str(self.num_sent)),
            ("accepted (reached the engine)", str(self.accepted)),
            ("  completed", str(self.completed)),
            ("  aborted (client left)", str(self.aborted)),
            ("  errored (injected faults)", str(self.errored)),
            ("rejected", f"{sum(self.rejected.values())} ({rej})"),
            ("cancelled before admission", str(self.cancelled_before_engine)),
            ("lost", str(self.lost)),
            ("ended twice", str(self.duplicates)),
            ("blocks leaked", f"{self.blocks_leaked} of {self.num_blocks}"),
            ("preemptions", f"{self.preemptions:.0f}"),
            ("prefix cache hit rate", f"{100 * self.prefix_cache_hit_rate:.0f}%"),
            ("/health max latency", f"{1000 * self.health_max_s:.0f} ms "
                                    f"({self.health_failures} over 1 s or failed)"),
            ("server RSS 1st -> 2nd half", f"{self.rss_first_mib:.1f} -> "
                                           f"{self.rss_second_mib:.1f} MiB "
                                           f"({self.rss_growth_mib:+.1f} MiB)"),
            ("live Python objects", f"{self.objects_before} -> {self.objects_after} "
                                    f"({self.objects_after - self.objects_before:+d})"),
            ("greedy under load == serial", f"{self.greedy_checked - self.greedy_mismatches} "
                                            f"of {self.greedy_checked}"),
            ("problems", str(len(self.problems))),
        ]
        w = max(len(k) for k, _ in rows)
        lines = ["=" * 20 + " iterserve soak " + "=" * 20]
        lines += [f"{k:<{w}}  {v}" for k, v in rows]
        lines += [f"  ! {p}" for p in self.problems[:20]]
        return "\n".join(lines)


def _public_id(engine_id: str) -> str:
    m = _ENGINE_ID.match(engine_id)
    return m.group(1) if m else engine_id


def run_soak(model_path: Path, cfg: SoakConfig, workdir: Path) -> SoakReport:
    with ServerProcess(model_path, cfg, workdir / "server.log") as server:
        try:
            return asyncio.run(_soak(server, cfg))
        except BaseException:
            print(server.log_path.read_text()[-5000:])
            raise


async def _soak(server: ServerProcess, cfg: SoakConfig) -> SoakReport:
    url = server.base_url
    driver = Driver(server, cfg)
    workload = Workload(cfg, cfg.seed)
    # Warm up and measure what the server sustains (closed loop, as many as it runs).
    sustained = await driver.run_closed_loop(cfg.max_num_seqs, cfg.calibrate_s, workload,
                                             "warm")
    await asyncio.to_thread(wait_idle, url)
    state0 = await asyncio.to_thread(read_state, url, True)
    metrics0 = await asyncio.to_thread(read_metrics, url)
    driver.outcomes.clear()
    driver.num_sent = 0

    stop = asyncio.Event()
    health: list[float] = []
    rss: list[tuple[float, float]] = []
    finished: list[list] = []  # the engine's finish log, drained as the run goes
    health_stop = threading.Event()
    health_thread = threading.Thread(
        target=_poll_health, args=(url, cfg.health_poll_s, health_stop, health), daemon=True)
    health_thread.start()
    pollers = [asyncio.create_task(_sample_rss(server, cfg.rss_sample_s, stop, rss)),
               asyncio.create_task(_drain_log(url, stop, finished))]
    # A hang needs the step timeout; it is on only around the hang (a busy machine can
    # stall an ordinary step past a short timeout, and that would be a fault we did not mean).
    faults = sorted([(f, "raise") for f in cfg.raise_at] + [(f, "hang") for f in cfg.hang_at]
                    + [(f + 0.1, "reset") for f in cfg.hang_at])
    injected: list[str] = []

    async def on_fraction(frac: float) -> None:
        while faults and frac >= faults[0][0]:
            _, kind = faults.pop(0)
            body = {
                "raise": {"kind": "raise", "count": 1},
                "hang": {"kind": "hang", "count": 1, "seconds": cfg.step_timeout_s * 2,
                         "step_timeout_s": cfg.step_timeout_s},
                "reset": {"kind": "none", "step_timeout_s": None},
            }[kind]
            async with httpx.AsyncClient() as c:
                r = await c.post(url + "/_test/fault", json=body, headers=AUTH)
                r.raise_for_status()
            if kind != "reset":
                injected.append(kind)

    objects0 = await count_objects(url)
    t0 = time.monotonic()
    offered = await driver.run_open_loop(sustained * cfg.overload, cfg.duration_s, workload,
                                         "soak", on_fraction)
    t_mid = t0 + cfg.duration_s / 2
    t_end = t0 + cfg.duration_s
    stop.set()
    health_stop.set()
    await asyncio.gather(*pollers)
    await asyncio.to_thread(health_thread.join, 5)
    async with httpx.AsyncClient() as c:
        await c.post(url + "/_test/fault", json={"kind": "none", "step_timeout_s": None},
                     headers=AUTH)
    state = await asyncio.to_thread(wait_idle, url)
    state = await asyncio.to_thread(read_state, url, True)
    state["finished"] = finished + state["finished"]
    metrics1 = await asyncio.to_thread(read_metrics, url)

    # Greedy probes, now served one at a time on the idle server.
    serial: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=60) as c:
        for prompt in workload.greedy_prompts:
            r = await c.post(url + "/v1/completions", headers=AUTH, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True})
            serial[prompt] = r.json()["choices"][0]["text"]
    await asyncio.to_thread(wait_idle, url)
    read_state(url, drain=True)
    objects1 = await count_objects(url)
    report = _audit(cfg, driver, state, state0, metrics0, metrics1, health, rss, t_mid, t_end,
                    serial, sustained, offered, injected)
    report.objects_before = objects0["num_objects"]
    report.objects_after = objects1["num_objects"]
    return report


def _audit(cfg: SoakConfig, driver: Driver, state: dict, state0: dict,
           metrics0: dict[str, float], metrics1: dict[str, float], health: list[float],
           rss: list[tuple[float, float]], t_mid: float, t_end: float, serial: dict[str, str],
           sustained: float, offered: float, injected: list[str]) -> SoakReport:
    problems: list[str] = []
    # The engine's log: public id -> {child index: [finish reasons]}.
    log: dict[str, dict[int, list[str]]] = {}
    for engine_id, index, reason in state["finished"]:
        log.setdefault(_public_id(engine_id), {}).setdefault(index, []).append(reason)
    duplicates = sum(len(v) - 1 for ch in log.values() for v in ch.values() if len(v) > 1)
    by_id = {o.rid: o for o in driver.outcomes}
    for rid in log:
        if rid not in by_id:
            problems.append(f"the engine ran {rid}, which no client sent")

    accepted = completed = aborted = errored = lost = cancelled_before = 0
    rejected: Counter[int] = Counter()
    finish_counts: Counter[str] = Counter()
    greedy_checked = greedy_bad = 0
    for o in driver.outcomes:
        if o.problem:
            problems.append(f"{o.rid} ({o.kind}, {o.result}, {o.status}): {o.problem}")
        children = log.get(o.rid)
        if o.result == "lost":
            lost += 1
        if o.result == "rejected":
            rejected[o.status or 0] += 1
            if children is not None:
                problems.append(f"{o.rid} was rejected ({o.status}) but reached the engine")
            continue
        if children is None:
            if o.result == "cancelled":
                cancelled_before += 1  # the client left before its request was admitted
            elif o.result in ("completed", "errored"):
                lost += 1
                problems.append(f"{o.rid} was answered ({o.result}) but the engine never "
                                "ended it")
            continue
        accepted += 1
        reasons = {i: r[0] for i, r in children.items()}
        finish_counts.update(reasons.values())
        if sorted(reasons) != list(range(o.num_children)):
            lost += o.num_children - len(reasons)
            problems.append(f"{o.rid}: children {sorted(reasons)} ended, want "
                            f"{o.num_children}")
        vals = set(reasons.values())
        if "error" in vals:
            errored += 1
            if o.result not in ("errored", "cancelled"):
                problems.append(f"{o.rid}: the engine failed it but the client saw {o.result}")
        elif "abort" in vals:
            aborted += 1
            if o.result != "cancelled":
                problems.append(f"{o.rid}: aborted, but its client did not leave ({o.result})")
        else:
            completed += 1
            if o.result == "completed" and reasons != o.finish_reasons:
                problems.append(f"{o.rid}: client saw {o.finish_reasons}, engine {reasons}")
        if o.result == "errored" and "error" not in vals:
            problems.append(f"{o.rid}: the client saw an error the engine did not log")
        if o.greedy_prompt is not None and o.result == "completed":
            greedy_checked += 1
            if o.texts.get(0) != serial[o.greedy_prompt]:
                greedy_bad += 1
                problems.append(f"{o.rid}: greedy text under load {o.texts.get(0)!r} != "
                                f"serial {serial[o.greedy_prompt]!r}")

    # The engine holds nothing now.
    held = {k: state[k] for k in ("num_streams", "num_unfinished_requests",
                                  "num_admitted_requests", "num_admitted_tokens")}
    if any(held.values()):
        problems.append(f"still held after the drain: {held}")
        lost += state["num_unfinished_requests"]
    blocks_leaked = state["num_blocks"] - state["num_free_blocks"]
    if blocks_leaked or state["num_leak_reports"] != state0["num_leak_reports"]:
        problems.append(f"KV blocks leaked: {blocks_leaked}, leak reports "
                        f"{state['num_leak_reports']}")

    p = "iterserve:"

    def delta(key: str) -> float:
        return metrics1.get(p + key, 0.0) - metrics0.get(p + key, 0.0)

    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "num_requests_admitted"):
        if metrics1[p + g] != 0:
            problems.append(f"/metrics {g} = {metrics1[p + g]} after the drain")
    deltas = {}
    for reason in ("stop", "length", "abort", "error"):
        d = delta(f"request_success_total{{finished_reason={reason}}}")
        deltas[reason] = d
        if d != finish_counts[reason]:
            problems.append(f"/metrics request_success_total{{{reason}}} grew by {d}, the "
                            f"engine log has {finish_counts[reason]}")
    d429 = sum(delta(f"admission_rejections_total{{reason={r}}}")
               for r in ("max_num_queued_reqs", "max_num_queued_tokens"))
    deltas["admission_rejections"] = d429
    # A client that gave up while its request was being refused never saw the 429.
    if not rejected[429] <= d429 <= rejected[429] + cancelled_before:
        problems.append(f"/metrics admission_rejections_total grew by {d429}, clients got "
                        f"{rejected[429]} 429s (and {cancelled_before} gave up unanswered)")
    preemptions = delta("num_preemptions_total")
    queries = delta("prefix_cache_queries_total")
    hits = delta("prefix_cache_hits_total")
    if not injected or len(injected) != len(cfg.raise_at) + len(cfg.hang_at):
        problems.append(f"faults injected: {injected}")

    # /health within 1 s throughout.
    health_failures = sum(1 for h in health if h > 1.0)
    if health_failures or not health:
        problems.append(f"/health: {health_failures} of {len(health)} polls over 1 s")
    # RSS: the peak of each half.
    first = [m for t, m in rss if t < t_mid]
    second = [m for t, m in rss if t_mid <= t <= t_end]
    rss1, rss2 = (max(first) if first else 0.0), (max(second) if second else 0.0)
    return SoakReport(
        duration_s=cfg.duration_s, sustained_rps=sustained, offered_rps=offered,
        num_sent=driver.num_sent, accepted=accepted, completed=completed, aborted=aborted,
        errored=errored, rejected=dict(rejected), cancelled_before_engine=cancelled_before,
        lost=lost, duplicates=duplicates, blocks_leaked=blocks_leaked,
        num_blocks=state["num_blocks"], preemptions=preemptions,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        health_max_s=max(health) if health else float("inf"), health_failures=health_failures,
        rss_first_mib=rss1, rss_second_mib=rss2, greedy_checked=greedy_checked,
        greedy_mismatches=greedy_bad, problems=problems, finish_counts=dict(finish_counts),
        metric_deltas=deltas,
        rss_trace_mib=[(round(t - (t_end - cfg.duration_s), 1), round(m, 1))
                       for t, m in rss[:: max(1, len(rss) // 20)]],
    )
