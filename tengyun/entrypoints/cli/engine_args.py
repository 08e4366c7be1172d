"""EngineConfig <-> command-line flags, with vLLM's flag names, generated from the dataclass:
each init field of EngineConfig is one flag --field-name whose type comes from the annotation,
default from the field, and help, choices, aliases and --help group from its setting(...).
The same generator makes the server's flags from ServerConfig (entrypoints/openai/server_config.py),
whose annotations may carry a Flag for what the type alone cannot say:

    api_key_file: Annotated[str | None, Flag(metavar="PATH")] = setting(None, help=...)
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable

from tengyun.config import EngineConfig

POSITIONAL = ("model",)  # EngineConfig fields given as MODEL or --model, added by add_engine_args itself


@dataclass(frozen=True)
class Flag:
    """How a flag reads its value where the annotation's type does not say: ``parse`` (argparse's
    type=, e.g. '["a", "b"]' -> ["a", "b"]), ``metavar`` ("PATH") and ``nargs`` ("+")."""

    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    nargs: str | None = None


def flag_fields(cls: type, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that become flags: init ones, in declaration order (``only``:
    just these)."""
    return [f for f in dataclasses.fields(cls) if f.init and f.name not in skip and (only is None or f.name in only)]


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                        only: tuple[str, ...] | None = None) -> None:
    """One flag per init field of ``cls`` (see the module docstring); groups are made once per parser.
    ``only``: a command that takes some of the settings (`tengyun plan`)."""
    hints = typing.get_type_hints(cls, include_extras=True)  # keeps Annotated[..., Flag(...)]
    groups: dict[str, Any] = {}
    for f in flag_fields(cls, skip, only):
        group_name = f.metadata.get("group")
        if group_name and group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        target = groups[group_name] if group_name else parser
        names = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        target.add_argument(*names, dest=f.name, **_flag_kwargs(f, hints[f.name]))


def _flag_kwargs(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse keywords for field ``f``: bool -> a switch (--x/--no-x when it defaults True),
    int / float / str (None allowed) -> that type, anything else (int | str) -> str for the
    dataclass to parse; a Flag in Annotated[...] adds its parse, metavar and nargs."""
    flag = Flag()
    if typing.get_origin(hint) is Annotated:
        flag = next((m for m in hint.__metadata__ if isinstance(m, Flag)), flag)
        hint = typing.get_args(hint)[0]
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{f.name}: a flag needs a default; declare it with setting(default, help=...).")
    help_text = f.metadata.get("help") or ""
    help_text = help_text() if callable(help_text) else help_text
    kwargs: dict[str, Any] = {"default": f.default, "help": help_text.replace("%", "%%")}
    if hint is bool:
        kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        return kwargs
    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kwargs["type"] = flag.parse or (types[0] if len(types) == 1 and types[0] in (int, float) else str)
    if f.metadata.get("choices"):
        kwargs["choices"] = f.metadata["choices"]
    kwargs.update({key: value for key, value in (("metavar", flag.metavar), ("nargs", flag.nargs)) if value})
    return kwargs


def dataclass_kwargs(cls: type, args: argparse.Namespace, skip: tuple[str, ...] = (),
                     only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{field name: parsed value} for the flags add_dataclass_flags(parser, cls, skip, only) made."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls, skip, only)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    model_help = EngineConfig.__dataclass_fields__["model"].metadata["help"]
    parser.add_argument("model", nargs="?", default=None, help=model_help)
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    add_dataclass_flags(parser, EngineConfig, skip=POSITIONAL)


def config_from_args(args: argparse.Namespace, usage_context: str = "llm") -> EngineConfig:
    """``usage_context``: "api_server" for `tengyun serve` (its own default step budget on CPU)."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} disagree: pass one of them.")
    config = EngineConfig(model=args.model or args.model_flag, **dataclass_kwargs(EngineConfig, args, skip=POSITIONAL))
    config.usage_context = usage_context
    return config
