"""Regenerate the README's Results table and docs/benchmarks.md's tables from the result files.

    python benchmarks/report.py           # rewrite both between their marker comments
    python benchmarks/report.py --check   # exit 1 (and print a diff) when either is stale

Only committed result files count (``benchmarks/results/<benchmark>/*.json``, written by
the scripts through ``results.py``). For each figure the newest publishable run that
measured it is shown, with its commit, date and the cores other processes used. A run is
not published (and is listed as skipped, with the reason) when other processes used more
than ``MAX_OTHER_CORES`` cores on average, when tracked files had uncommitted changes, or
when its commit is not in this repository's history. A row whose run is older than the
last commit touching the code its benchmark declares is marked stale. Every ratio is
iterserve's figure over the baseline's, inverted where lower is better: above 1 =
iterserve better. A benchmark with no publishable run says "not measured yet".
"""

from __future__ import annotations

import argparse
import difflib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MAX_OTHER_CORES = 0.05
BEGIN, END = "<!-- results:begin (benchmarks/report.py) -->", "<!-- results:end -->"

# The benchmarks in the order the tables show them, with the command a first run takes.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline_throughput": ("Offline throughput",
                           "python benchmarks/offline_throughput.py --models llama-56m,qwen2-0.5b"),
    "online_vs_vllm": ("Online serving against vLLM's CPU server",
                       "python benchmarks/online_vs_vllm.py"),
    "server_profile": ("Where a saturated server's CPU goes",
                       "ITERSERVE_PYSPY=PATH python benchmarks/server_profile.py"),
    "scheduler_overhead": ("Scheduler CPU per step", "python benchmarks/scheduler_overhead.py"),
    "simulator_speed": ("Simulator speed", "python benchmarks/simulator_speed.py --repeat 3"),
    "simulator_fidelity": ("Simulator against the measured engine",
                           "python benchmarks/simulator_fidelity.py --held-out --threads 1"),
    "structured_output": ("Structured outputs: a JSON schema's cost",
                          "python benchmarks/structured_output.py"),
    "hostile_load": ("Normal clients beside hostile ones", "python benchmarks/hostile_load.py"),
    "goodput": ("Goodput by scheduling policy (simulator)", "python benchmarks/goodput.py"),
    "goodput_engine": ("Goodput by scheduling policy (real engine)",
                       "python benchmarks/goodput_engine.py --threads 1 --num-prompts 160"),
    "routing": ("Routing over replicas (simulator)", "python benchmarks/routing.py"),
    "pd_simulation": ("Prefill/decode disaggregation (simulator)",
                      "python benchmarks/pd_simulation.py"),
    "pd_ray": ("Prefill/decode disaggregation on Ray Serve", "python benchmarks/pd_ray.py"),
    "soak": ("Soak over capacity", "python benchmarks/soak.py --duration 180"),
    "bench_client_overhead": ("The bench client's own overhead",
                              "python benchmarks/bench_client_overhead.py"),
    "quantized": ("Quantized GGUF files against llama.cpp", "python benchmarks/quantized.py"),
    "default_model_eval": ("The default model: held-out bits per byte",
                           "python benchmarks/default_model_eval.py --doc-root DIR --draft "
                           "src/iterserve/data/default_model_draft"),
}


@dataclass
class Run:
    path: Path
    data: dict[str, Any]
    skip: str | None = None  # why it is not published
    stale: str | None = None  # the commit that changed its code since

    @property
    def commit(self) -> str:
        return (self.data["git"].get("commit") or "")[:10]

    @property
    def date(self) -> str:
        return self.data["start"][:10]

    @property
    def other(self) -> float:
        return float(self.data["other_processes"]["cores_mean"])

    def tag(self) -> str:
        s = f"`{self.commit}` {self.date}, other processes {self.other:.2f} cores"
        return s + (f"; **stale** (code changed in `{self.stale}`)" if self.stale else "")


@dataclass
class Row:
    run: Run
    fig: dict[str, Any]
    baselines: list[dict[str, Any]] = field(default_factory=list)
    references: list[dict[str, Any]] = field(default_factory=list)
    pair: Row | None = None  # the p99 beside a p50


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()


def load_runs(results: Path, repo: Path) -> list[Run]:
    runs = []
    for path in sorted(results.glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
            _ = (data["benchmark"], data["figures"], data["git"], data["start"],
                 data["other_processes"]["cores_mean"])  # what the report reads
        except (ValueError, KeyError, TypeError) as e:
            runs.append(Run(path, {}, skip=f"unreadable result file ({e})"))
            continue
        run = Run(path, data)
        commit = data["git"].get("commit")
        if data.get("timed", True) and run.other > MAX_OTHER_CORES:
            run.skip = (f"other processes used {run.other:.2f} cores on average "
                        f"(more than {MAX_OTHER_CORES})")
        elif data["git"].get("dirty"):
            run.skip = "tracked files had uncommitted changes"
        elif not commit or subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"],
                                          cwd=repo, capture_output=True).returncode:
            run.skip = "its commit is not in this repository's history"
        else:
            paths = [p for p in data.get("code", []) if (repo / p).exists()]
            if paths:
                try:
                    changed = _git(repo, "rev-list", "-1", f"{commit}..HEAD", "--", *paths)
                except subprocess.CalledProcessError:
                    changed = "unknown"
                run.stale = changed[:10] or None
        runs.append(run)
    return runs


def _key(fig: dict[str, Any]) -> tuple[str, str]:
    return fig["name"], json.dumps(fig["labels"], sort_keys=True)


def select(runs: list[Run], benchmark: str) -> tuple[list[Row], list[tuple[Run, dict]]]:
    """The newest publishable run's figure per (name, labels): iterserve's rows, with the
    baselines and references of that same run, and the other systems' unmatched figures."""
    good = sorted((r for r in runs if not r.skip and r.data["benchmark"] == benchmark),
                  key=lambda r: r.data["start"], reverse=True)
    rows: dict[tuple[str, str], Row] = {}
    others: dict[tuple[str, str, str], tuple[Run, dict]] = {}
    for run in good:
        figs = run.data["figures"]
        ours = {_key(f) for f in figs if f["system"] == "iterserve"}
        for f in figs:
            k = _key(f)
            if f["system"] == "iterserve" and k not in rows:
                rows[k] = Row(run, f, [b for b in figs if b["system"] != "iterserve"
                                       and _key(b) == k],
                              [x for x in run.data.get("reference_published", [])
                               if _key(x) == k])
            elif f["system"] != "iterserve" and k not in ours:
                others.setdefault((f["system"], *k), (run, f))
    return list(rows.values()), list(others.values())


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    a = abs(v)
    s = (f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1
         else f"{v:.3g}")
    return f"{s} {unit}".strip()


def ratio(fig: dict[str, Any], base: dict[str, Any]) -> str:
    a, b = fig["value"], base["value"]
    if fig.get("better") not in ("higher", "lower") or not a or not b:
        return "—"
    return f"{(a / b if fig['better'] == 'higher' else b / a):.2f}x"


def labels(fig: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fig["labels"].items())


def pair_percentiles(rows: list[Row], all_rows: list[Row]) -> list[Row]:
    """Put each p50 row beside its p99 (same run and labels): latency shows both."""
    by_key = {(id(r.run), _key(r.fig)): r for r in all_rows}
    out, used = [], set()
    for r in rows:
        if id(r) in used:
            continue
        if " p50" in r.fig["name"]:
            k = (id(r.run), (r.fig["name"].replace(" p50", " p99"), _key(r.fig)[1]))
            p99 = by_key.get(k)
            if p99 is not None:
                r.pair = p99
                used.add(id(p99))
        out.append(r)
    return [r for r in out if id(r) not in used]


def cells(row: Row) -> tuple[str, str, str, str, str]:
    parts = [row] + ([row.pair] if row.pair else [])
    name = row.fig["name"].replace(" p50", " p50 / p99", 1) if row.pair else row.fig["name"]
    value = " / ".join(fmt(p.fig["value"], p.fig["unit"]) for p in parts)
    systems = [b["system"] for b in row.baselines]
    base, rat = [], []
    for system in systems:
        bs = [next((b for b in p.baselines if b["system"] == system), None) for p in parts]
        base.append(f"{system}: " + " / ".join(fmt(b["value"], b["unit"]) if b else "n/a"
                                              for b in bs))
        rat.append(" / ".join(ratio(p.fig, b) if b else "—" for p, b in zip(parts, bs)))
    refs = [f"{x['system']}: {fmt(x['value'], x['unit'])} ({x['source']})"
            for p in parts for x in p.references]
    return name, value, "; ".join(base) or "—", "; ".join(rat) or "—", "; ".join(refs) or "—"


HEADER = ("| figure | iterserve | baseline, measured in the same run | iterserve vs baseline "
          "(above 1 = iterserve better) | reference (published), not measured here | run |\n"
          "|---|---:|---:|---:|---|---|")


def cell(text: str) -> str:
    """Text that cannot break a Markdown table row."""
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], what: str) -> list[str]:
    out = HEADER.split("\n")
    for r in rows:
        name, value, base, rat, refs = (cell(c) for c in cells(r))
        lab = cell(labels(r.fig))
        out.append(f"| {cell(what)}{name}{f' ({lab})' if lab else ''} | {value} | {base} | "
                   f"{rat} | {refs} | {r.run.tag()} |")
    return out


def _rel(path: Path, repo: Path) -> str:
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def skipped(runs: list[Run], repo: Path) -> list[str]:
    bad = [r for r in runs if r.skip]
    if not bad:
        return []
    return ["", "Not published:", ""] + [f"- `{_rel(r.path, repo)}`: {r.skip}" for r in bad]


def run_list(runs: list[Run], repo: Path) -> list[str]:
    out = ["", "The runs shown (reproduce each with its command at its commit):", ""]
    for r in runs:
        m = r.data.get("machine", {})
        desc = (f"{m.get('cpu_model') or m.get('cpu') or m.get('arch')}, {m.get('usable_cpus')} "
                f"CPUs, {m.get('memory_gib')} GiB")
        out.append(f"- {r.tag()}, {desc}: `{r.data['command']}` "
                   f"(`{_rel(r.path, repo)}`)")
    return out


def benchmarks_in(runs: list[Run]) -> list[str]:
    names = list(BENCHMARKS)
    names += sorted({r.data["benchmark"] for r in runs if r.data} - set(names))
    return names


def title(name: str, runs: list[Run]) -> str:
    if name in BENCHMARKS:
        return BENCHMARKS[name][0]
    return next((r.data.get("title") or name for r in runs if r.data.get("benchmark") == name), name)


def readme_block(runs: list[Run], repo: Path) -> str:
    out = HEADER.split("\n")
    shown: dict[int, Run] = {}
    for name in benchmarks_in(runs):
        rows, _ = select(runs, name)
        head = pair_percentiles([r for r in rows if r.fig.get("headline")], rows)
        if not head:
            cmd = BENCHMARKS[name][1] if name in BENCHMARKS else name
            out.append(f"| {title(name, runs)} | not measured yet | — | — | — | `{cmd}` |")
            continue
        out += table(head, f"{title(name, runs)}: ")[2:]
        shown.update({id(r.run): r.run for r in head})
    if shown:
        out += run_list(sorted(shown.values(), key=lambda r: r.path), repo)
    out += skipped(runs, repo)
    return "\n".join(out)


def docs_block(runs: list[Run], repo: Path) -> str:
    out: list[str] = []
    for name in benchmarks_in(runs):
        rows, others = select(runs, name)
        cmd = BENCHMARKS[name][1] if name in BENCHMARKS else ""
        out += ["", f"### {title(name, runs)} (`{name}`)", ""]
        if not rows and not others:
            out.append(f"Not measured yet: no publishable result file. `{cmd}` writes one.")
            continue
        if rows:
            out += table(pair_percentiles(rows, rows), "")
        if others:
            out += ["", "Other figures of the same runs (no iterserve figure to compare):", "",
                    "| system | figure | value | run |", "|---|---|---:|---|"]
            for run, f in others:
                lab = cell(labels(f))
                out.append(f"| {cell(f['system'])} | {cell(f['name'])}"
                           f"{f' ({lab})' if lab else ''} | {fmt(f['value'], f['unit'])} | "
                           f"{run.tag()} |")
        shown = {id(r.run): r.run for r in rows} | {id(r): r for r, _ in others}
        out += run_list(sorted(shown.values(), key=lambda r: r.path), repo)
    out += skipped(runs, repo)
    return "\n".join(out).lstrip("\n")


def splice(text: str, block: str, where: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{where}: expected one {BEGIN!r} and one {END!r}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def generate(repo: Path | None = None, results: Path | None = None) -> dict[Path, str]:
    """The README and docs/benchmarks.md as the result files make them."""
    repo = repo or REPO
    runs = load_runs(results or repo / "benchmarks" / "results", repo)
    files = {repo / "README.md": readme_block(runs, repo),
             repo / "docs" / "benchmarks.md": docs_block(runs, repo)}
    return {p: splice(p.read_text(), block, str(p.relative_to(repo))) for p, block in files.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when a file differs")
    args = ap.parse_args(argv)
    stale = 0
    for path, text in generate().items():
        old = path.read_text()
        if old == text:
            continue
        if args.check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), text.splitlines(True), str(path), f"{path} (generated)"))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("\nthe tables differ from the result files: run python benchmarks/report.py",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
