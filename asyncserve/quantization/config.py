"""Which quantization scheme a model runs with: the checkpoint's `quantization_config`,
or `--quantization` for a scheme applied at load."""

from __future__ import annotations

from typing import Any

import torch

from asyncserve.quantization.base import QuantConfig
from asyncserve.quantization.compressed_tensors import CompressedTensorsConfig
from asyncserve.quantization.fp8 import check_fp8_device
from asyncserve.quantization.fp8_config import Fp8Config
from asyncserve.quantization.int4_config import AWQConfig, GPTQConfig

# `--quantization` values: the checkpoint's quant_method names, as vLLM accepts them.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "gguf")


def resolve_quant_config(
    quantization: str | None, hf_config: dict[str, Any], device: torch.device
) -> QuantConfig | None:
    """The scheme for a model whose config.json is `hf_config` (empty for GGUF); None when
    neither the checkpoint nor `quantization` asks for one. One-line ValueError on an
    unsupported scheme, a mismatch, or a device that cannot run it."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization {quantization!r} is not supported "
            f"(supported: {', '.join(QUANTIZATION_METHODS)})"
        )
    config: QuantConfig
    if qc is None:
        if quantization is None:
            return None
        if quantization == "gguf":
            raise ValueError("quantization 'gguf' needs a .gguf model")
        if quantization != "fp8":
            raise ValueError(
                f"quantization {quantization!r} needs a checkpoint quantized with it; "
                "only fp8 can be applied at load"
            )
        config = Fp8Config.online()
    else:
        if not isinstance(qc, dict):
            raise ValueError("quantization_config in config.json must be an object")
        method = str(qc.get("quant_method", "")).lower()
        if quantization is not None and quantization != method:
            raise ValueError(
                f"quantization {quantization!r} does not match the checkpoint's "
                f"quant_method {method!r}"
            )
        if method == "fp8":
            config = Fp8Config.from_hf(qc)
        elif method == "compressed-tensors":
            config = CompressedTensorsConfig.from_hf(qc)
        elif method == "gptq":
            config = GPTQConfig.from_hf(qc)
        elif method == "awq":
            config = AWQConfig.from_hf(qc)
        else:
            raise ValueError(
                f"checkpoint quant_method {method!r} is not supported "
                f"(supported: {', '.join(QUANTIZATION_METHODS)})"
            )
    if config.uses_fp8():
        check_fp8_device(device)
    return config
