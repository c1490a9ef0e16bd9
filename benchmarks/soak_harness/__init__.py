"""The soak harness: a real server over capacity, good and bad clients, injected faults,
then an audit (nothing lost, nothing leaked). Run by benchmarks/soak.py and
tests/soak/test_soak.py."""

from .audit import SoakReport, run_soak
from .server import SoakConfig

__all__ = ["SoakConfig", "SoakReport", "run_soak"]
