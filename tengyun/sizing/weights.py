"""Weight bytes of one pipeline stage on one TP rank, in the dtype they are served in: dense
parameters (model_size) x the served dtype's bytes, quantised layers as the platform's kernels
hold them (packed weights, scales, zeros), an embedding / LM head stored quantised as
tengyun/layers/embed_head.py holds it."""

from __future__ import annotations

from tengyun.dtypes import DTYPE_BYTES
from tengyun.model_spec import ModelSpec
from tengyun.quantization.config import QuantConfig
from tengyun.sizing import platform_facts
from tengyun.sizing.model_size import StageParams, decoder_linears
from tengyun.sizing.resolve import ResolvedSizing

GiB = 2**30
DENSE_WIDTHS = (2, 4)  # bytes per parameter of a dense 16- or 32-bit checkpoint


def stage_weight_bytes(spec: ModelSpec, sizing: ResolvedSizing, params: StageParams, scale: float,
                       quant: QuantConfig | None) -> int:
    """``params`` in sizing.dtype, x ``scale`` (weight_scale), with ``quant``'s layers as held."""
    weights = int(params.total * DTYPE_BYTES[sizing.dtype] * scale)
    if quant:
        start, end = params.layers
        weights = _quantized_weight_bytes(spec, sizing, start, end, weights, quant)
        weights += _vocab_bytes_change(spec, sizing, params, quant)
    return weights


def weight_scale(spec: ModelSpec, params: int, dtype: str, checkpoint_bytes: int | None,
                 device: str) -> tuple[float, list[str]]:
    """(checkpoint bytes / config estimate, notes): weights follow the checkpoint's own size only
    when it is not a dense checkpoint of ``params``, i.e. differs by more than 2 % from ``params``
    in config.json's dtype and in 16 and 32 bits (quantized weights the scheme does not say, extra
    tensors). A dense checkpoint is loaded into ``dtype`` whatever it is stored in: SmolLM2's GGUF
    conversion, float32 on disk with no dtype in config.json, served in bfloat16, is 134.5 M
    params x 2 B, not its 538 MB on disk. Nor is an FP8 block-quantized one dequantized at load."""
    if spec.fp8_block and not platform_facts.fp8_matmul(device):
        held = (f"it holds {checkpoint_bytes / GiB:.2f} GiB as stored (FP8 weights, their scales and the "
                f"unquantized tensors); " if checkpoint_bytes else "")
        return 1.0, [f"FP8 block-quantized checkpoint (weight_block_size {list(spec.fp8_block)}): {held}{device} has "
                     f"no FP8 matmul, so the engine dequantizes it at load and its weights count in {dtype}: "
                     f"{params * DTYPE_BYTES[dtype] / GiB:.2f} GiB."]
    notes: list[str] = []
    scale = 1.0
    stored = spec.checkpoint_dtype if spec.checkpoint_dtype in DTYPE_BYTES else dtype
    estimate = params * DTYPE_BYTES[stored]
    dense = any(abs(checkpoint_bytes / (params * width) - 1) <= 0.02
                for width in {DTYPE_BYTES[stored], *DENSE_WIDTHS}) if checkpoint_bytes else True
    if not dense:
        scale = checkpoint_bytes / estimate
        notes.append(f"The checkpoint holds {checkpoint_bytes / GiB:.2f} GiB but config.json's decoder is "
                     f"{estimate / GiB:.2f} GiB in {stored} (quantized weights, or tensors the decoder does not "
                     f"have): weights per card scaled by {scale:.3f}.")
    if spec.quantization and not checkpoint_bytes:
        notes.append(f"config.json has a quantization_config but no checkpoint files are here: weights are "
                     f"counted as {dtype}; plan the folder with its *.safetensors (or index) for real sizes.")
    return scale, notes


def _quantized_weight_bytes(spec: ModelSpec, sizing: ResolvedSizing, start: int, end: int, dense_bytes: int,
                            quant: QuantConfig) -> int:
    """``dense_bytes`` with every quantised linear layer of layers [start, end) counted as the
    platform's kernel holds it instead of as a dense weight."""
    device, dtype = sizing.device, sizing.dtype
    for layer in range(start, end):
        for linear in decoder_linears(spec, sizing.tp, layer, sizing.expert_ranks):
            schemes = [quant.scheme_for(part) for part in linear.parts]
            # one layer in one scheme, or (a GGUF's mixed q/k/v) each part as its own shard
            held = (list(zip(schemes, linear.part_outs)) if quant.mixed_shards and linear.part_outs
                    and len(set(schemes)) > 1 else [(next((s for s in schemes if s), None), linear.out)])
            for scheme, out in held:
                if scheme is not None:
                    dense_bytes += linear.count * (
                        platform_facts.quantized_weight_bytes(device, scheme, out, linear.in_, dtype, linear.in_total)
                        - out * linear.in_ * DTYPE_BYTES[dtype])
    return dense_bytes


def _vocab_bytes_change(spec: ModelSpec, sizing: ResolvedSizing, params: StageParams, quant: QuantConfig) -> int:
    """How a stage's bytes change where the checkpoint stores the embedding / LM head quantised
    (QuantConfig.vocab_layers: a GGUF; an untied head compressed-tensors targets by name), held as
    tengyun/layers/embed_head.py holds them: the head through the platform's kernel
    (Platform.quantized_head) or dense; the embedding as its blocks, as nothing when a tied head's
    kernel serves its rows, or dense with a dense tied head."""
    if not (quant.vocab_layers or quant.named_head):
        return 0
    device, dtype, width = sizing.device, sizing.dtype, DTYPE_BYTES[sizing.dtype]
    rows, hidden, tied = -(-spec.vocab_size // sizing.tp), spec.hidden_size, spec.tie_word_embeddings
    embed_scheme = quant.scheme_for("model.embed_tokens") if quant.vocab_layers else None
    head_scheme = embed_scheme if tied else quant.head_scheme("lm_head")
    head = platform_facts.quantized_head(device, head_scheme, dtype) if head_scheme else None
    change = 0
    if params.lm_head or (tied and params.stage == sizing.pp - 1):  # this stage holds the head
        if head is not None:
            change += platform_facts.quantized_weight_bytes(device, head_scheme, rows, hidden, dtype) \
                - params.lm_head * width
    if params.embedding and embed_scheme is not None:
        with_head = tied and sizing.pp == 1
        if with_head and head == "rows":
            change -= params.embedding * width
        elif not with_head or head is not None:  # with a dense tied head it turns dense too
            own = platform_facts.quantized_head(device, embed_scheme, dtype) == "rows"  # rows from the kernel's layout
            held = (platform_facts.quantized_weight_bytes(device, embed_scheme, rows, hidden, dtype) if own
                    else embed_scheme.nbytes(rows, hidden, width))
            change += held - params.embedding * width
    return change
