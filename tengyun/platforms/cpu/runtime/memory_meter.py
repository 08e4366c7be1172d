"""On CPU the peak of a step is read from the process's resident memory: glibc's free heap pages
are first given back (malloc_trim), so that the step's buffers are pages it faults in, then the
resident high-water mark is reset (/proc/self/clear_refs) and read after the step (VmHWM)."""

from __future__ import annotations

from tengyun.host import probe
from tengyun.platforms.cpu.runtime import allocator


class ResidentPeakMeter:
    name = "process resident peak (VmHWM)"

    def __init__(self):
        self.base: int | None = None

    def start(self) -> None:
        allocator.give_back_free_pages()
        self.base = probe.own_resident_bytes()[0] if probe.reset_own_resident_peak() else None

    def peak(self) -> int | None:
        """None where the high-water mark could not be reset (it would hold an earlier peak)."""
        if self.base is None:
            return None
        return max(0, probe.own_resident_bytes()[1] - self.base)

    def release_cached(self) -> None:
        """Nothing to give back: the KV budget on CPU is a fixed size, not what is left free."""
