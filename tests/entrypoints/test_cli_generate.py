"""`tengyun generate`: one chat turn printed; bad flags give a one-line error naming the flag."""

from __future__ import annotations

import subprocess
import sys

from tengyun import LLM, SamplingParams


def _tengyun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tengyun.entrypoints.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_the_chat_answer(tiny_checkpoints):
    folder = str(tiny_checkpoints["qwen2"])
    expected = LLM(folder, kv_cache_memory="1MiB").chat(
        [{"role": "user", "content": "Hello"}], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    proc = _tengyun("generate", "Hello", folder, "--max-tokens", "8", "--kv-cache-memory", "1MiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_bad_flag_value_is_one_line_naming_the_flag(tiny_checkpoints):
    proc = _tengyun("generate", "Hello", str(tiny_checkpoints["qwen2"]), "--block-size", "7")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --block-size must be")
    assert "Traceback" not in proc.stderr


def test_missing_model_path_is_one_line_naming_it(tmp_path):
    proc = _tengyun("generate", "Hello", str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
