"""Extract vLLM's public names (serve flags, request fields, routes, metric names) from an
installed vLLM into the JSON data file the compatibility table is generated from.

Run once per vLLM version, with that vLLM's Python (CPU-only is enough, no model):

    VLLM_TARGET_DEVICE=cpu /path/to/vllm-venv/bin/python benchmarks/tools/extract_vllm_names.py \
        src/iterserve/entrypoints/data/vllm_0_33_names.json

then regenerate docs/vllm-compat.md (docs/development.md). Only names are recorded.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path


def serve_flags() -> list[dict]:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    out = []
    for a in parser._actions:
        if "-h" in a.option_strings:
            continue
        names = list(a.option_strings) or [a.dest]
        out.append({"flags": names, "group": group_of.get(id(a)) or ""})
    return out


def request_fields() -> dict[str, list[str]]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return {"completions": sorted(CompletionRequest.model_fields),
            "chat": sorted(ChatCompletionRequest.model_fields)}


def routes() -> list[dict]:
    import vllm.entrypoints as ep
    from fastapi import APIRouter
    found: dict[tuple[str, str], str] = {}
    # The Prometheus exposition, which vLLM adds through prometheus_fastapi_instrumentator.
    found[("/metrics", "GET")] = "entrypoints.serve.instrumentator.metrics"
    for info in pkgutil.walk_packages(ep.__path__, "vllm.entrypoints."):
        if not re.search(r"(api_router|routers?|instrumentator\.\w+|api_server)$", info.name):
            continue
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # optional dependencies
            continue
        src = Path(mod.__file__).read_text() if getattr(mod, "__file__", None) else ""
        # Routes registered inside functions: @router.post("/ping"), ...
        for method, path in re.findall(r"""\.(get|post|put|delete)\(\s*["'](/[^"']*)["']""", src):
            found.setdefault((path, method.upper()), info.name.removeprefix("vllm."))
        for value in vars(mod).values():
            if isinstance(value, APIRouter):
                for r in value.routes:
                    for m in sorted(getattr(r, "methods", None) or ["GET"]):
                        if m != "HEAD":
                            found.setdefault((r.path, m), info.name.removeprefix("vllm."))
        attach = getattr(mod, "attach_router", None)
        if callable(attach):  # routes added by code (the Prometheus /metrics, ...)
            from fastapi import FastAPI
            app = FastAPI()
            try:
                attach(app)
            except Exception:  # needs more than the app
                continue
            for r in app.routes:
                path = getattr(r, "path", None)
                if not path or path.startswith(("/docs", "/redoc", "/openapi")):
                    continue
                for m in sorted(getattr(r, "methods", None) or ["GET"]):
                    if m != "HEAD":
                        found.setdefault((path, m), info.name.removeprefix("vllm."))
    return [{"path": p, "method": m, "module": mod} for (p, m), mod in sorted(found.items())]


def metrics() -> list[dict]:
    import vllm
    root = Path(vllm.__file__).parent
    out: dict[str, dict] = {}
    for path in sorted(root.rglob("*.py")):
        if "benchmarks" in path.parts:
            continue  # the benchmark client parses metrics, it defines none
        text = path.read_text(errors="replace")
        for m in re.finditer(r"""["']vllm:([a-z][a-z0-9_]+)["']""", text):
            before = text[max(0, m.start() - 200):m.start()]
            kinds = re.findall(r"(counter|gauge|histogram)", before, re.IGNORECASE)
            out.setdefault(m.group(1), {
                "name": m.group(1),
                "type": kinds[-1].lower() if kinds else "",
                "source": str(path.relative_to(root.parent)),
            })
    return sorted(out.values(), key=lambda d: d["name"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("output")
    args = ap.parse_args()
    import vllm
    data = {
        "vllm_version": vllm.__version__,
        "serve_flags": serve_flags(),
        "request_fields": request_fields(),
        "routes": routes(),
        "metrics": metrics(),
    }
    Path(args.output).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output}: " + ", ".join(
        f"{len(v)} {k}" for k, v in data.items() if isinstance(v, list)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
