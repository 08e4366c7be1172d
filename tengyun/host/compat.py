"""The torch <-> torch_npu <-> CANN <-> driver table (compat_table.json) and version ordering."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("compat_table.json")

# Rank of each part of a version; a number is (1, n) and the end of a version is _END, so
# pre-releases sort before their release and post-releases / builds after it.
_TAG_RANK = {"dev": -3, "alpha": -2, "a": -2, "beta": -1, "rc": 0, "post": 2, "b": 2}
_END = (1, -1)


def version_key(version: str) -> tuple:
    """Sortable key for torch, torch_npu, CANN and Ascend driver versions.
    '8.0.RC2' < '8.0.0' < '8.1.RC1'; '24.1.rc2' < '24.1.0'; '2.10.0rc2' < '2.10.0' < '2.10.0.post4';
    '24.1.rc1' < '24.1.rc1.b030' (a build of rc1)."""
    key: list[tuple[int, int]] = []
    for tag, number in re.findall(r"([a-z]*)(\d*)", version.split("+")[0].lower()):
        if tag:
            key.append((_TAG_RANK.get(tag, 2), int(number or 0)))
        elif number:
            key.append((1, int(number)))
    return (*key, _END)


def base_version(version: str) -> str:
    """'2.1.0.post10' -> '2.1.0'; '2.13.0+cpu' -> '2.13.0'; '2.10.0rc2' -> '2.10.0'."""
    match = re.match(r"^(\d+(?:\.\d+)*)", version.split("+")[0])
    return match.group(1) if match else version


def cann_matches(pattern: str, cann: str) -> bool:
    """'9.1.X' matches any 9.1 release; otherwise exact (case-insensitive)."""
    if pattern.upper().endswith(".X"):
        return cann.upper().startswith(pattern[:-1].upper())
    return pattern.upper() == cann.upper()


@dataclass(frozen=True)
class TorchNpuRow:
    cann: str
    torch: str
    torch_npu: str
    source: str


@dataclass(frozen=True)
class HdkRow:
    cann: str
    driver: str
    firmware: str | None
    source: str


@dataclass(frozen=True)
class GccRow:
    cann: str
    gcc_min: str
    gcc_max: str | None  # newest gcc the CANN release is documented with ("11": any 11.x); None: no ceiling
    source: str


@dataclass(frozen=True)
class CompatTable:
    torch_npu: list[TorchNpuRow]
    cann_hdk: list[HdkRow]
    sources: dict[str, str]
    cann_gcc: list[GccRow]

    def gcc_for(self, cann: str) -> GccRow | None:
        return next((r for r in self.cann_gcc if cann_matches(r.cann, cann)), None)

    def rows_for_torch_npu(self, torch_npu: str) -> list[TorchNpuRow]:
        return [r for r in self.torch_npu if r.torch_npu == torch_npu.split("+")[0]]

    def rows_for(self, cann: str, torch: str) -> list[TorchNpuRow]:
        return [r for r in self.torch_npu if cann_matches(r.cann, cann) and r.torch == base_version(torch)]

    def hdk_for(self, cann: str) -> HdkRow | None:
        return next((r for r in self.cann_hdk if cann_matches(r.cann, cann)), None)


@lru_cache(maxsize=1)
def load_table(path: Path = TABLE_PATH) -> CompatTable:
    data = json.loads(Path(path).read_text())
    return CompatTable(
        torch_npu=[TorchNpuRow(**row) for row in data["torch_npu"]],
        cann_hdk=[HdkRow(**row) for row in data["cann_hdk"]],
        sources=data["sources"],
        cann_gcc=[GccRow(**row) for row in data["cann_gcc"]],
    )
