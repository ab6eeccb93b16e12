"""Images in chat over HTTP: data: URLs through the OpenAI SDK against a tiny LLaVA server,
equal to the offline engine's tokens; 400s naming the bad part."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import ServerProcess
from tests.multimodal.conftest import random_image
from tests.multimodal.conftest import tiny_llava_dir as tiny_llava_dir  # noqa: F401 (fixture)

QUESTION = {"type": "text", "text": "What is in the picture?"}


def data_url(image: Any, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def png_header_url(width: int, height: int) -> str:
    """A PNG data: URL whose header claims width x height (a decompression bomb's shape)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return "data:image/png;base64," + base64.b64encode(png + chunk(b"IEND", b"")).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava_server(
    tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:  # noqa: F811
    args = [str(tiny_llava_dir), "--served-model-name", "llava", "--device", "cpu",
            "--max-model-len", "256", "--kv-cache-memory", str(16 << 20),
            "--limit-mm-per-prompt", '{"image": 2}']  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("llava-server"))
    proc.wait_ready()
    yield proc
    code = proc.stop()
    logs = proc.logs()
    assert code == 0, f"server exited with {code}:\n{logs[-4000:]}"
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


def _chat(server: ServerProcess, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "llava", "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def test_openai_sdk_chat_with_images(llava_server: ServerProcess, tiny_llava_dir: Path) -> None:  # noqa: F811
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llava_server.base_url}/v1", api_key="x", max_retries=0)
    first, second = random_image(70), random_image(71, 64, 30)

    def ask(content: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model="llava",
            messages=[{"role": "user", "content": content}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )

    one = ask([image_part(data_url(first)), QUESTION])
    jpeg = ask([image_part(data_url(second, "JPEG")), QUESTION])
    two = ask([image_part(data_url(first)), image_part(data_url(second)), QUESTION])
    assert one.usage.completion_tokens == 6
    # Each image takes 16 placeholder positions.
    assert two.usage.prompt_tokens == one.usage.prompt_tokens + 17  # 16 rows and "\n"
    assert one.choices[0].message.content != jpeg.choices[0].message.content

    from asyncserve.llm import LLM

    llm = LLM(str(tiny_llava_dir), device="cpu", max_model_len=256, kv_cache_memory=16 << 20)
    try:
        from asyncserve.sampling_params import SamplingParams

        offline = llm.chat(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": first}, QUESTION]}],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )[0]
    finally:
        llm.close()
    assert one.choices[0].message.content == offline.outputs[0].text


def test_bad_image_parts_are_400s(llava_server: ServerProcess) -> None:
    image = random_image(80)
    cases = [
        ([image_part("data:image/png;base64,bm90IGFuIGltYWdl"), QUESTION],
         "messages[0].content[0].image_url"),
        ([image_part(data_url(image))] * 3 + [QUESTION], "messages[0].content[2]"),
        ([image_part("http://127.0.0.1:1/cat.png"), QUESTION], "messages[0].content[0].image_url"),
        ([{"type": "image_url"}, QUESTION], "messages[0].content[0].image_url"),
        ([{"type": "input_audio"}, QUESTION], "messages[0].content[0].type"),
        # Too large: a header claiming 20000 x 20000 pixels, refused before decoding.
        ([QUESTION, image_part(png_header_url(20000, 20000))], "messages[0].content[1].image_url"),
    ]  # fmt: skip
    for content, param in cases:
        response = _chat(llava_server, content)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    # Placeholders without images, in a completion or a chat.
    body = {"model": "llava", "prompt": "USER: <image>\nHi", "max_tokens": 2}
    response = httpx.post(f"{llava_server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "no image was given" in response.json()["error"]["message"]
    # Typed in the text, alone or beside an image part: a 400 naming the text.
    for content, param in (
        ([{"type": "text", "text": "<image> hi"}], "messages[0].content"),  # text only: a string
        ([image_part(data_url(image)), {"type": "text", "text": "see <image>"}],
         "messages[0].content[1].text"),
    ):  # fmt: skip
        response = _chat(llava_server, content)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    # The server still answers.
    assert _chat(llava_server, [image_part(data_url(image)), QUESTION]).status_code == 200


def test_image_to_text_only_model_is_400(client: httpx.Client) -> None:
    body = {"model": "smol", "max_tokens": 2, "messages": [
        {"role": "user", "content": [QUESTION, image_part(data_url(random_image(90)))]}]}  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1].type"
    assert "text-only" in error["message"]


def test_chat_batch_takes_image_parts(llava_server: ServerProcess) -> None:
    # Each conversation answers as the single route answers it alone.
    first, second = data_url(random_image(94)), data_url(random_image(95, 64, 30))
    conversations = [
        [image_part(first), QUESTION],
        [QUESTION],
        [image_part(first), image_part(second), QUESTION],
    ]
    body: dict[str, Any] = {"model": "llava", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "messages": [[{"role": "user", "content": c}] for c in conversations]}  # fmt: skip
    url = f"{llava_server.base_url}/v1/chat/completions/batch"
    batch = httpx.post(url, json=body, timeout=120)
    assert batch.status_code == 200, batch.text
    singles = [_chat(llava_server, content).json() for content in conversations]
    choices = batch.json()["choices"]
    assert [c["message"] for c in choices] == [s["choices"][0]["message"] for s in singles]
    prompt_tokens = sum(s["usage"]["prompt_tokens"] for s in singles)
    assert batch.json()["usage"]["prompt_tokens"] == prompt_tokens
    # A bad part is a 400 naming its conversation.
    body["messages"][1][0]["content"] = [image_part("data:image/png;base64,bm90"), QUESTION]
    refused = httpx.post(url, json=body, timeout=120)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages[1][0].content[0].image_url"


def test_chat_batch_image_to_text_only_model_is_400(client: httpx.Client) -> None:
    content = [QUESTION, image_part(data_url(random_image(96)))]
    single = {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    one = client.post("/v1/chat/completions", json=single)
    conversations = [[{"role": "user", "content": "Hi"}], single["messages"]]
    batch = client.post("/v1/chat/completions/batch", json={**single, "messages": conversations})
    assert one.status_code == batch.status_code == 400, batch.text
    assert batch.json()["error"]["message"] == one.json()["error"]["message"]
    assert batch.json()["error"]["param"] == "messages[1][0].content[1].type"


def test_image_larger_than_the_text_body_limit(llava_server: ServerProcess) -> None:
    # max_model_len 256 gives text bodies 1 MiB; a model that takes images also gets room
    # for the data: URLs of --limit-mm-per-prompt images of the media byte limit.
    url = data_url(random_image(91, 700, 700))
    assert len(url) > 1 << 20
    response = _chat(llava_server, [image_part(url), QUESTION])
    assert response.status_code == 200, response.text


def test_tokenize_chat_with_an_image_counts_as_the_chat(llava_server: ServerProcess) -> None:
    content = [image_part(data_url(random_image(92))), QUESTION]
    messages = [{"role": "user", "content": content}]
    body = {"model": "llava", "messages": messages, "add_generation_prompt": True}
    tokens = httpx.post(f"{llava_server.base_url}/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    chat = _chat(llava_server, content)
    assert tokens.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    placeholder = {"model": "llava", "prompt": "<image>", "add_special_tokens": False}
    [image_id] = httpx.post(f"{llava_server.base_url}/tokenize", json=placeholder).json()["tokens"]
    assert tokens.json()["tokens"].count(image_id) == 16  # the image's rows
    # The chat limits hold: three images where two may go.
    body["messages"] = [{"role": "user", "content": [image_part(data_url(random_image(93)))] * 3}]
    refused = httpx.post(f"{llava_server.base_url}/tokenize", json=body, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[0].content[2]"
