"""`unicron plan` / `unicron simulate`: through typer's runner, and as a real subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from unicron.errors import InputError, UsageError
from unicron.plan.commands import register

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "plan"


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    register(app)
    return app


def test_plan_json_has_the_promised_fields(app: typer.Typer) -> None:
    result = CliRunner().invoke(app, ["plan", "--input", str(EXAMPLES / "small.json"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"assignment", "objective", "waf", "transfers", "jobs"} <= set(data)
    assert "n1" not in data["assignment"]["a"] and len(data["assignment"]["a"]) == 4
    assert data["transfers"] and all(t["est_s"] >= 0 for t in data["transfers"])


def test_plan_table_and_yaml_input(app: typer.Typer, tmp_path: Path) -> None:
    source = json.loads((EXAMPLES / "small.json").read_text())
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(source))
    result = CliRunner().invoke(app, ["plan", "--input", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    for text in ("lost n1", "WAF", "objective", "state transfers"):
        assert text in result.output


@pytest.mark.parametrize("content, suffix, message", [
    ('{"nodes": [], "jobs": []}', ".json", "nodes: expected a non-empty list"),
    ('{"nodes": [{"name": "n0"}], "jobs": [{"name": "a", "weight": "x", "throughput": {"1": 1}}]}', ".json",
     "jobs[0].weight: expected a number"),
    ('{"nodes": [{"name": "n0"}], "jobs": [{"name": "a", "throughput": {"1": 1}}], "transition_s": 1e308}', ".json",
     "transition_s: must be <= 1e+30, got 1e+308"),  # finite, but its products overflowed to -Infinity
    ("{not json", ".json", "is not valid JSON"),
    ("nodes: [unclosed", ".yaml", "is not valid YAML"),
    ("[" * 100_000 + "]" * 100_000, ".json", "is not valid JSON (maximum recursion depth exceeded"),
    ('{"nodes": [{"name": "n0"}], "horizon_s": ' + "9" * 5000 + "}", ".json",
     "is not valid JSON (Exceeds the limit (4300 digits)"),
    ("a: " + "[" * 5000 + "]" * 5000, ".yaml", "is not valid YAML (maximum recursion depth exceeded"),
])
def test_bad_input_is_one_error_naming_the_field(app: typer.Typer, tmp_path: Path, content: str, suffix: str,
                                                 message: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    result = CliRunner().invoke(app, ["plan", "--input", str(path)])
    assert result.exit_code != 0
    assert isinstance(result.exception, InputError) and message in str(result.exception)


def test_missing_file(app: typer.Typer, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plan", "--input", str(tmp_path / "nope.json")])
    assert isinstance(result.exception, InputError) and "cannot read" in str(result.exception)


def test_a_device_or_a_fifo_as_input_is_refused_without_reading_it(app: typer.Typer, tmp_path: Path) -> None:
    fifo = tmp_path / "cluster.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):  # /dev/zero used to be read until memory ran out; a FIFO, forever
        result = CliRunner().invoke(app, ["plan", "--input", path])
        assert isinstance(result.exception, InputError), result.output
        assert str(result.exception) == f"--input: cannot read {path}: it is not a regular file"


def test_simulate_json_and_plot(app: typer.Typer, tmp_path: Path) -> None:
    plot = tmp_path / "work.png"
    result = CliRunner().invoke(app, [
        "simulate", "--input", str(EXAMPLES / "sim-128gpu.json"), "--trace", str(EXAMPLES / "trace-synthetic.json"),
        "--plot", str(plot), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    names = [p["name"] for p in data["policies"]]
    assert names == ["unicron", "restart", "shrink", "redundancy"]
    assert next(p for p in data["policies"] if p["name"] == "unicron")["ratio_to_unicron"] == pytest.approx(1.0)
    assert all(p["work"] <= data["bound"] for p in data["policies"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_rejects_unknown_policy_and_bad_trace(app: typer.Typer, tmp_path: Path) -> None:
    args = ["simulate", "--input", str(EXAMPLES / "small.json"), "--trace", str(EXAMPLES / "trace-synthetic.json")]
    result = CliRunner().invoke(app, [*args, "--policy", "magic"])
    assert isinstance(result.exception, UsageError) and "--policy" in str(result.exception)
    bad = tmp_path / "trace.json"
    bad.write_text(json.dumps({"duration_s": 100, "events": [{"t": 1, "node": "n99", "kind": "down"}]}))
    result = CliRunner().invoke(app, ["simulate", "--input", str(EXAMPLES / "small.json"), "--trace", str(bad)])
    assert isinstance(result.exception, InputError) and "trace.events[0].node" in str(result.exception)


def _cli_wired() -> bool:
    modules = ("unicron.cli", "unicron.launch.commands", "unicron.coord.commands", "unicron.status.commands")
    return all(importlib.util.find_spec(m) is not None for m in modules)


@pytest.mark.skipif(not _cli_wired(), reason="unicron.cli does not yet import every subsystem's commands")
def test_real_command_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [{"name": "n0"}], "jobs": [{"name": "a", "nodes": ["n9"], "throughput": {"1": 1}}]}')
    proc = subprocess.run([sys.executable, "-m", "unicron", "plan", "--input", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == InputError.exit_code
    assert proc.stderr.strip() == f"unicron: error: {bad}: jobs[0].nodes[0]: unknown node 'n9'"
    assert "Traceback" not in proc.stdout + proc.stderr
    ok = subprocess.run([sys.executable, "-m", "unicron", "plan", "--input", str(EXAMPLES / "small.json"), "--json"],
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["assignment"]["b"]


def test_simulate_refuses_a_plot_path_that_is_no_image_file_before_simulating(app: typer.Typer, tmp_path: Path) -> None:
    """Acceptance 27C F8: ``--plot x.txt`` was an internal error, and ``--plot DIR`` or a path
    without a suffix silently wrote DIR.png."""
    args = ["simulate", "--input", str(EXAMPLES / "small.json"), "--trace", str(EXAMPLES / "trace-synthetic.json")]
    for path, said in ((tmp_path / "x.txt", "does not end in a suffix of an image format (."),
                       (tmp_path / "pd", "does not end in a suffix"), (tmp_path, "is a directory")):
        result = CliRunner().invoke(app, [*args, "--plot", str(path)])
        assert isinstance(result.exception, UsageError), result.output
        assert str(result.exception).startswith(f"--plot: {path} {said}"), result.exception
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_simulate_names_the_flag_of_a_negative_time(app: typer.Typer) -> None:
    args = ["simulate", "--input", str(EXAMPLES / "small.json"), "--trace", str(EXAMPLES / "trace-synthetic.json")]
    result = CliRunner().invoke(app, [*args, "--detect-s", "-1"])
    assert isinstance(result.exception, UsageError) and str(result.exception) == "--detect-s must be >= 0, got -1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, value", [("--detect-s", "nan"), ("--checkpoint-interval-s", "nan"),
                                         ("--restart-s", "inf"), ("--setup-s", "-inf"),
                                         ("--redundancy-overhead", "nan"), ("--redundancy-recovery-s", "inf")])
def test_simulate_refuses_a_non_finite_flag_naming_it(app: typer.Typer, flag: str, value: str) -> None:
    """Acceptance 29C F2: --detect-s nan was an internal error (NaN passes `< 0`); --restart-s inf
    was taken."""
    args = ["simulate", "--input", str(EXAMPLES / "small.json"), "--trace", str(EXAMPLES / "trace-synthetic.json")]
    result = CliRunner().invoke(app, [*args, flag, value])
    assert isinstance(result.exception, UsageError), result.exception
    assert str(result.exception) == f"{flag} must be a finite number, got {float(value)}"


def test_the_coordinator_says_an_ipv6_address_as_host_port_takes_it() -> None:
    from unicron.coord.commands import _listening

    assert _listening("::1", 42489) == "[::1]:42489" and _listening("10.0.0.1", 5) == "10.0.0.1:5"


def test_a_trace_given_to_plan_is_named_with_its_file_and_what_it_is(app: typer.Typer) -> None:
    """Acceptance 28C F6: the error named a field of the file (duration_s), not the file."""
    trace = EXAMPLES / "trace-synthetic.json"
    result = CliRunner().invoke(app, ["plan", "--input", str(trace)])
    assert isinstance(result.exception, InputError), result.output
    assert str(result.exception).startswith(f"{trace}: ") and str(result.exception).endswith(
        "(a failure trace: give it to `unicron simulate --trace`)"), result.exception
