"""The tensors one quantised linear layer holds, described by their shape in the layer's output
and input features, so one description sizes, splits and counts them everywhere.

    compressed-tensors W4A16, group 128, a layer of 1536 outputs x 576 inputs:
        weight_packed int32 [out, in / 8]    dims ((OUT, 1), (IN, 8))   -> [1536, 72]
        weight_scale  act   [out, in / 128]  dims ((OUT, 1), (IN, 128)) -> needs 576 % 128 == 0
        weight_shape  int64 [2]              dims (2,), not kept        -> checked, then dropped

Tensor parallelism: a column-parallel layer splits every tensor along its OUT dim, a row-parallel
one along its IN dim (``split_in``), in whole elements, so a packed int32 or a scale group never
straddles two ranks. "act" is the model's --dtype: scales are held in it whatever the checkpoint
stored them in.
"""

from __future__ import annotations

from dataclasses import dataclass

OUT, IN = "out", "in"
ACT = "act"  # the model's --dtype
DTYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "int64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

Dim = "tuple[str, int] | int"  # (OUT or IN, features per element) or a fixed length


@dataclass(frozen=True)
class TensorLayout:
    name: str  # the checkpoint suffix: <module>.weight_packed
    dtype: str  # a DTYPE_BYTES key, or ACT
    dims: tuple  # of Dim
    split_in: bool = True  # row-parallel ranks split its IN dim (False: each holds all of it)
    kept: bool = True  # False: checked when loaded, then dropped (never counted as weights)

    def axis(self, feature: str) -> tuple[int, int] | None:
        """(dim index, features per element) of OUT or IN; None when no dim runs over it."""
        for i, d in enumerate(self.dims):
            if isinstance(d, tuple) and d[0] == feature:
                return i, d[1]
        return None

    def shape(self, out: int, in_: int) -> tuple[int, ...]:
        """Shape for ``out`` x ``in_`` features (both divisible by the per-element counts)."""
        return tuple(d if isinstance(d, int) else (out if d[0] == OUT else in_) // d[1] for d in self.dims)

    def nbytes(self, out: int, in_: int, act_bytes: int) -> int:
        n = 1
        for length in self.shape(out, in_):
            n *= length
        return n * (act_bytes if self.dtype == ACT else DTYPE_BYTES[self.dtype])


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer is quantised and which kernel runs it (Platform.quant_linear_kernel)."""

    kernel: str  # "w8a8_int8": int8 weights and dynamic per-token int8 activations; "wna16_int": weight-only
    tensors: tuple[TensorLayout, ...]
    weight_bits: int
    group_size: int | None  # input features per weight scale; None: one scale per output channel
    symmetric: bool
    description: str  # for messages: "compressed-tensors W4A16 (int4, group 128, symmetric)"
    # How the weight-only tensors are packed, which unpacker reads them
    # (tengyun/layers/quant_kernels.py unpacked_weight): "compressed-tensors", "awq", "gptq", "gptq_v2"
    packing: str = "compressed-tensors"

    @property
    def quantises_activations(self) -> bool:
        """W8A8: the layer's inputs are quantised too, so a dense copy of its weight would compute
        other values."""
        return self.kernel in ("w8a8_int8", "w8a8_static_int8")

    def tensor(self, name: str) -> TensorLayout:
        return next(t for t in self.tensors if t.name == name)

    @property
    def act_order(self) -> bool:
        """GPTQ desc_act: inputs belong to groups through a kept g_idx [in], in any order."""
        return any(t.name == "g_idx" and t.kept for t in self.tensors)

    def shape_problem(self, out: int, in_: int) -> str | None:
        """Why a layer (or one rank's part of it) of ``out`` x ``in_`` features cannot hold this
        scheme (a packed element or a group would be cut), or None."""
        for t in self.tensors:
            for feature, size in ((OUT, out), (IN, in_)):
                axis = t.axis(feature)
                if axis and size % axis[1]:
                    what = "group size" if self.group_size == axis[1] else f"{axis[1]} values per {t.dtype}"
                    return (f"{t.name} needs the {feature}put features ({size}) to be a multiple of {axis[1]} "
                            f"({what})")
        return None

    def nbytes(self, out: int, in_: int, act_bytes: int, in_total: int | None = None) -> int:
        """Bytes one rank holds for ``out`` x ``in_`` features; ``in_total``: the unsplit input
        features, for tensors every row-parallel rank holds whole."""
        return sum(t.nbytes(out, in_ if t.split_in else (in_total or in_), act_bytes)
                   for t in self.tensors if t.kept)


DENSE_WEIGHT = TensorLayout("weight", ACT, ((OUT, 1), (IN, 1)))
BIAS = TensorLayout("bias", ACT, ((OUT, 1),))
