"""A worker whose model load takes $FLEETLLM_TEST_LOAD_DELAY seconds (default 5), named by
worker_cls: a test can signal a server while its engine is surely still starting."""

from __future__ import annotations

import os
import time

from fleetllm.worker.worker import Worker


class SlowStartWorker(Worker):
    def load_model(self) -> None:
        time.sleep(float(os.environ.get("FLEETLLM_TEST_LOAD_DELAY", "5")))
        super().load_model()
