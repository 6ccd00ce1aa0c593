"""API-server configuration: the `tokenmill serve` options that concern the HTTP front end, not the engine.

Names and defaults follow `vllm serve`, so existing command lines keep working. Every field here must either be
honoured by the server or rejected in `__post_init__`; nothing is accepted and then ignored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenmill.config.utils import check_choices, check_range, config_field

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")


def _star() -> list[str]:
    return ["*"]


@dataclass
class FrontendConfig:
    """The OpenAI-compatible HTTP server: socket, CORS, authentication, TLS, chat templates, tools and logging."""
    # --- where to listen -------------------------------------------------------------------------------------
    host: str | None = config_field(None, help="Address to bind; unset = all interfaces.")
    port: int = config_field(8000, help="TCP port to listen on.")
    uds: str | None = config_field(None, help="Listen on this Unix domain socket instead of host:port.")
    root_path: str | None = config_field(None, help="ASGI root_path, for running behind a proxy that serves the "
                                                    "API under a path prefix.")
    # --- uvicorn / HTTP ----------------------------------------------------------------------------------------
    uvicorn_log_level: str = config_field("info", help="Log level of the uvicorn HTTP server.",
                                          choices=UVICORN_LOG_LEVELS)
    disable_uvicorn_access_log: bool = config_field(False, help="Do not log one line per HTTP request.")
    h11_max_incomplete_event_size: int = config_field(
        4194304, help="Largest partial HTTP event (headers or body chunk) the h11 parser buffers, in bytes.")
    h11_max_header_count: int = config_field(256, help="Most HTTP headers accepted in one request.")
    middleware: list[str] = config_field(
        help="Extra ASGI middleware, as import paths; repeat the flag for several. A function is added with "
             "@app.middleware('http'), a class with app.add_middleware().", default_factory=list)
    disable_fastapi_docs: bool = config_field(False, help="Do not serve /docs, /redoc and /openapi.json.")
    enable_request_id_headers: bool = config_field(False, help="Add an X-Request-Id header to every response.")
    disable_frontend_multiprocessing: bool = config_field(
        False, help="Run the engine in the API server's process instead of a separate one.")
    api_server_count: int = config_field(
        1, help="Number of API server processes; they share the port (SO_REUSEPORT) and each talks to every engine "
                "core.")
    headless: bool = config_field(
        False, help="Run only this node's data-parallel engine cores (ranks from --data-parallel-start-rank), "
                    "connected to the head node at --data-parallel-address:--data-parallel-rpc-port; no API server.")
    shutdown_timeout: int = config_field(0, help="Seconds to let running requests finish on shutdown; 0 aborts "
                                                 "them at once.")
    # --- CORS and authentication -----------------------------------------------------------------------------
    allow_credentials: bool = config_field(False, help="CORS: allow credentials (cookies, auth headers).")
    allowed_origins: list[str] = config_field(help="CORS: allowed origins.", default_factory=_star)
    allowed_methods: list[str] = config_field(help="CORS: allowed HTTP methods.", default_factory=_star)
    allowed_headers: list[str] = config_field(help="CORS: allowed request headers.", default_factory=_star)
    api_key: list[str] | None = config_field(
        None, help="Require one of these keys in the 'Authorization: Bearer <key>' header of /v1 requests.")
    # --- TLS -----------------------------------------------------------------------------------------------------
    ssl_keyfile: str | None = config_field(None, help="Private key file for HTTPS.")
    ssl_certfile: str | None = config_field(None, help="Certificate file for HTTPS.")
    ssl_ca_certs: str | None = config_field(None, help="CA certificates used to verify client certificates.")
    ssl_cert_reqs: int = config_field(0, help="Client certificates: 0 = not asked for, 1 = optional, "
                                              "2 = required (Python ssl.CERT_* values).")
    enable_ssl_refresh: bool = config_field(False, help="Reload the TLS certificate and key when their files "
                                                        "change.")
    # --- models, chat templates, tools and reasoning -------------------------------------------------------------
    lora_modules: list[str] | None = config_field(
        None, help="LoRA adapters to serve (with --enable-lora), each as name=path or a JSON object "
                   "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; they appear in /v1/models and a "
                   "request picks one by \"model\": \"<name>\".")
    chat_template: str | None = config_field(None, help="Chat template: a Jinja file path or the template text; "
                                                        "default: the tokenizer's.")
    chat_template_content_format: str = config_field(
        "auto", help="How message content reaches the template: string (plain text) or openai (a list of typed "
                     "parts); auto detects it from the template.", choices=CHAT_TEMPLATE_CONTENT_FORMATS)
    trust_request_chat_template: bool = config_field(
        False, help="Let requests supply their own chat_template (runs client-provided Jinja).")
    default_chat_template_kwargs: dict | None = config_field(
        None, help="Extra variables passed to every chat template render, e.g. '{\"enable_thinking\": false}'; "
                   "a request's chat_template_kwargs override them.")
    response_role: str = config_field("assistant", help="Role of the generated message when the request sets "
                                                        "add_generation_prompt.")
    return_tokens_as_token_ids: bool = config_field(
        False, help="Report logprob tokens as 'token_id:<id>' strings, so tokens that are not valid UTF-8 "
                    "stay identifiable.")
    enable_auto_tool_choice: bool = config_field(
        False, help="Let the model decide to call tools (tool_choice='auto'); needs --tool-call-parser.")
    exclude_tools_when_tool_choice_none: bool = config_field(
        False, help="Leave tool definitions out of the prompt when tool_choice is 'none'.")
    tool_call_parser: str | None = config_field(
        None, help="Parser that turns the model's tool-call text into OpenAI tool_calls (e.g. hermes, "
                   "qwen3_coder, llama3_json).")
    tool_parser_plugin: str = config_field("", help="Python file that registers extra tool parsers.")
    reasoning_parser: str = config_field("", help="Parser that separates reasoning text into reasoning_content "
                                                  "(e.g. deepseek_r1, qwen3).")
    reasoning_parser_plugin: str = config_field("", help="Python file that registers extra reasoning parsers.")
    structured_outputs_config: dict | None = config_field(
        None, help="Structured-output (JSON schema / regex / grammar) options as JSON, e.g. '{\"backend\": "
                   "\"auto\"}'.")
    # --- responses and logging -----------------------------------------------------------------------------------
    enable_prompt_tokens_details: bool = config_field(False, help="Include prompt_tokens_details (cached tokens) "
                                                                  "in usage.")
    enable_force_include_usage: bool = config_field(False, help="Send usage with every streamed response, "
                                                                "whatever the request asks.")
    enable_server_load_tracking: bool = config_field(False, help="Track in-flight requests for the /load "
                                                                 "endpoint.")
    enable_tokenizer_info_endpoint: bool = config_field(
        False, help="Serve /tokenizer_info (tokenizer settings and chat template).")
    disable_log_stats: bool = config_field(False, help="Do not log periodic engine statistics.")
    enable_log_requests: bool = config_field(False, help="Log each request's id and parameters (its prompt too at "
                                                         "DEBUG level).")
    enable_log_outputs: bool = config_field(False, help="Log each request's generated output (with "
                                                        "--enable-log-requests).")
    max_log_len: int | None = config_field(None, help="Truncate logged prompts and outputs to this many "
                                                      "characters or token ids; unset = no limit.")
    log_config_file: str | None = config_field(None, help="JSON file with a logging.config dictConfig for the "
                                                          "server's loggers.")

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers", "middleware"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
        if isinstance(self.api_key, str):
            self.api_key = [self.api_key]
        if isinstance(self.lora_modules, str):
            self.lora_modules = [self.lora_modules]
        if self.middleware is None:
            self.middleware = []
        check_choices(self)
        check_range("port", self.port, 0, 65535)
        check_range("h11_max_incomplete_event_size", self.h11_max_incomplete_event_size, 1)
        check_range("h11_max_header_count", self.h11_max_header_count, 1)
        check_range("shutdown_timeout", self.shutdown_timeout, 0)
        check_range("max_log_len", self.max_log_len, 0)
        check_range("api_server_count", self.api_server_count, 1)
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"Invalid value {self.ssl_cert_reqs!r} for `ssl_cert_reqs`: must be 0 (none), "
                             "1 (optional) or 2 (required).")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile was given without ssl_certfile; HTTPS needs both.")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (e.g. --tool-call-parser hermes).")
        if self.api_key is not None and not all(isinstance(k, str) and k for k in self.api_key):
            raise ValueError("api_key entries must be non-empty strings.")
        if self.api_server_count > 1 and self.uds:
            raise ValueError(f"api_server_count={self.api_server_count} needs a TCP port to share; it cannot be "
                             "combined with uds.")
        if self.headless and self.api_server_count > 1:
            raise ValueError("headless runs no API server; api_server_count must stay 1.")
        if self.lora_modules:
            from tokenmill.config.lora import parse_lora_modules
            parse_lora_modules(self.lora_modules)  # a malformed entry fails at start, naming it

    def check_tls_files(self) -> None:
        """Load the TLS files once before the engine starts: uvicorn would only read them after the model has
        loaded, and its error names neither the flag nor the file."""
        if not self.ssl_certfile:
            return
        import ssl
        files = (("ssl_certfile", self.ssl_certfile), ("ssl_keyfile", self.ssl_keyfile),
                 ("ssl_ca_certs", self.ssl_ca_certs))
        for name, path in files:
            if path and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file.")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (OSError, ssl.SSLError) as e:
            key = f" with --ssl-keyfile {self.ssl_keyfile}" if self.ssl_keyfile else ""
            raise ValueError(f"--ssl-certfile {self.ssl_certfile}{key}: cannot load the certificate and "
                             f"private key ({e}).") from None
        if self.ssl_ca_certs:
            try:
                ctx.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs {self.ssl_ca_certs}: cannot load the CA certificates ({e}).") \
                    from None

    @property
    def url(self) -> str:
        """Where clients reach this server (for log messages)."""
        if self.uds:
            return f"unix:{self.uds}"
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{self.host or '0.0.0.0'}:{self.port}"

    def cors_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for starlette's CORSMiddleware."""
        return dict(allow_origins=self.allowed_origins, allow_credentials=self.allow_credentials,
                    allow_methods=self.allowed_methods, allow_headers=self.allowed_headers)
