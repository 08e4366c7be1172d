"""EngineConfig: every engine setting, under vLLM's names, validated and frozen by finalize()."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tengyun.model_spec import DTYPE_ALIASES, ModelSpec, canonical_dtype
from tengyun.pooling_config import (
    CONVERTS, RUNNERS, PoolerConfig, PoolingModel, apply_hf_overrides, parse_hf_overrides, resolve_pooling_model,
    resolve_runner,
)
from tengyun.lora.settings import LORA_DTYPES, check_lora_model, check_lora_values
from tengyun.parallel_checks import SUPPORTED_EXECUTOR_BACKENDS, check_parallel_values
from tengyun.sizing.data_parallel import serving_problem as data_parallel_serving_problem
from tengyun.sizing.resolve import DEFAULT_MAX_NUM_BATCHED_TOKENS, ResolvedSizing, resolve_sizing
from tengyun.spec_decode.config import SpeculativeConfig
from tengyun.quantization.config import QUANT_METHODS, QuantConfig, detect_quantization

SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16")
SUPPORTED_KV_DTYPES = ("auto", "float32", "float16", "bfloat16")
SUPPORTED_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SUPPORTED_DEVICES = ("auto", "cpu", "cuda", "npu")

logger = logging.getLogger(__name__)

KVCACHE_SPACE_ENV = "TENGYUN_CPU_KVCACHE_SPACE"  # GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE
DEFAULT_CPU_KVCACHE_GIB = 4

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "t": 1e12, "tb": 1e12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
               "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(value: int | str, name: str) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name} must be a byte count such as 4GiB or 512MiB, got {value!r}.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


PARALLELISM = "parallelism (docs/parallelism.md)"  # the --help group of the parallel settings


def setting(default: Any, help: str | Callable[[], str], *, choices: tuple[str, ...] | None = None,
            aliases: tuple[str, ...] = (), group: str | None = None) -> Any:
    """A user-facing EngineConfig field and how its flag reads; the flag itself (--field-name,
    its type and default) is generated from the field by tengyun/entrypoints/cli/engine_args.py.
    help: text, or a function that builds it when the flags are made; aliases: extra spellings
    such as "-tp"; group: the --help section."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "group": group})


def block_size_help() -> str:
    """--block-size's help, with each platform's default_block_size (a CUDA-style property is
    described by its docstring's first sentence, read without importing torch)."""
    from tengyun.platforms import platform_class

    defaults = []
    for device in (d for d in SUPPORTED_DEVICES if d != "auto"):
        default = platform_class(device).default_block_size
        if isinstance(default, property):
            default = " ".join((default.__doc__ or "").split()).split(". ")[0].rstrip(".")
        defaults.append(f"{device} {default}")
    return f"tokens per KV block (default: the platform's: {'; '.join(defaults)})"


@dataclass
class EngineConfig:
    model: str | None = setting(
        None, help="HF folder, .gguf file, or one of the embedded models (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = setting(None, help="folder of the tokenizer files (default: the model's)")
    dtype: str = setting("auto", choices=SUPPORTED_DTYPES + tuple(DTYPE_ALIASES),
                         help="weight and activation dtype (auto: on CPU bfloat16 where the cores have native bf16 "
                              "(float32 checkpoints downcast, as vLLM), else float32; on CUDA and NPU the "
                              "checkpoint's 16-bit dtype, bfloat16 for a float32 one); half/fp16, bf16 and float/fp32 "
                              "are aliases")
    kv_cache_dtype: str = setting("auto", choices=SUPPORTED_KV_DTYPES,
                                  help="KV-cache dtype (auto: the same as --dtype)")
    block_size: int | None = setting(None, help=block_size_help)
    max_model_len: int | None = setting(
        None, help="context length in tokens, prompt plus output (default: from the model's config.json)")
    max_num_seqs: int = setting(256, help="most sequences one scheduler step runs")
    max_num_batched_tokens: int | None = setting(
        None, help="most tokens one scheduler step runs (default: 2048; 512 for `tengyun serve` on CPU; at least "
                   "--max-num-seqs, and without chunked prefill at least --max-model-len)")
    stream_interval: int = setting(
        1, help="a running request's outputs (a stream's chunks) carry at least this many new tokens each; "
                "the first and the last go out at once (vLLM's --stream-interval: more tokens a chunk, less "
                "work for the API process and the client under load)")
    enable_prefix_caching: bool = setting(
        True, help="reuse the KV blocks of a prompt prefix an earlier request computed")
    enable_chunked_prefill: bool = setting(
        True, help="split a long prompt over several steps, batched with other requests' decodes")
    gpu_memory_utilization: float = setting(
        0.9, help="fraction of the device's memory the engine may fill; the KV cache gets what the model and "
                  "other processes leave of it (CUDA, NPU)")
    kv_cache_memory: int | str | None = setting(  # bytes, or a size such as 4GiB; parse_size reads it
        None, help=f"KV-cache bytes on CPU, e.g. 4GiB (default: ${KVCACHE_SPACE_ENV} GiB, else "
                   f"{DEFAULT_CPU_KVCACHE_GIB}GiB)")
    num_gpu_blocks_override: int | None = setting(
        None, help="this many KV blocks, instead of as many as --gpu-memory-utilization / --kv-cache-memory allow")
    seed: int = setting(0, help="random seed (sampling without a request seed; --load-format dummy weights)")
    load_format: str = setting(
        "auto", choices=SUPPORTED_LOAD_FORMATS,
        help="weights: auto (safetensors, or the .gguf file given as MODEL), safetensors, gguf, or dummy "
             "(random weights of config.json's shapes)")
    enforce_eager: bool = setting(False, help="never replay decode steps from captured graphs (CPU: traces of "
                                  "small batches; CUDA: CUDA graphs); run each eagerly")
    quantization: str | None = setting(
        None, aliases=("-q",), choices=tuple(QUANT_METHODS),
        help="the checkpoint's quantisation format (default: config.json's quantization_config.quant_method; "
             "gguf: a .gguf keeps its quantised blocks instead of loading dequantized; docs/quantization.md)")
    trust_remote_code: bool = setting(False, help="let the tokenizer run Python code from the model folder")
    skip_tokenizer_init: bool = setting(
        False, help="load no tokenizer (the folder need not hold one): prompts must be token ids, answers carry "
                    "token ids and empty text; chat, text prompts, stop strings and structured output are refused")
    enable_prompt_embeds: bool = setting(
        False, help="accept prompts as embeddings (prompt_embeds on /v1/completions, {'prompt_embeds': tensor} in "
                    "LLM.generate); such prompts bypass the prefix cache (docs/prompt_embeds.md)")
    device: str = setting("auto", choices=SUPPORTED_DEVICES,
                          help="auto: the first of npu, cuda, cpu that works here (the log says why)")
    device_init_timeout: float | None = setting(
        None, help="seconds the device runtime's first start (import torch_npu, first touch of NPU 0) may take "
                   "before start-up fails naming the step that hung (default: $TENGYUN_DEVICE_INIT_TIMEOUT, else 120)")
    skip_version_check: bool = setting(
        False, help="start even when torch / torch_npu / CANN / NPU driver are a combination known not to work "
                    "(the table `tengyun doctor` checks)")
    served_model_name: str | None = setting(
        None, help="the model name in API answers and metrics (default: MODEL as given)")
    generation_config: str = setting(
        "auto", help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                     "max_new_tokens as max_tokens) for fields a request leaves unset: auto = the model "
                     "folder's generation_config.json, vllm = none (the engine's own defaults), or a "
                     "folder holding a generation_config.json")
    max_logprobs: int = setting(  # vLLM's default 20
        20, help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1 allows "
                 "the whole vocabulary (and a request's -1)")
    speculative_config: SpeculativeConfig | dict | str | None = setting(  # a JSON object; parsed by __post_init__
        None, help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (prompt lookup, any model) or '
                   '\'{"method": "mtp", "num_speculative_tokens": 1}\' (the model\'s multi-token-prediction '
                   'layers); docs/speculative_decoding.md')
    # Pooling models (docs/pooling.md)
    runner: str = setting("auto", choices=RUNNERS, help="generate (a *ForCausalLM) or pooling (embeddings, "
                          "classification, scores: /v1/embeddings, /classify, /score, /rerank); auto: from "
                          "config.json's architecture (Qwen3Model, *ForSequenceClassification pool); draft is refused")
    convert: str = setting("auto", choices=CONVERTS, help="with --runner pooling: embed, classify or reward (auto: "
                           "*ForSequenceClassification classifies, anything else embeds)")
    pooler_config: PoolerConfig | dict | str | None = setting(  # a JSON object; parsed by __post_init__
        None, help='the pooler as vLLM\'s JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type '
                   'LAST / MEAN / CLS / ALL, normalize, dimensions, activation)')
    hf_overrides: dict | str | None = setting(  # a JSON object; parsed by __post_init__
        None, help='JSON merged into config.json, e.g. the Qwen3-Reranker recipe \'{"architectures": '
                   '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
                   '"is_original_qwen3_reranker": true}\'')
    # LoRA adapters (docs/lora.md)
    enable_lora: bool = setting(False, help="serve LoRA adapters (PEFT folders) on the base model: --lora-modules, "
                                "or a request's lora_request / model name")
    max_loras: int = setting(1, help="most adapters one step runs (device slots; other adapters' requests wait)")
    max_lora_rank: int = setting(16, help="the highest adapter rank the slots hold (an adapter above it is refused)")
    max_cpu_loras: int | None = setting(None, help="adapters kept read in host memory (default: --max-loras)")
    lora_dtype: str = setting("auto", choices=LORA_DTYPES, help="dtype of the adapter slots (auto: --dtype)")
    fully_sharded_loras: bool = setting(
        False, help="vLLM's extra split of LoRA's unsplit half over TP ranks: accepted at --tensor-parallel-size 1 "
                    "(nothing to split), refused above it")
    # Parallelism (docs/parallelism.md). World size = tp * pp, split evenly over --nnodes.
    tensor_parallel_size: int = setting(
        1, aliases=("-tp",), group=PARALLELISM, help="tensor-parallel ranks: each layer's weights split over them")
    pipeline_parallel_size: int = setting(
        1, aliases=("-pp",), group=PARALLELISM, help="pipeline stages: the layers split into consecutive groups")
    distributed_executor_backend: str | None = setting(
        None, choices=SUPPORTED_EXECUTOR_BACKENDS, group=PARALLELISM,
        help="mp: one process per rank (default when tp x pp > 1); uni: this process")
    nnodes: int = setting(1, group=PARALLELISM, help="nodes the tp x pp ranks are spread over")
    node_rank: int = setting(0, group=PARALLELISM, help="this node's index; node 0 runs the engine")
    master_addr: str = setting("127.0.0.1", group=PARALLELISM, help="node 0's address, reachable from every node")
    master_port: int | None = setting(  # None: a free port (single node only)
        None, group=PARALLELISM, help="rendezvous port on node 0 (default: a free one)")
    headless: bool = setting(False, group=PARALLELISM, help="run this node's workers only (nodes 1..N-1); with "
                                                            "--data-parallel-size, this node's replicas for the API "
                                                            "node at --data-parallel-address")
    enable_expert_parallel: bool = setting(
        False, group=PARALLELISM, help="MoE layers: divide the experts whole over the tensor-parallel ranks "
                                       "(num_experts / tp whole experts each) instead of a slice of every expert")
    # Data parallel (docs/parallelism.md): engine replicas behind one API server, each with tp x pp ranks.
    data_parallel_size: int = setting(
        1, aliases=("-dp",), group=PARALLELISM, help="engine replicas behind one API server (`tengyun serve`), each "
                                                     "with its own tp x pp ranks and KV cache; each request goes to "
                                                     "the least loaded")
    data_parallel_size_local: int | None = setting(
        None, aliases=("-dpl",), group=PARALLELISM, help="replicas on this node (default: --data-parallel-size; "
                                                         "fewer: the others run on --headless nodes)")
    data_parallel_start_rank: int = setting(
        0, aliases=("-dpr",), group=PARALLELISM, help="index of this node's first replica (0: the node that "
                                                      "serves the API; above 0: a --headless node)")
    data_parallel_address: str | None = setting(
        None, aliases=("-dpa",), group=PARALLELISM, help="address of the node that serves the API in a multi-node "
                                                         "data-parallel launch: it listens there, --headless nodes "
                                                         "connect to it (unused on one node)")
    data_parallel_rpc_port: int | None = setting(
        None, aliases=("-dpp",), group=PARALLELISM, help="port the replicas of a multi-node data-parallel launch "
                                                         "reach the API node on (default 29550; + 1: the expert "
                                                         "exchange); one node with --enable-expert-parallel: where "
                                                         "the replicas meet (default: a free port)")
    enable_expert_load_metrics: bool = setting(
        False, group=PARALLELISM, help="export tengyun:expert_load_tokens_total{layer,expert} on /metrics: tokens "
                                       "routed to each expert of each MoE layer (docs/metrics.md); large, off by "
                                       "default")
    disable_pipeline_overlap: bool = setting(
        False, group=PARALLELISM, help="with --pipeline-parallel-size P > 1, keep one batch in flight instead of P "
                                       "(stages then run one after another; docs/parallelism.md)")
    distributed_timeout: float = setting(
        300.0, group=PARALLELISM, help="seconds the engine waits for a step's result before it fails (a dead local "
                                       "rank is named at once)")
    rank_table: str | None = setting(
        None, group=PARALLELISM, help="HCCL rank table (hccl.json) of a multi-node NPU run: validated, checked against "
                                      "--nnodes / --node-rank, and this node's HCCL environment derived from it "
                                      "(default: $RANK_TABLE_FILE)")
    numa_bind: str = setting("auto", choices=("auto", "off"),
                             help="pin each worker's CPUs and memory to its device's NUMA node (auto: when the host "
                                  "has more than one node)")

    # Resolved by finalize(); read-only afterwards.
    model_path: Path | None = field(default=None, init=False)
    tokenizer_path: Path | None = field(default=None, init=False)
    model_spec: ModelSpec | None = field(default=None, init=False, repr=False)  # the one description of the model
    quant_config: QuantConfig | None = field(default=None, init=False, repr=False)  # None: not quantised
    device_type: str = field(default="", init=False)
    # Who runs the engine, as vLLM's UsageContext: "llm" (the offline LLM class) or "api_server"
    # (`tengyun serve`, set by config_from_args): the platform's default step budget depends on it.
    usage_context: str = field(default="llm", init=False)
    sizing: ResolvedSizing | None = field(default=None, init=False, repr=False)  # what `tengyun plan` resolves too
    hccl_node: Any = field(default=None, init=False, repr=False)  # ops.ranktable.HcclNode of --rank-table
    pooling: PoolingModel | None = field(default=None, init=False, repr=False)  # --runner pooling's; None: generate
    _frozen: bool = field(default=False, init=False, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"EngineConfig is frozen after finalize(); cannot set {name}.")
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self.dtype = canonical_dtype(self.dtype)
        self.kv_cache_dtype = canonical_dtype(self.kv_cache_dtype)
        self._validate_values()

    # ----- validation of values the user typed ------------------------------------------
    def _validate_values(self) -> None:
        def choice(flag: str, value: Any, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ValueError(f"--{flag} must be one of {', '.join(allowed)}; got {value!r}.")

        choice("dtype", self.dtype, SUPPORTED_DTYPES)
        choice("kv-cache-dtype", self.kv_cache_dtype, SUPPORTED_KV_DTYPES)
        choice("load-format", self.load_format, SUPPORTED_LOAD_FORMATS)
        choice("device", self.device, SUPPORTED_DEVICES)
        choice("numa-bind", self.numa_bind, ("auto", "off"))
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"--block-size must be a power of two from 1 to 256 (try 16); got {self.block_size}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1 (try 2048); got {self.max_model_len}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1 (try 256); got {self.max_num_seqs}.")
        if type(self.stream_interval) is not int or self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be an integer >= 1 (1: every token at once); "
                             f"got {self.stream_interval!r}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1 (try {DEFAULT_MAX_NUM_BATCHED_TOKENS}); "
                f"got {self.max_num_batched_tokens}."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1] (try 0.9); got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "--kv-cache-memory")
            if self.kv_cache_memory <= 0:
                raise ValueError(f"--kv-cache-memory must be positive (try 4GiB); got {self.kv_cache_memory}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"--num-gpu-blocks-override must be >= 1; got {self.num_gpu_blocks_override}.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be an integer >= 0, or -1 for the whole vocabulary (try 20); "
                             f"got {self.max_logprobs!r}.")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self.hf_overrides = parse_hf_overrides(self.hf_overrides)
        self._validate_generation_config()
        check_parallel_values(self)
        check_lora_values(self)

    def _validate_generation_config(self) -> None:
        """auto, vllm, or a folder holding generation_config.json."""
        from tengyun.generation_config import GENERATION_CONFIG_FILE

        if self.generation_config in ("auto", "vllm"):
            return
        folder = Path(str(self.generation_config)).expanduser()
        if not (folder / GENERATION_CONFIG_FILE).is_file():
            what = "has no" if folder.is_dir() else "is not a folder with a"
            raise ValueError(
                f"--generation-config {self.generation_config!r} {what} {GENERATION_CONFIG_FILE}: pass auto "
                f"(the model's), vllm (no model defaults) or a folder that holds {GENERATION_CONFIG_FILE}."
            )

    # ----- resolution against the model and the machine ----------------------------------
    def finalize(self) -> "EngineConfig":
        """Resolve the model folder, dtypes and lengths; check combinations; freeze."""
        if self._frozen:
            return self
        from tengyun.models.model_source import resolve_model
        from tengyun.platforms.startup import device_init_timeout, select_platform

        source = resolve_model(self.model, self.load_format, self.tokenizer, self.quantization,
                               require_tokenizer=not self.skip_tokenizer_init)
        self.model_path = source.folder
        if self.load_format in ("auto", "gguf"):
            self.load_format = source.load_format
        self.tokenizer_path = source.tokenizer_folder
        hf_config = apply_hf_overrides(json.loads((source.folder / "config.json").read_text()), self.hf_overrides)
        self.model_spec = ModelSpec.from_hf_config(hf_config)
        self._resolve_runner(hf_config)
        if self.hccl_node is not None:  # before the NPU runtime starts: it reads ASCEND_RT_VISIBLE_DEVICES
            os.environ.update(self.hccl_node.env)
            logger.info("--rank-table %s: %s", self.rank_table, self.hccl_node.describe())
        platform = select_platform(self.device, device_init_timeout(self.device_init_timeout),
                                   check_versions=not self.skip_version_check)
        self.device_type = platform.device_type
        self._resolve_sizing(platform.default_block_size)
        if problem := data_parallel_serving_problem(self):
            raise ValueError(problem)
        self._check_expert_load_metrics()
        self._check_prompt_embeds()
        self._check_quantization()
        check_lora_model(self)
        if self.served_model_name is None:
            self.served_model_name = self.model or source.default_name
        self._frozen = True
        return self

    def _resolve_runner(self, hf_config: dict) -> None:
        """--runner / --convert from the architecture; a pooling model's pooler (docs/pooling.md)."""
        self.runner, self.convert = resolve_runner(self.model_spec.architecture, self.runner, self.convert)
        if self.runner == "pooling":
            if self.speculative_config is not None:
                raise ValueError("--speculative-config drafts tokens to generate; a --runner pooling model generates "
                                 "none: drop --speculative-config.")
            self.pooling = resolve_pooling_model(self.convert, hf_config, self.pooler_config, self.model_path)
            logger.info("--runner pooling: %s", self.pooling.describe())
        elif self.pooler_config is not None:
            raise ValueError("--pooler-config sets a pooling model's pooler: add --runner pooling, or drop it.")

    def _resolve_sizing(self, block_size_default: int) -> None:
        """Block size, dtypes, lengths, batched tokens, the TP / PP and MTP checks: sizing.resolve_sizing,
        the resolve `tengyun plan` runs for the device it plans for, written back into the fields."""
        sizing = resolve_sizing(self, self.model_spec, self.device_type, self.model_path, block_size_default)
        if self.dtype == "auto":
            logger.info("--dtype auto: %s on %s for a checkpoint config.json calls %s (pass --dtype to choose; "
                        "Platform.auto_dtype says why)", sizing.dtype, self.device_type,
                        self.model_spec.checkpoint_dtype or "nothing")
        self.block_size, self.dtype, self.kv_cache_dtype = sizing.block_size, sizing.dtype, sizing.kv_cache_dtype
        self.max_model_len, self.max_num_batched_tokens = sizing.max_model_len, sizing.max_num_batched_tokens
        if sizing.mtp_layers:
            self.model_spec = dataclasses.replace(self.model_spec, mtp_num_layers=sizing.mtp_layers)
        if sizing.pp_layers:
            self.model_spec = dataclasses.replace(self.model_spec, pp_layers=sizing.pp_layers)
            logger.info("Pipeline stages hold %s decoder layers (balanced by each layer's and the LM head's work per "
                        "token; VLLM_PP_LAYER_PARTITION sets them)", "/".join(map(str, sizing.pp_layers)))
        self.sizing = sizing

    def _check_expert_load_metrics(self) -> None:
        """--enable-expert-load-metrics needs MoE layers, all on the sampling rank's stage
        (--enable-expert-parallel's split is checked by resolve_sizing, as `tengyun plan` does)."""
        if self.enable_expert_load_metrics and self.model_spec.moe is None:
            raise ValueError(f"--enable-expert-load-metrics counts the tokens routed to MoE experts, but "
                             f"{self.model_spec.architecture} has none: drop --enable-expert-load-metrics.")
        if self.enable_expert_load_metrics and self.pipeline_parallel_size > 1:
            raise ValueError("--enable-expert-load-metrics is counted on the sampling rank, which holds only the last "
                             "pipeline stage's layers: use --pipeline-parallel-size 1 or drop the flag.")

    def _check_prompt_embeds(self) -> None:
        """--enable-prompt-embeds runs with generating models, without a draft model (docs/prompt_embeds.md)."""
        if not self.enable_prompt_embeds:
            return
        if self.runner == "pooling":
            raise ValueError("--enable-prompt-embeds feeds embeddings to a generating model; --runner pooling "
                             "models take text or token ids: drop --enable-prompt-embeds.")
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp":
            raise ValueError("--enable-prompt-embeds cannot run with --speculative-config method mtp: the MTP head "
                             "embeds the prompt's token ids, which an embeddings prompt does not have; use method "
                             "ngram or drop one of the two.")

    def _check_quantization(self) -> None:
        """The checkpoint's quantisation (config.json quantization_config, or --quantization), read
        once here: a format or scheme Tengyun cannot run is refused before any weight loads.
        FP8 block-quantized checkpoints (ModelSpec.fp8_block) are dequantized at load where the
        platform has no FP8 matmul (Platform.fp8_matmul). --load-format dummy of a format Tengyun
        does not read fills dense random weights."""
        block = self.model_spec.fp8_block
        if block is not None:
            self._log_fp8_dequantization(block)
            return
        if self.load_format == "dummy" and self.model_spec.quantization not in (None, *QUANT_METHODS):
            logger.info("--load-format dummy: %s's %r quantization is not read; random dense weights", self.model,
                        self.model_spec.quantization)
            return
        if self.model_spec.quantization == "fp8" and self.load_format != "dummy":
            raise ValueError(
                f"{self.model_path} is a quantized checkpoint (config.json quantization_config: quant_method 'fp8'), "
                "which Tengyun cannot load yet; an fp8 checkpoint loads when it is block-quantized "
                "(weight_block_size, e.g. [128, 128]) with activation_scheme dynamic: serve the unquantized "
                "(bf16 / fp16) checkpoint, or pass --load-format dummy for random weights of its shapes.")
        hf_config = json.loads((self.model_path / "config.json").read_text())
        self.quant_config = detect_quantization(hf_config, self.quantization, self.model_path)
        if self.quant_config:
            logger.info("Quantized checkpoint: %s", self.quant_config.describe())

    def _log_fp8_dequantization(self, block: tuple[int, int]) -> None:
        from tengyun.platforms import platform_class

        why = ("Tengyun has no FP8 linear layer yet" if platform_class(self.device_type).fp8_matmul
               else f"{self.device_type} has no FP8 matmul (Platform.fp8_matmul)")
        logger.info("FP8 block-quantized checkpoint (weight_block_size %s): weights dequantized to %s at load, "
                    "since %s", list(block), self.dtype, why)

    # ----- derived values -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """--distributed-executor-backend, defaulting to mp when there is more than one rank."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"

    def kv_cache_budget_bytes(self) -> int:
        """Bytes of KV cache to allocate on CPU: --kv-cache-memory, else the env var, else 4 GiB."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        env = os.environ.get(KVCACHE_SPACE_ENV)
        if env:
            try:
                gib = float(env)
            except ValueError:
                raise ValueError(f"{KVCACHE_SPACE_ENV} must be a number of GiB such as 4; got {env!r}.") from None
            if gib <= 0:
                raise ValueError(f"{KVCACHE_SPACE_ENV} must be positive (try 4); got {env!r}.")
            return int(gib * 2**30)
        return DEFAULT_CPU_KVCACHE_GIB * 2**30

    @property
    def architecture(self) -> str:
        return self.model_spec.architecture

    def replace(self, **changes: Any) -> "EngineConfig":
        """A new, unfinalized config with the user-facing fields changed."""
        user_fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        user_fields.update(changes)
        return EngineConfig(**user_fields)
