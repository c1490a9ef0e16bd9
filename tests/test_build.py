"""The optional mypyc build (setup.py) of the scheduler and simulator hot path."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import iterserve

PACKAGE = Path(iterserve.__file__).parent


def compiled_modules() -> list[tuple[Path, Path]]:
    """(extension, source) pairs: mypyc puts ``mod.cpython-*.so`` beside ``mod.py``."""
    pairs = []
    for so in PACKAGE.rglob("*.so"):
        py = so.with_name(so.name.split(".")[0] + ".py")
        if py.exists():
            pairs.append((so, py))
    return pairs


def test_compiled_modules_are_not_stale():
    """Python imports a module's .so before its .py: an edit to a compiled module does
    nothing until it is rebuilt. Fail loudly instead of testing the old code."""
    stale = [str(py.relative_to(PACKAGE)) for so, py in compiled_modules()
             if so.stat().st_mtime < py.stat().st_mtime]
    assert not stale, (
        f"edited since the mypyc build: {stale}; rebuild with `pip install -e .` "
        "(or delete the .so files, or install with ITERSERVE_NO_MYPYC=1)"
    )


def test_hot_path_compiled_where_it_can_be():
    """Where a C compiler exists and the build was not opted out, the install must
    have compiled the hot path: a silent fallback to pure Python halves the
    simulator's speed and would otherwise go unnoticed (pip -q hides the warning)."""
    if os.environ.get("ITERSERVE_NO_MYPYC", "") not in ("", "0"):
        pytest.skip("mypyc build opted out")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    from iterserve.core import scheduler

    assert scheduler.__file__.endswith(".so"), (
        "iterserve.core.scheduler is pure Python: the mypyc build fell back "
        "(reinstall with `pip install -e . -v` to see why)"
    )
