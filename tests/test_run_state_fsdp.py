"""FSDP2 (``fully_shard``, DTensor parameters and optimizer state) with ``unicron.State``: a rank
SIGKILLed mid-run is restored from memory and every rank's state ends bit for bit as in a run
without the fault (real gloo, 2 ranks)."""

from __future__ import annotations

import pytest
from e2e import read_events, run_unicron

pytestmark = pytest.mark.slow

COMMON = ["run", "--standalone", "--nproc-per-node", "2", "--grace-period", "2", "--first-step-timeout", "60"]


def test_fsdp2_state_is_restored_from_memory_bit_for_bit(workdir) -> None:
    code, _, err = run_unicron([*COMMON, "--log-dir", str(workdir / "ref-logs"), str(workdir / "train_fsdp.py"), "20",
                                str(workdir / "ref")], workdir, timeout=100)
    assert code == 0, err
    code, _, err = run_unicron([*COMMON, "--max-restarts", "2", "--inject", "kill@1:9", "--log-dir",
                                str(workdir / "logs"), str(workdir / "train_fsdp.py"), "20", str(workdir / "healed")],
                               workdir, timeout=100)
    assert code == 0, err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 2 and starts[1]["restore_step"] in (8, 9), starts
    for rank in (0, 1):
        assert (workdir / f"healed.rank{rank}").read_text() == (workdir / f"ref.rank{rank}").read_text()
