"""`unicron run`'s command line: torchrun's flags, PET_*, UNICRON_*, config files, Slurm, and a
clear UsageError for every bad or contradictory input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import typer

from unicron.errors import ConfigError, UsageError
from unicron.launch import parse_run_args
from unicron.launch.args import InjectSpec, RdzvConf, StdSpec, to_comma_list
from unicron.launch.commands import HelpRequested, register, split_argv
from unicron.launch.slurm import expand_nodelist, slurm_info


def no_gpu(kind: str) -> int | None:
    return {"cpu": 6}.get(kind)


def four_gpus(kind: str) -> int | None:
    return {"cpu": 6, "cuda": 4, "accelerator": 4}.get(kind)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def parse(argv: list[str], env: dict[str, str] | None = None, probe=no_gpu):
    return parse_run_args(argv, env or {}, probe=probe)


# --- torchrun's flags and defaults -----------------------------------------------------------

def test_defaults_match_torchrun_single_node(script: str) -> None:
    cfg = parse([script])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 1, 1)
    # torchrun: a one-node static job without endpoint or port becomes local c10d on a free port
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port) == ("c10d", "localhost", 0)
    assert len(cfg.rdzv_id) == 36 and cfg.rdzv_id.count("-") == 4
    assert cfg.max_restarts == 0 and cfg.monitor_interval == 0.1 and cfg.role == "default"
    assert cfg.master_addr == "127.0.0.1" and cfg.master_port == 29500
    assert cfg.redirects == StdSpec(0) and cfg.tee == StdSpec(0) and cfg.log_dir is None
    assert cfg.signals_to_handle == ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    assert cfg.rdzv_conf == RdzvConf() and cfg.rdzv_conf.join_timeout == 600 and cfg.rdzv_conf.last_call_timeout == 30
    assert cfg.grace_period == 5.0 and cfg.hang_factor == 3.0 and cfg.hang_floor == 1.5
    assert cfg.hang_busy_factor == 5.0 and cfg.hang_busy_floor == 10.0
    assert cfg.hang_warmup_steps == 3 and cfg.first_step_timeout == 300.0
    assert cfg.heartbeat_interval == 0.5 and cfg.heartbeat_timeout == 3.0
    assert cfg.weight == 1.0 and cfg.warm and cfg.status_line == "auto" and cfg.metrics_port is None
    assert cfg.node_rank is None and cfg.injects == () and cfg.uses_boot
    assert cfg.secret_source == "generated" and len(cfg.secret) == 64
    assert cfg.python_exec == sys.executable


def test_both_spellings_and_all_value_flags(script: str, tmp_path: Path) -> None:
    cfg = parse(["--nnodes", "2:4", "--nproc_per_node=3", "--rdzv_backend", "c10d", "--rdzv-endpoint",
                 "head.example:1234", "--rdzv_id", "job7", "--rdzv-conf", "join_timeout=5,last_call_timeout=2,"
                 "read_timeout=9,is_host=true,store_type=tcp", "--max_restarts", "3", "--monitor-interval",
                 "0.5", "--role", "trainer", "--log_dir", str(tmp_path / "logs"), "-r", "0:1,1:2", "-t3",
                 "--local_ranks_filter", "0,2", "--node_rank", "1", "--local-addr", "10.0.0.5",
                 "--signals-to-handle", "SIGTERM,SIGUSR1", "--start-method", "fork",
                 "--duplicate-stdout-filters", "loss,,x,acc", "--max-restarts", "4", script],
                {"UNICRON_SECRET": "s3cret"})
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (2, 4, 3)
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == ("c10d", "head.example", 1234, "job7")
    assert cfg.rdzv_conf == RdzvConf(join_timeout=5, last_call_timeout=2, read_timeout=9, is_host=True,
                                     extra=(("store_type", "tcp"),))
    assert cfg.max_restarts == 4  # the last occurrence wins, as in argparse
    assert cfg.monitor_interval == 0.5 and cfg.role == "trainer" and cfg.log_dir == str(tmp_path / "logs")
    assert cfg.redirects.for_rank(0) == 1 and cfg.redirects.for_rank(1) == 2 and cfg.redirects.for_rank(5) == 0
    assert cfg.tee.for_rank(7) == 3
    assert cfg.local_ranks_filter == frozenset({0, 2}) and cfg.node_rank == 1 and cfg.local_addr == "10.0.0.5"
    assert cfg.signals_to_handle == ("SIGTERM", "SIGUSR1") and cfg.start_method == "fork"
    assert cfg.duplicate_stdout_filters == ("loss,x", "acc")
    assert cfg.secret == b"s3cret" and cfg.secret_source == "UNICRON_SECRET"
    assert cfg.source("nnodes") == "--nnodes" and cfg.source("nproc_per_node") == "--nproc_per_node"


def test_script_args_are_untouched(script: str) -> None:
    tail = ["--nnodes", "9", "-m", "--", "-h", "--help", "--no", "--standalone=3", "-x"]
    cfg = parse(["--nproc-per-node", "2", script, *tail])
    assert cfg.script == script and cfg.script_args == tuple(tail) and cfg.nproc_per_node == 2
    cfg = parse(["--", script, "a"])
    assert cfg.script == script and cfg.script_args == ("a",)


def test_module_no_python_run_path_switches(script: str) -> None:
    cfg = parse(["-m", "pkg.train", "--lr", "1"])
    assert cfg.module and cfg.script == "pkg.train" and cfg.script_args == ("--lr", "1")
    assert parse(["--no-python", "bash", "-c", "true"]).no_python
    cfg = parse(["--run-path", "--no_python", script])  # torchrun: --run-path takes precedence
    assert cfg.run_path and cfg.no_python and cfg.uses_boot
    cfg = parse(["-mr", "3", "pkg"])  # short cluster: -m then -r 3
    assert cfg.module and cfg.redirects == StdSpec(3)


def test_abbreviations_unique_prefixes(script: str) -> None:
    cfg = parse(["--nproc", "2", "--stand", script])
    assert cfg.nproc_per_node == 2 and cfg.standalone


@pytest.mark.parametrize("spec,probe,expected", [
    ("auto", no_gpu, 6), ("cpu", four_gpus, 6), ("gpu", four_gpus, 4), ("auto", four_gpus, 4), ("7", no_gpu, 7)])
def test_nproc_per_node_resolution(script: str, spec: str, probe, expected: int) -> None:
    assert parse(["--nproc-per-node", spec, script], probe=probe).nproc_per_node == expected


def test_nproc_real_probe_cpu(script: str) -> None:
    cfg = parse_run_args(["--nproc-per-node", "cpu", script], {})
    assert cfg.nproc_per_node == len(os.sched_getaffinity(0))


def test_standalone_like_torchrun(script: str) -> None:
    cfg = parse(["--standalone", "--rdzv-endpoint", "h:1", "--rdzv-id", "x", script])
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.standalone) == ("c10d", "localhost:0", True)
    assert cfg.rdzv_id != "x" and any("ignored with --standalone" in w for w in cfg.warnings)
    assert parse(["--standalone", "--nnodes", "1", script]).max_nodes == 1
    # a range that allows one node runs on this one, as torchrun runs it (no secret needed)
    ranged = parse(["--standalone", "--nnodes", "1:4", script])
    assert (ranged.min_nodes, ranged.max_nodes) == (1, 1)
    assert "--standalone runs a single node: --nnodes 1:4 runs as 1" in ranged.warnings


def test_static_endpoint_is_master_addr_and_port(script: str) -> None:
    cfg = parse(["--nnodes", "2", "--master-addr", "10.1.2.3", "--master_port", "4000", "--node-rank", "1",
                 script], {"UNICRON_SECRET": "k"})
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.node_rank) == ("static", "10.1.2.3:4000", 1)
    cfg = parse(["--nnodes", "2", script], {"UNICRON_SECRET": "k"})
    assert cfg.rdzv_endpoint == "127.0.0.1:29500"
    # one node with an explicit master port stays static, as in torchrun
    assert parse(["--master-port", "4001", script]).rdzv_backend == "static"


def test_c10d_and_etcd_default_ports(script: str) -> None:
    env = {"UNICRON_SECRET": "k"}
    assert parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h", script], env).rdzv_port == 29400
    assert parse(["--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h", script], env).rdzv_port == 2379
    assert parse(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "[::1]:5", script], env).rdzv_host == "::1"
    assert parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "::1", script], env).rdzv_host == "::1"  # bare: the default port
    assert parse(["--nnodes", "2", "--rdzv-endpoint", "[fe80::1%eth0]:5", script], env).rdzv_host == "fe80::1%eth0"


def test_inject_specs(script: str) -> None:
    cfg = parse(["--nproc-per-node", "4", "--inject", "kill@1:5", "--inject=exit=3@0:2", "--inject",
                 "slow=0.5@3:1", "--inject", "hang@2:0", "--inject", "exception@0:9", script])
    assert cfg.injects == (InjectSpec("kill", 1, 5), InjectSpec("exit", 0, 2, 3.0), InjectSpec("slow", 3, 1, 0.5),
                           InjectSpec("hang", 2, 0), InjectSpec("exception", 0, 9))
    assert cfg.inject_env == "kill@1:5;exit=3@0:2;slow=0.5@3:1;hang@2:0;exception@0:9"
    assert parse(["--inject", "exit@0:1", script]).injects[0].arg == 1.0
    assert parse(["--inject", "hang@*:4", script]).inject_env == "hang@*:4"
    # On several nodes the world size is not known before the rendezvous (nodes may run
    # different numbers of workers): rank 2 of nodes with 1 and 2 workers exists.
    multi = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:5", "--inject", "kill@2:30", script]
    assert parse(multi, {"UNICRON_SECRET": "s"}).inject_env == "kill@2:30"


def test_unicron_value_flags(script: str, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("abc\n")
    secret.chmod(0o600)
    cfg = parse(["--nnodes", "2", "--grace-period", "1.5", "--hang-factor", "4", "--hang-floor", "2.5",
                 "--hang-busy-factor", "6", "--hang_busy_floor", "30", "--hang-warmup-steps", "0", "--first-step-timeout", "60", "--heartbeat-interval", "0.2",
                 "--heartbeat-timeout", "1", "--secret-file", str(secret), "--coordinator", "coord:7000",
                 "--weight", "2.5", "--no-warm", "--metrics-port", "0", "--status-line", "never", "--no-inject",
                 script], {"UNICRON_SECRET": "ignored-because-the-flag-wins"})
    assert (cfg.grace_period, cfg.hang_factor, cfg.hang_floor, cfg.hang_warmup_steps) == (1.5, 4.0, 2.5, 0)
    assert (cfg.hang_busy_factor, cfg.hang_busy_floor) == (6.0, 30.0)
    assert (cfg.first_step_timeout, cfg.heartbeat_interval, cfg.heartbeat_timeout) == (60.0, 0.2, 1.0)
    assert cfg.secret == b"abc" and cfg.secret_source == "--secret-file" and cfg.secret_file == str(secret)
    assert cfg.coordinator == "coord:7000" and cfg.weight == 2.5 and not cfg.warm
    assert cfg.metrics_port == 0 and cfg.status_line == "never" and cfg.no_inject and not cfg.uses_boot
    assert "abc" not in repr(cfg)


def test_shutdown_timeout_is_grace_period(script: str) -> None:
    assert parse(["--shutdown-timeout", "12", script]).grace_period == 12.0
    assert parse([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).grace_period == 7.0
    assert parse([script], {"PET_SHUTDOWN_TIMEOUT": "8", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).grace_period == 8.0
    assert parse(["--grace-period", "2", script], {"PET_SHUTDOWN_TIMEOUT": "8"}).grace_period == 2.0
    assert parse(["--grace-period", "3", "--shutdown-timeout", "3", script]).grace_period == 3.0


def test_ignored_torchrun_flags_warn(script: str) -> None:
    cfg = parse(["--logs-specs", "mine", "--numa-binding", "node", "--event-log-handler", "console",
                 "--virtual-local-rank", script])
    assert cfg.logs_specs == "mine" and cfg.numa_binding == "node" and cfg.virtual_local_rank
    assert len([w for w in cfg.warnings if "is ignored" in w]) == 3
    # --weight is carried for planning across jobs, which no coordinator does yet (29C F11).
    assert not [w for w in parse([script]).warnings if "weight" in w]
    assert [w for w in parse(["--weight", "2", script]).warnings if w.startswith("--weight is not used yet")]
    assert [w for w in parse([script], {"UNICRON_WEIGHT": "2"}).warnings if "is not used yet" in w]


def test_help_lists_every_flag() -> None:
    with pytest.raises(HelpRequested) as req:
        split_argv(["--nnodes", "2", "--help", "x.py"])
    from unicron.launch.args import OPTIONS

    for opt in OPTIONS:
        assert opt.name in req.value.text
    with pytest.raises(HelpRequested):
        split_argv(["-h"])


def test_typer_run_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    app = typer.Typer(add_completion=False)
    register(app)

    @app.command("other")
    def other() -> None:  # a second command so `run` stays a sub-command
        pass

    with pytest.raises(SystemExit) as done:
        app(args=["run", "--help"], prog_name="unicron", standalone_mode=False)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node" in out and "--inject" in out and "--hang-floor" in out


def test_typer_run_command_reports_usage_errors() -> None:
    app = typer.Typer(add_completion=False)
    register(app)

    @app.command("other")
    def other() -> None:
        pass

    with pytest.raises(UsageError, match="--nnodes: need 0 < MIN <= MAX"):
        app(args=["run", "--nnodes", "3:2", "x.py"], prog_name="unicron", standalone_mode=False)


# --- precedence: flag > environment > Slurm > config file > default -------------------------

@pytest.mark.parametrize("suffix,text", [
    (".toml", 'hang-factor = 7\nhang_floor = 4.5\nno-warm = true\ninject = ["kill@0:1"]\nmax-restarts = 2\n'),
    (".yaml", "hang-factor: 7\nhang_floor: 4.5\nno-warm: true\ninject: [kill@0:1]\nmax-restarts: 2\n"),
    (".json", '{"hang-factor": 7, "hang_floor": 4.5, "no-warm": true, "inject": ["kill@0:1"], "max-restarts": 2}'),
])
def test_config_file_formats(script: str, tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"u{suffix}"
    path.write_text(text)
    cfg = parse(["--config", str(path), script])
    assert (cfg.hang_factor, cfg.hang_floor, cfg.warm, cfg.max_restarts) == (7.0, 4.5, False, 2)
    assert cfg.injects == (InjectSpec("kill", 0, 1),) and cfg.config_file == str(path)
    assert cfg.source("hang_factor") == f"{path}: hang-factor"


def test_precedence_flag_env_file_default(script: str, tmp_path: Path) -> None:
    path = tmp_path / "u.toml"
    path.write_text("hang-factor = 7\nhang-floor = 8\nweight = 3\n")
    env = {"UNICRON_HANG_FACTOR": "6", "UNICRON_HANG_FLOOR": "9", "UNICRON_CONFIG": str(path)}
    cfg = parse(["--hang-factor", "4", script], env)
    assert cfg.hang_factor == 4.0 and cfg.source("hang_factor") == "--hang-factor"  # flag
    assert cfg.hang_floor == 9.0 and cfg.source("hang_floor") == "UNICRON_HANG_FLOOR"  # env over file
    assert cfg.weight == 3.0 and cfg.source("weight") == f"{path}: weight"  # file over default
    assert cfg.first_step_timeout == 300.0 and cfg.source("first_step_timeout") == "default"
    assert parse(["--config", str(path), script], {}).hang_factor == 7.0


def test_pet_variables_as_torchrun_reads_them(script: str) -> None:
    env = {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "5", "PET_STANDALONE": "0",
           "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "h:9", "PET_ROLE": "r", "PET_TEE": "3",
           "UNICRON_SECRET": "k", "PET_MONITOR_INTERVAL": "1"}
    cfg = parse([script], env)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node, cfg.max_restarts) == (1, 3, 2, 5)
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.role, cfg.tee) == ("c10d", "h:9", "r", StdSpec(3))
    assert not cfg.standalone and cfg.source("nnodes") == "PET_NNODES"
    assert parse(["--max-restarts", "1", script], env).max_restarts == 1  # flag beats PET_*
    assert parse([script], {"PET_STANDALONE": "1"}).standalone
    assert parse(["pkg"], {"PET_MODULE": "1"}).module
    assert parse([script], {"PET_NNODES": ""}).max_nodes == 1  # empty means unset


def test_slurm_fills_missing_values(script: str) -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[07-09,12]", "UNICRON_SECRET": "k"}
    cfg = parse([script], env)
    assert (cfg.max_nodes, cfg.node_rank, cfg.rdzv_id) == (4, 2, "4242")
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.master_addr) == ("static", "gpu07:29500", "gpu07")
    cfg = parse(["--rdzv-backend", "c10d", script], env)
    assert cfg.rdzv_endpoint == "gpu07:29400" and cfg.source("rdzv_endpoint") == "SLURM_JOB_NODELIST"
    cfg = parse(["--nnodes", "2", "--node-rank", "0", "--rdzv-id", "mine", script], {**env, "PET_MASTER_ADDR": "m"})
    assert (cfg.max_nodes, cfg.node_rank, cfg.rdzv_id, cfg.master_addr) == (2, 0, "mine", "m")


def test_a_job_sized_apart_from_the_slurm_allocation_ignores_its_node_values(script: str) -> None:
    """Acceptance 19C F1: `srun -N2 unicron run --standalone ...` (one job per node: a sweep,
    evaluation shards) was refused on the second node, whose SLURM_NODEID 1 is an index into
    the allocation, not into a one-node job; torchrun runs it."""
    env = {"SLURM_JOB_ID": "123", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "vm,node2",
           "UNICRON_SECRET": "k"}
    for argv in (["--standalone"], ["--nnodes", "1"], ["--standalone", "--nnodes", "1"]):
        cfg = parse([*argv, "--nproc-per-node", "2", script], env)
        assert (cfg.max_nodes, cfg.node_rank) == (1, None), argv
        assert cfg.rdzv_id != "123"  # two such jobs on one host are not one job
    cfg = parse(["--nproc-per-node", "2", script], {**env, "PET_NNODES": "1"})
    assert (cfg.max_nodes, cfg.node_rank) == (1, None)
    # 19C F9: with an explicit --master-port (several one-node jobs per node) it stays local too.
    cfg = parse(["--nnodes", "1", "--master-port", "38500", script], env)
    assert (cfg.max_nodes, cfg.node_rank, cfg.master_addr) == (1, None, "127.0.0.1")
    assert cfg.rdzv_endpoint == "127.0.0.1:38500"
    # Sized as the allocation is: Slurm's node id and job id are this job's.
    cfg = parse(["--nnodes", "2", "--nproc-per-node", "2", script], env)
    assert (cfg.max_nodes, cfg.node_rank, cfg.rdzv_id) == (2, 1, "123")


def test_slurm_info_and_nodelist() -> None:
    assert slurm_info({}) is None
    assert expand_nodelist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_nodelist("a1,b[2-3],c") == ["a1", "b2", "b3", "c"]
    assert expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    for bad in ("n[1-", "n[3-1]", "n[a-b]", "n]", ""):
        with pytest.raises(ValueError):
            expand_nodelist(bad)
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST: cannot read node list"):
        slurm_info({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-"})
    # Only the first host is needed: a range with a digit too many must not be built in memory.
    info = slurm_info({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[07-999999999999],m[1-3]"})
    assert info is not None and info.first_host == "n07"
    with pytest.raises(ConfigError, match="bad range"):  # a malformed later part is still refused
        slurm_info({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-999999999999],m[x]"})


def test_comma_list_escape() -> None:
    assert to_comma_list("") == () and to_comma_list("a,,b,c") == ("a,b", "c")


# --- every bad input: one clear UsageError ---------------------------------------------------

BAD_FLAGS = [
    (["--nnodes", "3:2"], "--nnodes: need 0 < MIN <= MAX, got '3:2'"),
    (["--nnodes", "0"], "--nnodes: need 0 < MIN <= MAX"),
    (["--nnodes", "a"], "--nnodes: expected N or MIN:MAX, got 'a'"),
    (["--nnodes", "1:2:3"], "--nnodes: expected N or MIN:MAX"),
    (["--nproc-per-node", "0"], "--nproc-per-node: must be at least 1, got 0"),
    (["--nproc_per_node", "many"], "--nproc_per_node: expected an integer, auto, cpu, gpu or xpu; got 'many'"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node: gpu: CUDA is not available"),
    (["--nproc-per-node", "xpu"], "--nproc-per-node: xpu: XPU is not available"),
    (["--rdzv-backend", "zk"], "--rdzv-backend: unknown rendezvous backend 'zk'"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint: bad endpoint 'h:99999'"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x"], "--rdzv-endpoint: bad endpoint 'h:x'"),
    (["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "host"], "the port is missing"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h o:1"], "bad endpoint 'h o:1'"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0"], "port 0 cannot be found"),
    # Brackets that do not close, text after them, a third colon: refused, not joined for 600 s
    (["--nnodes", "2", "--rdzv-endpoint", "[::1"], "--rdzv-endpoint: bad endpoint '[::1'"),
    (["--nnodes", "2", "--rdzv-endpoint", "[::1]x:5"], "bad endpoint '[::1]x:5'"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400:1"], "bad endpoint '127.0.0.1:29400:1'"),
    (["--master-addr", "a:b"], "--master-addr: not a host name or address: 'a:b'"),
    (["--rdzv-id", "a/b"], "--rdzv-id: must be letters"),
    (["--rdzv-conf", "join_timeout"], "--rdzv-conf: expected KEY=VALUE,...; bad item 'join_timeout'"),
    (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf: join_timeout: not a number: 'soon'"),
    (["--rdzv-conf", "last_call_timeout=-1"], "--rdzv-conf: last_call_timeout: must be > 0"),
    (["--rdzv-conf", "is_host=maybe"], "is_host: not a boolean"),
    (["--standalone", "--nnodes", "2"], "--standalone runs a single node; it contradicts --nnodes 2:2"),
    (["--max-restarts", "-1"], "--max-restarts: must be >= 0, got -1"),
    (["--max-restarts", "x"], "--max-restarts: not an integer: 'x'"),
    (["--monitor-interval", "0"], "--monitor-interval: must be > 0"),
    (["--monitor-interval", "nan"], "not a finite number"),
    (["--start-method", "thread"], "--start-method: must be one of spawn, fork, forkserver; got 'thread'"),
    (["--role", ""], "--role: must not be empty"),
    (["-r", "4"], "-r: expected 0-3 or LOCAL_RANK:0-3"),
    (["--tee", "0:1,x"], "--tee: expected 0-3"),
    (["--local-ranks-filter", "a,b"], "--local-ranks-filter: expected comma-separated local ranks"),
    (["--node-rank", "-1"], "--node-rank: must be >= 0, got -1"),
    (["--node-rank", "2", "--nnodes", "2", "--secret-file", "/nonexistent"], "--node-rank: node rank 2 must be below"),
    (["--node-rank", "1"], "node rank 1 must be below the number of nodes (1, from default)"),
    (["--master-port", "70000"], "--master-port: port must be 0..65535"),
    (["--master-addr", "a b"], "--master-addr: not a host name"),
    (["--numa-binding", "all"], "--numa-binding: must be one of node, socket, exclusive, core-complex"),
    (["--signals-to-handle", "SIGNOPE"], "--signals-to-handle: unknown signal 'SIGNOPE'"),
    (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
    (["--shutdown-timeout", "-2"], "--shutdown-timeout: must be >= 0"),
    (["--grace-period", "1", "--shutdown-timeout", "2"], "--grace-period 1 contradicts --shutdown-timeout 2"),
    (["--no-python", "-m"], "--no-python and -m cannot be used together"),
    (["--run-path", "--module"], "--run-path runs a file; it cannot be combined with --module"),
    (["--inject", "kill"], "--inject: bad fault spec 'kill': expected KIND@RANK:STEP (RANK a global rank or *)"),
    (["--inject", "boom@0:1"], "--inject: bad fault spec 'boom@0:1': unknown kind 'boom'"),
    (["--inject", "kill=2@0:1"], "--inject: bad fault spec 'kill=2@0:1': kill takes no value"),
    (["--inject", "exit=\u00b3@0:1"], "exit code must be an integer 0..255"),
    (["--inject", "exit=300@0:1"], "exit code must be an integer 0..255"),
    (["--inject", "slow=-1@0:1"], "slow needs a number of seconds above 0 and below 1e6"),
    (["--inject", "slow=1e7@0:1"], "slow needs a number of seconds above 0 and below 1e6"),
    (["--inject", "kill@-1:1"], "expected KIND@RANK:STEP"),
    (["--inject", "kill@2:1", "--nproc-per-node", "2"], "rank 2 does not exist (world size 2)"),
    (["--nproc-per-node", "99999999999"], "--nproc-per-node: at most 1024 workers per node, got 99999999999"),
    (["--heartbeat-timeout", "0.1"], "--heartbeat-timeout (0.1s) must be longer than the default --heartbeat-interval (0.5s)"),
    (["--inject", "kill@0:1", "--no-inject"], "--inject needs unicron's worker hooks; it contradicts --no-inject"),
    (["--inject", "kill@0:1", "--no-python"], "--inject needs a Python worker"),
    (["--grace-period", "-1"], "--grace-period: must be >= 0"),
    (["--hang-factor", "1"], "--hang-factor: must be > 1, got 1"),
    (["--hang-floor", "0"], "--hang-floor: must be > 0"),
    (["--hang-warmup-steps", "1.5"], "--hang-warmup-steps: not an integer: '1.5'"),
    (["--first-step-timeout", "0"], "--first-step-timeout: must be > 0"),
    (["--heartbeat-interval", "2", "--heartbeat-timeout", "1"], "--heartbeat-timeout (1s) must be longer than --heartbeat-interval (2s)"),
    (["--coordinator", "host"], "--coordinator: bad endpoint 'host': the port is missing"),
    (["--coordinator", "host:0"], "port 0 cannot be joined"),
    (["--weight", "0"], "--weight: must be > 0"),
    (["--metrics-port", "-5"], "--metrics-port: port must be 0..65535"),
    (["--status-line", "sometimes"], "--status-line: must be one of auto, always, never"),
    (["--secret-file", "/nonexistent/secret"], "--secret-file: cannot read secret file /nonexistent/secret"),
    (["--nnodes", "2"], "this job (2 nodes) needs the same secret on every node: set UNICRON_SECRET or pass --secret-file PATH"),
    (["--nnodes", "1:2"], "this job (up to 2 nodes) needs the same secret on every node"),
    (["--coordinator", "c:1"], "(--coordinator c:1) needs the same secret"),
    (["--bogus"], "unrecognized option --bogus"),
    (["--nnode=2x"], "--nnode: expected N or MIN:MAX"),
    (["--nprocs-per-node", "2"], "unrecognized option --nprocs-per-node (did you mean --nproc-per-node?)"),
    (["--no", "x"], "ambiguous option --no: could be"),
    (["-z"], "unrecognized option -z"),
    (["--standalone=1"], "--standalone takes no value"),
    (["--nnodes", "--standalone"], "--nnodes: expected a value"),
    (["--config", "/nonexistent.toml"], "/nonexistent.toml: cannot read config file"),
    # read, it would fill memory (it used to); a FIFO is below
    (["--config", "/dev/zero"], "/dev/zero: cannot read config file: it is not a regular file"),
    (["--config", "/"], "/: cannot read config file: it is a directory"),
    (["--secret-file", "/dev/zero"], "--secret-file: cannot read secret file /dev/zero: it is not a regular file"),
]


def test_a_fifo_or_an_oversized_file_as_config_is_refused_without_reading_it(script: str, tmp_path: Path) -> None:
    fifo = tmp_path / "settings.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(UsageError, match="settings.toml: cannot read config file: it is not a regular file"):
        parse(["--config", str(fifo), script])
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(UsageError, match="big.toml: cannot read config file: it is 2097152 bytes, more than"):
        parse(["--config", str(big), script])


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_one_clear_usage_error(script: str, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse([*argv, script])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv,message", [
    ([], "missing the training script"),
    (["--nnodes", "2"], "missing the training script"),
    (["--"], "missing the training script after --"),
    (["--nnodes"], "--nnodes: expected a value"),
    (["-r"], "-r: expected a value"),
    (["missing.py"], "training script not found: missing.py"),
])
def test_missing_script(script: str, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse(argv)


def test_a_directory_is_a_script_only_with_a_main(tmp_path, monkeypatch) -> None:
    """python DIR runs DIR/__main__.py, so torchrun accepts such a directory; one without it is
    refused up front, in words that say what is wrong."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    with pytest.raises(UsageError, match="training script app is a directory without a __main__.py"):
        parse(["app"])
    (tmp_path / "app" / "__main__.py").write_text("print('hi')\n")
    assert parse(["--nproc-per-node", "1", "app"]).nproc_per_node == 1


BAD_ENV = [
    ({"UNICRON_HANG_FACTOR": "x"}, "UNICRON_HANG_FACTOR: not a number: 'x'"),
    ({"PET_NNODES": "2:1"}, "PET_NNODES: need 0 < MIN <= MAX"),
    ({"PET_STANDALONE": "yes"}, "PET_STANDALONE: expected an integer (1 on, 0 off); got 'yes'"),
    ({"UNICRON_NO_WARM": "maybe"}, "UNICRON_NO_WARM: expected 1/0, true/false, yes/no; got 'maybe'"),
    ({"UNICRON_INJECT": "kill@0:1;nope"}, "UNICRON_INJECT: bad fault spec 'nope': expected KIND@RANK:STEP"),
    ({"UNICRON_INJECT": ";;"}, "UNICRON_INJECT: no value in ';;'"),
    ({"PET_MASTER_PORT": "http"}, "PET_MASTER_PORT: not an integer: 'http'"),
    ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "zero"}, "SLURM_NNODES: expected N or MIN:MAX"),
    ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "5", "UNICRON_SECRET": "k"}, "SLURM_NODEID: node rank 5 must be below"),
    ({"UNICRON_CONFIG": "/nope.ini"}, "/nope.ini: cannot read config file"),
]


@pytest.mark.parametrize("env,message", BAD_ENV, ids=[next(iter(e)) + str(i) for i, (e, _) in enumerate(BAD_ENV)])
def test_bad_environment_names_its_variable(script: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError if "SLURM_NODEID" not in message else UsageError) as err:
        parse([script], env)
    assert message in str(err.value)


@pytest.mark.parametrize("name,text,message", [
    ("c.toml", "hang-factor = 'x'\n", "c.toml: hang-factor: not a number: 'x'"),
    ("c.toml", "hang-factor = [\n", "c.toml: not valid TOML"),
    ("c.yaml", "- a\n- b\n", "c.yaml: expected a table of settings"),
    ("c.json", "{", "c.json: not valid JSON"),
    ("c.json", '{"hang-facter": 2}', "c.json: unknown setting 'hang-facter' (did you mean hang-factor?)"),
    ("c.json", '{"config": "other.json"}', "unknown setting 'config'"),
    ("c.toml", "nproc = 2\n", "c.toml: unknown setting 'nproc' (did you mean nproc-per-node?)"),
    ("c.toml", "max_restart = 2\n", "c.toml: unknown setting 'max_restart' (did you mean max-restarts?)"),
    ("c.json", '{"weight": true}', "c.json: weight: expected a string or number, got true"),
    ("c.json", '{"no-warm": "perhaps"}', "c.json: no-warm: expected 1/0"),
    ("c.ini", "x=1", "c.ini: config file must end in .toml, .yaml, .yml or .json"),
    ("c.toml", "nproc-per-node = 2\nnproc_per_node = 3\n",
     "c.toml: nproc-per-node is set twice ('nproc-per-node', 'nproc_per_node')"),
    ("c.json", '{"max-restarts": 1, "max-restarts": 2}', "c.json: not valid JSON: 'max-restarts' appears twice"),
    ("c.yaml", "max-restarts: 1\nmax-restarts: 2\n", "c.yaml: not valid YAML: 'max-restarts' appears twice"),
    ("c.toml", "\udcff\udcfe = 1", "c.toml: not UTF-8 text (byte 0)"),
    ("c.yaml", "nproc-per-node: 2024-06-01\n", "c.yaml: nproc-per-node: "),  # a date, given as its text
    ("c.toml", "nproc-per-node = 1979-05-27T07:32:00\n", "c.toml: nproc-per-node: "),
    ("c.yaml", "rdzv-id: !!set {a, b}\n", "c.yaml: rdzv-id: expected a string or number, got a set"),
    ("c.yaml", "rdzv-id: !!binary aGVsbG8=\n", "c.yaml: rdzv-id: expected a string or number, got a bytes"),
])
def test_bad_config_file_names_file_and_key(script: str, tmp_path: Path, name: str, text: str, message: str) -> None:
    (tmp_path / name).write_bytes(text.encode("utf-8", "surrogateescape"))  # \udcff: the byte 0xff
    with pytest.raises(ConfigError) as err:
        parse(["--config", str(tmp_path / name), script])
    assert message in str(err.value)


def test_secret_sources(script: str, tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.write_text("from-file")
    path.chmod(0o644)
    cfg = parse(["--nnodes", "2", script], {"UNICRON_SECRET_FILE": str(path)})
    assert cfg.secret == b"from-file" and cfg.secret_source == "UNICRON_SECRET_FILE"
    assert any("readable by others" in w for w in cfg.warnings)
    cfg = parse(["--nnodes", "2", script], {"UNICRON_SECRET_FILE": str(path), "UNICRON_SECRET": "env"})
    assert cfg.secret == b"env"  # UNICRON_SECRET beats a secret file from the environment
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(UsageError, match="is empty"):
        parse(["--secret-file", str(empty), script])
    assert parse(["--standalone", script]).secret != parse(["--standalone", script]).secret


def test_config_file_may_be_json_with_null_top(script: str, tmp_path: Path) -> None:
    (tmp_path / "e.yaml").write_text("")
    assert parse(["--config", str(tmp_path / "e.yaml"), script]).config_file == str(tmp_path / "e.yaml")
    (tmp_path / "n.json").write_text(json.dumps({"nproc_per_node": 3, "rdzv-conf": "join_timeout=7"}))
    cfg = parse(["--config", str(tmp_path / "n.json"), script])
    assert cfg.nproc_per_node == 3 and cfg.rdzv_conf.join_timeout == 7.0


def test_inject_env_is_what_the_worker_parses(script: str) -> None:
    """Contract with unicron.worker.inject: the UNICRON_INJECT the agent hands on parses to the
    same faults the user asked for."""
    from unicron.worker.inject import parse_inject_spec

    specs = ["kill@1:5", "exit=3@0:2", "exit@2:2", "slow=0.25@*:1", "hang@3:0", "exception@0:9"]
    cfg = parse(["--nproc-per-node", "4", *[f"--inject={s}" for s in specs], script])
    faults = parse_inject_spec(cfg.inject_env)
    assert [(f.kind, f.rank, f.step, None if f.value is None else float(f.value)) for f in faults] == \
           [(i.kind, i.rank, i.step, i.arg) for i in cfg.injects]


def test_a_date_in_a_config_file_is_taken_as_the_text_written(script: str, tmp_path: Path) -> None:
    # YAML and TOML read an unquoted 2024-06-01 as a date: a date-named job id is plausible.
    (tmp_path / "c.yaml").write_text("rdzv-id: 2024-06-01\n")
    (tmp_path / "c.toml").write_text("rdzv_id = 2024-06-01\n")
    assert parse(["--config", str(tmp_path / "c.yaml"), script]).rdzv_id == "2024-06-01"
    assert parse(["--config", str(tmp_path / "c.toml"), script]).rdzv_id == "2024-06-01"


def test_counts_past_64_bits_are_taken_as_unlimited_and_huge_seconds_refused(script: str, tmp_path: Path) -> None:
    """Acceptance 27C F1/F3/F9/F11: torchrun takes --max-restarts 2**63 (and --log-dir ''); under
    unicron the first made every join be dropped by the node's own coordinator (the mesh carries
    64-bit numbers), --grace-period 1e308 made an infinite stop timeout (an internal error), and
    --heartbeat-interval 1e-9 spun the agent."""
    from unicron.launch.values import INT_CAP

    assert parse(["--max-restarts", str(2**63), script]).max_restarts == INT_CAP
    assert parse(["--hang-warmup-steps", str(2**64 - 1), script]).hang_warmup_steps == INT_CAP
    (tmp_path / "c.json").write_text(json.dumps({"max-restarts": 2**63}))
    assert parse(["--config", str(tmp_path / "c.json"), script]).max_restarts == INT_CAP
    assert parse(["--max-restarts", "5", script]).max_restarts == 5
    for flag in ("--grace-period", "--hang-floor", "--heartbeat-timeout", "--weight"):
        with pytest.raises(UsageError, match=rf"{flag}: must be at most 1e\+09, got 1e308"):
            parse([flag, "1e308", script])
    with pytest.raises(UsageError, match=r"--heartbeat-interval: must be >= 0.01, got 1e-9"):
        parse(["--heartbeat-interval", "1e-9", script])
    assert parse(["--log-dir", "", script]).log_dir is None


def test_small_parity_points_of_pass_27(script: str) -> None:
    """Acceptance 27C F13: torchrun runs /dev/null (python does); a one-node job given only
    --master-addr was told it is "only used by the static backend without --rdzv-endpoint",
    which is the very setup: the reason is that it rendezvouses locally."""
    assert parse(["/dev/null"]).script == "/dev/null"
    cfg = parse(["--master-addr", "localhost", script])
    assert list(cfg.warnings) == ["--master-addr is not used by a one-node job without --master-port: it rendezvouses "
                            "on this host, as torchrun's does"], cfg.warnings
    both = parse(["--master-addr", "localhost", "--master-port", "29600", "--rdzv-endpoint", "h:1", script])
    assert list(both.warnings) == ["--master-addr and --master-port are only used by the static backend without "
                             "--rdzv-endpoint"], both.warnings


def test_no_inject_on_the_command_line_overrides_an_inject_from_the_environment(script: str) -> None:
    """Acceptance 28C F10: a UNICRON_INJECT left in the environment made --no-inject on the
    command line an error, where flag > environment holds for every other setting."""
    cfg = parse(["--no-inject", script], {"UNICRON_INJECT": "kill@0:1"})
    assert cfg.no_inject and cfg.injects == () and "UNICRON_INJECT is overridden by --no-inject" in cfg.warnings
    cfg = parse(["--inject", "kill@0:1", script], {"UNICRON_NO_INJECT": "1"})
    assert not cfg.no_inject and len(cfg.injects) == 1
    with pytest.raises(UsageError, match="contradicts --no-inject"):
        parse(["--inject", "kill@0:1", "--no-inject", script])
