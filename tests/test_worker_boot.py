"""unicron.worker.boot runs a script exactly as python would, and reports how it ended."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from helpers_worker import PYTHON, agent_socket, base_env, finish, run_boot, workers, write_script

from unicron.worker import boot

PROBE = """
    import json, os, pickle, sys

    class Point:
        def __init__(self, x):
            self.x = x

    def main():
        report = {
            "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
            "spec": getattr(__spec__, "name", None),
            "dunders": sorted(k for k in globals() if k.startswith("__")),  # __annotations__ too
            "pickled": pickle.loads(pickle.dumps(Point(3))).x,
        }
        print("REPORT " + json.dumps(report))
        mode = sys.argv[1] if len(sys.argv) > 1 else ""
        if mode == "raise":
            inner()
        if mode == "exit":
            sys.exit(int(sys.argv[2]))
        if mode == "exitmsg":
            sys.exit("bad things")
        if mode == "hard0":
            os._exit(0)

    def inner():
        try:
            {}["missing"]
        except KeyError as err:
            raise ValueError("boom in script") from err

    if __name__ == "__main__":
        main()
"""


def _report(out: str) -> dict:
    line = next(x for x in out.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.fixture()
def probe(tmp_path: Path) -> Path:
    sub = tmp_path / "pkg"
    sub.mkdir()
    return write_script(sub, "probe.py", PROBE)



def _kinds(agent) -> list[str]:
    """The message kinds in order, ``alive`` only the first time: past its end the liveness thread
    says it every second, and a teardown slowed by a busy machine may take longer than that."""
    kinds = [m["t"] for m in agent.messages]
    return [t for i, t in enumerate(kinds) if t != "alive" or "alive" not in kinds[:i]]

def test_argv_main_and_path_like_python(probe: Path) -> None:
    cwd = probe.parent.parent
    rc, out, err = run_boot("pkg/probe.py", "a", "--flag", env=base_env(), cwd=cwd)
    assert rc == 0, err
    got = _report(out)
    plain = subprocess.run([PYTHON, "-u", "pkg/probe.py", "a", "--flag"], cwd=cwd, capture_output=True,
                           text=True, env=base_env(), timeout=60)
    assert got == _report(plain.stdout)
    assert got["name"] == "__main__" and got["argv"] == ["pkg/probe.py", "a", "--flag"]
    assert got["path0"] == str(probe.parent.resolve()) and got["pickled"] == 3 and got["spec"] is None


def test_a_working_directory_file_named_like_a_stdlib_module_shadows_nothing(probe: Path) -> None:
    # python SCRIPT (torchrun's workers) puts only the script's directory first; python -m (our
    # entry) put the working directory first while the stdlib and torch were imported, so a
    # tokenize.py there (a data-prep script) broke every rank of a script run from elsewhere.
    cwd = probe.parent.parent
    (cwd / "tokenize.py").write_text("raise SystemExit('the tokenize.py of the working directory was imported')\n")
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p)  # "" is the cwd
    rc, out, err = run_boot("pkg/probe.py", "raise", env=env, cwd=cwd)
    plain = subprocess.run([PYTHON, "-u", "pkg/probe.py", "raise"], cwd=cwd, capture_output=True, text=True,
                           env=env, timeout=60)
    assert "working directory was imported" not in err + plain.stderr, err
    assert rc == plain.returncode == 1 and "ValueError: boom in script" in err  # the traceback printed
    assert _report(out) == _report(plain.stdout)


@pytest.mark.parametrize("module", [False, True])
def test_safe_path_keeps_pythonpath_first_like_python_p(probe: Path, tmp_path: Path, module: bool) -> None:
    # PYTHONSAFEPATH=1 (python -P): python puts neither the script's directory nor the working
    # directory first, so the first PYTHONPATH entry is sys.path[0]; boot once overwrote it.
    lib = tmp_path / "lib"
    lib.mkdir()
    env = {**base_env(), "PYTHONSAFEPATH": "1", "PYTHONPATH": f"{lib}{os.pathsep}{base_env().get('PYTHONPATH', '')}"}
    cwd = probe.parent.parent
    target = ["pkg.probe"] if module else ["pkg/probe.py"]
    rc, out, err = run_boot(*target, env=env, cwd=cwd, module=module)
    assert rc == 0, err
    plain = subprocess.run([PYTHON, "-u", *(["-m"] if module else []), *target], cwd=cwd, capture_output=True,
                           text=True, env=env, timeout=60)
    assert _report(out)["path0"] == _report(plain.stdout)["path0"] == str(lib)


def test_module_mode_like_python_m(probe: Path) -> None:
    cwd = probe.parent.parent
    # What the package sees while it imports: python says "-m" there.
    (probe.parent / "__init__.py").write_text("import sys\nprint('INIT argv0', sys.argv[0], flush=True)\n")
    rc, out, err = run_boot("pkg.probe", "x", env=base_env(), cwd=cwd, module=True)
    assert rc == 0, err
    plain = subprocess.run([PYTHON, "-u", "-m", "pkg.probe", "x"], cwd=cwd, capture_output=True,
                           text=True, env=base_env(), timeout=60)
    assert _report(out) == _report(plain.stdout)
    assert "INIT argv0 -m\n" in out and "INIT argv0 -m\n" in plain.stdout
    assert _report(out)["spec"] == "pkg.probe" and _report(out)["argv"][1:] == ["x"]


@pytest.mark.parametrize(("args", "code"), [(["exit", "3"], 3), (["exit", "0"], 0), (["exitmsg"], 1), ([], 0)])
def test_exit_codes_are_the_scripts(probe: Path, args: list[str], code: int) -> None:
    rc, _, err = run_boot(probe, *args, env=base_env())
    assert rc == code, err
    if args == ["exitmsg"]:
        assert err.strip() == "bad things"


def test_exception_traceback_exactly_as_python_and_forwarded(probe: Path, tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    with agent_socket() as agent:
        env = base_env(UNICRON_AGENT_ADDR=agent.addr, RANK="3", LOCAL_RANK="1",
                       TORCHELASTIC_ERROR_FILE=str(error_file))
        rc, _, err = run_boot(probe, "raise", env=env)
        plain = subprocess.run([PYTHON, "-u", str(probe), "raise"], capture_output=True, text=True,
                               env=base_env(), timeout=60)
        assert rc == 1 and plain.returncode == 1
        assert err == plain.stderr  # chained exceptions included, no boot/runpy frames
        exc = agent.wait_for(lambda m: m["t"] == "exc")
        hello = agent.of("hello")[0]
    assert hello["rank"] == 3 and hello["local_rank"] == 1 and hello["pid"] > 0
    assert exc["rank"] == 3 and exc["type"] == "ValueError" and exc["msg"] == "boom in script"
    assert exc["tb"] == plain.stderr
    assert not agent.of("bye")
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "ValueError: boom in script"
    assert record["extraInfo"]["py_callstack"] == plain.stderr and int(record["extraInfo"]["timestamp"]) > 0


@pytest.mark.parametrize("args", [[], ["hard0"]])
def test_hello_and_bye_on_clean_exit(probe: Path, args: list[str]) -> None:
    with agent_socket() as agent:
        rc, _, err = run_boot(probe, *args, env=base_env(UNICRON_AGENT_ADDR=agent.addr))
        assert rc == 0, err
        agent.wait_for(lambda m: m["t"] == "bye")
        assert _kinds(agent) == ["hello", "alive", "bye"]  # alive: its tail is watched


def test_no_agent_everything_is_a_noop(probe: Path) -> None:
    rc, out, err = run_boot(probe, env=base_env())
    assert rc == 0 and err == "" and _report(out)["name"] == "__main__"


def test_agent_gone_never_blocks(probe: Path) -> None:
    # An endpoint nobody binds: messages queue, the exit lingers briefly, then leaves.
    rc, _, err = run_boot(probe, "raise", env=base_env(UNICRON_AGENT_ADDR="ipc:///tmp/uw-nobody-here.sock"),
                          timeout_s=20)
    assert rc == 1 and "ValueError: boom in script" in err


def test_bad_usage_is_one_line(tmp_path: Path) -> None:
    rc, _, err = run_boot(tmp_path / "missing.py", env=base_env())
    assert rc == 2 and err.count("\n") == 1 and "can't open file" in err
    script = write_script(tmp_path, "ok.py", "print('ran')\n")
    rc, out, err = run_boot(script, env=base_env(UNICRON_INJECT="explode@0:1"))
    assert rc == 2 and out == "" and err.count("\n") == 1 and "bad fault spec 'explode@0:1'" in err


def test_parse_argv() -> None:
    assert boot.parse_argv(["s.py", "-x"]) == boot.Target("s.py", ["-x"])
    assert boot.parse_argv(["--module", "m.n", "a"]) == boot.Target("m.n", ["a"], module=True)
    assert boot.parse_argv(["--", "s.py"]) == boot.Target("s.py", [])
    for bad in ([], ["--module"], ["--weird"]):
        with pytest.raises(boot.UsageError):
            boot.parse_argv(bad)


ELASTIC = """
    import sys
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if sys.argv[1] == "raise":
            raise KeyError("from record")
        sys.exit(int(sys.argv[2]))

    if __name__ == "__main__":
        main()
"""


def test_record_decorator_and_its_error_file_win(tmp_path: Path) -> None:
    script = write_script(tmp_path, "elastic.py", ELASTIC)
    error_files = [tmp_path / "raise.json", tmp_path / "exit.json"]
    with workers() as group:  # both at once: each pays for importing torch
        raising = group.boot(script, "raise", env=base_env(TORCHELASTIC_ERROR_FILE=str(error_files[0])))
        exiting = group.boot(script, "exit", "4", env=base_env(TORCHELASTIC_ERROR_FILE=str(error_files[1])))
        (rc, _, err), (rc_exit, _, _) = finish(raising, 100), finish(exiting, 100)
    assert rc == 1 and "KeyError: 'from record'" in err
    written = json.loads(error_files[0].read_text())["message"]
    assert written["message"] == "KeyError: 'from record'"
    # @record's own traceback (it includes its wrapper frame) was kept, not overwritten
    assert "in wrapper" in written["extraInfo"]["py_callstack"]
    assert rc_exit == 4 and not error_files[1].exists()  # an exit code is not an exception


SPAWN = """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Squares(Dataset):  # defined in the script: spawned workers must re-import it
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return torch.tensor([i * i])

    if __name__ == "__main__":
        loader = DataLoader(Squares(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
        print("BATCHES", [b.flatten().tolist() for b in loader])
"""


def test_spawned_dataloader_workers(tmp_path: Path) -> None:
    script = write_script(tmp_path, "spawn.py", SPAWN)
    with agent_socket() as agent, workers() as group:
        proc = group.boot(script, env=base_env(UNICRON_AGENT_ADDR=agent.addr))
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err
        assert "BATCHES [[0, 1], [4, 9]]" in out
        agent.wait_for(lambda m: m["t"] == "bye")
        # the spawned child inherited the environment but never spoke as a worker
        assert _kinds(agent) == ["hello", "alive", "bye"]  # alive: its tail is watched


THREADS_AND_FORK = """
    import os, threading
    import unicron

    def work():
        raise OSError("disk gone in a thread")

    t = threading.Thread(target=work, name="loader")
    t.start()
    t.join()
    pid = os.fork()
    if pid == 0:  # a forked child (like a dataloader worker) must stay silent
        unicron.step()
        os._exit(0)
    os.waitpid(pid, 0)
    unicron.step()
"""


def test_thread_exceptions_forwarded_and_forked_children_silent(tmp_path: Path) -> None:
    script = write_script(tmp_path, "threads.py", THREADS_AND_FORK)
    with agent_socket() as agent:
        rc, _, err = run_boot(script, env=base_env(UNICRON_AGENT_ADDR=agent.addr, RANK="1"))
        assert rc == 0, err
        agent.wait_for(lambda m: m["t"] == "bye")
    assert "OSError: disk gone in a thread" in err  # python's own report still printed
    assert _kinds(agent) == ["hello", "exc", "step", "alive", "bye"]
    exc = agent.of("exc")[0]
    assert exc["type"] == "OSError" and exc["msg"] == "disk gone in a thread" and "in work" in exc["tb"]
    assert exc["fatal"] is False  # only a thread died: the agent must not stop the job
    assert agent.of("step")[0]["step"] == 1


def test_syntax_error_printed_as_python_and_forwarded(tmp_path: Path) -> None:
    script = write_script(tmp_path, "bad.py", "x = 1\ndef (:\n")
    with agent_socket() as agent:
        rc, _, err = run_boot(script, env=base_env(UNICRON_AGENT_ADDR=agent.addr))
        exc = agent.wait_for(lambda m: m["t"] == "exc")
    plain = subprocess.run([PYTHON, "-u", str(script)], capture_output=True, text=True, env=base_env(), timeout=60)
    assert rc == 1 and err == plain.stderr and err.rstrip().endswith("SyntaxError: invalid syntax")
    assert exc["type"] == "SyntaxError" and exc["tb"] == plain.stderr


@pytest.mark.parametrize("kind", ["dir", "zip"])
def test_a_directory_or_zip_with_main_runs_like_python(tmp_path: Path, kind: str) -> None:
    """python DIR (or APP.zip) runs its __main__.py with the path itself first on sys.path
    (torchrun passes such a script on to python)."""
    files = {"helper.py": "VALUE = 42\n",
             "__main__.py": "import json, sys\nimport helper\n"
                            "print('REPORT ' + json.dumps({'name': __name__, 'argv': sys.argv, "
                            "'path0': sys.path[0], 'file': __file__, 'value': helper.VALUE}))\n"}
    app = tmp_path / ("app" if kind == "dir" else "app.zip")
    if kind == "dir":
        app.mkdir()
        for name, text in files.items():
            (app / name).write_text(text)
    else:
        with zipfile.ZipFile(app, "w") as zf:
            for name, text in files.items():
                zf.writestr(name, text)
    rc, out, err = run_boot(app.name, "a", env=base_env(), cwd=tmp_path)
    assert rc == 0, err
    plain = subprocess.run([PYTHON, "-u", app.name, "a"], cwd=tmp_path, capture_output=True, text=True,
                           env=base_env(), timeout=60)
    assert _report(out) == _report(plain.stdout)
    got = _report(out)
    assert got["name"] == "__main__" and got["argv"] == [app.name, "a"] and got["value"] == 42
    assert os.path.samefile(got["path0"], app)


def test_a_removed_working_directory_is_one_line_naming_it(tmp_path: Path) -> None:
    """Acceptance 23B F3: the job's directory removed (a redeploy), then a restart: every rank
    printed a traceback of unicron's own boot (os.path.abspath asks for the gone directory)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    # Only absolute paths: Python itself cannot start with a relative one and no directory.
    env = base_env(PYTHONPATH=str(Path(boot.__file__).resolve().parents[2]))
    proc = subprocess.run(["bash", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "{PYTHON}" -m '
                           "unicron.worker.boot train.py"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"unicron worker: can't open file 'train.py' (the working directory '{gone}' "
                                  "no longer exists)"), proc.stderr
