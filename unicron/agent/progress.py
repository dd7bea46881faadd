"""How far an attempt's local ranks got, as every fault states it for the restart policy (a
part of ``unicron.agent.workers.WorkerGroup``): steps completed, whether the ranks trained past
their start-up though they report no steps, the furthest step and the one restored."""

from __future__ import annotations

from typing import Any

from unicron.agent.ranks import GroupSpec, RankState
from unicron.agent.shm import newest_snapshot

RAN_FOR_S = 1.0  # see GroupProgress.ran_past_startup
NEVER_READY_S = 10.0  # hello, and no init_process_group call this long after: it trains in a child


class GroupProgress:
    """The progress half of a ``WorkerGroup``, whose attributes these are."""

    spec: GroupSpec
    ranks: dict[int, RankState]
    saw_hello: bool
    expect_steps: bool
    shm_dir: str
    started_at: float

    def progress(self, now: float) -> int | None:
        """Steps the job completed in this attempt (None: unknown, when the workers report no
        steps: not injected, or a script that has reported none in any attempt and ran past its
        start-up, ``ran_past_startup``)."""
        counts = [r.steps_in_attempt for r in self.ranks.values()]
        if not counts or (max(counts) == 0 and not self.saw_hello):
            return None
        if max(counts) == 0 and any(self.ran_past_startup(r, now) for r in self.ranks.values()):
            return None
        return max(counts)

    def how_far(self, now: float) -> dict[str, Any]:
        """What every fault of this attempt says of its progress, for the restart policy."""
        return {"progress": self.progress(now), "trained": self.trained(now), **self.reach()}

    def trained(self, now: float) -> bool:
        """Some rank ran long past ``init_process_group`` (``ran_past_startup``): with no step
        reports, its progress is unknown, but it trained; not a rank that loaded for long before
        it (``unicron.detect.policy``: the same exception again stops only the latter)."""
        return any(r.ready_at is not None and self.ran_past_startup(r, now) for r in self.ranks.values())

    def reach(self) -> dict[str, int]:
        """The furthest step (over the run) a rank of this attempt completed, and the step the
        attempt restored (0: a fresh start): the crash-loop guard's "replayed only". The furthest
        step only where a rank made a ``unicron.State``: without one, a script resumes from its own
        checkpoint (as torchrun's elastic scripts do), so the same step count in two attempts is
        not the same step of the job (acceptance 21A F1: a leak that ended every attempt after
        25 steps of its life, each 20 steps further on, was stopped as a crash loop)."""
        reach = {"restored_from": self.spec.restore_step or 0}
        if any(r.stateful for r in self.ranks.values()):
            reach["reached"] = max((r.step for r in self.ranks.values()), default=0)
        return reach

    def steps_completed(self, r: RankState, now: float) -> int | None:
        """``r``'s completed steps for a fault; None when unknown: it never said hello (no
        hooks: ``--no-inject``), or as in ``progress``, so a script without step reports that
        fails mid-run is not taken for one failing at start-up."""
        if not r.hooked or (r.step == 0 and self.ran_past_startup(r, now)):
            return None
        if r.stateful and self.shm_dir:
            # A SIGKILL loses the step reports still queued in the rank's socket, not the
            # snapshots it completed: "exit at step 957" then "restoring step 960" (20B F3).
            return max(r.step, newest_snapshot(self.shm_dir, r.rank, since=self.started_at))
        return r.step

    def ran_past_startup(self, r: RankState, now: float) -> bool:
        """``r`` reports no steps (none in any attempt of this job) yet ran, after initialising
        torch.distributed, at least as long as it took to get there (and ``RAN_FOR_S``): it was
        training, so its progress is unknown, not zero. A rank that dies right after joining
        stays "before the first step" (the crash-loop guard and the user-error rules apply).
        A rank that replaced its image (``exec``: its hooks went with the old one), or that
        said hello and, for ``NEVER_READY_S``, never called ``init_process_group`` (a per-rank
        wrapper running the trainer as a child process, a job without torch.distributed), has
        unknown progress too. One that called it and never got out (a peer it cannot reach)
        is still starting up: failing there again in the same place is a node's fault."""
        if r.hello_at is not None and not r.hooked:
            return True
        if self.expect_steps or r.steps_expected:
            return False
        if r.ready_at is None:
            return r.hello_at is not None and not r.joining and now - r.hello_at >= NEVER_READY_S
        return now - r.ready_at >= max(RAN_FOR_S, r.ready_at - self.started_at)
