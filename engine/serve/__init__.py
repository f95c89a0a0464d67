"""``tokenbudget serve``: an OpenAI-compatible HTTP server on ``AsyncLLM`` (the ``serve`` extra:
FastAPI, uvicorn, prometheus-client). ``protocol`` maps request bodies to ``SamplingParams``,
``responses`` builds OpenAI response objects, ``app`` the routes, ``metrics`` ``/metrics``,
``server`` runs uvicorn with a SIGTERM drain."""
