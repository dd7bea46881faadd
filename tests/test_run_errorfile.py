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
