"""Value types of failure handling: what went wrong (``Fault``), how bad it is (``Severity``),
and what to do about it (``Action``, ``Classification``).

Faults travel between agents and the coordinator inside mesh messages, which are JSON, so
every type here has an explicit ``to_dict``/``from_dict`` (never pickle).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, fields
from typing import Any

FAULT_KINDS = ("exit", "exception", "hang", "node_lost", "health", "startup")


class Severity(enum.Enum):
    """How bad a fault is; the names follow the Unicron paper (SEV1 is the worst recoverable one)."""

    INFO = "INFO"  # not a failure (clean exit, memory pressure warning): record it, do nothing
    SEV3 = "SEV3"  # transient (a peer vanished, a link flapped): reattempt in place
    SEV2 = "SEV2"  # the process is broken (crash, CUDA error, hang): restart on the same resources
    SEV1 = "SEV1"  # a resource is lost (node, GPU hardware): reconfigure without it
    FATAL = "FATAL"  # a user error restarting cannot fix: never restarted

    @property
    def order(self) -> int:
        """Higher is worse; escalation moves up this order."""
        return _SEVERITY_ORDER[self]


_SEVERITY_ORDER = {Severity.INFO: 0, Severity.SEV3: 1, Severity.SEV2: 2, Severity.SEV1: 3, Severity.FATAL: 4}


class Action(enum.Enum):
    """What the job does about a fault."""

    NONE = "none"  # nothing: not a failure
    REATTEMPT = "reattempt"  # retry the failed attempt in place, the cheapest retry (a peer vanished)
    RESTART = "restart"  # kill every worker, start them again on the same nodes (new store namespace)
    RECONFIGURE = "reconfigure"  # exclude the bad node/GPU and re-plan the job on what remains
    STOP = "stop"  # give up: the job fails with the root cause

    @property
    def order(self) -> int:
        return _ACTION_ORDER[self]


_ACTION_ORDER = {Action.NONE: 0, Action.REATTEMPT: 1, Action.RESTART: 2, Action.RECONFIGURE: 3, Action.STOP: 4}

DEFAULT_ACTION = {
    Severity.INFO: Action.NONE,
    Severity.SEV3: Action.REATTEMPT,
    Severity.SEV2: Action.RESTART,
    Severity.SEV1: Action.RECONFIGURE,
    Severity.FATAL: Action.STOP,
}


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"fault field {name!r} must be an integer or null, got {value!r}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"fault field {name!r} must be a string, got {type(value).__name__}")
    return value


MAX_RANK = 2**24 - 1  # above any world size a launcher starts
# (field, lowest, highest): attempt -1 is a node's fault between attempts (a health reading)
_RANGES = (("rank", 0, MAX_RANK), ("gpu", 0, 4095), ("attempt", -1, 2**53), ("steps_completed", 0, 2**63 - 1),
           ("exitcode", -255, 255), ("signal", 1, 255))


@dataclass(frozen=True)
class Fault:
    """One observed failure of one rank, node or GPU (or of the whole job, for a hang).

    ``steps_completed`` is the step the failed rank (or the slowest rank, for a hang) had
    completed, counting the steps its attempt restored; 0 only for a rank that never completed
    one; ``None`` means unknown (e.g. ``--no-inject``: no step reports), which the classifier and
    the policy treat as "maybe made progress", never as zero. (Progress within the attempt, for
    the crash-loop guard, is counted apart.)
    """

    kind: str
    ts: float
    rank: int | None = None
    node: str = ""
    host: str = ""
    exitcode: int | None = None
    signal: int | None = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    stderr_tail: str = ""
    steps_completed: int | None = None
    attempt: int = 0
    gpu: int | None = None  # health faults: the GPU index on the node
    culprit_ranks: tuple[int, ...] = field(default=())  # hangs: the ranks named by stack analysis
    # The rank's hooks heard it leave through a non-zero ``sys.exit`` and no exception explains
    # it: a traceback in its stderr is one the script printed, not what ended it (35A F1).
    sys_exit: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {', '.join(FAULT_KINDS)}")
        # Values no agent sends: a signed peer's rank -1 or 2**62 was taken, and restarted the job
        # as "rank -1 ... exited" or "died of signal 4611686018427387904" (acceptance 30B F2).
        for name, low, high in _RANGES:
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ValueError(f"fault field {name!r} must be in [{low}, {high}], got {value}")
        if any(not 0 <= r <= MAX_RANK for r in self.culprit_ranks):
            raise ValueError(f"fault field 'culprit_ranks' must be ranks in [0, {MAX_RANK}]")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if f.name == "culprit_ranks" else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        """Rebuild a fault from ``to_dict`` output; raises ``ValueError`` naming a bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"a fault must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
        for required in ("kind", "ts"):
            if required not in data:
                raise ValueError(f"fault field {required!r} is missing")
        ts = data["ts"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise ValueError(f"fault field 'ts' must be a number, got {ts!r}")
        culprits = data.get("culprit_ranks", [])
        if not isinstance(culprits, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in culprits
        ):
            raise ValueError("fault field 'culprit_ranks' must be a list of integers")
        attempt = _opt_int(data.get("attempt", 0), "attempt")
        return cls(
            kind=_str(data["kind"], "kind"),
            ts=float(ts),
            rank=_opt_int(data.get("rank"), "rank"),
            node=_str(data.get("node", ""), "node"),
            host=_str(data.get("host", ""), "host"),
            exitcode=_opt_int(data.get("exitcode"), "exitcode"),
            signal=_opt_int(data.get("signal"), "signal"),
            error_type=_str(data.get("error_type", ""), "error_type"),
            message=_str(data.get("message", ""), "message"),
            traceback=_str(data.get("traceback", ""), "traceback"),
            stderr_tail=_str(data.get("stderr_tail", ""), "stderr_tail"),
            steps_completed=_opt_int(data.get("steps_completed"), "steps_completed"),
            attempt=attempt if attempt is not None else 0,
            gpu=_opt_int(data.get("gpu"), "gpu"),
            culprit_ranks=tuple(culprits),
            sys_exit=data.get("sys_exit") is True,
        )

    @classmethod
    def from_report(cls, raw: dict[str, Any]) -> Fault:
        """A fault as the agents report it (more fields than the classifier needs: they ride
        along, and are left out here) to a ``Fault``; raises ``ValueError`` naming a bad field."""
        if not isinstance(raw, dict):
            raise ValueError(f"a fault must be a JSON object, got {type(raw).__name__}")
        data = {k: v for k, v in raw.items() if k in _FIELDS}
        data.setdefault("node", str(raw.get("node_id", "")))
        sig = data.get("signal")
        if not isinstance(sig, int) or isinstance(sig, bool):  # a signal's name ("SIGKILL"): the exit code says it
            code = raw.get("exitcode")
            data["signal"] = -code if isinstance(code, int) and code < 0 else None
        for key in ("message", "traceback", "stderr_tail", "error_type", "host", "node"):
            if data.get(key) is None:
                data.pop(key, None)
        reported_at = raw.get("reported_at", 0.0)
        data.setdefault("ts", float(reported_at) if isinstance(reported_at, (int, float)) else 0.0)
        return cls.from_dict(data)

    def where(self) -> str:
        """Short location for messages: ``rank 3 on node-a`` / ``node node-a`` / ``the job``. A
        hang is the job's, whichever node reported it: ``the job``, or its one culprit ``rank 1``
        (the culprit may run on another node than the reporter, so no host is named)."""
        if self.kind == "hang" and self.rank is None:
            return f"rank {self.culprit_ranks[0]}" if len(self.culprit_ranks) == 1 else "the job"
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.gpu is not None:
            parts.append(f"GPU {self.gpu}")
        if self.node or self.host:
            parts.append(f"on {self.node or self.host}" if parts else f"node {self.node or self.host}")
        return " ".join(parts) if parts else "the job"


_FIELDS = frozenset(f.name for f in fields(Fault))


def report_problem(raw: Any) -> str | None:
    """Why a reported fault (a peer's: any JSON may come) is not one ``Fault.from_report`` takes,
    or None. The mesh drops such a report at receipt (``unicron.proto.schema``): read later, in
    the job's tick, it failed the whole job (acceptance 29B F1)."""
    try:
        Fault.from_report(raw)
    except (ValueError, TypeError, OverflowError) as err:
        return str(err)
    return None


@dataclass(frozen=True)
class Classification:
    """The classifier's verdict: ``reason`` is a sentence for a human, ``rule`` names the table row."""

    severity: Severity
    action: Action
    reason: str
    rule: str
    error: str = ""  # the error itself ("ImportError: No module named 'x'"), without where it happened

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity.value, "action": self.action.value, "reason": self.reason, "rule": self.rule,
                "error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Classification:
        if not isinstance(data, dict):
            raise ValueError(f"a classification must be a JSON object, got {type(data).__name__}")
        try:
            return cls(
                severity=Severity(data["severity"]),
                action=Action(data["action"]),
                reason=_str(data["reason"], "reason"),
                rule=_str(data["rule"], "rule"),
                error=_str(data.get("error", ""), "error"),
            )
        except KeyError as exc:
            raise ValueError(f"classification field {exc.args[0]!r} is missing") from None


# Lines of a crash report that say where or how to debug, not what went wrong: C++ stack frames
# (torch's c10::Error dumps them), CUDA's standard hints, indented traceback lines.
# faulthandler's report of a fatal signal ends in thread headers and the extension module list;
# CPython's ``Fatal Python error: ...`` is followed by the runtime's state and the same dump.
_NOT_THE_ERROR = re.compile(r"^(frame #\d+:|Exception raised from |Search for `|CUDA kernel errors might|"
                            r"For debugging consider|Compile with `TORCH_USE_CUDA_DSA`|Current thread 0x|"
                            r"Thread 0x|Extension modules:|Python runtime state:|\s)")
_HOOKS_WARNING = "unicron: "  # unicron.worker's own warnings on a rank's stderr (not "unicron worker:" errors)
_CXX_WHAT = re.compile(r"^\s*what\(\):\s*(\S.*)$")  # std::terminate's report of the C++ exception


def stderr_summary(tail: str) -> str:
    """The line of a dead process's stderr that says what went wrong: the message of the C++
    exception that terminated it (an NCCL watchdog's ``what():``), else the last line that is
    not a stack frame or a debugging hint, else the last line. Not the warnings unicron's worker
    hooks print themselves (``unicron: snapshot write failed ...``): printed steps earlier, they
    were shown as what a rank that exited 3 for its own reasons said last (acceptance 23B F4)."""
    lines = [line.rstrip() for line in tail.splitlines() if line.strip() and not line.startswith(_HOOKS_WARNING)]
    for line in reversed(lines):
        found = _CXX_WHAT.match(line)
        if found:
            return found.group(1).strip()
    for line in reversed(lines):
        if not _NOT_THE_ERROR.match(line):
            return line.strip()
    return lines[-1].strip() if lines else ""


# What a process prints on its way that is not why a signal killed it: warnings (Python's
# ``warnings``, glog's W and I lines as torch prints them, ``[rank0]:W1206 ...``).
_WARNING = re.compile(r"\w*Warning:|^(\[rank\d+\]:)?\[?[WI]\d{4}\b")
_READS_AS_ERROR = re.compile(r"error|exception|fatal|abort|terminat|what\(\)|out of memory|failed|assert",
                             re.IGNORECASE)


def signal_cause(tail: str) -> str:
    """Why a process killed by a signal died, if its stderr says: ``stderr_summary`` when that
    reads as an error (a C++ ``what()`` before SIGABRT, ``Fatal Python error: Segmentation
    fault``), else "" (a SIGKILL from outside leaves whatever was printed last, a warning or a
    log line, which is not its cause)."""
    if any(_CXX_WHAT.match(line) for line in tail.splitlines()):
        return stderr_summary(tail)  # what a C++ exception said as it terminated the process is why
    said = stderr_summary(tail)
    if not said or _WARNING.search(said) or not _READS_AS_ERROR.search(said):
        return ""
    return said
