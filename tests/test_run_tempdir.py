"""Without --log-dir the workers' streams are copied to a temporary directory for the failure
report only: a job that succeeds leaves its event log there and nothing else (acceptance pass
14: a chatty stderr left tens of MB per run in /tmp); one that fails keeps them."""

from __future__ import annotations

import pytest
from e2e import clean_env, run_unicron

pytestmark = pytest.mark.slow

CHATTY = "import sys\nfor i in range(2000):\n    print('warning: something chatty', i, file=sys.stderr)\nsys.exit({code})\n"


@pytest.mark.parametrize("code", [0, 3])
def test_a_succeeded_jobs_temporary_worker_logs_are_removed_a_failed_ones_kept(workdir, code: int) -> None:
    tmp = workdir / "tmp"
    tmp.mkdir()
    (workdir / "chatty.py").write_text(CHATTY.format(code=code))
    exit_code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", str(workdir / "chatty.py")],
                                      workdir, env=clean_env(TMPDIR=str(tmp)))
    assert exit_code == (0 if code == 0 else 1), err
    assert err.count("warning: something chatty") >= 2000  # the console had all of it
    run_dirs = [d for root in tmp.glob("unicron_*") for d in root.iterdir() if d.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    kept = sorted(p.name for p in run_dirs[0].iterdir())
    assert "events.jsonl" in kept
    stderr_logs = list(run_dirs[0].glob("attempt_*/*/stderr.log"))
    if code == 0:
        assert not stderr_logs and not [k for k in kept if k.startswith("attempt_")], kept
    else:
        assert len(stderr_logs) == 2, kept


def test_streams_the_user_redirected_are_kept_after_success(workdir) -> None:
    """``-r 3`` without ``--log-dir``: the files are the job's only copy of its output (rank 0's
    metrics, eval results); torchrun keeps them in its temp dir, and so must unicron."""
    tmp = workdir / "tmp"
    tmp.mkdir()
    (workdir / "hello.py").write_text("import os, sys\nprint('hello from rank', os.environ['RANK'])\n"
                                      "print('warn', file=sys.stderr)\n")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "-r", "3", str(workdir / "hello.py")],
                                 workdir, env=clean_env(TMPDIR=str(tmp)))
    assert code == 0, err
    assert "hello from rank" not in out
    outs = sorted(tmp.glob("unicron_*/*/attempt_0/*/stdout.log"))
    assert [p.read_text() for p in outs] == ["hello from rank 0\n", "hello from rank 1\n"], outs
    assert len(list(tmp.glob("unicron_*/*/attempt_0/*/stderr.log"))) == 2
