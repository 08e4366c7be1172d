#!/usr/bin/env bash
# Fetch vLLM 0.11.0's sdist and wheel from PyPI, unpack the sdist, make the test venv, build the
# work copy of the tests (adapt.py). Everything lands under $ROOT (default /tmp/vept).
#   bash setup.sh
# Then: TENGYUN_SRC=... bash run.sh    (see README.md)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT=${ROOT:-/tmp/vept}
VENV=${VENV:-/tmp/vllm-tests-venv}
TENGYUN_PYTHON=${TENGYUN_PYTHON:-/work/main/.venv/bin/python}
FILES=https://files.pythonhosted.org/packages
SDIST=$FILES/82/5a/36d2351206f4d8d871b10780f874d03957985e08298d430cc837723e07af/vllm-0.11.0.tar.gz
SDIST_SHA=f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae
WHEEL=$FILES/47/33/d19e0763c34392ec956534536fa837c060495bfff31ed83452135ea7608d/vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl
WHEEL_SHA=3861c75ff2b12e24f6d179ff5c084d791b42ded8675d76c8706697c79f68cd62
mkdir -p "$ROOT"
cd "$ROOT"
# 1. vLLM's source package (the tests) and wheel (what the tests import from vllm: tokenizer,
#    ModelConfig, protocol classes); URLs as https://pypi.org/simple/vllm/ lists them.
[ -f vllm-0.11.0.tar.gz ] || curl -sSfL -o vllm-0.11.0.tar.gz "$SDIST"
echo "$SDIST_SHA  vllm-0.11.0.tar.gz" | sha256sum -c -
WHL=vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl
[ -f "$WHL" ] || curl -sSfL -o "$WHL" "$WHEEL"
echo "$WHEEL_SHA  $WHL" | sha256sum -c -
[ -d vllm-0.11.0 ] || tar xzf vllm-0.11.0.tar.gz
# 2. a venv of its own: torch's CPU wheel (on disk here), the test dependencies at the versions
#    measured (vLLM 0.11's test pins where it has one), and vLLM without its GPU dependencies.
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -r "$HERE/venv-requirements.txt"
"$VENV/bin/pip" install -q --no-deps "$ROOT/$WHL"
# 3. the work copy: stand-ins, model ids, offline HF cache
"$VENV/bin/python" "$HERE/adapt.py" --sdist "$ROOT/vllm-0.11.0" --work "$ROOT/work" \
  --hf-home "$ROOT/hf-home" --tmpdir "$ROOT/tmp" --tengyun-python "$TENGYUN_PYTHON"
