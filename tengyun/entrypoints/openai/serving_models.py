"""ServingModels: the names a request's "model" may give: the base model (--served-model-name)
and each LoRA adapter, from --lora-modules at start-up or POST /v1/load_lora_adapter at run time
(behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, or its alias TENGYUN_ALLOW_RUNTIME_LORA_UPDATING).

Each adapter gets the next lora_int_id (1, 2, ...), never reused: an adapter unloaded and loaded
again under the same name is a new id, so neither the worker's slots and host copies nor the
prefix cache can serve the old weights for it. Unloading stops new requests from naming it;
requests already running on it finish. Torch-free.
"""

from __future__ import annotations

import itertools
import os

from tengyun.config import EngineConfig
from tengyun.entrypoints.openai.protocol import ModelCard
from tengyun.entrypoints.openai.request_model import RequestError
from tengyun.lora.modules import LoRAModulePath, parse_lora_modules
from tengyun.lora.peft_adapter import LoRAAdapterNotFound, read_peft_adapter
from tengyun.lora.request import LoRARequest

RUNTIME_UPDATES_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "TENGYUN_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updates_allowed() -> bool:
    """vLLM's switch (or Tengyun's alias) for /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATES_ENV)


class ServingModels:
    def __init__(self, config: EngineConfig, lora_modules: list[LoRAModulePath] = ()):
        """Checks every --lora-modules adapter now: a bad one raises ValueError (exit 2)."""
        self.config = config
        self.base_name = config.served_model_name
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        if lora_modules and not config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora: add --enable-lora (and --max-lora-rank at least "
                             "the adapters' rank).")
        for module in lora_modules:
            self.load(module.name, module.path, module.base_model_name)

    @classmethod
    def from_flags(cls, config: EngineConfig, lora_modules: tuple[str, ...] | None) -> "ServingModels":
        return cls(config, parse_lora_modules(lora_modules))

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's "model" names; None for the base model (or no name). An unknown
        name is a 404, as vLLM answers it."""
        if model is None or model == self.base_name:
            return None
        lora = self.loras.get(model)
        if lora is None:  # vLLM's first sentence, then what is served
            adapters = f" and the LoRA adapters {', '.join(f'`{n}`' for n in self.loras)}" if self.loras else ""
            raise RequestError(f"The model `{model}` does not exist; this server serves `{self.base_name}`"
                               f"{adapters}.", "model", status=404)
        return lora

    def response_name(self, model: str | None) -> str:
        """The "model" an answer carries: the adapter's name, else the base model's."""
        return model if model in self.loras else self.base_name

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter's folder against the model and serve it under ``name``; ValueError
        (a RequestError at run time) naming the adapter if it cannot be."""
        if not self.config.enable_lora:
            raise RequestError("LoRA is not enabled: start the server with --enable-lora to load adapters.")
        if not name or not path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.loras:
            raise RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if name == self.base_name:
            raise RequestError(f"The lora adapter '{name}' has the base model's name: choose another.", "lora_name")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        try:
            read_peft_adapter(lora, self.config.model_spec, self.config.max_lora_rank)
        except LoRAAdapterNotFound as e:
            raise RequestError(str(e), "lora_path", status=404) from None
        except ValueError as e:
            raise RequestError(str(e), "lora_path") from None
        self.loras[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if not name:
            raise RequestError("'lora_name' must be provided.", "lora_name")
        if self.loras.pop(name, None) is None:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", status=404)

    def cards(self) -> list[ModelCard]:
        """/v1/models: the base model, then each adapter with its parent."""
        cards = [ModelCard(id=self.base_name, root=self.base_name, max_model_len=self.config.max_model_len)]
        cards += [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or self.base_name,
                            max_model_len=self.config.max_model_len) for lora in self.loras.values()]
        return cards
