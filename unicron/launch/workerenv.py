"""The environment and command line of each worker: exactly what torchrun gives (pure).

Mirrors torch 2.13's ``LocalElasticAgent._start_workers`` (the per-worker variables),
``torch.distributed.run`` (OMP_NUM_THREADS, PYTHON_EXEC, ``-u``), ``elastic_launch``
(TORCHELASTIC_SIGNALS_TO_HANDLE, which torchrun puts in its own environment and so every worker
inherits) and ``DefaultLogsSpecs`` (TORCHELASTIC_ERROR_FILE). The worker environment is the
launcher's environment plus these, like torchrun's ``os.environ.copy(); env.update(...)``.
"""

from __future__ import annotations

from collections.abc import Mapping

from unicron.errors import UsageError
from unicron.launch.config import LaunchConfig

# Variables the agent sets for its own workers; one inherited from a surrounding unicron run
# (or from the user's shell) must never leak into a worker, and the job secret is not the
# workers' business (logging tools often capture the whole environment).
AGENT_OWNED_VARS = (
    "UNICRON_AGENT_ADDR",
    "UNICRON_STACK_DIR",
    "UNICRON_SNAPSHOT_DIR",
    "UNICRON_RESTORE_STEP",
    "UNICRON_INJECT",
    "UNICRON_WATCH_START",
    "UNICRON_HANG_IDLE",
    "UNICRON_SECRET",
    "UNICRON_AGENT_PID",
)

BOOT_MODULE = "unicron.worker.boot"
_RUN_PATH_SNIPPET = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

# The variables torchrun itself sets for every worker (the env-parity test compares these).
TORCHRUN_WORKER_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)


def default_omp_threads(base_env: Mapping[str, str], nproc_per_node: int) -> str | None:
    """OMP_NUM_THREADS that torchrun sets for workers: one thread each when a node runs several,
    unless the user chose; None: leave it as inherited."""
    if "OMP_NUM_THREADS" not in base_env and nproc_per_node > 1:
        return "1"
    return None


def worker_env(
    base_env: Mapping[str, str],
    *,
    cfg: LaunchConfig,
    local_rank: int,
    rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    role_rank: int,
    role_world_size: int,
    master_addr: str,
    master_port: int,
    restart_count: int,
    run_id: str,
    error_file: str,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """The full environment of one worker. ``error_file`` is "" when logs go to /dev/null (as
    in torchrun); ``extra`` (unicron's UNICRON_* variables) is applied last."""
    if not (0 <= local_rank < local_world_size and 0 <= rank < world_size):
        raise ValueError(f"bad worker placement: local rank {local_rank}/{local_world_size}, rank {rank}/{world_size}")
    env = {k: v for k, v in base_env.items() if k not in AGENT_OWNED_VARS}
    omp = default_omp_threads(base_env, cfg.nproc_per_node)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(cfg.signals_to_handle)
    env.update({
        "RANK": str(rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(role_rank),
        "ROLE_NAME": cfg.role,
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_WORLD_SIZE": str(role_world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        # The agent hosts the TCPStore the workers' env:// rendezvous connects to (as clients).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
    })
    if cfg.virtual_local_rank:
        # Each worker sees only its own GPU, as device 0 (mapped through the parent's list).
        env["LOCAL_RANK"] = "0"
        visible = base_env.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        else:
            gpus = visible.split(",")
            if local_rank >= len(gpus):
                raise UsageError(f"--virtual-local-rank: local rank {local_rank} has no GPU in "
                                 f"CUDA_VISIBLE_DEVICES={visible}")
            env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank].strip()
    else:
        env["LOCAL_RANK"] = str(local_rank)
    env.update(extra)
    return env


def worker_command(cfg: LaunchConfig, *, inject: bool) -> list[str]:
    """The worker's argv. Without ``inject`` (or with --no-inject, or --no-python) it is what
    torchrun runs; with it the script runs under ``unicron.worker.boot``, which installs the
    hooks and then runs the script (or module) with its arguments unchanged."""
    py, script, args = cfg.python_exec, cfg.script, list(cfg.script_args)
    if cfg.no_python and not cfg.run_path:
        return [script, *args]
    if inject and cfg.uses_boot:
        return [py, "-u", "-m", BOOT_MODULE, *(["--module"] if cfg.module else []), script, *args]
    if cfg.run_path:
        # torchrun runs runpy.run_path(script) with sys.argv = [script, *args] in a child process.
        return [py, "-u", "-c", _RUN_PATH_SNIPPET, script, *args]
    if cfg.module:
        return [py, "-u", "-m", script, *args]
    return [py, "-u", script, *args]


def master_addr_for(cfg: LaunchConfig, *, fqdn: str) -> str:
    """MASTER_ADDR as torchrun advertises it: the static endpoint's host, or else the address of
    the node that hosts the store (its --local-addr, else its FQDN; call this on that node)."""
    if cfg.rdzv_backend == "static":
        return cfg.rdzv_host
    return cfg.local_addr or fqdn
