"""Every injected fault kind fires at the right step, on the right rank only (real processes)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers_worker import agent_socket, base_env, finish, wait_until, workers, write_script

from unicron.errors import UsageError
from unicron.worker.env import STACK_SIGNAL
from unicron.worker.inject import INJECTED_CUDA_ERROR, Fault, faults_at, format_inject_spec, parse_inject_spec

LOOP = """
    import sys
    import unicron

    for i in range(int(sys.argv[1])):
        unicron.step()
        print(f"done {i + 1}", flush=True)
"""


def test_parse_and_format() -> None:
    faults = parse_inject_spec(" kill@1:5 ; hang@0:2;exception@*:3;exit=7@2:4;exit@2:9;slow=0.25@1:0;slow@0:1; ")
    assert faults == [
        Fault("kill", 1, 5), Fault("hang", 0, 2), Fault("exception", None, 3), Fault("exit", 2, 4, 7),
        Fault("exit", 2, 9, 1), Fault("slow", 1, 0, 0.25), Fault("slow", 0, 1, 1.0),
    ]
    assert parse_inject_spec(format_inject_spec(faults)) == faults


@pytest.mark.parametrize(
    "bad", ["", ";", "kill", "kill@1", "kill@x:1", "kill@1:-1", "boom@1:1", "kill=3@1:1", "exit=256@0:1",
            "exit=-1@0:1", "slow=0@0:1", "slow=abc@0:1", "kill@1:2:3", "KILL@1:2"],
)
def test_bad_specs_are_usage_errors(bad: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_inject_spec(bad)
    assert "\n" not in str(err.value) and ("fault spec" in str(err.value))


def test_faults_at_picks_rank_and_step() -> None:
    faults = parse_inject_spec("slow=0.5@1:2;kill@1:4;exit@*:6")
    assert faults_at(faults, 0, 4) == []
    assert faults_at(faults, 1, 1) == []
    assert [f.kind for f in faults_at(faults, 1, 2)] == ["slow"]
    assert [f.kind for f in faults_at(faults, 1, 4)] == ["slow", "kill"]  # slow first: it returns
    assert [f.kind for f in faults_at(faults, 0, 6)] == ["exit"]


def _done_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("done")]


def _run_pair(tmp_path: Path, spec: str, steps: int = 6, **extra: str):
    """The loop script and the environments of ranks 0 and 1, both given the same spec."""
    script = write_script(tmp_path, "loop.py", LOOP)
    return script, {r: base_env(RANK=str(r), WORLD_SIZE="2", UNICRON_INJECT=spec, **extra) for r in (0, 1)}


@pytest.mark.parametrize("kind", ["kill", "exception", "exit=7"])
def test_terminal_fault_on_one_rank(tmp_path: Path, kind: str) -> None:
    script, envs = _run_pair(tmp_path, f"{kind}@1:3")
    with agent_socket() as agent, workers() as group:
        procs = {r: group.boot(script, "6", env={**e, "UNICRON_AGENT_ADDR": agent.addr}) for r, e in envs.items()}
        rc0, out0, _ = finish(procs[0])
        rc1, out1, err1 = finish(procs[1])
        agent.wait_for(lambda m: m["t"] == "bye" and m["rank"] == 0)
        if kind != "kill":  # a SIGKILL may take its last queued message with it
            agent.wait_for(lambda m: m["t"] == "step" and m["rank"] == 1 and m["step"] == 3)
    assert rc0 == 0 and len(_done_lines(out0)) == 6
    assert _done_lines(out1) == ["done 1", "done 2"]  # fired at the boundary after step 3
    assert [m["step"] for m in agent.of("step", 0)] == [1, 2, 3, 4, 5, 6]
    assert all(m["step"] <= 3 for m in agent.of("step", 1)) and not agent.of("bye", 1)
    # Each injected fault says so on the rank's stderr, where and what, before it happens (29C F12).
    announced = [line for line in err1.splitlines() if "injected fault on rank 1 after step 3: " in line]
    assert len(announced) == 1 and announced[0].startswith("unicron: "), err1
    if kind == "kill":
        assert rc1 == -signal.SIGKILL and not agent.of("exc", 1)
        assert announced[0].endswith("SIGKILL to itself (--inject kill)")
    elif kind == "exit=7":
        assert rc1 == 7 and err1.splitlines() == announced and not agent.of("exc", 1)
        assert announced[0].endswith("exits with code 7 (--inject exit)")
    else:
        assert rc1 == 1 and err1.rstrip().endswith(f"RuntimeError: {INJECTED_CUDA_ERROR}")
        assert "in fire" in err1  # the traceback shows it came from unicron's injector
        (exc,) = agent.of("exc", 1)
        assert exc["type"] == "RuntimeError" and exc["msg"] == INJECTED_CUDA_ERROR


def test_hang_blocks_in_python_and_stack_dump_shows_it(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    script, envs = _run_pair(tmp_path, "hang@1:3", UNICRON_STACK_DIR=str(stacks))
    with agent_socket() as agent, workers() as group:
        procs = {r: group.boot(script, "6", env={**e, "UNICRON_AGENT_ADDR": agent.addr}) for r, e in envs.items()}
        assert finish(procs[0])[0] == 0
        agent.wait_for(lambda m: m["t"] == "step" and m["rank"] == 1 and m["step"] == 3)
        dump = stacks / "rank1.txt"
        wait_until(dump.exists, 10, "rank 1 stack file")
        # Step 3 is reported just before the fault fires, so a signal sent as soon as it arrives may
        # catch the rank on its way into hang_forever: signal again until a dump shows it there.
        # The dump is written as it is read: its innermost line comes before the frames below it.
        deadline = time.monotonic() + 20
        while not all(part in dump.read_text() for part in ("hang_forever", "loop.py", "in step")):
            assert time.monotonic() < deadline, "timed out after 20s waiting for rank 1 stack dump"
            os.kill(procs[1].pid, STACK_SIGNAL)
            signalled = time.monotonic()
            while "hang_forever" not in dump.read_text() and time.monotonic() - signalled < 1:
                time.sleep(0.02)
        assert procs[1].poll() is None  # still hung, survived the dump
        agent.drain(0.2)
        assert max(m["step"] for m in agent.of("step", 1)) == 3
        text = dump.read_text()
    assert "unicron/worker/inject.py" in text and "loop.py" in text and "in step" in text


def test_slow_rank_sleeps_at_every_step_from_its_step(tmp_path: Path) -> None:
    script, envs = _run_pair(tmp_path, "slow=0.5@1:2")
    with agent_socket() as agent, workers() as group:
        procs = {r: group.boot(script, "4", env={**e, "UNICRON_AGENT_ADDR": agent.addr}) for r, e in envs.items()}
        assert finish(procs[0])[0] == 0 and finish(procs[1])[0] == 0
        agent.wait_for(lambda m: m["t"] == "bye" and m["rank"] == 1)
    ts = {m["step"]: m["ts"] for m in agent.of("step", 1)}
    assert sorted(ts) == [1, 2, 3, 4]
    assert ts[2] - ts[1] < 0.5  # nothing before step 2
    assert ts[3] - ts[2] >= 0.5 and ts[4] - ts[3] >= 0.5
    ts0 = [m["ts"] for m in agent.of("step", 0)]
    assert ts0[-1] - ts0[0] < 0.5  # rank 0 untouched


def test_step_zero_fires_before_the_script(tmp_path: Path) -> None:
    script, envs = _run_pair(tmp_path, "exit=5@0:0;exception@1:0")
    with agent_socket() as agent, workers() as group:
        procs = [group.boot(script, "3", env={**e, "UNICRON_AGENT_ADDR": agent.addr}) for e in envs.values()]
        (rc0, out0, err0), (rc1, out1, err1) = (finish(p) for p in procs)
        agent.wait_for(lambda m: m["t"] == "exc")
    assert (rc0, out0) == (5, "") and err0.endswith("injected fault on rank 0 before its first step: exits with code "
                                                  "5 (--inject exit)\n"), err0
    assert rc1 == 1 and out1 == "" and err1.rstrip().endswith(f"RuntimeError: {INJECTED_CUDA_ERROR}")
    assert [m["t"] for m in agent.messages if m["rank"] == 1] == ["hello", "exc"]
    assert not agent.of("exc", 0) and not agent.of("step")


def test_never_active_without_the_variable(tmp_path: Path) -> None:
    script = write_script(tmp_path, "loop.py", LOOP)
    with workers() as group:
        rc, out, _ = finish(group.boot(script, "3", env=base_env(RANK="1")))
    assert rc == 0 and len(_done_lines(out)) == 3
