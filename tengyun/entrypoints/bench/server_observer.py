"""What `bench serve` reads from the server beside its own clock: /metrics before and after the
run (the per-request timeline, ops/bench_timeline.py) and, with --server-pid, the CPU seconds of
the server's processes (process_cpu.py). Either is skipped, with a line saying why, where the
server does not offer it."""

from __future__ import annotations

import time

from tengyun.entrypoints.bench import process_cpu
from tengyun.ops.bench_timeline import HistogramTotal, format_timeline, histogram_totals, timeline

TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


class ServerObserver:
    def __init__(self, base_url: str, api_key: str | None, server_pid: int | None, scrape: bool = True):
        self.url = base_url.rstrip("/") + "/metrics"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server_pid, self.scrape = server_pid, scrape
        self.metrics_before: dict[str, HistogramTotal] | None = None
        self.cpu_before: dict[int, process_cpu.ProcessCpu] = {}
        self.skipped = ""

    def start(self) -> None:
        if self.server_pid is not None:
            self.cpu_before = process_cpu.snapshot(self.server_pid)
        if self.scrape:
            self.metrics_before = self._scrape()

    def finish(self, completed: int, client_mean_ttft_ms: float, duration_s: float) -> tuple[str, dict]:
        """(the report's lines, the result JSON's fields) after a run that completed `completed`
        requests. The server may observe a request's histograms just after its last chunk left,
        so the scrape waits (2 s at most) for every completed request's TTFT to be counted."""
        lines, record = [], {}
        if self.server_pid is not None:
            share = process_cpu.run_share(self.cpu_before, process_cpu.snapshot(self.server_pid))
            lines.append(process_cpu.format_cpu(share, duration_s))
            record["server_cpu"] = [{"pid": p.pid, "command": p.command, "cpu_s": p.cpu_s} for p in share]
        if self.metrics_before is not None:
            after = self._scrape_counted(completed)
            if after is not None:
                phases = timeline(self.metrics_before, after)
                lines.insert(0, format_timeline(phases, client_mean_ttft_ms))
                record["server_timeline"] = phases
        if self.skipped:
            lines.append(self.skipped)
        return "\n".join(lines), record

    def _scrape_counted(self, completed: int) -> dict[str, HistogramTotal] | None:
        start = self.metrics_before.get(TTFT_HISTOGRAM, HistogramTotal(0.0, 0.0)).count
        deadline = time.monotonic() + 2.0
        while True:
            after = self._scrape()
            if after is None or TTFT_HISTOGRAM not in after:
                return after
            if after[TTFT_HISTOGRAM].count - start >= completed or time.monotonic() > deadline:
                return after
            time.sleep(0.05)

    def _scrape(self) -> dict[str, HistogramTotal] | None:
        import httpx

        try:
            response = httpx.get(self.url, headers=self.headers, timeout=30)
            response.raise_for_status()
            return histogram_totals(response.text)
        except (httpx.HTTPError, ValueError) as e:
            self.skipped = f"no server timeline: {self.url} did not answer ({e.__class__.__name__}: {e})"
            return None
