"""LocalServer: `fleetllm serve` as a child process, ready when the constructor returns.

For the serving benchmark and tests: it binds a free loopback port (--port 0), learns it from
the server's "listening on" line, waits for /health to answer 200, and stop() sends SIGTERM
(the server drains and exits 0) and kills it if it does not exit in time.
"""

from __future__ import annotations

import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from fleetllm import envs

_READY_PREFIX = "fleetllm serve: listening on "


class ServerStartError(RuntimeError):
    pass


class LocalServer:
    def __init__(self, args: list[str], env: Mapping[str, str] | None = None,
                 startup_timeout: float = 180.0, command: list[str] | None = None,
                 url: str | None = None, ready_prefix: str = _READY_PREFIX):
        """`fleetllm serve ARGS` on a free port; or another server (a peer): `command` (with
        its args), listening at `url`, ready once its /health answers 200 (or, without
        `url`, at the URL its stdout line starting with `ready_prefix` names: `fleetllm
        proxy`'s)."""
        self._ready_prefix = ready_prefix
        self._dir = tempfile.mkdtemp(prefix="fleetllm-serve-")
        self.log_path = Path(self._dir) / "server.log"
        self._log = open(self.log_path, "w")  # lives as long as the server
        self._final_log: str | None = None
        cmd = command or [sys.executable, "-m", "fleetllm.cli", "serve", "--port", "0",
                          "--host", "127.0.0.1", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log,
                                     env=dict(env) if env is not None else None, text=True)
        try:
            if url is None:
                self.url = self._wait_listening(startup_timeout)
            else:
                self.url = url
                threading.Thread(target=self._copy_stdout, daemon=True).start()
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """What the server wrote (kept after stop() for post-mortems)."""
        if self._final_log is not None:
            return self._final_log
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        out = self.proc.stdout
        assert out is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                if line.startswith(self._ready_prefix):
                    threading.Thread(target=self._copy_stdout, daemon=True).start()
                    return line[len(self._ready_prefix):].strip()
                if line:
                    self._log.write(line)
                    continue
            if self.proc.poll() is not None:
                raise ServerStartError(f"the server exited with {self.proc.returncode}:\n"
                                       f"{self.log()[-4000:]}")
        raise ServerStartError(f"the server did not start in {timeout:.0f} s:\n"
                               f"{self.log()[-4000:]}")

    def _copy_stdout(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._log.write(line)
        except (ValueError, OSError):  # closed by stop()
            pass

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise ServerStartError(f"/health did not answer 200 in {timeout:.0f} s:\n"
                               f"{self.log()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain), then SIGKILL after `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._close()

    def _close(self) -> None:
        if self._final_log is not None:
            return
        self._final_log = self.log()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        if not envs.get("FLEETLLM_KEEP_SERVER_LOGS"):
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
