"""The OpenAI-compatible HTTP server's configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server: where it listens, who may call it, its limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Names the model answers to (the first is reported as the response's model); empty: the
    # model path's name.
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # Seconds running requests get to finish after SIGTERM.
    shutdown_timeout: float = 30.0
    # Characters (or token ids) of a prompt written to the request log; None: all of it.
    max_log_len: int | None = None
    enable_log_requests: bool = False
    disable_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    # 503 + Retry-After once this many requests wait to be scheduled; None: no limit.
    max_waiting_requests: int | None = None
    # Larger bodies get 413; None: derived from max_model_len (http/limits.py).
    max_request_body_bytes: int | None = None
    # Seconds a client gets to send a request's headers, then its body (408 after), and
    # an idle keep-alive connection stays open; None: no limit.
    timeout_request_header: float | None = 10.0
    timeout_request_body: float | None = 60.0
    timeout_keep_alive: float = 5.0
    # Connections (and requests) served at once; more get 503. None: no limit.
    limit_concurrency: int | None = None
    log_level: str = "info"
    # Behind a path-prefix proxy: the prefix the proxy strips (ASGI root_path), e.g. "/llm".
    root_path: str = ""
    # CORS, as vLLM configures it (every origin, method and header by default).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Echo X-Request-Id (the client's, else a fresh one) on every response.
    enable_request_id_headers: bool = False
    # A usage chunk (and per-chunk usage) on every stream, whatever stream_options say.
    enable_force_include_usage: bool = False
    # Timing metrics (`metrics`) in single-sequence responses.
    enable_per_request_metrics: bool = False
    # Count in-flight generation requests for /load.
    enable_server_load_tracking: bool = False
    # Tokens in logprobs as "token_id:<id>" unless the request says otherwise.
    return_tokens_as_token_ids: bool = False
    # Most logprobs (and prompt_logprobs) a request may ask for; -1: the vocabulary size.
    max_logprobs: int = 20
    # A chat template (its text) used instead of the tokenizer's; None: the tokenizer's.
    chat_template: str | None = None
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none: the
    # OpenAI defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # LoRA adapters served from the start: (name, path) pairs (--lora-modules).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (they change what the server runs).
    allow_runtime_lora_updating: bool = False
    # Tool calling: tool_choice "auto" parses the output with this parser (vLLM's names).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # /metrics names: "both" (asyncserve: and vLLM's vllm:), "vllm" or "asyncserve".
    metrics_prefix: str = "both"

    def __post_init__(self) -> None:
        if self.metrics_prefix not in ("both", "vllm", "asyncserve"):
            raise ValueError(
                f"metrics_prefix must be both, vllm or asyncserve, got {self.metrics_prefix!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("timeout_request_header", "timeout_request_body"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.timeout_keep_alive <= 0:
            raise ValueError(f"timeout_keep_alive must be > 0, got {self.timeout_keep_alive}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile must be given together")
        lora_names = [name for name, _ in self.lora_modules]
        if len(set(lora_names)) != len(lora_names):
            raise ValueError(f"lora_modules: a name appears twice in {lora_names}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one, got {self.root_path!r}"
            )
