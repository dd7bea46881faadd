"""Health readings on this machine (no GPU) and the pure ``health_faults`` diff."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from unicron.detect.classify import classify
from unicron.detect.faults import Fault, Severity
from unicron.detect.health import (
    GpuHealthReader,
    health_faults,
    read_gpu_health,
    read_health,
    read_host_health,
    read_oom_kills,
)


def test_host_health_on_this_machine_is_sane() -> None:
    read_host_health()  # the first cpu_percent reading is 0.0 by psutil's definition
    h = read_host_health(now=lambda: 1234.5)
    assert h["ts"] == 1234.5
    assert 0.0 <= h["cpu_percent"] <= 100.0 * (psutil.cpu_count() or 1)
    assert 0.0 < h["mem_percent"] < 100.0
    assert 0 < h["mem_available"] <= h["mem_total"] == psutil.virtual_memory().total
    assert 0.0 <= h["swap_percent"] <= 100.0
    vmstat = Path("/proc/vmstat")
    if vmstat.exists() and "oom_kill " in vmstat.read_text():
        assert isinstance(h["oom_kills"], int) and h["oom_kills"] >= 0
    else:
        assert h["oom_kills"] is None
    json.dumps(h)  # it travels in heartbeats


def test_no_gpu_here_gives_empty_list_without_error() -> None:
    reader = GpuHealthReader()
    assert reader.read() == []
    assert reader.unavailable_reason  # says why (no library / no driver)
    assert reader.read() == []  # and stays quiet on later readings
    reader.close()
    assert read_gpu_health() == []
    assert read_health()["gpus"] == []


def test_oom_counter_parsing(tmp_path: Path) -> None:
    f = tmp_path / "vmstat"
    f.write_text("nr_free_pages 100\noom_kill 7\npgfault 9\n")
    assert read_oom_kills(f) == 7
    f.write_text("nr_free_pages 100\n")
    assert read_oom_kills(f) is None
    assert read_oom_kills(tmp_path / "missing") is None


def reading(ts: float = 10.0, mem: float = 50.0, oom: int | None = 0, gpus: list[dict] | None = None) -> dict:
    return {"ts": ts, "cpu_percent": 5.0, "mem_percent": mem, "oom_kills": oom, "gpus": gpus or []}


def gpu(index: int = 0, ecc: int | None = 0, xid: list[int] | None = None, throttle: list[str] | None = None) -> dict:
    return {"index": index, "util": 90, "mem_used": 1, "mem_total": 2, "temp": 60,
            "ecc_uncorrected": ecc, "xid": xid or [], "throttle": throttle or []}


def kinds(faults: list[Fault]) -> list[tuple[str, int | None]]:
    return [(f.error_type, f.gpu) for f in faults]


def test_steady_readings_give_no_faults() -> None:
    prev = reading(gpus=[gpu(0), gpu(1)])
    assert health_faults(prev, reading(ts=11.0, gpus=[gpu(0), gpu(1)])) == []
    assert health_faults(None, reading(gpus=[gpu(0, ecc=3)])) == [], "counters need a previous reading"


def test_oom_kill_counter_increase() -> None:
    faults = health_faults(reading(oom=2), reading(ts=20.0, oom=5), node="n3", host="h3", attempt=2)
    assert kinds(faults) == [("oom_kill", None)]
    f = faults[0]
    assert (f.kind, f.node, f.host, f.attempt, f.ts) == ("health", "n3", "h3", 2, 20.0)
    assert "3 process" in f.message
    assert health_faults(reading(oom=None), reading(oom=5)) == []


def test_memory_pressure_on_crossing_only() -> None:
    assert kinds(health_faults(reading(mem=80.0), reading(mem=96.0))) == [("memory_pressure", None)]
    assert health_faults(reading(mem=96.0), reading(mem=97.0)) == []
    assert kinds(health_faults(None, reading(mem=99.0))) == [("memory_pressure", None)]
    assert health_faults(reading(mem=80.0), reading(mem=85.0), mem_threshold=90.0) == []


def test_gpu_changes() -> None:
    prev = reading(gpus=[gpu(0), gpu(1), gpu(2)])
    cur = reading(gpus=[gpu(0, ecc=2), gpu(1, xid=[79, 13], throttle=["hw_slowdown", "sw_power_cap"])])
    got = kinds(health_faults(prev, cur))
    assert got == [("gpu_lost", 2), ("ecc_uncorrectable", 0), ("xid", 1), ("xid", 1), ("gpu_throttle", 1)]
    # A throttle reason already present is not new; the software power cap is normal.
    again = reading(gpus=[gpu(0, ecc=2), gpu(1, throttle=["hw_slowdown", "sw_power_cap"])])
    assert health_faults(cur, again) == []


def test_health_faults_classify_by_severity() -> None:
    prev = reading(oom=0, gpus=[gpu(0), gpu(1)])
    cur = reading(oom=1, mem=99.0, gpus=[gpu(0, ecc=1, xid=[79]), gpu(1, xid=[13], throttle=["hw_thermal_slowdown"])])
    result = {(f.error_type, f.gpu, f.message.split()[1] if f.error_type == "xid" else ""): classify(f).severity
              for f in health_faults(prev, cur, node="n0")}
    assert result == {
        ("oom_kill", None, ""): Severity.INFO,
        ("memory_pressure", None, ""): Severity.INFO,
        ("xid", 0, "79"): Severity.SEV1,
        ("ecc_uncorrectable", 0, ""): Severity.SEV1,
        ("xid", 1, "13"): Severity.INFO,
        ("gpu_throttle", 1, ""): Severity.INFO,
    }


def test_health_evidence_upgrades_worker_faults() -> None:
    prev, cur = reading(oom=0), reading(ts=50.0, oom=1)
    evidence = health_faults(prev, cur, node="n0")
    killed = Fault("exit", 49.0, rank=0, node="n0", exitcode=-9)
    assert classify(killed).rule == "sigkill"
    c = classify(killed, evidence)
    assert c.rule == "oom-killer" and "OOM killer" in c.reason and c.severity is Severity.SEV2


@pytest.mark.parametrize("gpus", [[{"index": None}], [{"util": 1}]])
def test_malformed_gpu_entries_are_ignored(gpus: list[dict]) -> None:
    assert health_faults(reading(gpus=gpus), reading(gpus=[])) == []


def test_health_watch_reports_hardware_at_once_and_keeps_the_rest_as_evidence() -> None:
    import time

    from unicron.agent.healthwatch import HEALTH_EVERY_S, HealthWatch

    watch = HealthWatch()
    assert watch.due(100.0) and not watch.due(100.0 + HEALTH_EVERY_S / 2) and watch.due(100.0 + HEALTH_EVERY_S)
    now = time.time()
    report, kept = watch.update(reading(ts=now, oom=0, gpus=[gpu(0)]), node="n0", host="h0", attempt=1, running=True)
    assert report == [] and kept == []
    report, kept = watch.update(reading(ts=now + 1, oom=2, gpus=[gpu(0, xid=[79])]), node="n0", host="h0",
                                attempt=1, running=True)
    assert [(f["error_type"], f["gpu"]) for f in report] == [("xid", 0)], "a hardware Xid is reported at once"
    assert kinds(kept) == [("oom_kill", None)] and watch.reading["oom_kills"] == 2
    # Between attempts nothing is reported: the Xid is kept as evidence too.
    report, kept = watch.update(reading(ts=now + 2, oom=2, gpus=[gpu(0, xid=[79])]), node="n0", host="h0",
                                attempt=-1, running=False)
    assert report == [] and kinds(kept) == [("xid", 0)]
    assert [f["error_type"] for f in watch.take_evidence()] == ["oom_kill", "xid"]
    assert watch.take_evidence() == []
    # Evidence older than a minute is dropped at the next reading.
    watch.update(reading(ts=now - 600, oom=3), node="n0", host="h0", attempt=1, running=True)
    watch.update(reading(ts=now, oom=3), node="n0", host="h0", attempt=1, running=True)
    assert watch.evidence == []
