"""Reaching a Ray cluster and reserving its devices for one engine.

`connect` joins the cluster the process already belongs to, else an existing one (RAY_ADDRESS
or the latest `ray start` on this machine), else starts a local one; it is ray.init's own
search order. `reserve` checks that the cluster can hold the workers (a one-line ValueError
before any model loads) and takes a placement group of one bundle per device.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# Seconds a feasible placement group gets to be placed (other jobs may hold the devices).
_PLACEMENT_TIMEOUT_S = 120.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'asyncserve[ray]'"
        ) from exc
    return ray


def connect() -> Any:
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(log_to_driver=True, include_dashboard=False)
    return ray


def device_resource(device_type: str) -> str:
    """The Ray resource one rank holds: a GPU, or on CPU one CPU core."""
    return "GPU" if device_type == "cuda" else "CPU"


def check_capacity(size: int, resource: str, strategy: str, nodes: list[dict[str, Any]]) -> None:
    """One-line ValueError when `size` bundles of one `resource` cannot be placed on `nodes`
    (ray.nodes()) with `strategy`."""
    per_node = [
        int(node.get("Resources", {}).get(resource, 0)) for node in nodes if node.get("Alive")
    ]
    total = sum(per_node)
    most = max(per_node, default=0)
    what = f"{size} {resource} bundle{'s' if size > 1 else ''} ({strategy})"
    if strategy == "STRICT_PACK" and most < size:
        raise ValueError(
            f"the Ray cluster cannot place {what}: the largest node has {most} {resource}s "
            f"(total {total} on {len(per_node)} nodes); use ray_placement_strategy='SPREAD' "
            "to span nodes"
        )
    if strategy == "STRICT_SPREAD" and sum(1 for n in per_node if n >= 1) < size:
        raise ValueError(
            f"the Ray cluster cannot place {what}: only "
            f"{sum(1 for n in per_node if n >= 1)} nodes have a {resource}"
        )
    if total < size:
        raise ValueError(
            f"the Ray cluster cannot place {what}: it has {total} {resource}s in all "
            f"on {len(per_node)} nodes"
        )


def reserve(size: int, device_type: str, strategy: str) -> tuple[Any, bool]:
    """(placement group, whether this engine created it) with at least `size` bundles.

    Inside a placement group already (a Ray Data or Ray Serve replica, or a user's own), the
    engine uses that one, as vLLM does; else it creates one."""
    ray = connect()
    from ray.util.placement_group import get_current_placement_group, placement_group

    current = get_current_placement_group()
    if current is not None:
        if len(current.bundle_specs) < size:
            raise ValueError(
                f"the current placement group has {len(current.bundle_specs)} bundles, "
                f"fewer than the {size} workers"
            )
        return current, False
    resource = device_resource(device_type)
    check_capacity(size, resource, strategy, ray.nodes())
    group = placement_group([{resource: 1.0}] * size, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ValueError(
            f"the Ray cluster did not place {size} {resource} bundles ({strategy}) within "
            f"{_PLACEMENT_TIMEOUT_S:.0f} s: other jobs hold its devices"
        )
    return group, True
