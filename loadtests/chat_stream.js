// k6 load test: stream chat completions at a fixed arrival rate with bounded concurrency.
//
//   k6 run -e BASE_URL=http://127.0.0.1:8000 -e RATE=4 -e VUS=16 -e DURATION=60s \
//          -e MAX_TOKENS=64 loadtests/chat_stream.js
//
// RATE: new streams per second (constant arrival rate); VUS: most streams open at once.
// k6 reads a streamed body whole, so per-token timing is not visible here: it reports the
// whole-stream time, streamed tokens, and checks the SSE framing. See loadtests/README.md.

import http from "k6/http";
import { check, fail } from "k6";
import { Counter, Rate, Trend } from "k6/metrics";

const BASE_URL = __ENV.BASE_URL || "http://127.0.0.1:8000";
const API_KEY = __ENV.API_KEY || "";
const MODEL = __ENV.MODEL || "";
const MAX_TOKENS = parseInt(__ENV.MAX_TOKENS || "64", 10);
const RATE = parseFloat(__ENV.RATE || "2");
const VUS = parseInt(__ENV.VUS || "8", 10);
const DURATION = __ENV.DURATION || "30s";
const IGNORE_EOS = (__ENV.IGNORE_EOS || "") !== "";

const PROMPTS = [
  "Name three colors.",
  "Write a haiku about the sea.",
  "What is the capital of France?",
  "Explain what a hash table is in two sentences.",
  "List five fruits.",
];

const streamDuration = new Trend("stream_duration", true);
const streamedTokens = new Counter("streamed_tokens");
const streamEvents = new Counter("stream_events");
const goodStreams = new Rate("good_streams");

export const options = {
  scenarios: {
    chat_streams: {
      executor: "constant-arrival-rate",
      rate: Math.max(1, Math.round(RATE * 100)),
      timeUnit: "100s", // rate per 100 s, so fractional RATE values work
      duration: DURATION,
      preAllocatedVUs: VUS,
      maxVUs: VUS,
    },
  },
  thresholds: {
    good_streams: ["rate>0.99"],
    http_req_failed: ["rate<0.01"],
  },
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (API_KEY) h["Authorization"] = `Bearer ${API_KEY}`;
  return h;
}

export function setup() {
  if (MODEL) return { model: MODEL };
  const res = http.get(`${BASE_URL}/v1/models`, { headers: headers() });
  if (res.status !== 200) fail(`GET /v1/models: HTTP ${res.status} ${res.body}`);
  return { model: res.json("data.0.id") };
}

export default function (data) {
  const body = {
    model: data.model,
    messages: [{ role: "user", content: PROMPTS[__ITER % PROMPTS.length] }],
    max_tokens: MAX_TOKENS,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (IGNORE_EOS) body.ignore_eos = true;
  const res = http.post(`${BASE_URL}/v1/chat/completions`, JSON.stringify(body), {
    headers: headers(),
    timeout: "600s",
    tags: { name: "chat_stream" },
  });
  const text = res.body || "";
  const events = text.split("\n\n").filter((e) => e.length > 0);
  let tokens = 0;
  let errors = 0;
  for (const event of events) {
    if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
    const chunk = JSON.parse(event.slice(6));
    if (chunk.error) errors++;
    if (chunk.usage) tokens = chunk.usage.completion_tokens;
  }
  const ok = check(res, {
    "status 200": (r) => r.status === 200,
    "event-stream": (r) => (r.headers["Content-Type"] || "").startsWith("text/event-stream"),
    "ends with [DONE]": () => text.endsWith("data: [DONE]\n\n"),
    "every event is data:": () => events.every((e) => e.startsWith("data: ")),
    "no error events": () => errors === 0,
    "tokens streamed": () => tokens > 0,
  });
  goodStreams.add(ok);
  streamDuration.add(res.timings.duration);
  streamEvents.add(events.length);
  streamedTokens.add(tokens);
}
