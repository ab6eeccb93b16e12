"""Multimodal inputs: which hosts media URLs may name, images per prompt, fetch timeout."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncserve.config.typecheck import check_fields

if TYPE_CHECKING:
    from asyncserve.multimodal.policy import MediaPolicy

MODALITIES = ("image", "video", "audio")
# Images one prompt may carry unless limit_mm_per_prompt says otherwise; other modalities: 0.
DEFAULT_IMAGE_LIMIT = 4
DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0


def _default_limits() -> dict[str, int]:
    return {"image": DEFAULT_IMAGE_LIMIT}


def _check_domain(domain: Any) -> str:
    if not isinstance(domain, str) or not domain.strip():
        raise ValueError(f"allowed_media_domains: {domain!r} is not a host name")
    host = domain.strip().rstrip(".").lower()
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]")
    except ValueError:
        pass
    if "/" in host or ":" in host or "@" in host or " " in host:
        raise ValueError(
            f"allowed_media_domains: {domain!r} is not a host name (give hosts such as "
            "'example.com', without scheme, port or path)"
        )
    return host


def parse_allowed_media_domains(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """Host names from a list or one string of them separated by spaces or commas."""
    if value is None:
        return ()
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    return tuple(dict.fromkeys(_check_domain(d) for d in items))


def parse_limit_mm_per_prompt(value: str | Mapping[str, Any] | None) -> dict[str, int]:
    """vLLM's form: '{"image": 2}' (JSON text or a dict); a modality's value may also be
    {"count": n, ...}. Modalities not named keep their default."""
    limits = _default_limits()
    if value is None:
        return limits
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt: not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError('limit_mm_per_prompt must be a JSON object such as {"image": 2}')
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt: unknown modality {modality!r} (one of {', '.join(MODALITIES)})"
            )
        count = limit.get("count") if isinstance(limit, Mapping) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"limit_mm_per_prompt: {modality!r} must be an integer >= 0, got {limit!r}"
            )
        limits[modality] = count
    return limits


@dataclass(frozen=True)
class MultiModalConfig:
    """`allowed_media_domains`: hosts http(s) media URLs may name; none: only data: URLs.
    `limit_mm_per_prompt`: most items of each modality in one prompt."""

    allowed_media_domains: tuple[str, ...] = ()
    limit_mm_per_prompt: dict[str, int] = field(default_factory=_default_limits, hash=False)
    media_fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "allowed_media_domains", parse_allowed_media_domains(self.allowed_media_domains)
        )
        object.__setattr__(
            self, "limit_mm_per_prompt", parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        )
        check_fields(self)
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(
                "media fetch timeout (ASYNCSERVE_IMAGE_FETCH_TIMEOUT) must be > 0, got "
                f"{self.media_fetch_timeout_s}"
            )

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, 0)

    def media_policy(self) -> MediaPolicy:
        """The fetch and decode limits media URLs are read under."""
        from asyncserve.multimodal.policy import MediaPolicy

        return MediaPolicy(
            allowed_domains=self.allowed_media_domains, timeout_s=self.media_fetch_timeout_s
        )
