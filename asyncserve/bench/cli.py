"""Registers `bench throughput|latency|serve` on the main CLI parser."""

from __future__ import annotations

import argparse

from asyncserve.bench import latency, serve, throughput

_MODES = {
    "throughput": (throughput, "offline throughput of LLM.generate on random prompts"),
    "latency": (latency, "end-to-end latency of one batch; ms per output token"),
    "serve": (serve, "stream completions from a running server with Poisson arrivals"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, serve")
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    for name, (module, help_text) in _MODES.items():
        mode_parser = modes.add_parser(name, help=help_text)
        module.add_arguments(mode_parser)
        mode_parser.set_defaults(handler=module.run)
