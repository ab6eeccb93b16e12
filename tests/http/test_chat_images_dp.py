"""Chat with image parts against `serve -dp 2` (tiny LLaVA): both replicas answer, greedy
tokens equal one engine's, prompt tokens count the images, bad parts are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import ServerProcess, sse_events
from tests.http.test_chat_images import QUESTION, data_url, image_part
from tests.multimodal.conftest import random_image
from tests.multimodal.conftest import tiny_llava_dir as tiny_llava_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dp_llava(
    tiny_llava_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    args = [str(tiny_llava_dir), "-dp", "2", "--served-model-name", "llava", "--device", "cpu",
            "--max-model-len", "256", "--kv-cache-memory", str(16 << 20),
            "--limit-mm-per-prompt", '{"image": 2}', "--shutdown-timeout", "2"]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("dp-llava"))
    proc.wait_ready()
    yield proc
    code = proc.stop()
    logs = proc.logs()
    assert code == 0, f"server exited with {code}:\n{logs[-4000:]}"
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


def _chat(server: ServerProcess, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "llava", "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _requests_per_engine(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "asyncserve:request_success_total" and s.labels.get("engine"):
                engine = s.labels["engine"]
                out[engine] = out.get(engine, 0.0) + s.value
    return out


def test_dp2_chat_with_images_matches_one_engine(
    dp_llava: ServerProcess,
    tiny_llava_dir: Path,  # noqa: F811
) -> None:
    first, second = random_image(60), random_image(61, 64, 30)
    contents = [
        [image_part(data_url(first)), QUESTION],
        [image_part(data_url(first)), image_part(data_url(second)), QUESTION],
    ] * 3
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda c: _chat(dp_llava, c), contents))
    for reply in replies:
        assert reply.status_code == 200, reply.text
    tokens = [r.json()["choices"][0]["token_ids"] for r in replies]
    usage = [r.json()["usage"]["prompt_tokens"] for r in replies]
    assert tokens[0::2] == [tokens[0]] * 3 and tokens[1::2] == [tokens[1]] * 3
    assert usage[1] == usage[0] + 17  # the second image's 16 rows and "\n"
    per_engine = _requests_per_engine(dp_llava.base_url)
    assert per_engine["0"] > 0 and per_engine["1"] > 0, per_engine

    from asyncserve.llm import LLM
    from asyncserve.sampling_params import SamplingParams

    llm = LLM(str(tiny_llava_dir), device="cpu", max_model_len=256, kv_cache_memory=16 << 20)
    try:
        offline = llm.chat(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": first}, QUESTION]}],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )[0]
    finally:
        llm.close()
    assert tokens[0] == list(offline.outputs[0].token_ids)
    # Streamed, the same text arrives in chunks.
    body = {"model": "llava", "messages": [{"role": "user", "content": contents[0]}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    raw = httpx.post(f"{dp_llava.base_url}/v1/chat/completions", json=body, timeout=120).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    text = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert text == offline.outputs[0].text


def test_dp2_bad_image_parts_are_400s(dp_llava: ServerProcess) -> None:
    image = random_image(62)
    bad = _chat(dp_llava, [image_part("data:image/png;base64,bm90IGFuIGltYWdl"), QUESTION])
    assert (
        bad.status_code == 400
        and bad.json()["error"]["param"] == "messages[0].content[0].image_url"
    )
    many = _chat(dp_llava, [image_part(data_url(image))] * 3 + [QUESTION])
    assert many.status_code == 400 and many.json()["error"]["param"] == "messages[0].content[2]"
    tokenized = httpx.post(f"{dp_llava.base_url}/tokenize", timeout=60, json={
        "model": "llava", "messages": [{"role": "user", "content": [image_part(data_url(image))]}]})  # fmt: skip
    assert tokenized.status_code == 200, tokenized.text
    assert _chat(dp_llava, [image_part(data_url(image)), QUESTION]).status_code == 200
