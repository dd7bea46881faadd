"""Resolve `unicron run`'s arguments once into a frozen ``LaunchConfig``.

Precedence for every option: flag > environment (``PET_*`` for torchrun's options exactly as
torchrun reads them, ``UNICRON_*`` for unicron's) > Slurm (``SLURM_*``, only a few values) >
``--config`` file > default. A bad value names where it came from, e.g.
``UNICRON_HANG_FACTOR: not a number: 'x'``. Then torchrun's own rewrites are applied
(``--standalone``; a single-node static job without endpoint or port becomes a local c10d one)
and contradictions are refused with one clear ``UsageError``. Reading the layers: ``layers``.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from unicron.errors import UsageError
from unicron.launch.args import BY_DEST, InjectSpec, RdzvConf, StdSpec, split_endpoint
from unicron.launch.commands import split_argv
from unicron.launch.layers import CLI, DEFAULT, ENV, Resolver, load_config_file
from unicron.launch.slurm import slurm_info
from unicron.smallfile import NotReadable, read_regular

SECRET_MAX_BYTES = 64 << 10
DEFAULT_PORTS = {"c10d": 29400, "etcd": 2379, "etcd-v2": 2379}  # torchrun's; static needs an explicit port
DeviceProbe = Callable[[str], "int | None"]  # kind (cpu|cuda|xpu|accelerator) -> count, None if absent


@dataclass(frozen=True)
class LaunchConfig:
    """Everything `unicron run` was asked to do, resolved and checked. Immutable."""

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    python_exec: str = sys.executable  # PYTHON_EXEC, as in torchrun
    # sizes
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = None  # None: the coordinator assigns one
    # rendezvous
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_host: str = "localhost"
    rdzv_port: int = 0  # 0: the hosting agent binds any free port
    rdzv_id: str = "none"
    rdzv_conf: RdzvConf = RdzvConf()
    standalone: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_addr: str | None = None
    # supervision (torchrun's)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    log_dir: str | None = None
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    start_method: str = "spawn"
    virtual_local_rank: bool = False
    log_line_prefix_template: str | None = None  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    event_log_handler: str = "null"
    logs_specs: str | None = None
    numa_binding: str | None = None
    # unicron's own
    injects: tuple[InjectSpec, ...] = ()
    no_inject: bool = False
    grace_period: float = 5.0
    hang_factor: float = 3.0
    hang_floor: float = 1.5
    hang_warmup_steps: int = 3
    hang_busy_factor: float = 5.0
    hang_busy_floor: float = 10.0
    first_step_timeout: float = 300.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    secret: bytes = field(default=b"", repr=False)
    secret_source: str = "generated"  # the flag/variable it came from, or "generated"
    secret_file: str | None = None
    coordinator: str | None = None
    weight: float = 1.0
    warm: bool = True
    metrics_port: int | None = None
    status_line: str = "auto"
    config_file: str | None = None
    sources: tuple[tuple[str, str], ...] = ()  # option -> where its value came from (non-defaults)
    warnings: tuple[str, ...] = ()  # to print once at start (ignored flags and the like)

    @property
    def fixed_world_size(self) -> int | None:
        """WORLD_SIZE when the node count is fixed; None for an elastic MIN:MAX job."""
        return self.max_nodes * self.nproc_per_node if self.min_nodes == self.max_nodes else None

    @property
    def uses_boot(self) -> bool:
        """Whether workers start under unicron.worker.boot (hooks, step reports, injection)."""
        return not self.no_inject and not (self.no_python and not self.run_path)

    @property
    def inject_env(self) -> str:
        """The UNICRON_INJECT value for the first attempt ("" when nothing is injected)."""
        return ";".join(str(spec) for spec in self.injects)

    def source(self, dest: str) -> str:
        return dict(self.sources).get(dest, "default")


def _check_script(script: str) -> None:
    """What python itself would refuse to run, said before any node starts a worker."""
    if os.path.isdir(script):
        # python runs a directory by its __main__ module (python DIR, like a zip application)
        if not any(os.path.isfile(os.path.join(script, f"__main__.{ext}")) for ext in ("py", "pyc")):
            raise UsageError(f"training script {script} is a directory without a __main__.py")
    elif not os.path.exists(script):  # /dev/null or a FIFO runs too, as under torchrun (27C F13)
        raise UsageError(f"training script not found: {script}")


def default_probe(kind: str) -> int | None:
    """How many devices of ``kind`` this machine has (None: not available), as torchrun counts."""
    if kind == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    import torch  # only for auto/gpu/xpu: keeps the common path fast

    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else None
    if kind == "xpu":
        return torch.xpu.device_count() if torch.xpu.is_available() else None
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return int(accelerator.device_count()) if accelerator.is_available() else None
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def resolve_nproc(spec: str, probe: DeviceProbe, label: str) -> int:
    """torchrun's determine_local_world_size: an integer, or a device count."""
    if spec.isdigit():
        return int(spec)
    if spec in ("gpu", "xpu"):
        count = probe("cuda" if spec == "gpu" else "xpu")
        if count is None:
            raise UsageError(f"{label}: {spec}: {'CUDA' if spec == 'gpu' else 'XPU'} is not available")
    elif spec == "auto":
        count = probe("accelerator")
        count = probe("cpu") if count is None else count
    else:
        count = probe("cpu")
    if not count:
        raise UsageError(f"{label}: {spec}: found no devices")
    return count


def _read_secret(path: str, label: str, warnings: list[str]) -> bytes:
    try:
        data = read_regular(path, SECRET_MAX_BYTES).strip()
        mode = os.stat(path).st_mode
    except OSError as err:
        raise UsageError(f"{label}: cannot read secret file {path}: {err.strerror or err}") from None
    except NotReadable as err:
        raise UsageError(f"{label}: cannot read secret file {path}: it {err}") from None
    if not data:
        raise UsageError(f"{label}: secret file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.append(f"secret file {path} is readable by others; chmod 600 it")
    return data


def _sized_apart_from_slurm(v: Mapping[str, Any], r: Resolver, slurm_nnodes: str | None) -> bool:
    """Under Slurm, whether the job's size is the user's own: ``--standalone``, or a node count
    given above Slurm's layer (a flag or variable) that is not the allocation's."""
    if v["standalone"]:
        return True
    if r.ranks["nnodes"] > ENV:
        return False
    _, max_nodes = v["nnodes"]
    try:
        return slurm_nnodes is None or int(slurm_nnodes) != max_nodes
    except ValueError:
        return True  # Slurm's own value is unusable; the user's wins


def parse_run_args(argv: list[str], environ: Mapping[str, str], *,
                   probe: DeviceProbe = default_probe) -> LaunchConfig:
    """Parse `unicron run` arguments (without the `run`) against ``environ``. Raises
    ``UsageError``/``ConfigError`` with one clear line, or ``HelpRequested``."""
    split = split_argv(argv)
    config_path = split.given.get("config") or environ.get("UNICRON_CONFIG", "").strip() or None
    file_values = load_config_file(str(config_path)) if config_path else {}
    slurm = slurm_info(environ)
    slurm_layer: dict[str, tuple[str, str]] = {}
    if slurm is not None:
        slurm_layer["rdzv_id"] = (slurm.job_id, "SLURM_JOB_ID")
        for dest, value in (("nnodes", slurm.nnodes), ("node_rank", slurm.node_rank)):
            if value is not None:
                slurm_layer[dest] = (value, slurm.source[dest])
    r = Resolver(split.given, split.spelling, environ, slurm_layer, file_values,
                  str(config_path) if config_path else None)
    v: dict[str, Any] = {o.dest: r.get(o.dest) for o in BY_DEST.values()}
    sized_apart = slurm is not None and _sized_apart_from_slurm(v, r, slurm.nnodes)
    if sized_apart:
        # Slurm's node count, node id and job id describe the allocation, not a job the user
        # sized apart from it (`srun -N2 unicron run --standalone ...`: one job per node, as
        # torchrun runs them; two such jobs must not share an id either).
        slurm_layer = {}
        r = Resolver(split.given, split.spelling, environ, slurm_layer, file_values,
                      str(config_path) if config_path else None)
        v = {o.dest: r.get(o.dest) for o in BY_DEST.values()}
        if v["nnodes"][1] == 1:
            slurm = None  # a one-node job: nor Slurm's first host (an elastic one keeps it: its nodes meet there)
    warnings: list[str] = []
    label = r.labels
    min_nodes, max_nodes = v["nnodes"]
    nproc = resolve_nproc(v["nproc_per_node"], probe, label["nproc_per_node"])

    # Which program to start (torchrun: --run-path wins over --no-python; -m with --no-python fails).
    if v["no_python"] and v["module"] and not v["run_path"]:
        raise UsageError(f"{label['no_python']} and {label['module']} cannot be used together")
    if v["run_path"] and v["module"]:
        raise UsageError(f"{label['run_path']} runs a file; it cannot be combined with {label['module']}")
    script = split.script
    if not (v["module"] or (v["no_python"] and not v["run_path"])):
        _check_script(script)

    # Rendezvous, with torchrun's rewrites.
    backend, endpoint, rdzv_id = v["rdzv_backend"], v["rdzv_endpoint"].strip(), v["rdzv_id"]
    one_node_static = False  # torchrun's default backend, one node, no --master-port: a local rendezvous
    if v["standalone"]:
        if min_nodes > 1:  # torchrun would wait for nodes that cannot come, until its join timeout
            raise UsageError(f"{label['standalone']} runs a single node; it contradicts "
                             f"{label['nnodes']} {min_nodes}:{max_nodes}")
        if max_nodes > 1:  # torchrun runs a range that allows one node on this one alone
            warnings.append(f"{label['standalone']} runs a single node: {label['nnodes']} {min_nodes}:{max_nodes} "
                            "runs as 1")
            max_nodes = 1
        for dest in ("rdzv_backend", "rdzv_endpoint", "rdzv_id"):
            if r.ranks[dest] != DEFAULT:
                warnings.append(f"{label[dest]} is ignored with {label['standalone']} (as in torchrun)")
        backend, endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    elif one_node_static := (backend == "static" and not endpoint and v["master_port"] is None and max_nodes == 1):
        backend, endpoint = "c10d", "localhost:0"  # torchrun: a one-node static job runs locally
        rdzv_id = rdzv_id if r.ranks["rdzv_id"] != DEFAULT else str(uuid.uuid4())
        if r.ranks["master_addr"] != DEFAULT:  # the warning below would name the setup it is (27C F13)
            warnings.append(f"{label['master_addr']} is not used by a one-node job without --master-port: "
                            "it rendezvouses on this host, as torchrun's does")
    if slurm is not None and slurm.first_host and not endpoint and backend != "static":
        endpoint, label["rdzv_endpoint"] = slurm.first_host, slurm.source["first_host"]
    master_addr = v["master_addr"]
    if slurm is not None and slurm.first_host and r.ranks["master_addr"] == DEFAULT:
        master_addr, label["master_addr"] = slurm.first_host, slurm.source["first_host"]
    master_port = 29500 if v["master_port"] is None else v["master_port"]
    if backend == "static" and not endpoint:
        endpoint, label["rdzv_endpoint"] = f"{_bracketed(master_addr)}:{master_port}", label["master_addr"]
    elif r.ranks["master_port"] != DEFAULT or (r.ranks["master_addr"] != DEFAULT and not one_node_static):
        given = [label[k] for k in ("master_addr", "master_port") if r.ranks[k] != DEFAULT]
        warnings.append(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} only used by the static "
                        "backend without --rdzv-endpoint")
    try:
        rdzv_host, rdzv_port = split_endpoint(endpoint or "localhost", DEFAULT_PORTS.get(backend))
    except ValueError as err:
        raise UsageError(f"{label['rdzv_endpoint']}: {err}") from None
    if rdzv_port == 0 and max_nodes > 1:
        raise UsageError(f"{label['rdzv_endpoint']}: port 0 cannot be found by the other nodes; give a port")
    node_rank = v["node_rank"]
    if node_rank is not None and node_rank >= max_nodes:
        raise UsageError(f"{label['node_rank']}: node rank {node_rank} must be below the number of nodes "
                         f"({max_nodes}, from {label['nnodes']})")

    # unicron's own settings.
    # The world size is known before the rendezvous only on one node (nodes may run different
    # numbers of workers); on several, a rank the job does not have is said when it starts.
    injects, world = v["inject"], (nproc if max_nodes == 1 else None)
    no_inject = v["no_inject"]
    if injects and no_inject and r.ranks["inject"] != r.ranks["no_inject"]:
        # Two layers: the nearer one wins, as every setting's does (28C F10: a UNICRON_INJECT
        # left in the environment made --no-inject on the command line an error)
        loser = "inject" if r.ranks["no_inject"] < r.ranks["inject"] else "no_inject"
        warnings.append(f"{label[loser]} is overridden by {label['no_inject' if loser == 'inject' else 'inject']}")
        injects, no_inject = ((), True) if loser == "inject" else (injects, False)
    if injects and no_inject:
        raise UsageError(f"{label['inject']} needs unicron's worker hooks; it contradicts {label['no_inject']}")
    if injects and v["no_python"] and not v["run_path"]:
        raise UsageError(f"{label['inject']} needs a Python worker; it contradicts {label['no_python']}")
    for spec in injects:
        if world is not None and spec.rank is not None and spec.rank >= world:
            raise UsageError(f"{label['inject']}: {spec}: rank {spec.rank} does not exist (world size {world})")
    if v["heartbeat_timeout"] <= v["heartbeat_interval"]:
        interval = "the default --heartbeat-interval" if label["heartbeat_interval"] == "default" \
            else label["heartbeat_interval"]
        raise UsageError(f"{label['heartbeat_timeout']} ({v['heartbeat_timeout']:g}s) must be longer than "
                         f"{interval} ({v['heartbeat_interval']:g}s)")
    grace, shutdown = v["grace_period"], v["shutdown_timeout"]
    if r.ranks["shutdown_timeout"] == r.ranks["grace_period"] == CLI and float(shutdown) != grace:
        raise UsageError(f"{label['grace_period']} {grace:g} contradicts {label['shutdown_timeout']} {shutdown}")
    if r.ranks["shutdown_timeout"] < r.ranks["grace_period"]:
        grace, label["grace_period"] = float(shutdown), label["shutdown_timeout"]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if v["virtual_local_rank"] and visible is not None and nproc > len(visible.split(",")):
        raise UsageError(f"{label['virtual_local_rank']}: {nproc} workers but CUDA_VISIBLE_DEVICES={visible}")
    log_dir = v["log_dir"]
    if log_dir is not None and os.path.isfile(log_dir):
        raise UsageError(f"{label['log_dir']}: {log_dir} is a file, not a directory")
    for dest, why in (("logs_specs", "unicron writes torchrun's default log layout"),
                      ("numa_binding", "unicron does not bind workers to NUMA nodes"),
                      ("event_log_handler", "unicron writes its own event log")):
        if r.ranks[dest] != DEFAULT:
            warnings.append(f"{label[dest]} is ignored: {why}")
    if r.ranks["weight"] != DEFAULT:  # sent with the join for the roadmap's planning across jobs
        warnings.append(f"{label['weight']} is not used yet: a coordinator does not move nodes between its jobs "
                        "(`unicron plan` takes each job's weight from its input file)")
    for dest, bit in (("duplicate_stdout_filters", 1), ("duplicate_stderr_filters", 2)):
        # As in torchrun, only teed lines are copied: say so rather than leave an empty file.
        tee = v["tee"]
        teed = any(s & bit for _, s in tee.per_rank) if tee.per_rank else tee.default & bit
        if v[dest] and (log_dir == os.devnull or not teed):
            why = f"with {label['log_dir']} {os.devnull}" if teed else f"without --tee {bit} or 3 (it copies only teed lines)"
            warnings.append(f"{label[dest]} copies nothing {why}")

    # The job secret: flag > UNICRON_SECRET > UNICRON_SECRET_FILE / config file > random (one node).
    secret_file, env_secret = v["secret_file"], environ.get("UNICRON_SECRET", "").strip()
    if secret_file is not None and (r.ranks["secret_file"] == CLI or not env_secret):
        secret, secret_source = _read_secret(secret_file, label["secret_file"], warnings), label["secret_file"]
    elif env_secret:
        secret, secret_source, secret_file = env_secret.encode(), "UNICRON_SECRET", None
    elif max_nodes == 1 and v["coordinator"] is None:
        secret, secret_source = secrets.token_hex(32).encode(), "generated"
    else:
        nodes = f"{max_nodes} nodes" if min_nodes == max_nodes else f"up to {max_nodes} nodes"
        why = f"{label['coordinator']} {v['coordinator']}" if v["coordinator"] else nodes
        raise UsageError(f"this job ({why}) needs the same secret on every node: set UNICRON_SECRET or "
                         "pass --secret-file PATH")

    return LaunchConfig(
        script=script, script_args=tuple(split.script_args), module=v["module"], no_python=v["no_python"],
        run_path=v["run_path"], python_exec=environ.get("PYTHON_EXEC") or sys.executable,
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, node_rank=node_rank,
        rdzv_backend=backend, rdzv_endpoint=f"{rdzv_host}:{rdzv_port}", rdzv_host=rdzv_host,
        rdzv_port=rdzv_port, rdzv_id=rdzv_id, rdzv_conf=v["rdzv_conf"], standalone=v["standalone"],
        master_addr=master_addr, master_port=master_port, local_addr=v["local_addr"],
        max_restarts=v["max_restarts"], monitor_interval=v["monitor_interval"], role=v["role"],
        log_dir=log_dir, redirects=v["redirects"], tee=v["tee"], local_ranks_filter=v["local_ranks_filter"],
        duplicate_stdout_filters=v["duplicate_stdout_filters"],
        duplicate_stderr_filters=v["duplicate_stderr_filters"], signals_to_handle=v["signals_to_handle"],
        start_method=v["start_method"], virtual_local_rank=v["virtual_local_rank"],
        log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        event_log_handler=v["event_log_handler"], logs_specs=v["logs_specs"], numa_binding=v["numa_binding"],
        injects=injects, no_inject=no_inject, grace_period=grace, hang_factor=v["hang_factor"],
        hang_floor=v["hang_floor"], hang_warmup_steps=v["hang_warmup_steps"],
        hang_busy_factor=v["hang_busy_factor"], hang_busy_floor=v["hang_busy_floor"],
        first_step_timeout=v["first_step_timeout"], heartbeat_interval=v["heartbeat_interval"],
        heartbeat_timeout=v["heartbeat_timeout"], secret=secret, secret_source=secret_source,
        secret_file=secret_file, coordinator=v["coordinator"], weight=v["weight"], warm=not v["no_warm"],
        metrics_port=v["metrics_port"], status_line=v["status_line"],
        config_file=str(config_path) if config_path else None,
        sources=tuple(sorted((k, s) for k, s in label.items() if s != "default")),
        warnings=tuple(warnings),
    )


def _bracketed(host: str) -> str:
    """An IPv6 literal in brackets, so that HOST:PORT parses (``--master-addr ::1``)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
