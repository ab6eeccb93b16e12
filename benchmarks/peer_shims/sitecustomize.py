"""Loaded by every Python process that has this folder on PYTHONPATH (the vLLM peer runs of
benchmarks/gpu_x4.sh, including the subprocess in which vLLM inspects a model's class).

vLLM 0.26.0's LLaVA code imports `PixtralRotaryEmbedding` from transformers, which the GPU
image's transformers names `PixtralVisionRotaryEmbedding`: the old name is added back.
"""

try:
    import transformers.models.pixtral.modeling_pixtral as _pixtral

    if not hasattr(_pixtral, "PixtralRotaryEmbedding") and hasattr(
        _pixtral, "PixtralVisionRotaryEmbedding"
    ):
        _pixtral.PixtralRotaryEmbedding = _pixtral.PixtralVisionRotaryEmbedding  # type: ignore[attr-defined]
except ImportError:
    pass
