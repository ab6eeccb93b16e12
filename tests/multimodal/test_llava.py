"""LLaVA end to end on CPU: greedy tokens equal to transformers' with one and two images,
the encoder cache, image hashes in prefix-cache keys, chunked prefill through an image."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from asyncserve.llm import LLM
from asyncserve.multimodal.image_processing import ImageProcessor
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.sampling_params import SamplingParams
from tests.multimodal.conftest import random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhat differs? ASSISTANT:"


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory=16 << 20, **kwargs)


@pytest.fixture(scope="module")
def llava(tiny_llava_dir: Path) -> Iterator[LLM]:
    llm = _llm(tiny_llava_dir)
    yield llm
    llm.close()


def _hf_greedy(hf: Any, mm: MultiModalInputs, n: int = 8) -> list[int]:
    ids = torch.tensor([mm.prompt_token_ids])
    pixels = torch.stack([item.data["pixel_values"] for item in mm.features.items])
    out = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, ids.shape[1] :]]


def _encoded(llm: LLM) -> int:
    runner = llm.engine.runner  # type: ignore[union-attr]
    assert runner is not None and runner.embedder is not None
    return runner.embedder.cache.num_encoded


def test_pixel_values_equal_transformers(tiny_llava_dir: Path) -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil.from_pretrained(str(tiny_llava_dir))
    ours = ImageProcessor.from_dict(hf.to_dict(), 32)
    # Wide, tall, smaller than the crop (padded), and grey-scale (converted to RGB).
    for image in (
        random_image(1, 70, 40),
        random_image(2, 33, 90),
        random_image(3, 20, 24),
        random_image(4, 64, 64).convert("L"),
    ):
        expected = hf(image, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(ours(image), expected, rtol=0, atol=1e-6)


def test_extreme_aspect_ratios_stay_small(monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    from asyncserve.multimodal import image_processing

    crop = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # 16M x 1 resized whole would be 512M x 32 pixels (1.5 GB); only the crop is made.
    wide = crop(Image.new("RGB", (16_000_000, 1), (9, 99, 200)))
    assert wide.shape == (3, 32, 32)
    # The cropped resize samples what the whole one keeps (rounding: one 8-bit step).
    image = random_image(5, 900, 11)
    whole = crop(image)
    monkeypatch.setattr(image_processing, "MAX_RESIZED_PIXELS", 0)
    torch.testing.assert_close(crop(image), whole, rtol=0, atol=0.02)
    no_crop = ImageProcessor(size={"shortest_edge": 32}, crop_size=None)
    with pytest.raises(ValueError, match="aspect ratio too large"):
        no_crop(image)
    with pytest.raises(ValueError, match="no pixels: 0x0"):
        crop(Image.new("RGB", (0, 0)))


def test_one_image_equals_transformers(llava: LLM, hf_llava: Any) -> None:
    image = random_image(10)
    out = llava.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)
    mm = llava.engine.multimodal.process(ONE, {"image": [image]})  # type: ignore[union-attr]
    assert out[0].outputs[0].token_ids == _hf_greedy(hf_llava, mm)
    # 16 patches of the 32-pixel image (8-pixel patches), CLIP's class token dropped.
    assert mm.features.items[0].length == 16
    assert out[0].prompt == ONE


def test_two_images_and_token_ids_prompt(llava: LLM, hf_llava: Any) -> None:
    images = [random_image(11), random_image(12, 64, 30)]
    ids = llava.engine.tokenizer.encode(TWO, add_special_tokens=True)
    out = llava.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY)
    mm = llava.engine.multimodal.process(ids, {"image": images})  # type: ignore[union-attr]
    assert [i.offset for i in mm.features.items][1] > mm.features.items[0].end
    assert out[0].outputs[0].token_ids == _hf_greedy(hf_llava, mm)


def test_repeated_image_is_encoded_once(llava: LLM) -> None:
    image = random_image(20)
    before = _encoded(llava)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": image}},
        {"prompt": "USER: <image>\nDescribe it. ASSISTANT:", "multi_modal_data": {"image": image}},
    ]
    llava.generate(prompts[:1], GREEDY, use_tqdm=False)
    llava.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert _encoded(llava) == before + 1


def test_palette_images_of_other_colours_share_nothing(llava: LLM) -> None:
    """Equal palette indices under other palettes are other images: neither takes the
    other's encoder cache entry or prefix-cache blocks."""
    indices = np.random.default_rng(5).integers(0, 4, (50, 40), dtype=np.uint8)
    images = []
    for seed in (6, 7):
        image = Image.fromarray(indices, "P")
        image.putpalette(np.random.default_rng(seed).integers(0, 256, 12).tolist())
        images.append(image)
    a, b = (
        llava.generate({"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY)[0]
        for image in images
    )
    rgb = {"prompt": ONE, "multi_modal_data": {"image": images[1].convert("RGB")}}
    assert b.outputs[0].token_ids == llava.generate(rgb, GREEDY)[0].outputs[0].token_ids
    assert b.outputs[0].token_ids != a.outputs[0].token_ids


def test_same_text_other_image_shares_no_image_blocks(llava: LLM) -> None:
    kv = llava.engine.scheduler.kv_cache_manager  # type: ignore[union-attr]
    # The image starts at token 3: blocks of 16 tokens hold it from the first one on.
    text = "USER: <image>\n" + "Tell me everything about this picture, please. " * 3 + "ASSISTANT:"
    a, b = random_image(30), random_image(31)

    def run(image: Any) -> tuple[list[int], int]:
        hits = kv.prefix_cache_hits
        out = llava.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
        return out[0].outputs[0].token_ids, kv.prefix_cache_hits - hits

    first, _ = run(a)
    other, other_hits = run(b)
    again, again_hits = run(a)
    assert other != first
    assert again == first
    assert other_hits == 0  # every block touches the image or follows it
    assert again_hits > 0


def test_chunked_prefill_through_an_image(tiny_llava_dir: Path, llava: LLM) -> None:
    images = [random_image(40), random_image(41)]
    prompt = {"prompt": TWO, "multi_modal_data": {"image": images}}
    expected = llava.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # 8-token chunks cut each 16-token placeholder run in two.
    small = _llm(tiny_llava_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    try:
        got = small.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected
        assert _encoded(small) == 2  # each image once, though its rows came in two steps
    finally:
        small.close()


def test_chat_with_image_parts(llava: LLM) -> None:
    import base64
    import io

    image = random_image(50)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    question = {"type": "text", "text": "What is in the picture?"}
    by_url = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}
    ]
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, question]}]
    out_url = llava.chat(by_url, GREEDY, use_tqdm=False)[0]
    out_pil = llava.chat(by_pil, GREEDY, use_tqdm=False)[0]
    direct = llava.generate(
        {"prompt": ONE, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False
    )[0]
    assert out_url.outputs[0].token_ids == out_pil.outputs[0].token_ids
    # The template renders "USER: <image>\nWhat is in the picture? ASSISTANT:".
    assert out_pil.outputs[0].token_ids == direct.outputs[0].token_ids


def test_bad_multimodal_input(llava: LLM, smollm2_llm: LLM) -> None:
    image = random_image(60)
    with pytest.raises(ValueError, match="1 '<image>' placeholder.*2 image"):
        llava.generate({"prompt": ONE, "multi_modal_data": {"image": [image, image]}}, GREEDY)
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] must be a PIL"):
        llava.generate({"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(ValueError, match="modality not supported"):
        llava.generate({"prompt": ONE, "multi_modal_data": {"video": image}}, GREEDY)
    with pytest.raises(ValueError, match="at most 4 per prompt"):
        llava.generate({"prompt": "<image>" * 5, "multi_modal_data": {"image": [image] * 5}})
    # Opened lazily, truncated: it fails when its pixels are read, as a ValueError too.
    encoded = io.BytesIO()
    random_image(61, 100, 100).save(encoded, format="PNG")
    truncated = Image.open(io.BytesIO(encoded.getvalue()[:2000]))
    with pytest.raises(ValueError, match="image 0: image file is truncated"):
        llava.generate({"prompt": ONE, "multi_modal_data": {"image": truncated}}, GREEDY)
    with pytest.raises(ValueError, match="text-only model"):
        smollm2_llm.generate({"prompt": "Hi", "multi_modal_data": {"image": image}}, GREEDY)
    # Placeholders without an image fail the request, not the engine.
    out = llava.generate(ONE, GREEDY, use_tqdm=False)[0]
    assert out.error is not None and "no image was given" in out.error
    bad_url = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url"):
        llava.chat(bad_url, GREEDY, use_tqdm=False)


def test_a_batch_of_image_prompts_is_processed_in_parallel_and_in_order(
    llava: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many prompts with images: preprocessed on several threads, each output the one its
    prompt gets alone; a bad prompt among them raises its own error before any work."""
    import asyncserve.llm_prompts as llm_prompts

    threads: set[str] = set()
    process = llava.engine.multimodal.process  # type: ignore[union-attr]

    def recording(*args: Any) -> MultiModalInputs:
        import threading

        threads.add(threading.current_thread().name)
        return process(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(llava.engine.multimodal, "process", recording)
    monkeypatch.setattr(llm_prompts.os, "cpu_count", lambda: 4)
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"image": random_image(70 + i)}} for i in range(6)
    ]
    batch = llava.generate(prompts, GREEDY, use_tqdm=False)
    assert any(name.startswith("asyncserve-images") for name in threads)
    for prompt, out in zip(prompts[:2], batch[:2], strict=False):
        alone = llava.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    bad = [*prompts[:3], {"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, *prompts[3:]]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\] must be a PIL"):
        llava.generate(bad, long, use_tqdm=False)
    # The call's requests that had started are aborted with it, none left running.
    assert not llava.engine.core.has_unfinished_requests()  # type: ignore[union-attr]
    assert llava.generate(prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
        batch[0].outputs[0].token_ids
    )
