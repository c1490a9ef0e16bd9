"""The published tables are what the committed result files generate (benchmarks/report.py),
and the result files record what the report needs (benchmarks/results.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402
import results  # noqa: E402


def _shallow_clone() -> bool:
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip() == "true"


@pytest.mark.skipif(_shallow_clone(), reason="a shallow clone lacks the runs' commits, "
                    "which the report needs to date rows and mark them stale")
def test_readme_and_docs_tables_match_the_result_files() -> None:
    """Fails when README.md or docs/benchmarks.md differ from what the files generate:
    run ``python benchmarks/report.py`` (and never type a figure into those tables)."""
    for path, text in report.generate().items():
        assert path.read_text() == text, f"{path.name} is stale: run python benchmarks/report.py"
    assert report.main(["--check"]) == 0


# ------------------------------------------------------------------ a repository of its own
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    block = f"{report.BEGIN}\n{report.END}\n"
    (tmp_path / "README.md").write_text(f"# x\n\n## Results\n\n{block}\nafter\n")
    (tmp_path / "docs" / "benchmarks.md").write_text(f"# b\n\n{block}")
    (tmp_path / "src" / "sched.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "init")
    return tmp_path


def record(repo: Path, benchmark: str = "scheduler_overhead", *, other: float = 0.01,
           dirty: bool = False, start: str = "2030-01-02T03:04:05+00:00",
           commit: str | None = None, figures: list | None = None, refs: list | None = None,
           timed: bool | None = None) -> Path:
    data = {
        "schema": 1, "benchmark": benchmark, "title": benchmark, "command": f"python {benchmark}",
        "code": ["src/sched.py"],
        "git": {"commit": commit or _git(repo, "rev-parse", "HEAD"), "dirty": dirty},
        "machine": {"cpu_model": "Test CPU", "usable_cpus": 2, "memory_gib": 8.0},
        "start": start, "end": start, "wall_s": 1.0,
        "other_processes": {"cores_mean": other, "cores_max": other, "cpu_s": 0.0,
                            "samples": 2, "interval_s": 0.5},
        "figures": figures if figures is not None else [
            {"system": "iterserve", "name": "latency p50", "value": 10.0, "unit": "ms",
             "better": "lower", "headline": True, "labels": {"N": 1}},
            {"system": "iterserve", "name": "latency p99", "value": 40.0, "unit": "ms",
             "better": "lower", "headline": True, "labels": {"N": 1}},
            {"system": "peer", "name": "latency p50", "value": 20.0, "unit": "ms",
             "better": "lower", "headline": False, "labels": {"N": 1}},
            {"system": "peer", "name": "latency p99", "value": 20.0, "unit": "ms",
             "better": "lower", "headline": False, "labels": {"N": 1}},
            {"system": "iterserve", "name": "throughput", "value": 300.0, "unit": "tok/s",
             "better": "higher", "headline": False, "labels": {}},
            {"system": "peer", "name": "throughput", "value": 200.0, "unit": "tok/s",
             "better": "higher", "headline": False, "labels": {}},
        ],
        "reference_published": refs or [],
        "notes": [],
    }
    if timed is not None:
        data["timed"] = timed
    path = repo / "benchmarks" / "results" / benchmark / f"{start[:19].replace(':', '')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def blocks(repo: Path) -> tuple[str, str]:
    out = report.generate(repo)
    return out[repo / "README.md"], out[repo / "docs" / "benchmarks.md"]


def test_no_result_files_say_not_measured_yet(repo: Path) -> None:
    readme, docs = blocks(repo)
    for title, cmd in report.BENCHMARKS.values():
        assert f"| {title} | not measured yet |" in readme
        assert f"`{cmd}` writes one" in docs
    assert readme.endswith("after\n")  # text outside the markers is kept


def test_ratios_point_one_way_and_latency_shows_p50_and_p99(repo: Path) -> None:
    record(repo)
    readme, docs = blocks(repo)
    row = next(line for line in readme.splitlines() if "latency p50 / p99" in line)
    # lower is better: peer 20 / iterserve 10 = 2.00x; p99: 20 / 40 = 0.50x.
    assert "10.0 ms / 40.0 ms" in row and "peer: 20.0 ms / 20.0 ms" in row
    assert "2.00x / 0.50x" in row
    assert ": throughput" not in readme  # not a headline figure ...
    tp = next(line for line in docs.splitlines() if line.startswith("| throughput"))
    assert "1.50x" in tp  # ... but in docs; higher is better: 300 / 200
    assert "above 1 = iterserve better" in readme.splitlines()[
        readme.splitlines().index(report.BEGIN) + 1]


def test_busy_dirty_and_unknown_commit_runs_are_skipped_with_the_reason(repo: Path) -> None:
    record(repo, other=0.06, start="2030-01-01T00:00:00+00:00")
    record(repo, dirty=True, start="2030-01-01T00:00:01+00:00")
    record(repo, commit="0" * 40, start="2030-01-01T00:00:02+00:00")
    readme, docs = blocks(repo)
    assert "| Scheduler CPU per step | not measured yet |" in readme
    for text in (readme, docs):
        assert "other processes used 0.06 cores on average (more than 0.05)" in text
        assert "tracked files had uncommitted changes" in text
        assert "its commit is not in this repository's history" in text


def test_a_run_of_no_timings_is_published_from_a_busy_machine(repo: Path) -> None:
    """A simulation's figures do not move with other processes' CPU (``timed=False``)."""
    record(repo, other=0.9, timed=False)
    readme, _ = blocks(repo)
    assert "| Scheduler CPU per step | not measured yet |" not in readme
    assert "other processes 0.90 cores" in readme


def test_newest_publishable_run_wins_and_a_changed_code_path_marks_it_stale(repo: Path) -> None:
    old = [{"system": "iterserve", "name": "speed", "value": 1.0, "unit": "", "better": "higher",
            "headline": True, "labels": {}}]
    new = [dict(old[0], value=2.0)]
    record(repo, figures=old, start="2030-01-01T00:00:00+00:00")
    record(repo, figures=new, start="2030-01-02T00:00:00+00:00")
    record(repo, figures=[dict(old[0], value=3.0)], other=0.5, start="2030-01-03T00:00:00+00:00")
    readme, _ = blocks(repo)
    row = next(line for line in readme.splitlines() if ": speed" in line)
    assert "| 2.00 |" in row and "stale" not in row
    (repo / "src" / "sched.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "change the scheduler")
    readme, _ = blocks(repo)
    row = next(line for line in readme.splitlines() if ": speed" in line)
    assert "**stale** (code changed in" in row


def test_a_reference_stands_apart_with_its_source(repo: Path) -> None:
    refs = [{"system": "Other engine", "name": "latency p50", "value": 15.0, "unit": "ms",
             "source": "its paper, table 2", "labels": {"N": 1}}]
    record(repo, refs=refs)
    readme, _ = blocks(repo)
    row = next(line for line in readme.splitlines() if "latency p50" in line)
    cells = [c.strip() for c in row.split("|")]
    assert cells[5] == "Other engine: 15.0 ms (its paper, table 2)"  # its own column
    assert "Other engine" not in cells[3]  # never beside the measured baseline


def test_check_fails_on_drift(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "REPO", repo)
    assert report.main([]) == 0  # writes
    assert report.main(["--check"]) == 0
    record(repo)
    assert report.main(["--check"]) == 1


# ------------------------------------------------------------------ the result file
def test_a_run_writes_everything_the_report_reads(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITERSERVE_BENCH_RESULTS", str(tmp_path))
    with results.BenchmarkRun("demo", "Demo", code=["benchmarks/results.py"],
                              argv=["benchmarks/demo.py", "--x", "1"]) as run:
        run.figure("speed", 2.0, unit="x", better="higher", headline=True, n=1)
        run.baseline("peer", "speed", 1.0, unit="x", better="higher", n=1)
        run.reference("paper", "speed", 3.0, source="a paper")
        run.figure("undefined", float("nan"))
    assert run.path is not None and run.path.parent == tmp_path / "demo"
    data = json.loads(run.path.read_text())
    assert data["command"] == "python benchmarks/demo.py --x 1"
    assert len(data["git"]["commit"]) == 40 and isinstance(data["git"]["dirty"], bool)
    m = data["machine"]
    assert m["cpu_model"] and m["usable_cpus"] >= 1 and m["memory_gib"] > 0
    assert isinstance(m["isa"], list)
    assert data["other_processes"]["samples"] >= 1 and data["other_processes"]["cores_mean"] >= 0
    assert [f["system"] for f in data["figures"]] == ["iterserve", "peer", "iterserve"]
    assert data["figures"][2]["value"] is None
    assert data["reference_published"][0]["source"] == "a paper"
    assert data["start"] <= data["end"]


def test_bad_calls_are_refused_and_off_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ITERSERVE_BENCH_RESULTS", "off")
    with results.BenchmarkRun("demo", "Demo", code=[]) as run:
        with pytest.raises(ValueError, match="source"):
            run.reference("x", "y", 1.0, source="")
        with pytest.raises(ValueError, match="better"):
            run.figure("y", 1.0, better="up")
        with pytest.raises(ValueError, match="baseline"):
            run.baseline("iterserve", "y", 1.0)
    assert run.path is None
    with pytest.raises(RuntimeError), results.BenchmarkRun("demo", "Demo", code=[]) as run2:
        raise RuntimeError("a failed run")
    assert run2.path is None


def scripted_other_cpu_s(monkeypatch: pytest.MonkeyPatch, root: int, tables: list[dict],
                         busy: list[float]) -> float:
    """The sampler over scripted /proc tables and machine busy times (one per sample,
    the first at start): the "other" CPU seconds it counts."""
    it_t, it_b = iter(tables), iter(busy)
    monkeypatch.setattr(results, "_processes", lambda: next(it_t))
    monkeypatch.setattr(results, "_machine_busy_s", lambda: next(it_b))
    s = results.OtherCpuSampler(interval_s=60)
    s._root = root
    s.start()
    s._stop.set()
    s._thread.join()
    for _ in range(len(tables) - 1):
        s._sample()
    return s.other_cpu_s


def test_the_sampler_counts_the_tree_and_its_reaped_children_as_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted /proc: this process (pid 10) with a child (11) that exits and is reaped
    into 10's children's time; an unrelated process (20) is the only "other" CPU."""
    me = 10
    tables = [  # pid -> (parent, CPU s with reaped children, reaped children's CPU s)
        {me: (1, 1.0, 0.0), 11: (me, 0.0, 0.0), 20: (1, 0.0, 0.0)},
        {me: (1, 1.5, 0.0), 11: (me, 2.0, 0.0), 20: (1, 0.5, 0.0)},  # child 2 s, 20 0.5 s
        {me: (1, 1.5 + 3.0, 3.0), 20: (1, 0.5, 0.0)},  # the child (3 s in all) reaped into 10
    ]
    busy = [100.0, 103.0, 103.0 + 1.0 + 0.25]  # + the tree's CPU + the other's
    assert scripted_other_cpu_s(monkeypatch, me, tables, busy) == pytest.approx(0.5 + 0.25)


def test_a_descendant_reaped_outside_the_tree_is_not_subtracted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer server (11) exits first and sits a zombie; its worker (12, 40 s of CPU in
    all) is reparented to init and reaped there. Its lifetime must not come off the
    tree's usage (that once made "other" read hundreds of cores); only its time since
    the last sample is lost, and counts as other."""
    me = 10
    tables = [
        {me: (1, 1.0, 0.0), 11: (me, 0.0, 0.0), 12: (11, 0.0, 0.0), 20: (1, 0.0, 0.0)},
        {me: (1, 1.0, 0.0), 11: (me, 1.0, 0.0), 12: (11, 40.0, 0.0), 20: (1, 0.5, 0.0)},
        {me: (1, 1.0, 0.0), 11: (me, 1.0, 0.0), 20: (1, 0.5, 0.0)},  # 12 (+0.5 s) reaped by init
        {me: (1, 2.0, 1.0), 20: (1, 0.5, 0.0)},  # the zombie 11 reaped into 10
    ]
    busy = [100.0, 141.5, 142.0, 142.0]
    assert scripted_other_cpu_s(monkeypatch, me, tables, busy) == pytest.approx(0.5 + 0.5)


def test_a_pipe_in_a_name_cannot_break_the_table(repo: Path) -> None:
    fig = {"system": "iterserve", "name": "|error|", "value": 1.0, "unit": "%",
           "better": "lower", "headline": True, "labels": {"a": "x|y"}}
    record(repo, figures=[fig, dict(fig, system="other|peer", headline=False)])
    readme, _ = blocks(repo)
    row = next(line for line in readme.splitlines() if "error" in line)
    assert r"\|error\| (a x\|y)" in row and r"other\|peer: 1.00 %" in row
    assert row.replace(r"\|", "").count("|") == 7  # six cells
