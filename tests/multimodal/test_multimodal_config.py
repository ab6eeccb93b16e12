"""The multimodal section: --allowed-media-domains, --limit-mm-per-prompt, the fetch timeout
from ASYNCSERVE_IMAGE_FETCH_TIMEOUT, and the MediaPolicy they give."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncserve.cli import build_parser, engine_config_from_args, main
from asyncserve.cli_server import expand_config_file
from asyncserve.config import EngineConfig, Environment, MultiModalConfig
from asyncserve.config.multimodal import DEFAULT_IMAGE_LIMIT
from asyncserve.multimodal.media import MediaError, load_image

NO_ENV = Environment(api_key=None, default_model=None, log_level="INFO")


def test_defaults_refuse_every_http_url() -> None:
    config = EngineConfig.from_engine_args()
    assert config.multimodal.allowed_media_domains == ()
    assert config.multimodal.limit("image") == DEFAULT_IMAGE_LIMIT
    assert config.multimodal.limit("video") == 0
    policy = config.multimodal.media_policy()
    assert policy.allowed_domains == () and policy.timeout_s == 10.0
    assert not policy.allow_private_addresses
    with pytest.raises(MediaError, match="need --allowed-media-domains"):
        load_image("https://example.com/cat.png", policy)


def test_serve_flags() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--allowed-media-domains", "Upload.Example.com", "cdn.example.org.",
            "--limit-mm-per-prompt", '{"image": 2, "video": {"count": 1}}',
        ]
    )  # fmt: skip
    multimodal = engine_config_from_args(args, NO_ENV).multimodal
    assert multimodal.allowed_media_domains == ("upload.example.com", "cdn.example.org")
    assert multimodal.limit_mm_per_prompt == {"image": 2, "video": 1}
    assert multimodal.media_policy().host_allowed("UPLOAD.example.com")


def test_engine_arguments_accept_strings_and_dicts() -> None:
    config = EngineConfig.from_engine_args(
        allowed_media_domains="a.example, b.example", limit_mm_per_prompt={"image": 0}
    )
    assert config.multimodal.allowed_media_domains == ("a.example", "b.example")
    assert config.multimodal.limit("image") == 0
    assert MultiModalConfig(limit_mm_per_prompt={}).limit("image") == DEFAULT_IMAGE_LIMIT


def test_fetch_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSERVE_IMAGE_FETCH_TIMEOUT", "2.5")
    assert EngineConfig.from_engine_args().multimodal.media_policy().timeout_s == 2.5
    monkeypatch.setenv("ASYNCSERVE_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ASYNCSERVE_IMAGE_FETCH_TIMEOUT must be a number"):
        EngineConfig.from_engine_args()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"limit_mm_per_prompt": '{"image": -1}'}, "'image' must be an integer >= 0"),
        ({"limit_mm_per_prompt": '{"image": "2"}'}, "'image' must be an integer >= 0"),
        ({"limit_mm_per_prompt": '{"smell": 1}'}, "unknown modality 'smell'"),
        ({"limit_mm_per_prompt": "[1]"}, "must be a JSON object"),
        ({"limit_mm_per_prompt": "{image: 1}"}, "not valid JSON"),
        ({"allowed_media_domains": ["https://example.com"]}, "without scheme, port or path"),
        ({"allowed_media_domains": ["example.com:8080"]}, "without scheme, port or path"),
        ({"allowed_media_domains": [""]}, "is not a host name"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(**kwargs)  # type: ignore[arg-type]


def test_bad_flag_exits_2_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--allowed-media-domains", "http://example.com/"]) == 2
    err = capsys.readouterr().err
    assert "allowed_media_domains" in err and len(err.strip().splitlines()) == 1


def test_yaml_config_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        "allowed-media-domains: [a.example, b.example]\nlimit_mm_per_prompt: {image: 3}\n"
    )
    parser = build_parser()
    argv = expand_config_file(
        ["serve", "--config", str(tmp_path / "c.yaml")], parser.get_default("serve_parser")
    )
    multimodal = engine_config_from_args(parser.parse_args(argv), NO_ENV).multimodal
    assert multimodal.allowed_media_domains == ("a.example", "b.example")
    assert multimodal.limit("image") == 3
