"""Imports point one way (docs/architecture.md, "Packages and the direction of imports"):
entrypoints -> engine -> core / model, with the simulator above the engine only through
its documented seam. Read from the source's import statements, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "iterserve"

# Which top-level parts of the package each part may import.
ALLOWED: dict[str, set[str]] = {
    "config_options": set(),
    "measure": set(),
    "config_speculative": set(),
    "config": {"config_options", "config_speculative", "core"},
    # Proposers: pure Python at import; a draft model loads model/ lazily and drives
    # its runner with core's requests, KV cache manager and scheduler outputs.
    "spec_decode": {"config", "config_speculative", "core", "model"},
    "core": {"config"},
    "metrics": {"measure"},
    "bench": {"measure"},
    "model": {"config", "core"},
    "engine": {"config", "config_speculative", "core", "measure", "metrics", "model",
               "spec_decode"},
    "sim": {"bench", "cluster", "config", "config_speculative", "core", "engine", "measure",
            "model", "spec_decode"},
    "cluster": {"config", "core", "engine", "entrypoints", "metrics", "model"},
    "entrypoints": {"bench", "cluster", "config", "config_options", "config_speculative",
                    "core", "engine",
                    "measure", "metrics", "sim"},
    "__init__": {"config", "core", "engine"},
}

# Narrower rules inside an allowed edge: (importing part, imported part) -> the modules
# that may be imported, or the importing modules that may import at all.
SEAMS: dict[tuple[str, str], tuple[str, ...]] = {
    # The simulator drives the engine's request-level API, never its thread or server.
    ("sim", "engine"): ("iterserve.engine.core", "iterserve.engine.output_processor"),
    # The simulated cluster uses the routing policies, which import no Ray.
    ("sim", "cluster"): ("iterserve.cluster",),
}
IMPORTERS: dict[tuple[str, str], tuple[str, ...]] = {
    # Only the Ray Serve ingress builds the HTTP app it serves.
    ("cluster", "entrypoints"): ("cluster/ray_serve.py",),
    # The simulator reads a bench result only to compare with it.
    ("sim", "bench"): ("sim/report.py",),
}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.startswith("iterserve.")]


def _part(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_part_has_a_rule():
    parts = {_part(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    assert parts <= set(ALLOWED), parts - set(ALLOWED)


def test_imports_point_one_way():
    bad: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        src = _part(rel)
        for mod in _imports(path):
            dst = mod.split(".")[1]
            if dst == src:
                continue
            edge = (src, dst)
            if dst not in ALLOWED[src]:
                bad.append(f"{rel}: {mod} ({src} may not import {dst})")
            elif edge in SEAMS and mod not in SEAMS[edge]:
                bad.append(f"{rel}: {mod} (only {SEAMS[edge]} from {src})")
            elif edge in IMPORTERS and rel.as_posix() not in IMPORTERS[edge]:
                bad.append(f"{rel}: {mod} (only {IMPORTERS[edge]} may import {dst})")
    assert not bad, "\n".join(bad)


def test_the_routing_policies_import_no_ray_and_no_engine():
    """What the simulator takes from cluster/ is plain Python."""
    init = SRC / "cluster" / "__init__.py"
    seen = [init]
    for mod in _imports(init):
        if mod.startswith("iterserve.cluster."):
            seen.append(SRC / "cluster" / (mod.split(".")[2] + ".py"))
    for path in seen:
        text = path.read_text()
        assert "import ray" not in text and "from ray" not in text, path
        assert all(not m.startswith(("iterserve.engine", "iterserve.entrypoints"))
                   for m in _imports(path)), path
