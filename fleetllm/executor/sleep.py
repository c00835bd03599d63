"""SleepState: what an executor's workers have freed (Executor.sleep / wake_up), and the KV
cache epoch that tells an engine its cached KV is gone.

sleep(level) frees the KV cache on every worker (level 1; on an accelerator the weights also
move to host memory) or the KV cache and the weights (level 2); wake_up(tags) restores
"weights", "kv_cache" or both. The executor is asleep from the moment sleep() starts, even if
a rank fails: wake_up restores what each rank freed, and a restart puts the new workers back
to sleep at the same level with the same parts awake (restore()).

kv_cache_epoch moves whenever the workers' KV content is lost (sleep, restart), whoever
called: an engine compares it before every step and recomputes instead of reading blocks
that were wiped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from fleetllm.errors import ConfigurationError, EngineSleepingError

logger = logging.getLogger(__name__)
TAGS = frozenset({"weights", "kv_cache"})

Rpc = Callable[..., list[Any]]  # Executor.collective_rpc


class SleepState:
    def __init__(self) -> None:
        self.tags: set[str] = set()  # what is asleep
        self.level = 0
        self.kv_cache_epoch = 0

    @property
    def is_sleeping(self) -> bool:
        return bool(self.tags)

    def raise_if_asleep(self) -> None:
        if self.tags:
            raise EngineSleepingError(
                f"the engine is asleep ({', '.join(sorted(self.tags))} freed): call "
                "wake_up() first (LLM.wake_up / LLMEngine.wake_up); an LLMEngine keeps its "
                "queued requests and runs them after wake_up")

    def kv_lost(self) -> None:
        self.kv_cache_epoch += 1

    def sleep(self, rpc: Rpc, level: int) -> None:
        if level not in (1, 2):
            raise ConfigurationError(f"level: sleep level must be 1 or 2, got {level!r}")
        if self.tags:
            logger.info("sleep(%s): the executor is already asleep", level)
            return
        start = time.perf_counter()
        self.tags, self.level = set(TAGS), level
        self.kv_lost()
        freed = sum(rpc("sleep", args=(level,)))
        logger.info("asleep (level %d) in %.2f s: %.1f MiB freed", level,
                    time.perf_counter() - start, freed / (1 << 20))

    def wake_up(self, rpc: Rpc, tags: Iterable[str] | None) -> None:
        wanted = set(TAGS) if tags is None else set(tags)
        unknown = wanted - TAGS
        if unknown:
            raise ConfigurationError(f"tags: {sorted(unknown)} are not 'weights' or "
                                     "'kv_cache'")
        wake = sorted(wanted & self.tags)
        if not wake:
            return
        start = time.perf_counter()
        rpc("wake_up", args=(wake,))
        self.tags -= set(wake)
        if not self.tags:
            self.level = 0
        logger.info("woke %s in %.2f s", ", ".join(wake), time.perf_counter() - start)

    def restore(self, rpc: Rpc) -> None:
        """New workers (after a restart) to the state the old ones were in."""
        if not self.tags:
            return
        rpc("sleep", args=(self.level,))
        awake = sorted(TAGS - self.tags)
        if awake:
            rpc("wake_up", args=(awake,))
