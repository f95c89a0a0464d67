"""The OpenAI-compatible server as a Ray Serve deployment: N replicas, one engine each.

    serve run tokenbudget.integrations.ray.serve:app_builder num_replicas=2 model=/models/m.gguf

or from Python::

    from ray import serve
    from tokenbudget.integrations.ray.serve import TokenbudgetDeployment
    serve.run(TokenbudgetDeployment.options(num_replicas=2).bind(model="/models/m.gguf"))

A plain ``@serve.deployment`` with ``@serve.ingress`` around the project's own FastAPI app
(``engine/serve/app.py``: the same routes, errors and metrics as ``tokenbudget serve``), built on
each replica after its ``AsyncLLM`` (``__serve_build_asgi_app__``). Options that matter for a
continuous-batching engine:

* ``max_ongoing_requests`` raised from Ray's default of 5 to 256: the engine batches whatever is
  in flight under its token budget, so capping a replica at 5 requests would cap its batch at 5.
  The engine's own admission control (``max_queued_requests``) is the bound that answers 429.
* graceful drain on scale-down: Ray stops routing to a replica it removes, then waits up to
  ``graceful_shutdown_timeout_s`` for its requests in flight (polling every
  ``graceful_shutdown_wait_loop_s``); the app's lifespan then aborts what is left
  (``AsyncLLM.shutdown``). ``check_health`` fails once the engine is dead, so Ray replaces it.
* ``num_cpus`` per replica = the engine's torch threads (``num_threads``).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from tokenbudget.engine.entrypoints.async_llm import AsyncLLM
from tokenbudget.engine.serve.app import build_app

MAX_ONGOING_REQUESTS = 256


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, graceful_shutdown_wait_loop_s=1.0,
                  graceful_shutdown_timeout_s=60.0, health_check_period_s=10.0,
                  ray_actor_options={"num_cpus": 1, "num_gpus": 0})
@serve.ingress()
class TokenbudgetDeployment:
    """One replica: an ``AsyncLLM`` and the OpenAI routes over it."""

    def __init__(self, model: str | None = None, served_model_name: str | None = None,
                 engine_options: dict[str, Any] | None = None, api_key: str | None = None) -> None:
        import os
        options = dict(engine_options or {})
        options.setdefault("num_threads", 1)
        self.llm = AsyncLLM(model, **options)
        self.model_name = served_model_name or (os.path.basename(os.path.normpath(model)) if model
                                                else "SmolLM2-135M-Instruct")
        self.api_key = api_key

    def __serve_build_asgi_app__(self):
        return build_app(self.llm, self.model_name, self.api_key)

    def check_health(self) -> None:
        if not self.llm.is_healthy():
            raise RuntimeError("the tokenbudget engine is dead")


def app_builder(args: dict[str, str]):
    """``serve run ...:app_builder key=value ...``: ``num_replicas`` (default 1), ``model``,
    ``served_model_name``, ``api_key``, ``num_threads`` (also the replica's num_cpus), and any
    other ``EngineConfig`` option as a JSON value (``max_num_seqs=32``,
    ``speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'``)."""
    import json

    opts = dict(args)
    num_replicas = int(opts.pop("num_replicas", 1))
    fixed = {k: opts.pop(k, None) for k in ("model", "served_model_name", "api_key")}
    engine_options = {}
    for key, value in opts.items():
        try:
            engine_options[key] = json.loads(value)
        except (TypeError, ValueError):
            engine_options[key] = value  # a bare string (dtype=float32)
    threads = int(engine_options.setdefault("num_threads", 1))
    return TokenbudgetDeployment.options(num_replicas=num_replicas,
                                         ray_actor_options={"num_cpus": threads, "num_gpus": 0}).bind(
        engine_options=engine_options, **fixed)
