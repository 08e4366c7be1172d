"""argparse that reads underscores in a long flag's name as dashes, as vLLM's command line does:

    --data_parallel_size 2        -> --data-parallel-size 2
    --max_model_len=4096          -> --max-model-len=4096
    --lora-modules my_lora=/a_b   -> unchanged (only flag names change, never values)

Only the name before '=' (and before a '.', where vLLM's dotted config keys begin) is rewritten;
tokens after a bare '--' are positional and stay as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

_FLAG_NAME = re.compile(r"(?<=^--)[^.=]+")  # '--max_model_len=5' -> 'max_model_len'


def dashed_flags(args: Sequence[str]) -> list[str]:
    """['--max_model_len', '5', '--', '--x_y'] -> ['--max-model-len', '5', '--', '--x_y']."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + list(args[i:])
        out.append(_FLAG_NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1))
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long flags may be spelled with underscores (vLLM's parser class
    name). Subparsers made from it are of the same class."""

    def parse_known_args(self, args=None, namespace=None):
        return super().parse_known_args(dashed_flags(sys.argv[1:] if args is None else args), namespace)
