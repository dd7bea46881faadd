"""Whether a stalled job's ranks all sit outside any collective (their stacks, once a stall).

Then no collective is stuck and the job waits for something of its own (rollouts from a
server, a file, a sleep), which the hang detector judges by the busy threshold. A loop that
waits 1.8 s and then steps its optimizer four times has a median step near zero and was called
hung 1.5 s into its first wait (acceptance 29A F1); after two such waits the detector knows
the gap as the loop's own (``StepStats.recurring_gap``) and no stack is taken.
"""

from __future__ import annotations

from collections.abc import Iterable

from unicron.agent.ranks import RankState
from unicron.agent.stackdump import dump_stacks
from unicron.detect.hang import HangVerdict
from unicron.detect.stacks import name_culprits

RECHECK_S = 0.5  # how stale the stacks of a stall may be: a rank that enters a collective later makes it a hang


class OutsideCollectives:
    def __init__(self, busy_floor_s: float) -> None:
        self.busy_floor_s = busy_floor_s
        self.stall: float | None = None  # the stall in which every rank was seen outside collectives
        self.seen_at = 0.0  # when, last (monotonic)
        self.notice: str | None = None  # what the agent says of it (then None again)
        self.said = False  # the agent said one this attempt (the rest are events)

    def seen(self, mono: float, verdict: HangVerdict, ranks: Iterable[RankState], nnodes: int, stack_dir: str) -> bool:
        """True when every rank of the job is outside any collective in ``verdict``'s stall.

        Only where this node holds every rank (``nnodes`` 1): another node's ranks may wait in
        one. A rank that gives no stack (stopped, stuck where no Python runs) or cannot be
        asked (no hooks) is a suspect, not outside.
        """
        if nnodes > 1:
            return False
        stall = round(mono - verdict.stalled_s, 3)
        if self.stall == stall and mono - self.seen_at < RECHECK_S:
            return True
        # Looked at again: once one rank ends its wait and enters a collective that the other
        # never joins (it hung in its own wait), the stall is a hang at the idle threshold.
        # Taken once a stall, such a hang waited for the busy threshold (acceptance 30A F1).
        running = [r for r in ranks if r.exitcode is None]
        live = {r.rank: r.proc.pid for r in running if r.hooked and r.proc.poll() is None}
        if not live or len(live) < len(running):
            return False
        stacks = dump_stacks(live, stack_dir)
        report = name_culprits({int(rank): text for rank, text in stacks.items()}, expected=live)
        if report.verdict != "none_in_collective" or report.missing:
            self.stall = None
            return False
        if self.stall == stall:
            self.seen_at = mono
            return True
        self.stall, self.seen_at = stall, mono
        where = "; ".join(f"rank {r} at {report.where[r]}" for r in report.outside[:4])
        self.notice = (f"no step for {verdict.stalled_s:.1f}s, but no rank waits in a collective ({where}): "
                       f"a hang only if that lasts {self.busy_floor_s:g}s (--hang-busy-floor), or once a rank "
                       f"waits in one")
        return True
