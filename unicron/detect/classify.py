"""The failure classifier: an ordered table of rules, the first match wins.

Each rule maps a ``Fault`` to a ``Severity`` (and so a default ``Action``). The table is the
documentation: ``docs/failures.md`` lists every row with what it matches and why, and a test
checks that both agree. ``classify`` is pure: recent health readings (``evidence``) are passed
in, never read here.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from unicron.detect import errortext
from unicron.detect.evidence import (
    FRAME_FILE,
    Evidence,
    error_summary,
    gather,
    short,
    signal_name,
    strip_prefixes,
)
from unicron.detect.faults import DEFAULT_ACTION, Classification, Fault, Severity
from unicron.worker.inject import INJECTED_KILL

# In the message of a rank the agent killed as frozen past its end (unicron.agent.frozen).
FROZEN_KILL = "killed with SIGKILL as frozen"

# Xid codes that mean the GPU or its links are broken (NVIDIA's Xid catalogue): exclude the node.
HARDWARE_XIDS = frozenset({48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140})
# Xid codes raised by an application's own bad kernel (page fault, engine exception): the worker
# dies with a CUDA error of its own, which is what gets classified.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 69})

CRASH_SIGNALS = frozenset({_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGABRT, _signal.SIGILL, _signal.SIGFPE})
TERMINATION_SIGNALS = frozenset({_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGQUIT})

# "Xid 79", "Xid: 79" and the kernel's "NVRM: Xid (PCI:0000:3b:00): 79, pid=..."
_XID_CODE = re.compile(r"\bXid\b(?:\s*\([^)]*\))?\s*:?\s*(\d{1,3})\b")


@dataclass(frozen=True)
class Rule:
    name: str
    severity: Severity
    matches: Callable[[Fault, Evidence], bool]
    reason: Callable[[Fault, Evidence], str]
    victim: bool = False  # a victim's failure is caused by another rank's fault


def _has(*needles: str, case: bool = True) -> Callable[[Fault, Evidence], bool]:
    if case:
        return lambda _f, ev: any(n in ev.text for n in needles)
    lowered = tuple(n.lower() for n in needles)
    return lambda _f, ev: any(n in ev.text.lower() for n in lowered)


# torch's DataLoader when one of its worker processes dies (killed, or its own exit).
_LOADER_WORKER_KILLED = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (exited unexpectedly|is killed by signal)")


def _failed_process(fault: Fault) -> bool:
    return fault.kind in ("exit", "exception") and not _clean_exit(fault)


_CONNECT_FAILED = re.compile(r"connectFullMesh failed|timed out connecting|No route to host|Network is unreachable"
                             r"|EHOSTUNREACH|ENETUNREACH")
_ZMQ_ASSERT = re.compile(r"\(src/[a-z_]+\.(?:cpp|hpp):\d+\)")


def _may_be_a_victim(ev: Evidence) -> bool:
    """A lost peer ends a rank with an exception, an exit code, or SIGABRT (a C++ exception that
    escapes: NCCL's watchdog); never with SIGKILL, SIGSEGV or SIGTERM. Such a death is its own
    cause, whatever its stderr said earlier (a background thread's connection reset 20 steps
    before an OOM kill)."""
    return ev.signal is None or ev.signal == _signal.SIGABRT


def _clean_exit(fault: Fault) -> bool:
    return fault.kind == "exit" and fault.exitcode == 0 and fault.signal is None


def _before_first_step(fault: Fault) -> bool:
    return fault.steps_completed == 0  # None (unknown) is never treated as "before the first step"


_PEER_ERRORS = frozenset({"ConnectionResetError", "ConnectionRefusedError", "ConnectionAbortedError"})
_REFUSED = ("Connection refused", "ECONNREFUSED")
_PEER_NEEDLES = ("Connection reset by peer", "Connection refused", "Broken pipe", "Connection closed by peer",
                 "ECONNRESET", "ECONNREFUSED")


# A web client's error (requests/urllib3, botocore, http.client, aiohttp, httpx): the rank's own
# script failed talking to a service (a metrics logger, object storage, a model hub), no peer.
_WEB_CLIENT = re.compile(r"HTTPS?ConnectionPool|Max retries exceeded|urllib3|botocore|/http/client\.py"
                         r"|/urllib/request\.py|aiohttp|httpx|Could not connect to the endpoint URL")


def _web_client(fault: Fault, ev: Evidence) -> bool:
    """The exception that ended the rank came out of a web client. Its text and traceback, not
    stderr: a logger's warning printed long before is not it."""
    return bool(ev.exception_type) and bool(_WEB_CLIENT.search(f"{fault.message or ''}\n{fault.traceback or ''}"))


def _peer_connection_lost(fault: Fault, ev: Evidence) -> bool:
    """The error that ended the process says a connection to a peer broke (gloo's "Connection
    closed by peer", a store's reset). Only that error: an earlier one of a chain (a DataLoader's
    pipe reset while its worker was killed, before "DataLoader worker ... is killed") is not what
    failed. A ``BrokenPipeError`` is a local pipe as often as a peer's (the console's, closed by
    ``| head``): not a peer's loss; nor is a web client's reset. Without a known exception, the
    whole output is searched."""
    if ev.exception_type == "BrokenPipeError" or _web_client(fault, ev):
        return False
    where = ev.exception_message if ev.exception_type else ev.text
    said = [needle for needle in _PEER_NEEDLES if needle in where]
    if ev.exception_type == "ConnectionRefusedError" or (said and all(n in _REFUSED for n in said)):
        # Nobody listens there: a peer's (or the store's) port only when torch.distributed was
        # connecting; the script's own service (a feature store, redis) otherwise (33A F4).
        return errortext.from_collective(fault, ev, said[0] if said else "Connection refused")
    return ev.exception_type in _PEER_ERRORS or bool(said)


def _user_error(types: frozenset[str]) -> Callable[[Fault, Evidence], bool]:
    return lambda f, ev: _failed_process(f) and _before_first_step(f) and ev.exception_type in types


# The exceptions that are user errors before the first step (the rules below).
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})
SYNTAX_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError"})
NAME_ERRORS = frozenset({"NameError", "UnboundLocalError"})
USER_ERROR_TYPES = IMPORT_ERRORS | SYNTAX_ERRORS | NAME_ERRORS


SAME_AGAIN_STOPS = "; the same error again after the restart stops the job"  # said of the first; the stop drops it


def _user_error_unknown_progress(fault: Fault, ev: Evidence) -> bool:
    """A user-error type from a rank whose progress is unknown (past start-up in a script that
    reports no steps): maybe a lazy import that fails once, maybe one that always will. It is
    restarted; the policy stops the job when the same error comes back right after (rule 2)."""
    return _failed_process(fault) and fault.steps_completed is None and ev.exception_type in USER_ERROR_TYPES


# unicron.worker.errors: misuses of unicron.State, whose messages all start "unicron.State"
# (a script's own class of the same name is not one of them).
STATE_ERRORS = frozenset({"StateError", "SnapshotTypeError"})


def _state_misuse(fault: Fault, ev: Evidence) -> bool:
    """The worker API refused how it was used: at any step, a restart replays the same code."""
    return (_failed_process(fault) and ev.exception_type in STATE_ERRORS
            and ev.exception_message.startswith("unicron.State"))


def _missing_script(fault: Fault, ev: Evidence) -> bool:
    # CPython's own words as the process's last (before any of the script ran, so whatever the
    # steps are known to be: --no-inject reports none)
    if _failed_process(fault) and fault.steps_completed in (0, None) and (
            errortext.cant_open_script(fault) or errortext.missing_module(fault)):
        return True  # `python missing.py` (exit code 2), `python -m missing` (exit code 1)
    if not (_failed_process(fault) and _before_first_step(fault)):
        return False
    if ev.exception_type != "FileNotFoundError":
        return False
    # Only when no frame of the user's code ran: the launcher's own frames (runpy, the boot
    # module) failed to open the script. A data file missing inside the script is not this.
    frames = FRAME_FILE.findall(fault.traceback or strip_prefixes(fault.stderr_tail))
    launcher = ("runpy.py", "<frozen runpy>")
    return bool(frames) and all(f.endswith(launcher) or "/unicron/worker/" in f for f in frames)


def _usage_error(fault: Fault, ev: Evidence) -> bool:
    if not (_failed_process(fault) and _before_first_step(fault)):
        return False
    exited_2 = fault.exitcode == 2 or (ev.exception_type == "SystemExit" and ev.exception_message.strip() == "2")
    return exited_2 and errortext.usage_error(fault)


def _found(pattern: re.Pattern[str], ev: Evidence) -> bool:
    return bool(pattern.search(ev.text))


def _first_match(pattern: re.Pattern[str], text: str) -> str:
    found = pattern.search(text)
    return found.group(0) if found else ""


def _xid_codes(fault: Fault) -> list[int]:
    return [int(m.group(1)) for m in _XID_CODE.finditer(fault.message)]


def _health(error_type: str) -> Callable[[Fault, Evidence], bool]:
    return lambda f, _ev: f.kind == "health" and f.error_type == error_type


def _hardware_xid(fault: Fault, _ev: Evidence) -> bool:
    return fault.kind == "health" and fault.error_type == "xid" and any(c in HARDWARE_XIDS for c in _xid_codes(fault))


def _sev1_health(fault: Fault) -> bool:
    return fault.kind == "health" and (
        fault.error_type in ("ecc_uncorrectable", "gpu_lost")
        or (fault.error_type == "xid" and any(c in HARDWARE_XIDS for c in _xid_codes(fault)))
    )


def _signal_in(signals: frozenset[int]) -> Callable[[Fault, Evidence], bool]:
    return lambda f, ev: _failed_process(f) and ev.signal in signals


_SHARED_GPU = re.compile(r"Duplicate GPU detected[^\n]*")  # NCCL's words for two ranks of one communicator on one GPU

# fmt: off
RULES: tuple[Rule, ...] = (
    Rule("clean-exit", Severity.INFO, lambda f, _ev: _clean_exit(f),
         lambda f, _ev: f"{f.where()} exited cleanly"),
    Rule("startup-failed", Severity.FATAL, lambda f, _ev: f.kind == "startup",
         lambda f, _ev: f"{f.where()} could not be started: {short(f.message) or 'no detail'}"),
    Rule("node-lost", Severity.SEV1, lambda f, _ev: f.kind == "node_lost",
         lambda f, _ev: f"node {f.node or f.host} " + (f.message if f.message.startswith("left: ")
                                                        else "stopped answering heartbeats")),
    Rule("health-xid-hardware", Severity.SEV1, _hardware_xid,
         lambda f, _ev: f"{f.where()} reported a hardware Xid ({short(f.message)}): the GPU is faulty"),
    Rule("health-ecc-uncorrectable", Severity.SEV1, _health("ecc_uncorrectable"),
         lambda f, _ev: f"{f.where()} has new uncorrectable ECC errors: its memory cannot be trusted"),
    Rule("health-gpu-lost", Severity.SEV1, _health("gpu_lost"),
         lambda f, _ev: f"{f.where()} disappeared from the driver (fallen off the bus?)"),
    Rule("health-xid-other", Severity.INFO, _health("xid"),
         lambda f, _ev: f"{f.where()} reported {short(f.message)} (an application or unknown Xid: recorded)"),
    Rule("health-oom-kill", Severity.INFO, _health("oom_kill"),
         lambda f, _ev: f"the kernel OOM killer killed a process on {f.node or f.host or 'this node'}"),
    Rule("health-memory-pressure", Severity.INFO, _health("memory_pressure"),
         lambda f, _ev: f"memory pressure on {f.node or f.host or 'this node'}: {short(f.message)}"),
    Rule("health-throttle", Severity.INFO, _health("gpu_throttle"),
         lambda f, _ev: f"{f.where()} is throttled: {short(f.message)}"),
    Rule("health-other", Severity.INFO, lambda f, _ev: f.kind == "health",
         lambda f, _ev: f"health reading on {f.where()}: {f.error_type} {short(f.message)}"),
    Rule("hang", Severity.SEV2, lambda f, _ev: f.kind == "hang",
         lambda f, _ev: f"hang: {short(f.message) or 'no step completed in time'}"
         + (f"; culprit rank(s) {', '.join(map(str, f.culprit_ranks))}" if f.culprit_ranks else "")),
    # User errors: only before the first step, where restarting replays the same failure.
    Rule("user-import-error", Severity.FATAL, _user_error(IMPORT_ERRORS),
         lambda f, ev: f"{f.where()} failed to import before the first step ({error_summary(f, ev)}): fix the environment"),
    Rule("user-syntax-error", Severity.FATAL, _user_error(SYNTAX_ERRORS),
         lambda f, ev: f"{f.where()}: the script does not parse ({error_summary(f, ev)})"),
    Rule("user-name-error", Severity.FATAL, _user_error(NAME_ERRORS),
         lambda f, ev: f"{f.where()}: a bug in the script before the first step ({error_summary(f, ev)})"),
    Rule("user-missing-script", Severity.FATAL, _missing_script,
         lambda f, ev: f"{f.where()}: the training script cannot be opened ({error_summary(f, ev)})"),
    Rule("user-usage-error", Severity.FATAL, _usage_error,
         lambda f, ev: f"{f.where()}: the script rejected its arguments (argparse usage error, exit code 2)"),
    Rule("user-state-error", Severity.FATAL, _state_misuse,
         lambda f, ev: f"{f.where()}: {error_summary(f, ev)} (a restart would repeat it)"),
    Rule("user-gpu-shared", Severity.FATAL, lambda f, ev: _failed_process(f) and bool(_SHARED_GPU.search(ev.text)),
         lambda f, ev: f"{f.where()}: two ranks share one GPU (NCCL: {short(_first_match(_SHARED_GPU, ev.text))}): "
         "give each local rank its own device (torch.cuda.set_device(int(os.environ['LOCAL_RANK']))) and start "
         "no more ranks per node than it has GPUs"),
    Rule("user-error-unknown-progress", Severity.SEV2, _user_error_unknown_progress,
         lambda f, ev: f"{f.where()} raised {error_summary(f, ev)} past start-up (the script reports no steps, "
         "so its progress is unknown)" + SAME_AGAIN_STOPS),
    # Hardware named in the error text: the node (or its GPU) must be excluded.
    # The words of the kernel, CUDA, NVML or NCCL (errortext), never a mere mention in a log line.
    Rule("gpu-xid", Severity.SEV1, lambda f, ev: _failed_process(f) and _found(errortext.XID_LINE, ev),
         lambda f, ev: f"{f.where()} hit a GPU Xid error: {short(_first_match(errortext.XID_LINE, ev.text))}"),
    Rule("gpu-ecc", Severity.SEV1, lambda f, ev: _failed_process(f) and _found(errortext.ECC_ERROR, ev),
         lambda f, ev: f"{f.where()} hit an uncorrectable ECC error ({error_summary(f, ev)})"),
    Rule("gpu-nvlink", Severity.SEV1, lambda f, ev: _failed_process(f) and _found(errortext.NVLINK_ERROR, ev),
         lambda f, ev: f"{f.where()} hit an NVLink error ({error_summary(f, ev)})"),
    Rule("gpu-lost", Severity.SEV1, lambda f, ev: _failed_process(f) and _found(errortext.GPU_LOST, ev),
         lambda f, ev: f"{f.where()} lost its GPU ({error_summary(f, ev)})"),
    Rule("health-evidence-hardware", Severity.SEV1,
         lambda f, ev: _failed_process(f) and any(_sev1_health(h) for h in ev.health),
         lambda f, ev: f"{f.where()} failed ({error_summary(f, ev) or 'exit'}) while its node reported "
         + "; ".join(short(h.message) or h.error_type for h in ev.health if _sev1_health(h))),
    Rule("out-of-memory", Severity.SEV2, lambda f, ev: _failed_process(f) and errortext.out_of_memory(f, ev),
         lambda f, ev: f"{f.where()} ran out of memory ({error_summary(f, ev)})"),
    # CUDA errors a script's data or build causes (a class label or token id out of range fails
    # a kernel's index check: a device-side assert; a build without this GPU's architecture):
    # restarted, but they point at the script, so no node is left out for them (coord.decide).
    Rule("cuda-script-error", Severity.SEV2, lambda f, ev: _failed_process(f) and _has(
        "device-side assert", "no kernel image is available", "invalid device function",
        "CUBLAS_STATUS_NOT_SUPPORTED", "CUBLAS_STATUS_INVALID_VALUE", "CUDNN_STATUS_NOT_SUPPORTED",
        "CUDNN_STATUS_BAD_PARAM")(f, ev),
         lambda f, ev: f"{f.where()} hit a CUDA error its script or build causes ({error_summary(f, ev)})"),
    Rule("cuda-error", Severity.SEV2, lambda f, ev: _failed_process(f) and (
        ev.exception_type == "AcceleratorError" or _has(
            # torch's and CUDA's wording ends on a colon: "CUDA error: an illegal memory access ...";
            # "checked CUDA errors: none" in a script's log is no fault (33A F1's kind)
            "CUDA error:", "illegal memory access", "device-side assert", "CUBLAS_STATUS_", "CUDNN_STATUS_",
            "cuDNN error:")(f, ev)),
         lambda f, ev: f"{f.where()} hit a CUDA error ({error_summary(f, ev)})"),
    Rule("nccl-remote", Severity.SEV3, lambda f, ev: _failed_process(f) and _may_be_a_victim(ev) and _has(
        "ncclRemoteError", "Connection closed by remote peer", "remote process exited")(f, ev),
         lambda f, ev: f"{f.where()} lost an NCCL peer ({error_summary(f, ev)})", victim=True),
    Rule("nccl-error", Severity.SEV2, lambda f, ev: _failed_process(f) and _has(
        "NCCL error in:", "NCCL error:", "ncclInternalError", "ncclSystemError", "ncclUnhandledCudaError", "ncclInvalidUsage",
        "unhandled system error")(f, ev),
         lambda f, ev: f"{f.where()} hit an NCCL error ({error_summary(f, ev)})"),
    Rule("collective-timeout", Severity.SEV2, lambda f, ev: _failed_process(f) and (
        _has("Watchdog caught collective operation timeout")(f, ev)
        or bool(re.search(r"Timed out waiting \d+ms for (recv|send)", ev.text))),
         lambda f, ev: f"{f.where()} timed out waiting in a collective for a peer ({error_summary(f, ev)})",
         victim=True),
    Rule("peer-connection-lost", Severity.SEV3,
         lambda f, ev: _failed_process(f) and _may_be_a_victim(ev) and _peer_connection_lost(f, ev),
         lambda f, ev: f"{f.where()} lost its connection to a peer ({error_summary(f, ev)})", victim=True),
    # This rank could not reach a peer at all (its process group's connections never formed): its
    # node, or the link to the peer, is at fault; not a victim of a peer that died.
    Rule("connect-failed", Severity.SEV2, lambda f, ev: _failed_process(f) and _may_be_a_victim(ev)
         and not _web_client(f, ev)
         and bool(_CONNECT_FAILED.search(ev.exception_message if ev.exception_type else ev.text)),
         lambda f, ev: f"{f.where()} could not connect to a peer ({error_summary(f, ev)})"),
    Rule("oom-killer", Severity.SEV2, lambda f, ev: _failed_process(f) and ev.signal == _signal.SIGKILL and any(
        h.error_type == "oom_kill" for h in ev.health),
         lambda f, _ev: f"{f.where()} was killed by the kernel OOM killer (out of memory: the host's, or its cgroup's limit)"),
    # A DataLoader worker (or a Pool child) killed by the OOM killer: torch's error names no cause.
    Rule("loader-oom-killer", Severity.SEV2, lambda f, ev: _failed_process(f)
         and bool(_LOADER_WORKER_KILLED.search(ev.exception_message if ev.exception_type else ev.text))
         and any(h.error_type == "oom_kill" for h in ev.health),
         lambda f, ev: f"{f.where()}: a DataLoader worker was killed by the kernel OOM killer (out of memory: "
                       f"the host's, or its cgroup's limit; {error_summary(f, ev)})"),
    # The agent's own kill of a rank frozen past its end (unicron.agent.frozen): its message says why.
    Rule("frozen", Severity.SEV2, lambda f, ev: _signal_in(frozenset({_signal.SIGKILL}))(f, ev) and FROZEN_KILL in ev.text,
         lambda f, _ev: f"{f.where()} froze past its last collective and was killed by unicron: its Python could "
                        "not run and it used no CPU (a thread blocked in native code holds the interpreter lock, as in "
                        "a deadlock in torch's teardown)"),
    Rule("sigkill", Severity.SEV2, _signal_in(frozenset({_signal.SIGKILL})),
         lambda f, ev: f"{f.where()} was killed by SIGKILL ("
                       + ("injected by unicron" if INJECTED_KILL in ev.text else "from outside, or by the kernel OOM killer")
                       + ")"),
    # libzmq asserts ("Invalid argument (src/signaler.cpp:157)") when the descriptors of the
    # worker's channel to its agent were closed under it: a script's os.closerange(3, N).
    Rule("agent-channel-broken", Severity.SEV2, lambda f, ev: _failed_process(f) and ev.signal == _signal.SIGABRT
         and bool(_ZMQ_ASSERT.search(ev.text)),
         lambda f, ev: f"{f.where()} aborted in ZeroMQ ({_ZMQ_ASSERT.search(ev.text).group(0)}): its channel to its "  # type: ignore[union-attr]
                       "agent broke, as when a script closes file descriptors it did not open (os.closerange); "
                       "run such a script with --no-inject"),
    Rule("crash-signal", Severity.SEV2, _signal_in(CRASH_SIGNALS),
         lambda f, ev: f"{f.where()} crashed with {signal_name(ev.signal or 0)}"),
    Rule("terminated", Severity.SEV2, _signal_in(TERMINATION_SIGNALS),
         lambda f, ev: f"{f.where()} was terminated by {signal_name(ev.signal or 0)} from outside unicron"),
    Rule("other-signal", Severity.SEV2, lambda f, ev: _failed_process(f) and ev.signal is not None,
         lambda f, ev: f"{f.where()} died of {signal_name(ev.signal or 0)}"),
    Rule("uncaught-exception", Severity.SEV2, lambda f, ev: _failed_process(f) and (
        f.kind == "exception" or bool(ev.exception_type)),
         lambda f, ev: f"{f.where()} raised {error_summary(f, ev) or 'an exception'}"),
    Rule("nonzero-exit", Severity.SEV2, lambda f, _ev: f.kind == "exit" and f.exitcode not in (None, 0),
         lambda f, _ev: f"{f.where()} exited with code {f.exitcode}"),
    Rule("unknown", Severity.SEV2, lambda _f, _ev: True,
         lambda f, _ev: f"{f.where()} failed ({f.kind}) for an unknown reason"),
)
# fmt: on

RULES_BY_NAME = {rule.name: rule for rule in RULES}
VICTIM_RULES = frozenset(rule.name for rule in RULES if rule.victim)


def classify(fault: Fault, evidence: Sequence[Fault] = ()) -> Classification:
    """Classify one fault; ``evidence`` is recent health faults (any node: filtered here)."""
    ev = gather(fault, evidence)
    for rule in RULES:
        if rule.matches(fault, ev):
            return Classification(rule.severity, DEFAULT_ACTION[rule.severity], rule.reason(fault, ev), rule.name,
                                  error=error_summary(fault, ev))
    raise AssertionError("the 'unknown' rule matches everything")  # pragma: no cover


def is_victim(fault: Fault, classification: Classification) -> bool:
    """True when this fault is most likely caused by another rank's fault."""
    if fault.kind == "hang" and fault.culprit_ranks and fault.rank is not None:
        return fault.rank not in fault.culprit_ranks  # a rank blocked behind the culprit
    return classification.rule in VICTIM_RULES


def root_cause(faults: Sequence[Fault], evidence: Sequence[Fault] = ()) -> Fault:
    """Among faults seen together, the one that caused the others.

    Order: real failures before clean exits and health notes (INFO); causes before victims (a
    rank whose connection was reset is a victim of the rank that died); then the earliest; then
    the most severe; then the lowest rank (so the answer does not depend on list order).
    """
    if not faults:
        raise ValueError("root_cause needs at least one fault")
    # Every rank that answered waits in a collective, and a node went silent: its ranks are
    # what the others wait for. The hang is seen first (an idle threshold is shorter than the
    # heartbeat timeout) but is the node's victim.
    node_lost = any(f.kind == "node_lost" for f in faults)

    def key(fault: Fault) -> tuple[bool, bool, float, int, int, str]:
        c = classify(fault, evidence)
        rank = fault.rank if fault.rank is not None else -1
        victim = is_victim(fault, c) or (node_lost and fault.kind == "hang" and not fault.culprit_ranks)
        return (c.severity is Severity.INFO, victim, fault.ts, -c.severity.order, rank, fault.node)

    return min(faults, key=key)
