"""Schemathesis against the real server's /openapi.json: bodies generated from each
endpoint's schema, valid and not, must never get a 5xx. Generation lengths are capped in the
schema under test so that valid requests stay a few tokens long on CPU."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.http.conftest import API_KEY, ServerProcess

pytestmark = pytest.mark.timeout(300)
# Field -> the most the schema under test allows, so that valid requests are quick.
_CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "min_tokens": 3, "n": 2, "best_of": 2}
# Skipped: /invocations has no body schema (it routes /v1/*'s); the rest are GETs covered
# elsewhere.
_METHOD = "POST"


def _cap(schema: dict[str, Any]) -> dict[str, Any]:
    for name, component in schema["components"]["schemas"].items():
        if not name.endswith("Request"):
            continue
        for field, prop in component.get("properties", {}).items():
            if field in _CAPS:
                for branch in prop.get("anyOf", [prop]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = _CAPS[field]
    return schema


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    spec = httpx.get(
        f"{server.base_url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()
    return schemathesis.openapi.from_dict(_cap(spec)).include(method=_METHOD)


def test_no_server_errors(api_schema: Any, server: ServerProcess) -> None:
    """Each POST endpoint in turn (schemathesis' pytest plugin is not used: one test,
    hypothesis driven directly)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 6, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=8,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            body = case.body
            limits = ("max_tokens", "max_completion_tokens")
            if isinstance(body, dict) and all(body.get(key) is None for key in limits):
                # A chat request without either (absent or null: the default) runs to
                # max_model_len: minutes on CPU.
                body["max_tokens"] = 3
            case.call_and_validate(
                base_url=server.base_url, headers=headers, checks=[not_a_server_error], timeout=60
            )

        check()
