"""Run the app under uvicorn, with a SIGTERM drain.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits up to ``grace_period``
seconds for the requests in flight to finish; then it cancels the rest (each cancelled response
aborts its request), the app's lifespan ends with ``AsyncLLM.shutdown()``, and the process
exits 0. (uvicorn re-delivers the signal it handled to the handler installed before it; ``serve``
installs one that ignores SIGTERM, since the drain already did what SIGTERM asks.)
"""

from __future__ import annotations

import signal
import threading

import uvicorn

from tokenbudget.engine.serve.app import build_app


def make_server(llm, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                grace_period: float = 30.0, log_level: str = "info") -> uvicorn.Server:
    app = build_app(llm, model_name, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_period,
                            lifespan="on", access_log=False)
    return uvicorn.Server(config)


def serve(llm, model_name: str, **options) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean drain."""
    server = make_server(llm, model_name, **options)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 1
