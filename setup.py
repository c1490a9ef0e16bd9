"""Optional mypyc build of the scheduler and simulator hot path.

``pip install -e .`` compiles the modules below with mypyc (mypy is a build
requirement in pyproject.toml); the .py files stay the source and the fallback.
Set ITERSERVE_NO_MYPYC=1 to skip compiling. If mypyc or a C compiler is missing,
or compiling fails, the install goes on and the package runs as pure Python.
After editing one of these modules, rebuild (``pip install -e .`` again) or delete
its .so files: Python imports a module's .so in preference to its .py.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

MYPYC_MODULES = [
    "src/iterserve/config.py",
    "src/iterserve/core/admission.py",
    "src/iterserve/core/baselines.py",
    "src/iterserve/core/block_hash.py",
    "src/iterserve/core/block_pool.py",
    "src/iterserve/core/hybrid_kv_cache_manager.py",
    "src/iterserve/core/invariants.py",
    "src/iterserve/core/kv_cache_manager.py",
    "src/iterserve/core/kv_groups.py",
    "src/iterserve/core/outputs.py",
    "src/iterserve/core/policy.py",
    "src/iterserve/core/request.py",
    "src/iterserve/core/sampling_params.py",
    "src/iterserve/core/scheduler.py",
    "src/iterserve/core/slo.py",
    "src/iterserve/core/stats.py",
    "src/iterserve/engine/core.py",
    "src/iterserve/sim/executor.py",
    "src/iterserve/sim/simulator.py",
]


def _warn(msg: str) -> None:
    print(f"iterserve: {msg}; installing pure Python", file=sys.stderr)


def ext_modules() -> list:
    if os.environ.get("ITERSERVE_NO_MYPYC", "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not available")
        return []
    try:
        # Type-check only these modules; what they import (torch included) is Any.
        # "--config-file=": the compile's own options, not pyproject's [tool.mypy] (CI's
        # checking, strict on core/), whose findings must not turn the build off.
        return mypycify(
            ["--config-file=", "--follow-imports=skip", "--ignore-missing-imports", *MYPYC_MODULES],
            opt_level="3",
        )
    except BaseException as e:  # mypy reports type errors with SystemExit
        _warn(f"mypyc failed ({type(e).__name__}: {e})")
        return []


class OptionalBuildExt(build_ext):
    """All or nothing: if any compiled module fails to build, install none."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:
            _warn(f"compiling the mypyc modules failed ({type(e).__name__}: {e})")
            for ext in self.extensions:  # drop any that did build
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = []

    def get_outputs(self) -> list:
        return super().get_outputs() if self.extensions else []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
