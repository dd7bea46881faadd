"""The classifier table, row by row, on synthetic faults and on real failing processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicron.detect.classify import RULES, RULES_BY_NAME, classify, is_victim, root_cause
from unicron.detect.faults import DEFAULT_ACTION, Action, Classification, Fault, Severity

REPO = Path(__file__).resolve().parents[1]


def F(kind: str = "exit", **kw: object) -> Fault:
    base: dict[str, object] = {"ts": 100.0, "rank": 0, "node": "n0", "host": "h0", "steps_completed": 5}
    base.update(kw)
    return Fault(kind, **base)  # type: ignore[arg-type]


NCCL_REMOTE = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
    "remote process exited or there was a network error, NCCL version 2.19.3\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
)
NCCL_SYSTEM = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
    "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error."
)
NCCL_INVALID_USAGE = (  # as torch 2.x words it (NCCL 2.19-2.28): a launch that put two ranks on one GPU
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, invalid usage (run with "
    "NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: This usually reflects invalid usage of "
    "NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000"
)
GLOO_RESET = (
    "[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:61576. This is typically caused by a remote worker crashing."
)
DATALOADER_CHAIN = (
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3.11/multiprocessing/resource_sharer.py", line 138, in _serve\n'
    "ConnectionResetError: [Errno 104] Connection reset by peer\n\n"
    "During handling of the above exception, another exception occurred:\n\n"
    "Traceback (most recent call last):\n"
    '  File "train.py", line 30, in <module>\n'
    "RuntimeError: DataLoader worker (pid 7103) is killed by signal: Killed.\n"
)
XID_EVIDENCE = Fault("health", 105.0, node="n0", error_type="xid", message="Xid 79 on GPU 0", gpu=0)
OOM_EVIDENCE = Fault("health", 99.0, node="n0", error_type="oom_kill", message="kernel OOM killer killed 1 process(es)")

# (rule expected, fault, health evidence): at least one row per rule of the table.
CASES: list[tuple[str, Fault, tuple[Fault, ...]]] = [
    ("clean-exit", F(exitcode=0), ()),
    ("startup-failed", F("startup", message="[Errno 2] No such file or directory: 'trainx'"), ()),
    ("node-lost", F("node_lost", rank=None, node="n1"), ()),
    ("health-xid-hardware", F("health", rank=None, error_type="xid", message="Xid 79 on GPU 3", gpu=3), ()),
    ("health-xid-hardware", F("health", rank=None, error_type="xid", message="NVRM: Xid (PCI:0000:3b:00): 48, pid=9"), ()),
    ("health-ecc-uncorrectable", F("health", rank=None, error_type="ecc_uncorrectable", message="2 new", gpu=1), ()),
    ("health-gpu-lost", F("health", rank=None, error_type="gpu_lost", message="GPU 2 gone", gpu=2), ()),
    ("health-xid-other", F("health", rank=None, error_type="xid", message="Xid 13 on GPU 0", gpu=0), ()),
    ("health-xid-other", F("health", rank=None, error_type="xid", message="Xid 999 on GPU 0", gpu=0), ()),
    ("health-oom-kill", F("health", rank=None, error_type="oom_kill", message="1 killed"), ()),
    ("health-memory-pressure", F("health", rank=None, error_type="memory_pressure", message="97%"), ()),
    ("health-throttle", F("health", rank=None, error_type="gpu_throttle", message="hw_slowdown", gpu=0), ()),
    ("health-other", F("health", rank=None, error_type="fan_failure", message="fan 2"), ()),
    ("hang", F("hang", rank=None, message="no step for 9s", culprit_ranks=(1,)), ()),
    ("user-import-error", F("exception", error_type="ModuleNotFoundError", message="No module named 'x'",
                            steps_completed=0), ()),
    ("user-import-error", F(exitcode=1, steps_completed=0,
                            stderr_tail="Traceback...\n[rank3]: ImportError: cannot import name 'y' from 'z'\n"), ()),
    ("user-syntax-error", F("exception", error_type="IndentationError", message="unexpected indent",
                            steps_completed=0), ()),
    ("user-name-error", F("exception", error_type="builtins.NameError", message="name 'lr' is not defined",
                          steps_completed=0), ()),
    ("user-missing-script", F(exitcode=2, steps_completed=0,
                              stderr_tail="python: can't open file '/x/train.py': [Errno 2] No such file or directory"), ()),
    ("user-usage-error", F(exitcode=2, steps_completed=0,
                           stderr_tail="usage: train.py [-h] --lr LR\ntrain.py: error: the following arguments are required: --lr"), ()),
    ("user-usage-error", F("exception", error_type="SystemExit", message="2", steps_completed=0,
                           stderr_tail="usage: t.py [-h]\nt.py: error: unrecognized arguments: --x"), ()),
    ("gpu-xid", F(exitcode=1, stderr_tail="RuntimeError: CUDA error: unknown error\nNVRM: Xid (PCI:0000:3b:00): 79"), ()),
    ("gpu-ecc", F("exception", error_type="RuntimeError", message="CUDA error: uncorrectable ECC error encountered"), ()),
    ("gpu-nvlink", F(exitcode=1, stderr_tail="NCCL WARN NVLink error detected on link 3 of GPU 1"), ()),
    ("gpu-lost", F(exitcode=1, stderr_tail="Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost."), ()),
    ("health-evidence-hardware", F(exitcode=-6), (XID_EVIDENCE,)),
    ("out-of-memory", F("exception", error_type="torch.OutOfMemoryError",
                        message="CUDA out of memory. Tried to allocate 2.00 GiB"), ()),
    ("out-of-memory", F("exception", error_type="MemoryError", message="", steps_completed=0), ()),
    ("out-of-memory", F("exception", error_type="RuntimeError", steps_completed=0,  # torch's CPU allocator
                        message="[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                "memory: you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"), ()),
    ("cuda-error", F("exception", error_type="RuntimeError",
                     message="CUDA error: an illegal memory access was encountered"), ()),
    ("cuda-error", F(exitcode=-6, stderr_tail="terminate called...\n  what():  CUDA error: unspecified launch failure"), ()),
    ("cuda-script-error", F(exitcode=-6, stderr_tail="terminate called...\n  what():  CUDA error: device-side assert triggered"), ()),
    ("cuda-script-error", F("exception", error_type="torch.AcceleratorError",
                            message="CUDA error: no kernel image is available for execution on the device"), ()),
    ("nccl-remote", F(exitcode=1, stderr_tail=NCCL_REMOTE), ()),
    ("nccl-error", F(exitcode=1, stderr_tail=NCCL_SYSTEM), ()),
    ("nccl-error", F(exitcode=1, stderr_tail=NCCL_INVALID_USAGE.replace("Duplicate GPU", "Other")), ()),
    ("user-gpu-shared", F("exception", error_type="torch.distributed.DistBackendError", steps_completed=0,
                          message=NCCL_INVALID_USAGE), ()),
    ("user-gpu-shared", F(exitcode=1, steps_completed=12, stderr_tail=NCCL_INVALID_USAGE), ()),
    ("collective-timeout", F(exitcode=-6, stderr_tail="[Rank 0] Watchdog caught collective operation timeout: "
                                                      "WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds"), ()),
    ("collective-timeout", F(exitcode=1, stderr_tail="RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] "
                                                     "Timed out waiting 1800000ms for recv operation to complete"), ()),
    ("peer-connection-lost", F(exitcode=1, stderr_tail=GLOO_RESET), ()),
    ("peer-connection-lost", F("exception", error_type="ConnectionResetError", message="[Errno 104]"), ()),
    # Only the error that ended the process counts: a DataLoader worker killed mid-transfer
    # leaves a reset connection earlier in the chain, and the console closed by `| head` is a
    # broken pipe to no peer.
    ("uncaught-exception", F("exception", error_type="RuntimeError",
                             message="DataLoader worker (pid 7103) is killed by signal: Killed.",
                             traceback=DATALOADER_CHAIN), ()),
    ("uncaught-exception", F(exitcode=1, stderr_tail=DATALOADER_CHAIN), ()),
    ("uncaught-exception", F("exception", error_type="BrokenPipeError", message="[Errno 32] Broken pipe"), ()),
    ("oom-killer", F(exitcode=-9), (OOM_EVIDENCE,)),
    # its DataLoader worker was the OOM killer's victim (torch's message names no cause)
    ("loader-oom-killer", F("exception", error_type="RuntimeError",
                            message="DataLoader worker (pid(s) 3370) exited unexpectedly"), (OOM_EVIDENCE,)),
    ("loader-oom-killer", F("exception", error_type="RuntimeError",
                            message="DataLoader worker (pid 7103) is killed by signal: Killed.",
                            traceback=DATALOADER_CHAIN), (OOM_EVIDENCE,)),
    ("sigkill", F(exitcode=-9), ()),
    ("sigkill", F(exitcode=137), ()),
    # the agent's own kill of a rank frozen past its end (unicron.agent.frozen) says so in its message
    ("frozen", F(exitcode=-9, message="rank 1 (pid 7) froze after it destroyed its process group: ... stack kept, "
                 "killed with SIGKILL as frozen"), ()),
    ("agent-channel-broken", F(exitcode=-6, stderr_tail="Invalid argument (src/signaler.cpp:157)\n"), ()),
    ("connect-failed", F("exception", exitcode=None, error_type="RuntimeError",
                         message="Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
                                 "No route to host, remote=[10.1.2.2]:62352"), ()),
    ("crash-signal", F(exitcode=-11), ()),
    ("crash-signal", F(exitcode=139), ()),
    ("crash-signal", F(signal=7, exitcode=None), ()),
    ("terminated", F(exitcode=-15), ()),
    ("other-signal", F(exitcode=-10), ()),
    ("uncaught-exception", F("exception", error_type="ValueError", message="bad shape"), ()),
    ("uncaught-exception", F("exception", error_type="ModuleNotFoundError", message="late import", steps_completed=7), ()),
    ("user-error-unknown-progress", F("exception", error_type="ImportError", message="unknown progress",
                                      steps_completed=None), ()),
    ("user-error-unknown-progress", F(exitcode=1, steps_completed=None,
                                      stderr_tail="Traceback...\nNameError: name 'lr' is not defined\n"), ()),
    ("uncaught-exception", F("exception", error_type="ValueError", message="unknown progress", steps_completed=None), ()),
    # unicron.State refusals stop the job at any step; a script's own StateError does not.
    ("user-state-error", F("exception", error_type="unicron.worker.errors.StateError", steps_completed=40,
                           message="unicron.State.commit(1) after step 40: the step must not go back"), ()),
    ("user-state-error", F(exitcode=1, steps_completed=3, stderr_tail=(
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: unicron.worker.errors.SnapshotTypeError: unicron.State cannot snapshot extra['h'] of type ndarray")),
     ()),
    ("uncaught-exception", F("exception", error_type="mylib.StateError", message="lock held", steps_completed=4), ()),
    ("nonzero-exit", F(exitcode=3), ()),
    ("nonzero-exit", F(exitcode=2, steps_completed=0, stderr_tail="some other failure"), ()),
    ("sigkill", F(exitcode=-9, stderr_tail="NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/NVLink"), ()),
    ("sigkill", F(exitcode=-9, node="n5"), (OOM_EVIDENCE,)),  # evidence from another node
    ("crash-signal", F(exitcode=-6, ts=200.0), (XID_EVIDENCE,)),  # evidence outside the window
    ("unknown", F(exitcode=None), ()),
]


@pytest.mark.parametrize("rule,fault,evidence", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_table_row(rule: str, fault: Fault, evidence: tuple[Fault, ...]) -> None:
    c = classify(fault, evidence)
    assert c.rule == rule, c
    assert c.severity is RULES_BY_NAME[rule].severity
    assert c.action is DEFAULT_ACTION[c.severity]
    assert c.reason and "{" not in c.reason


def test_every_rule_has_a_case_and_a_documented_row() -> None:
    assert {r.name for r in RULES} == {case[0] for case in CASES}
    assert len(RULES_BY_NAME) == len(RULES), "rule names must be unique"
    doc = (REPO / "docs" / "failures.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", doc, re.MULTILINE))
    assert documented == {r.name for r in RULES}


def test_reason_names_the_place_and_the_error() -> None:
    c = classify(F("exception", rank=3, node="gpu-7", error_type="RuntimeError",
                   message="CUDA error: an illegal memory access was encountered"))
    assert "rank 3" in c.reason and "gpu-7" in c.reason and "illegal memory access" in c.reason


def test_user_error_in_user_code_file_not_found_is_not_fatal() -> None:
    tb = textwrap.dedent("""\
        Traceback (most recent call last):
          File "/work/main/unicron/worker/boot.py", line 40, in <module>
          File "/usr/lib/python3.11/runpy.py", line 291, in run_path
          File "/home/u/train.py", line 12, in <module>
            data = open("/data/shard0.bin", "rb")
        FileNotFoundError: [Errno 2] No such file or directory: '/data/shard0.bin'
        """)
    c = classify(F(exitcode=1, steps_completed=0, stderr_tail=tb))
    assert c.severity is Severity.SEV2 and c.rule == "uncaught-exception"
    # Without any traceback there is no evidence that it was the script itself.
    bare = classify(F("exception", error_type="FileNotFoundError", message="x", steps_completed=0))
    assert bare.rule == "uncaught-exception"


def test_quoted_source_lines_are_not_evidence() -> None:
    # The script's own code, quoted under a frame, mentions a CUDA error; the error is not one.
    tb = textwrap.dedent("""\
        Traceback (most recent call last):
          File "/home/u/train.py", line 30, in <module>
            check(batch)  # a bad label here used to be a device-side assert on GPU
            ^^^^^^^^^^^^
          File "/home/u/train.py", line 12, in check
            raise ValueError("labels out of range (would be CUDA error: device-side assert)")
        ValueError: labels out of range
        """)
    for fault in (F(exitcode=1, stderr_tail=tb), F("exception", error_type="ValueError",
                                                  message="labels out of range", traceback=tb)):
        assert classify(fault).rule == "uncaught-exception"
    # The same frames with the real error as the exception line still classify as CUDA.
    real = tb.replace("ValueError: labels out of range",
                      "RuntimeError: CUDA error: device-side assert triggered")
    assert classify(F(exitcode=1, stderr_tail="[rank1]: " + real.replace("\n", "\n[rank1]: "))).rule == "cuda-script-error"


# ---------------------------------------------------------------------------------------------
# Real processes: the failure happens, the classifier reads what the process really left behind.

SCRIPTS = {
    "import": ("import not_a_module_unicron_test\n", "user-import-error"),
    "syntax": ("def f(:\n    pass\n", "user-syntax-error"),
    "name": ("x = undefined_name_unicron + 1\n", "user-name-error"),
    "usage": ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\np.parse_args()\n",
              "user-usage-error"),
    "segv": ("import ctypes\nctypes.string_at(0)\n", "crash-signal"),
    "abort": ("import os\nos.abort()\n", "crash-signal"),
    "kill": ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "sigkill"),
    "memory": ("b = bytearray(1 << 62)\n", "out-of-memory"),
    "exit3": ("import sys\nsys.exit(3)\n", "nonzero-exit"),
    "value": ("raise ValueError('bad config value')\n", "uncaught-exception"),
}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONFAULTHANDLER": ""})


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_real_process_failures(name: str, tmp_path: Path) -> None:
    source, rule = SCRIPTS[name]
    script = tmp_path / "train.py"
    script.write_text(source)
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode != 0
    fault = Fault("exit", time.time(), rank=0, exitcode=proc.returncode, stderr_tail=proc.stderr[-8192:],
                  steps_completed=0)
    assert classify(fault).rule == rule, (proc.returncode, proc.stderr)


def test_real_missing_script_plain_and_through_a_boot_module(tmp_path: Path) -> None:
    proc = _run([sys.executable, str(tmp_path / "missing.py")], tmp_path)
    fault = Fault("exit", 1.0, exitcode=proc.returncode, stderr_tail=proc.stderr, steps_completed=0)
    assert classify(fault).rule == "user-missing-script"
    # The worker boot module runs the script with runpy: only launcher frames in the traceback.
    boot = tmp_path / "unicron" / "worker" / "boot.py"
    boot.parent.mkdir(parents=True)
    boot.write_text("import runpy, sys\nrunpy.run_path(sys.argv[1], run_name='__main__')\n")
    proc = _run([sys.executable, str(boot), str(tmp_path / "missing.py")], tmp_path)
    fault = Fault("exit", 1.0, exitcode=proc.returncode, stderr_tail=proc.stderr, steps_completed=0)
    c = classify(fault)
    assert (c.rule, c.severity) == ("user-missing-script", Severity.FATAL), proc.stderr
    # The same script missing after steps completed is not a startup error.
    assert classify(Fault("exit", 1.0, exitcode=1, stderr_tail=proc.stderr, steps_completed=3)).severity is Severity.SEV2


GLOO_CHILD = textwrap.dedent("""\
    import os, sys, time
    import torch, torch.distributed as dist
    rank, port_file = int(sys.argv[1]), sys.argv[2]
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        with open(port_file + ".tmp", "w") as fh:
            fh.write(str(store.port))
        os.rename(port_file + ".tmp", port_file)
    else:
        deadline = time.monotonic() + 90
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                sys.exit("no port file")
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int(open(port_file).read()), 2, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), 9)  # a real crash of rank 1 in the middle of training
    dist.all_reduce(t)
    """)


def test_real_gloo_victim_is_sev3_and_root_cause_is_the_killed_rank(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(GLOO_CHILD)
    port_file = str(tmp_path / "port")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port_file], stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        errs = [p.communicate(timeout=100)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -signal.SIGKILL, errs[1]
    assert procs[0].returncode == 1, errs[0]
    # The victim's fault is reported (even timestamped) before the killed rank's exit is seen.
    victim = Fault("exit", 10.0, rank=0, node="n0", exitcode=1, stderr_tail=errs[0][-8192:], steps_completed=1)
    killed = Fault("exit", 10.2, rank=1, node="n0", exitcode=procs[1].returncode, steps_completed=1)
    cv, ck = classify(victim), classify(killed)
    assert (cv.rule, cv.severity, cv.action) == ("peer-connection-lost", Severity.SEV3, Action.REATTEMPT), errs[0]
    assert is_victim(victim, cv) and not is_victim(killed, ck)
    assert root_cause([victim, killed]) == killed
    assert root_cause([killed, victim]) == killed


# ---------------------------------------------------------------------------------------------
# root_cause


def test_root_cause_earliest_cause_wins() -> None:
    a = F("exception", rank=2, ts=5.0, error_type="RuntimeError", message="CUDA error: illegal memory access")
    b = F(rank=1, ts=4.0, exitcode=-11)
    assert root_cause([a, b]) == b


def test_root_cause_ignores_clean_exits_and_health_notes() -> None:
    done = F(rank=0, ts=1.0, exitcode=0)
    note = F("health", rank=None, ts=0.5, error_type="memory_pressure", message="96%")
    crash = F(rank=1, ts=3.0, exitcode=-11)
    assert root_cause([done, note, crash]) == crash
    assert root_cause([done]) == done


def test_root_cause_hang_culprit_beats_blocked_ranks() -> None:
    blocked = [F("hang", rank=r, ts=1.0, culprit_ranks=(2,)) for r in (0, 1, 3)]
    culprit = F("hang", rank=2, ts=1.5, culprit_ranks=(2,))
    assert root_cause([*blocked, culprit]) == culprit


def test_root_cause_of_a_hang_without_culprit_is_the_node_that_went_silent() -> None:
    """The answering ranks all wait in a collective; the ranks they wait for are on a node that
    stopped answering. The hang is seen first (its threshold is shorter) but is the victim."""
    hang = F("hang", rank=None, node="a", ts=1.5)
    lost = F("node_lost", rank=None, node="b", ts=3.0)
    assert root_cause([hang, lost]) == lost
    named = F("hang", rank=None, node="a", ts=1.5, culprit_ranks=(0,))  # a culprit that answered
    assert root_cause([named, lost]) == named
    assert root_cause([hang]) == hang


def test_root_cause_same_time_prefers_worse_severity_then_lower_rank() -> None:
    lost = F("node_lost", rank=None, node="n1", ts=2.0)
    crash = F(rank=1, ts=2.0, exitcode=-11)
    assert root_cause([crash, lost]) == lost
    r3, r1 = F(rank=3, ts=2.0, exitcode=-11), F(rank=1, ts=2.0, exitcode=-11)
    assert root_cause([r3, r1]) == r1


def test_root_cause_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        root_cause([])


# ---------------------------------------------------------------------------------------------
# Value types


faults = st.builds(
    Fault,
    kind=st.sampled_from(["exit", "exception", "hang", "node_lost", "health", "startup"]),
    ts=st.floats(min_value=0, max_value=2e9, allow_nan=False),
    rank=st.none() | st.integers(0, 4096),
    node=st.text(max_size=10),
    exitcode=st.none() | st.integers(-64, 255),
    signal=st.none() | st.integers(1, 64),
    error_type=st.text(max_size=20),
    message=st.text(max_size=60),
    traceback=st.text(max_size=60),
    stderr_tail=st.text(max_size=60),
    steps_completed=st.none() | st.integers(0, 10**6),
    attempt=st.integers(0, 100),
    gpu=st.none() | st.integers(0, 15),
    culprit_ranks=st.lists(st.integers(0, 64), max_size=4).map(tuple),
)


@given(faults)
def test_fault_json_round_trip_and_classify_total(fault: Fault) -> None:
    assert Fault.from_dict(json.loads(json.dumps(fault.to_dict()))) == fault
    c = classify(fault)
    assert c.rule in RULES_BY_NAME
    assert Classification.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("bad,word", [
    ({"ts": 1.0}, "kind"),
    ({"kind": "exit"}, "ts"),
    ({"kind": "explode", "ts": 1.0}, "explode"),
    ({"kind": "exit", "ts": "soon"}, "ts"),
    ({"kind": "exit", "ts": 1.0, "rank": "zero"}, "rank"),
    ({"kind": "exit", "ts": 1.0, "extra": 1}, "extra"),
    ({"kind": "exit", "ts": 1.0, "culprit_ranks": [True]}, "culprit_ranks"),
    ([], "object"),
])
def test_fault_from_bad_dict_names_the_field(bad: object, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        Fault.from_dict(bad)  # type: ignore[arg-type]


def test_severity_and_action_orders() -> None:
    order = [Severity.INFO, Severity.SEV3, Severity.SEV2, Severity.SEV1, Severity.FATAL]
    assert [s.order for s in order] == sorted(s.order for s in order)
    assert [DEFAULT_ACTION[s] for s in order] == [Action.NONE, Action.REATTEMPT, Action.RESTART,
                                                    Action.RECONFIGURE, Action.STOP]


def test_a_node_that_left_is_described_by_its_reason_not_as_silent() -> None:
    lost = classify(F("node_lost", rank=None, node="n1", message="no heartbeat for 3.2 s"), [])
    left = classify(F("node_lost", rank=None, node="n1", message="left: interrupted by SIGTERM"), [])
    assert lost.rule == left.rule == "node-lost"
    assert lost.reason == "node n1 stopped answering heartbeats"
    assert left.reason == "node n1 left: interrupted by SIGTERM"


def test_a_process_ended_by_a_cxx_exception_is_described_by_its_message() -> None:
    # NCCL's watchdog met a device-side assert first: std::terminate, SIGABRT, stack frames last.
    tail = ("terminate called after throwing an instance of 'c10::DistBackendError'\n"
            "  what():  [PG ID 0 Rank 0] Process group watchdog thread terminated with exception: "
            "CUDA error: device-side assert triggered\n"
            "Exception raised from run at ProcessGroupNCCL.cpp:2125 (most recent call first):\n"
            "frame #4: <unknown function> + 0x129ecc (0x7f0194129ecc in /lib/x86_64-linux-gnu/libc.so.6)\n")
    c = classify(Fault(kind="exit", ts=1.0, rank=0, exitcode=-6, stderr_tail=tail), ())
    assert c.rule == "cuda-script-error"
    assert "watchdog thread terminated with exception: CUDA error: device-side assert triggered" in c.reason
    assert "frame #" not in c.reason


def test_where_names_the_rank_a_hang_blames_or_the_node() -> None:
    assert Fault("exit", 1.0, rank=3, host="h").where() == "rank 3 on h"
    # The culprit of a hang may run on another node than the one that reported it: no host.
    assert Fault("hang", 1.0, host="h", culprit_ranks=(1,)).where() == "rank 1"
    assert Fault("hang", 1.0, host="h", culprit_ranks=(0, 1)).where() == "the job"
    assert Fault("node_lost", 1.0, host="h").where() == "node h"
    assert Fault("health", 1.0, host="h", gpu=2).where() == "GPU 2 on h"
    assert Fault("hang", 1.0).where() == "the job"
    assert Fault("exit", 1.0).where() == "the job"


def test_a_rank_killed_by_a_signal_is_no_victim_of_an_old_connection_reset_in_its_stderr() -> None:
    """A background uploader thread's connection was reset 20 steps before the OOM killer
    SIGKILLed the rank: the kill is the cause. A lost peer ends a rank with an exception, an
    exit code or SIGABRT (a C++ exception that escapes), never SIGKILL or SIGSEGV."""
    tail = ("Exception in thread uploader:\nTraceback (most recent call last):\n"
            "  File \"train.py\", line 20, in run\n"
            "ConnectionResetError: [Errno 104] Connection reset by peer\n")
    for sig, rule in ((9, "sigkill"), (11, "crash-signal")):
        c = classify(Fault(kind="exit", ts=1.0, rank=1, exitcode=-sig, signal=sig, stderr_tail=tail), ())
        assert c.rule == rule and c.severity is Severity.SEV2, (sig, c)
    aborted = classify(Fault(kind="exit", ts=1.0, rank=1, exitcode=-6, signal=6, stderr_tail=tail), ())
    assert aborted.rule == "peer-connection-lost"
    raised = classify(Fault(kind="exception", ts=1.0, rank=1, error_type="RuntimeError",
                            message="Connection reset by peer"), ())
    assert raised.rule == "peer-connection-lost"


def test_a_libzmq_assertion_names_the_broken_agent_channel_and_no_inject() -> None:
    """A script that closes every inherited descriptor (os.closerange(3, N)) closes the worker's
    channel to its agent under libzmq, which aborts."""
    for tail in ("Invalid argument (src/signaler.cpp:157)\n",
                 "Assertion failed: pfd.revents & POLLIN (src/signaler.cpp:238)\n"):
        c = classify(Fault(kind="exit", ts=1.0, rank=1, exitcode=-6, signal=6, stderr_tail=tail), ())
        assert c.rule == "agent-channel-broken" and "--no-inject" in c.reason and "src/signaler.cpp" in c.reason, c


def test_a_web_clients_unreachable_network_is_the_scripts_failure_not_its_machines() -> None:
    """wandb.init on a rank whose route to the service is down: not connect-failed (which may
    leave the node out of the job), the rank's own exception."""
    for errno in ("[Errno 101] Network is unreachable", "[Errno 113] No route to host"):
        c = classify(Fault(kind="exception", ts=1.0, rank=2, error_type="ConnectionError",
                           message="HTTPSConnectionPool(host='api.wandb.ai', port=443): Max retries exceeded with url: "
                                   "/graphql (Caused by NewConnectionError('<urllib3.connection.HTTPSConnection object>: "
                                   f"Failed to establish a new connection: {errno}'))"), ())
        assert c.rule == "uncaught-exception", c
    gloo = classify(Fault(kind="exception", ts=1.0, rank=2, error_type="DistBackendError",
                          message="Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:144] no error"), ())
    assert gloo.rule == "connect-failed"


@pytest.mark.parametrize("error_type, message, traceback", [
    ("ConnectionError", "HTTPSConnectionPool(host='api.wandb.ai', port=443): Max retries exceeded with url: "
     "/graphql (Caused by ProtocolError('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer')))",
     '  File "/site-packages/requests/adapters.py", line 682, in send\n'),
    ("ConnectionResetError", "[Errno 104] Connection reset by peer",  # http.client under urllib
     '  File "/usr/lib/python3.11/http/client.py", line 1395, in getresponse\n'),
    ("EndpointConnectionError", 'Could not connect to the endpoint URL: "https://bucket.s3.amazonaws.com/ckpt"',
     '  File "/site-packages/botocore/httpsession.py", line 493, in send\n'),
])
def test_a_web_clients_reset_is_the_ranks_own_failure_not_a_lost_peer(error_type: str, message: str,
                                                                        traceback: str) -> None:
    """The script failed talking to a service (a metrics logger, object storage): the rank's own
    exception (SEV2, the root cause), not a victim of a peer that went away."""
    c = classify(Fault(kind="exception", ts=1.0, rank=0, error_type=error_type, message=message,
                       traceback="Traceback (most recent call last):\n" + traceback), ())
    assert c.rule == "uncaught-exception" and c.severity is Severity.SEV2, c
    # The same reset out of gloo is a lost peer, even when a web client had warned earlier in stderr.
    gloo = classify(Fault(kind="exception", ts=1.0, rank=0, error_type="DistBackendError",
                          message="[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
                          traceback='  File "/site-packages/torch/distributed/distributed_c10d.py", line 2806\n',
                          stderr_tail="WARNING urllib3.connectionpool: Retrying after connection broken\n"), ())
    assert gloo.rule == "peer-connection-lost", gloo


def test_a_kill_that_unicron_injected_is_said_to_be_so() -> None:
    """Acceptance 28C F3: every --inject kill (README's first command) was said to come "from
    outside, or by the kernel OOM killer", and sent users looking for an OOM."""
    from unicron.worker.inject import INJECTED_KILL

    injected = classify(F(exitcode=-9, rank=1, stderr_tail=f"step 14\n{INJECTED_KILL}\n"), [])
    assert injected.rule == "sigkill" and injected.reason.endswith("was killed by SIGKILL (injected by unicron)")
    other = classify(F(exitcode=-9, rank=1, stderr_tail="step 14\n"), [])
    assert other.reason.endswith("(from outside, or by the kernel OOM killer)")


# ---------------------------------------------------------------------------------------------
# A mention is not a fault: acceptance 33A F1/F2. A rank's stderr holds its own log lines too;
# the text rules match what the failing component prints, not any line that names the thing.

PREFLIGHT = "preflight: ECC errors: 0, NVLink links down: 0\n"


@pytest.mark.parametrize("tail", [
    PREFLIGHT + "bad batch, giving up\n",
    "gpu check: Xid events since boot: none\nbad batch, giving up\n",
    "checked: no GPU is lost: 0 of 8, uncorrectable ECC errors: 0\nbad batch\n",
    "NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/NVLink\nNVLink status: 12 links, errors 0\nbad batch\n",
    "health: no CUDA errors, no NCCL errors, no cuDNN errors since the last step\nbad batch\n",
    # an optional helper it ran was missing; the script went on and failed later, for another reason
    "/usr/bin/python3: can't open file '/w/optional_prefetch.py': [Errno 2] No such file or directory\n"
    "dataset server not ready yet, exiting for a retry\n",
    # an earlier log line about an OOM it recovered from, and a subprocess's usage error
    "step 0: caught torch.OutOfMemoryError, retrying with batch 16 (CUDA out of memory was avoided)\n"
    "usage: tool [-h]\ntool: error: unrecognized arguments: --x\nloader: giving up\n",
])
@pytest.mark.parametrize("exitcode", [1, 2])
def test_a_line_that_mentions_a_fault_is_not_one(tail: str, exitcode: int) -> None:
    for steps in (0, 4, None):
        c = classify(F(exitcode=exitcode, rank=1, steps_completed=steps, stderr_tail=tail))
        assert (c.rule, c.severity) == ("nonzero-exit", Severity.SEV2), (steps, c)


def test_the_real_reports_are_still_faults() -> None:
    """What the kernel, CUDA, NVML, NCCL, CPython and argparse print, after a script's own
    harmless lines, still classifies as before."""
    real = {
        "gpu-xid": "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "gpu-ecc": "terminate called after throwing an instance of 'c10::Error'\n"
                   "  what():  CUDA error: uncorrectable ECC error encountered",
        "gpu-nvlink": "RuntimeError: CUDA error: uncorrectable NVLink error was detected during the execution",
        "gpu-lost": "Unable to determine the device handle for GPU 0000:3B:00.0: GPU is lost.  Reboot the system "
                    "to recover this GPU",
        "out-of-memory": "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc",
    }
    for rule, text in real.items():
        c = classify(F(exitcode=1 if rule != "out-of-memory" else -6, stderr_tail=PREFLIGHT + text))
        assert c.rule == rule, (rule, c)
    missing = "python: can't open file '/x/train.py': [Errno 2] No such file or directory\n"
    assert classify(F(exitcode=2, steps_completed=0, stderr_tail="starting\n" + missing)).rule == "user-missing-script"
    click = "Usage: train.py [OPTIONS]\nTry 'train.py --help' for help.\n\nError: No such option: --lr\n"
    assert classify(F(exitcode=2, steps_completed=0, stderr_tail=click)).rule == "user-usage-error"


@pytest.mark.timeout(60)
def test_real_health_line_and_missing_helper_then_exit_1_is_an_ordinary_exit(tmp_path: Path) -> None:
    """33A's scripts, for real: a preflight line naming ECC and NVLink, an optional helper run
    with python that is missing, then ``sys.exit(1)`` and ``os._exit(1)``: restarted (SEV2), not
    a node left out (SEV1) nor a FATAL "the training script cannot be opened"."""
    for ending in ("sys.exit(1)", "os._exit(1)"):
        script = tmp_path / "train.py"
        script.write_text(textwrap.dedent(f"""\
            import os, subprocess, sys
            print({PREFLIGHT.strip()!r}, file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "optional_prefetch.py"])
            print("dataset server not ready yet, exiting for a retry", file=sys.stderr, flush=True)
            {ending}
            """))
        proc = _run([sys.executable, str(script)], tmp_path)
        assert proc.returncode == 1 and "can't open file" in proc.stderr, proc.stderr
        for steps in (0, 4):
            fault = Fault("exit", time.time(), rank=1, exitcode=1, stderr_tail=proc.stderr, steps_completed=steps)
            c = classify(fault)
            assert (c.rule, c.severity) == ("nonzero-exit", Severity.SEV2), (ending, steps, c)


@pytest.mark.timeout(60)
def test_real_missing_script_through_unicrons_worker_boot(tmp_path: Path) -> None:
    """unicron's worker boot says so in its own words (exit 2), after any line a wrapper printed."""
    proc = _run([sys.executable, "-m", "unicron.worker.boot", str(tmp_path / "missing.py")], REPO)
    assert proc.returncode == 2 and "unicron worker: can't open file" in proc.stderr, proc.stderr
    for before in ("", "starting training\n"):
        fault = Fault("exit", 1.0, rank=0, exitcode=2, stderr_tail=before + proc.stderr, steps_completed=0)
        assert classify(fault).rule == "user-missing-script", proc.stderr


# A rank's own connection to a port nobody listens on (its redis, down): not a peer's.
REFUSED_SCRIPT = textwrap.dedent("""\
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    socket.create_connection(("127.0.0.1", port), timeout=5)
    """)


@pytest.mark.timeout(60)
def test_a_refused_connection_is_a_lost_peer_only_out_of_torch_distributed(tmp_path: Path) -> None:
    """Acceptance 33A F4: a rank's own socket to a service that is down (a feature store) was
    "lost its connection to a peer" (SEV3, a victim). Real: a connection to a port nobody listens on."""
    script = tmp_path / "train.py"
    script.write_text(REFUSED_SCRIPT)
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode == 1 and "ConnectionRefusedError" in proc.stderr, proc.stderr
    tb = proc.stderr[:proc.stderr.index("ConnectionRefusedError")]
    own = [Fault("exit", 1.0, rank=1, exitcode=1, stderr_tail=proc.stderr, steps_completed=4),
           Fault("exception", 1.0, rank=1, error_type="ConnectionRefusedError", message="[Errno 111] Connection refused",
                 traceback=tb, steps_completed=4)]
    for fault in own:
        c = classify(fault)
        assert (c.rule, c.severity) == ("uncaught-exception", Severity.SEV2) and not is_victim(fault, c), c
    # The same refusal out of torch.distributed (the store, gloo's pair) is a peer's loss.
    store = [
        F("exception", error_type="torch.distributed.DistNetworkError", message="The client socket has failed to "
          "connect to [localhost]:41234 (errno: 111 - Connection refused)."),
        F("exception", error_type="ConnectionRefusedError", message="[Errno 111] Connection refused",
          traceback='  File "/site-packages/torch/distributed/rendezvous.py", line 189, in _create_c10d_store\n'),
        F(exitcode=1, stderr_tail="[W socket.cpp:464] [c10d] The client socket has failed to connect to "
          "[localhost]:41234 (errno: 111 - Connection refused).\n"),
        F(exitcode=1, stderr_tail="RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
          "connect [127.0.0.1]:41234: Connection refused"),
    ]
    for fault in store:
        assert classify(fault).rule == "peer-connection-lost", fault


@pytest.mark.timeout(60)
def test_a_traceback_the_script_caught_and_printed_is_not_what_ended_it(tmp_path: Path) -> None:
    """Acceptance 34A F1: an optional import's ModuleNotFoundError, caught and printed with
    ``traceback.print_exc()``, then a ``sys.exit(1)`` for another reason before the first step,
    was FATAL "failed to import". Real: the traceback ends the stderr only when it ended the rank."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import sys, traceback
        try:
            import apex_fused_adam_optional_34a
        except ImportError:
            traceback.print_exc(); print("optional feature unavailable, continuing", file=sys.stderr)
        if sys.argv[1:] == ["raise"]:
            import missing_for_real_34a
        print("dataset server not ready yet, exiting for a retry", file=sys.stderr)
        sys.exit(1)
        """))
    proc = _run([sys.executable, str(script)], tmp_path)
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr, proc.stderr
    for steps in (0, None):
        c = classify(Fault("exit", 1.0, rank=1, exitcode=1, stderr_tail=proc.stderr, traceback=proc.stderr,
                           steps_completed=steps))
        assert (c.rule, c.severity) == ("nonzero-exit", Severity.SEV2), (steps, c)
    # The import that did end it is still a user error, in a chain and before teardown warnings too.
    proc = _run([sys.executable, str(script), "raise"], tmp_path)
    assert proc.returncode == 1 and "missing_for_real_34a" in proc.stderr, proc.stderr
    for tail in (proc.stderr, "[rank1]: " + proc.stderr.replace("\n", "\n[rank1]: "),
                 DATALOADER_CHAIN.replace("RuntimeError: DataLoader", "ImportError: DataLoader"),
                 proc.stderr + "unicron: snapshot write failed\nsys:1: ResourceWarning: unclosed file\n",
                 # 35A F5: an atexit warning, as the warnings module prints it, with its source line
                 proc.stderr + "/w/train.py:15: UserWarning: teardown thing\n  warnings.warn('teardown thing')\n"):
        c = classify(Fault("exit", 1.0, rank=1, exitcode=1, stderr_tail=tail, steps_completed=0))
        assert c.rule == "user-import-error", (tail, c)


@pytest.mark.timeout(60)
def test_an_out_of_memory_log_line_is_not_an_out_of_memory(tmp_path: Path) -> None:
    """Acceptance 34A F2: a rank that logged ``OutOfMemoryError: retrying with smaller batch`` (or
    caught and printed a real OOM traceback) and later exited 1, or whose last line was a log
    line ``warning: CUDA out of memory on previous try``, was "ran out of memory" (which the
    policy's oom_fatal_after counts). Real processes; a real OOM that ended the rank still is."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import sys, traceback
        class OutOfMemoryError(RuntimeError):
            pass
        def oom():
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        how = sys.argv[1]
        if how == "log":
            print("OutOfMemoryError: retrying with smaller batch", file=sys.stderr)
            print("carrying on, then a transient failure", file=sys.stderr)
        if how == "warning":
            print("warning: CUDA out of memory on previous try, halving batch", file=sys.stderr)
        if how == "log-last":  # 35A F4: the log line is the last one
            print("OutOfMemoryError: retrying with smaller batch", file=sys.stderr)
        if how in ("caught", "caught-then-raise"):
            try:
                oom()
            except OutOfMemoryError:
                traceback.print_exc(); print("retrying with batch 16", file=sys.stderr)
        if how == "caught-then-raise":
            raise ValueError("bad label 7")
        if how == "real":
            oom()
        if how == "chained":
            try:
                oom()
            except OutOfMemoryError as e:
                raise RuntimeError("training step failed") from e
        sys.exit(1)
        """))
    for how, rule in (("log", "nonzero-exit"), ("log-last", "nonzero-exit"), ("warning", "nonzero-exit"),
                      ("caught", "nonzero-exit"),
                      ("caught-then-raise", "uncaught-exception"), ("real", "out-of-memory"),
                      ("chained", "out-of-memory")):
        proc = _run([sys.executable, str(script), how], tmp_path)
        assert proc.returncode == 1, proc.stderr
        fault = Fault("exit", 1.0, rank=1, exitcode=1, stderr_tail=proc.stderr, traceback=proc.stderr, steps_completed=3)
        assert classify(fault).rule == rule, (how, proc.stderr)


@pytest.mark.timeout(60)
def test_a_refused_connection_from_a_script_in_a_directory_named_nccl_is_the_scripts_own(tmp_path: Path) -> None:
    """Acceptance 34A F3: the same refused connection as above, from ``nccl_experiments/train.py``,
    was "lost its connection to a peer" (SEV3): any frame's path that said nccl, gloo or c10d
    counted. Only torch.distributed's own frames do."""
    # 35A F2: a script whose main is wrapped in torch's @record has that wrapper's frame (under
    # torch/distributed/elastic/) in every traceback; and a script under proj/torch/distributed/
    recorded = ("from torch.distributed.elastic.multiprocessing.errors import record\n@record\ndef main():\n"
                + "".join("    " + line + "\n" for line in REFUSED_SCRIPT.splitlines()) + "main()\n")
    for folder, text in (("nccl_experiments", REFUSED_SCRIPT), ("gloo_c10d_tests/torch_distributed", REFUSED_SCRIPT),
                         ("proj/torch/distributed", REFUSED_SCRIPT), ("recorded", recorded)):
        script = tmp_path / folder / "train.py"
        script.parent.mkdir(parents=True)
        script.write_text(text)
        proc = _run([sys.executable, str(script)], tmp_path)
        assert proc.returncode == 1 and "ConnectionRefusedError" in proc.stderr, proc.stderr
        tb = proc.stderr[:proc.stderr.index("ConnectionRefusedError")]
        for fault in (Fault("exit", 1.0, rank=1, exitcode=1, stderr_tail=proc.stderr, traceback=proc.stderr,
                            steps_completed=4),
                      Fault("exception", 1.0, rank=1, error_type="ConnectionRefusedError",
                            message="[Errno 111] Connection refused", traceback=tb, steps_completed=4)):
            c = classify(fault)
            assert (c.rule, c.severity) == ("uncaught-exception", Severity.SEV2), (folder, c)
        # Called through torch.distributed's own code, the same refusal is a peer's loss.
        torch_frame = '  File "/venv/lib/python3.11/site-packages/torch/distributed/rendezvous.py", line 189, in x\n'
        through = Fault("exception", 1.0, rank=1, error_type="ConnectionRefusedError",
                        message="[Errno 111] Connection refused", traceback=tb + torch_frame, steps_completed=4)
        assert classify(through).rule == "peer-connection-lost"


def test_python_m_of_a_missing_module_is_a_missing_script_whatever_the_steps_known() -> None:
    """Acceptance 35A F3: under --no-inject (steps unknown) ``-m missing_mod`` spent the whole
    restart budget; CPython's line says no code of the script ran."""
    for line in ("/venv/bin/python: No module named missing_mod_xyz",
                 "/usr/bin/python3.11: Error while finding module specification for 'pkg.sub' "
                 "(ModuleNotFoundError: No module named 'pkg')"):
        for steps in (0, None):
            c = classify(F(exitcode=1, rank=0, steps_completed=steps, stderr_tail=line + "\n"))
            assert (c.rule, c.severity) == ("user-missing-script", Severity.FATAL), (line, steps, c)
    # the script's own words, or after steps, or another code: not CPython's
    for tail, code, steps in (("loader: No module named plugins, giving up\n", 1, None),
                              ("/venv/bin/python: No module named missing_mod_xyz\n", 1, 5),
                              ("/venv/bin/python: No module named missing_mod_xyz\nretrying later\n", 1, None),
                              ("/venv/bin/python: No module named missing_mod_xyz\n", 3, None)):
        assert classify(F(exitcode=code, rank=0, steps_completed=steps, stderr_tail=tail)).rule != "user-missing-script"
