"""Tengyun is measured with its compiled CPU kernels: `KernelGuard` checks, before the runs, that this
checkout's kernels are built and load, and after them, that their sources did not change meanwhile.
An edited source under tengyun/csrc/ is another build folder (cpu_kernels.build_directory), which a
Tengyun process started afterwards does not find: it runs the PyTorch fallback (torch_sdpa, oneDNN
alone) and its figures are not Tengyun's. Both happened while benchmarks ran on 2026-12-03."""

from __future__ import annotations

import sys


class KernelGuard:
    def __init__(self):
        from tengyun.platforms.cpu import native as cpu_kernels

        error = cpu_kernels.load_error()
        if error:
            sys.exit(f"Tengyun's CPU kernels do not load ({error}): its runs would measure the PyTorch "
                     "fallback. Build them first: python -m tengyun.platforms.cpu.native --build")
        self.folder = cpu_kernels.build_directory()

    def changed(self) -> str | None:
        """None while the sources still hash to the build the runs started with, else a warning."""
        from tengyun.platforms.cpu import native as cpu_kernels

        now = cpu_kernels.build_directory()
        if now == self.folder:
            return None
        return (f"**Invalid Tengyun figures**: the CPU kernel sources changed during the runs ({self.folder.name} "
                f"-> {now.name}); Tengyun runs started after the change ran without the compiled kernels.")
