"""docs/vllm-compat.md: vLLM's serving flags, request fields, routes and metric names
against iterserve's, generated so it cannot drift.

vLLM's names come from a committed data file (``data/vllm_0_33_names.json``, extracted
once from an installed vLLM by ``benchmarks/tools/extract_vllm_names.py``); iterserve's
side is read from the code itself: the ``serve`` argparse parser, the request pydantic
models, the FastAPI app's routes and the Prometheus registry. A field counts as refused
when the serving code answers it with a 400 saying it is not supported (found in the
source), a flag when its parser action carries a ``reason`` (cli_serve's refused flags).

    python -m iterserve.entrypoints.vllm_compat --write docs/vllm-compat.md
    python -m iterserve.entrypoints.vllm_compat --check docs/vllm-compat.md
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "vllm_0_33_names.json"
ENTRYPOINTS = Path(__file__).parent

Y, ALIAS, REFUSED, NO = "Y", "alias", "refused", "no"
NO_EFFECT, ONE_VALUE = "accepted, no effect", "accepted with one value"
STATUSES = (Y, ALIAS, NO_EFFECT, ONE_VALUE, REFUSED, NO)


@dataclass(slots=True)
class Row:
    vllm: str
    ours: str
    status: str  # one of STATUSES
    note: str = ""


def load_vllm_names(path: Path = DATA) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


# -- serve flags ------------------------------------------------------------------------


def serve_parser() -> argparse.ArgumentParser:
    from iterserve.entrypoints.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser: argparse.ArgumentParser = action.choices["serve"]
            return parser
    raise RuntimeError("the iterserve CLI has no serve command")


def _primary(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings or [action.dest])[0]


def flag_rows(parser: argparse.ArgumentParser, vllm_flags: list[dict[str, Any]]) -> list[Row]:
    by_flag: dict[str, argparse.Action] = {}
    positionals: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.option_strings:
            for s in a.option_strings:
                by_flag.setdefault(s, a)
        else:
            positionals[a.dest] = a
    rows = []
    for entry in vllm_flags:
        flags: list[str] = entry["flags"]
        shown = ", ".join(f"`{f}`" for f in flags)
        if not flags[0].startswith("-"):  # a positional (vllm serve MODEL)
            pos = positionals.get(flags[0])
            rows.append(Row(shown, f"`{flags[0]}`" if pos else "", Y if pos else NO))
            continue
        action = next((by_flag[f] for f in flags if f in by_flag), None)
        if action is None:
            rows.append(Row(f"`{flags[0]}`", "", NO))
            continue
        ours = ", ".join(f"`{s}`" for s in action.option_strings)
        reason = getattr(action, "reason", None)
        missing = [f for f in flags if f not in by_flag]
        note = ("not accepted: " + ", ".join(f"`{f}`" for f in missing)) if missing else ""
        no_effect = getattr(action, "no_effect", None)
        one_value = getattr(action, "one_value", None)
        if one_value:
            value, why = one_value
            rows.append(Row(shown, ours, ONE_VALUE, f"only {value}: {why}; any other value is "
                            "refused"))
        elif isinstance(reason, str) and reason:
            rows.append(Row(shown, ours, REFUSED, reason))
        elif no_effect:
            rows.append(Row(shown, ours, NO_EFFECT, "; ".join(x for x in (no_effect, note) if x)))
        elif _primary(action) in flags:
            rows.append(Row(shown, ours, Y, note))
        else:
            rows.append(Row(shown, ours, ALIAS, "; ".join(
                x for x in (f"iterserve's name: `{_primary(action)}`", note) if x)))
    return rows


# -- request fields ---------------------------------------------------------------------


def refused_fields(sources: list[Path] | None = None) -> dict[str, str]:
    """Fields the serving code refuses: ``bad_request("... not supported", param="f")``."""
    out: dict[str, str] = {}
    for path in sources if sources is not None else sorted(ENTRYPOINTS.glob("serving*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "bad_request" and node.args):
                continue
            msg = node.args[0]
            text = msg.value if isinstance(msg, ast.Constant) and isinstance(msg.value, str) \
                else ""
            param = next((k.value for k in node.keywords if k.arg == "param"), None)
            if (text and "not supported" in text and isinstance(param, ast.Constant)
                    and isinstance(param.value, str)):
                out.setdefault(param.value, text)
    return out


def _model_fields(model: Any) -> dict[str, str]:
    """Field name (and alias) -> why it changes nothing ("" for a field that does)."""
    names = {}
    for name, f in model.model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        why = str(extra.get("no_effect") or "")
        names[name] = why
        if isinstance(f.alias, str):
            names[f.alias] = why
    return names


def field_rows(vllm_fields: list[str], model: Any, refused: dict[str, str]) -> list[Row]:
    ours = _model_fields(model)
    rows = []
    for name in vllm_fields:
        if name in refused:
            rows.append(Row(f"`{name}`", f"`{name}`", REFUSED, refused[name]))
        elif ours.get(name):
            rows.append(Row(f"`{name}`", f"`{name}`", NO_EFFECT, ours[name]))
        elif name in ours:
            rows.append(Row(f"`{name}`", f"`{name}`", Y))
        else:
            rows.append(Row(f"`{name}`", "", NO, "ignored (logged as an unknown field)"))
    return rows


# -- routes -----------------------------------------------------------------------------


def our_routes() -> set[tuple[str, str]]:
    """(path, method) of the server's app, built around an engine that never starts."""
    from iterserve.engine.async_llm import AsyncLLM
    from iterserve.entrypoints.server import ServerConfig, build_app
    from iterserve.metrics import Metrics

    class _Tokenizer:  # what AsyncLLM and the serving layer read at construction
        eos_token_id = 0

        def __len__(self) -> int:
            return 256

    engine = AsyncLLM(None, _Tokenizer(), model_name="m", max_model_len=128,
                      metrics=Metrics("m"), log_stats_interval_s=0)
    app = build_app(engine, ServerConfig(served_model_names=["m"]))
    out = set()
    for r in app.routes:
        path = getattr(r, "path", None)
        for m in getattr(r, "methods", None) or ():
            if path and m != "HEAD":
                out.add((path, m))
    return out


def route_rows(vllm_routes: list[dict[str, Any]], ours: set[tuple[str, str]]) -> list[Row]:
    rows = []
    for r in vllm_routes:
        key = (r["path"], r["method"])
        name = f"`{r['method']} {r['path']}`"
        rows.append(Row(name, name if key in ours else "", Y if key in ours else NO))
    return rows


# -- metrics ----------------------------------------------------------------------------


def our_metric_names() -> set[str]:
    """Metric family names (no prefix) of a server's registry, traffic or not."""
    from iterserve.config import CacheConfig
    from iterserve.entrypoints.guards import ServerCounters
    from iterserve.metrics import Metrics

    m = Metrics("m", prefix="vllm")
    m.attach_engine(128, CacheConfig(num_gpu_blocks=1))
    ServerCounters(m)
    return {fam.name.removeprefix("vllm:") for fam in m.registry.collect()}


def metric_rows(vllm_metrics: list[dict[str, Any]], ours: set[str]) -> list[Row]:
    rows = []
    for m in vllm_metrics:
        name = m["name"]
        rows.append(Row(f"`vllm:{name}`", f"`{name}`" if name in ours else "",
                        Y if name in ours else NO, m.get("type", "")))
    return rows


# -- the document -----------------------------------------------------------------------


def _table(rows: list[Row], head: tuple[str, str]) -> list[str]:
    """What iterserve accepts as a table; what it lacks as one list after it."""
    lines = [f"| {head[0]} | {head[1]} | status | note |", "|---|---|---|---|"]
    for r in rows:
        if r.status != NO:
            note = r.note.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.vllm} | {r.ours} | {r.status} | {note} |")
    missing = [r.vllm for r in rows if r.status == NO]
    if missing:
        lines += ["", f"**no** ({len(missing)}): " + ", ".join(missing)]
    return lines


def _summary(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    return "; ".join(f"{n} {s}" for s, n in counts.items() if n) + f" (of {len(rows)})"


def render(data: dict[str, Any] | None = None) -> str:
    from iterserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    data = data if data is not None else load_vllm_names()
    version = data["vllm_version"]
    refused = refused_fields()
    sections = [
        ("Serving flags (`vllm serve`)", ("vLLM", "iterserve serve"),
         flag_rows(serve_parser(), data["serve_flags"])),
        ("Request fields: `/v1/completions`", ("vLLM", "iterserve"),
         field_rows(data["request_fields"]["completions"], CompletionRequest, refused)),
        ("Request fields: `/v1/chat/completions`", ("vLLM", "iterserve"),
         field_rows(data["request_fields"]["chat"], ChatCompletionRequest, refused)),
        ("Routes", ("vLLM", "iterserve"), route_rows(data["routes"], our_routes())),
        ("Metrics", ("vLLM", "iterserve (after the prefix)"),
         metric_rows(data["metrics"], our_metric_names())),
    ]
    out = [
        "# vLLM compatibility",
        "",
        "<!-- Generated by `python -m iterserve.entrypoints.vllm_compat --write "
        "docs/vllm-compat.md`; do not edit by hand. -->",
        "",
        f"vLLM {version}'s serving flags, request fields, routes and Prometheus metric names "
        "against iterserve's. vLLM's names are read from "
        "`src/iterserve/entrypoints/data/vllm_0_33_names.json` (extracted from vLLM by "
        "`benchmarks/tools/extract_vllm_names.py`); iterserve's from its code: the `serve` "
        "parser, the request models, the app's routes and the metrics registry.",
        "",
        "- **Y**: accepted under vLLM's name.",
        "- **alias**: accepted under vLLM's name, iterserve's own name differs.",
        "- **accepted, no effect**: parsed (so vLLM's launch line or request works) and then "
        "changes nothing; the note says why.",
        "- **accepted with one value**: only the value in the note is accepted (the one "
        "iterserve runs with); any other is refused.",
        "- **refused**: accepted only to be refused with the message in the note (a flag: "
        "a CLI error; a request field: an HTTP 400), never silently ignored.",
        "- **no**: not there. An unknown flag is a CLI error; an unknown request field is "
        "ignored and logged once.",
        "",
        "Metric names take iterserve's prefix (`iterserve:` by default; `--metrics-prefix "
        "vllm` gives vLLM's). The note of a metric is its type in vLLM.",
        "",
        "| section | summary |",
        "|---|---|",
    ]
    out += [f"| {title} | {_summary(rows)} |" for title, _, rows in sections]
    for title, head, rows in sections:
        out += ["", f"## {title}", "", *_table(rows, head)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m iterserve.entrypoints.vllm_compat",
                                 description="write or check docs/vllm-compat.md")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="PATH", help="write the table to PATH")
    g.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the code")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text, encoding="utf-8")
        return 0
    if args.check:
        current = Path(args.check).read_text(encoding="utf-8")
        if current != text:
            print(f"{args.check} is out of date: run python -m iterserve.entrypoints.vllm_compat "
                  f"--write {args.check}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
