"""A bounded load test of ``scripts/serve.py`` on loopback (the serve section of scripts/benchmark.py).

``ServerProcess`` starts the command as typed in a process group of its own and stops it by its PID
(SIGTERM: LitServe's shutdown; then SIGKILL to what is left of that group only); ``group_memory``
reads the RSS of every process of the group; ``hammer`` sends a fixed number of requests from a fixed
number of client threads (keep-alive connections), each bounded in time.
"""

from __future__ import annotations

import http.client
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python scripts/serve.py <args> port=<free> host=127.0.0.1``, its output in ``log``."""

    def __init__(self, script: Path, args: list[str], log: Path, *, env: dict | None = None) -> None:
        self.port = free_port()
        self.log = log
        cmd = [sys.executable, str(script), *args, "host=127.0.0.1", f"port={self.port}"]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until ``GET /health`` is 200 ``ok``; RuntimeError with the log's tail when it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve.py exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().read() == b"ok":
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve.py not ready in {timeout_s:g} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process was started in: ours only
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)

    def memory(self) -> dict:
        return group_memory(self.proc.pid)


def group_memory(pgid: int) -> dict:
    """``{"rss_mb": sum of VmRSS, "peak_rss_mb": sum of VmHWM, "pss_mb": sum of Pss, "processes": n}``
    over the processes of process group ``pgid`` (Linux /proc; zeros elsewhere). RSS counts the pages
    the processes share (torch's libraries) once per process; PSS splits them between the sharers."""
    rss = hwm = pss = n = 0
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:  # fields after "(comm)": state ppid pgrp
                continue
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError, IndexError):
            continue
        try:
            rollup = (entry / "smaps_rollup").read_text()
            pss += int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:")))
        except (OSError, StopIteration, ValueError):
            pass
        rss += int(fields.get("VmRSS", "0 kB").split()[0])
        hwm += int(fields.get("VmHWM", "0 kB").split()[0])
        n += 1
    return {"rss_mb": rss / 1024, "peak_rss_mb": hwm / 1024, "pss_mb": pss / 1024, "processes": n}


def hammer(port: int, bodies: list[bytes], *, requests: int, clients: int, timeout_s: float = 600) -> dict:
    """Send ``requests`` JSON bodies (cycled) from ``clients`` threads to ``POST /predict``; every thread
    stops at ``timeout_s``. Returns the wall time and, per answered (200) request, its latency (s) and
    the X-Batch-Size it reported (``load_summary`` turns runs into figures)."""
    order = itertools.count()
    lock = threading.Lock()
    latencies, batch_sizes = [], []  # of the answered (200) requests; the rest count as failed
    deadline = time.monotonic() + timeout_s

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < deadline:
            with lock:
                i = next(order)
            if i >= requests:
                break
            start = time.perf_counter()
            try:
                conn.request("POST", "/predict", body=bodies[i % len(bodies)],
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok, size = response.status == 200, response.getheader("X-Batch-Size")
            except (OSError, http.client.HTTPException):
                ok, size = False, None
                conn.close()  # a fresh connection for the next request
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            took = time.perf_counter() - start
            if ok:
                with lock:
                    latencies.append(took)
                    batch_sizes.append(int(size or 1))
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic() + 60))
    return {"requests": requests, "wall_s": time.perf_counter() - start, "latencies": latencies,
            "batch_sizes": batch_sizes}


def load_summary(runs: list[dict]) -> dict:
    """The runs of one contender (``hammer``'s results) together: requests, answered, failed (not
    answered 200), req/s (answered / summed wall time), latency p50/p99 (ms), mean and max batch size."""
    lat = np.array([t for r in runs for t in r["latencies"]]) * 1e3
    sizes = [b for r in runs for b in r["batch_sizes"]]
    requests, wall = sum(r["requests"] for r in runs), sum(r["wall_s"] for r in runs)
    nan = float("nan")
    return {"requests": requests, "answered": len(lat), "failed": requests - len(lat), "wall_s": wall,
            "req_s": len(lat) / wall if wall > 0 else nan,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else nan,
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else nan,
            "mean_batch": float(np.mean(sizes)) if sizes else nan, "max_batch": max(sizes, default=0)}
