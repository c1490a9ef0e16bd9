"""Shared by the benchmarks: how busy the rest of the machine was while we measured.

Two threads on a shared 2-core machine slow down several-fold when anything else
runs, so every benchmark records the CPU time *other* processes used during each
measurement and flags a busy machine.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from dataclasses import dataclass


def _machine_cpu_seconds() -> float:
    """All CPU time (user + system + nice + irq) the machine spent, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


@dataclass
class BusyReport:
    wall_s: float
    own_cpu_s: float
    other_cpu_s: float

    @property
    def other_cores(self) -> float:
        """Average number of cores other processes kept busy."""
        return self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def is_busy(self) -> bool:
        return self.other_cores > 0.05  # report.py publishes no run above this

    def __str__(self) -> str:
        flag = "  << BUSY: rerun on an idle machine" if self.is_busy else ""
        return f"other processes used {self.other_cores:.2f} cores ({self.other_cpu_s:.1f} CPU-s){flag}"


class MachineMonitor:
    """``with MachineMonitor() as m: ...`` then ``m.report``."""

    def __enter__(self) -> MachineMonitor:
        self._t0 = time.perf_counter()
        self._m0 = _machine_cpu_seconds()
        self._o0 = _own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        total = _machine_cpu_seconds() - self._m0
        own = _own_cpu_seconds() - self._o0
        self.report = BusyReport(wall, own, max(0.0, total - own))


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
