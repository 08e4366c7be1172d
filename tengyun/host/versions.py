"""Which torch / torch_npu / CANN / driver / firmware versions a host has, and whether they are a
combination documented to work (compat_table.json): read by `tengyun doctor` and by the NPU
platform at start-up (NpuPlatform.check_versions). Pure functions of HostFacts."""

from __future__ import annotations

from tengyun.host.compat import base_version, cann_matches, load_table, version_key
from tengyun.host.findings import Finding, Status, fail, ok, warn
from tengyun.host.probe import HostFacts
from tengyun.host.smi import NpuSmiInfo, parse_colon_table, parse_key_value_file, parse_npu_smi_info

SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def command_stdout(facts: HostFacts, command: str) -> str | None:
    out = facts.commands.get(command)
    return out.stdout if out is not None and out.returncode == 0 else None


def npu_smi(facts: HostFacts) -> NpuSmiInfo | None:
    text = command_stdout(facts, "npu-smi info")
    return parse_npu_smi_info(text) if text else None


def cann_version(facts: HostFacts) -> str | None:
    text = facts.files.get("cann")
    return parse_key_value_file(text).get("version") if text else None


def driver_version(facts: HostFacts) -> str | None:
    text = facts.files.get("driver")
    if text and parse_key_value_file(text).get("version"):
        return parse_key_value_file(text)["version"]
    info = npu_smi(facts)
    return info.version if info else None


def firmware_version(facts: HostFacts) -> str | None:
    text = facts.files.get("firmware")
    if text and parse_key_value_file(text).get("version"):
        return parse_key_value_file(text)["version"]
    board = command_stdout(facts, "npu-smi info -t board -i 0")
    return parse_colon_table(board).get("Firmware Version") if board else None


def check_torch_npu(facts: HostFacts) -> list[Finding]:
    """torch_npu is built for one torch version; and each (torch, CANN) pair has one documented
    torch_npu release (compat_table.json)."""
    probe, table = facts.torch_probe, load_table()
    torch_npu = probe.get("torch_npu") or facts.packages.get("torch_npu")
    torch = probe.get("torch") or facts.packages.get("torch")
    cann = cann_version(facts)
    if not torch_npu:
        pairs = table.rows_for(cann, torch) if cann and torch else []
        want = f"pip install torch-npu=={pairs[0].torch_npu}" if pairs else \
            "pip install the torch_npu release listed for your torch and CANN in compat_table.json"
        return [fail("torch_npu", "torch_npu is not installed on this Ascend host", want)]
    out = []
    if torch and base_version(torch_npu) != base_version(torch):
        matching = sorted({r.torch_npu for r in table.torch_npu if r.torch == base_version(torch)}, key=version_key)
        out.append(fail("torch_npu", f"torch_npu {torch_npu} is built for torch {base_version(torch_npu)} but torch "
                        f"{torch} is installed",
                        f"pip install torch=={base_version(torch_npu)}, or a torch_npu for torch "
                        f"{base_version(torch)}" + (f" ({', '.join(matching)})" if matching else ""),
                        known_bad=True))
    if probe.get("torch_npu_error"):
        out.append(fail("torch_npu", f"import torch_npu failed: {probe['torch_npu_error']}",
                        f"`source {SET_ENV}` and check the CANN finding"))
    if cann:
        rows = table.rows_for_torch_npu(torch_npu)
        if any(r.torch == base_version(torch_npu) and cann_matches(r.cann, cann) for r in rows):
            out.append(ok("torch_npu", f"torch_npu {torch_npu} with CANN {cann} (documented pair)"))
        elif rows:
            paired = ", ".join(sorted({r.cann for r in rows}))
            for_this = table.rows_for(cann, torch) if torch else []
            fix = f"install CANN {paired}"
            if for_this:
                fix += f", or torch_npu {for_this[0].torch_npu} for CANN {cann}"
            # A CANN older than every one this torch_npu is released for lacks the operators and ACL
            # interfaces it calls; a newer one is usually backward compatible (a warning only).
            older = all(version_key(cann) < _cann_key(r.cann) for r in rows)
            out.append(warn("torch_npu", f"torch_npu {torch_npu} is documented with CANN {paired}, "
                            f"not CANN {cann}" + (" (an older CANN)" if older else ""), fix, known_bad=older))
        else:
            out.append(warn("torch_npu", f"torch_npu {torch_npu} is not in the compatibility table",
                            "use a torch_npu release from the table (compat_table.json, sourced from "
                            "Ascend/pytorch's version table), or check Ascend's table for this build"))
    elif not any(f.status == Status.FAIL for f in out):
        out.append(ok("torch_npu", f"torch_npu {torch_npu}"))
    return out


def _cann_key(pattern: str) -> tuple:
    """A table row's CANN for ordering: '9.1.X' (any 9.1 release) sorts as its first, 9.1.0."""
    return version_key(pattern[:-2] + ".0" if pattern.upper().endswith(".X") else pattern)


def known_bad_versions(facts: HostFacts) -> list[Finding]:
    """The torch / torch_npu / CANN / driver findings that are documented not to work together."""
    return [f for f in check_torch_npu(facts) + check_driver(facts) if f.known_bad]


def check_driver(facts: HostFacts) -> list[Finding]:
    driver, firmware, cann = driver_version(facts), firmware_version(facts), cann_version(facts)
    if driver is None:
        return [fail("driver", "no NPU driver found (/usr/local/Ascend/driver/version.info, npu-smi)",
                     "install the Ascend HDK NPU driver and firmware, then reboot")]
    out = []
    hdk = load_table().hdk_for(cann) if cann else None
    if hdk and version_key(driver) < version_key(hdk.driver):
        out.append(warn("driver", f"NPU driver {driver} is older than Ascend HDK {hdk.driver}, which CANN {cann} "
                        f"is documented with", f"upgrade the NPU driver to >= {hdk.driver}", known_bad=True))
    else:
        out.append(ok("driver", f"NPU driver {driver}" + (f" (CANN {cann} is documented with >= {hdk.driver})"
                                                          if hdk else "")))
    board = command_stdout(facts, "npu-smi info -t board -i 0")
    compat = parse_colon_table(board).get("Compatibility") if board else None
    if compat and compat.upper() != "OK":
        out.append(fail("firmware", f"npu-smi reports driver/firmware Compatibility: {compat}",
                        "install the firmware package of the same Ascend HDK release as the driver, then reboot"))
    elif firmware and hdk and hdk.firmware and version_key(firmware) < version_key(hdk.firmware):
        out.append(warn("firmware", f"NPU firmware {firmware} is older than {hdk.firmware} (Ascend HDK "
                        f"{hdk.driver}, documented with CANN {cann})",
                        f"upgrade the NPU firmware to >= {hdk.firmware}"))
    elif firmware:
        out.append(ok("firmware", f"NPU firmware {firmware}" + (f", Compatibility {compat}" if compat else "")))
    return out
