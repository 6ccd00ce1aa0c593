"""The OpenAI-compatible HTTP API (vLLM's routes and shapes): `api_server.build_app` / `api_server.run_server`."""
