"""Shared fixtures: a tiny byte-level BPE tokenizer and tiny random-weight HF checkpoints."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import textwrap
from pathlib import Path

import pytest

# An engine a test builds without --kv-cache-memory gets 256 MiB of KV cache instead of the 4 GiB
# default: allocating and zeroing 4 GiB per engine, beside the test process's other engines, cost
# six such files 36.5 s where 256 MiB costs 16.7 (2026-12-06, AMD VM); no such test needs more. The
# real-model and server tests name their own size; test_config checks the default without it.
os.environ.setdefault("TENGYUN_CPU_KVCACHE_SPACE", "0.25")

TINY_VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "人工智能正在改变世界。北京是中国的首都。",
    "Hello world! 😀 Emoji and 中文 mixed text.",
] * 20

ARCH_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False, head_dim=32),
    # 8 experts, top-2, renormalised; layer 1 stays dense (mlp_only_layers).
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
}


# Qwen3.5: 4 layers (3 Gated DeltaNet, 1 gated attention), 2 key / 4 value linear heads.
QWEN3_5_TEXT = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                    initializer_range=0.1, bos_token_id=0, eos_token_id=0)
# Qwen3.5-MoE adds 8 experts, top-2, and a shared expert on every layer.
QWEN3_5_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Qwen3-Next: Qwen3.5-MoE's sizes, every 2nd layer full attention, layer 0 dense.
QWEN3_NEXT = dict(QWEN3_5_TEXT, **QWEN3_5_MOE, mlp_only_layers=[0], decoder_sparse_step=1, full_attention_interval=2)


def make_tiny_qwen3_5(arch: str = "qwen3_5", seed: int = 0, **overrides):
    """A tiny random HF Qwen3.5 (arch "qwen3_5") or Qwen3.5-MoE ("qwen3_5_moe") text model, fp32, eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{**QWEN3_5_TEXT, **overrides}))
    else:
        config = transformers.Qwen3_5MoeTextConfig(**{**QWEN3_5_TEXT, **QWEN3_5_MOE, **overrides})
        model = transformers.Qwen3_5MoeForCausalLM(config)
    return randomize_norms_and_routers(model).eval()


def randomize_norms_and_routers(model):
    """Norms start at 0 (zero-centred) or 1 and routers near 0: give them values so a wrong
    formula shows."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    tokenizer.save_pretrained(folder)
    assert len(tokenizer) <= TINY_VOCAB
    return folder


def make_tiny_checkpoint(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random HF model of ``arch`` (fp32, safetensors) with the tiny tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=0, eos_token_id=0,
    )
    fields.update(ARCH_CONFIGS[arch])
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # give the qkv bias non-zero values so a missing bias shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.3)
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    return {
        arch: make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), tiny_tokenizer_dir, arch)
        for arch in ARCH_CONFIGS
    }


@pytest.fixture(scope="session")
def tiny_hybrid_checkpoints(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    """Saved tiny Qwen3.5 and Qwen3.5-MoE checkpoints with the tiny tokenizer."""
    import shutil

    folders = {}
    for arch in ("qwen3_5", "qwen3_5_moe"):
        folders[arch] = tmp_path_factory.mktemp(f"tiny_{arch}")
        make_tiny_qwen3_5(arch).save_pretrained(folders[arch])
        for f in tiny_tokenizer_dir.iterdir():
            shutil.copy(f, folders[arch] / f.name)
    return folders


def free_port_pair() -> int:
    """A port p with p + 1 free too: --master-port and the node link (--master-port + 1), below
    the kernel's ephemeral range, so no outgoing connection (the TCP store's clients, HTTP) takes
    p + 1 between this check and the server binding it (seen: a full-suite run lost it so)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").is_file() else 32768
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def plan_and_worker(folder, dtype: str):
    """`tengyun plan` of ``folder`` for this CPU, with the engine's own sizes and KV budget, beside
    the engine's Worker on it (2 MiB of KV cache, 128 tokens, 4 sequences, blocks of 16): what tests
    comparing the plan with the runtime build. -> (plan, its QuantConfig, worker)."""
    from tengyun.config import EngineConfig
    from tengyun.model_spec import ModelSpec
    from tengyun.sizing.checkpoint import read_model, read_quantization
    from tengyun.sizing.plan import make_plan
    from tengyun.sizing.resolve import resolve_sizing
    from tengyun.worker.worker import Worker

    flags = dict(dtype=dtype, kv_cache_memory="2MiB", max_model_len=128, max_num_seqs=4, block_size=16)
    worker = Worker(EngineConfig(str(folder), **flags).finalize())
    hf_config, checkpoint_bytes, name = read_model(folder)
    quant = read_quantization(folder, hf_config)
    sizing = resolve_sizing(EngineConfig(str(folder), **flags), ModelSpec.from_hf_config(hf_config), "cpu", folder)
    plan = make_plan(hf_config, sizing, None, checkpoint_bytes, name, quant)
    return plan, quant, worker


# The fast tier: `make test-fast` runs `pytest -m "not heavy"`, the tests that need no server, no
# other process and no real model. A test is heavy when the code it runs from tests/ (its body, the
# fixtures it uses, and the functions, classes and helper modules under tests/ they name, followed
# recursively) names one of HEAVY_NAMES or builds an engine (ENGINE_NAMES) of more than one rank
# (tensor_parallel_size / pipeline_parallel_size > 1: worker processes), when it is marked slow (a
# real model), or when its node id starts with one of HEAVY_TESTS (what its code does not show).
# tengyun's own code is not read: an LLM over a tiny checkpoint in this process stays fast.
HEAVY_NAMES = {
    "subprocess": "starts a process", "Popen": "starts a process", "multiprocessing": "starts a process",
    "run_child_probe": "starts a process", "init_process_group": "joins torch.distributed",
    "EngineProcessClient": "starts the engine process", "uvicorn": "serves HTTP",
    # Named where a test imports it inside its body, which the scan does not follow.
    "RemoteServer": "starts the server",
    "smollm2_gguf": "loads a real model", "qwen_coder_gguf": "loads a real model",
}
PARALLEL_KEYWORDS = ("tensor_parallel_size", "pipeline_parallel_size")
ENGINE_NAMES = {"LLM", "LLMEngine", "AsyncLLMEngine"}  # what starts the ranks (EngineConfig alone does not)
HEAVY_TESTS = {
    "tests/platforms/test_startup.py::test_auto_logs_why_it_passed_over_an_installed_but_broken_torch_npu":
        "probes the stub torch_npu in a child process (platforms/startup.py)",
}


class _Uses:
    """What a test's code names: identifiers (globals, attributes) and the parallel sizes it passes,
    as a constant or as the name of a parameter or a module-level dict."""

    def __init__(self):
        self.names: set[str] = set()
        self.parallel: list[object] = []  # an int, or the name a size is read from
        self.seen: set = set()

    def add(self, func) -> None:
        func = inspect.unwrap(func)
        code = getattr(func, "__code__", None)
        if code is None or code in self.seen or not code.co_filename.startswith(_TESTS_DIR):
            return
        self.seen.add(code)
        names, parallel = _read_code(func)
        self.names |= names
        self.parallel += parallel
        for name in names:
            self.follow(func.__globals__.get(name), names)

    def follow(self, obj, names: frozenset[str]) -> None:
        """Into a function or class defined under tests/, or a helper module's attributes among ``names``;
        a module-level dict's parallel sizes."""
        if inspect.ismodule(obj):
            if str(getattr(obj, "__file__", "")).startswith(_TESTS_DIR):
                for name in names:
                    self.follow(getattr(obj, name, None), frozenset())
        elif isinstance(obj, dict):
            self.parallel += [obj[k] for k in PARALLEL_KEYWORDS if k in obj]
        elif inspect.isclass(obj):
            if str(getattr(inspect.getmodule(obj), "__file__", "")).startswith(_TESTS_DIR):
                for member in vars(obj).values():
                    if inspect.isfunction(member):
                        self.add(member)
        elif callable(obj):
            self.add(obj)


_TESTS_DIR = str(Path(__file__).parent)


@functools.lru_cache(maxsize=None)
def _read_code(func) -> tuple[frozenset[str], tuple]:
    """A function's source -> (the names and attributes it reads, the parallel sizes it passes:
    an int, the name it reads one from, or "?"). Cached per function: fixtures and helpers recur."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(), ()
    names, parallel = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg in PARALLEL_KEYWORDS:
            value = node.value
            parallel.append(value.value if isinstance(value, ast.Constant) else
                            value.id if isinstance(value, ast.Name) else "?")
    return frozenset(names), tuple(parallel)


def _more_than_one_rank(sizes: list[object], params: dict) -> bool:
    """Whether a parallel size is over 1; a size read from a name that is not a parameter counts."""
    for size in sizes:
        size = params.get(size, size) if isinstance(size, str) else size
        if not isinstance(size, int) or size > 1:
            return True
    return any(isinstance(v, dict) and _more_than_one_rank([v[k] for k in PARALLEL_KEYWORDS if k in v], {})
               for v in params.values())


def heavy_reason(item) -> str | None:
    """Why ``item`` is left out of the fast tier, or None."""
    if item.get_closest_marker("slow"):
        return "marked slow (a real model)"
    for prefix, why in HEAVY_TESTS.items():
        if item.nodeid.startswith(prefix):
            return why
    uses = _Uses()
    if getattr(item, "function", None) is not None:
        uses.add(item.function)
    fixtures = getattr(item, "_fixtureinfo", None)
    for defs in (fixtures.name2fixturedefs.values() if fixtures else ()):
        for fixture in defs:
            uses.add(fixture.func)
    named = sorted(uses.names & HEAVY_NAMES.keys())
    if named:
        return f"{HEAVY_NAMES[named[0]]} ({named[0]})"
    callspec = getattr(item, "callspec", None)
    if uses.names & ENGINE_NAMES and _more_than_one_rank(uses.parallel, callspec.params if callspec else {}):
        return "starts worker processes (more than one rank)"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = heavy_reason(item)
        if reason:
            item.add_marker(pytest.mark.heavy(reason=reason))
