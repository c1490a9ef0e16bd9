"""Structured-output request fields -> ``StructuredOutputsParams``.

Accepted, as vLLM accepts them: ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``, ``disable_any_whitespace``), OpenAI's
``response_format`` (``text``, ``json_object``, ``json_schema``) on chat and
completions, and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. Anything malformed is a 400 naming the field; nothing is ignored.
A request's grammar is compiled at admission, off the event loop and the engine
thread (``compile_structured``), so a bad schema is a 400 before any engine work, and
the compiled grammar goes to the engine with the request.
"""

from __future__ import annotations

from typing import Any

from iterserve.core.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredFieldError(ValueError):
    """A malformed structured-output field; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredFieldError(
            "response_format must be an object with a 'type'", "response_format"
        )
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise StructuredFieldError(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        return StructuredOutputsParams(json=schema)
    raise StructuredFieldError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
        "response_format",
    )


def _from_structured_outputs(so: Any) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise StructuredFieldError("structured_outputs must be an object", "structured_outputs")
    known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
    unknown = sorted(set(so) - known)
    if unknown:
        raise StructuredFieldError(
            f"structured_outputs: unsupported field(s) {', '.join(unknown)[:200]} "
            f"(supported: {', '.join(sorted(known))})",
            "structured_outputs",
        )
    return StructuredOutputsParams(
        json=so.get("json"),
        regex=so.get("regex"),
        choice=so.get("choice"),
        grammar=so.get("grammar"),
        json_object=bool(so.get("json_object") or False),
        disable_any_whitespace=bool(so.get("disable_any_whitespace") or False),
    )


def structured_outputs_of(req: Any) -> tuple[str, StructuredOutputsParams] | None:
    """The request's one output constraint and the field that set it, or None. More
    than one constraint (``response_format`` and ``guided_json``, say) is a 400."""
    structured_outputs, response_format = req.structured_outputs, req.response_format
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        if structured_outputs is not None:
            # Options alone (disable_any_whitespace) may accompany response_format.
            options_only = isinstance(structured_outputs, dict) and set(structured_outputs) <= {
                "disable_any_whitespace"
            }
            if not options_only:
                found.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
        if response_format is not None:
            p = _from_response_format(response_format)
            if p is not None:
                found.append(("response_format", p))
        for name, kind in _GUIDED.items():
            value = getattr(req, name, None)
            if value is not None:
                found.append((name, _from_structured_outputs({kind: value})))
    except StructuredFieldError:
        raise
    except ValueError as e:
        raise StructuredFieldError(str(e), "structured_outputs") from None
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise StructuredFieldError(
            f"give one output constraint, got several ({names})", found[1][0]
        )
    param, params = found[0]
    if isinstance(structured_outputs, dict) and structured_outputs.get("disable_any_whitespace"):
        params.disable_any_whitespace = True
    return param, params


async def compile_structured(engine: Any, found: tuple[str, StructuredOutputsParams]) -> None:
    """Compile (and cache) the request's grammar on the grammar pool, within the time
    limit (``engine/grammar_pool.py``); the compiled grammar rides with ``found``'s
    params to the engine. A ValueError from the checks or the compiler names the field
    that gave the constraint."""
    param, params = found
    manager = getattr(engine.engine_core, "structured_outputs", None)
    if manager is None:
        raise StructuredFieldError("structured outputs are not supported by this engine", param)
    try:
        await manager.compile_async(params)
    except ValueError as e:
        raise StructuredFieldError(str(e), param) from None
