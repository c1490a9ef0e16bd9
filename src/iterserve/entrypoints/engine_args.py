"""Engine flags generated from the config dataclasses (``iterserve.config``).

Every command that takes engine settings (``serve``, ``generate``, ``simulate``,
``calibrate``) adds its flags with :func:`add_config_args`, so a flag has one name,
one default and one help text everywhere; a command passes the names of the fields
it honours (the rest are not accepted: a flag is never silently ignored).

    python -m iterserve.entrypoints.engine_args --markdown > docs/configuration.md

writes the flag reference from the same metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Any

from iterserve.config import (
    ARG_ALIASES,
    SECTIONS,
    BackendConfig,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from iterserve.config_options import parse_bytes, parse_weights

__all__ = [
    "BACKEND_ARGS", "CACHE_ARGS", "ENGINE_ARGS", "MODEL_ARGS", "SCHEDULER_ARGS",
    "SPECULATIVE_ARGS",
    "HelpFormatter", "add_config_args", "add_engine_args", "config_fields",
    "engine_args_dict", "engine_config_from_cli", "engine_kwargs_from_cli", "markdown_reference",
    "parse_bytes", "parse_weights",
]

# (group title, config class, field names) in the order flags are listed.
_MODEL_FIELDS = ("model", "tokenizer", "dtype", "quantization", "quantization_group_size",
                 "device", "seed", "generation_config")


def _cli_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True))


GROUPS: list[tuple[str, type, tuple[str, ...]]] = [
    ("model", EngineConfig, _MODEL_FIELDS),
    ("scheduler", SchedulerConfig, _cli_fields(SchedulerConfig)),
    ("KV cache", CacheConfig, _cli_fields(CacheConfig)),
    ("back end", BackendConfig, _cli_fields(BackendConfig)),
    ("speculative decoding", EngineConfig, ("speculative_config",)),
]
MODEL_ARGS = _MODEL_FIELDS
SCHEDULER_ARGS = GROUPS[1][2]
CACHE_ARGS = GROUPS[2][2]
BACKEND_ARGS = GROUPS[3][2]
SPECULATIVE_ARGS = GROUPS[4][2]
# Everything an engine is built from (serve, generate).
ENGINE_ARGS = MODEL_ARGS + SCHEDULER_ARGS + CACHE_ARGS + BACKEND_ARGS + SPECULATIVE_ARGS


def config_fields() -> dict[str, tuple[str, type, dataclasses.Field]]:
    """Engine argument name -> (group title, config class, field), for every argument."""
    out: dict[str, tuple[str, type, dataclasses.Field]] = {}
    for title, cls, names in GROUPS:
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for name in names:
            out[name] = (title, cls, by_name[name])
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _flags(f: dataclasses.Field) -> list[str]:
    md = f.metadata
    return [md.get("flag") or "--" + f.name.replace("_", "-"), *md.get("aliases", ())]


def _kind(f: dataclasses.Field) -> str:
    """The field's value type, from its default: annotations do not survive mypyc
    (a union reads as ``type``), so a field whose default is None names its parser."""
    default = _default(f)
    if default is None:
        parse = f.metadata.get("parse")
        if parse is None:
            raise TypeError(f"config field {f.name!r} defaults to None: give option(parse=...)")
        return {int: "int", float: "float"}.get(parse, "str")
    return type(default).__name__


def _value_parser(f: dataclasses.Field) -> Callable[[str], Any]:
    """Flag text -> value, with argparse's error message on a bad one."""
    md = f.metadata
    parse = md.get("parse") or {"int": int, "float": float, "str": str}.get(_kind(f), str)
    choices = md.get("choices")

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as e:
            msg = str(e) if parse not in (int, float) else f"not a number: {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(choices)})")
        return value

    convert.__name__ = f.name  # argparse names the flag's type in some errors
    return convert


def _help(f: dataclasses.Field, default: Any) -> str:
    md = f.metadata
    text = md.get("help") or ""
    shown = md.get("shown_default")
    if shown is None and isinstance(default, bool):
        shown = "on" if default else "off"
    elif shown is None and default is not None:
        shown = str(default)
    if shown:
        text += f" (default: {shown})"
    if md.get("env"):
        text += f" [env {md['env']}]"
    return text.replace("%", "%%")


def add_config_args(
    p: argparse.ArgumentParser,
    names: Iterable[str] = ENGINE_ARGS,
    *,
    lists: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    groups: dict[str, Any] | None = None,
) -> None:
    """Add the flags of the named engine arguments to ``p``, in argument groups.

    ``lists``: arguments that take a comma list here (simulate's sweeps), each value
    parsed as the single-value flag parses it; the parsed value is a list.
    ``defaults``: per-command defaults for arguments that are not engine settings
    there (simulate's ``--model`` is a preset name); engine settings keep the config's.
    ``groups``: existing argument groups to add to, by title.
    """
    table = config_fields()
    lists, defaults = set(lists), defaults or {}
    groups = groups if groups is not None else {}
    for name in names:
        title, _cls, f = table[name]
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        g = groups[title]
        default = defaults.get(name, _default(f))
        help_text = _help(f, default)
        flags = _flags(f)
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices else flags[0][2:].upper().replace("-", "_")
        if _kind(f) == "bool":
            g.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                           default=default, help=help_text)
            negatives = f.metadata.get("negatives") or ()
            if negatives:
                g.add_argument(*negatives, dest=name, action="store_false",
                               help=f"the same as --no-{flags[0][2:]}")
        elif name in lists:
            one = _value_parser(f)
            g.add_argument(*flags, dest=name, type=_comma_list(one), default=[default],
                           metavar=metavar + "[,...]",
                           help=help_text + "; a comma list runs each")
        else:
            g.add_argument(*flags, dest=name, type=_value_parser(f), default=default,
                           metavar=metavar, help=help_text)


def _comma_list(one: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def convert(text: str) -> list[Any]:
        values = [one(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    return convert


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every engine flag (vLLM's names): what ``serve`` and ``generate`` take."""
    add_config_args(p, ENGINE_ARGS)


class HelpFormatter(argparse.HelpFormatter):
    """Help texts already name their defaults (the generator adds them)."""


def engine_kwargs_from_cli(
    args: argparse.Namespace, names: Iterable[str] = ENGINE_ARGS
) -> dict[str, Any]:
    """The parsed flags as ``LLM(**kwargs)`` / ``engine_config_from_args`` keywords
    (``model`` excluded: it is ``LLM``'s first argument)."""
    return {n: getattr(args, n) for n in names if n != "model" and hasattr(args, n)}


def engine_config_from_cli(args: argparse.Namespace, names: Iterable[str] = ENGINE_ARGS) -> Any:
    """The parsed flags as an (unresolved) EngineConfig; a value the config refuses
    (e.g. --max-num-batched-tokens below --max-model-len without chunked prefill) ends
    the command with the message, as a bad flag does."""
    from iterserve.engine.builder import engine_config_from_args

    try:
        return engine_config_from_args(getattr(args, "model", None),
                                       **engine_kwargs_from_cli(args, names))
    except ValueError as e:
        raise SystemExit(f"iterserve: error: {e}") from None


def engine_args_dict(cfg: EngineConfig) -> dict[str, Any]:
    """A config as flat engine arguments (``LLM(cfg.model, **d)`` rebuilds it): what a
    benchmark records as ``engine_args`` so ``simulate --compare-with`` can check it."""
    out: dict[str, Any] = {}
    for name, (_title, cls, _f) in config_fields().items():
        section = next((s for s, c in SECTIONS.items() if c is cls), None)
        value = getattr(getattr(cfg, section) if section else cfg, name)
        # A nested config (speculative_config) as the JSON the flag takes.
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        out[name] = value
    return out


# ---------------------------------------------------------------------------
# The flag reference (docs/configuration.md)
# ---------------------------------------------------------------------------


def _md_default(f: dataclasses.Field) -> str:
    shown = f.metadata.get("shown_default")
    if shown is not None:
        return f"`{shown}`" if shown else ""
    # The built-in default, not the environment's: the reference must not vary.
    value = f.default if f.default is not dataclasses.MISSING else None
    if f.metadata.get("env"):
        value = _builtin_env_default(f)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _builtin_env_default(f: dataclasses.Field) -> Any:
    import os

    saved = os.environ.pop(f.metadata["env"], None)
    try:
        return _default(f)
    finally:
        if saved is not None:
            os.environ[f.metadata["env"]] = saved


BEGIN_MARK = ("<!-- generated by `python -m iterserve.entrypoints.engine_args --write "
              "docs/configuration.md` from src/iterserve/config.py: do not edit by hand -->")
END_MARK = "<!-- end of generated part -->"


def markdown_reference() -> str:
    """The generated part of docs/configuration.md: a flag table per group, then the
    environment variables that set defaults."""
    lines: list[str] = []
    envs: list[tuple[str, str, str]] = []
    for title, _cls, names in GROUPS:
        by_name = {f.name: f for f in dataclasses.fields(_cls)}
        lines += [f"### {title[0].upper()}{title[1:]}", "",
                  "| flag | `LLM(...)` keyword | default | description |",
                  "|---|---|---|---|"]
        for name in names:
            f = by_name[name]
            flags = _flags(f)
            if _kind(f) == "bool":
                shown = [f"`{flags[0]}` / `--no-{flags[0][2:]}`"]
                shown += [f"`{a}` / `--no-{a[2:]}`" for a in flags[1:]]
                shown += [f"`{a}`" for a in f.metadata.get("negatives") or ()]
            else:
                shown = [f"`{a}`" for a in flags]
            first, rest = shown[0], shown[1:]
            flag_cell = first + (f" (also {', '.join(rest)})" if rest else "")
            md = f.metadata
            desc = md.get("help", "").replace("|", "\\|")
            keywords = [f"`{name}`"] + [f"`{a}`" for a, n in ARG_ALIASES.items() if n == name]
            if md.get("choices"):
                desc += "; one of " + ", ".join(f"`{c}`" for c in md["choices"])
            if md.get("env"):
                desc += f"; default from `{md['env']}`"
                envs.append((md["env"], flags[0], _md_default(f)))
            lines.append(f"| {flag_cell} | {', '.join(keywords)} | {_md_default(f)} | {desc} |")
        lines.append("")
    lines += ["### Environment variables", "",
              "Each sets its setting's default; a flag or `LLM(...)` keyword still wins. "
              "`0`, `false`, `off` and `no` mean off.", "",
              "| variable | setting | built-in default |", "|---|---|---|"]
    lines += [f"| `{env}` | `{flag}` | {default} |" for env, flag, default in envs]
    return "\n".join(lines) + "\n"


def write_reference(path: str) -> bool:
    """Replace the generated part of ``path`` (between its markers); True if it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, sep, rest = text.partition(BEGIN_MARK)
    _old, sep2, tail = rest.partition(END_MARK)
    if not sep or not sep2:
        raise SystemExit(f"{path}: the generated-part markers are missing")
    new = head + BEGIN_MARK + "\n\n" + markdown_reference() + "\n" + END_MARK + tail
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


def generated_part(path: str) -> str:
    """The generated part of ``path`` as committed (for the drift test)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text.partition(BEGIN_MARK)[2].partition(END_MARK)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the engine flag reference, from the config")
    ap.add_argument("--markdown", action="store_true", help="print the reference (Markdown)")
    ap.add_argument("--write", metavar="PATH",
                    help="replace the generated part of PATH (docs/configuration.md)")
    args = ap.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if write_reference(args.write) else 'up to date'}")
        return 0
    if not args.markdown:
        ap.print_help()
        return 2
    sys.stdout.write(markdown_reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
