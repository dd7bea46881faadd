"""Environment variables the agent gives a worker, and how the worker reads them.

Kept free of heavy imports: the agent imports these names too.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping

from unicron.errors import ConfigError

AGENT_ADDR = "UNICRON_AGENT_ADDR"  # zmq endpoint of the agent's PULL socket
STACK_DIR = "UNICRON_STACK_DIR"  # STACK_SIGNAL dumps all thread stacks to rank{RANK}.txt here
# The signal that asks a worker for its stacks: a real-time one, which scripts leave alone.
# SIGUSR1 is a script's own (Slurm's `--signal=USR1@90`, Lightning's checkpoint-and-requeue):
# sending it ran such a handler on every hang, and the handler had replaced the dump's.
STACK_SIGNAL = signal.SIGRTMIN + 4
SNAPSHOT_DIR = "UNICRON_SNAPSHOT_DIR"  # unicron.State snapshots live here (agent-owned shm)
RESTORE_STEP = "UNICRON_RESTORE_STEP"  # step every rank has a snapshot of
INJECT = "UNICRON_INJECT"  # fault-injection specs KIND@RANK:STEP[;...]
# Seconds from the worker's start after which the agent samples the start-up's activity (before
# the first step: unicron.agent.workers): the worker reports its own from then on too
WATCH_START = "UNICRON_WATCH_START"
# "K,FLOOR": the agent's idle threshold between steps, max(K x median step, FLOOR) seconds; the
# worker's evidence of a wait (data, motion) must come before it runs out
HANG_IDLE = "UNICRON_HANG_IDLE"

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchelastic's per-worker error file (JSON)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def rank(env: Mapping[str, str] | None = None) -> int:
    """Global rank of this worker (``RANK``; 0 outside a distributed launch)."""
    return _int(os.environ if env is None else env, "RANK", 0)


def local_rank(env: Mapping[str, str] | None = None) -> int:
    return _int(os.environ if env is None else env, "LOCAL_RANK", 0)


def world_size(env: Mapping[str, str] | None = None) -> int:
    return max(1, _int(os.environ if env is None else env, "WORLD_SIZE", 1))


def restart_count(env: Mapping[str, str] | None = None) -> int:
    return _int(os.environ if env is None else env, "TORCHELASTIC_RESTART_COUNT", 0)


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    return max(1, _int(os.environ if env is None else env, "LOCAL_WORLD_SIZE", 1))


def restore_step(env: Mapping[str, str] | None = None) -> int | None:
    """``UNICRON_RESTORE_STEP`` as an int, or None when unset (fresh start)."""
    env = os.environ if env is None else env
    if not env.get(RESTORE_STEP, "").strip():
        return None
    step = _int(env, RESTORE_STEP, 0)
    if step < 0:
        raise ConfigError(f"{RESTORE_STEP}={step} must be >= 0")
    return step


def path_or_none(name: str, env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(name, "")
    return value or None


def numbers_or_none(name: str, count: int, env: Mapping[str, str] | None = None) -> tuple[float, ...] | None:
    """``count`` comma-separated non-negative numbers from ``name``; None when unset or not such."""
    parts = (os.environ if env is None else env).get(name, "").split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        return None
    ok = len(values) == count and all(math.isfinite(v) and v >= 0 for v in values)
    return values if ok else None


def seconds_or_none(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """A non-negative number of seconds from ``name``; None when unset or not such a number."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
