"""The activity evidence read from real process trees with psutil."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from unicron.agent.sendqueues import (
    SendQueueWatch,
    asked_send_queues,
    drained_between,
    parse_tcp_table,
    socket_inodes,
    table_send_queues,
)
from unicron.agent.usage import tree_usage
from unicron.detect.activity import Activity, ActivityTracker, BusyRule

# A leader that idles while its child computes (a data loader, a helper process), a leader that
# computes itself (a long native call, a spin-wait), and a leader that idles alone (a rank
# waiting in a collective).
BUSY_CHILD = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
              "print('ready', flush=True)\n"
              "try:\n    time.sleep(3600)\nfinally:\n    child.kill(); child.wait()\n")
SPIN = "import time\nprint('ready', flush=True)\nwhile True: pass\n"
IDLE = "import time\nprint('ready', flush=True)\ntime.sleep(3600)\n"
# A collective's traffic through a slow link: 20 KiB written to a socket (writev, as gloo
# sends) 10 times a second, and a logging thread's worth of output: a short line 10 times a second.
SLOW_LINK = ("import os, socket, time\n"
             "a, b = socket.socketpair()\n"
             "print('ready', flush=True)\n"
             "while True:\n"
             "    os.writev(a.fileno(), [b'x' * 20480])\n"
             "    while len(b.recv(65536)) == 65536: pass\n"
             "    time.sleep(0.1)\n")
LOGGING = ("import sys, time\nprint('ready', flush=True)\nlog = open(os.devnull, 'w')\n"
           "while True:\n    log.write('step 12 loss 0.123 lr 1e-4 tokens/s 123456\\n'); log.flush(); time.sleep(0.1)\n")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in started:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []  # already reaped by the test
        for child in children:
            child.kill()
        proc.kill()
        proc.wait()  # its orphaned child is reaped by init (or the test's subreaper) now
        psutil.wait_procs(children, timeout=10)


def test_a_computing_descendant_is_work_a_computing_leader_is_busy_an_idle_tree_idle(procs) -> None:
    helped, spinning, idle = procs(BUSY_CHILD), procs(SPIN), procs(IDLE)
    tracker = ActivityTracker(BusyRule(window_s=1.0, period_s=0.25))
    expected = {0: Activity.WORKING, 1: Activity.BUSY, 2: Activity.IDLE}
    deadline = time.monotonic() + 30
    verdict = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if tracker.due(now):
            tracker.add(now, {0: tree_usage(helped.pid), 1: tree_usage(spinning.pid), 2: tree_usage(idle.pid)})
            verdict = tracker.levels(now)
            if verdict == expected:  # the trees' start-up has aged out
                break
        time.sleep(0.05)
    assert verdict == expected
    idle.kill()
    idle.wait()
    assert tree_usage(idle.pid) is None


def test_a_slow_links_traffic_is_work_a_logging_thread_is_not(procs) -> None:
    sending, logging = procs(SLOW_LINK), procs("import os\n" + LOGGING)
    tracker = ActivityTracker()  # the default rule
    expected = {0: Activity.WORKING, 1: Activity.IDLE}
    deadline = time.monotonic() + 30
    verdict = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if tracker.due(now):
            tracker.add(now, {0: tree_usage(sending.pid), 1: tree_usage(logging.pid)})
            verdict = tracker.levels(now)
            if verdict == expected:  # the trees' start-up has aged out
                break
        time.sleep(0.05)
    assert verdict == expected


ONE_BIG_WRITE = ("import os, sys\n"
                 "data = bytearray(768 << 20)\n"
                 "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
                 "print('ready', flush=True)\n"
                 "os.write(fd, data)  # one call, as torch.save writes a storage\n"
                 "print('written', flush=True)\n"
                 "os.close(fd)\n"
                 "sys.stdin.read()\n")


def _on_tmpfs(path) -> bool:
    best, kind = "", ""
    for line in open("/proc/mounts").read().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path).startswith(point) and len(point) > len(best):
            best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")


def test_one_long_write_is_io_while_it_runs(tmp_path) -> None:
    """``torch.save`` writes each storage with one ``write()``, which ``wchar`` counts only
    when it returns: a checkpoint of a 2 GB tensor looked like no I/O for as long as it took
    (acceptance pass 14). Storage bytes count as pages are dirtied, during the call."""
    if _on_tmpfs(tmp_path):
        pytest.skip("tmpfs does not account written pages")
    proc = subprocess.Popen([sys.executable, "-c", ONE_BIG_WRITE, str(tmp_path / "big.bin")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = tree_usage(proc.pid)
        assert before is not None
        seen_during = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = tree_usage(proc.pid)
            assert now is not None
            if not _inside_write(proc.pid):
                break
            seen_during = max(seen_during, now.io_bytes - before.io_bytes)
            time.sleep(0.005)
        assert seen_during > 64 << 20, seen_during
    finally:
        proc.kill()
        proc.wait()


def _inside_write(pid: int) -> bool:
    """The big write has not returned: ``wchar`` (counted when a call returns) has not got it."""
    fields = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines() if ": " in line)
    return int(fields["wchar"]) < 768 << 20


# A rank whose collective's data waits in its socket's send queue for a slow link (or a slow
# reader): one burst of writes, as gloo hands a chunk to the kernel, then nothing but waiting.
ONE_BURST = ("import socket, sys, time\n"
             "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
             "s.setblocking(False)\n"
             "sent = 0\n"
             "try:\n"
             "    while True:\n"
             "        sent += s.send(b'x' * 65536)\n"
             "except BlockingIOError:\n"
             "    pass\n"
             "print('ready', sent, flush=True)\n"
             "time.sleep(3600)\n")


def test_data_draining_from_a_ranks_send_queue_is_work_a_stuck_queue_is_not() -> None:
    """Acceptance 18C F4: at 1 Mbit/s a collective's write lands in the send buffer at once and
    then drains for seconds, with no counter moving; the job was called hung. The bytes that
    leave the send queue count (a reader draining 800 KB/s here, far below the 64 KiB/s of
    ``io_bytes`` in any window after the burst); once the reader stops, nothing drains: idle."""
    listener = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", ONE_BURST, str(listener.getsockname()[1])],
                            stdout=subprocess.PIPE, text=True)
    reading = threading.Event()
    reading.set()
    stop = threading.Event()
    try:
        conn, _ = listener.accept()
        assert proc.stdout is not None
        ready, sent = proc.stdout.readline().split()
        assert ready == "ready" and int(sent) > 1 << 20, sent  # more than a second of reading

        def read_slowly() -> None:
            while not stop.is_set():
                if reading.is_set():
                    conn.recv(16384)
                time.sleep(0.02)

        threading.Thread(target=read_slowly, daemon=True).start()
        watch = SendQueueWatch()

        def verdict_within(expected: Activity, timeout_s: float) -> dict[int, Activity]:
            tracker = ActivityTracker()
            deadline = time.monotonic() + timeout_s
            levels: dict[int, Activity] = {}
            while time.monotonic() < deadline:
                now = time.monotonic()
                if tracker.due(now):
                    tracker.add(now, {0: tree_usage(proc.pid, watch)})
                    levels = tracker.levels(now)
                    if levels.get(0) is expected:
                        break
                time.sleep(0.05)
            return levels

        assert verdict_within(Activity.WORKING, 10) == {0: Activity.WORKING}
        reading.clear()  # the peer stops reading: its buffer fills, nothing drains
        assert verdict_within(Activity.IDLE, 10) == {0: Activity.IDLE}
        assert asked_send_queues(proc.pid), "the queue is still full, and read"
        # Asked of the rank's own socket (acceptance 20C F3: not the host's whole table, seconds
        # to parse with tens of thousands of sockets), with the table's answer.
        assert watch.route == "ask"
        asked = asked_send_queues(proc.pid)
        assert asked == table_send_queues(proc.pid, socket_inodes(proc.pid)) and list(asked.values())[0] > 0
        # Where descriptors cannot be taken, the table (read once for every rank of a namespace),
        # and never a table over the size limit: no evidence from it rather than a slow agent.
        by_table = SendQueueWatch(route="table")
        assert by_table.drained(proc.pid) == 0 and by_table._read(proc.pid) == asked
        too_big = SendQueueWatch(route="table", table_max_bytes=100)
        assert too_big.drained(proc.pid) == 0 and too_big.route == "none" and too_big._read(proc.pid) == {}
    finally:
        stop.set()
        proc.kill()
        proc.wait()
        listener.close()


def test_send_queues_are_read_from_the_kernels_table() -> None:
    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
             "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0\n"
             "   1: 0100007F:C350 0100007F:1F90 01 0001E000:00000000 01:00000014 00000000     0        0 4243 2 0\n"
             "   2: garbage\n"
             "   3: 0100007F:C351 0100007F:1F90 01 zz:00000000 01:00000014 00000000     0        0 4244 2 0\n")
    assert parse_tcp_table(table) == {4242: 0, 4243: 0x1E000}
    # What left each socket present in both readings; a new socket or a refill adds nothing.
    assert drained_between({1: 100, 2: 50, 3: 10}, {1: 40, 2: 80, 4: 999}) == 60


def _levels_until(pids: dict[int, int], expected: dict[int, Activity], timeout_s: float) -> dict[int, Activity]:
    tracker = ActivityTracker()  # the default rule
    deadline = time.monotonic() + timeout_s
    levels: dict[int, Activity] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        if tracker.due(now):
            tracker.add(now, {rank: tree_usage(pid) for rank, pid in pids.items()})
            levels = tracker.levels(now)
            if levels == expected:
                break
        time.sleep(0.05)
    return levels


def test_a_rank_computing_on_an_oversubscribed_cpu_is_busy_a_sleeping_one_idle() -> None:
    """Acceptance 19B F1: ten other sessions' busy processes on two cores left a rank in one
    native call 0.18 of a core, under the 0.2 that made it busy: it was called idle (a hang at
    1.5 s). Here a spinner shares one CPU with eight busy siblings, each in a session of its
    own (as other users' jobs are): it receives about 0.11 of a core and wants a whole one."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    pin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
    started: list[subprocess.Popen] = []
    try:
        for _ in range(8):
            started.append(subprocess.Popen([sys.executable, "-c", pin + "while True: pass"], start_new_session=True))
        spinner, sleeper = (subprocess.Popen([sys.executable, "-c", pin + code], stdout=subprocess.PIPE, text=True,
                                             start_new_session=True) for code in (SPIN, IDLE))
        started += [spinner, sleeper]
        for proc in (spinner, sleeper):
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        expected = {0: Activity.BUSY, 1: Activity.IDLE}
        assert _levels_until({0: spinner.pid, 1: sleeper.pid}, expected, 30) == expected
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


# A rank printing every step into a console that stopped reading (a full pipe).
PRINTS = "print('ready', flush=True)\nwhile True:\n    print('step ' + 'x' * 2000, flush=True)\n"


def test_a_rank_blocked_writing_to_a_console_that_does_not_read_is_work(procs) -> None:
    """Acceptance 19B F2: `unicron run ... | less`, a terminal paused with Ctrl-S, `| tee` over a
    slow link: the ranks block in write(1, ...) with no counter moving, and were called hung
    at 1.5 s. A rank blocked writing to a socket (a peer that stopped reading) is not this."""
    printer = procs(PRINTS)  # nothing reads its stdout after 'ready': the pipe fills
    stuck_socket = procs("import socket\na, b = socket.socketpair()\nprint('ready', flush=True)\n"
                         "while True: a.sendall(b'x' * 65536)\n")
    expected = {0: Activity.WORKING, 1: Activity.IDLE}
    assert _levels_until({0: printer.pid, 1: stuck_socket.pid}, expected, 30) == expected
