"""`tokenmill serve` builds the engine's config and starts the engine core before it imports the HTTP app
(api_server.py): the engine core, already importing, waits for that config, so what the server imports first
delays the whole start. The app is imported while the engine core loads the model."""
from __future__ import annotations

import subprocess
import sys

# The HTTP app and what it alone needs (about 0.5 s of imports on 2 CPU cores).
APP = ("fastapi", "starlette", "uvicorn", "xgrammar", "tokenmill.entrypoints.openai.app",
       "tokenmill.entrypoints.openai.protocol", "tokenmill.structured.backend_xgrammar")


def test_the_serve_path_imports_no_http_app_before_the_engine_starts():
    # What `tokenmill serve` and `python -m tokenmill.entrypoints.openai.api_server` import before the engine
    # config is built and AsyncLLM starts the engine core.
    code = ("import sys\n"
            "import tokenmill.entrypoints.cli.main, tokenmill.config.args, tokenmill.entrypoints.openai.api_server\n"
            "import tokenmill.config.engine_args, tokenmill.engine.async_llm\n"
            "print(' '.join(sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    early = sorted(m for m in out.stdout.split() if any(m == a or m.startswith(a + ".") for a in APP))
    assert early == []
