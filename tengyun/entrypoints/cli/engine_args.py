"""EngineConfig <-> command-line flags, with vLLM's flag names."""

from __future__ import annotations

import argparse

from tengyun.config import (
    SUPPORTED_DEVICES, SUPPORTED_DTYPES, SUPPORTED_EXECUTOR_BACKENDS, SUPPORTED_KV_DTYPES, SUPPORTED_LOAD_FORMATS,
    EngineConfig,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF folder, .gguf file, or one of the embedded models (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--dtype", default="auto", choices=SUPPORTED_DTYPES + ("half", "float", "bf16", "fp16", "fp32"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=SUPPORTED_KV_DTYPES)
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16; 128 on NPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV-cache bytes on CPU, e.g. 4GiB (default: $TENGYUN_CPU_KVCACHE_SPACE GiB, else 4GiB)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-format", default="auto", choices=SUPPORTED_LOAD_FORMATS)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--device", default="auto", choices=SUPPORTED_DEVICES)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--generation-config", default="auto",
                        help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens as max_tokens) for fields a request leaves unset: auto = the model "
                             "folder's generation_config.json, vllm = none (the engine's own defaults), or a "
                             "folder holding a generation_config.json")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1 allows "
                             "the whole vocabulary (and a request's -1)")
    parser.add_argument("--numa-bind", default="auto", choices=("auto", "off"),
                        help="pin each worker's CPUs and memory to its device's NUMA node (auto: when the host "
                             "has more than one node)")
    group = parser.add_argument_group("parallelism (docs/parallelism.md)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    group.add_argument("--distributed-executor-backend", default=None, choices=SUPPORTED_EXECUTOR_BACKENDS,
                       help="mp: one process per rank (default when tp x pp > 1); uni: this process")
    group.add_argument("--nnodes", type=int, default=1, help="nodes the tp x pp ranks are spread over")
    group.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 runs the engine")
    group.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, reachable from every node")
    group.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (default: a free one)")
    group.add_argument("--headless", action="store_true", help="run this node's workers only (nodes 1..N-1)")
    group.add_argument("--distributed-timeout", type=float, default=300.0,
                       help="seconds the engine waits for a step's result before it fails (a dead local rank "
                            "is named at once)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} disagree: pass one of them.")
    return EngineConfig(
        model=args.model or args.model_flag, tokenizer=args.tokenizer, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed, load_format=args.load_format,
        enforce_eager=args.enforce_eager, trust_remote_code=args.trust_remote_code, device=args.device,
        served_model_name=args.served_model_name, generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        headless=args.headless, distributed_timeout=args.distributed_timeout, numa_bind=args.numa_bind,
    )
