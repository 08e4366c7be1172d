"""load_weights on a tiny fake model: packed qkv / gate_up, shards, tied head, dummy weights."""

import json
import logging

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tengyun.layers.weight_loading import check_shape
from tengyun.models.loader import load_weights

H, Q, KV, I, V = 8, 8, 4, 12, 16  # hidden, q out, k/v out, intermediate, vocab  # noqa: E741 (I as the papers write it)


def packed_loader(offsets: dict):
    """weight_loader placing shard `shard_id` at rows offsets[shard_id] = (start, size)."""

    def load(param, tensor, shard_id):
        start, size = offsets[shard_id]
        part = param.data.narrow(0, start, size)
        check_shape(part, tensor)
        part.copy_(tensor)

    return load


class FakeModel(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, tie: bool = False, dtype=torch.float32):
        super().__init__()
        self.tie_word_embeddings = tie
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        layer = nn.Module()
        layer.input_layernorm = nn.Module()
        layer.input_layernorm.weight = nn.Parameter(torch.empty(H))
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = nn.Linear(H, Q + 2 * KV, bias=True)
        layer.self_attn.o_proj = nn.Linear(Q, H, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = nn.Linear(H, 2 * I, bias=False)
        layer.mlp.down_proj = nn.Linear(I, H, bias=False)
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.empty(H))
        self.lm_head = nn.Linear(H, V, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        qkv = packed_loader({"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)})
        layer.self_attn.qkv_proj.weight.weight_loader = qkv
        layer.self_attn.qkv_proj.bias.weight_loader = qkv
        layer.mlp.gate_up_proj.weight.weight_loader = packed_loader({0: (0, I), 1: (I, I)})
        self.to(dtype)


def hf_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.self_attn.q_proj.weight": (Q, H),
        "model.layers.0.self_attn.k_proj.weight": (KV, H),
        "model.layers.0.self_attn.v_proj.weight": (KV, H),
        "model.layers.0.self_attn.q_proj.bias": (Q,),
        "model.layers.0.self_attn.k_proj.bias": (KV,),
        "model.layers.0.self_attn.v_proj.bias": (KV,),
        "model.layers.0.self_attn.o_proj.weight": (H, Q),
        "model.layers.0.mlp.gate_proj.weight": (I, H),
        "model.layers.0.mlp.up_proj.weight": (I, H),
        "model.layers.0.mlp.down_proj.weight": (H, I),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_packed_shards_and_plain_tensors_land_in_their_parameters(tmp_path):
    sd = hf_state_dict()
    save_file({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, tmp_path / "model.safetensors")
    model = FakeModel(dtype=torch.bfloat16)
    load_weights(model, tmp_path, "safetensors")

    p = dict(model.named_parameters())
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    expected_qkv = torch.cat([sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"]])
    expected_qkv_bias = torch.cat([sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"]])
    expected_gate_up = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
    assert p[attn + "qkv_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(p[attn + "qkv_proj.weight"], expected_qkv.bfloat16())
    assert torch.equal(p[attn + "qkv_proj.bias"], expected_qkv_bias.bfloat16())
    assert torch.equal(p[mlp + "gate_up_proj.weight"], expected_gate_up.bfloat16())
    for name in ["model.embed_tokens.weight", attn + "o_proj.weight", "model.norm.weight", "lm_head.weight"]:
        assert torch.equal(p[name], sd[name].bfloat16()), name


def write_sharded(folder, sd, shard_names=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
    names = sorted(sd)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for shard, part in zip(shard_names, halves):
        save_file({n: sd[n] for n in part}, folder / shard)
        weight_map |= {n: shard for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads_every_shard_in_the_index(tmp_path, caplog):
    sd = hf_state_dict()
    write_sharded(tmp_path, sd)
    model = FakeModel()
    with caplog.at_level(logging.INFO, logger="tengyun.models.loader"):
        load_weights(model, tmp_path, "safetensors")
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    assert torch.equal(model.model.norm.weight, sd["model.norm.weight"])
    assert "loaded 14 tensors from 2 file(s)" in caplog.text


def test_index_naming_a_missing_shard_raises_naming_the_shard_and_index(tmp_path):
    write_sharded(tmp_path, hf_state_dict())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors.*model\.safetensors\.index\.json"):
        load_weights(FakeModel(), tmp_path, "safetensors")


@pytest.mark.parametrize(
    "name, bad_shape, param",
    [
        ("model.layers.0.self_attn.k_proj.weight", (KV + 1, H), "qkv_proj.weight (shard k)"),
        ("model.layers.0.self_attn.o_proj.weight", (H, Q + 2), "o_proj.weight"),
    ],
)
def test_shape_mismatch_names_tensor_file_and_both_shapes(tmp_path, name, bad_shape, param):
    sd = hf_state_dict()
    sd[name] = torch.zeros(bad_shape)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as err:
        load_weights(FakeModel(), tmp_path, "safetensors")
    msg = str(err.value)
    expected = list(hf_state_dict()[name].shape)
    assert name in msg and "model.safetensors" in msg and param in msg
    assert f"shape {list(bad_shape)}" in msg and f"expects {expected}" in msg
    assert "config.json disagrees with the checkpoint" in msg


def test_checkpoint_tensor_without_a_parameter_is_named(tmp_path):
    sd = hf_state_dict() | {"model.layers.1.mlp.down_proj.weight": torch.zeros(H, I)}
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 checkpoint tensor\(s\).*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_weights(FakeModel(), tmp_path, "safetensors")


@pytest.mark.parametrize(
    "dropped, reported",
    [
        ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight (shard v)"),
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight (shard 1)"),
        ("model.norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_parameter_without_a_checkpoint_tensor_is_named(tmp_path, dropped, reported):
    sd = hf_state_dict()
    del sd[dropped]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 model parameter\(s\) have no tensor") as err:
        load_weights(FakeModel(), tmp_path, "safetensors")
    assert reported in str(err.value)


@pytest.mark.parametrize("head_in_checkpoint", [True, False])
def test_tied_lm_head_is_skipped_and_shares_the_embedding(tmp_path, head_in_checkpoint):
    sd = hf_state_dict()
    if not head_in_checkpoint:
        del sd["lm_head.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    model = FakeModel(tie=True)
    load_weights(model, tmp_path, "safetensors")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])


def test_tied_head_detected_by_identity_without_the_attribute(tmp_path):
    sd = hf_state_dict()
    save_file(sd, tmp_path / "model.safetensors")
    model = FakeModel(tie=True)
    model.tie_word_embeddings = False
    load_weights(model, tmp_path, "safetensors")
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])


def test_folder_without_safetensors_suggests_dummy(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors in .*--load-format dummy"):
        load_weights(FakeModel(), tmp_path, "safetensors")


def test_unknown_load_format_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--load-format 'pt'"):
        load_weights(FakeModel(), tmp_path, "pt")


def test_dummy_weights_are_deterministic_per_seed(tmp_path):
    a, b, c = FakeModel(), FakeModel(), FakeModel()
    load_weights(a, tmp_path, "dummy", seed=7)
    load_weights(b, tmp_path, "dummy", seed=7)
    load_weights(c, tmp_path, "dummy", seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        elif name.endswith(".bias"):
            assert torch.equal(pa, torch.zeros_like(pa))
        else:
            assert not torch.equal(pa, pc), name
            assert 0.005 < pa.std().item() < 0.05, name
