"""Where `--quantization fp8` loses greedy agreement on the default model (CPU, fp32).

The test's measure (tests/quantization/test_fp8_online.py): 8 prompts x 32 greedy tokens of
the unquantized model; at each position, does the quantized model given the same prefix rank
the same token first. Here the same measure for fake-quantized variants of the unquantized
model's linear layers, one factor at a time:
- weights: none, per output channel (ours), per channel with MSE-optimal scales, per tensor
  of the fused layer (vLLM's online fp8: one scale for q/k/v together), per tensor of each
  checkpoint tensor;
- activations: none, per token dynamic (ours), per tensor dynamic;
- weights "jitterN" / "tensor-jitterN": per channel / per tensor with each scale raised by
  up to 10% at random: the noise of the measure (as accurate, rounded elsewhere);
- rounding: round to nearest even (torch's cast, as the GPU's), or truncation toward zero;
- which layers: all projections, or all but the attention's (to see where the loss sits).
The engine's own `quantization="fp8"` run is measured too, to check that the emulation of
"per channel + per token" gives its number.

    python benchmarks/fp8_agreement.py                 # prints one line per variant
    python benchmarks/fp8_agreement.py --noise 10 --only-noise
    python benchmarks/fp8_agreement.py --wide         # over the test's 16 x 32 positions
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from asyncserve.llm import LLM
from asyncserve.models.layers import Linear
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three uses of a paperclip:\n1.",
    "The largest planet in the solar system is",
    "To make a cup of tea,",
]
# Output rows of each checkpoint tensor in a fused layer (SmolLM2-135M: 9 q heads, 3 kv
# heads of 64; intermediate 1536).
FUSED_PARTS = {"qkv_proj": (576, 192, 192), "gate_up_proj": (1536, 1536)}
ERRORS: list[float] = []  # relative weight error of each layer quantized in a variant
# Every non-negative finite e4m3 value, ascending.
E4M3_GRID = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()


def to_fp8(x: torch.Tensor, scale: torch.Tensor, rounding: str) -> torch.Tensor:
    """x / scale on the e4m3 grid, back in fp32 units of x."""
    y = (x / scale).clamp(-FP8_MAX, FP8_MAX)
    if rounding == "nearest":
        return y.to(FP8_DTYPE).float() * scale
    # Toward zero: the largest e4m3 magnitude at or below |y|.
    index = torch.searchsorted(E4M3_GRID, y.abs().contiguous(), right=True) - 1
    return E4M3_GRID[index].copysign(y) * scale


def weight_scale(w: torch.Tensor, name: str, granularity: str) -> torch.Tensor:
    a = w.abs()
    if "jitter" in granularity:
        # Per channel ("jitterN") or per tensor ("tensor-jitterN"), each scale raised by up
        # to 10% at random (seeded): as accurate, but every weight rounds at another place
        # on the grid. The spread of these runs is the measure's noise.
        seed = int(granularity.rpartition("jitter")[2])
        gen = torch.Generator().manual_seed(seed * 1000 + len(name))
        per_tensor = granularity.startswith("tensor")
        factor = 1 + 0.1 * torch.rand(1 if per_tensor else w.shape[0], 1, generator=gen)
        amax = a.amax().expand(w.shape[0], 1) if per_tensor else a.amax(dim=1, keepdim=True)
        return (amax * factor / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    if granularity == "mse":
        # Per channel, each row's scale the one of 21 (0.8-1.0 of its largest magnitude)
        # with the least squared error (clipping the row's outliers).
        amax = a.amax(dim=1, keepdim=True)
        scales = [(amax * r / FP8_MAX).clamp(min=FP8_MIN_SCALE) for r in torch.linspace(0.8, 1, 21)]
        errors = torch.cat([((to_fp8(w, s, "nearest") - w) ** 2).sum(dim=1, keepdim=True)
                            for s in scales], dim=1)  # fmt: skip
        return torch.cat(scales, dim=1).gather(1, errors.argmin(dim=1, keepdim=True))
    if granularity == "channel":
        amax = a.amax(dim=1, keepdim=True)
    elif granularity == "tensor":
        amax = a.amax().expand(w.shape[0], 1)
    else:  # "shard": one scale per checkpoint tensor of a fused layer
        parts = next((p for k, p in FUSED_PARTS.items() if name.endswith(k)), (w.shape[0],))
        amax = torch.cat([c.amax().expand(c.shape[0], 1) for c in a.split(list(parts))])
    return (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)


@dataclass
class FakeQuant:
    """A Linear's quant_method: activations fake-quantized, times the fake-quantized weight."""

    weight: torch.Tensor
    activations: str
    rounding: str

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.activations != "none":
            x2 = x.reshape(-1, x.shape[-1]).float()
            if self.activations == "token":
                amax = x2.abs().amax(dim=1, keepdim=True)
            else:
                amax = x2.abs().amax().expand(x2.shape[0], 1)
            scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
            x = to_fp8(x2, scale, self.rounding).view(x.shape)
        return F.linear(x, self.weight, bias)


def quantize_model(
    model: nn.Module, weights: str, activations: str, rounding: str, skip: Callable[[str], bool]
) -> None:
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or skip(name):
            module.quant_method = None
            continue
        w = module.weight.data.float()
        if not hasattr(module, "original_weight"):
            module.original_weight = w.clone()
        w = module.original_weight
        if weights != "none":
            q = to_fp8(w, weight_scale(w, name, weights), rounding)
            ERRORS.append(((q - w).norm() / w.norm()).item())
            w = q
        module.quant_method = FakeQuant(w, activations, rounding)  # type: ignore[assignment]


def agreement(llm: LLM, reference: list[RequestOutput]) -> tuple[int, list[float]]:
    sequences = [[*o.prompt_token_ids, *o.outputs[0].token_ids] for o in reference]
    scored = llm.generate(
        [{"prompt_token_ids": ids} for ids in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    agree, logprobs = 0, []
    for out, other in zip(reference, scored, strict=True):
        generated = out.outputs[0].token_ids
        assert other.prompt_logprobs is not None
        for token, entry in zip(generated, other.prompt_logprobs[-len(generated) :], strict=True):
            assert entry is not None
            agree += entry[token].rank == 1
            logprobs.append(entry[token].logprob)
    return agree, logprobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--noise", type=int, default=4, help="jittered runs of each scale")
    parser.add_argument("--only-noise", action="store_true", help="only the jittered runs")
    parser.add_argument(
        "--wide", action="store_true", help="16 prompts (the fp8 test's) instead of 8"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = PROMPTS
    if args.wide:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.quantization.conftest import MORE_PROMPTS

        prompts = [*PROMPTS, *MORE_PROMPTS]
    common = {"device": "cpu", "max_model_len": 512, "kv_cache_memory": 64 << 20,
              "enable_prefix_caching": False}  # fmt: skip
    llm = LLM(args.model, **common)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    reference = llm.generate(prompts, params, use_tqdm=False)
    total = sum(len(o.outputs[0].token_ids) for o in reference)
    model = llm.engine.loaded.model

    base = agreement(llm, reference)[1]

    def report(label: str, result: tuple[int, list[float]]) -> None:
        agree, logprobs = result
        drift = sum(abs(a - b) for a, b in zip(logprobs, base, strict=True)) / total
        werr = sum(ERRORS) / len(ERRORS) if ERRORS else 0.0
        ERRORS.clear()
        print(f"{label:62s} {agree}/{total} = {100 * agree / total:.1f}%  "
              f"mean |dlogprob| {drift:.4f}  weight rel. error {werr:.4f}", flush=True)  # fmt: skip

    report("unquantized (sanity)", agreement(llm, reference))
    attention = lambda name: ".self_attn." in name  # noqa: E731
    variants = [
        ("channel", "token", "nearest", "all"),  # ours
        ("mse", "token", "nearest", "all"),
        ("channel", "none", "nearest", "all"),
        ("none", "token", "nearest", "all"),
        ("tensor", "token", "nearest", "all"),  # vLLM's online fp8 weights
        ("shard", "token", "nearest", "all"),
        ("tensor", "tensor", "nearest", "all"),
        ("channel", "token", "zero", "all"),
        ("channel", "token", "nearest", "mlp"),
        ("channel", "token", "nearest", "attention"),
    ]
    variants += [(f"jitter{i}", "token", "nearest", "all") for i in range(1, args.noise + 1)]
    variants += [(f"tensor-jitter{i}", "token", "nearest", "all") for i in range(1, args.noise + 1)]
    if args.only_noise:
        variants = variants[-2 * args.noise :]
    for weights, acts, rounding, layers in variants:
        if layers == "all":
            skip: Callable[[str], bool] = lambda name: False  # noqa: E731
        elif layers == "mlp":
            skip = attention
        else:
            skip = lambda name: not attention(name)  # noqa: E731
        quantize_model(model, weights, acts, rounding, skip)
        label = f"weights {weights}, activations {acts}, {rounding}, layers {layers}"
        report(label, agreement(llm, reference))
    quantize_model(model, "none", "none", "nearest", lambda name: True)
    llm.close()
    fp8 = LLM(args.model, quantization="fp8", **common)
    report("engine quantization='fp8'", agreement(fp8, reference))
    fp8.close()


if __name__ == "__main__":
    main()
