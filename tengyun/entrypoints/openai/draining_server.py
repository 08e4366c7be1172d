"""DrainingServer: uvicorn, with SIGTERM / SIGINT starting a drain instead of an immediate stop,
and the lifecycle's exit code: 0 after a drain, 1 if the engine died, 2 if it could not start
(configuration). A second signal stops at once."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from tengyun.entrypoints.openai.server_lifecycle import ServerLifecycle

logger = logging.getLogger("tengyun.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.lifecycle.draining or self.should_exit:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        logger.info("Received signal %d: no new requests; finishing %d in-flight request(s) within %.0f s",
                    sig, self.lifecycle.in_flight, self.lifecycle.shutdown_timeout)
        self.lifecycle.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        code = self.lifecycle.exit_code()
        if code is not None:
            self.exit_code = code
            return True
        return should_exit
