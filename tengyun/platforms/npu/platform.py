from __future__ import annotations

import importlib.util
import logging
import os
import sys

from tengyun.host.probe import NNAL_SET_ENV
from tengyun.host.versions import SET_ENV
from tengyun.dtypes import torch_dtype
from tengyun.platforms.base import Platform, reference_quant_bytes, fullest_device, torch_memory_readings
from tengyun.platforms.kernel_choice import KernelCandidate, KernelQuery, always
from tengyun.platforms.startup import (
    DEVICE_INIT_TIMEOUT_ENV, SKIP_HINT, DeviceStartupError, RuntimeProblem, run_child_probe,
)

INSTALL_FIX = (f"install the torch_npu build matching your torch and CANN (`tengyun doctor` names it), "
               f"then `source {SET_ENV}`")
NNAL_FIX = (f"install the NNAL package matching your CANN, then `source {NNAL_SET_ENV}` after the CANN "
            f"set_env.sh (`tengyun doctor` checks it)")
NO_NPU_FIX = (f"run `source {SET_ENV}`, check `npu-smi info` lists the cards, and check ASCEND_RT_VISIBLE_DEVICES "
              f"(in a container: pass the /dev/davinci* devices)")
# Run in a child Python by runtime_problem: each step is announced before it starts, so a hang names it.
_PROBE = r"""
import sys
def step(what):
    print("STEP " + what, flush=True)
step("import torch"); import torch
step("import torch_npu"); import torch_npu
step("torch.npu.is_available()")
if not torch.npu.is_available():
    print("UNAVAILABLE torch.npu.is_available() is False", flush=True); sys.exit(0)
step("torch.npu.device_count()"); count = torch.npu.device_count()
step("torch.npu.set_device(0)"); torch.npu.set_device(0)
step("the first tensor on npu:0"); torch.zeros(1, device="npu:0"); torch.npu.synchronize()
step("NNAL's ATB library")  # the KV-cache write's, where npu_scatter_pa_kv_cache does not serve (kernels/attention.py)
if not hasattr(torch_npu, "npu_scatter_pa_kv_cache") or "310" in torch.npu.get_device_name(0):
    import ctypes
    try:
        ctypes.CDLL("libatb.so")
    except OSError as e:
        print("NNAL " + str(e), flush=True); sys.exit(0)
print(f"OK {count} NPU(s)", flush=True)
"""
# The step that hung -> what to check.
_HANG_HINTS = {
    "starting Python": "the probe process did not start: check the machine's load",
    "import torch": "importing torch itself was this slow: check the machine's load and the Python environment's disk",
    "import torch_npu": f"loading CANN and ACL hung: check that `source {SET_ENV}` selects the CANN this torch_npu "
                        f"is built for (`tengyun doctor`) and that `npu-smi info` answers",
    "torch.npu.is_available()": "the NPU driver did not answer: check `npu-smi info` answers and lists healthy "
                                "cards, and `dmesg | grep -i davinci`",
    "torch.npu.device_count()": "the NPU driver did not answer: check `npu-smi info` and `dmesg | grep -i davinci`",
    "torch.npu.set_device(0)": "opening NPU 0 hung: another process may hold it (the process table of `npu-smi "
                               "info`), or it is unhealthy (`npu-smi info -t health -i 0`); choose free cards with "
                               "ASCEND_RT_VISIBLE_DEVICES",
    "NNAL's ATB library": f"loading NNAL's libatb.so hung: check `source {NNAL_SET_ENV}` selects the NNAL of this "
                          f"CANN",
    "the first tensor on npu:0": "the first allocation on NPU 0 hung: check its HBM is free (`npu-smi info`) and "
                                 "its health (`npu-smi info -t health -i 0`)",
}


class NpuPlatform(Platform):
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    default_block_size = 128  # what the fused paged-attention kernels are tuned for

    @classmethod
    def kernel_candidates(cls, kind: str):
        """torch_npu's kernels (npu/kernels/): attention, fused layer ops, quantised linears (GGUF
        kept quantised), then the plain-PyTorch ones."""
        return list(_NPU_CANDIDATES.get(kind, ())) + super().kernel_candidates(kind)

    @classmethod
    def is_available(cls) -> bool:
        return cls.runtime_installed() and cls._in_process_problem() is None

    def check_available(self) -> None:
        """In this process (workers, `tengyun launch`); start-up proper goes through runtime_problem."""
        problem = self._in_process_problem() if self.runtime_installed() else \
            RuntimeProblem("torch_npu is not installed", INSTALL_FIX, installed=False)
        if problem is not None:
            raise DeviceStartupError(f"--device npu was requested but {problem.what}: {problem.fix}.")

    @classmethod
    def runtime_installed(cls) -> bool:
        return importlib.util.find_spec("torch_npu") is not None

    @classmethod
    def runtime_problem(cls, timeout_s: float) -> RuntimeProblem | None:
        """torch_npu imported and NPU 0 touched in a child process within ``timeout_s`` (in this
        process when torch_npu is already imported here)."""
        if not cls.runtime_installed():
            return RuntimeProblem("torch_npu is not installed", INSTALL_FIX, installed=False)
        if "torch_npu" in sys.modules:
            return cls._in_process_problem()
        probe = run_child_probe(_PROBE, timeout_s, results=("OK", "UNAVAILABLE", "NNAL"))
        if probe.timed_out:
            return RuntimeProblem(
                f"the NPU runtime hung: `{probe.last_step}` did not finish within {timeout_s:g} s "
                f"(--device-init-timeout, ${DEVICE_INIT_TIMEOUT_ENV})",
                _HANG_HINTS.get(probe.last_step, "see `tengyun doctor`")
                + "; if the first start is only slow, raise --device-init-timeout",
                installed=True)
        if probe.result and probe.result.startswith("OK"):
            return None
        if probe.result and probe.result.startswith("NNAL "):
            return RuntimeProblem(f"NNAL's ATB library, which its KV-cache write (_npu_reshape_and_cache) needs, does "
                                  f"not load ({probe.result[5:]})", NNAL_FIX, installed=True)
        if probe.result:
            return RuntimeProblem(f"torch_npu finds no NPU ({probe.result.split(' ', 1)[1]})", NO_NPU_FIX, True)
        if probe.last_step == "import torch_npu":
            return RuntimeProblem(f"torch_npu is not importable: {probe.error}",
                                  f"run `source {SET_ENV}` (the CANN libraries torch_npu loads) and check that "
                                  f"torch_npu is the build for your torch and CANN (`tengyun doctor`)", True)
        return RuntimeProblem(f"`{probe.last_step}` failed: {probe.error}", NO_NPU_FIX, installed=True)

    @classmethod
    def _in_process_problem(cls) -> RuntimeProblem | None:
        try:
            import torch
            import torch_npu  # noqa: F401
        except Exception as e:
            return RuntimeProblem(f"torch_npu is not importable: {type(e).__name__}: {e}",
                                  f"run `source {SET_ENV}` and check torch_npu matches torch and CANN "
                                  f"(`tengyun doctor`)", installed=True)
        try:
            if torch.npu.is_available():
                return None
        except Exception as e:
            return RuntimeProblem(f"torch.npu.is_available() failed: {type(e).__name__}: {e}", NO_NPU_FIX, True)
        return RuntimeProblem("torch_npu finds no NPU", NO_NPU_FIX, installed=True)

    @classmethod
    def check_versions(cls) -> None:
        """torch / torch_npu / CANN / driver against compat_table.json, as `tengyun doctor` reads them."""
        from tengyun.host import probe, versions

        bad = versions.known_bad_versions(probe.collect_versions())
        if bad:
            raise DeviceStartupError(
                "the NPU software stack is a known-bad version combination:\n"
                + "\n".join(f"  - {f.detail}: {f.fix}" for f in bad)
                + f"\nFix the versions (`tengyun doctor` checks them all), or {SKIP_HINT}.")

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def set_device(self, device) -> None:
        import torch

        torch.npu.set_device(device)

    def memory_info(self) -> tuple[int, int]:
        import torch

        return torch.npu.mem_get_info()

    def init_process(self) -> None:
        """In each rank, before its HCCL communicators exist: set the HCCL variables Tengyun relies on
        that the environment leaves unset (tengyun/host/hccl.py: values, reasons, CANN sources), and
        log them with their values."""
        from tengyun.host import hccl

        added = hccl.missing_defaults(dict(os.environ))
        os.environ.update(added)
        if added:
            logging.getLogger(__name__).info(
                "HCCL defaults (not set in the environment): %s; set them to override (`tengyun doctor` checks them)",
                " ".join(f"{k}={v}" for k, v in added.items()))

    def smi_device_ids(self) -> list[int]:
        from tengyun.host import probe, smi

        out = probe.npu_smi_info()
        if out is None or out.returncode != 0:
            return []
        return sorted({d.npu_id for d in smi.parse_npu_smi_info(out.stdout).devices})

    def memory_usage(self, pid: int) -> tuple[int, int] | None:
        from tengyun.host import probe, smi

        out = probe.npu_smi_info()
        if out is None or out.returncode != 0:
            return None
        usage = {}
        for d in smi.parse_npu_smi_info(out.stdout).devices:  # HBM where the card has it (910B), else DDR
            used, total = (d.hbm_used_mb, d.hbm_total_mb) if d.hbm_total_mb else (d.memory_used_mb, d.memory_total_mb)
            if total:
                usage[d.npu_id] = (used or 0, total)
        return fullest_device(usage, os.environ.get(self.visible_devices_env))

    def device_readings(self) -> list:
        """npu-smi (HBM, AI Core use, temperature, power, health per visible chip), else this
        process's own device through torch_npu's mem_get_info."""
        from tengyun.host import probe, smi, telemetry

        out = probe.npu_smi_info()
        if out is not None and out.returncode == 0:
            readings = telemetry.npu_readings(smi.parse_npu_smi_info(out.stdout),
                                              os.environ.get(self.visible_devices_env))
            if readings:
                return readings
        return torch_memory_readings("npu")

    def link_status(self) -> dict[str, str] | None:
        """`hccn_tool -i N -link -g` for each visible device: {"npu:N": "UP" | "DOWN" | "unknown"};
        None when hccn_tool is not installed."""
        from tengyun.host import probe, smi, telemetry

        if probe.hccn_tool() is None:
            return None
        ids = telemetry.visible_ids(os.environ.get(self.visible_devices_env))
        status = {}
        for device in sorted(ids) if ids is not None else self.smi_device_ids():
            out = probe.hccn_link(device)
            if out is None:
                return None
            status[f"npu:{device}"] = (smi.parse_hccn_link(out.stdout) if out.returncode == 0 else None) or "unknown"
        return status

    @classmethod
    def settings_problem(cls, block_size: int, dtype: str, kv_cache_dtype: str) -> str | None:
        """npu_fused_infer_attention_score (torch_npu docs, PageAttention约束) pages a multi-token
        query only in blocks of 128-512 tokens in multiples of 128; it, the cache write,
        npu_dynamic_quant and npu_quant_matmul take float16 / bfloat16 only."""
        if not (128 <= block_size <= 512 and block_size % 128 == 0):
            return (f"--block-size {block_size}: torch_npu's paged attention takes blocks of 128-512 tokens in "
                    f"multiples of 128 for a prompt's tokens: use --block-size 128 (the NPU default)")
        for flag, value in (("--dtype", dtype), ("--kv-cache-dtype", kv_cache_dtype)):
            if value not in ("float16", "bfloat16") and (flag, value) != ("--kv-cache-dtype", "auto"):
                return (f"{flag} {value}: torch_npu's attention, KV-cache write and W8A8 ops take float16 or "
                        f"bfloat16 only: use {flag} bfloat16")
        return None


def _npu_layer_ops(query: KernelQuery):
    from tengyun.platforms.npu.kernels.layer_ops import NpuLayerOps

    return NpuLayerOps()


def _npu_gguf(query: KernelQuery):
    from tengyun.platforms.npu.kernels.gguf import npu_gguf_kernel

    return npu_gguf_kernel(query.scheme, torch_dtype(query.dtype))


def _npu_quant(query: KernelQuery):
    from tengyun.platforms.npu.kernels.quant import npu_quant_kernel

    return npu_quant_kernel(query.scheme)


def _npu_moe(query: KernelQuery):
    from tengyun.platforms.npu.kernels.moe import NpuMoe

    return NpuMoe()


def _is_gguf(query: KernelQuery) -> str | None:
    return None if query.scheme.kernel.startswith("gguf_") else "not a GGUF block type"


_NPU_CANDIDATES = {
    "attention": (KernelCandidate("npu", always, lambda q: "npu",
                                  describe=lambda q: "torch_npu's fused infer attention over the paged cache"),),
    "layer_ops": (KernelCandidate("npu_fused", always, _npu_layer_ops),),
    "moe": (KernelCandidate("npu_moe", always, _npu_moe,
                            describe=lambda q: "torch_npu's MoE routing and grouped matmul ops"),),
    "quant_linear": (KernelCandidate("npu_gguf", _is_gguf, _npu_gguf, nbytes=reference_quant_bytes),
                     KernelCandidate("npu_quant", always, _npu_quant, nbytes=reference_quant_bytes)),
}
