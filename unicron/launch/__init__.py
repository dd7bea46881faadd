"""torchrun-compatible command line -> frozen ``LaunchConfig``; the worker environment (pure).

    cfg = parse_run_args(argv, os.environ)          # UsageError/ConfigError: one clear line
    env = worker_env(os.environ, cfg=cfg, ...)       # what torchrun gives each worker
    argv = worker_command(cfg, inject=cfg.uses_boot)
"""

from unicron.launch.args import InjectSpec, RdzvConf, StdSpec
from unicron.launch.config import LaunchConfig, parse_run_args
from unicron.launch.workerenv import master_addr_for, worker_command, worker_env

__all__ = [
    "InjectSpec",
    "LaunchConfig",
    "RdzvConf",
    "StdSpec",
    "master_addr_for",
    "parse_run_args",
    "worker_command",
    "worker_env",
]
