"""Where this worker's threads are: samples of their innermost frames, and the waits read off
their stacks (a data loader, another thread, a debugger).

Split from ``unicron.worker.liveness``, which judges motion over time: this is what one look
at the threads' frames says, with no clock and no state of its own, so that the frame watch
keeps to its timing and these stack readings can be read (and changed) on their own.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

DATA_FRAMES = "torch/utils/data/"  # a frame of a data loader (iterating, fetching, waiting for workers)
DATA_DEPTH = 24  # frames looked at from the innermost one outwards for a data loader
PIN_MEMORY_FRAMES = "torch/utils/data/_utils/pin_memory.py"
COLLECTIVE_FRAMES = "torch/distributed/"
DEBUGGER_FRAMES = ("/bdb.py", "/pdb.py", "pydevd")  # pdb, ipdb (on bdb), debugpy: a person at the prompt


class FrameSample:
    """One sample of a thread: equal to another only for the same frame object at the same
    instruction (holding it keeps the frame's address from being reused by a new call)."""

    __slots__ = ("frame", "lasti")

    def __init__(self, frame: FrameType, lasti: int) -> None:
        self.frame, self.lasti = frame, lasti

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FrameSample) and other.frame is self.frame and other.lasti == self.lasti

    def __hash__(self) -> int:
        return hash((id(self.frame), self.lasti))

    def __repr__(self) -> str:
        code = self.frame.f_code
        return f"<{code.co_filename}:{code.co_name}@{self.lasti} frame {id(self.frame):#x}>"


def main_thread_signature() -> FrameSample | None:
    """The main thread's innermost Python frame and instruction, now."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    return FrameSample(frame, frame.f_lasti)


def waits_for_data(sample: FrameSample | None, depth: int = DATA_DEPTH) -> bool:
    """Whether the main thread waits for a data loader: a loader's frame is among the ``depth``
    innermost frames of the sample (the wait itself is deeper: a queue, a pipe, a selector, the
    dataset's own read), or the main thread waits outside any collective while another thread
    is inside a loader (a prefetching thread that iterates it)."""
    frame = sample.frame if sample is not None else None
    if frame is None:
        return False
    if _within(frame, DATA_FRAMES, depth):
        return True
    if COLLECTIVE_FRAMES in _filename(frame):  # waiting for its peers, not for its data
        return False
    frames = sys._current_frames()
    for thread in user_threads():
        other = frames.get(thread.ident or -1)
        # A pin-memory thread sits inside its loader whatever the main thread does.
        if _within(other, DATA_FRAMES, depth) and not _within(other, PIN_MEMORY_FRAMES, depth):
            return True
    return False


def user_threads() -> list[threading.Thread]:
    """The script's Python threads other than the main one and the caller's (unicron's own,
    named ``unicron-...``, never count)."""
    skip = {threading.main_thread().ident, threading.get_ident()}
    return [t for t in threading.enumerate()
            if t.ident is not None and t.ident not in skip and not t.name.startswith("unicron-")]


def _filename(frame: FrameType) -> str:
    return frame.f_code.co_filename.replace("\\", "/")


def _within(frame: FrameType | None, part: str | tuple[str, ...], depth: int) -> bool:
    """Whether a frame of a file whose path contains ``part`` (one of them) is among the
    ``depth`` innermost."""
    parts = (part,) if isinstance(part, str) else part
    for _ in range(depth):
        if frame is None:
            return False
        filename = _filename(frame)
        if any(p in filename for p in parts):
            return True
        frame = frame.f_back
    return False


def waits_for_threads(sample: FrameSample | None) -> bool:
    """Whether the main thread is blocked on another thread: its innermost frame is in
    ``threading`` (a future's result, ``executor.map``, ``join``, a queue or lock). With a
    thread of its own computing meanwhile, that is an evaluation on a thread pool, whose long
    native ops change no frame for seconds (acceptance 19A F3: it was called a hang)."""
    frame = sample.frame if sample is not None else None
    return frame is not None and _filename(frame).endswith("/threading.py")


def in_debugger(sample: FrameSample | None, depth: int = DATA_DEPTH) -> bool:
    """The main thread stopped in a debugger (``breakpoint()``): a person, not a peer, holds it."""
    return _within(getattr(sample, "frame", None), DEBUGGER_FRAMES, depth)
