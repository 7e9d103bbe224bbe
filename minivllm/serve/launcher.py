"""uvicorn's server as `minivllm serve` runs it (vLLM's entrypoints/launcher.py): SIGINT / SIGTERM first abort
every request, so that streams end at once (finish_reason "abort") and the graceful shutdown does not wait for long
generations; and a watchdog that stops the server when its engine core has died.

Why stop, not go on answering 503: the core is gone with its KV cache and every request; nothing in this process
can bring it back. vLLM's API server exits then, so that its supervisor (systemd, Kubernetes, a shell loop) starts a
fresh one; this does the same. The core's death has ended every open stream with an error already (core_client.py);
within a tick (0.1 s) the server stops listening, gives the connections `DEAD_GRACE` seconds, stops the tokenizer
workers, and `run_server` raises EngineDeadError: `minivllm serve` exits with status 1, within 5 s of the death."""

import os
import signal

import uvicorn

DEAD_GRACE = 2.0  # seconds the connections get to close after the engine died (their streams have ended)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, llm, parent_pid: int | None = None) -> None:
        super().__init__(config)
        self.llm = llm
        self.parent_pid = parent_pid  # one of several API servers: the process that started it (api_servers.py)
        self.engine_died = False  # the watchdog stopped the server: the engine core died

    def handle_exit(self, sig, frame) -> None:
        self.llm.abort_all()
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's main loop calls this every 0.1 s; True stops the server."""
        if not self.llm.is_running and not self.should_exit:
            self.engine_died = True
            self.config.timeout_graceful_shutdown = DEAD_GRACE
            return True
        if self.parent_pid is not None and os.getppid() != self.parent_pid and not self.should_exit:
            self.handle_exit(signal.SIGTERM, None)  # the parent was killed: leave as on SIGTERM
        return await super().on_tick(counter)
