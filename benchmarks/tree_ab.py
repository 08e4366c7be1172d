"""Before/after of a change that should not touch the hot path (a re-layering): the same offline
workload under two revisions of tengyun/, alternated in fresh subprocesses on the same cores.

    python benchmarks/tree_ab.py --base 6272d9a --rounds 3 --cpus 0,1 --dtype bfloat16

Each revision's tengyun/ is exported with `git archive` into a temporary folder and put first on
PYTHONPATH; its compiled CPU kernels are built there if they are not cached (the build command
moved with the re-layering, so both spellings are tried). Workload: the embedded SmolLM2 with
dummy weights (--load-format dummy, the same arithmetic), 64 prompts x 128 random tokens in, 128
out, greedy, ignore_eos; then one prompt alone (batch-1 decode). Prints output tok/s per run, the
medians, tokens per CPU second (less sensitive to other load than wall time) and whether both
revisions produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
BUILD_MODULES = ("tengyun.platforms.cpu.native", "tengyun.layers.attention.cpu_kernels")


def child(dtype: str, num: int, out_len: int) -> None:
    from tengyun import LLM, SamplingParams

    llm = LLM(load_format="dummy", dtype=dtype, kv_cache_memory="1GiB", max_model_len=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(num)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    one = time.perf_counter()
    single = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    one = time.perf_counter() - one
    print(json.dumps({"tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu, "b1_tok_s": len(single) / one,
                      "tokens": [o.outputs[0].token_ids for o in outputs[:4]]}))


def export(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "tengyun"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    env = dict(os.environ, PYTHONPATH=str(into))
    for module in BUILD_MODULES:  # whichever this revision has
        if (into / (module.replace(".", "/") + ".py")).exists():
            subprocess.run([sys.executable, "-m", module, "--build"], env=env, check=True, cwd=into)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="6272d9a", help="the revision before the change")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpus", default="0,1", help="taskset list; OMP_NUM_THREADS = its length")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: export(rev, Path(tmp) / name) for name, rev in (("base", args.base), ("head", args.head))}
        rows: dict[str, list[dict]] = {"base": [], "head": []}
        for r in range(args.rounds):
            for name in (("base", "head") if r % 2 == 0 else ("head", "base")):
                env = dict(os.environ, PYTHONPATH=str(trees[name]), OMP_NUM_THREADS=str(len(args.cpus.split(","))))
                proc = subprocess.run(["taskset", "-c", args.cpus, sys.executable, __file__, "--child", args.dtype,
                                       str(args.num_prompts), str(args.output_len)],
                                      env=env, capture_output=True, text=True, check=True)
                rows[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(name, {k: round(v, 1) for k, v in rows[name][-1].items() if k != "tokens"}, flush=True)
    for name, rev in (("base", args.base), ("head", args.head)):
        runs = rows[name]
        print(f"{name} ({rev}): {args.num_prompts} x 128/{args.output_len} output tok/s median "
              f"{statistics.median(r['tok_s'] for r in runs):.1f} ({', '.join('%.1f' % r['tok_s'] for r in runs)}); "
              f"tok per CPU s {statistics.median(r['tok_per_cpu_s'] for r in runs):.1f}; batch-1 tok/s "
              f"{statistics.median(r['b1_tok_s'] for r in runs):.1f}")
    print("same greedy tokens:", rows["base"][0]["tokens"] == rows["head"][0]["tokens"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
