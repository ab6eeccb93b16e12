"""Loaded by every Python process that has this folder on PYTHONPATH (the vLLM peer runs of
the GPU scripts, including the subprocess in which vLLM inspects a model's class).

vLLM 0.26.0's Pixtral module, which its LLaVA code imports, takes two names from transformers
that the GPU image's transformers no longer has: `PixtralRotaryEmbedding` (now
`PixtralVisionRotaryEmbedding`) and `position_ids_in_meshgrid` (used only by Pixtral's own
vision tower, not LLaVA's CLIP). Both are added back.
"""

try:
    import torch
    import transformers.models.pixtral.modeling_pixtral as _pixtral

    if not hasattr(_pixtral, "PixtralRotaryEmbedding") and hasattr(
        _pixtral, "PixtralVisionRotaryEmbedding"
    ):
        _pixtral.PixtralRotaryEmbedding = _pixtral.PixtralVisionRotaryEmbedding  # type: ignore[attr-defined]

    if not hasattr(_pixtral, "position_ids_in_meshgrid"):

        def position_ids_in_meshgrid(patch_embeds_list: list, max_width: int) -> torch.Tensor:
            """Row-major patch positions (row * max_width + column) of each image, concatenated."""
            ids = []
            for patches in patch_embeds_list:
                height, width = patches.shape[-2:]
                rows = torch.arange(height).repeat_interleave(width)
                cols = torch.arange(width).repeat(height)
                ids.append(rows * max_width + cols)
            return torch.cat(ids)

        _pixtral.position_ids_in_meshgrid = position_ids_in_meshgrid  # type: ignore[attr-defined]
except ImportError:
    pass
