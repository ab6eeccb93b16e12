from __future__ import annotations

import pytest

from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.registry import SUPPORTED_ARCHITECTURES, resolve_model_class


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_supported_architectures_resolve(arch: str) -> None:
    assert resolve_model_class(arch) is LlamaForCausalLM


def test_unsupported_architecture_names_itself_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'BertModel'.*Qwen3ForCausalLM"):
        resolve_model_class("BertModel")
