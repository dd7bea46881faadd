"""Stack analysis on real faulthandler dumps of real processes blocked in real gloo collectives.

The dumps are produced at test time: two ranks join a gloo process group, one waits in a
collective (a plain all_reduce, or DDP's gradient all-reduce inside backward), the other sleeps
(the culprit). The test asks each process for its stacks with SIGUSR1, exactly as the agent does.
"""

from __future__ import annotations

import linecache
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron.detect.stacks import analyze_dump, annotate_sources, main_thread, name_culprits, parse_dump

CHILD = textwrap.dedent("""\
    import datetime, faulthandler, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    rank, mode, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dump = open(os.path.join(workdir, f"rank{rank}.txt"), "a")  # append: the test truncates between requests
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    threading.Thread(target=time.sleep, args=(3600,), name="side", daemon=True).start()
    port_file = os.path.join(workdir, "port")
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
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))

    def sleep_forever():
        open(os.path.join(workdir, f"ready{rank}"), "w").close()
        while True:
            time.sleep(3600)

    if mode == "allreduce":
        if rank == 0:
            open(os.path.join(workdir, f"ready{rank}"), "w").close()
            dist.all_reduce(torch.ones(16))  # blocks: rank 1 never joins
        else:
            sleep_forever()
    elif mode == "irecv":
        if rank == 0:
            open(os.path.join(workdir, f"ready{rank}"), "w").close()
            dist.irecv(torch.zeros(4), src=1).wait()  # blocks in C++ Work.wait, below this line
        else:
            sleep_forever()
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))  # collective: both ranks
        if rank == 0:
            open(os.path.join(workdir, f"ready{rank}"), "w").close()
            model(torch.randn(4, 8)).sum().backward()  # blocks in DDP's gradient all-reduce
        else:
            sleep_forever()
    elif mode == "mismatch":  # the ranks disagree on the collective: they never meet
        open(os.path.join(workdir, f"ready{rank}"), "w").close()
        if rank == 0:
            dist.all_gather_object([None, None], {"rank": rank})
        else:
            dist.broadcast(torch.ones(1), src=1)
    elif mode == "ddp_ctor":
        if rank == 0:
            open(os.path.join(workdir, f"ready{rank}"), "w").close()
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))  # blocks: its shape check
        else:
            sleep_forever()
    """)


def _wait_for(predicate, what: str, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _request_dump(proc: subprocess.Popen[bytes], path: Path) -> str:
    """SIGUSR1 the process and return the complete dump it writes."""
    path.write_text("")  # the child appends, so its next dump starts at offset 0
    os.kill(proc.pid, signal.SIGUSR1)

    def complete() -> str | None:
        first = path.read_text()
        if "most recent call first" not in first:
            return None
        return first if path.read_text() == first else None  # the handler has stopped writing

    return str(_wait_for(complete, f"a stack dump from pid {proc.pid}", timeout=30.0))


def _collect(mode: str, workdir: Path) -> dict[int, str]:
    script = workdir / "child.py"
    script.write_text(CHILD)
    procs = {r: subprocess.Popen([sys.executable, str(script), str(r), mode, str(workdir)]) for r in (0, 1)}
    try:
        for r in procs:
            _wait_for(lambda r=r: (workdir / f"ready{r}").exists() or procs[r].poll() is not None,
                      f"rank {r} to start")
            assert procs[r].poll() is None, f"rank {r} exited with {procs[r].returncode}"
        dumps = {1: _request_dump(procs[1], workdir / "rank1.txt")} if mode != "mismatch" else {}
        # A rank reaches the collective a moment after saying it is ready: ask until it is inside.
        for r in (0, 1) if mode == "mismatch" else (0,):
            dumps[r] = _wait_for(
                lambda r=r: (d := annotate_sources(_request_dump(procs[r], workdir / f"rank{r}.txt"),
                                                   linecache.getline))
                and (a := analyze_dump(r, d)) is not None and a.in_collective and d,
                f"rank {r} to be seen inside the collective", timeout=60.0)
        for r, text in dumps.items():  # the fixtures, kept next to the run for inspection
            (workdir / f"fixture_{mode}_rank{r}.txt").write_text(text)
        return dumps
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture(scope="module")
def allreduce_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    yield _collect("allreduce", tmp_path_factory.mktemp("allreduce"))


@pytest.fixture(scope="module")
def irecv_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    yield _collect("irecv", tmp_path_factory.mktemp("irecv"))


@pytest.fixture(scope="module")
def ddp_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    yield _collect("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def mismatch_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    yield _collect("mismatch", tmp_path_factory.mktemp("mismatch"))


@pytest.fixture(scope="module")
def ddp_ctor_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    yield _collect("ddp_ctor", tmp_path_factory.mktemp("ddp_ctor"))


def test_parse_real_dump_threads_and_main_thread(allreduce_dumps: dict[int, str]) -> None:
    for text in allreduce_dumps.values():
        threads = parse_dump(text)
        assert len(threads) >= 2, text  # the main thread and the "side" thread at least
        main = main_thread(threads)
        assert main is not None, text
        assert main.frames[-1].function == "<module>" and main.frames[-1].filename.endswith("child.py")
        assert all(f.lineno > 0 for t in threads for f in t.frames)


def test_allreduce_waiter_vs_sleeper(allreduce_dumps: dict[int, str]) -> None:
    waiter = analyze_dump(0, allreduce_dumps[0])
    sleeper = analyze_dump(1, allreduce_dumps[1])
    assert waiter is not None and waiter.in_collective and "distributed_c10d.py" in waiter.where
    assert sleeper is not None and not sleeper.in_collective and "child.py" in sleeper.where
    report = name_culprits(allreduce_dumps)
    assert report.verdict == "culprits" and report.culprits == (1,)
    assert report.in_collective == (0,)
    assert "rank(s) 1" in report.summary and "child.py" in report.summary


def test_ddp_backward_waiter_vs_sleeper(ddp_dumps: dict[int, str]) -> None:
    waiter = analyze_dump(0, ddp_dumps[0])
    assert waiter is not None and waiter.in_collective and "autograd" in waiter.where, ddp_dumps[0]
    report = name_culprits(ddp_dumps)
    assert (report.verdict, report.culprits) == ("culprits", (1,))


def test_a_rank_waiting_in_ddps_constructor_is_inside_a_collective(ddp_ctor_dumps: dict[int, str]) -> None:
    """DDP's (and FSDP's) constructor checks parameter shapes and broadcasts them across ranks in
    C++ below torch/distributed/utils.py: a rank there waits for the others; the sleeper is the culprit."""
    waiter = analyze_dump(0, ddp_ctor_dumps[0])
    assert waiter is not None and waiter.in_collective and "distributed/utils.py" in waiter.where, ddp_ctor_dumps[0]
    report = name_culprits(ddp_ctor_dumps)
    assert (report.verdict, report.culprits) == ("culprits", (1,))


def test_ambiguous_cases_are_reported(allreduce_dumps: dict[int, str], ddp_dumps: dict[int, str]) -> None:
    both_inside = name_culprits({0: allreduce_dumps[0], 1: ddp_dumps[0]})
    assert (both_inside.verdict, both_inside.culprits) == ("all_in_collective", ())
    # A plain all_reduce on one rank, DDP's backward on the other: they never meet.
    assert "different collectives" in both_inside.summary and "backward at child.py" in both_inside.summary
    none_inside = name_culprits({0: allreduce_dumps[1], 1: ddp_dumps[1]})
    assert (none_inside.verdict, none_inside.culprits) == ("none_in_collective", ())
    # A rank that gave no dump, while every other waits in the collective, is the suspect.
    silent = name_culprits({0: allreduce_dumps[0], 1: None}, expected=[0, 1, 2])
    assert (silent.verdict, silent.culprits, silent.missing) == ("all_in_collective", (1, 2), (1, 2))
    assert name_culprits({0: "", 1: "garbage\n"}).verdict == "no_dumps"


def test_appended_dumps_use_the_last_one(allreduce_dumps: dict[int, str]) -> None:
    # Two dumps in one file (a worker that did not truncate): the newest decides.
    text = allreduce_dumps[1] + allreduce_dumps[0]
    assert parse_dump(text) == parse_dump(allreduce_dumps[0])
    report = analyze_dump(5, text)
    assert report is not None and report.in_collective


def test_frame_location_is_never_mistaken_for_a_relative_path() -> None:
    from unicron.detect.stacks import Frame

    assert Frame("/tmp/accept/train.py", 20, "<module>").short() == "/tmp/accept/train.py:20 in <module>"
    assert Frame("/home/u/proj/pkg/train.py", 7, "main").short() == ".../proj/pkg/train.py:7 in main"
    assert Frame("train.py", 1, "f").short() == "train.py:1 in f"


def test_a_rank_waiting_in_work_wait_of_an_irecv_is_inside_with_its_source_line(irecv_dumps: dict[int, str]) -> None:
    """``dist.irecv(...).wait()`` waits in C++ straight from the script's line: faulthandler
    shows only that line. With the source line the agent adds, it is a wait, and the sleeper is
    the culprit; without it, no rank looked inside a collective and nobody was named."""
    assert "    > dist.irecv(torch.zeros(4), src=1).wait()" in irecv_dumps[0]
    report = name_culprits(irecv_dumps)
    assert report.verdict == "culprits" and report.culprits == (1,) and report.in_collective == (0,)
    bare = {r: "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("> "))
            for r, text in irecv_dumps.items()}
    assert name_culprits(bare).verdict == "none_in_collective"


def test_source_lines_are_added_under_each_threads_innermost_frame_only() -> None:
    dump = ('Thread 0x1 (most recent call first):\n  File "/a.py", line 3 in f\n  File "/a.py", line 9 in <module>\n\n'
            'Current thread 0x2 (most recent call first):\n  File "/b.py", line 1 in g\n')
    lines = {("/a.py", 3): "    req.wait()\n", ("/a.py", 9): "f()\n"}
    out = annotate_sources(dump, lambda f, n: lines.get((f, n), ""))
    assert out.count("    > ") == 1 and "  File \"/a.py\", line 3 in f\n    > req.wait()\n" in out
    threads = parse_dump(out)
    assert threads[0].frames[0].source == "req.wait()" and threads[0].frames[1].source == ""
    assert analyze_dump(0, out) is not None
    assert annotate_sources(dump, lambda f, n: "") == dump  # nothing readable: unchanged


def test_ranks_waiting_in_different_collectives_are_a_deadlock_named_with_their_script_lines(
        mismatch_dumps: dict[int, str], allreduce_dumps: dict[int, str]) -> None:
    """Acceptance 23C F2: rank 0 in all_gather_object, rank 1 in broadcast. Both wait inside a
    collective, so no culprit, but they never meet: say where each waits, and from which line
    of the script (torchrun shows it in each rank's traceback at its timeout, 30 minutes on)."""
    report = name_culprits(mismatch_dumps)
    assert report.verdict == "all_in_collective" and report.culprits == ()
    line = {r: next(i for i, text in enumerate(CHILD.splitlines(), 1) if call in text and "dist." in text)
            for r, call in ((0, "all_gather_object"), (1, "broadcast(torch"))}
    assert report.calls == {0: f"all_gather_object at child.py:{line[0]}", 1: f"broadcast at child.py:{line[1]}"}
    assert report.summary.startswith("ranks wait in different collectives, which never meet (a deadlock: "
                                     "every rank must call the same collectives in the same order): "
                                     f"rank(s) 0 in all_gather_object at child.py:{line[0]}; "
                                     f"rank(s) 1 in broadcast at child.py:{line[1]}")
    # Waiting in the same collective is no deadlock of this kind, from the same line or from
    # two ("rank 0 sends, the others receive": acceptance 24A F2); nor when a rank gave no stack
    # (it may be the one the others wait for).
    same = name_culprits({0: allreduce_dumps[0], 1: allreduce_dumps[0]})
    assert same.verdict == "all_in_collective" and same.mismatch() == ""
    assert same.summary.startswith("every rank that answered waits inside a collective")
    moved = mismatch_dumps[1].replace(f"line {line[1]} in", f"line {line[1] + 1} in")
    assert moved != mismatch_dumps[1] and name_culprits({0: mismatch_dumps[1], 1: moved}).mismatch() == ""
    assert name_culprits({0: mismatch_dumps[0], 1: mismatch_dumps[1], 2: None}).mismatch() == ""
