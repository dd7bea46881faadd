"""Restart policy: escalation, crash-loop guard, budget and backoff (pure, clock passed in)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron.detect.classify import classify
from unicron.detect.faults import Action, Fault, Severity
from unicron.detect.policy import Decision, FailureRecord, RestartPolicy, StopReason, replayed_only
from unicron.errors import CrashLoopError, FatalUserError, RestartBudgetExceeded, WorkerFailedError

POLICY = RestartPolicy(crash_loop_limit=3, reattempt_window_s=30.0, backoff_first_s=1.0, backoff_cap_s=30.0)

KINDS: dict[str, dict[str, object]] = {
    "crash": {"kind": "exit", "exitcode": -11},
    "kill": {"kind": "exit", "exitcode": -9},  # a SIGKILL from outside (or an OOM kill unicron saw no trace of)
    "term": {"kind": "exit", "exitcode": -15},
    "conn": {"kind": "exit", "exitcode": 1, "stderr_tail": "RuntimeError: Connection reset by peer"},
    "lost": {"kind": "node_lost", "rank": None},
    "oom": {"kind": "exception", "error_type": "torch.OutOfMemoryError", "message": "CUDA out of memory"},
    "import": {"kind": "exception", "error_type": "ModuleNotFoundError", "message": "No module named 'x'"},
    "clean": {"kind": "exit", "exitcode": 0},
    "hang": {"kind": "hang", "rank": None, "message": "no step completed for 4.0 s"},
    "bug": {"kind": "exception", "error_type": "KeyError", "message": "'learning_rate'"},
    "bug2": {"kind": "exception", "error_type": "KeyError", "message": "'warmup_steps'"},
    "http503": {"kind": "exception", "error_type": "requests.exceptions.HTTPError", "message": "503 Server Error"},
    "argparse": {"kind": "exit", "exitcode": 2, "stderr_tail": "usage: t.py [-h]\nt.py: error: unrecognized arguments: --lr"},
}


class Job:
    """Feeds failures through the policy the way the coordinator does, keeping the history."""

    def __init__(self, max_restarts: int = 10, elastic: bool = False, policy: RestartPolicy = POLICY) -> None:
        self.history: list[FailureRecord] = []
        self.attempt = 0
        self.max_restarts = max_restarts
        self.elastic = elastic
        self.policy = policy
        self.decisions: list[Decision] = []

    def fail(self, what: str, now: float, progress: int | None, rank: int | None = 1, node: str = "n1", *,
             reached: int | None = None, restored_from: int | None = None, trained: bool = False) -> Decision:
        spec = dict(KINDS[what])
        kind = str(spec.pop("kind"))
        if "rank" in spec:
            rank = spec.pop("rank")  # type: ignore[assignment]
        steps = 0 if progress == 0 else progress
        fault = Fault(kind, now, rank=rank, node=node, attempt=self.attempt, steps_completed=steps, **spec)  # type: ignore[arg-type]
        c = classify(fault)
        replayed = replayed_only(self.history, restored_from, reached, c.rule, progress, c.error)
        d = self.policy.decide(self.history, fault, c, now, max_restarts=self.max_restarts,
                               steps_completed_since_last_restart=progress, elastic=self.elastic, replayed=replayed,
                               trained=trained)
        self.decisions.append(d)
        if d.action is not Action.NONE:
            self.history.append(d.record(fault, c, progress, now, reached=reached, restored_from=restored_from,
                                         replayed=replayed, trained=trained))
        if d.action in (Action.REATTEMPT, Action.RESTART, Action.RECONFIGURE):
            self.attempt += 1
        return d


def test_a_hang_is_at_its_culprits_place_and_nowhere_without_one() -> None:
    # A crash of rank 1, then (after the restart, no step) a hang on the same node: without a
    # culprit it is not "rank 1 failed again" (it used to stop the job with restarts left).
    fixed = Job(elastic=False)
    fixed.fail("crash", 1.0, 50, rank=1)
    d = fixed.fail("hang", 2.0, 0)
    assert d.action is Action.RESTART and not d.escalated, d.reason
    # A hang whose one culprit is rank 1 is at rank 1's place: the restart failed again there.
    named = Job(elastic=False)
    named.fail("crash", 1.0, 50, rank=1)
    spec = dict(KINDS["hang"], culprit_ranks=(1,))
    fault = Fault(str(spec.pop("kind")), 2.0, node="n1", attempt=1, steps_completed=0, **spec)  # type: ignore[arg-type]
    d = POLICY.decide(named.history, fault, classify(fault), 2.0, max_restarts=10,
                      steps_completed_since_last_restart=0, elastic=False)
    assert d.action is Action.STOP and d.stop is StopReason.CANNOT_RECONFIGURE and "rank 1" in d.reason


def test_info_is_not_a_failure_and_spends_nothing() -> None:
    job = Job(max_restarts=0)
    d = job.fail("clean", 1.0, 10)
    assert (d.action, d.restarts_used, d.to_error()) == (Action.NONE, 0, None)
    assert job.history == []


def test_fatal_stops_at_once_with_the_user_error() -> None:
    job = Job(max_restarts=100)
    d = job.fail("import", 1.0, 0)
    assert d.action is Action.STOP and d.stop is StopReason.FATAL
    assert "user error" in d.reason and "No module named" in d.reason
    err = d.to_error()
    assert isinstance(err, FatalUserError) and err.exit_code == 1


def test_user_error_of_unknown_progress_is_restarted_once_then_fatal() -> None:
    # A script without step reports that fails past start-up: maybe a lazy import that fails once.
    job = Job(max_restarts=100)
    first = job.fail("import", 1.0, None)
    assert first.action is Action.RESTART and job.history[-1].rule == "user-error-unknown-progress"
    again = job.fail("import", 5.0, None)  # the same error right after the restart: it will not go away
    assert again.action is Action.STOP and again.stop is StopReason.FATAL
    assert "came back after a restart" in again.reason and "No module named" in again.reason
    assert isinstance(again.to_error(), FatalUserError)
    # A user error is FATAL however it was first classified (29C F8: "SEV2 stop: user error"),
    # and the stop does not repeat the first time's "the same error again ... stops the job".
    assert again.severity is Severity.FATAL and "stops the job" not in again.reason


@pytest.mark.parametrize("between", ["crash", "conn"])
def test_user_error_of_unknown_progress_is_fatal_only_when_it_repeats_at_once(between: str) -> None:
    job = Job(max_restarts=100)
    assert job.fail("import", 1.0, None).action is Action.RESTART
    assert job.fail(between, 5.0, None).action is not Action.STOP
    assert job.fail("import", 9.0, None).action is Action.RESTART  # not right after the first one
    # Every rank fails alike; the root cause is whichever is seen first: the rank does not matter.
    other = Job(max_restarts=100)
    assert other.fail("import", 1.0, None).action is Action.RESTART
    assert other.fail("import", 5.0, None, rank=0).stop is StopReason.FATAL


def test_reattempt_escalates_to_restart_within_window_only() -> None:
    job = Job()
    assert job.fail("conn", 100.0, 5).action is Action.REATTEMPT
    d = job.fail("conn", 110.0, 5)
    assert d.action is Action.RESTART and d.escalated and "escalated to restart" in d.reason
    # Outside the window a transient fault is a new, independent reattempt.
    job2 = Job()
    job2.fail("conn", 100.0, 5)
    d2 = job2.fail("conn", 200.0, 5)
    assert d2.action is Action.REATTEMPT and not d2.escalated


def test_an_escalated_restart_that_fails_again_never_steps_back_to_reattempt() -> None:
    """Acceptance 33A F4: reattempt, then restart (escalated), then the same transient failure
    within the window was reattempted again: the ladder stepped back down."""
    job = Job()
    actions = [job.fail("conn", t, 4) for t in (100.0, 101.0, 102.0, 103.0)]
    assert [d.action for d in actions] == [Action.REATTEMPT, Action.RESTART, Action.RESTART, Action.RESTART]
    assert all(d.escalated for d in actions[1:]) and "stays at restart" in actions[2].reason
    # After any restart that failed within the window, too; outside it, a reattempt again.
    other = Job()
    assert other.fail("crash", 100.0, 4).action is Action.RESTART
    assert other.fail("conn", 110.0, 4).action is Action.RESTART
    later = Job()
    later.fail("crash", 100.0, 4)
    d = later.fail("conn", 200.0, 4)
    assert d.action is Action.REATTEMPT and not d.escalated


def test_restart_failing_again_in_place_without_progress() -> None:
    elastic = Job(elastic=True)
    assert elastic.fail("crash", 1.0, 50, rank=3).action is Action.RESTART
    d = elastic.fail("crash", 2.0, 0, rank=3)
    assert d.action is Action.RECONFIGURE and d.escalated
    fixed = Job(elastic=False)
    fixed.fail("crash", 1.0, 50, rank=3)
    d = fixed.fail("crash", 2.0, 0, rank=3)
    assert d.action is Action.STOP and d.stop is StopReason.CANNOT_RECONFIGURE and d.escalated
    assert "not elastic" in d.reason and "rank 3" in d.reason
    assert type(d.to_error()) is WorkerFailedError
    # Elsewhere, or after progress, it is an ordinary restart.
    other = Job()
    other.fail("crash", 1.0, 50, rank=3, node="a")
    assert other.fail("crash", 2.0, 0, rank=4, node="b").action is Action.RESTART
    progressed = Job()
    progressed.fail("crash", 1.0, 50, rank=3)
    assert progressed.fail("crash", 2.0, 7, rank=3).action is Action.RESTART


@pytest.mark.parametrize("elastic", [False, True])
def test_a_kill_from_outside_after_a_restart_is_no_failure_of_the_script(elastic: bool) -> None:
    # Acceptance 33B F1: rank 1 killed at step 10, then SIGKILLed from outside during the
    # restart's rendezvous, stopped the job saying "what failed points at the script".
    job = Job(elastic=elastic, policy=RestartPolicy(crash_loop_limit=5))  # (the guard is below)
    assert job.fail("kill", 1.0, 10, rank=1).action is Action.RESTART
    d = job.fail("kill", 2.0, 0, rank=1)
    assert d.action is Action.RESTART and not d.escalated, d.reason
    # Nor is the script's own failure right after a kill a repeat of anything: the first one is restarted ...
    assert job.fail("crash", 3.0, 0, rank=1).action is Action.RESTART
    # ... and only the script failing alike again in place, with no step between, stops (or reconfigures).
    d = job.fail("crash", 4.0, 0, rank=1)
    assert d.action is (Action.RECONFIGURE if elastic else Action.STOP) and d.escalated
    # A termination signal from outside is the same; the crash-loop guard still bounds kills.
    term = Job(elastic=elastic)
    term.fail("crash", 1.0, 10, rank=1)
    assert term.fail("term", 2.0, 0, rank=1).action is Action.RESTART
    assert term.fail("kill", 3.0, 0, rank=1).action is Action.RESTART
    d = term.fail("kill", 4.0, 0, rank=1)
    assert d.action is Action.STOP and d.stop is StopReason.CRASH_LOOP


def test_sev1_reconfigures_only_when_elastic() -> None:
    assert Job(elastic=True).fail("lost", 1.0, 10).action is Action.RECONFIGURE
    d = Job(elastic=False).fail("lost", 1.0, 10)
    assert d.action is Action.RESTART and "not elastic" in d.reason and d.severity is Severity.SEV1


def test_crash_loop_guard_message() -> None:
    job = Job(max_restarts=100)
    # Each failure on another node, so escalation in place does not stop the job first.
    job.fail("crash", 1.0, 20, rank=0, node="a")  # attempt 0 made progress
    job.fail("crash", 2.0, 0, rank=1, node="b")  # restart 1: no step
    job.fail("crash", 3.0, 0, rank=2, node="c")  # restart 2: no step
    d = job.fail("crash", 4.0, 0, rank=3, node="d")  # restart 3: no step -> loop
    assert d.action is Action.STOP and d.stop is StopReason.CRASH_LOOP
    # The root cause first, then what ended the healing (docs/cli.md; acceptance 29C F2).
    assert d.reason.startswith("rank 3") and d.reason.endswith("; crash loop: 3 restarts without completing a step")
    assert isinstance(d.to_error(), CrashLoopError)


def test_restored_attempts_that_only_replay_earlier_steps_are_a_crash_loop() -> None:
    # A rank raises after its optimizer step and before commit(): each attempt restores step 6,
    # redoes step 7 (progress 1) and fails again; the restore is exact, so it always will.
    job = Job(max_restarts=100)
    job.fail("crash", 1.0, 7, rank=1, reached=7, restored_from=0)
    rule = job.history[-1].rule
    assert replayed_only(job.history, 6, 7, rule, 1)
    assert not replayed_only(job.history, 6, 8, rule, 2)  # got further
    assert not replayed_only(job.history, 6, 7, "hang", 1)  # failed another way
    assert not replayed_only(job.history, 6, 7, rule, None)  # no evidence
    assert not replayed_only(job.history, 0, 7, rule, 7) and not replayed_only(job.history, None, 7, rule, 7)
    assert not replayed_only([], 6, 7, rule, 1)  # nothing earlier to compare with
    for n in (1, 2):
        d = job.fail("crash", 1.0 + n, 1, rank=1, reached=7, restored_from=6)
        assert d.action is Action.RESTART and job.history[-1].replayed
    d = job.fail("crash", 4.0, 1, rank=1, reached=7, restored_from=6)
    assert d.action is Action.STOP and d.stop is StopReason.CRASH_LOOP
    assert "; crash loop: 3 restarts without completing a step that an earlier attempt had not already completed" \
        in d.reason and d.reason.startswith("rank 1")


def test_progress_after_a_fresh_start_or_unrelated_faults_is_no_replay() -> None:
    # A node lost with its snapshots: the job starts over from step 0 and makes progress,
    # restored attempt after restored attempt, each short of where the first attempt got.
    fresh = Job(max_restarts=100)
    fresh.fail("lost", 1.0, 1050, rank=None, reached=1050, restored_from=1000)
    fresh.fail("crash", 2.0, 400, rank=1, reached=400, restored_from=0)
    for n, (start, end) in enumerate([(400, 700), (700, 900), (900, 1000), (1000, 1020)]):
        assert fresh.fail("crash", 3.0 + n, end - start, rank=1, reached=end, restored_from=start).action \
            is Action.RESTART
    assert not any(r.replayed for r in fresh.history)
    # Different failures, each after a restore of the same step: not one failure replayed.
    mixed = Job(max_restarts=100)
    mixed.fail("crash", 1.0, 50, rank=1, reached=1050, restored_from=1000)
    for n, what in enumerate(["conn", "lost", "oom", "crash"]):
        assert mixed.fail(what, 2.0 + n, 40, rank=2, reached=1040, restored_from=1000).action is not Action.STOP
    assert not any(r.replayed for r in mixed.history)


def test_unknown_progress_never_counts_as_a_crash_loop() -> None:
    job = Job(max_restarts=100)
    for i in range(10):
        assert job.fail("crash", float(i), None, rank=1).action is Action.RESTART


def test_oom_before_first_step_twice_is_fatal() -> None:
    job = Job()
    assert job.fail("oom", 1.0, 0).action is Action.RESTART
    d = job.fail("oom", 2.0, 0, rank=2)
    assert d.stop is StopReason.FATAL and "does not fit" in d.reason
    later = Job()
    later.fail("oom", 1.0, 100)
    assert later.fail("oom", 2.0, 0, rank=2).action is Action.RESTART  # it did fit before


def test_budget_is_job_wide_and_counts_every_action() -> None:
    job = Job(max_restarts=3, elastic=True)
    actions = [job.fail(w, float(i * 100), 10, rank=i, node=f"n{i}").action
               for i, w in enumerate(["conn", "crash", "lost"])]
    assert actions == [Action.REATTEMPT, Action.RESTART, Action.RECONFIGURE]
    d = job.fail("crash", 400.0, 10, rank=9, node="n9")
    assert d.stop is StopReason.BUDGET and d.restarts_used == 3
    assert "3 of 3 restarts used job-wide" in d.reason
    assert isinstance(d.to_error(), RestartBudgetExceeded)
    none = Job(max_restarts=0).fail("crash", 1.0, 5)
    assert none.stop is StopReason.BUDGET
    # torchrun's default: nothing was tried, and the line does not read as if restarts had been
    assert "restart budget spent: none allowed (--max-restarts 0" in none.reason and "0 of 0" not in none.reason
    # The root cause comes first, the budget after it (docs/cli.md; acceptance 29C F2 read
    # "restart budget spent: ...; last cause: rank 1 ... exited with code 7").
    assert none.reason.startswith("rank ") and none.reason.index("restart budget spent") > 0


def test_backoff_sequence_and_reset_after_progress() -> None:
    assert [POLICY.backoff(n) for n in range(1, 9)] == [0, 1, 2, 4, 8, 16, 30, 30]
    policy = RestartPolicy(crash_loop_limit=100)
    job = Job(max_restarts=100, policy=policy)
    backoffs = [job.fail("crash", float(i), 0, rank=i, node=f"n{i}").backoff_s for i in range(6)]
    assert backoffs == [0, 1, 2, 4, 8, 16]
    assert job.fail("crash", 10.0, 3, rank=50).backoff_s == 0  # this attempt made progress


def test_failure_record_round_trip_and_bad_input() -> None:
    job = Job()
    job.fail("crash", 5.0, 7, rank=2, node="gpu-1")
    record = job.history[0]
    assert FailureRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    with pytest.raises(ValueError, match="cause"):
        FailureRecord.from_dict({k: v for k, v in record.to_dict().items() if k != "cause"})
    with pytest.raises(ValueError, match="bad failure record"):
        FailureRecord.from_dict({**record.to_dict(), "severity": "SEV9"})


@pytest.mark.parametrize("kwargs", [{"crash_loop_limit": 0}, {"backoff_cap_s": -1}, {"oom_fatal_after": 0}])
def test_bad_policy_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Invariants over random failure sequences.

events = st.lists(
    st.tuples(
        st.sampled_from(sorted(KINDS)),
        st.floats(min_value=0.0, max_value=120.0),  # time since the previous failure
        st.none() | st.integers(0, 3),  # progress of the attempt
        st.integers(0, 3),  # rank
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events=events, max_restarts=st.integers(0, 8), elastic=st.booleans(), limit=st.integers(1, 5))
def test_policy_invariants(events: list[tuple[str, float, int | None, int]], max_restarts: int, elastic: bool,
                           limit: int) -> None:
    job = Job(max_restarts=max_restarts, elastic=elastic, policy=RestartPolicy(crash_loop_limit=limit))
    now = 0.0
    streak_backoffs: list[float] = []
    for what, gap, progress, rank in events:
        now += gap
        d = job.fail(what, now, progress, rank=rank, node=f"n{rank}")
        # The budget is never exceeded, job-wide.
        spent = sum(1 for r in job.history if r.action in (Action.REATTEMPT, Action.RESTART, Action.RECONFIGURE))
        assert spent <= max_restarts
        # FATAL is never restarted.
        if d.severity is Severity.FATAL:
            assert d.action is Action.STOP and d.stop is StopReason.FATAL
        # Backoff is capped, monotone within a streak without progress, zero after progress.
        assert 0.0 <= d.backoff_s <= POLICY.backoff_cap_s
        if d.action in (Action.NONE, Action.STOP):
            if d.action is Action.STOP:
                assert d.to_error() is not None
                break
            continue
        if progress is not None and progress > 0:
            assert d.backoff_s == 0.0
            streak_backoffs = [0.0]
        else:
            if streak_backoffs:
                assert d.backoff_s >= streak_backoffs[-1]
            streak_backoffs.append(d.backoff_s)
        assert d.to_error() is None


def test_the_same_start_up_error_on_another_rank_stops_like_on_the_same_rank(monkeypatch) -> None:
    """Every rank fails alike before its first step: which rank is seen first is chance, and the
    job used to be restarted 1 to 3 times depending on it."""
    monkeypatch.setitem(KINDS, "value", {"kind": "exception", "error_type": "ValueError",
                                         "message": "ValueError: bad shard spec"})
    for first, second in ((1, 1), (1, 0), (0, 1)):
        job = Job(max_restarts=6)
        assert job.fail("value", 1.0, 0, rank=first).action is Action.RESTART
        d = job.fail("value", 2.0, 0, rank=second)
        assert d.stop is StopReason.CANNOT_RECONFIGURE, (first, second, d)
        assert "after a restart without completing a step" in d.reason
        assert ("failed again" in d.reason) == (first == second)
    # Another error on another rank is another failure: restarted
    job = Job(max_restarts=6)
    job.fail("value", 1.0, 0, rank=1)
    assert job.fail("oom", 2.0, 0, rank=0).action is Action.RESTART
    # Without a message to compare (a signal), only the same rank is the same failure
    job = Job(max_restarts=6)
    job.fail("crash", 1.0, 0, rank=1)
    assert job.fail("crash", 2.0, 0, rank=0).action is Action.RESTART


def test_the_same_exception_after_a_restart_of_unknown_progress_stops_the_job() -> None:
    """Acceptance 20A F1: a script that loads for over 10 s before init_process_group (an HF
    Trainer script) has unknown progress; a bug after the load was restarted until the budget
    ran out, each attempt paying the load again. The same exception, word for word, twice: stop."""
    job = Job(max_restarts=50)
    assert job.fail("bug", 1.0, None, rank=0).action is Action.RESTART
    d = job.fail("bug", 20.0, None, rank=1)  # which rank is seen first is chance
    assert d.action is Action.STOP and d.stop is StopReason.CANNOT_RECONFIGURE
    assert "the same error came back" in d.reason and "KeyError" in d.reason and "unknown progress" in d.reason
    # An exit with the same error line may come from an image without hooks that worked (a rank
    # that execs itself: test_run_stepless), and is restarted, as is another exception, or a
    # death by a signal.
    exits = Job(max_restarts=50)
    exits.fail("argparse", 1.0, None, rank=0)
    assert exits.fail("argparse", 20.0, None, rank=0).action is Action.RESTART
    other = Job(max_restarts=50)
    other.fail("bug", 1.0, None, rank=0)
    assert other.fail("bug2", 20.0, None, rank=0).action is Action.RESTART
    crashes = Job(max_restarts=50)
    crashes.fail("crash", 1.0, None, rank=0)
    assert crashes.fail("crash", 20.0, None, rank=0).action is Action.RESTART
    # An exception of the world the script met, not of its code (acceptance 23A F2: work without
    # torch.distributed met the same HTTP 503 twice): restarted, as under torchrun.
    transient = Job(max_restarts=50)
    transient.fail("http503", 1.0, None, rank=0)
    assert transient.fail("http503", 20.0, None, rank=0).action is Action.RESTART
    # Progress made in between: an ordinary restart.
    progressed = Job(max_restarts=50)
    progressed.fail("bug", 1.0, None, rank=0)
    assert progressed.fail("bug", 20.0, 12, rank=0).action is Action.RESTART


def test_the_same_exception_in_attempts_that_trained_without_step_reports_is_restarted() -> None:
    """Acceptance 21A F3: a loop without torch.optim ran hundreds of iterations past
    init_process_group in each attempt (progress unknown, but it trained) and met the same
    transient error twice: restarted up to the budget, as under torchrun, not stopped."""
    job = Job(max_restarts=50)
    assert job.fail("bug", 1.0, None, rank=0, trained=True).action is Action.RESTART
    assert job.fail("bug", 20.0, None, rank=0, trained=True).action is Action.RESTART
    assert job.fail("bug", 40.0, None, rank=0, trained=True).action is Action.RESTART
    # One that loaded before init_process_group, then the same error after one that trained: not alike.
    mixed = Job(max_restarts=50)
    mixed.fail("bug", 1.0, None, rank=0, trained=True)
    assert mixed.fail("bug", 20.0, None, rank=0).action is Action.RESTART
    assert mixed.fail("bug", 40.0, None, rank=0).action is Action.STOP


def test_fresh_starts_that_fail_alike_at_the_same_step_are_a_crash_loop() -> None:
    """Acceptance 20B F2: DDP's first snapshot comes after its first steps, so a job that raises
    at its second iteration in every attempt (an unused parameter) starts fresh each time,
    with progress 1, and spent the whole restart budget."""
    job = Job(max_restarts=100)
    decisions = [job.fail("bug", float(n), 1, rank=0, reached=1, restored_from=0) for n in range(4)]
    assert [d.action for d in decisions] == [Action.RESTART] * 3 + [Action.STOP]
    assert decisions[-1].stop is StopReason.CRASH_LOOP and "failed the same way again" in decisions[-1].reason
    # Failing further each time, or with another error, is no loop.
    further = Job(max_restarts=100)
    assert all(further.fail("bug", float(n), 5, rank=0, reached=5 * (n + 1), restored_from=0).action
               is Action.RESTART for n in range(5))
    other = Job(max_restarts=100)
    assert all(other.fail("bug" if n % 2 else "bug2", float(n), 1, rank=0, reached=1, restored_from=0).action
               is Action.RESTART for n in range(5))
    # A fresh start after a restored one is not compared with it.
    assert not replayed_only([FailureRecord(ts=0.0, attempt=0, rule="x", severity=Severity.SEV2,
                                            action=Action.RESTART, cause="", error="E", reached=1,
                                            restored_from=6)], 0, 1, "x", 1, "E")
