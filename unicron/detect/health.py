"""Host and GPU health readings (thin shell: reads the machine) and ``health_faults`` (pure).

A reading is a plain dict, the ``health`` object of the coordinator's status snapshot
(docs/architecture.md): host fields plus ``gpus``, a list with one dict per GPU. Without an
NVIDIA driver (or without pynvml) ``gpus`` is simply ``[]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from unicron.detect.faults import Fault

MEMORY_PRESSURE_PERCENT = 95.0
VMSTAT = Path("/proc/vmstat")

# Clock throttling that points at a cooling, power or hardware problem (idle clocks, application
# clocks, the software power cap and sync boost are normal under load).
BAD_THROTTLE_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
_THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock", 0x200: "board_limit", 0x400: "reliability",
}


def read_oom_kills(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's OOM-kill counter (Linux >= 4.13), or None where the kernel has none."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def read_host_health(now: Callable[[], float] = time.time) -> dict[str, Any]:
    """CPU, memory, swap, load and OOM kills of this host.

    ``cpu_percent`` is measured since the previous call in this process (0.0 on the first).
    """
    mem = psutil.virtual_memory()
    swap = psutil.swap_memory()
    try:
        load1 = psutil.getloadavg()[0]
    except (OSError, AttributeError):
        load1 = None
    return {
        "ts": now(),
        "cpu_percent": psutil.cpu_percent(interval=None),
        "mem_percent": mem.percent,
        "mem_available": mem.available,
        "mem_total": mem.total,
        "swap_percent": swap.percent,
        "load1": load1,
        "oom_kills": read_oom_kills(),
    }


class GpuHealthReader:
    """Reads every GPU through NVML, keeping an Xid event set open between readings so each
    reading reports the Xid events that happened since the previous one."""

    def __init__(self) -> None:
        self.unavailable_reason = ""
        self._nvml: Any = None
        self._events: Any = None
        self._started = False

    def _start(self) -> None:
        self._started = True
        try:
            import pynvml
        except ImportError:
            self.unavailable_reason = "pynvml is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:  # no driver, no library, no permission
            self.unavailable_reason = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError:
                    pass  # Xid events unsupported on this GPU (e.g. some consumer boards)
        except pynvml.NVMLError:
            self._events = None

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None  # not supported on this GPU / driver

    def _drain_xids(self) -> dict[int, list[int]]:
        xids: dict[int, list[int]] = {}
        if self._events is None:
            return xids
        nvml = self._nvml
        for _ in range(1000):  # bounded: a storm of events must not stall the agent
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:
                break  # NVML_ERROR_TIMEOUT: no more pending events
            index = self._try(nvml.nvmlDeviceGetIndex, data.device)
            xids.setdefault(-1 if index is None else int(index), []).append(int(data.eventData))
        return xids

    def read(self) -> list[dict[str, Any]]:
        if not self._started:
            self._start()
        nvml = self._nvml
        if nvml is None:
            return []
        xids = self._drain_xids()
        count = self._try(nvml.nvmlDeviceGetCount) or 0
        gpus = []
        for index in range(count):
            handle = self._try(nvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None:
                continue
            util = self._try(nvml.nvmlDeviceGetUtilizationRates, handle)
            mem = self._try(nvml.nvmlDeviceGetMemoryInfo, handle)
            reasons = self._try(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
            if reasons is None:
                reasons = self._try(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
            name = self._try(nvml.nvmlDeviceGetName, handle)
            uuid = self._try(nvml.nvmlDeviceGetUUID, handle)
            gpus.append({
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else name,
                "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                "util": util.gpu if util is not None else None,
                "mem_used": mem.used if mem is not None else None,
                "mem_total": mem.total if mem is not None else None,
                "temp": self._try(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                "throttle": [n for bit, n in _THROTTLE_BITS.items() if reasons and reasons & bit],
                "ecc_uncorrected": self._try(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                             nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
                "ecc_corrected": self._try(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                           nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC),
                "xid": xids.get(index, []) + (xids.get(-1, []) if index == 0 else []),
            })
        return gpus

    def close(self) -> None:
        if self._nvml is not None:
            if self._events is not None:
                self._try(self._nvml.nvmlEventSetFree, self._events)
            self._try(self._nvml.nvmlShutdown)
        self._nvml, self._events = None, None


_default_reader: GpuHealthReader | None = None


def read_gpu_health() -> list[dict[str, Any]]:
    """Every GPU's health through a process-wide reader; [] without an NVIDIA driver."""
    global _default_reader
    if _default_reader is None:
        _default_reader = GpuHealthReader()
    return _default_reader.read()


def read_health(gpu_reader: GpuHealthReader | None = None) -> dict[str, Any]:
    """Host health with ``gpus`` added: the status snapshot's ``health`` object."""
    reading = read_host_health()
    reading["gpus"] = gpu_reader.read() if gpu_reader is not None else read_gpu_health()
    return reading


def health_faults(
    prev: dict[str, Any] | None,
    cur: dict[str, Any],
    *,
    node: str = "",
    host: str = "",
    attempt: int = 0,
    mem_threshold: float = MEMORY_PRESSURE_PERCENT,
) -> list[Fault]:
    """Faults for what changed between two readings (pure). ``prev`` is None for the first one:
    then only absolute conditions count (memory pressure, Xid events), never counters."""
    ts = float(cur.get("ts", 0.0))
    faults: list[Fault] = []

    def fault(error_type: str, message: str, gpu: int | None = None) -> None:
        faults.append(Fault("health", ts, node=node, host=host, error_type=error_type, message=message,
                            attempt=attempt, gpu=gpu))

    before_oom, now_oom = (prev or {}).get("oom_kills"), cur.get("oom_kills")
    if isinstance(before_oom, int) and isinstance(now_oom, int) and now_oom > before_oom:
        fault("oom_kill", f"kernel OOM killer killed {now_oom - before_oom} process(es)")

    mem = cur.get("mem_percent")
    before_mem = (prev or {}).get("mem_percent")
    crossed = not isinstance(before_mem, (int, float)) or before_mem < mem_threshold
    if isinstance(mem, (int, float)) and mem >= mem_threshold and crossed:
        fault("memory_pressure", f"host memory {mem:.1f}% used (threshold {mem_threshold:g}%)")

    prev_gpus = {g.get("index"): g for g in (prev or {}).get("gpus", [])}
    cur_gpus = {g.get("index"): g for g in cur.get("gpus", [])}
    for index in sorted(i for i in prev_gpus if i not in cur_gpus and isinstance(i, int)):
        fault("gpu_lost", f"GPU {index} no longer answers NVML", gpu=index)
    for index, gpu in sorted((i, g) for i, g in cur_gpus.items() if isinstance(i, int)):
        old = prev_gpus.get(index, {})
        for code in gpu.get("xid") or []:
            fault("xid", f"Xid {code} on GPU {index}", gpu=index)
        before_ecc, now_ecc = old.get("ecc_uncorrected"), gpu.get("ecc_uncorrected")
        if isinstance(before_ecc, int) and isinstance(now_ecc, int) and now_ecc > before_ecc:
            fault("ecc_uncorrectable", f"{now_ecc - before_ecc} new uncorrectable ECC error(s) on GPU {index}",
                  gpu=index)
        new_throttle = [r for r in gpu.get("throttle") or [] if r in BAD_THROTTLE_REASONS
                        and r not in (old.get("throttle") or [])]
        if prev is not None and new_throttle:
            fault("gpu_throttle", f"GPU {index} throttled: {', '.join(new_throttle)}", gpu=index)
    return faults
