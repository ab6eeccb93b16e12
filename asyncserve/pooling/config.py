"""Which runner a checkpoint gets, and how a pooling model turns hidden states into vectors.

The pooling method is read the way sentence-transformers writes it (modules.json and the
Pooling module's config.json), so a sentence-transformers checkpoint embeds here as it does
there; without those files it follows the architecture (vLLM's defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PoolingType = Literal["LAST", "MEAN", "CLS"]
Runner = Literal["generate", "pooling"]

# Decoder bodies saved without their LM head ("Qwen3Model") map to the generation class.
DECODER_BODIES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
ENCODERS = ("BertModel", "BertForSequenceClassification", "BertForMaskedLM")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON
        raise ValueError(f"cannot read {path}: {exc}") from exc


def resolve_runner(requested: str, model_dir: Path | None) -> Runner:
    """`--runner auto` picks pooling for encoders, decoder bodies without an LM head and
    sentence-transformers checkpoints; generation otherwise."""
    if requested in ("generate", "pooling"):
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {requested!r}")
    if model_dir is None or not (model_dir / "config.json").is_file():
        return "generate"
    config = _read(model_dir / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir / 'config.json'} must hold a JSON object")
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    if arch in ENCODERS or arch in DECODER_BODIES or arch.endswith("ForSequenceClassification"):
        return "pooling"
    if (model_dir / "modules.json").is_file():
        return "pooling"
    return "generate"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool
    # Matryoshka: the `dimensions` a request may ask for; () with `any_dimensions` for any.
    matryoshka_dimensions: tuple[int, ...] = ()
    any_dimensions: bool = False

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        if dimensions is None:
            return
        if not (self.any_dimensions or self.matryoshka_dimensions):
            raise ValueError("dimensions: this model does not support Matryoshka truncation")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be in [1, {hidden_size}], got {dimensions}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
            )


def pooler_config(
    model_dir: Path | None, hf_config: dict[str, Any], is_encoder: bool
) -> PoolerConfig:
    """sentence-transformers' modules when present; else CLS for encoders and the last token
    (normalized) for decoders, as vLLM does."""
    pooling: PoolingType = "CLS" if is_encoder else "LAST"
    normalize = True
    modules_file = model_dir / "modules.json" if model_dir is not None else None
    if modules_file is not None and modules_file.is_file():
        modules = _read(modules_file)
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith("Normalize") for t in types)
        for m in modules:
            if str(m.get("type", "")).endswith("Pooling"):
                assert model_dir is not None
                pooling = _st_pooling(_read(model_dir / m["path"] / "config.json"))
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig(
        pooling_type=pooling,
        normalize=normalize,
        matryoshka_dimensions=tuple(int(d) for d in dims) if isinstance(dims, list) else (),
        any_dimensions=bool(hf_config.get("is_matryoshka", False)),
    )


def _st_pooling(config: dict[str, Any]) -> PoolingType:
    # Newer sentence-transformers write one "pooling_mode"; older ones a flag per mode.
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        named: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
        if mode not in named:
            raise ValueError(
                f"sentence-transformers pooling {mode!r} is not supported (cls, mean, lasttoken)"
            )
        return named[mode]
    if config.get("pooling_mode_cls_token"):
        return "CLS"
    if config.get("pooling_mode_lasttoken"):
        return "LAST"
    if config.get("pooling_mode_mean_tokens"):
        return "MEAN"
    modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    raise ValueError(
        f"sentence-transformers pooling {modes} is not supported (cls, mean, lasttoken)"
    )
