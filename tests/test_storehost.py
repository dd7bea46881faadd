"""The store host: the coordinator's TCPStores served by a fork of the agent's zygote."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from e2e import wait_for
from helpers_worker import IMPORT_S, base_env, broken_torch_env, wait_until

from unicron.agent.warm import WarmPool
from unicron.coord import stores
from unicron.coord.stores import (
    HostedStore,
    LocalStore,
    Store,
    StoreHostChannel,
    StoreHostGone,
    StoreOpener,
)
from unicron.worker.storehost import RequestError, parse_request
from unicron.worker.zygote import parse_args

PY = sys.executable


def test_requests_are_checked() -> None:
    assert parse_request(b'{"open": 3, "timeout_s": 12}') == ("open", 3, 12.0)
    assert parse_request(b'{"open": 0}') == ("open", 0, 30.0)
    assert parse_request(b'{"close": 7}') == ("close", 7, 0.0)
    for bad in (b"", b"[1]", b'{"open": -1}', b'{"open": true}', b'{"open": "1"}', b'{"open": 1, "timeout_s": 0}',
                b'{"open": 1, "timeout_s": 1e9}', b'{"open": 1, "timeout_s": NaN}', b'{"other": 1}', b"\xff"):
        with pytest.raises(RequestError):
            parse_request(bad)


def test_zygote_arguments() -> None:
    room = " " * 10
    assert parse_args(["--reply-fd", "5", "--spec-fd", "6", room]) == (5, 6, None)
    assert parse_args(["--reply-fd", "5", "--spec-fd", "6"]) == (5, 6, None)
    assert parse_args(["--reply-fd", "5", "--spec-fd", "6", "--store-fds", "7,8", room]) == (5, 6, (7, 8))
    for bad in (["--reply-fd", "5"], ["--reply-fd", "x", "--spec-fd", "6"], ["--spec-fd", "5", "--reply-fd", "6"],
                ["--reply-fd", "5", "--spec-fd", "6", "--store-fds", "7"],
                ["--reply-fd", "5", "--spec-fd", "6", "--other", "7,8"], ["--reply-fd", "5", "--spec-fd", "6", "x"]):
        assert parse_args(bad) is None


def _opened(opener: StoreOpener, attempt: int, timeout_s: float = IMPORT_S) -> Store:
    (job, got, store, error) = wait_for(lambda: opener.ready() or None, timeout_s, f"store {attempt}")[0]
    assert (job, got, error) == ("job", attempt, "") and store is not None, error
    return store


def _client_round_trip(port: int, key: str) -> None:
    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    client.set(key, "value of " + key)
    assert client.get(key) == ("value of " + key).encode()


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except OSError:
        return True


def test_the_zygotes_store_host_serves_stores_outlives_its_zygote_and_goes_with_the_pool(subreaper: None) -> None:
    pool = WarmPool(1, python=PY, base_env=base_env(), host_stores=True)
    try:
        pool.refill()
        assert pool.store_channel is not None
        opener = StoreOpener(pool.store_channel)
        opener.open("job", 0)  # asked while the zygote still imports: answered once it is done
        assert pool.wait_ready(IMPORT_S)
        host = pool.store_pid
        assert host is not None and host in pool.pids()  # a helper of the agent, not a leftover of its workers
        proc = psutil.Process(host)
        assert proc.ppid() == os.getpid() and os.getsid(host) == host  # ours, in a session of its own
        # Its title is rewritten as it starts, concurrently with the zygote's "ready".
        wait_for(lambda: "unicron.worker.storehost" in " ".join(proc.cmdline()), 30, "the store host's title")
        first = _opened(opener, 0)
        assert isinstance(first, HostedStore)
        _client_round_trip(first.port, "attempt 0")
        opener.open("job", 1)
        second = _opened(opener, 1)
        assert second.port != first.port
        # The zygote dies (OOM-killed, say): the stores in use live on.
        (zygote,) = [p for p in pool.pids() if p != host]
        os.kill(zygote, signal.SIGKILL)
        wait_until(lambda: zygote not in pool.pids(), 30, "the pool to notice its zygote died")
        _client_round_trip(second.port, "attempt 1, zygote gone")
        first.close()  # an attempt's store closed: its port is free
        wait_until(lambda: _refused(first.port), 30, "the closed store's port to be freed")
        _client_round_trip(second.port, "attempt 1, first closed")
    finally:
        pool.close()
    assert not psutil.pid_exists(host), "the store host survived the pool"
    # Its host gone, the coordinator opens stores itself.
    opener.open("job", 2)
    third = _opened(opener, 2)
    assert isinstance(third, LocalStore)
    _client_round_trip(third.port, "attempt 2, in the launcher")
    assert opener.host is not None and (opener.host.gone or "").startswith("the store host")


def test_a_zygote_that_cannot_import_leaves_the_stores_to_the_launcher(tmp_path: Path, subreaper: None) -> None:
    env = broken_torch_env(tmp_path)
    with WarmPool(1, python=PY, base_env=env, host_stores=True) as pool:
        pool.refill()
        opener = StoreOpener(pool.store_channel)
        opener.open("job", 0)
        store = _opened(opener, 0)  # its exit closed the pipe: no waiting out HOST_WAIT_S
        assert isinstance(store, LocalStore) and pool.store_pid is None
        _client_round_trip(store.port, "cold")


def test_a_channel_whose_host_never_answers_gives_up_at_its_deadline() -> None:
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    channel = StoreHostChannel(requests_w, replies_r)
    try:
        with pytest.raises(StoreHostGone, match="did not answer"):
            channel.open(30.0, 0.3)
        with pytest.raises(StoreHostGone):  # gone for good: the next open does not wait again
            channel.open(30.0, 30.0)
        assert os.read(requests_r, 1000) == b'{"open": 0, "timeout_s": 30.0}\n'
    finally:
        channel.close()
        for fd in (requests_r, replies_r, replies_w):
            os.close(fd)


def test_a_host_that_answered_once_and_then_falls_silent_is_given_up_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its imports a store host answers in milliseconds: silent after that, it is stopped
    or wedged, and the next attempt's store opens in the launcher after ``ANSWERED_WAIT_S``, not
    after the 300 s a zygote still importing is given (acceptance 21A F2)."""
    monkeypatch.setattr(stores, "ANSWERED_WAIT_S", 0.5)
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    channel = StoreHostChannel(requests_w, replies_r)
    opener = StoreOpener(channel)
    try:
        os.write(replies_w, b'{"id": 0, "error": "address in use"}\n')  # an answer: it is up
        with pytest.raises(stores.StoreOpenError):
            channel.open(30.0, 5.0)
        assert channel.answered
        started = time.monotonic()
        opener.open("job", 1)
        store = _opened(opener, 1)
        assert isinstance(store, LocalStore) and time.monotonic() - started < 60
        assert channel.gone == "the store host did not answer"
        store.close()
    finally:
        opener.close()
        for fd in (requests_r, replies_r, replies_w):
            os.close(fd)


def _waiting_in_its_store(launcher: psutil.Process) -> bool:
    """A worker is in gloo's connect of ``init_process_group``: it listens for its peers (gloo's
    device) and is connected to the store, where it waits for their addresses. (Its environment
    cannot tell its rank: a worker forked by the zygote sets it after its start.)"""
    for proc in launcher.children(recursive=True):
        try:
            if "unicron.worker.boot" not in proc.cmdline():
                continue
            states = {c.status for c in proc.net_connections("tcp")}
        except psutil.Error:
            continue
        if {psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED} <= states:
            return True
    return False


# Rank 1 sleeps before its init_process_group; rank 0 waits in its own, on the store, and takes
# SIGTERM as a script that checkpoints on preemption does: it lives on to the grace period's SIGKILL.
WAITS_FOR_ITS_PEER = """import os, signal, time
import torch.distributed as dist
signal.signal(signal.SIGTERM, lambda *_: None)
if os.environ["RANK"] == "1":
    time.sleep(3600)
dist.init_process_group("gloo")
"""


@pytest.mark.timeout(120)
def test_an_interrupted_launcher_stops_its_workers_before_their_store(workdir: Path) -> None:
    """The launcher (hosting the coordinator) gets SIGTERM while rank 0 waits in its store for a
    peer. It told the coordinator first, which closed the store under rank 0 as it was being
    stopped: 40 lines of TCPStore's C++ stack ("recvValueWithTimeout failed ... Did the remote
    server shutdown or crash?", acceptance 31A F2). The store now goes after the workers."""
    from e2e import Launched

    (workdir / "waits.py").write_text(WAITS_FOR_ITS_PEER)
    job = Launched(["run", "--standalone", "--nproc-per-node", "2", "--grace-period", "2",
                    str(workdir / "waits.py")], workdir)
    try:
        wait_for(lambda: _waiting_in_its_store(psutil.Process(job.proc.pid)), 60, "rank 0 waiting in its store")
        job.proc.send_signal(signal.SIGTERM)
        code, out, err = job.wait(60)
    finally:
        job.kill()
    assert code != 0 and "interrupted by SIGTERM" in err, err
    assert "recvValueWithTimeout" not in err and "remote server" not in err, err
