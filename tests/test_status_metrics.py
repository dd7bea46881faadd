"""Prometheus exposition: the pure formatter checked against the text format, and a real scrape."""

from __future__ import annotations

import math
import re
import threading
import urllib.error
import urllib.request

import pytest

from unicron.status.metrics import (
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    MetricsRecorder,
    format_metrics,
    start_metrics_server,
    stop_metrics_server,
)

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
SAMPLE = re.compile(rf"^({NAME})(\{{{LABEL}(?:,{LABEL})*\}})? (\S+)$")
TYPE_LINE = re.compile(rf"^# TYPE ({NAME}) (counter|gauge|histogram|summary|untyped)$")
HELP_LINE = re.compile(rf"^# HELP ({NAME}) .*$")


def parse_exposition(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Check ``text`` against the 0.0.4 text format; return samples by family.

    Every sample belongs to the family declared by the TYPE line before it (a histogram's
    ``_bucket``/``_sum``/``_count`` too), each family is declared once, values parse as floats.
    """
    assert text.endswith("\n")
    families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    types: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP"):
            assert HELP_LINE.match(line), line
            continue
        if line.startswith("# TYPE"):
            m = TYPE_LINE.match(line)
            assert m, line
            assert m.group(1) not in types, f"family {m.group(1)} declared twice"
            current, types[m.group(1)] = m.group(1), m.group(2)
            families[current] = []
            continue
        m = SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        name = m.group(1)
        assert current is not None
        suffixes = ("_bucket", "_sum", "_count") if types[current] == "histogram" else ("",)
        assert any(name == current + s for s in suffixes), f"{name} outside its family {current}"
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        families[current].append((name, labels, float(m.group(3))))
    for name, kind in types.items():
        if kind == "counter":
            assert name.endswith("_total"), name
    return families


def sample_values() -> dict:
    return {
        "job": "gpt-demo",
        "steps_per_second": 19.2,
        "step": 812,
        "detection_latency_last": 0.31,
        "detection_latencies": [0.08, 0.31, 2.4, 0.31],
        "restarts": {"exit": 2, "hang": 1},
        "downtime_seconds": 7.5,
        "transfer_bytes": 3 * 1024**3,
        "dropped_messages": {"unauthenticated": 4},
    }


def test_format_is_valid_exposition_with_every_metric() -> None:
    fam = parse_exposition(format_metrics(sample_values()))
    assert fam["unicron_steps_per_second"] == [("unicron_steps_per_second", {"job": "gpt-demo"}, 19.2)]
    assert fam["unicron_step"][0][2] == 812
    assert fam["unicron_detection_latency_last_seconds"][0][2] == 0.31
    restarts = {s[1]["cause"]: s[2] for s in fam["unicron_restarts_total"]}
    assert restarts == {"exit": 2, "hang": 1}
    assert fam["unicron_downtime_seconds_total"][0][2] == 7.5
    assert fam["unicron_transfer_bytes_total"][0][2] == 3 * 1024**3
    assert fam["unicron_dropped_messages_total"] == [
        ("unicron_dropped_messages_total", {"job": "gpt-demo", "reason": "unauthenticated"}, 4)
    ]


def test_histogram_is_cumulative_and_consistent() -> None:
    fam = parse_exposition(format_metrics(sample_values()))
    hist = fam["unicron_detection_latency_seconds"]
    buckets = [(s[1]["le"], s[2]) for s in hist if s[0].endswith("_bucket")]
    assert [b[0] for b in buckets][-1] == "+Inf" and len(buckets) == len(LATENCY_BUCKETS) + 1
    counts = [b[1] for b in buckets]
    assert counts == sorted(counts)  # cumulative
    by_le = dict(buckets)
    assert by_le["0.1"] == 1 and by_le["0.5"] == 3 and by_le["2"] == 3 and by_le["3"] == 4
    total = {s[0]: s[2] for s in hist if not s[0].endswith("_bucket")}
    assert total["unicron_detection_latency_seconds_count"] == by_le["+Inf"] == 4
    assert math.isclose(total["unicron_detection_latency_seconds_sum"], 0.08 + 0.31 + 2.4 + 0.31)


def test_empty_values_give_zero_counters_and_no_gauges() -> None:
    fam = parse_exposition(format_metrics({}))
    assert fam["unicron_steps_per_second"] == [] and fam["unicron_restarts_total"] == []
    assert fam["unicron_downtime_seconds_total"] == [("unicron_downtime_seconds_total", {}, 0.0)]
    assert fam["unicron_detection_latency_seconds"][-1] == (
        "unicron_detection_latency_seconds_count",
        {},
        0.0,
    )


def test_several_jobs_share_one_family_and_labels_are_escaped() -> None:
    a = sample_values()
    b = {"job": 'we"ird\\job\n', "restarts": {"node lost": 1}, "steps_per_second": 3}
    text = format_metrics({"jobs": [a, b]})
    fam = parse_exposition(text)
    jobs = {s[1]["job"] for s in fam["unicron_restarts_total"]}
    assert jobs == {"gpt-demo", 'we\\"ird\\\\job\\n'}
    assert len(fam["unicron_steps_per_second"]) == 2


def test_recorder_counts_from_several_threads() -> None:
    rec = MetricsRecorder("j")

    def work() -> None:
        for _ in range(500):
            rec.count_restart("exit")
            rec.add_transfer(10)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.observe_detection(0.2)
    rec.add_downtime(1.5)
    rec.set_dropped({"replayed": 3})
    rec.set_progress(40, 2.5)
    values = rec.values()
    assert values["restarts"] == {"exit": 2000} and values["transfer_bytes"] == 20000
    assert values["detection_latency_last"] == 0.2 and values["downtime_seconds"] == 1.5
    parse_exposition(format_metrics(values))


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_scrape_the_real_server() -> None:
    rec = MetricsRecorder("gpt-demo")
    server, port = start_metrics_server(0, rec.values, host="127.0.0.1")
    try:
        assert port > 0
        status, ctype, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and ctype == CONTENT_TYPE
        assert parse_exposition(body)["unicron_restarts_total"] == []
        rec.count_restart("hang")  # the next scrape sees what happened since
        rec.observe_detection(1.2)
        fam = parse_exposition(_get(f"http://127.0.0.1:{port}/metrics")[2])
        assert fam["unicron_restarts_total"] == [
            ("unicron_restarts_total", {"job": "gpt-demo", "cause": "hang"}, 1)
        ]
        assert fam["unicron_detection_latency_last_seconds"][0][2] == 1.2
        assert _get(f"http://127.0.0.1:{port}/nope")[0] == 404
    finally:
        stop_metrics_server(server)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_failing_collector_gives_500_and_the_server_survives() -> None:
    calls = {"n": 0}

    def collect() -> dict:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("coordinator state busy")
        return {"job": "x"}

    server, port = start_metrics_server(0, collect, host="127.0.0.1")
    try:
        status, _, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 500 and "coordinator state busy" in body
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        server.stop()


def test_a_scraper_that_resets_mid_request_costs_no_traceback_on_the_console(capfd) -> None:
    """Acceptance 25C F2: each broken-off scrape printed a Python traceback (socketserver's)."""
    import socket
    import struct

    from e2e import wait_for

    server, port = start_metrics_server(0, lambda: {"job": "x"}, host="127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHo")  # the server waits for the rest: reset then
        wait_for(lambda: server.client_errors >= 1, 10, "the server to meet the reset")
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200  # it serves on
    finally:
        server.stop()
    assert "Traceback" not in capfd.readouterr().err


def test_a_metrics_port_in_use_is_one_usage_error() -> None:
    import socket

    from unicron.errors import UsageError

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"--metrics-port: cannot listen on 0.0.0.0:{port}: .*pick a free port"):
            start_metrics_server(port, lambda: {})
