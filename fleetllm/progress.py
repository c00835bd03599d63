"""Progress bars for long jobs (generation, checkpoint loading)."""

from __future__ import annotations

import threading

from tqdm import tqdm


class ProgressBar(tqdm):
    """tqdm with a thread lock. tqdm's default lock is a multiprocessing semaphore that is
    never released; once the mp backend has started the spawn resource tracker, every exit
    then warns of a "leaked semaphore". Our bars are only drawn from one process."""

    _lock = threading.RLock()
