"""speculative_config: vLLM's keys and defaults; bad values are one-line errors at start."""

from __future__ import annotations

import numpy as np
import pytest

from asyncserve.cli import build_parser, engine_config_from_args, main
from asyncserve.config import EngineConfig, Environment
from asyncserve.core.request import Request
from asyncserve.sampling_params import SamplingParams
from asyncserve.spec_decode.config import SpeculativeConfig
from asyncserve.spec_decode.ngram_proposer import NgramProposer
from asyncserve.spec_decode.proposals import take_proposals


def test_ngram_keys_and_defaults() -> None:
    config = SpeculativeConfig.from_value(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (3, 4)
    assert config.prompt_lookup_max == 4
    both = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)


def test_serve_flag_reaches_the_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    env = Environment(api_key=None, default_model=None, log_level="INFO")
    spec = engine_config_from_args(args, env).speculative
    assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 4
    assert EngineConfig.from_engine_args().speculative is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', "num_speculative_tokens"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}',
         "prompt_lookup_min"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
        ("{method: ngram}", "not valid JSON"),
    ],
)  # fmt: skip
def test_bad_config_is_one_line_at_start(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # serve checks its configs before it binds the port or loads a model.
    assert main(["serve", "--speculative-config", value]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize(
    ("tokens", "proposal"),
    [
        # The latest match of the longest suffix wins: "1 2" was followed by 7 last.
        ([1, 2, 3, 1, 2, 7, 5, 1, 2], [7, 5, 1]),
        # No 3-gram or 2-gram match; the 1-gram "4" matches.
        ([4, 9, 8, 6, 4], [9, 8, 6]),
        ([1, 2, 3], []),
        ([5], []),
        # A match near the end proposes what is there.
        ([3, 3], [3]),
    ],
)
def test_ngram_proposals(tokens: list[int], proposal: list[int]) -> None:
    proposer = NgramProposer(num_speculative_tokens=3, lookup_min=1, lookup_max=3)
    assert proposer.propose(np.asarray(tokens, dtype=np.int64)) == proposal


def test_ngram_respects_the_minimum() -> None:
    proposer = NgramProposer(num_speculative_tokens=2, lookup_min=2, lookup_max=3)
    assert proposer.propose(np.asarray([4, 9, 8, 6, 4], dtype=np.int64)) == []


def _request(num_output: int, max_tokens: int) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(), max_tokens=max_tokens)
    request.output_token_ids = [4] * num_output
    request.spec_token_ids = [5, 6, 7, 8]
    return request


@pytest.mark.parametrize(
    ("num_output", "max_tokens", "num_new", "budget", "max_model_len", "taken"),
    [
        (1, 16, 1, 100, 64, 4),
        (1, 16, 1, 3, 64, 2),  # the token budget holds the decode token and two proposals
        (1, 4, 1, 100, 64, 2),  # 3 more tokens at most: 2 proposals + the target's own
        (1, 16, 1, 100, 7, 2),  # 4 tokens now, max_model_len 7
        (1, 2, 1, 100, 64, 0),
        (1, 16, 5, 100, 64, 0),  # not a decode step
    ],
)
def test_proposals_are_cut_to_the_limits(
    num_output: int, max_tokens: int, num_new: int, budget: int, max_model_len: int, taken: int
) -> None:
    request = _request(num_output, max_tokens)
    assert take_proposals(request, num_new, budget, max_model_len) == [5, 6, 7, 8][:taken]
    assert request.spec_token_ids == []  # used once, whatever was taken
