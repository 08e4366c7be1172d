"""Sampling a benchmarked process tree while it runs (benchmarks/compare and quant.py): peak
RSS and PSS of the measured tree and the CPU other processes took meanwhile; and waiting, between
two servers, until the machine is quiet (wait_quiet)."""

from __future__ import annotations

import os
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, utime + stime jiffies, rss bytes) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE)
    return table


def _descendants(roots: list[int], table) -> set[int]:
    found, frontier = set(roots) & set(table), list(roots)
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, _) in table.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    return found


def machine_busy_jiffies() -> int:
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, open("/proc/stat").readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


class TreeSampler:
    """Every 0.5 s: peak RSS of the measured tree (/proc/PID/stat, cheap), and its PSS whenever
    that RSS has grown by PSS_GROWTH since PSS was last read, and at the end (RSS counts a page
    shared by a forked child and its parent in both; PSS splits it between them); CPU of our
    trees vs the whole machine, so the report can say how many cores other processes took during
    the run. PSS comes from /proc/PID/smaps_rollup, a walk of the process's page tables: ~25 ms
    of CPU for a 1.9 GB process here, which stalls one of the measured engine's two threads for
    that long. Read every 0.5 s (until 2026-12-02 16:20) it showed as a 25-50 ms decode step
    every 0.5 s, longer for the system holding more memory; now it is read while memory grows
    (loading), not while a steady engine decodes."""

    PSS_GROWTH = 1.05

    def __init__(self, measured: int, also_ours: tuple[int, ...] = ()):
        self.measured, self.ours = measured, [measured, *also_ours]
        self.peak_rss = self.peak_pss = 0
        self._cpu_seen: dict[int, int] = {}
        self._our_jiffies = 0
        self._rss_at_pss = 0  # the tree's RSS when PSS was last read
        self._stop = threading.Event()
        self._start = (time.monotonic(), machine_busy_jiffies())
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        self.ours.append(pid)

    def _sample(self, final: bool = False) -> None:
        table = _proc_table()
        measured = _descendants([self.measured], table)
        rss = sum(table[p][2] for p in measured)
        self.peak_rss = max(self.peak_rss, rss)
        if final or rss > self._rss_at_pss * self.PSS_GROWTH:
            self._rss_at_pss = rss
            self.peak_pss = max(self.peak_pss, sum(_pss_bytes(p) for p in measured))
        for pid in _descendants(self.ours, table):
            cpu = table[pid][1]
            self._our_jiffies += cpu - self._cpu_seen.get(pid, 0)  # a new pid: all of it was during the run
            self._cpu_seen[pid] = cpu

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def stop(self) -> dict:
        self._sample(final=True)
        self._stop.set()
        self._thread.join()
        seconds = time.monotonic() - self._start[0]
        machine = (machine_busy_jiffies() - self._start[1]) / CLK_TCK
        ours = self._our_jiffies / CLK_TCK
        return {"peak_rss_mib": self.peak_rss / 2**20, "peak_pss_mib": self.peak_pss / 2**20,
                "our_cpu_cores": ours / seconds,
                "other_cpu_cores": max(machine - ours, 0.0) / seconds, "sampled_s": seconds}


def _pss_bytes(pid: int) -> int:
    """Proportional set size of one process (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def busy_cores(interval_s: float = 1.0) -> float:
    """Cores' worth of CPU time the whole machine spent busy over the next ``interval_s``."""
    started, busy = time.monotonic(), machine_busy_jiffies()
    time.sleep(interval_s)
    return (machine_busy_jiffies() - busy) / CLK_TCK / (time.monotonic() - started)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_quiet(pgid: int, timeout_s: float = 60.0, max_busy: float = 0.2) -> float | None:
    """Wait until no process of the stopped server's group ``pgid`` is left and the cores are quiet
    (at most ``max_busy`` cores busy over a second), so the next server does not start, nor time
    its thread check, while the last one's processes still exit (killed engines free GiBs of
    memory for seconds after SIGKILL) -> None, or after ``timeout_s`` the cores still busy."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    while time.monotonic() < deadline:
        if busy_cores() <= max_busy:
            return None
    return busy_cores()
