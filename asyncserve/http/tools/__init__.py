"""Tool calling on /v1/chat/completions: request checks, forced-call schemas, and the
parsers that turn a model's text into OpenAI tool calls (whole or streamed)."""
