"""One Ray cluster for every Ray test: two simulated nodes (ray.cluster_utils.Cluster) in
this machine, started once (Ray's start takes seconds) and shared by the Ray Data and Ray
executor tests.

Each node offers 3 logical CPUs, a CPU being one "device" of the Ray executor on CPU: two
ranks fit on one node (STRICT_PACK) or spread over both (SPREAD)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from safetensors.torch import save_file

from tests.models.test_loader import random_state, write_config

# Small object stores: the tests move prompts and token ids, not tensors.
NODE_ARGS = {"num_cpus": 3, "object_store_memory": 80 << 20}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE_ARGS, "include_dashboard": False},
    )
    cluster.add_node(**NODE_ARGS)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama checkpoint (random weights, byte-level placeholder tokenizer): quick to
    load in every actor, and its 4 heads split over 2 ranks."""
    root = write_config(tmp_path_factory.mktemp("ray") / "llama")
    save_file(random_state(seed=3), str(root / "model.safetensors"))
    return root
