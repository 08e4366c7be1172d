"""What a host check found: OK / WARN / FAIL, with what to do (`tengyun doctor`, NPU start-up)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    detail: str
    fix: str = ""
    # A version combination documented not to work: `tengyun serve` refuses to start on it
    # (NpuPlatform.check_versions) unless --skip-version-check.
    known_bad: bool = False


def ok(check: str, detail: str) -> Finding:
    return Finding(check, Status.OK, detail)


def warn(check: str, detail: str, fix: str, known_bad: bool = False) -> Finding:
    return Finding(check, Status.WARN, detail, fix, known_bad)


def fail(check: str, detail: str, fix: str, known_bad: bool = False) -> Finding:
    return Finding(check, Status.FAIL, detail, fix, known_bad)
