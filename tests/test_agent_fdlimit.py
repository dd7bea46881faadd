"""The launcher's soft limit on open files is raised for many local ranks (acceptance 19B F8)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from unicron.agent.fdlimit import needed_fds, room_problem, soft_limit_for

INF = resource.RLIM_INFINITY


def test_the_soft_limit_is_raised_only_when_the_ranks_need_it() -> None:
    assert soft_limit_for(2, 1024, 4096) == (None, "")  # the usual node: nothing changes
    assert soft_limit_for(256, 1024, 4096) == (needed_fds(256), "") and needed_fds(256) > 1024
    assert soft_limit_for(256, 1024, INF) == (needed_fds(256), "")
    assert soft_limit_for(256, INF, INF) == (None, "")
    # The hard limit is too low: as far as it goes, with a warning (torchrun would try, too).
    target, warning = soft_limit_for(256, 512, 1024)
    assert target == 1024 and warning.startswith(f"256 local ranks may need about {needed_fds(256)} open files; "
                                                 "the limit is 1024 (ulimit -Hn)")
    assert soft_limit_for(256, 1024, 1024)[0] is None


def test_a_launcher_under_a_low_soft_limit_raises_it_for_its_ranks() -> None:
    """As `ulimit -n 100` then 24 ranks: the launcher died of "ZMQError: Too many open files"."""
    code = ("import resource\n"
            "from unicron.agent.fdlimit import ensure_fd_limit\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))\n"
            "print(repr(ensure_fd_limit(24)), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["''", str(needed_fds(24))]


def test_room_for_an_attempts_ranks_is_checked_against_what_is_open() -> None:
    assert room_problem(8, 32, 1024) == "" and room_problem(8, 32, INF) == ""
    assert room_problem(8, 32, 76) == ""  # 4 a rank and 12 spare
    assert room_problem(2, 5, 53, own=28) == "" and room_problem(2, 5, 52, own=28).startswith(
        "out of open files: 2 local ranks and the launcher need about 48 descriptors beyond the 5")
    assert room_problem(8, 32, 75).startswith("out of open files: 8 local ranks need about 44 descriptors beyond "
                                              "the 32 this launcher holds, and the limit is 75 (ulimit -n)")


@pytest.mark.parametrize("limit, nproc, line", [
    # Past the hard limit the launcher died with "internal error: ZMQError: Too many open files",
    # exit 70, as if unicron had a bug; or, its node and its coordinator each meeting the full
    # table in ZeroMQ's threads, waited 600 s for a join nobody could answer.
    (24, 2, "out of open files: 2 local ranks and the launcher need about 48 descriptors beyond the "),
    # Acceptance 20C F1: ZeroMQ's I/O thread aborted the launcher (SIGABRT, "Too many open
    # files (src/ipc_listener.cpp:297)") with 3 of 8 ranks started.
    (50, 8, "out of open files: 8 local ranks and the launcher need about 72 descriptors beyond the "),
])
def test_a_launcher_out_of_open_files_says_so_in_one_line(tmp_path, limit, nproc, line) -> None:
    import resource as res

    from e2e import clean_env, unicron_cmd

    script = tmp_path / "t.py"
    script.write_text("print('never')\n")

    def low_limit() -> None:
        res.setrlimit(res.RLIMIT_NOFILE, (limit, limit))

    proc = subprocess.run(unicron_cmd("run", "--standalone", "--no-warm", "--nproc-per-node", str(nproc), str(script)),
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=low_limit)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("unicron: error: " + line), proc.stderr
    assert "never" not in proc.stdout and "Traceback" not in proc.stderr
