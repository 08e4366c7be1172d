"""--lora-modules as vLLM reads it: adapters the server loads at start-up, each ``name=path`` or
a JSON object '{"name": "sql", "path": "/adapters/sql", "base_model_name": "Qwen/Qwen2.5-0.5B"}'.
The server hands out lora_int_id 1, 2, ... in the order given (serving_models.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: tuple[str, ...] | list[str] | None) -> list[LoRAModulePath]:
    """Each value of --lora-modules; ValueError naming the flag and the bad value."""
    modules = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{"):
            try:
                fields = json.loads(value)
                modules.append(LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name")))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and \"path\" "
                                 f"(and may give \"base_model_name\"): {e}") from None
        elif "=" in value:
            name, path = value.split("=", 1)
            modules.append(LoRAModulePath(name.strip(), path.strip()))
        else:
            raise ValueError(f"--lora-modules {value!r}: give name=path or a JSON object "
                             f"'{{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}'.")
        if not modules[-1].name or not modules[-1].path:
            raise ValueError(f"--lora-modules {value!r}: the name and the path must not be empty.")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        twice = sorted(n for n in set(names) if names.count(n) > 1)
        raise ValueError(f"--lora-modules names an adapter twice: {twice}.")
    return modules
