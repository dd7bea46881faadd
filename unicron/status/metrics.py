"""Opt-in Prometheus endpoint (text exposition format 0.0.4) for the coordinator.

``format_metrics(values)`` is pure: it turns one job's numbers (or ``{"jobs": [...]}`` for a
coordinator serving several) into exposition text. ``MetricsRecorder`` is a thread-safe place
for the coordinator to count into, and its ``values()`` is a ready ``collect`` callable.
``start_metrics_server(port, collect)`` serves ``GET /metrics`` from a daemon thread.

The values dict of one job (every key optional):

=========================  ================================================================
``job``                    job id (becomes the ``job`` label)
``steps_per_second``       current training throughput
``step``                   last step every rank completed
``detection_latency_last`` seconds from the last fault to its detection
``detection_latencies``    every detection latency observed (seconds), for the histogram
``restarts``               ``{cause: count}`` of restarts (cause: e.g. ``exit``, ``hang``)
``downtime_seconds``       total seconds the job was not training (fault to next step)
``transfer_bytes``         total bytes of state moved between nodes / restored
``dropped_messages``       ``{reason: count}`` of messages the coordinator dropped
=========================  ================================================================
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from unicron.errors import UsageError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Detection targets are sub-second for crashes and a few seconds for hangs and lost nodes.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

# name, type, help
_GAUGES = (
    ("unicron_steps_per_second", "steps_per_second", "Training steps per second (slowest rank)."),
    ("unicron_step", "step", "Last training step every rank completed."),
    ("unicron_detection_latency_last_seconds", "detection_latency_last",
     "Seconds from the last fault to its detection."),
)
_COUNTERS = (
    ("unicron_downtime_seconds_total", "downtime_seconds", "Seconds the job was not training because of faults."),
    ("unicron_transfer_bytes_total", "transfer_bytes", "Bytes of training state moved or restored."),
)
_LABELLED_COUNTERS = (
    ("unicron_restarts_total", "restarts", "cause", "Restarts of the job, by cause."),
    ("unicron_dropped_messages_total", "dropped_messages", "reason", "Mesh messages dropped, by reason."),
)
_LATENCY = ("unicron_detection_latency_seconds", "detection_latencies", "Fault detection latency in seconds.")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs)
    return f"{{{body}}}" if body else ""


def _jobs(values: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    jobs = values.get("jobs")
    if isinstance(jobs, list):
        return [j for j in jobs if isinstance(j, Mapping)]
    return [values]


def _job_label(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("job", str(job["job"]))] if job.get("job") is not None else []


def histogram_lines(name: str, base: list[tuple[str, str]], observations: Sequence[float],
                    buckets: Sequence[float] = LATENCY_BUCKETS) -> list[str]:
    """Cumulative ``_bucket`` lines (ending with ``le="+Inf"``), ``_sum`` and ``_count``."""
    lines = []
    for bound in (*buckets, math.inf):
        count = sum(1 for x in observations if x <= bound)
        lines.append(f"{name}_bucket{_labels([*base, ('le', format_value(bound))])} {count}")
    lines.append(f"{name}_sum{_labels(base)} {format_value(float(sum(observations)))}")
    lines.append(f"{name}_count{_labels(base)} {len(observations)}")
    return lines


def format_metrics(values: Mapping[str, Any]) -> str:
    """Prometheus text exposition of one job's values, or of ``{"jobs": [values, ...]}``.

    Every family is written once (HELP, TYPE, then all its samples). Counters are always
    present (0 until something is counted); a gauge without a value has no sample.
    """
    jobs = _jobs(values)
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        # HELP and TYPE even without samples, so a scraper knows the family before it happens.
        out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

    for name, key, help_text in _GAUGES:
        family(name, "gauge", help_text, [f"{name}{_labels(_job_label(j))} {format_value(v)}"
                                          for j in jobs if (v := _number(j.get(key))) is not None])
    for name, key, help_text in _COUNTERS:
        family(name, "counter", help_text, [f"{name}{_labels(_job_label(j))} {format_value(_number(j.get(key)) or 0.0)}"
                                            for j in jobs])
    for name, key, label, help_text in _LABELLED_COUNTERS:
        samples = []
        for j in jobs:
            counts = j.get(key)
            if isinstance(counts, Mapping):
                for label_value, count in sorted(counts.items(), key=lambda kv: str(kv[0])):
                    if (n := _number(count)) is not None:
                        samples.append(f"{name}{_labels([*_job_label(j), (label, str(label_value))])} {format_value(n)}")
        family(name, "counter", help_text, samples)
    name, key, help_text = _LATENCY
    samples = []
    for j in jobs:
        raw = j.get(key)
        observations = [x for x in (_number(v) for v in raw) if x is not None] if isinstance(raw, list) else []
        samples += histogram_lines(name, _job_label(j), observations)
    family(name, "histogram", help_text, samples)
    return "\n".join(out) + "\n"


class MetricsRecorder:
    """Counters the coordinator updates as things happen; ``values()`` is a ``collect`` callable."""

    def __init__(self, job: str | None = None) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._latencies: list[float] = []
        self._restarts: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._downtime = 0.0
        self._transfer = 0
        self._steps_per_second: float | None = None
        self._step: int | None = None

    def observe_detection(self, latency_s: float) -> None:
        with self._lock:
            self._latencies.append(float(latency_s))

    def count_restart(self, cause: str) -> None:
        with self._lock:
            self._restarts[cause] = self._restarts.get(cause, 0) + 1

    def add_downtime(self, seconds: float) -> None:
        with self._lock:
            self._downtime += max(0.0, float(seconds))

    def add_transfer(self, nbytes: int) -> None:
        with self._lock:
            self._transfer += max(0, int(nbytes))

    def set_dropped(self, counts: Mapping[str, int]) -> None:
        """Dropped messages by reason (e.g. a ``DropCounter.counts``, already cumulative)."""
        with self._lock:
            self._dropped = dict(counts)

    def set_progress(self, step: int | None, steps_per_second: float | None) -> None:
        with self._lock:
            self._step, self._steps_per_second = step, steps_per_second

    def values(self) -> dict[str, Any]:
        with self._lock:
            return {"job": self.job, "steps_per_second": self._steps_per_second, "step": self._step,
                    "detection_latency_last": self._latencies[-1] if self._latencies else None,
                    "detection_latencies": list(self._latencies), "restarts": dict(self._restarts),
                    "downtime_seconds": self._downtime, "transfer_bytes": self._transfer,
                    "dropped_messages": dict(self._dropped)}


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], collect: Callable[[], Mapping[str, Any]]) -> None:
        super().__init__(address, _Handler)
        self.collect = collect
        self.thread: threading.Thread | None = None
        self.client_errors = 0  # requests that broke off (a scraper that timed out and reset)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback on the console for each; a scrape that gives up
        # mid-answer (a Prometheus timeout) is ordinary, and only the scraper is affected.
        self.client_errors += 1
        log.debug("metrics request from %s broke off", client_address, exc_info=True)

    def stop(self) -> None:
        stop_metrics_server(self)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._reply(404, "not found: try /metrics\n", "text/plain; charset=utf-8")
            return
        try:
            body = format_metrics(self.server.collect())
        except Exception as err:  # a broken collector must not kill the server; say why to the scraper
            self._reply(500, f"collect failed: {type(err).__name__}: {err}\n", "text/plain; charset=utf-8")
            return
        self._reply(200, body, CONTENT_TYPE)

    def _reply(self, code: int, text: str, content_type: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a line each
        return


def start_metrics_server(port: int, collect: Callable[[], Mapping[str, Any]],
                         host: str = "0.0.0.0") -> tuple[MetricsServer, int]:
    """Serve ``GET /metrics`` on ``host:port`` (0: any free port) from a daemon thread.

    Returns the server and the port it is bound to. Binds all interfaces by default so
    Prometheus can scrape the coordinator from another machine.
    """
    try:
        server = MetricsServer((host, port), collect)
    except OSError as err:
        raise UsageError(f"--metrics-port: cannot listen on {host}:{port}: {err.strerror or err}; "
                         "pick a free port (or 0 for any)") from None
    server.thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                     name="unicron-metrics", daemon=True)
    server.thread.start()
    return server, int(server.server_address[1])


def stop_metrics_server(server: MetricsServer) -> None:
    """Stop serving and close the socket; returns once the serving thread is gone."""
    server.shutdown()
    server.server_close()
    if server.thread is not None:
        server.thread.join(timeout=5)
