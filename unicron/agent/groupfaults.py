"""The faults an attempt's local ranks report to the coordinator (a part of
``unicron.agent.workers.WorkerGroup``): one rank's exit or exception as the fault dict the
restart policy reads, and the faults a stop confirmed (ranks spared as raising).

Split from ``unicron.agent.workers``, which follows the ranks (messages, exits, hang verdicts):
what a fault says of a rank (its exit code and signal, its traceback, how far the attempt got)
is one concern, with its own rules for which of a rank's exceptions explains its exit.
"""

from __future__ import annotations

import json
from typing import Any

from unicron.agent.logs import full_copy_note
from unicron.agent.progress import GroupProgress
from unicron.agent.ranks import RankState
from unicron.agent.rootcause import WorkerFailure, build_failure, describe_exit
from unicron.textclip import clip_fields


class GroupFaults(GroupProgress):
    """The fault half of a ``WorkerGroup``, whose attributes these are."""

    host: str
    reported_exc: set[int]

    def confirmed_pending(self, now: float) -> list[dict[str, Any]]:
        """After a stop: the faults of ranks that had an exception in hand as they destroyed their
        group and then did not end cleanly (they were spared as raising ranks, and ended non-zero
        or were killed at the end of the grace period). Reported before the node says it stopped,
        so the decision names them, not their peers that lost them (acceptance 25A F1)."""
        faults = []
        for r in self.ranks.values():
            if not r.fault_pending or r.exitcode is None:
                continue
            r.fault_pending = False
            if r.exitcode == 0:
                continue
            self.reported_exc.add(r.rank)
            if r.exitcode > 0:  # it ended by itself: its exit, which its exception explains
                faults.append(self._exit_fault(r, now))
            elif r.exception is not None:  # the stop's signal ended its cleanup: its exception
                faults.append(self._exception_fault(r, r.exception, now))
            elif r.exiting_code is not None:  # ... or the sys.exit code it was on its way out with
                r.exitcode = r.exiting_code
                faults.append(self._exit_fault(r, now))
        return faults

    def _exception_fault(self, r: RankState, exc: dict[str, str], now: float, **fields: Any) -> dict[str, Any]:
        return self._fault(r, "exception", now, message=exc["msg"] + full_copy_note(r.logs, str(exc["msg"])),
                           error_type=exc["type"], traceback=exc["tb"], **fields)

    def _exit_fault(self, r: RankState, now: float) -> dict[str, Any]:
        failure = build_failure(rank=r.rank, local_rank=r.local_rank, pid=r.proc.pid, exitcode=r.exitcode or 0,
                                exited_at=now, error_file=r.logs.error_file, stderr_file=r.logs.stderr_path,
                                host=self.host)
        return self._fault(r, "exit", now, failure=failure, message=r.frozen)

    def _fault(self, r: RankState, kind: str, now: float, *, failure: WorkerFailure | None = None,
               at: float | None = None, **fields: Any) -> dict[str, Any]:
        """``at``: when the failure happened, if known better than ``now`` (when it was seen)."""
        when = at if at is not None else r.exiting_at if r.exiting_at is not None else now
        fault: dict[str, Any] = {"kind": kind, "rank": r.rank, "local_rank": r.local_rank, "host": self.host,
                                 "pid": r.proc.pid, "ts": now, "attempt": self.spec.attempt,
                                 "steps_completed": self.steps_completed(r, when),
                                 "into_attempt_s": round(now - self.started_at, 3),  # seconds since the attempt started
                                 **self.how_far(when)}
        if failure is not None:
            fault.update(exitcode=failure.exitcode, signal=failure.signal_name, stderr_tail=failure.stderr_tail[-4000:],
                         traceback=failure.traceback,
                         summary=failure.summary or describe_exit(failure.exitcode))
            if failure.error is not None:
                fault["message"] = failure.error.message[-2000:]
            # A background thread's exception explains an exit only if it came at the same step and
            # the process exited rather than being killed (it died 20 steps before a SIGKILL: no).
            explains = r.exception is not None and (r.exception_fatal or (
                failure.signal_name is None and r.exception_step == r.step))
            if explains and r.exception is not None:
                fault.setdefault("error_type", r.exception.get("type"))
                fault.setdefault("message", r.exception.get("msg"))
                fault["traceback"] = fault.get("traceback") or r.exception.get("tb")
            elif r.exception is not None and failure.signal_name is not None and failure.error is None:
                fault["summary"] = describe_exit(failure.exitcode)  # not the old traceback in its stderr
            if not explains and r.exiting_code is not None and failure.signal_name is None \
                    and failure.exitcode == r.exiting_code:
                fault["sys_exit"] = True  # said by its hooks: what its stderr printed before did not end it
        fault.update({k: v for k, v in fields.items() if v is not None})
        return clip_fields(json.loads(json.dumps(fault, default=str)))  # a worker's text is unbounded
