from __future__ import annotations

import pytest

from asyncserve.models.base import CausalLM
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.registry import SUPPORTED_ARCHITECTURES, resolve_model_class


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_supported_architectures_resolve(arch: str) -> None:
    cls = resolve_model_class(arch)
    assert issubclass(cls, CausalLM)
    # Each family has its own class, named as its architecture; Llama's serves its kin.
    assert cls.__name__ == arch or cls is LlamaForCausalLM


def test_unsupported_architecture_names_itself_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'BertModel'.*Qwen3ForCausalLM"):
        resolve_model_class("BertModel")
