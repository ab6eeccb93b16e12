"""Qwen2.5-VL over HTTP against hostile images (tiny checkpoint): odd sizes and modes are
answered or refused with a 400 naming the part; the image processor's max_pixels bounds the
image tokens; more image tokens than max_model_len holds is a 400, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import ServerProcess
from tests.http.test_chat_images import data_url, image_part, png_header_url
from tests.models.qwen2_5_vl_tiny import MAX_PIXELS
from tests.models.test_qwen2_5_vl import tiny_dir as tiny_dir  # noqa: F401 (fixture)
from tests.multimodal.conftest import random_image

pytestmark = pytest.mark.timeout(300)
QUESTION = {"type": "text", "text": "What is it?"}
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def qwen_server(
    tiny_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    args = [str(tiny_dir), "--served-model-name", "qwen", "--device", "cpu",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(16 << 20),
            "--limit-mm-per-prompt", '{"image": 40}', "--shutdown-timeout", "2"]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("qwen-vl-server"))
    proc.wait_ready()
    yield proc
    code = proc.stop()
    logs = proc.logs()
    assert code == 0, f"server exited with {code}:\n{logs[-4000:]}"
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


def _chat(server: ServerProcess, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "qwen", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True}  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _solid(width: int, height: int, mode: str = "RGB", fmt: str = "PNG") -> str:
    from PIL import Image

    color: Any = 200 if mode in ("L", "P", "I;16", "1") else (10, 200, 30, 128)[: len(mode)]
    return data_url(Image.new(mode, (width, height), color), fmt)


def _prompt_tokens(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


def test_odd_sizes_and_modes(qwen_server: ServerProcess) -> None:
    text_only = _prompt_tokens(_chat(qwen_server, [QUESTION]))
    # 1x1 and 1x150 pixels are scaled up to min_pixels; 4000x3000 down to max_pixels.
    for width, height in [(1, 1), (150, 1), (1, 150), (4000, 3000)]:
        tokens = _prompt_tokens(_chat(qwen_server, [image_part(_solid(width, height)), QUESTION]))
        assert tokens > text_only
    big = _prompt_tokens(_chat(qwen_server, [image_part(_solid(4000, 3000)), QUESTION]))
    assert big - text_only <= MAX_PIXELS // (28 * 28) + 2  # rows, vision start and end
    for mode, fmt in [("L", "PNG"), ("P", "GIF"), ("RGBA", "PNG"), ("LA", "PNG"),
                      ("I;16", "PNG"), ("1", "PNG"), ("CMYK", "JPEG")]:  # fmt: skip
        reply = _chat(qwen_server, [image_part(_solid(40, 30, mode, fmt)), QUESTION])
        assert reply.status_code == 200, (mode, reply.text)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (_solid(1, 10000), "aspect ratio"),
        (_solid(10000, 1), "aspect ratio"),
        (png_header_url(20000, 20000), "pixels"),
        (png_header_url(0, 10), "image"),
    ],
)
def test_refused_images_are_400s(qwen_server: ServerProcess, url: str, words: str) -> None:
    reply = _chat(qwen_server, [QUESTION, image_part(url)])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert words in error["message"], error
    assert error["param"] == "messages[0].content[1].image_url", error


def test_more_image_tokens_than_max_model_len(qwen_server: ServerProcess) -> None:
    image = image_part(data_url(random_image(5, 120, 110)))
    reply = _chat(qwen_server, [image] * 30 + [QUESTION])
    assert reply.status_code == 400, reply.text
    assert str(MAX_MODEL_LEN) in reply.json()["error"]["message"]
    # The server still answers.
    assert _chat(qwen_server, [image, QUESTION]).status_code == 200


def test_per_request_processor_kwargs_are_refused(qwen_server: ServerProcess) -> None:
    # The checkpoint's max_pixels bounds every image; a request cannot raise it.
    body = {"model": "qwen", "max_tokens": 2,
            "messages": [{"role": "user", "content": [image_part(_solid(64, 64)), QUESTION]}],
            "mm_processor_kwargs": {"max_pixels": 10**12}}  # fmt: skip
    reply = httpx.post(f"{qwen_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "mm_processor_kwargs" in reply.text
