"""The SMG gRPC worker protocol (``service VllmEngine`` of the ``smg-grpc-proto`` package, the
``[grpc]`` extra): ``tokenbudget serve --grpc PORT`` puts an ``AsyncLLM`` behind it so the SGLang
Model Gateway tokenizes, applies chat templates and parses tool calls itself and routes on this
engine's KV-cache events and loads. ``server`` runs it, ``servicer`` answers the RPCs,
``sampling`` maps the proto's sampling parameters, ``kv_stream`` turns the pool's events
(``kv_cache.events``) into the proto's batches."""
