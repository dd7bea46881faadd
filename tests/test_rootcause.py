"""Root cause of worker failures: error files written by torch's @record, stderr tails, ordering, report."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from unicron.agent.logs import LogSpec, RunLogDir, Std
from unicron.agent.procs import WorkerProcess, spawn, start_worker, wait_any
from unicron.agent.rootcause import (
    ErrorRecord,
    WorkerFailure,
    build_failure,
    describe_exit,
    failure_of,
    failure_time,
    format_root_cause,
    make_failure,
    order_failures,
    parse_error_file,
    read_error_file,
    read_tail,
    root_cause,
    signal_name,
    tail_lines,
)
from unicron.agent.terminate import terminate_all
from unicron.detect.faults import stderr_summary

PY = sys.executable


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    spawned: list[WorkerProcess] = []
    yield spawned
    terminate_all(spawned, grace_s=0.5)
    for worker in spawned:
        worker.close()


def wait_until(condition: Callable[[], object], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def failure(rank: int, ts: float, **kw) -> WorkerFailure:
    fields = dict(
        rank=rank, local_rank=rank, host="node-a", pid=1000 + rank, exitcode=1, signal_name=None, timestamp=ts
    )
    fields.update(kw)
    return WorkerFailure(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------- pure parts


def test_parse_error_file_in_record_format() -> None:
    text = json.dumps(
        {
            "message": {
                "message": "ValueError: boom",
                "extraInfo": {
                    "py_callstack": "Traceback (most recent call last):\n...\nValueError: boom\n",
                    "timestamp": "1700000000",
                },
            }
        }
    )
    record = parse_error_file(text)
    assert record is not None
    assert record.message == "ValueError: boom"
    assert record.traceback is not None and record.traceback.startswith("Traceback")
    assert record.timestamp == 1700000000.0


def test_parse_error_file_plain_string_and_garbage() -> None:
    record = parse_error_file('{"message": "segfault in kernel", "timestamp": 1700000001}')
    assert record == ErrorRecord("segfault in kernel", None, 1700000001.0, record.data if record else {})
    assert parse_error_file("") is None
    assert parse_error_file("{not json") is None
    assert parse_error_file('["message"]') is None
    assert parse_error_file('{"other": 1}') is None
    assert parse_error_file('{"message": 3}') is None
    # a record with odd extraInfo still gives its message
    odd = parse_error_file('{"message": {"message": "E", "extraInfo": "x"}}')
    assert odd is not None and odd.message == "E" and odd.traceback is None and odd.timestamp is None
    assert parse_error_file("[" * 100_000 + "]" * 100_000) is None  # deeper than json recurses: garbage too


def test_an_error_file_is_read_only_when_it_is_a_bounded_regular_file(tmp_path: Path) -> None:
    ok = tmp_path / "error.json"
    ok.write_text('{"message": "boom"}')
    text, mtime = read_error_file(str(ok))
    assert text == '{"message": "boom"}' and mtime == os.stat(ok).st_mtime
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a worker's doing: reading it would block the agent forever
    big = tmp_path / "big.json"
    big.write_text('{"message": "' + "Y" * 5000 + '"}')
    for path in (str(fifo), "/dev/zero", str(tmp_path), str(tmp_path / "missing.json")):
        assert read_error_file(path) == (None, None), path
    assert read_error_file(str(big), max_bytes=4096) == (None, None)


def test_signal_names_and_exit_descriptions() -> None:
    assert signal_name(-9) == "SIGKILL" and signal_name(-15) == "SIGTERM"
    assert signal_name(0) is None and signal_name(1) is None
    assert describe_exit(-11) == "signal SIGSEGV (11)"
    assert describe_exit(3) == "exit code 3"


def test_failure_time_refines_whole_seconds_with_mtime() -> None:
    record = ErrorRecord("E", None, 100.0)
    assert failure_time(record, 100.4, exited_at=105.0) == 100.4
    assert failure_time(record, 250.0, exited_at=105.0) == 100.0  # an mtime that disagrees is ignored
    assert failure_time(None, None, exited_at=105.0) == 105.0
    assert failure_time(ErrorRecord("E", None, None), 101.5, exited_at=105.0) == 101.5


def test_tail_lines() -> None:
    text = "".join(f"l{i}\n" for i in range(100))
    assert tail_lines(text, 3) == "l97\nl98\nl99"
    assert tail_lines("", 3) == ""
    assert tail_lines("a\nb", 0) == ""


def test_root_cause_is_the_earliest_then_lowest_rank() -> None:
    late = failure(0, 200.0)
    early = failure(3, 100.0)
    tie = failure(1, 100.0)
    assert root_cause([late, early, tie]) is tie
    assert order_failures([late, early, tie]) == [tie, early, late]
    with pytest.raises(ValueError):
        root_cause([])


def test_format_root_cause_puts_the_traceback_first() -> None:
    tb = 'Traceback (most recent call last):\n  File "train.py", line 3, in main\nValueError: boom\n'
    root = failure(2, 100.0, error=ErrorRecord("ValueError: boom", tb, 100.0), error_file="/l/2/error.json")
    killed = failure(0, 101.0, exitcode=-9, signal_name="SIGKILL")
    stderr_only = failure(1, 102.0, stderr_tail="Traceback ...\nRuntimeError: Connection closed by peer")
    text = format_root_cause([killed, stderr_only, root])
    lines = text.splitlines()
    assert lines[0].startswith(
        "Root cause: rank 2 (local_rank 2) on node-a failed with exit code 1, pid 1002"
    )
    assert "/l/2/error.json" in lines[1]
    assert lines[2:5] == [
        "  Traceback (most recent call last):",
        '    File "train.py", line 3, in main',
        "  ValueError: boom",
    ]
    assert lines[5] == "Other failed ranks (2):"
    assert lines[6] == "  rank 0 (local_rank 0) on node-a: signal SIGKILL (9), pid 1000"
    assert lines[7] == (
        "  rank 1 (local_rank 1) on node-a: exit code 1, pid 1001: RuntimeError: Connection closed by peer"
    )
    assert len(lines) == 8


def test_format_without_any_traceback_says_why() -> None:
    assert "killed by SIGKILL" in format_root_cause([failure(0, 1.0, exitcode=-9, signal_name="SIGKILL")])
    assert "record" in format_root_cause([failure(0, 1.0)])
    assert format_root_cause([]) == "no worker failed"


def test_make_failure_prefers_the_error_file_over_stderr() -> None:
    error = json.dumps(
        {"message": {"message": "KeyError: 'x'", "extraInfo": {"py_callstack": "TB", "timestamp": "50"}}}
    )
    made = make_failure(
        rank=4,
        local_rank=0,
        host="h",
        pid=9,
        exitcode=1,
        exited_at=60.0,
        error_text=error,
        error_file="/e.json",
        error_file_mtime=50.25,
        stderr_text="noise\nmore noise\n",
    )
    assert made.traceback == "TB" and made.summary == "KeyError: 'x'" and made.timestamp == 50.25
    no_file = make_failure(
        rank=4, local_rank=0, host="h", pid=9, exitcode=1, exited_at=60.0, stderr_text="noise\nlast words\n\n"
    )
    assert no_file.error is None and no_file.error_file is None
    assert no_file.traceback == "noise\nlast words" and no_file.summary == "last words"
    assert no_file.timestamp == 60.0


# What a rank killed by NCCL's watchdog leaves on stderr (torch 2.11 + CUDA 13 on an H200, a
# device-side assert the watchdog found first): the process ends in std::terminate, SIGABRT.
NCCL_WATCHDOG_ABORT = """\
[rank0]:[E1204 16:46:22.791] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: CUDA error: device-side assert triggered
Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

Exception raised from query at /pytorch/c10/cuda/CUDAEvent.h:111 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f018df7305d in libc10.so)
frame #4: c10d::ProcessGroupNCCL::Watchdog::runLoop() + 0x9c3 (0x7f00d99071d3 in libtorch_cuda.so)

terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: CUDA error: device-side assert triggered
Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
Exception raised from run at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2125 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f018df7305d in libc10.so)
frame #4: <unknown function> + 0x129ecc (0x7f0194129ecc in /lib/x86_64-linux-gnu/libc.so.6)
"""


def test_the_summary_of_a_crash_report_is_its_error_not_its_last_stack_frame() -> None:
    expected = ("[PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: "
                "CUDA error: device-side assert triggered")
    assert stderr_summary(NCCL_WATCHDOG_ABORT) == expected
    # the what() line cut off by the tail's limit: the last line that is not a frame or a hint
    head = NCCL_WATCHDOG_ABORT.split("terminate called")[0]
    assert stderr_summary(head).endswith("terminated with exception: CUDA error: device-side assert triggered")
    traceback = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    boom()\nKeyError: 1\n'
    assert stderr_summary(traceback) == "KeyError: 1"
    assert stderr_summary("frame #0: only frames\n") == "frame #0: only frames" and stderr_summary("") == ""
    # unicron's worker hooks' own warnings are not what the rank said as it died (acceptance 23B F4)
    shm = "unicron: snapshot write failed: OSError: [Errno 28] shared memory too small for a 10.5 MB snapshot\n"
    assert stderr_summary("step 12\n" + shm) == "step 12" and stderr_summary(shm) == ""
    assert stderr_summary(shm + "unicron worker: can't open file 'train.py': no such file\n").startswith("unicron worker:")


def test_read_tail_reads_only_the_end(tmp_path: Path) -> None:
    path = tmp_path / "stderr.log"
    path.write_text("".join(f"line {i}\n" for i in range(100000)))
    tail = read_tail(str(path), max_bytes=1000)
    assert tail.endswith("line 99999\n") and tail.startswith("line ") and len(tail) <= 1000
    assert read_tail(str(tmp_path / "missing")) == ""
    assert read_tail(None) == "" and read_tail(os.devnull) == ""


# ---------------------------------------------------------------- real workers

RECORDED = """
    import sys
    from torch.distributed.elastic.multiprocessing.errors import record

    def inner():
        raise ValueError("boom from the worker")

    @record
    def main():
        inner()

    main()
"""

UNRECORDED = """
    import sys
    print("about to fail", file=sys.stderr, flush=True)
    def load():
        raise RuntimeError("checkpoint missing: /nowhere/ckpt.pt")
    load()
"""


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_record_error_file_becomes_the_root_cause(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    script = write(tmp_path, "recorded.py", RECORDED)
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path / "logs")), "job")
    (plan,) = logdir.prepare_attempt(0, [(0, 3)])
    worker = start_worker([PY, script], {}, plan)
    workers.append(worker)
    assert wait_any([worker], 90) == [worker]
    assert worker.returncode == 1
    assert plan.error_file is not None and os.path.exists(plan.error_file)

    found = failure_of(worker, host="node-x")
    assert found.rank == 3 and found.local_rank == 0 and found.pid == worker.pid and found.exitcode == 1
    assert found.error is not None and found.error.message == "ValueError: boom from the worker"
    assert found.traceback is not None
    assert "Traceback (most recent call last)" in found.traceback and "in inner" in found.traceback
    assert found.error_file == plan.error_file
    text = format_root_cause([found])
    print(text)
    assert text.startswith("Root cause: rank 3 (local_rank 0) on node-x failed with exit code 1")
    assert 'raise ValueError("boom from the worker")' in text


def test_stderr_tail_when_there_is_no_error_file(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    script = write(tmp_path, "unrecorded.py", UNRECORDED)
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path / "logs"), redirects=Std.ERR), "job")
    (plan,) = logdir.prepare_attempt(0, [(0, 0)])
    worker = start_worker([PY, script], {}, plan)
    workers.append(worker)
    assert wait_any([worker], 60) == [worker]
    found = failure_of(worker, host="h")
    assert found.error is None and found.exitcode == 1
    assert found.stderr_tail.startswith("about to fail")
    assert found.summary == "RuntimeError: checkpoint missing: /nowhere/ckpt.pt"
    text = format_root_cause([found])
    assert "no error file; last lines of its stderr:" in text and "in load" in text


def test_first_failure_wins_across_real_workers(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path / "logs"), redirects=Std.ERR), "job")
    victim_plan, recorded_plan = logdir.prepare_attempt(0, [(0, 0), (1, 1)])
    victim = start_worker(["sleep", "300"], {}, victim_plan)
    workers.append(victim)
    os.kill(victim.pid, signal.SIGKILL)  # rank 0 dies first, with no word
    assert wait_any([victim], 30) == [victim]
    recorded = start_worker([PY, write(tmp_path, "recorded.py", RECORDED)], {}, recorded_plan)
    workers.append(recorded)
    assert wait_any([recorded], 90) == [recorded]

    failures = [failure_of(recorded, host="h"), failure_of(victim, host="h")]
    assert root_cause(failures).rank == 0
    text = format_root_cause(failures)
    print(text)
    assert text.splitlines()[0].startswith(
        "Root cause: rank 0 (local_rank 0) on h failed with signal SIGKILL (9)"
    )
    assert text.splitlines()[-1].endswith("ValueError: boom from the worker")


def test_failure_of_a_running_worker_is_refused(workers: list[WorkerProcess]) -> None:
    worker = spawn(["sleep", "300"], {}, local_rank=0)
    workers.append(worker)
    with pytest.raises(ValueError, match="still running"):
        failure_of(worker)


def test_build_failure_without_any_files() -> None:
    made = build_failure(
        rank=0, local_rank=0, pid=1, exitcode=-6, exited_at=5.0, error_file=None, stderr_file=None
    )
    assert made.signal_name == "SIGABRT" and made.host and made.timestamp == 5.0


def test_a_death_by_signal_is_summarised_by_its_signal_not_by_a_warning_printed_before() -> None:
    def killed(exitcode: int, stderr: str) -> str:
        return make_failure(rank=1, local_rank=1, host="h", pid=9, exitcode=exitcode, exited_at=1.0,
                            stderr_text=stderr).summary

    warning = "/data/train.py:4: UserWarning: this dataset is deprecated\n  warnings.warn('this dataset is deprecated')\n"
    assert killed(-9, warning) == "signal SIGKILL (9)"
    glog = "[rank0]:W1206 02:21:13.000 Profiler record function is not supported and will be ignored\n"
    assert killed(-9, glog) == "signal SIGKILL (9)"
    assert killed(-9, "step 12 loss 3.2\n") == "signal SIGKILL (9)"
    assert killed(-9, "") == "signal SIGKILL (9)"
    # where stderr does say why: the C++ exception before SIGABRT, faulthandler's fatal error
    assert killed(-6, NCCL_WATCHDOG_ABORT).startswith("signal SIGABRT (6): [PG ID 0 PG GUID 0(default_pg) Rank 0] "
                                                      "Process group watchdog")
    segv = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f3b (most recent call first):\n"
            '  File "/data/ext.py", line 9 in crash\n\nExtension modules: numpy.core._multiarray_umath, '
            "torch._C (total: 2)\n")
    assert killed(-11, segv) == "signal SIGSEGV (11): Fatal Python error: Segmentation fault"
    # std::terminate's what() is the cause whatever its words (gloo's enforce on a collective mismatch)
    enforce = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
               "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 84488 vs 1000. "
               "Received data size doesn't match expected size. Is there a distributed collective mismatch?\n")
    assert killed(-6, enforce).startswith("signal SIGABRT (6): [enforce fail at pair.cc:456] op.preamble")
    # CPython's own fatal errors (Py_FatalError) say the runtime's state between cause and dump
    fatal = ("Fatal Python error: Cannot recover from stack overflow.\nPython runtime state: initialized\n\n"
             "Current thread 0x00007fdb81a51b80 (most recent call first):\n  File \"<string>\", line 1 in <module>\n")
    assert killed(-6, fatal) == "signal SIGABRT (6): Fatal Python error: Cannot recover from stack overflow."
    # an exit code (no signal): the last line that is not a frame is the error, as before
    assert killed(3, "step 12 loss 3.2\nconfig error: no such file\n") == "config error: no such file"
