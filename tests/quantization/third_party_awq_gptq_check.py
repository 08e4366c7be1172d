"""Recorded check (not collected by pytest): the AWQ and GPTQ layouts written by
awq_gptq_layouts.py, and Tengyun's reading of them, agree with dequantizers nobody here wrote:
AutoAWQ 0.2.9's awq/utils/packing_utils.py (dequantize_gemm) and GPTQModel 7.7.0's
gptqmodel/utils/model_dequant.py (convert_gptq_file, which reads a safetensors file as a
checkpoint holds it). Neither installs here without its GPU kernels, so their sources are loaded
from the sdists, the few imports they do not need stubbed:

    pip download --no-deps autoawq==0.2.9 gptqmodel==7.7.0 -d /tmp/refs
    cd /tmp/refs && tar xzf autoawq-0.2.9.tar.gz && tar xzf gptqmodel-7.7.0.tar.gz && cd -
    PYTHONPATH=$PWD python tests/quantization/third_party_awq_gptq_check.py /tmp/refs

Run 2026-12-01: every line "equal" (results in docs/quantization.md).
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from awq_gptq_layouts import Format, quantize_layer  # noqa: E402

from tengyun.layers.quant_kernels import dequantize_unpacked, unpacked_weight  # noqa: E402
from tengyun.quantization import awq, gptq  # noqa: E402


def load_references(root: Path):
    sys.modules["pcre"] = re  # GPTQModel's regex package: only its module filters use it
    gptqmodel = root / "gptqmodel-7.7.0" / "gptqmodel"
    for package, sub in (("gptqmodel", ""), ("gptqmodel.quantization", "quantization"), ("gptqmodel.utils", "utils")):
        module = types.ModuleType(package)
        module.__path__ = [str(gptqmodel / sub)]
        sys.modules[package] = module
    logger = types.ModuleType("gptqmodel.utils.logger")
    logger.setup_logger = lambda *a, **k: logging.getLogger("gptqmodel")
    dtype = types.ModuleType("gptqmodel.quantization.dtype")  # float8 / float4 helpers, unused for GPTQ
    for name in ("available_float4_packed_dtypes", "available_float8_dtype_names", "available_float8_dtypes",
                 "decode_e8m0_scale", "dequantize_f4_e2m1", "dequantize_fp8", "quark_floatx_formats"):
        setattr(dtype, name, lambda *a, **k: ())
    sys.modules.update({"gptqmodel.utils.logger": logger, "gptqmodel.quantization.dtype": dtype})
    model_dequant = importlib.import_module("gptqmodel.utils.model_dequant")
    sys.path.insert(0, str(root / "autoawq-0.2.9" / "awq" / "utils"))
    return model_dequant, importlib.import_module("packing_utils")


def tengyun_dense(fmt: Format, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    scheme = (awq if fmt.method == "awq" else gptq).from_config(fmt.quantization_config()).groups[0].scheme
    kept = {t.name: tensors[t.name].float() if t.dtype == "act" else tensors[t.name] for t in scheme.tensors if t.kept}
    return dequantize_unpacked(unpacked_weight(kept, scheme), torch.float32)


def main(root: Path) -> None:
    model_dequant, awq_packing = load_references(root)
    formats = [Format("awq", group=g) for g in (32, 64, 128)] + [
        Format("gptq", bits=b, sym=s, desc_act=d, checkpoint_format=f)
        for b in (4, 8) for s in (True, False) for d in (True, False) for f in ("gptq", "gptq_v2")]
    for fmt in formats:
        stored, dense = quantize_layer(fmt, "m.q_proj", 48, 256, np.random.default_rng(1))
        tensors = {k.removeprefix("m.q_proj."): v for k, v in stored.items()}
        if fmt.method == "awq":
            theirs = awq_packing.dequantize_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(),
                                                 4, fmt.group).t()
        else:
            with tempfile.TemporaryDirectory() as folder:
                save_file(stored, f"{folder}/m.safetensors")
                config = fmt.quantization_config()
                theirs = model_dequant.convert_gptq_file(Path(f"{folder}/m.safetensors"), torch.float32, config,
                                                         "cpu")["m.q_proj.weight"]
        ours = tengyun_dense(fmt, tensors)
        verdict = "equal" if torch.equal(theirs.float(), dense) and torch.equal(ours, dense) else "DIFFERENT"
        print(f"{fmt}: written {verdict} to the reference's dequantization and to Tengyun's")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
