"""What an agent says when an attempt's workers start (unicron.agent.attempt): pure, no processes."""

from __future__ import annotations

from dataclasses import replace

from unicron.agent.attempt import attempt_line, inject_warnings, unfired_injects
from unicron.agent.ranks import GroupSpec

SPEC = GroupSpec(attempt=2, restart_count=2, rank_offset=2, world_size=4, node_rank=1, nnodes=2,
                 local_world_sizes=(2, 2), master_addr="10.0.0.1", master_port=29500, restore_step=None, inject="")


def test_the_attempt_line_says_where_the_state_comes_from() -> None:
    assert attempt_line(SPEC, [3, 2]) == "attempt 2: ranks 2-3 of 4"
    assert attempt_line(replace(SPEC, restore_step=17), [2, 3]) == \
        "attempt 2: ranks 2-3 of 4, restoring step 17 from memory"
    noted = replace(SPEC, restore_note="rank 1's snapshots were lost with its node")
    assert attempt_line(noted, [2, 3]) == \
        "attempt 2: ranks 2-3 of 4, from the script's own start: rank 1's snapshots were lost with its node"


def test_faults_aimed_past_the_world_are_named_once_by_node_0() -> None:
    spec = replace(SPEC, node_rank=0, inject="kill@1:5;hang@4:2;exit=3@*:9;slow=2@7:1")
    assert inject_warnings(spec) == [
        "--inject hang@4:2: rank 4 does not exist (world size 4); it never fires",
        "--inject slow=2.0@7:1: rank 7 does not exist (world size 4); it never fires",
    ]
    assert inject_warnings(replace(spec, node_rank=1)) == []  # the other nodes stay quiet
    assert inject_warnings(replace(spec, inject="")) == []


def test_faults_of_the_first_attempt_that_never_fired_are_named() -> None:
    spec = replace(SPEC, attempt=0, inject="kill@2:5;hang@3:10;exit=3@*:40;freeze@2:0")
    # Rank 2 was killed at step 5 (its own fault): the restart ended rank 3 at step 5.
    said = unfired_injects(spec, {2: 5, 3: 5}, {2})
    assert said == [
        "--inject hang@3:10 did not fire: rank 3 stopped at step 5 of the first attempt "
        "(faults are injected into the first attempt only)",
        "--inject exit=3@*:40 did not fire: rank 2 stopped at step 5 of the first attempt "
        "(faults are injected into the first attempt only)",
    ]
    # A frozen rank's last step report may be lost with it: one step of slack, for it only.
    assert unfired_injects(replace(spec, inject="freeze@2:6"), {2: 5, 3: 5}, {None}) == []
    assert unfired_injects(replace(spec, inject="freeze@2:6"), {2: 5, 3: 5}, set()) == []
    assert len(unfired_injects(replace(spec, inject="freeze@2:7"), {2: 5, 3: 5}, set())) == 1
    assert unfired_injects(replace(spec, attempt=1), {2: 5, 3: 5}, set()) == []
