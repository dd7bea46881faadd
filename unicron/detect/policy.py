"""Restart policy: given the history of failures, what to do about this one (pure, clock passed in).

Rules, in order (docs/failures.md explains each):
1. INFO is not a failure: nothing to do, nothing spent.
2. FATAL (a user error) stops at once, whatever the budget. A user-error type from a rank of
   unknown progress (a script that reports no steps, failing past start-up) is restarted once;
   the same error (on any rank) right after that restart is FATAL.
3. Out of memory before the first step on ``oom_fatal_after`` consecutive attempts is FATAL too.
4. Crash-loop guard: ``crash_loop_limit`` restarts in a row without one completed step stop;
   a restored attempt that fails as the one before it did, by the same rule and no further,
   from no earlier a snapshot (a replay: restores are bit-exact) counts as no step.
5. Escalation: a REATTEMPT that fails again within ``reattempt_window_s`` becomes a RESTART, and
   so does one after a RESTART or RECONFIGURE that failed within it (no stepping back down); a
   RESTART that fails again on the same rank (or node, for node faults) without progress becomes a RECONFIGURE
   when the job is elastic, else STOP; not when either failure came from outside (``OUTSIDE_RULES``). A SEV1 in a job that is not elastic cannot exclude
   anything: it restarts on the same nodes (the lost node may come back) and escalates from there.
6. Budget: every REATTEMPT, RESTART and RECONFIGURE spends one unit of the job-wide
   ``max_restarts``; with none left the job stops.
Backoff before the action grows 0, 1, 2, 4 ... ``backoff_cap_s`` seconds over consecutive
failures without progress and resets when an attempt completes a step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unicron.detect.classify import SAME_AGAIN_STOPS
from unicron.detect.faults import Action, Classification, Fault, Severity
from unicron.errors import (
    CrashLoopError,
    FatalUserError,
    RestartBudgetExceeded,
    UnicronError,
    WorkerFailedError,
)

BUDGETED_ACTIONS = frozenset({Action.REATTEMPT, Action.RESTART, Action.RECONFIGURE})

# Failures the script did not cause: a SIGKILL (sent from outside, the kernel OOM killer's kill
# unicron saw no trace of, or --inject kill) or a termination signal from outside. One of them
# on either side of a restart is no evidence that the script fails again at start-up, so it
# never escalates (acceptance 33B F1: two unrelated kills of one rank stopped the job, blaming
# the script); the crash-loop guard and the budget still bound it.
OUTSIDE_RULES = frozenset({"sigkill", "terminated"})


class StopReason(enum.Enum):
    FATAL = "fatal"  # a user error: restarting replays it
    CRASH_LOOP = "crash_loop"  # restarts make no progress
    BUDGET = "budget"  # the job-wide --max-restarts is spent
    CANNOT_RECONFIGURE = "cannot_reconfigure"  # a restart failed again in place and the job is not elastic


# Exceptions that say the script's code is wrong, not the world it met: the same one again after
# a restart of unknown progress is not worth another restart (see ``unknown_twice``).
CODE_BUG_TYPES = frozenset({
    "TypeError", "KeyError", "AttributeError", "IndexError", "ValueError", "AssertionError", "NameError",
    "UnboundLocalError", "ZeroDivisionError", "NotImplementedError", "ImportError", "ModuleNotFoundError",
    "SyntaxError", "IndentationError", "TabError",
})


@dataclass(frozen=True)
class FailureRecord:
    """One handled failure: what it was, what was decided, and the progress made before it."""

    ts: float
    attempt: int
    rule: str
    severity: Severity
    action: Action  # the action decided (after escalation)
    cause: str
    rank: int | None = None
    node: str = ""
    progress: int | None = None  # steps completed in the attempt this failure ended (None: unknown)
    escalated: bool = False
    error: str = ""  # the classification's error, without where it happened
    reached: int | None = None  # the furthest step (over the whole run) the attempt completed
    restored_from: int | None = None  # the step the attempt restored (None or 0: a fresh start)
    replayed: bool = False  # a restored attempt that failed before passing an earlier one's furthest step
    trained: bool = False  # of unknown progress, a rank ran long past init_process_group: it trained

    def to_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts, "attempt": self.attempt, "rule": self.rule, "severity": self.severity.value,
            "action": self.action.value, "cause": self.cause, "rank": self.rank, "node": self.node,
            "progress": self.progress, "escalated": self.escalated, "error": self.error,
            "reached": self.reached, "restored_from": self.restored_from, "replayed": self.replayed,
            "trained": self.trained,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FailureRecord:
        try:
            return cls(
                ts=float(data["ts"]), attempt=int(data["attempt"]), rule=str(data["rule"]),
                severity=Severity(data["severity"]), action=Action(data["action"]), cause=str(data["cause"]),
                rank=None if data.get("rank") is None else int(data["rank"]), node=str(data.get("node", "")),
                progress=None if data.get("progress") is None else int(data["progress"]),
                escalated=bool(data.get("escalated", False)), error=str(data.get("error", "")),
                reached=None if data.get("reached") is None else int(data["reached"]),
                restored_from=None if data.get("restored_from") is None else int(data["restored_from"]),
                replayed=bool(data.get("replayed", False)), trained=data.get("trained") is True,
            )
        except KeyError as exc:
            raise ValueError(f"failure record field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad failure record: {exc}") from None


@dataclass(frozen=True)
class Decision:
    action: Action
    backoff_s: float
    reason: str
    escalated: bool
    severity: Severity  # of the classification (escalation changes the action, not the diagnosis)
    stop: StopReason | None = None
    restarts_used: int = 0  # job-wide budget spent, counting this decision

    def to_error(self) -> UnicronError | None:
        """The error the launcher exits with when this decision stops the job, else None."""
        if self.action is not Action.STOP:
            return None
        if self.stop is StopReason.FATAL:
            return FatalUserError(self.reason)
        if self.stop is StopReason.CRASH_LOOP:
            return CrashLoopError(self.reason)
        if self.stop is StopReason.BUDGET:
            return RestartBudgetExceeded(self.reason)
        return WorkerFailedError(self.reason)

    def record(self, fault: Fault, classification: Classification, progress: int | None, now: float, *,
               reached: int | None = None, restored_from: int | None = None, replayed: bool = False,
               trained: bool = False) -> FailureRecord:
        """The history entry for this decision (append it before the next ``decide``)."""
        return FailureRecord(
            ts=now, attempt=fault.attempt, rule=classification.rule, severity=classification.severity,
            action=self.action, cause=classification.reason, rank=place_rank(fault), node=fault.node,
            progress=progress, escalated=self.escalated, error=classification.error,
            reached=reached, restored_from=restored_from, replayed=replayed, trained=trained,
        )


def replayed_only(history: Sequence[FailureRecord], restored_from: int | None, reached: int | None,
                  rule: str, progress: int | None, error: str = "") -> bool:
    """Whether a restored attempt replayed the attempt before it: it restored from no earlier a
    step than that one did (``restored_from``; None or 0: it started fresh), got no further
    (``reached``, the furthest step over the whole run) and failed by the same rule. Restores
    are bit-exact, so such an attempt meets the same failure again: a script that raises after
    its optimizer step and before ``commit()`` redoes one step per attempt forever, each attempt
    with progress 1. A fresh start (it redoes steps by design) replays only a fresh start before
    it that failed at the same step with the same ``error``, word for word: a DDP job whose
    snapshot comes only after its first steps and that raises at its second iteration in every
    attempt (an unused parameter) restarted until the budget was spent. Never an attempt of
    unknown progress (no evidence), or another kind of failure (unrelated faults are not a loop)."""
    if reached is None or progress is None:
        return False
    last = next((r for r in reversed(history) if r.action is not Action.NONE), None)
    if not restored_from:
        return (last is not None and not last.restored_from and bool(error) and last.error == error
                and last.rule == rule and last.reached == reached)
    return (last is not None and last.rule == rule and last.reached is not None and reached <= last.reached
            and restored_from >= (last.restored_from or 0))


def _no_progress(progress: int | None) -> bool:
    return progress is not None and progress <= 0


def place_rank(fault: Fault) -> int | None:
    """The rank a fault happened at: its own, or a hang's one named culprit."""
    if fault.rank is None and len(fault.culprit_ranks) == 1:
        return fault.culprit_ranks[0]
    return fault.rank


def _same_place(record: FailureRecord, fault: Fault) -> bool:
    # The same rank when both name one. When only one names a rank (a hang without one culprit
    # after a crash, or the reverse) they are not known to be at the same place: on a single-node
    # job every rank shares the node, and the node alone would call any two failures the same.
    # Otherwise (node-level faults: a lost node, a GPU) the same node.
    rank = place_rank(fault)
    if record.rank is not None or rank is not None:
        return record.rank == rank
    return bool(record.node) and record.node == fault.node


@dataclass(frozen=True)
class RestartPolicy:
    crash_loop_limit: int = 3
    reattempt_window_s: float = 30.0
    backoff_first_s: float = 1.0
    backoff_cap_s: float = 30.0
    oom_fatal_after: int = 2

    def __post_init__(self) -> None:
        if self.crash_loop_limit < 1 or self.oom_fatal_after < 1:
            raise ValueError("crash_loop_limit and oom_fatal_after must be at least 1")
        if self.reattempt_window_s < 0 or self.backoff_first_s < 0 or self.backoff_cap_s < 0:
            raise ValueError("windows and backoff times must be >= 0")

    def backoff(self, streak: int) -> float:
        """Seconds to wait before the action for the ``streak``-th failure in a row without progress."""
        if streak <= 1:
            return 0.0
        return min(self.backoff_cap_s, self.backoff_first_s * 2.0 ** min(streak - 2, 60))

    @staticmethod
    def _backoff_streak(history: Sequence[FailureRecord], progress: int | None) -> int:
        # Unknown progress counts as none here (waiting a little longer is harmless).
        if progress is not None and progress > 0:
            return 1
        streak = 1
        for record in reversed(history):
            if record.progress is not None and record.progress > 0:
                break
            streak += 1
        return streak

    def decide(
        self,
        history: Sequence[FailureRecord],
        fault: Fault,
        classification: Classification,
        now: float,
        *,
        max_restarts: int,
        steps_completed_since_last_restart: int | None,
        elastic: bool = False,
        replayed: bool = False,
        fixed_why: str = "the job is not elastic (min nodes = current nodes)",
        spent: int = 0,
        trained: bool = False,
    ) -> Decision:
        """Decide once per incident, for its root cause (``classify.root_cause``).

        ``steps_completed_since_last_restart``: steps the job completed in the attempt that just
        failed (None when unknown: then neither the crash-loop guard nor "without progress"
        escalation can fire, and backoff grows as if there were no progress). ``elastic``: the
        job may shrink (min_nodes < current nodes); ``fixed_why`` says why not, when it may not.
        ``replayed``: the attempt restored a snapshot and failed again as the attempt before it
        did, no further (``replayed_only``): its steps redid known work, so the crash-loop guard
        counts it as no progress. The other rules keep the real count, since it did run.
        ``spent``: restarts the job spent that ``history`` may not hold (a coordinator that
        restarted took the job back with its count, not its history): the budget counts the more.
        """
        progress = steps_completed_since_last_restart
        history = [r for r in history if r.action is not Action.NONE]  # INFO notes are not failures
        used = max(sum(1 for r in history if r.action in BUDGETED_ACTIONS), spent)
        severity = classification.severity
        cause = classification.reason

        def stop(reason: StopReason, text: str, escalated: bool = False) -> Decision:
            # A stop for a user error is FATAL whatever the failure was classified as first (a
            # restartable-looking error that came back the same: 29C F8 said "SEV2 stop: user error").
            return Decision(Action.STOP, 0.0, text, escalated,
                            Severity.FATAL if reason is StopReason.FATAL else severity, reason, used)

        if severity is Severity.INFO or classification.action is Action.NONE:
            return Decision(Action.NONE, 0.0, f"not a failure: {cause}", False, severity, None, used)
        if severity is Severity.FATAL or classification.action is Action.STOP:
            return stop(StopReason.FATAL, f"user error, not restarted: {cause}")

        # Trailing history of attempts that completed no step (unknown progress breaks the run).
        streak: list[FailureRecord] = []
        for record in reversed(history):
            if not _no_progress(record.progress):
                break
            streak.append(record)

        if classification.rule == "out-of-memory" and _no_progress(progress):
            ooms = 1
            for record in streak:
                if record.rule != "out-of-memory":
                    break
                ooms += 1
            if ooms >= self.oom_fatal_after:
                return stop(
                    StopReason.FATAL,
                    f"{cause}; out of memory before the first step on {ooms} attempts in a row: the job does not "
                    f"fit (reduce the batch or model size)",
                )

        last = history[-1] if history else None
        if (
            # The same error on any rank (each rank fails alike; which one is seen first is chance).
            classification.rule == "user-error-unknown-progress" and progress is None and last is not None
            and last.rule == classification.rule and last.error == classification.error and last.progress is None
        ):
            return stop(StopReason.FATAL, f"user error, not restarted again: the same error came back after a "
                                          f"restart, with no step reported in between: {cause.removesuffix(SAME_AGAIN_STOPS)}")

        if _no_progress(progress) or replayed:
            # Restarts in a row that completed no step, or only steps an earlier attempt had done.
            loop: list[FailureRecord] = []
            for record in reversed(history):
                if not (_no_progress(record.progress) or record.replayed):
                    break
                loop.append(record)
            restarts = (1 if fault.attempt >= 1 else 0) + sum(1 for r in loop if r.attempt >= 1)
            if restarts >= self.crash_loop_limit:
                what = ("without completing a step" if not replayed and not any(r.replayed for r in loop)
                        else "without completing a step that an earlier attempt had not already completed "
                             "(attempts failed the same way again, no further)")
                return stop(StopReason.CRASH_LOOP, f"{cause}; crash loop: {restarts} restarts {what}")

        action = classification.action
        escalated = False
        notes: list[str] = []
        if action is Action.RECONFIGURE and not elastic:
            action = Action.RESTART
            notes.append(f"{fixed_why}: restarting on the same nodes")
        if (
            # A reattempt that failed again within the window is escalated; so is one after a
            # restart (or reconfigure) that failed within it: the ladder never steps back down
            # (it stayed escalated for one failure, then went reattempt, restart, reattempt ...
            # for the same failure: acceptance 33A F4).
            last is not None and action is Action.REATTEMPT and last.action.order >= Action.REATTEMPT.order
            and now - last.ts <= self.reattempt_window_s
        ):
            action, escalated = Action.RESTART, True
            notes.append(f"the reattempt failed again within {now - last.ts:.1f}s: escalated to restart"
                         if last.action is Action.REATTEMPT else
                         f"the {last.action.value} failed again within {now - last.ts:.1f}s: stays at restart")
        # The same error before any step, twice, on another rank is the same failure too: when
        # every rank fails alike at start-up, which one is seen first is chance, and must not
        # decide whether the job stops.
        # A Python exception (forwarded by the rank's hooks) that comes back word for word after
        # a restart, in attempts whose progress is unknown because the ranks loaded for long
        # before init_process_group (an HF Trainer script), is a bug in the script, as it is with
        # no progress. Not where a rank ran long past init_process_group (``trained``: a loop
        # without torch.optim trained hundreds of iterations and met the same transient error
        # twice, acceptance 21A F3), nor an exit: it may come from an image without the hooks (a
        # rank that execs itself, a wrapper's subprocess) that did work nobody saw.
        # Only an exception that says the code is wrong (a KeyError, a TypeError of a removed
        # argument): the same transient error twice (an HTTP 503, a stale NFS handle) after 15 s of
        # work without torch.distributed stopped a job that torchrun restarts (acceptance 23A F2).
        unknown_twice = (progress is None and last is not None and last.progress is None and fault.kind == "exception"
                         and not trained and not last.trained and fault.error_type.rsplit(".", 1)[-1] in CODE_BUG_TYPES
                         and bool(last.error) and last.error == classification.error)
        same_error = (last is not None and bool(last.error) and last.error == classification.error
                      and last.rule == classification.rule and (_no_progress(last.progress) or unknown_twice))
        outside = classification.rule in OUTSIDE_RULES or (last is not None and last.rule in OUTSIDE_RULES)
        if (
            last is not None and action is Action.RESTART and last.action is Action.RESTART and not outside
            and (_no_progress(progress) or unknown_twice) and (_same_place(last, fault) or same_error)
        ):
            same_place = _same_place(last, fault)
            if not elastic or not same_place:
                # The same error on another rank is no one node's fault (a script bug that fails
                # everywhere): no node is left out for it, elastic or not.
                again = f"{fault.where()} failed again" if same_place else f"the same error came back ({fault.where()})"
                how = ("without completing a step" if _no_progress(progress) else
                       "of unknown progress (no step reports), the same exception word for word")
                why = fixed_why if same_place else "it came on another rank, so it is no one node's fault"
                return stop(
                    StopReason.CANNOT_RECONFIGURE,
                    f"{cause}; {again} after a restart {how}, and {why}, so no node can be left "
                    f"out{' (use --nnodes MIN:MAX)' if 'not elastic' in why else ''}",
                    escalated=True,
                )
            action, escalated = Action.RECONFIGURE, True
            notes.append("the restart failed again in the same place without progress: escalated to reconfigure")

        if used >= max(max_restarts, 0):
            used_text = (f"{used} of {max_restarts} restarts used job-wide" if max_restarts > 0
                         else "none allowed (--max-restarts 0, torchrun's default)")
            # The root cause first (docs/cli.md), what ended the healing after it (29C F2).
            return stop(StopReason.BUDGET, f"{cause}; restart budget spent: {used_text}", escalated)

        backoff = self.backoff(self._backoff_streak(history, progress))
        text = "; ".join([cause, *notes]) + (f"; backing off {backoff:g}s" if backoff else "")
        return Decision(action, backoff, text, escalated, severity, None, used + 1)
