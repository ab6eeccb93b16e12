"""Locust load test: users stream chat completions from an asyncserve (or any OpenAI-
compatible) server and report time to first token, streamed tokens and whole-stream time.

    locust -f loadtests/locustfile.py --headless -u 16 -r 4 -t 60s \
        --host http://127.0.0.1:8000 --max-tokens 64 --rate-per-user 0.5

-u sets the concurrency (users, one stream each at a time); --rate-per-user caps each user's
request rate (0: back to back). See loadtests/README.md.
"""

from __future__ import annotations

import json
import time
from typing import Any

from locust import HttpUser, events, task
from locust.env import Environment

PROMPTS = [
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "List five fruits.",
]


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    parser.add_argument("--model", default="", help="model name (default: the server's first)")
    parser.add_argument("--api-key", default="", help="sent as `Authorization: Bearer <key>`")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument(
        "--rate-per-user",
        type=float,
        default=0.0,
        help="requests per second per user (0: back to back)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        default=False,
        help="generate exactly --max-tokens (asyncserve/vLLM extension)",
    )


def _headers(environment: Environment) -> dict[str, str]:
    key = environment.parsed_options.api_key if environment.parsed_options else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


class ChatStreamUser(HttpUser):
    """One user = one open stream at a time."""

    model = ""

    def wait_time(self) -> float:
        options = self.environment.parsed_options
        rate = options.rate_per_user if options else 0.0
        if rate <= 0:
            return 0.0
        # Constant throughput: wait out the rest of this request's 1/rate slot.
        return max(0.0, 1.0 / rate - getattr(self, "_last_duration", 0.0))

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.model = options.model if options and options.model else ""
        if not self.model:
            response = self.client.get(
                "/v1/models", headers=_headers(self.environment), name="/v1/models"
            )
            self.model = response.json()["data"][0]["id"]
        self._count = 0

    @task
    def stream_chat(self) -> None:
        options = self.environment.parsed_options
        self._count += 1
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": PROMPTS[self._count % len(PROMPTS)]}],
            "max_tokens": options.max_tokens if options else 64,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options and options.ignore_eos:
            body["ignore_eos"] = True
        start = time.perf_counter()
        first_token: float | None = None
        tokens = 0
        done = False
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=_headers(self.environment),
            stream=True,
            catch_response=True,
            name="/v1/chat/completions (stream)",
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    response.failure(f"error event: {chunk['error'].get('message')}")
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if first_token is None and any(
                    c.get("delta", {}).get("content") for c in chunk.get("choices", [])
                ):
                    first_token = time.perf_counter()
            if not done:
                response.failure("stream ended without data: [DONE]")
                return
            response.success()
        end = time.perf_counter()
        self._last_duration = end - start
        fire = self.environment.events.request.fire
        if first_token is not None:
            fire(
                request_type="SSE",
                name="time to first token",
                response_time=(first_token - start) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        if tokens > 1 and first_token is not None:
            fire(
                request_type="SSE",
                name="time per output token",
                response_time=(end - first_token) * 1000 / (tokens - 1),
                response_length=tokens,
                exception=None,
                context={},
            )
