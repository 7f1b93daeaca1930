"""A Ray cluster on one machine for tests and benchmarks: a head and generation nodes on loopback, with
small object stores and no dashboard (pipegen sends no data through Ray; the box has 2 cores).

`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes every node register as 127.0.0.1; it must be in the
environment of the cluster and of every driver (the launcher), so `LOOPBACK_ENV` is exported here.

Owns: starting and stopping a `ray.cluster_utils.Cluster`, and the environment a node's processes see.
Must never: be imported by pipegen's product code.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SMALL_NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def loopback_cluster() -> Iterator:
    """A head node with no generation resource; `cluster.address` is what a driver's RAY_ADDRESS names."""
    from ray.cluster_utils import Cluster

    with _environment(LOOPBACK_ENV):
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={**SMALL_NODE, "include_dashboard": False})
        try:
            yield cluster
        finally:
            cluster.shutdown()


def add_generation_node(cluster, resource: str, env: dict[str, str] | None = None):
    """A node with one unit of `resource`; `env` reaches every process it starts (its node runner and,
    through it, its servers), as a `ray start` run with that environment would."""
    with _environment({**LOOPBACK_ENV, **(env or {})}):
        return cluster.add_node(**SMALL_NODE, resources={resource: 1})
