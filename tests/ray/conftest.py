"""One Ray cluster for every Ray test: two simulated nodes (ray.cluster_utils.Cluster) in
this machine, started once (Ray's start takes seconds) and shared by the Ray Data and Ray
executor tests.

Each node offers 3 logical CPUs, a CPU being one "device" of the Ray executor on CPU: two
ranks fit on one node (STRICT_PACK) or spread over both (SPREAD)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

# Small object stores: the tests move prompts and token ids, not tensors.
_NODE_ARGS = {"num_cpus": 3, "object_store_memory": 80 << 20}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**_NODE_ARGS, "include_dashboard": False},
    )
    cluster.add_node(**_NODE_ARGS)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
