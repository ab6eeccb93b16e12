"""Quantized weights (FP8, block FP8) for the models' linear layers; see base.py."""

from asyncserve.quantization.base import LinearMethod, QuantConfig, quantized_build
from asyncserve.quantization.config import QUANTIZATION_METHODS, resolve_quant_config

__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethod",
    "QuantConfig",
    "quantized_build",
    "resolve_quant_config",
]
