"""Flags of `tengyun serve`: the engine's (shared with `tengyun generate`) plus the server's,
under vLLM's names, both generated from their dataclasses (EngineConfig, ServerConfig)."""

from __future__ import annotations

import argparse

from tengyun.entrypoints.cli.engine_args import add_dataclass_flags, add_engine_args, dataclass_kwargs
from tengyun.entrypoints.openai.server_config import API_KEY_ENV, ServerConfig

__all__ = ["API_KEY_ENV", "check_server_args", "make_arg_parser", "server_config_from_args"]


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser)
    add_dataclass_flags(parser, ServerConfig)
    return parser


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from `tengyun serve`'s flags; a bad combination raises ValueError
    naming the flag."""
    return ServerConfig(**dataclass_kwargs(ServerConfig, args))


def check_server_args(args: argparse.Namespace) -> None:
    """Refuse flags the server would refuse at start-up (`tengyun deploy`, `tengyun supervise`)."""
    server_config_from_args(args)
