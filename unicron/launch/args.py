"""The options of `unicron run`: torchrun's plus unicron's own, and their value converters.

Every option is one ``Option`` row (flags, converter, default, environment variables, help), so
the argv splitter, the help text, the config-file keys and the environment lookup can never
disagree. Converters take the raw string and raise ``ValueError`` with a message that reads well
after "<source>: " (``unicron.launch.config`` adds the flag, variable or file that gave it).
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Value converters. Each takes the raw string and returns the typed value or raises ValueError
# with a message that makes sense after "<source>: " (the flag, variable or file that gave it).

_RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
_INJECT_KINDS = ("kill", "hang", "exception", "exit", "slow")
_HOST = re.compile(r"^[\w.:\[\]-]+$")
_RUN_ID = re.compile(r"^[\w.:@+-]+$")


@dataclass(frozen=True)
class StdSpec:
    """torchrun's Std setting for --redirects/--tee: bit 1 stdout, bit 2 stderr (3 both), either
    for every local rank or per local rank (ranks not listed get 0, as in torchrun's to_map)."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    def for_rank(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default if not self.per_rank else 0)


@dataclass(frozen=True)
class InjectSpec:
    """One fault to inject: ``kind`` at global ``rank`` (None: every rank, ``*``) once ``step``
    steps have completed. ``arg`` is the exit code for ``exit`` (default 1) and the delay in
    seconds for ``slow`` (default 1.0). Same grammar as ``unicron.worker.inject``."""

    kind: str
    rank: int | None
    step: int
    arg: float | None = None

    def __str__(self) -> str:
        if self.arg is None:
            value = ""
        elif self.kind == "exit":
            value = f"={int(self.arg)}"
        else:
            value = f"={self.arg:g}"
        return f"{self.kind}{value}@{'*' if self.rank is None else self.rank}:{self.step}"


@dataclass(frozen=True)
class RdzvConf:
    """--rdzv-conf: torchrun's keys with their defaults (seconds); unknown keys kept in ``extra``."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat: float = 5.0
    read_timeout: float = 60.0
    timeout: float = 900.0
    is_host: bool | None = None
    extra: tuple[tuple[str, str], ...] = ()


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        value = _int(text)
        if value < low:
            raise ValueError(f"must be >= {low}, got {value}")
        return value
    return convert


def float_above(low: float) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = _float(text)
        if value <= low:
            raise ValueError(f"must be > {low:g}, got {text.strip()}")
        return value
    return convert


def float_at_least(low: float) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = _float(text)
        if value < low:
            raise ValueError(f"must be >= {low:g}, got {text.strip()}")
        return value
    return convert


def choice(*names: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in names:
            raise ValueError(f"must be one of {', '.join(names)}; got {text!r}")
        return text
    return convert


def nonempty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def to_nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise ValueError(f"need 0 < MIN <= MAX, got {text!r}")
    return low, high


def to_nproc(text: str) -> str:
    if text in ("auto", "cpu", "gpu", "xpu"):
        return text
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"expected an integer, auto, cpu, gpu or xpu; got {text!r}") from None
    if count < 1:
        raise ValueError(f"must be at least 1, got {count}")
    return str(count)


def to_backend(text: str) -> str:
    if text not in _RDZV_BACKENDS:
        raise ValueError(f"unknown rendezvous backend {text!r} (accepted: {', '.join(_RDZV_BACKENDS)})")
    return text


def to_rdzv_id(text: str) -> str:
    if not _RUN_ID.match(text):
        raise ValueError(f"must be letters, digits and . _ : @ + - only; got {text!r}")
    return text


def to_host(text: str) -> str:
    if not _HOST.match(text):
        raise ValueError(f"not a host name or address: {text!r}")
    return text


def to_port(text: str) -> int:
    port = _int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    return port


def split_endpoint(text: str, default_port: int | None) -> tuple[str, int]:
    """HOST[:PORT] as torchrun parses it ([v6] brackets allowed); raises ValueError."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        host, port_text = text, None
    elif ":" in text and not (text.count(":") > 1 and not text.startswith("[")):
        host, _, port_text = text.rpartition(":")
    else:
        host, port_text = text, None
    host = host[1:-1] if len(host) > 1 and host[0] == "[" and host[-1] == "]" else host
    if not host or not _HOST.match(host):
        raise ValueError(f"bad endpoint {text!r}: expected HOST:PORT")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"bad endpoint {text!r}: the port is missing (HOST:PORT)")
        return host, default_port
    if not re.match(r"^\d{1,5}$", port_text) or int(port_text) > 65535:
        raise ValueError(f"bad endpoint {text!r}: port must be 0..65535")
    return host, int(port_text)


def to_hostport(text: str) -> str:
    host, port = split_endpoint(text, None)
    if port == 0:
        raise ValueError(f"bad endpoint {text!r}: port 0 cannot be joined")
    return text


def to_rdzv_conf(text: str) -> RdzvConf:
    numeric = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat", "read_timeout", "timeout")
    values: dict[str, object] = {}
    extra: list[tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in text.split(",")) if text.strip() else ()):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not key or not eq or not value:
            raise ValueError(f"expected KEY=VALUE,...; bad item {item!r}")
        if key in numeric:
            try:
                values[key] = float_above(0.0)(value)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
        elif key == "is_host":
            if value.lower() not in ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"):
                raise ValueError(f"is_host: not a boolean: {value!r}")
            values[key] = value.lower() in ("1", "true", "t", "yes", "y")
        else:
            extra.append((key, value))
    return RdzvConf(**values, extra=tuple(extra))  # type: ignore[arg-type]


def to_std(text: str) -> StdSpec:
    text = text.strip()
    if re.match(r"^[0123]$", text):
        return StdSpec(int(text))
    if re.match(r"^(\d+:[0123],)*(\d+:[0123])$", text):
        pairs = tuple((int(r), int(s)) for r, s in (m.split(":") for m in text.split(",")))
        return StdSpec(0, pairs)
    raise ValueError(f"expected 0-3 or LOCAL_RANK:0-3,... (e.g. 3 or 0:1,1:2); got {text!r}")


def to_ranks_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        return frozenset(int(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated local ranks, e.g. 0,1,2; got {text!r}") from None


def to_comma_list(text: str) -> tuple[str, ...]:
    if not text:
        return ()
    return tuple(item.replace("\0", ",") for item in text.replace(",,", "\0").split(","))


def to_signals(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    for name in names:
        if not name.startswith("SIG") or name.startswith("SIG_") or not hasattr(signal, name):
            raise ValueError(f"unknown signal {name!r}")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{name} cannot be handled")
    if not names:
        raise ValueError("expected a comma-separated list of signal names")
    return names


def to_inject(text: str) -> InjectSpec:
    usage = "expected KIND@RANK:STEP (RANK a number or *) with KIND kill, hang, exception, exit[=CODE] or slow[=SECONDS]"
    match = re.match(r"^([a-z]+)(?:=([^@]*))?@(\*|\d+):(\d+)$", text.strip())
    if not match:
        raise ValueError(f"{usage}; got {text!r}")
    kind, arg_text, rank, step = match.groups()
    if kind not in _INJECT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {text!r}; {usage}")
    arg: float | None = None
    if arg_text is not None:
        if kind == "exit":
            code = _int(arg_text)
            if not 0 <= code <= 255:
                raise ValueError(f"exit code must be 0..255 in {text!r}")
            arg = float(code)
        elif kind == "slow":
            arg = float_above(0.0)(arg_text)
            if arg >= 1e6:
                raise ValueError(f"slow needs fewer than 1e6 seconds in {text!r}")
        else:
            raise ValueError(f"{kind} takes no value in {text!r}; {usage}")
    elif kind == "exit":
        arg = 1.0
    elif kind == "slow":
        arg = 1.0
    return InjectSpec(kind, None if rank == "*" else int(rank), int(step), arg)


TORCHRUN = "torchrun options"
UNICRON = "unicron options"


@dataclass(frozen=True)
class Option:
    dest: str
    flags: tuple[str, ...]  # first long flag is the canonical name
    help: str
    group: str = TORCHRUN
    convert: Callable[[str], object] | None = None  # None: a switch (no value)
    default: object = None
    envs: tuple[str, ...] = ()  # environment variables read when the flag is absent, in order
    metavar: str = ""
    repeat: bool = False  # may be given several times (values accumulate)

    @property
    def takes_value(self) -> bool:
        return self.convert is not None

    @property
    def name(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))


def _pet(dest: str) -> tuple[str, ...]:
    # torchrun's `env` action reads PET_<dest>, dest being the first long spelling.
    return (f"PET_{dest.upper()}",)


def _uni(dest: str) -> tuple[str, ...]:
    return (f"UNICRON_{dest.upper()}",)


def _both(name: str) -> tuple[str, ...]:
    return (f"--{name}", f"--{name.replace('-', '_')}") if "-" in name else (f"--{name}",)


def _t(name: str, help: str, convert: Callable[[str], object] | None = None, default: object = None,
       *, short: str = "", metavar: str = "", pet: bool = True, more_envs: tuple[str, ...] = ()) -> Option:
    dest = name.replace("-", "_")
    flags = ((short,) if short else ()) + _both(name)
    return Option(dest, flags, help, TORCHRUN, convert, default, (_pet(dest) if pet else ()) + more_envs, metavar)


def _u(name: str, help: str, convert: Callable[[str], object] | None = None, default: object = None,
       *, metavar: str = "", repeat: bool = False, envs: tuple[str, ...] | None = None) -> Option:
    dest = name.replace("-", "_")
    return Option(dest, _both(name), help, UNICRON, convert, default,
                  _uni(dest) if envs is None else envs, metavar, repeat)


OPTIONS: tuple[Option, ...] = (
    _t("nnodes", "Number of nodes, or MIN:MAX for an elastic job.", to_nnodes, "1:1", metavar="N|MIN:MAX"),
    _t("nproc-per-node", "Workers per node: an integer, or auto, cpu, gpu, xpu.", to_nproc, "1",
       metavar="N|auto|cpu|gpu|xpu"),
    _t("rdzv-backend", "Rendezvous backend: c10d, static, etcd, etcd-v2 (unicron's own rendezvous serves "
       "them all).", to_backend, "static", metavar="NAME"),
    _t("rdzv-endpoint", "Rendezvous endpoint HOST[:PORT]; the agent there hosts the coordinator.",
       str, "", metavar="HOST:PORT"),
    _t("rdzv-id", "Job id shared by all nodes (becomes TORCHELASTIC_RUN_ID).", to_rdzv_id, "none", metavar="ID"),
    _t("rdzv-conf", "Rendezvous settings KEY=VALUE,... (join_timeout=600, last_call_timeout=30, "
       "close_timeout=30, heartbeat=5, read_timeout=60, timeout=900).", to_rdzv_conf, "",
       metavar="K=V,..."),
    _t("standalone", "Single-node job: local rendezvous on a free port, random run id."),
    _t("max-restarts", "Restarts of the whole job before giving up (job-wide budget).",
       int_at_least(0), "0", metavar="N"),
    _t("monitor-interval", "Seconds between checks of the workers.", float_above(0.0), "0.1", metavar="SEC"),
    _t("start-method", "Accepted for torchrun compatibility: spawn, fork, forkserver (workers are always "
       "separate processes).", choice("spawn", "fork", "forkserver"), "spawn", metavar="METHOD"),
    _t("event-log-handler", "torchrun's event handler name; unicron writes its own event log (ignored).",
       str, "null", metavar="NAME"),
    _t("role", "Role name of the workers (ROLE_NAME).", nonempty, "default", metavar="ROLE"),
    _t("module", "Run the script as a module, like `python -m`.", short="-m"),
    _t("no-python", "Run the script directly, without `python` in front."),
    _t("run-path", "Run the script with runpy.run_path (takes precedence over --no-python)."),
    _t("log-dir", "Base directory for per-rank logs (torchrun's layout).", nonempty, None, metavar="DIR"),
    _t("redirects", "Redirect std streams to log files: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
       "rank, e.g. 0:1,1:2.", to_std, "0", short="-r", metavar="SPEC"),
    _t("tee", "Tee std streams to log files and the console (same SPEC as --redirects).", to_std, "0",
       short="-t", metavar="SPEC"),
    _t("local-ranks-filter", "Show only these local ranks on the console, e.g. 0,1.", to_ranks_filter, "",
       metavar="RANKS"),
    _t("duplicate-stdout-filters", "Copy stdout lines matching any of these comma-separated filters to a "
       "file (',,' escapes a comma).", to_comma_list, "", metavar="F1,F2"),
    _t("duplicate-stderr-filters", "Same for stderr.", to_comma_list, "", metavar="F1,F2"),
    _t("node-rank", "Rank of this node (static rendezvous; unicron honours it for every backend).",
       int_at_least(0), None, metavar="N"),
    _t("master-addr", "Address of the master node (static rendezvous without --rdzv-endpoint).",
       to_host, "127.0.0.1", metavar="HOST"),
    _t("master-port", "Port on the master node (static rendezvous); defaults to 29500.", to_port, None,
       metavar="PORT"),
    _t("local-addr", "Address of this node as others should reach it (default: its FQDN).", to_host, None,
       metavar="HOST"),
    _t("logs-specs", "torchrun.logs_specs entry point; unicron always writes torchrun's default layout "
       "(ignored).", nonempty, None, metavar="NAME", pet=False),
    _t("numa-binding", "NUMA binding mode: node, socket, exclusive, core-complex (ignored by unicron).",
       choice("node", "socket", "exclusive", "core-complex"), None, metavar="MODE", pet=False),
    _t("signals-to-handle", "Signals the agent handles and forwards to workers.", to_signals,
       "SIGTERM,SIGINT,SIGHUP,SIGQUIT", metavar="SIG,..."),
    _t("shutdown-timeout", "torchrun's name for --grace-period (seconds from SIGTERM to SIGKILL).",
       int_at_least(0), None, metavar="SEC", more_envs=("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",)),
    _t("virtual-local-rank", "LOCAL_RANK=0 for every worker, each seeing only its own GPU."),
    # unicron's own options
    _u("inject", "Fault injection KIND@RANK:STEP, KIND one of kill, hang, exception, exit[=CODE], "
       "slow[=SECONDS]; repeatable.", to_inject, (), metavar="SPEC", repeat=True),
    _u("no-inject", "Start workers exactly as torchrun does (no unicron worker hooks)."),
    _u("grace-period", "Seconds between SIGTERM and SIGKILL when stopping workers.", float_at_least(0.0),
       "5", metavar="SEC"),
    _u("hang-factor", "A rank is hung after K times its running median step time.", float_above(1.0),
       "5.0", metavar="K"),
    _u("hang-floor", "... but never before this many seconds.", float_above(0.0), "10.0", metavar="SEC"),
    _u("hang-warmup-steps", "Steps before the median is trusted.", int_at_least(0), "3", metavar="N"),
    _u("first-step-timeout", "Seconds allowed before and during the first steps.", float_above(0.0),
       "300", metavar="SEC"),
    _u("heartbeat-interval", "Seconds between agent heartbeats.", float_above(0.0), "0.5", metavar="SEC"),
    _u("heartbeat-timeout", "A node is lost after this many seconds without a heartbeat.",
       float_above(0.0), "3.0", metavar="SEC"),
    _u("secret-file", "File holding the per-job HMAC secret (else UNICRON_SECRET).", nonempty, None,
       metavar="PATH"),
    _u("coordinator", "Join a standalone `unicron coordinator` at HOST:PORT instead of embedding one.",
       to_hostport, None, metavar="HOST:PORT"),
    _u("weight", "Weight of this job for the planner.", float_above(0.0), "1.0", metavar="W"),
    _u("no-warm", "Disable warm restarts (always restart workers from scratch)."),
    _u("metrics-port", "Serve Prometheus metrics on this port (0: any free port).", to_port, None,
       metavar="PORT"),
    _u("status-line", "Live status line on the console: auto, always, never.",
       choice("auto", "always", "never"), "auto", metavar="WHEN"),
    _u("config", "TOML, YAML or JSON file of settings by long flag name.", nonempty, None, metavar="FILE"),
)

BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}
BY_FLAG: dict[str, Option] = {f: o for o in OPTIONS for f in o.flags}
