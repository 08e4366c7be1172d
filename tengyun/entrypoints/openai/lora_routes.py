"""vLLM's run-time LoRA routes, served only with VLLM_ALLOW_RUNTIME_LORA_UPDATING (or
TENGYUN_ALLOW_RUNTIME_LORA_UPDATING) set to true, as vLLM does (without it they are 404s):

    POST /v1/load_lora_adapter   {"lora_name": "sql", "lora_path": "/adapters/sql"}
      200 "Success: LoRA adapter 'sql' added successfully."; 404 when there is no adapter at the
      path (no adapter_config.json: "... No adapter found for PATH", as vLLM); 400 when the folder
      is not an adapter Tengyun can serve on this model (the message names the adapter and the
      module) or the name is taken
    POST /v1/unload_lora_adapter {"lora_name": "sql"}
      200 "Success: LoRA adapter 'sql' removed successfully."; 404 for a name not loaded
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tengyun.entrypoints.openai.request_model import RequestBody
from tengyun.entrypoints.openai.serving_models import RUNTIME_UPDATES_ENV, runtime_lora_updates_allowed

logger = logging.getLogger("tengyun.server")


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = ""
    lora_int_id: int | None = None  # accepted as vLLM takes it; the name decides


def add_lora_routes(app: FastAPI, host: Any) -> None:
    """``host``: the EngineHost whose ServingModels (host.models) the routes change."""
    if not runtime_lora_updates_allowed():
        return
    logger.warning("LoRA adapters may be loaded and unloaded at run time (%s): any client with the API key can "
                   "make the server read a folder it names.", " / ".join(RUNTIME_UPDATES_ENV))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        lora = host.models.load(request.lora_name, request.lora_path)
        logger.info("LoRA adapter %r loaded from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        host.models.unload(request.lora_name)
        logger.info("LoRA adapter %r unloaded", request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
