"""What a "ray" executor holds in Ray, and letting go of it: its lease on this process's Ray
connection, its placement group, its worker actors. See ray_executor.py for the overview.
"""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType
from typing import Any

from fleetllm.executor.ray_utils import RayConnection

GONE_WAIT_S = 5.0  # shutdown: how long to wait for Ray to report our actors dead


class RayWorkerGroup:
    """The executor's Ray resources. Referenced by the executor's finalizer, never the executor
    itself, so the executor can be garbage collected (which releases them)."""

    def __init__(self, ray: ModuleType, name: str) -> None:
        self.ray = ray
        self.name = name  # prefix of our placement group's and actors' names
        self.owner_pid = os.getpid()  # a forked copy of the driver must not touch them
        self.leased = False  # holds a RayConnection lease (release it once)
        self.pg: Any = None
        self.owns_pg = False  # made by us (removed by us), not given by the user
        self.actors: list[Any] = []  # RayWorkerWrapper handles, in rank order once assigned
        self.nodes: list[dict[str, Any]] = []  # get_node_info() per rank
        self.lock = threading.Lock()
        self.stopped = False
        self.closed = False

    def connect(self, address: str | None, local_cpus: float) -> None:
        self.leased = RayConnection.acquire(self.ray, address, local_cpus)

    def actor_names(self) -> list[str]:
        """Our actors that Ray still lists as alive (named actors: only live ones are listed)."""
        try:
            listed = self.ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # Ray is gone: so are the actors
            return []
        return [a["name"] for a in listed if a["name"].startswith(self.name + "-")]

    def stop_workers(self, wait: bool = False) -> None:
        """Kill every actor and remove our placement group (not one the user gave). Idempotent.
        wait: return once Ray no longer lists our actors (at most GONE_WAIT_S), so that
        nothing of ours is left when shutdown() returns."""
        with self.lock:
            if self.stopped or os.getpid() != self.owner_pid:
                return
            self.stopped = True
        if not self.ray.is_initialized():  # interpreter exit after ray.shutdown(): all gone
            return
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        if self.pg is not None and self.owns_pg:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:
                pass
        end = time.monotonic() + GONE_WAIT_S
        while wait and self.actor_names() and time.monotonic() < end:
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the workers, then give up our lease on the Ray connection (which disconnects,
        and stops a local instance we started, when no other executor holds one)."""
        with self.lock:
            if self.closed or os.getpid() != self.owner_pid:
                return
            self.closed = True
        try:
            self.stop_workers(wait=True)
        finally:
            if self.leased:
                self.leased = False
                RayConnection.release(self.ray)
