"""The short way to a text-only chat chunk gives the bytes the general path encodes."""

from __future__ import annotations

import json

import pytest

from asyncserve.http.chat import _Job, _TextChunks
from asyncserve.http.protocol import ChatStreamChoice, DeltaMessage


def _job(request_id: str, model: str) -> _Job:
    job = _Job.__new__(_Job)  # chunk() reads only these three
    job.id, job.created, job.model = request_id, 1_700_000_000, model
    return job


@pytest.mark.parametrize(
    "text", [" the", 'a "quoted" \\ word', "naïve 東京 🎉", "\n\t\u0000", '"content":""']
)
@pytest.mark.parametrize("index", [0, 3])
def test_text_chunk_matches_the_general_chunk(text: str, index: int) -> None:
    # An id and model holding the split mark themselves: JSON escapes their quotes.
    job = _job('chatcmpl-x"content":""y', 'm"content":""')
    fast = _TextChunks(job)
    general = job.chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=text))])
    assert fast(index, text) == general
    assert fast(index, text) == general  # from the cached parts too
    event = json.loads(general.removeprefix(b"data: "))
    assert event["choices"][0]["delta"] == {"content": text}
    assert event["choices"][0]["finish_reason"] is None
