"""The options of `unicron run`: torchrun's plus unicron's own, and their value converters.

Every option is one ``Option`` row (flags, converter, default, environment variables, help), so
the argv splitter, the help text, the config-file keys and the environment lookup can never
disagree. Converters take the raw string and raise ``ValueError`` with a message that reads well
after "<source>: " (``unicron.launch.config`` adds the flag, variable or file that gave it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unicron.launch.values import (  # noqa: F401 - InjectSpec, RdzvConf, StdSpec, to_comma_list, split_endpoint re-exported
    InjectSpec,
    RdzvConf,
    StdSpec,
    choice,
    float_above,
    float_at_least,
    int_at_least,
    nonempty,
    path_or_none,
    split_endpoint,
    to_backend,
    to_comma_list,
    to_host,
    to_hostport,
    to_inject,
    to_nnodes,
    to_nproc,
    to_port,
    to_ranks_filter,
    to_rdzv_conf,
    to_rdzv_id,
    to_signals,
    to_std,
)

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
    _t("log-dir", "Base directory for per-rank logs (torchrun's layout).", path_or_none, None, metavar="DIR"),
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
    _u("inject", "Fault injection KIND@RANK:STEP, KIND one of kill, hang, freeze, exception, exit[=CODE], "
       "slow[=SECONDS]; repeatable.", to_inject, (), metavar="SPEC", repeat=True),
    _u("no-inject", "Start workers exactly as torchrun does (no unicron worker hooks)."),
    _u("grace-period", "Seconds between SIGTERM and SIGKILL when stopping workers.", float_at_least(0.0),
       "5", metavar="SEC"),
    _u("hang-factor", "An idle job (no rank using CPU or doing I/O) is hung after K times the running "
       "median step time.", float_above(1.0), "3.0", metavar="K"),
    _u("hang-floor", "... but never before this many seconds.", float_above(0.0), "1.5", metavar="SEC"),
    _u("hang-busy-factor", "While some rank burns CPU with its Python still (a long native call, a "
       "spin-wait) or waits for its data loader, K times the median (never below the idle threshold).",
       float_above(1.0), "5.0", metavar="K"),
    _u("hang-busy-floor", "... but never before this many seconds.", float_above(0.0), "10.0", metavar="SEC"),
    _u("hang-warmup-steps", "Steps before the median is trusted (until then: k x the longest gap so far, at least --hang-floor).", int_at_least(0), "3", metavar="N"),
    _u("first-step-timeout", "Seconds allowed before every rank's first step; the cap of a stall during warm-up.", float_above(0.0),
       "300", metavar="SEC"),
    # At least 10 ms: each heartbeat wakes the agent, on the cores the ranks train on (27C F11).
    _u("heartbeat-interval", "Seconds between agent heartbeats.", float_at_least(0.01), "0.5", metavar="SEC"),
    _u("heartbeat-timeout", "A node is lost after this many seconds without a heartbeat.",
       float_above(0.0), "3.0", metavar="SEC"),
    _u("secret-file", "File holding the per-job HMAC secret (else UNICRON_SECRET).", nonempty, None,
       metavar="PATH"),
    _u("coordinator", "Join a standalone `unicron coordinator` at HOST:PORT instead of embedding one.",
       to_hostport, None, metavar="HOST:PORT"),
    _u("weight", "Weight of this job for the planner.", float_above(0.0), "1.0", metavar="W"),
    _u("no-warm", "Disable warm starts (start every worker as a new interpreter, as torchrun does)."),
    _u("metrics-port", "Serve Prometheus metrics on this port (0: any free port).", to_port, None,
       metavar="PORT"),
    _u("status-line", "Live status line on the console: auto, always, never.",
       choice("auto", "always", "never"), "auto", metavar="WHEN"),
    _u("config", "TOML, YAML or JSON file of settings by long flag name.", nonempty, None, metavar="FILE"),
)

BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}
BY_FLAG: dict[str, Option] = {f: o for o in OPTIONS for f in o.flags}


def closest_flag(name: str) -> str | None:
    """The long flag a misspelt or shortened ``--name`` most likely meant: the one flag it begins
    (``--nproc`` is ``--nproc-per-node``), else the nearest by spelling, else None."""
    import difflib

    wanted = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
    names = sorted(o.name for o in OPTIONS if o.name.startswith("--"))
    starts = [n for n in names if n.startswith(wanted)]
    if len(starts) == 1:
        return starts[0]
    close = difflib.get_close_matches(wanted, names, n=1)
    return close[0] if close else None
