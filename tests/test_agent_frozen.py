"""The frozen-tail judgement (``unicron.agent.frozen``) on its own: a rank past its end that said
nothing since its last word, with its process's CPU read at each."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from unicron.agent.frozen import excuse_pause, frozen_for, frozen_ranks, next_frozen_check_s, process_cpu_s
from unicron.agent.ranks import RankState


def _rank(pid: int, **fields: Any) -> RankState:
    return RankState(rank=1, local_rank=1, proc=SimpleNamespace(pid=pid), logs=None, started_at=0.0,  # type: ignore[arg-type]
                     **fields)


def test_only_a_rank_past_its_end_that_used_no_cpu_is_frozen() -> None:
    closed = dict(closed=True, alive_at=100.0, alive_cpu_s=5.0)
    assert frozen_for(_rank(1, **closed), 112.0, 5.0) == pytest.approx(12.0)
    assert frozen_for(_rank(1, **closed), 112.0, 5.0 + 0.02 * 12 * 0.9) == pytest.approx(12.0)  # a GIL waiter's wakes
    assert frozen_for(_rank(1, **closed), 112.0, 5.5) is None  # it computes: holding the lock is work then
    assert frozen_for(_rank(1, **dict(closed, closed_raising=True)), 112.0, 5.0) is None  # an exception's way out
    assert frozen_for(_rank(1, alive_at=100.0, alive_cpu_s=5.0), 112.0, 5.0) is None  # still training: the hang detector's
    assert frozen_for(_rank(1, **dict(closed, exitcode=0)), 112.0, 5.0) is None  # gone
    # its script ended: the interpreter finalizes, and a __del__ that waits stops the ticks (32A F4)
    assert frozen_for(_rank(1, **dict(closed, bye_at=99.0)), 112.0, 5.0) is None
    assert frozen_for(_rank(1, **closed), 112.0, None) is None  # unreadable: no verdict


def test_the_agents_own_pause_is_not_the_ranks_silence() -> None:
    """32A F3: the launcher stopped 10 s while a rank slept past its end; its ``alive`` ticks of
    that time were still in zmq's I/O thread when the watch ran, and it was killed as frozen."""
    ticking, starting = _rank(1, closed=True, alive_at=100.0, alive_cpu_s=5.0), _rank(1, closed=True)
    excuse_pause([ticking, starting], 10.0)
    assert ticking.alive_at == 110.0 and starting.alive_at is None
    assert frozen_for(ticking, 111.0, 5.0) == pytest.approx(1.0)
    assert frozen_ranks([ticking], 111.0, 6.0) == []


@pytest.mark.timeout(30)
def test_a_live_process_is_judged_by_its_cpu_and_a_stopped_one_never() -> None:
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpu = process_cpu_s(idle.pid)
        assert cpu is not None
        r = _rank(idle.pid, closed=True, alive_at=time.monotonic() - 5, alive_cpu_s=cpu)
        assert [(x.rank, round(s)) for x, s in frozen_ranks([r], time.monotonic(), 3.0)] == [(1, 5)]
        assert frozen_ranks([r], time.monotonic(), 30.0) == []  # not yet
        assert 24 < next_frozen_check_s([r], time.monotonic(), 30.0) <= 25
        r.frozen = "said"
        assert frozen_ranks([r], time.monotonic(), 3.0) == []  # once
        r.frozen = None
        os.kill(idle.pid, 19)  # SIGSTOP: a person's, not a freeze
        deadline = time.monotonic() + 10
        while (state := open(f"/proc/{idle.pid}/stat").read().rsplit(")", 1)[1].split()[0]) != "T":
            assert time.monotonic() < deadline, state
            time.sleep(0.01)
        assert frozen_ranks([r], time.monotonic(), 3.0) == []
    finally:
        idle.kill()
        idle.wait()
    assert process_cpu_s(idle.pid) is None
