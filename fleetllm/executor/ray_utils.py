"""Ray plumbing of the "ray" backend: importing Ray (an extra), this process's connection to a
cluster, the placement group, and which worker gets which rank. See ray_executor.py.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from types import ModuleType
from typing import Any

from fleetllm import envs
from fleetllm.config import EngineConfig
from fleetllm.errors import CommunicationTimeoutError, ConfigurationError

INSTALL_HINT = "pip install 'fleetllm[ray]'"
logger = logging.getLogger(__name__)
POLL_S = 0.1  # waiting for replies: how often to look for one that failed (see wait_some)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def import_ray() -> ModuleType:
    """Ray, or a ConfigurationError that says how to install it."""
    try:
        import ray
        import ray.util.placement_group  # noqa: F401  (a submodule the executor needs)
    except ImportError as e:
        raise ConfigurationError(
            f"distributed_executor_backend: 'ray' needs Ray, which is not installed ({e}); "
            f"install it with `{INSTALL_HINT}` (or `pip install 'ray>=2.9'`)") from e
    return ray


class RayConnection:
    """This process's use of Ray, shared by every ray executor in it.

    A Ray connection the user made (ray.init before the first executor) is used as it is and
    never shut down here. Otherwise the first executor joins the cluster named by ray_address
    or $RAY_ADDRESS, or starts a private local instance, and the last executor to release it
    disconnects (which stops the local instance): only what fleetllm started is shut down."""

    _lock = threading.Lock()
    _users = 0  # executors holding a connection that this class opened

    @classmethod
    def acquire(cls, ray: ModuleType, address: str | None, local_cpus: float) -> bool:
        """Connect if needed. True: this executor must release() when it is done."""
        with cls._lock:
            if cls._users == 0 and ray.is_initialized():  # the user's own connection
                if address:
                    logger.warning("ray_address=%r is ignored: this process is already "
                                   "connected to Ray (ray.init() was called)", address)
                return False
            if cls._users == 0:
                _init(ray, address or envs.get("RAY_ADDRESS"), local_cpus)
            cls._users += 1
            return True

    @classmethod
    def release(cls, ray: ModuleType) -> None:
        with cls._lock:
            cls._users = max(0, cls._users - 1)
            if cls._users == 0 and ray.is_initialized():
                ray.shutdown()


def _init(ray: ModuleType, address: str | None, local_cpus: float) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing is reported anywhere
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # A private single-host instance: no dashboard, every address on loopback, and the workers
    # find the modules this process can import (a worker_cls from a script's directory), as
    # the mp backend's spawned processes do. Logical CPUs are at least what the workers
    # reserve: on a small machine they share cores, as mp's processes would.
    env = {"PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env[name] = os.environ.get(name, "lo")  # one host: collectives stay on loopback
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=max(os.cpu_count() or 1, int(local_cpus + 0.999)),
             runtime_env={"env_vars": env}, log_to_driver=True)


def bundle_for(config: EngineConfig) -> dict[str, float]:
    """The resources one worker reserves."""
    if config.device_config.device == "cuda":
        return {"GPU": 1.0}
    return {"CPU": float(config.parallel_config.ray_cpus_per_worker)}


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def describe_shortfall(ray: ModuleType, bundles: list[dict[str, float]], strategy: str) -> str:
    """What a placement group needs next to what the cluster has, for the timeout message."""
    need = f"placement group needs {len(bundles)} bundles of {_fmt(bundles[0])} ({strategy})"
    try:
        free, total = ray.available_resources(), ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception as e:  # the cluster itself is unreachable: say that instead
        return f"{need}; the cluster's resources could not be read ({e})"
    have = ", ".join(f"{free.get(k, 0):g} {k}s free of {total.get(k, 0):g}" for k in bundles[0])
    text = f"{need}; the cluster has {have} on {len(nodes)} node{'s' * (len(nodes) != 1)}"
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        text += f" (STRICT_SPREAD needs {len(bundles)} nodes)"
    elif strategy == "STRICT_PACK":
        largest = max((n.get("Resources", {}).get(k, 0) for n in nodes for k in bundles[0]),
                      default=0)
        text += f" (STRICT_PACK needs one node for all; the largest has {largest:g})"
    return text


def placement_group_for(ray: ModuleType, config: EngineConfig, name: str,
                        deadline: float) -> tuple[Any, bool]:
    """The placement group the workers run in, ready, and whether this executor created it
    (and must remove it). Waits until `deadline` (time.monotonic()) for resources."""
    from ray.util.placement_group import get_placement_group, placement_group

    pc = config.parallel_config
    world, bundle = pc.world_size, bundle_for(config)
    given = pc.placement_group
    if given is None:
        bundles = [dict(bundle) for _ in range(world)]
        pg, owned = placement_group(bundles, strategy=pc.placement_strategy, name=name), True
    else:
        if isinstance(given, str):
            try:
                given = get_placement_group(given)
            except ValueError as e:
                raise ConfigurationError(f"placement_group: no placement group named "
                                         f"{pc.placement_group!r} in the cluster ({e})") from e
        bundles, owned, pg = list(given.bundle_specs), False, given
        small = [i for i, b in enumerate(bundles[:world])
                 if any(b.get(k, 0) < v for k, v in bundle.items())]
        if len(bundles) < world or small:
            raise ConfigurationError(
                f"placement_group: the workers need {world} bundles of at least {_fmt(bundle)};"
                f" the given one has {len(bundles)} ({', '.join(map(_fmt, bundles))})")
    # (not pg.wait(): it truncates its timeout to whole seconds)
    placed, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
    if not placed:
        strategy = pc.placement_strategy if owned else \
            ray.util.placement_group_table(pg).get("strategy", "?")
        message = describe_shortfall(ray, bundles[:world], strategy)
        if owned:
            ray.util.remove_placement_group(pg)
        raise CommunicationTimeoutError(
            f"{message}; still not placed after startup_timeout={pc.startup_timeout}s. Add "
            "nodes (`ray start --address=...`), free resources, lower ray_cpus_per_worker or "
            "choose another placement_strategy")
    return pg, owned


def assign_ranks(node_ids: list[str], tp_size: int) -> list[int]:
    """Which worker (index into `node_ids`: the node of each) takes each rank, so that every
    tensor-parallel group (tp_size consecutive ranks) lies on one node where possible: TP
    collectives run every layer, pipeline sends once per stage. Nodes with more workers come
    first; on each, whole TP groups first, and what is left over fills the last groups."""
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(i)
    nodes = sorted(by_node, key=lambda n: -len(by_node[n]))  # stable: ties keep bundle order
    whole, rest = [], []
    for node in nodes:
        members = by_node[node]
        cut = len(members) // tp_size * tp_size
        whole += members[:cut]
        rest += members[cut:]
    return whole + rest


def local_ranks(node_ids: list[str]) -> list[int]:
    """Each rank's index among the ranks on its node (node_ids in rank order)."""
    seen: dict[str, int] = {}
    out = []
    for node in node_ids:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def wait_some(ray: ModuleType, pending: dict[Any, int], timeout: float | None
              ) -> list[tuple[int, str, Any]]:
    """Wait up to `timeout` s (None: POLL_S) for some of the calls in `pending` (ObjectRef ->
    rank) to finish, and take those out of it: [(rank, kind, value)], kind "ok" (the result),
    "error" ((exception, remote traceback)) or "dead" (Ray's error: the actor or its node is
    gone).

    Fast path: one ray.get of every call, in slices of POLL_S (each Ray API call costs
    ~0.1-0.3 ms here, a round trip a few of them); a slice that ends with calls still out,
    or any call failed, is sorted out one call at a time. So an error is seen within
    POLL_S even while other ranks hang."""
    refs = list(pending)
    wait = POLL_S if timeout is None else max(0.0, min(timeout, POLL_S))
    try:
        values = ray.get(refs, timeout=wait)
    except ray.exceptions.RayError:  # some are still out (GetTimeoutError) or failed
        refs = ray.wait(refs, num_returns=len(refs), timeout=0)[0]  # those done, below
    else:
        done = [(pending[ref], "ok", v) for ref, v in zip(refs, values, strict=True)]
        pending.clear()
        return done
    out = []
    for ref in refs:
        rank = pending.pop(ref)
        try:
            out.append((rank, "ok", ray.get(ref)))
        except ray.exceptions.RayTaskError as e:  # the method raised: not a dead actor
            # str(e) is Ray's report: where it ran and the remote traceback (in colour)
            tb = _ANSI.sub("", getattr(e, "traceback_str", None) or str(e))
            cause = e.cause if isinstance(e.cause, BaseException) else RuntimeError(tb)
            out.append((rank, "error", (cause, tb)))
        except ray.exceptions.RayError as e:  # the actor (or its node) is gone
            out.append((rank, "dead", e))
    return out
