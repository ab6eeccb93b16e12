"""M-RoPE: prompt positions equal transformers' get_rope_index; the Qwen2 text model with
`mrope_section` equals transformers' Qwen2.5-VL language model on [3, T] positions (prefill)
and on index + delta positions (decode)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncserve.kernels.ops import REFERENCE_OPS
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.mrope import MRotaryEmbedding, mrope_positions
from tests.models.conftest import new_kv_caches
from tests.models.qwen2_5_vl_tiny import IMAGE_TOKEN_ID, hf_tiny_model

pytest.importorskip("transformers")

MERGE = 2
# Two images of different grids (patches): 8x12 -> 4x6 tokens, 6x4 -> 3x2 tokens.
GRIDS = [(1, 8, 12), (1, 6, 4)]


def prompt_with_images(text_lens: list[int]) -> tuple[list[int], list[tuple[int, Any]]]:
    """Token ids: text runs of the given lengths with one image's placeholders between each."""
    ids: list[int] = []
    images = []
    for i, n in enumerate(text_lens):
        ids.extend(10 + (7 * j + i) % 250 for j in range(n))
        if i < len(GRIDS) and i < len(text_lens) - 1:
            t, h, w = GRIDS[i]
            images.append((len(ids), GRIDS[i]))
            ids.extend([IMAGE_TOKEN_ID] * (t * h * w // MERGE**2))
    return ids, images


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return hf_tiny_model()


@pytest.mark.parametrize("text_lens", [[3, 0], [5, 4, 2], [0, 1, 6], [4]])
def test_positions_equal_get_rope_index(hf_model: Any, text_lens: list[int]) -> None:
    ids, images = prompt_with_images(text_lens)
    positions, delta = mrope_positions(len(ids), images, MERGE)
    input_ids = torch.tensor([ids])
    token_type = (input_ids == IMAGE_TOKEN_ID).int()
    grids = torch.tensor([g for _, g in images]) if images else None
    expected, deltas = hf_model.model.get_rope_index(
        input_ids, mm_token_type_ids=token_type, image_grid_thw=grids
    )
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(deltas[0, 0])


def test_positions_reject_runs_past_the_prompt() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        mrope_positions(10, [(4, (1, 8, 12))], MERGE)


def test_section_must_cover_half_the_head() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, 64, 10000.0, None, REFERENCE_OPS, [2, 2, 2])


def text_model(hf_model: Any) -> LlamaForCausalLM:
    d = {**hf_model.config.text_config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    config = ArchConfig.from_hf_dict(d)
    assert config.mrope_section == (2, 3, 3) and config.rope_scaling is None
    model = LlamaForCausalLM(config, REFERENCE_OPS)
    state = hf_model.state_dict()
    prefix = "model.language_model."
    weights = [
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k, v)
        for k, v in state.items()
        if k.startswith(prefix) or k == "lm_head.weight"
    ]
    model.load_weights(weights)
    return model.eval()


def paged_forward(
    model: LlamaForCausalLM,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    ids: list[int],
    positions: torch.Tensor,
    cached: int,
) -> torch.Tensor:
    """Logits of ids[cached:] of one sequence (block table 0..n-1, block size 4)."""
    total = len(ids)
    slots = list(range(cached, total))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, total - cached], dtype=torch.int32),
        seq_lens=torch.tensor([total], dtype=torch.int32),
        block_tables=torch.arange((total + 3) // 4, dtype=torch.int32)[None],
        max_seqlen_q=total - cached,
        max_seqlen_k=total,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(ids[cached:]), positions, caches, meta)
        return model.compute_logits(hidden)


def test_text_model_equals_transformers_prefill_and_decode(hf_model: Any) -> None:
    ours = text_model(hf_model)
    ids, images = prompt_with_images([5, 4, 2])
    positions, delta = mrope_positions(len(ids), images, MERGE)
    caches = new_kv_caches(ours, 32)
    logits = paged_forward(ours, caches, ids, positions, 0)
    lm = hf_model.model.language_model
    with torch.no_grad():
        out = lm(input_ids=torch.tensor([ids]), position_ids=positions[:, None], use_cache=True)
        expected = hf_model.lm_head(out.last_hidden_state)[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # Three decode steps: index + delta on all rows, given as plain [T] positions.
    past = out.past_key_values
    for step in range(3):
        token = 40 + step
        ids.append(token)
        index = len(ids) - 1
        got = paged_forward(ours, caches, ids, torch.tensor([index + delta]), index)
        with torch.no_grad():
            hf_pos = torch.full((3, 1, 1), index + delta)
            out = lm(
                input_ids=torch.tensor([[token]]),
                position_ids=hf_pos,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            want = hf_model.lm_head(out.last_hidden_state)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The same step as [3, T] rows gives the same logits as plain positions.
    ids.append(50)
    index = len(ids) - 1
    plain = paged_forward(ours, caches, ids, torch.tensor([index + delta]), index)
    rows = paged_forward(ours, caches, ids, torch.full((3, 1), index + delta), index)
    torch.testing.assert_close(plain, rows, rtol=0, atol=0)


def test_mrope_with_triton_rotary_equals_reference() -> None:
    """The per-token table goes through the GPU rotary kernel (Triton's interpreter on CPU)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from asyncserve.kernels.triton_ops import TRITON_OPS

    ids, images = prompt_with_images([3, 2, 1])
    positions, _ = mrope_positions(len(ids), images, MERGE)
    torch.manual_seed(3)
    q = torch.randn(len(ids), 4, 16)
    k = torch.randn(len(ids), 2, 16)
    ref = MRotaryEmbedding(16, 128, 100.0, None, REFERENCE_OPS, [2, 3, 3])
    tri = MRotaryEmbedding(16, 128, 100.0, None, TRITON_OPS, [2, 3, 3])
    want_q, want_k = ref(positions, q.clone(), k.clone())
    got_q, got_k = tri(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
