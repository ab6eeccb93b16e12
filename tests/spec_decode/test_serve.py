"""`serve --speculative-config`: completions (streamed too) as without it, and the metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams
from tests.http.conftest import ServerProcess, require_model
from tests.spec_decode.test_ngram_engine import COUNTING, NGRAM


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model()
    args = ["--max-model-len", "512", "--kv-cache-memory", "64M",
            "--speculative-config", json.dumps(NGRAM)]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("spec-server"))
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.logs()


def test_completions_match_and_metrics_count(
    spec_server: ServerProcess, smollm2_llm: LLM, gguf_path: Path
) -> None:
    expected = (
        smollm2_llm.generate(
            [COUNTING], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    body = {"prompt": COUNTING, "max_tokens": 24, "temperature": 0}
    url = f"{spec_server.base_url}/v1/completions"
    with httpx.Client(timeout=120) as client:
        reply = client.post(url, json=body).json()
        assert reply["choices"][0]["text"] == expected
        assert reply["usage"]["completion_tokens"] == 24
        streamed = ""
        with client.stream("POST", url, json={**body, "stream": True}) as events:
            for line in events.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:])["choices"]
                    streamed += "".join(c["text"] for c in choices)
        assert streamed == expected
        metrics = client.get(f"{spec_server.base_url}/metrics").text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("asyncserve:spec_decode_") and "position" not in line
    }
    assert values["asyncserve:spec_decode_num_drafts_total"] > 0
    assert (
        values["asyncserve:spec_decode_num_accepted_tokens_total"]
        > 0.9 * values["asyncserve:spec_decode_num_draft_tokens_total"]
    )
    assert "asyncserve:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in metrics
