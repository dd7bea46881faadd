"""Shared memory too small for every snapshot a rank keeps: the store keeps as many as fit,
each one complete, and says so once, instead of failing every commit after the first that
found no room (which froze restores at step 1 or 2 for the rest of the run).

Each case runs in a child of its own mount namespace with a tmpfs of a given size, so the
shortage is real (``posix_fallocate`` failing with ENOSPC) and nothing outside is touched."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20

CHILD = r"""
import errno, json, sys
from pathlib import Path
import torch
from unicron.worker import snapcodec, snapslots
store = snapslots.SlotStore(Path(sys.argv[1]) / "rank0", keep=3)
store.prepare(newest_kept=0)
tensor = torch.zeros(1 << 18)  # 1 MiB of float32
notices, error = [], None
for step in range(1, 8):
    tensor.fill_(step)
    encoder = snapcodec.Encoder()
    tree = encoder.encode({"t": tensor}, "state")
    try:
        store.write(step, tree, encoder)
    except OSError as err:
        error = errno.errorcode.get(err.errno)
        break
    if store.notice:
        notices.append(store.notice)
        store.notice = None
    for held in store.held_steps:  # every snapshot kept is whole, and of its own step
        back = snapslots.read(store.directory, held)
        assert torch.equal(back["t"], torch.full_like(tensor, held)), held
print(json.dumps({"held": store.held_steps, "notices": notices, "error": error}))
"""


TWO_RANKS = r"""
import json, sys
from pathlib import Path
import torch
from unicron.worker import snapcodec, snapslots
tensor = torch.zeros(1 << 18)  # 1 MiB of float32
out = {}
for rank in (0, 1):  # rank 0 commits first, as a rank whose first steps came sooner
    store = snapslots.SlotStore(Path(sys.argv[1]) / f"rank{rank}", keep=3, peers=1)
    store.prepare(newest_kept=0)
    for step in range(1, 5):
        encoder = snapcodec.Encoder()
        store.write(step, encoder.encode({"t": tensor}, "state"), encoder)
    out[rank] = {"held": store.held_steps, "notice": store.notice}
print(json.dumps(out))
"""


def _run_in_tmpfs(tmp_path: Path, size_k: int, child: str = CHILD) -> dict[str, object]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs in a private mount namespace")
    # Over /dev/shm itself, as a container's --shm-size is, in a mount namespace of the child's
    # own: the host's /dev/shm is untouched (the room left is kept on /dev/shm's file system only).
    mount = 'mount -t tmpfs -o size="$0"k tmpfs /dev/shm && exec "$1" -c "$2" /dev/shm'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mount,
                           str(size_k), sys.executable, child], capture_output=True, text=True, timeout=100)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# Two slots' worth (2 MiB here, more than a quarter of these file systems) always stays free.
@pytest.mark.parametrize("size_k, held, kept", [
    (6 * 1024, [5, 6, 7], None),   # room for all three
    (4300, [6, 7], 2),             # room for two: they alternate, the newest two are kept
    (3200, [7], 1),                # room for one: it is rewritten every step
])
def test_fewer_slots_when_shared_memory_is_short(tmp_path: Path, size_k: int, held: list[int], kept: int | None) -> None:
    result = _run_in_tmpfs(tmp_path, size_k)
    assert result["error"] is None
    assert result["held"] == held
    if kept is None:
        assert result["notices"] == []
    else:
        notices = result["notices"]
        assert isinstance(notices, list) and len(notices) == 1, notices
        assert f"room for only {kept} of this rank's 3 snapshots (1.0 MB each): keeping {kept}" in notices[0]


def test_two_ranks_short_of_room_keep_two_snapshots_each_not_three_and_one(tmp_path: Path) -> None:
    """Acceptance 27B F2: in a /dev/shm with room for four slots, the rank that committed first
    took three and its peer kept one, so a kill of that peer (a commit behind) left no step both
    held, and the restart went back to the script's start, in half of the runs."""
    result = _run_in_tmpfs(tmp_path, 6656, TWO_RANKS)  # 6.5 MiB: four 1 MiB slots and 2 MiB free
    assert result["0"] == {"held": [3, 4], "notice": "shared memory has room for only 2 of this rank's 3 "
                           "snapshots (1.0 MB each): keeping 2"}, result
    assert result["1"]["held"] == [3, 4], result  # type: ignore[index]


def test_no_room_for_one_snapshot_is_an_error(tmp_path: Path) -> None:
    result = _run_in_tmpfs(tmp_path, 2500)  # one would fit, but would leave the job too little
    assert result["error"] == "ENOSPC" and result["held"] == []


def test_snapshots_leave_a_quarter_of_shared_memory_and_two_slots_free() -> None:
    """Acceptance 19B F3: in a container's 64 MB /dev/shm the snapshots took what the job's
    DataLoader workers needed, and the job failed where torchrun trains."""
    from unicron.worker.snapslots import check_headroom, headroom_bytes

    assert headroom_bytes(64 * MIB, 25 * MIB) == 50 * MIB  # two slots' worth
    assert headroom_bytes(24 << 30, 25 * MIB) == 6 << 30  # a quarter of a host's 24 GiB
    stat = os.statvfs_result((4096, 4096, 16384, 16384, 16384, 0, 0, 0, 0, 255))  # 64 MiB, all free
    check_headroom(stat, 8 * MIB, 4 * MIB)  # 56 MiB left, 16 MiB kept
    with pytest.raises(OSError) as err:
        check_headroom(stat, 25 * MIB, 25 * MIB)  # 39 MiB left, 50 MiB kept
    assert err.value.errno == errno.ENOSPC and "--shm-size" in str(err.value)
    assert "and 52 MB stay free for the job's own use" in str(err.value)
    tiny = os.statvfs_result((4096, 4096, 2048, 2048, 2048, 0, 0, 0, 0, 255))  # 8 MiB, all free
    with pytest.raises(OSError) as err:
        check_headroom(tiny, 12 * MIB, 12 * MIB)  # 27B F9: "8 of 8 MB free, and 25 MB stay free"
    assert "8 of 8 MB free, and a quarter of it, and at least two snapshots' worth, stays free" in str(err.value)
