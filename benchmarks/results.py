"""Result files: what a benchmark run measured, written where `report.py` reads it.

Every script in benchmarks/ wraps its measurements in one `BenchmarkRun`::

    from results import BenchmarkRun

    with BenchmarkRun("scheduler_overhead", "Scheduler CPU per step",
                      code=["src/iterserve/core", "benchmarks/scheduler_overhead.py"]) as run:
        ...  # measure
        run.figure("decode us/req p50", 0.18, unit="us", better="lower", headline=True, N=256)
        run.baseline("vllm-cpu", "out tok/s", 98.0, unit="tok/s", better="higher", workload="x")
        run.reference("Vidur", "sim req/s", 200, unit="req/s", source="Vidur paper, table 3")

On a clean exit it writes ``benchmarks/results/<benchmark>/<UTC time>-<commit>.json``
(``$ITERSERVE_BENCH_RESULTS`` names another root; ``off`` writes nothing) holding:
the command line, the git commit and whether tracked files had uncommitted changes, the
machine (CPU model, ISA flags that matter, cores, memory), start and end time, the CPU
that processes other than this one and its descendants used over the run (sampled from
/proc), and every figure recorded.

- `figure` is a figure iterserve measured in this run; `baseline` one that another system
  measured in this same run, under the same name and labels as the iterserve figure it
  compares with. `better` ("higher" or "lower") lets the report state every ratio one
  way: above 1 = iterserve better.
- `reference` is a figure quoted, not measured: it needs its `source` and is kept apart.
- `headline=True` puts the figure in the README's table; all figures go in
  docs/benchmarks.md. Labels (keyword arguments) tell figures of the same name apart.
- `code` lists the paths whose last change makes a row stale (``git log`` on them).
- `timed=False` marks a run whose figures are no timings (a simulation's, a perplexity):
  other processes' CPU is still recorded, but a busy machine does not keep it unpublished.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
SCHEMA = 1
# ISA extensions the CPU kernels and torch's dispatch choose between.
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2", "bf16", "i8mm")
_TICK = os.sysconf("SC_CLK_TCK")
Labels = dict[str, str | int | float | bool]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def git_state() -> dict[str, Any]:
    """The commit and whether tracked files (outside benchmarks/results) were changed."""
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                          ":(exclude)benchmarks/results"))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def machine() -> dict[str, Any]:
    """CPU model, the ISA flags that matter, cores and memory of this machine."""
    info: dict[str, Any] = {"arch": platform.machine(), "cpu": platform.processor() or None,
                            "isa": [], "logical_cpus": os.cpu_count(),
                            "usable_cpus": len(os.sched_getaffinity(0)),
                            "kernel": platform.release(), "python": platform.python_version()}
    try:
        flags: set[str] = set()
        cores: set[tuple[str, str]] = set()
        phys = ""
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key in ("model name", "Model") and not info.get("cpu_model"):
                    info["cpu_model"] = val
                elif key in ("flags", "Features"):
                    flags.update(val.split())
                elif key == "physical id":
                    phys = val
                elif key == "core id":
                    cores.add((phys, val))
        info["isa"] = [f for f in ISA_FLAGS if f in flags]
        info["physical_cores"] = len(cores) or None
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    if "torch" in sys.modules:  # only when the benchmark uses it: importing costs seconds
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICK  # all but idle and iowait


def _processes() -> dict[int, tuple[int, float, float]]:
    """pid -> (parent pid, CPU seconds of the process and its reaped children, CPU
    seconds of its reaped children alone)."""
    out: dict[int, tuple[int, float, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s[s.rfind(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK,
                                sum(int(x) for x in fields[13:15]) / _TICK)
    return out


def _tree(procs: dict[int, tuple[int, float, float]], root: int) -> dict[int, float]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            tree[pid] = procs[pid][1]
            todo.extend(children.get(pid, ()))
    return tree


class OtherCpuSampler:
    """Cores used by processes other than this one and its descendants, sampled.

    Each interval: the machine's busy CPU time (/proc/stat) minus what this process tree
    used (/proc/<pid>/stat, a process's reaped children included). A descendant that
    exits is counted through its parent once reaped into the parent's children's time.
    One reaped elsewhere (its parent gone first, as a peer server's workers when the
    server exits: init reaps them) takes its time since the last sample with it, which
    counts as "other": the figure errs high, by at most an interval of that process,
    never low; and the tree never counts as having used less than nothing.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.other_cpu_s = 0.0
        self.max_cores = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._root = os.getpid()

    def start(self) -> None:
        self._t0 = self._t = time.monotonic()
        self._busy = _machine_busy_s()
        procs = _processes()
        self._remember(procs, _tree(procs, self._root))
        self._thread = threading.Thread(target=self._loop, name="other-cpu", daemon=True)
        self._thread.start()

    def _remember(self, procs: dict[int, tuple[int, float, float]], own: dict[int, float]) -> None:
        self._own = own
        self._parent = {p: procs[p][0] for p in own if p in procs}
        self._reaped = {p: procs[p][2] for p in own if p in procs}

    def _sample(self) -> None:
        procs = _processes()
        t, busy, own = time.monotonic(), _machine_busy_s(), _tree(procs, self._root)
        used = sum(v - self._own.get(pid, 0.0) for pid, v in own.items())
        # A process gone since the last sample was counted above in whole, through its
        # parent's reaped children's time, when that parent reaped it: take it off, up
        # to what the parent's reaped time grew by (a zombie parent reaps nothing).
        room = {p: procs[p][2] - self._reaped.get(p, 0.0) for p in own if p in procs}
        for pid, v in self._own.items():
            parent = self._parent.get(pid)
            if pid not in own and parent in room:
                take = min(v, max(room[parent], 0.0))
                room[parent] -= take
                used -= take
        other = max(0.0, (busy - self._busy) - max(used, 0.0))
        if t > self._t:
            self.max_cores = max(self.max_cores, other / (t - self._t))
        self.other_cpu_s += other
        self.samples += 1
        self._t, self._busy = t, busy
        self._remember(procs, own)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = self._t - self._t0
        return {"cores_mean": round(self.other_cpu_s / wall, 4) if wall > 0 else 0.0,
                "cores_max": round(self.max_cores, 4), "cpu_s": round(self.other_cpu_s, 3),
                "samples": self.samples, "interval_s": self.interval_s}


@dataclass
class BenchmarkRun:
    """One run of a benchmark; see the module docstring."""

    benchmark: str
    title: str
    code: list[str]
    argv: list[str] | None = None
    figures: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    path: Path | None = None
    timed: bool = True  # False: no figure is a timing, so other processes' CPU moves none

    def figure(self, name: str, value: float, *, unit: str = "", better: str | None = None,
               headline: bool = False, system: str = "iterserve", **labels: Any) -> None:
        """A figure measured in this run (by iterserve unless `system` says otherwise)."""
        if better not in (None, "higher", "lower"):
            raise ValueError(f"better must be 'higher', 'lower' or None, not {better!r}")
        v = float(value)
        self.figures.append({"system": system, "name": name,
                             "value": v if math.isfinite(v) else None,
                             "unit": unit, "better": better, "headline": headline,
                             "labels": labels})

    def baseline(self, system: str, name: str, value: float, *, unit: str = "",
                 better: str | None = None, **labels: Any) -> None:
        """Another system's figure measured in this run, beside iterserve's `name`/labels."""
        if system == "iterserve":
            raise ValueError("a baseline's system is not iterserve")
        self.figure(name, value, unit=unit, better=better, system=system, **labels)

    def reference(self, system: str, name: str, value: float, *, unit: str = "",
                  source: str, **labels: Any) -> None:
        """A figure quoted, not measured in this run; `source` says where it comes from."""
        if not source:
            raise ValueError("a reference figure needs its source")
        self.references.append({"system": system, "name": name, "value": float(value),
                                "unit": unit, "source": source, "labels": labels})

    def note(self, text: str) -> None:
        self.notes.append(text)

    def __enter__(self) -> BenchmarkRun:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.finish()
        else:  # a failed run leaves no result file
            self.discard()

    def start(self) -> BenchmarkRun:
        """Start the clock and the other-processes sampler (what ``with`` does)."""
        self._start = dt.datetime.now(dt.UTC)
        self._sampler = OtherCpuSampler()
        self._sampler.start()
        return self

    def discard(self) -> None:
        """Stop sampling and write nothing (a run whose figures are not to be kept)."""
        self._sampler.stop()

    def finish(self) -> Path | None:
        """Stop sampling and write the result file; returns its path."""
        other = self._sampler.stop()
        end = dt.datetime.now(dt.UTC)
        argv = self.argv if self.argv is not None else sys.argv
        script = Path(argv[0]).resolve() if argv else None
        if script is not None and script.is_relative_to(REPO):
            argv = [str(script.relative_to(REPO)), *argv[1:]]
        git = git_state()
        record = {
            "schema": SCHEMA, "benchmark": self.benchmark, "title": self.title,
            "command": "python " + shlex.join(argv), "code": self.code, "git": git,
            "machine": machine(), "start": self._start.isoformat(timespec="seconds"),
            "end": end.isoformat(timespec="seconds"),
            "wall_s": round((end - self._start).total_seconds(), 1),
            "other_processes": other, "timed": self.timed, "figures": self.figures,
            "reference_published": self.references, "notes": self.notes,
        }
        self.path = write(record)
        if self.path is not None:
            print(f"# result file: {self.path}", file=sys.stderr)
        return self.path


def write(record: dict[str, Any]) -> Path | None:
    """Write one run's record under the results root; None when results are off."""
    root = os.environ.get("ITERSERVE_BENCH_RESULTS", "")
    if root == "off":
        return None
    base = Path(root) if root else RESULTS_DIR
    stamp = dt.datetime.fromisoformat(record["start"]).strftime("%Y%m%dT%H%M%SZ")
    commit = (record["git"]["commit"] or "nocommit")[:10]
    path = base / record["benchmark"] / f"{stamp}-{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while path.exists():  # two runs in one second
        n += 1
        path = path.with_name(f"{stamp}-{commit}-{n}.json")
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return path
