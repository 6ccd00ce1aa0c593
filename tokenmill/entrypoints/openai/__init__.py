"""The OpenAI-compatible HTTP API (vLLM's routes and shapes): `app.build_app` / `api_server.run_server`."""
