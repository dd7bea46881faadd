"""The launcher's own TORCHELASTIC_ERROR_FILE (a wrapper's, as TorchX sets it): a failed job
leaves its root cause there, as torchrun's ``@record``ed main does (acceptance pass 14: it was
never written)."""

from __future__ import annotations

import json

import pytest
from e2e import clean_env, run_unicron

pytestmark = pytest.mark.slow

RAISES = """\
import os, signal
if os.environ["RANK"] == "1":
    if os.environ.get("HOW") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("boom on rank 1")
"""


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_job_writes_its_root_cause_to_the_launchers_error_file(workdir, how: str) -> None:
    (workdir / "fails.py").write_text(RAISES)
    target = workdir / "launcher_error.json"
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "fails.py")], workdir,
                                 env=clean_env(TORCHELASTIC_ERROR_FILE=str(target), HOW=how))
    assert code == 1, out + err
    data = json.loads(target.read_text())
    message = data["message"]
    assert message["errorCode"] == 1
    if how == "raise":  # rank 1's own record, its traceback with it
        assert message["message"] == "ValueError: boom on rank 1", message
        assert "fails.py" in message["extraInfo"]["py_callstack"], message
    else:  # no record of its own: the job's failure line
        assert "rank 1" in message["message"] and "SIGKILL" in message["message"], message


def test_a_launcher_stopped_by_sigterm_writes_why_to_its_error_file(workdir, launch) -> None:
    """A preemption or an eviction: the wrapper's error file says so, as torchrun's @record does
    for its SignalException."""
    import signal

    from e2e import read_events, wait_for

    (workdir / "long.py").write_text("import time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                     "print('ready', flush=True)\ntime.sleep(120)\n")
    target = workdir / "launcher_error.json"
    item = launch(["run", "--standalone", "--nproc-per-node", "1", "--log-dir", str(workdir / "logs"),
                   str(workdir / "long.py")], workdir, clean_env(TORCHELASTIC_ERROR_FILE=str(target)))
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "workers_started"], 60,
             "the workers to start")
    item.proc.send_signal(signal.SIGTERM)
    code, _out, err = item.wait(60)
    assert code == 143, err
    message = json.loads(target.read_text())["message"]
    assert message["errorCode"] == 143 and "SIGTERM" in message["message"], message
