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
    # an exit code first: stderr's last line may be a progress print, not what happened
    code = {"kind": "exit", "rank": 1, "exitcode": 3, "summary": "step 20 loss 2.0791", "steps_completed": 20}
    assert fault_line(code, "n") == "exit on rank 1 at step 20: exit code 3, last said: step 20 loss 2.0791"
    assert fault_line(dict(code, summary=""), "n") == "exit on rank 1 at step 20: exit code 3"


def test_a_refused_join_is_shown_on_the_coordinators_console(capsys) -> None:
    from unicron.agent.ui import AgentUI

    ui = AgentUI("never")
    ui.on_event({"kind": "join_refused", "host": "10.0.0.2", "reason": "--nnodes mismatch: 3:3 vs 2:2", "waits": False})
    assert "node 10.0.0.2 refused: --nnodes mismatch: 3:3 vs 2:2" in capsys.readouterr().err


def test_a_workers_control_characters_do_not_reach_the_terminal_through_unicrons_lines(capsys) -> None:
    from unicron.agent.ui import AgentUI, printable

    message = "payload \xff\x00\x01 and \x1b[31mANSI\x1b[0m\r\nline two\tend\rover"
    assert printable(message) == "payload \xff\\x00\\x01 and \\x1b[31mANSI\\x1b[0m\nline two\tend\\x0dover"
    AgentUI("never").warn("exception on rank 1 at step 10: ValueError: " + message)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x00" not in err and "\r" not in err and "\\x1b[31mANSI" in err


def test_the_live_line_is_drawn_in_auto_only_where_no_worker_output_reaches_the_terminal(monkeypatch) -> None:
    """Workers write to the terminal themselves, as under torchrun; a line redrawn in place
    glued itself to their lines (acceptance pass 14). ``always`` still draws it."""
    import io

    from unicron.agent.logs import LogSpec, Std
    from unicron.agent.ui import AgentUI

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    monkeypatch.setenv("TERM", "xterm")
    assert not AgentUI("auto").live
    assert not AgentUI("auto", workers_off_console=LogSpec().keeps_workers_off_console).live
    assert not AgentUI("auto", workers_off_console=LogSpec(redirects=Std.ALL, tee=Std.OUT).keeps_workers_off_console).live
    off = AgentUI("auto", workers_off_console=LogSpec(log_dir="/tmp/x", redirects=Std.ALL).keeps_workers_off_console)
    assert off.live
    off.close()
    always = AgentUI("always")
    assert always.live
    always.close()


def test_a_node_gone_while_the_job_forms_is_shown_with_what_the_job_waits_for(capsys) -> None:
    from unicron.agent.ui import AgentUI

    AgentUI("never").on_event({"kind": "waiting_for_nodes", "have": 1, "need": 2, "timeout_s": 600,
                               "gone": "node h-b left: lost the coordinator"})
    err = capsys.readouterr().err
    assert ("node h-b left: lost the coordinator before the job started; waiting for 1 more node(s) "
            "(--nnodes needs 2), up to the join timeout (600 s from the start)") in err, err


def test_the_live_line_of_a_run_shows_the_job_as_this_node_knows_it() -> None:
    # It had only this node's workers: "ranks 1/1 running" for a job of two ranks at the start,
    # "ranks 0/2 running (1 failed)" with no word of the restart, no job, attempt or restarts
    # (acceptance 29C F3).
    import io
    import time

    from rich.console import Console

    from unicron.agent.ui import AgentUI
    from unicron.status.statusline import StatusLine

    ui = AgentUI("never")
    out = io.StringIO()
    ui._line = StatusLine(Console(file=out, width=200), "never")
    ui.job = {"id": "job7", "max_restarts": 3, "started_at": time.time() - 65}
    shown: list[str] = []
    ui._line._print_plain = shown.append  # what plain mode would print
    ui._line.mode = "auto"
    ui.update([{"rank": 0, "state": "running", "step": 12}], attempt=1, world_size=2, restarts=1)
    assert shown[-1].startswith("unicron: job7 running · attempt 1 · restarts 1/3 · ranks 1/2 running · step 12"), shown
    assert "up 1m" in shown[-1]
    ui.update([{"rank": 0, "state": "failed", "step": 12}], restarts=1)
    assert shown[-1].startswith("unicron: job7 restarting · restarts 1/3 · ranks 0/1 running (1 failed)"), shown
