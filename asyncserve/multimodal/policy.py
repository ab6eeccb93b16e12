"""What a media URL may be: the allowed hosts and the size, pixel and time limits."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3


class MediaError(ValueError):
    """A media input that cannot be used: a refused URL, a failed fetch, or an image that does
    not decode or is over a limit. The message says which, in one line."""


def normalize_host(host: str) -> str:
    """The form hosts are compared in: lower case, IDNA-encoded, no trailing dot."""
    host = host.strip().rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise MediaError(f"host {host!r} is not a valid host name") from None


@dataclass(frozen=True)
class MediaPolicy:
    """Limits on fetching and decoding one image.

    `allowed_domains`: hosts that http(s) URLs may name (exact match, case-insensitive);
    empty: every http(s) URL is refused and only data: URLs are read.
    `allow_private_addresses`: also connect to loopback and private addresses. For tests
    against a local server only; no flag or engine argument sets it.
    """

    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = DEFAULT_TIMEOUT_S
    allow_redirects: bool = False
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    allow_private_addresses: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.allowed_domains, str):
            raise ValueError("allowed_domains must be a sequence of host names, not one string")
        object.__setattr__(
            self, "allowed_domains", tuple(normalize_host(d) for d in self.allowed_domains)
        )
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")

    def host_allowed(self, host: str) -> bool:
        return normalize_host(host) in self.allowed_domains
