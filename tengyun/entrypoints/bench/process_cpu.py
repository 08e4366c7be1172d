"""CPU seconds a server's processes spent during a `bench serve` run (`--server-pid PID`, Linux).

The server's process and every descendant (Tengyun's API process and engine process, vLLM's API
server and EngineCore, a TP worker each) are read from /proc before and after the run; a
process's share is its utime + stime difference (all its threads), one started during the run
counts from 0. On the 2-core machines this tells whether the API process competes with the
engine for the same cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    command: str  # its command line, shortened
    cpu_s: float  # user + system, all threads


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses):
    [state, ppid, ..., utime (index 11), stime (index 12), ...]; None once the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _command(pid: int, width: int = 48) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    words = [Path(w).name if k == 0 else w for k, w in enumerate(raw.decode(errors="replace").split("\0")) if w]
    text = " ".join(words)
    return text if len(text) <= width else text[:width - 3] + "..."


def process_tree(root: int) -> list[int]:
    """root and its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def snapshot(root: int) -> dict[int, ProcessCpu]:
    """{pid: cumulative CPU seconds} over root's tree now. A root that does not exist: ValueError
    naming --server-pid."""
    if _stat_fields(root) is None:
        raise ValueError(f"--server-pid {root}: no such process on this machine (the server must run here).")
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is not None:
            cpu[pid] = ProcessCpu(pid, _command(pid), (int(fields[11]) + int(fields[12])) / ticks)
    return cpu


def run_share(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> list[ProcessCpu]:
    """Each process's CPU seconds during the run, in tree order."""
    return [ProcessCpu(pid, p.command, p.cpu_s - (before[pid].cpu_s if pid in before else 0.0))
            for pid, p in after.items()]


def format_cpu(share: list[ProcessCpu], duration_s: float) -> str:
    lines = [f"{'Server CPU during the run':-^50}"]
    for p in share:
        lines.append(f"{p.pid:>7} {p.command}")
        lines.append(f"{'':>8}{p.cpu_s:.2f} s, {p.cpu_s / duration_s:.2f} cores on average")
    total = sum(p.cpu_s for p in share)
    lines.append(f"{'Total (s):':<40}{total:.2f}")
    return "\n".join(lines)
