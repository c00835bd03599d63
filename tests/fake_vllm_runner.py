"""A stand-in for fleetllm/benchmarks/vllm_runner.py speaking the same JSON lines, for testing
the driver without vLLM: it answers every run with tokens 7, 7, ... and a time that depends on
its configuration (eager +0.1 s; bound "auto" 0.5 s, else 0.25 s), and appends every message
and its environment's VLLM_* settings to $FAKE_RUNNER_LOG. FAKE_RUNNER_MODE=crash exits on a
run, =hang never answers one."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    mode = os.environ.get("FAKE_RUNNER_MODE", "ok")
    eager = False
    for line in sys.stdin:
        msg = json.loads(line)
        with open(os.environ["FAKE_RUNNER_LOG"], "a") as log:
            env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}
            log.write(json.dumps({"msg": msg, "env": env}) + "\n")
        if msg["op"] == "exit":
            return 0
        if msg["op"] == "load":
            eager = msg["enforce_eager"]
            reply = {"ok": True, "vllm": "fake", "seconds": 0.0}
        elif mode == "crash":
            return 3
        elif mode == "hang":
            time.sleep(3600)
            return 0
        else:
            seconds = (0.5 if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "auto" else 0.25) + \
                (0.1 if eager else 0.0)
            outputs = [[7] * n for _, n in msg["requests"]]
            times = [[0.01 * (i + 1) for i in range(n)] for _, n in msg["requests"]]
            reply = {"ok": True, "seconds": seconds, "outputs": outputs,
                     "token_times": times if msg["stream"] else None}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
