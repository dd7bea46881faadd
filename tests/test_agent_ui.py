"""The console line of a fault (unicron.agent.ui.fault_line): pure."""

from __future__ import annotations

from unicron.agent.ui import fault_line


def test_a_fault_line_says_who_when_and_what() -> None:
    kill = {"kind": "exit", "rank": 1, "summary": "signal SIGKILL (9)"}
    assert fault_line(dict(kill, steps_completed=15), "n") == "exit on rank 1 at step 15: signal SIGKILL (9)"
    assert fault_line(dict(kill, steps_completed=0), "n") == "exit on rank 1 before its first step: signal SIGKILL (9)"
    assert fault_line(dict(kill, steps_completed=None), "n") == "exit on rank 1: signal SIGKILL (9)"
    # a later attempt counts from 0 unless it restored a snapshot (then steps are the run's)
    later = dict(kill, steps_completed=11, attempt=2, restored_from=0)
    assert fault_line(later, "n") == "exit on rank 1 at step 11 of attempt 2: signal SIGKILL (9)"
    assert fault_line(dict(later, restored_from=36, steps_completed=40), "n") == "exit on rank 1 at step 40: signal SIGKILL (9)"
    assert fault_line(dict(later, steps_completed=0), "n") == "exit on rank 1 before its first step: signal SIGKILL (9)"
    exc = {"kind": "exception", "rank": 0, "error_type": "RuntimeError", "message": "boom", "steps_completed": 3}
    assert fault_line(exc, "n") == "exception on rank 0 at step 3: RuntimeError: boom"
    assert fault_line({"kind": "node_lost", "node_id": "b"}, "a") == "node_lost on node b: node_lost"


def test_a_refused_join_is_shown_on_the_coordinators_console(capsys) -> None:
    from unicron.agent.ui import AgentUI

    ui = AgentUI("never")
    ui.on_event({"kind": "join_refused", "host": "10.0.0.2", "reason": "--nnodes mismatch: 3:3 vs 2:2", "waits": False})
    assert "node 10.0.0.2 refused: --nnodes mismatch: 3:3 vs 2:2" in capsys.readouterr().err
