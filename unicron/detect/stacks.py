"""Parse ``faulthandler`` stack dumps and name the rank that holds up a hung collective.

In a hung synchronous job every rank but the culprit waits inside a collective (an
all-reduce, a barrier, DDP's gradient all-reduce at the end of backward); the culprit is
somewhere else (an endless loop, a sleep, a stuck data loader). ``faulthandler`` dumps only
Python frames: a collective is recognised by its innermost Python frame (see
``COLLECTIVE_FRAMES``), because the waiting itself happens in C++ below it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

_THREAD_HEADER = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):\s*$"
)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*?)\s*$')
# A frame's source line, added under it by the agent (``annotate_sources``): faulthandler gives none.
_SOURCE = re.compile(r"^\s+> (.*?)\s*$")


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str
    source: str = ""  # the line's text, when the agent could read it

    @property
    def path(self) -> str:
        """The file's path with forward slashes (a dump may come from any platform's Python)."""
        return self.filename.replace("\\", "/")

    def short(self) -> str:
        parts = self.path.split("/")
        # The last three parts; "..." says where a longer path was cut (not a relative path).
        tail = "/".join(parts) if len(parts) <= 4 else ".../" + "/".join(parts[-3:])
        return f"{tail}:{self.lineno} in {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    thread_id: str
    current: bool  # the thread that took the dump ("Current thread")
    frames: tuple[Frame, ...]  # innermost (most recent call) first


def parse_dump(text: str) -> list[ThreadStack]:
    """Threads of the last dump in ``text`` (empty if there is none).

    faulthandler separates the threads of one dump by a blank line and ends a dump right after
    its last frame, so a thread header that does not follow a blank line starts a new dump (a
    file can hold several dumps appended one after another).
    """
    dumps: list[list[ThreadStack]] = []
    header: re.Match[str] | None = None
    frames: list[Frame] = []
    previous_blank = True

    def flush() -> None:
        if header is not None:
            dumps[-1].append(ThreadStack(header.group(2), header.group(1) == "Current thread", tuple(frames)))

    for line in text.splitlines():
        found = _THREAD_HEADER.match(line)
        if found:
            flush()
            if not dumps or not previous_blank:
                dumps.append([])
            header, frames = found, []
        else:
            frame = _FRAME.match(line)
            source = None if frame else _SOURCE.match(line)
            if frame and header is not None:
                frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
            elif source and frames:
                frames[-1] = dataclasses.replace(frames[-1], source=source.group(1))
            # anything else ("<no Python frame>", "...", other output) is skipped
        previous_blank = not line.strip()
    flush()
    return dumps[-1] if dumps else []


def _is_thread_bootstrap(frame: Frame) -> bool:
    return frame.path.endswith("/threading.py") and frame.function.startswith("_bootstrap")


def main_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    """The interpreter's main thread: the one not started by ``threading`` (its outermost frame
    is the script, not ``threading._bootstrap``); the dumping thread breaks ties."""
    candidates = [t for t in threads if t.frames and not _is_thread_bootstrap(t.frames[-1])]
    if len(candidates) > 1:
        modules = [t for t in candidates if any(f.function == "<module>" for f in t.frames)]
        candidates = modules or candidates
    if len(candidates) > 1:
        current = [t for t in candidates if t.current]
        candidates = current or candidates
    return candidates[0] if candidates else None


# (path suffix or fragment, function or None for any): an innermost frame matching one of these
# means the thread waits in a collective.
COLLECTIVE_FRAMES: tuple[tuple[str, str | None], ...] = (
    ("torch/distributed/distributed_c10d.py", None),  # all_reduce, barrier, broadcast, wait ...
    ("torch/distributed/_functional_collectives", None),  # wait_tensor of functional collectives
    ("torch/distributed/algorithms/", None),  # DDP communication hooks
    ("torch/nn/parallel/distributed.py", None),  # DDP's own buffer/param sync
    # DDP's and FSDP's constructors: the shape check and the first broadcast, C++ collectives
    ("torch/distributed/utils.py", "_verify_param_shape_across_processes"),
    ("torch/distributed/utils.py", "_sync_params_and_buffers"),
    ("torch/distributed/utils.py", "_sync_module_states"),
    # DDP all-reduces gradients in autograd hooks, and backward waits for them in C++ below:
    ("torch/autograd/graph.py", "_engine_run_backward"),
    ("torch/autograd/__init__.py", "backward"),
    ("torch/autograd/__init__.py", "grad"),
)


def frame_in_collective(frame: Frame) -> bool:
    path = frame.path
    for fragment, function in COLLECTIVE_FRAMES:
        if fragment in path and (function is None or frame.function == function):
            return True
    return waits_in_cpp(frame.source)


def waits_in_cpp(source: str) -> bool:
    """Whether a script's own line, the innermost Python frame, waits straight in C++: the
    ``Work.wait()`` of an ``async_op=True`` collective or of ``isend``/``irecv``/
    ``batch_isend_irecv`` (the pipeline-parallel pattern), a torch ``Future.wait()``. Python-level
    waits (``threading.Event``, ``subprocess``) have frames of their own below the line."""
    return ".wait(" in source and "os.wait(" not in source


def annotate_sources(text: str, line_of: Callable[[str, int], str]) -> str:
    """``text`` (faulthandler dumps) with each thread's innermost frame followed by its source
    line (``    > text``), read with ``line_of(filename, lineno)`` (the agent reads the files
    of its own node: ``linecache.getline``). A line that cannot be read is left out."""
    out: list[str] = []
    innermost = False
    for line in text.splitlines():
        out.append(line)
        if _THREAD_HEADER.match(line):
            innermost = True
            continue
        frame = _FRAME.match(line) if innermost else None
        if frame:
            innermost = False
            try:
                source = line_of(frame.group(1), int(frame.group(2))).strip()
            except (OSError, ValueError, UnicodeDecodeError):
                source = ""
            if source:
                out.append(f"    > {source[:200]}")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


@dataclass(frozen=True)
class RankStack:
    rank: int
    threads: tuple[ThreadStack, ...]
    in_collective: bool
    where: str  # the innermost frame of the thread that decided it ("" if no frames)
    call: str = ""  # in a collective: which, and the script's line that called it ("" if not known)


def _in_torch(frame: Frame) -> bool:
    return "/torch/" in frame.path


_POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "wait", "send_object_list",
                             "recv_object_list"})
_DECORATORS = frozenset({"wrapper", "inner", "_fn", "decorate_context", "wrapped"})


def collective_call(frames: tuple[Frame, ...]) -> str:
    """``all_gather_object at coll.py:32``: the torch function a thread waiting in a collective
    was called into (the outermost torch frame) and the script's line that called it (the frame
    below). "" when the wait is not under torch, or nothing called into torch."""
    for i, frame in enumerate(frames):
        if not _in_torch(frame):
            if i == 0:
                return ""
            name = frame.path.rsplit("/", 1)[-1]
            # The API the script called, under torch's decorators (c10d_logger's ``wrapper``).
            called = next((f.function for f in reversed(frames[:i]) if f.function not in _DECORATORS),
                          frames[i - 1].function)
            return f"{called} at {name}:{frame.lineno}"
    return ""


def analyze_dump(rank: int, text: str) -> RankStack | None:
    """Classify one rank's dump; ``None`` when the text holds no parsable stack."""
    threads = parse_dump(text)
    if not any(t.frames for t in threads):
        return None
    main = main_thread(threads)
    # The main thread runs the training loop; only without one do other threads decide.
    deciding = [main] if main is not None else [t for t in threads if t.frames]
    for thread in deciding:
        if frame_in_collective(thread.frames[0]):
            return RankStack(rank, tuple(threads), True, thread.frames[0].short(), collective_call(thread.frames))
    return RankStack(rank, tuple(threads), False, deciding[0].frames[0].short())


@dataclass(frozen=True)
class CulpritReport:
    """``verdict``: "culprits" (some ranks outside a collective while others wait inside),
    "all_in_collective", "none_in_collective" or "no_dumps". ``culprits`` are the ranks to
    blame: those outside the collective, or, when every dump is inside one, the ranks that gave
    no dump at all (a process that cannot even dump its stack is the prime suspect)."""

    verdict: str
    culprits: tuple[int, ...]
    in_collective: tuple[int, ...]
    outside: tuple[int, ...]
    missing: tuple[int, ...]
    where: dict[int, str]
    calls: dict[int, str] = dataclasses.field(default_factory=dict)  # see RankStack.call

    @property
    def summary(self) -> str:
        def ranks(rs: tuple[int, ...]) -> str:
            return ", ".join(map(str, rs))

        missing = f"; no stack from rank(s) {ranks(self.missing)}" if self.missing and self.missing != self.culprits else ""
        if self.verdict == "culprits":
            detail = "; ".join(f"rank {r} at {self.where[r]}" for r in self.outside)
            return f"rank(s) {ranks(self.outside)} not in the collective that rank(s) " \
                   f"{ranks(self.in_collective)} wait in ({detail}){missing}"
        if self.verdict == "all_in_collective":
            blame = f"; suspect rank(s) {ranks(self.culprits)}, which gave no stack" if self.culprits else ""
            mismatch = self.mismatch()
            if mismatch:
                return (f"ranks wait in different collectives, which never meet (a deadlock: every rank must call "
                        f"the same collectives in the same order): {mismatch}{blame}{missing}")
            return f"every rank that answered waits inside a collective (no culprit among them){blame}{missing}"
        if self.verdict == "none_in_collective":
            return f"no rank is inside a collective: not a collective hang (ranks {ranks(self.outside)}){missing}"
        return f"no stack dump could be read{missing}"

    def mismatch(self, shown: int = 4) -> str:
        """Where ranks wait, when they wait in different collectives (rank 0 in
        all_gather_object, rank 1 in broadcast: they never meet); "" when they all wait in the
        same one (from whatever lines: "rank 0 sends, the others receive" is one broadcast), or a
        rank gave no stack (it may be the one the others wait for). torchrun shows it only at
        its 30 minute timeout."""
        if self.missing or self.culprits:
            return ""
        places: dict[str, list[int]] = {}
        for rank in self.in_collective:
            places.setdefault(self.calls.get(rank, "").split(" ", 1)[0], []).append(rank)
        # Point-to-point calls pair up different calls (a send meets a recv): no mismatch to see.
        if len(places) < 2 or "" in places or any(call in _POINT_TO_POINT for call in places):
            return ""
        groups = sorted(places.values(), key=lambda rs: rs[0])
        text = "; ".join(f"rank(s) {', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''} in {self.calls[rs[0]]}"
                         for rs in groups[:shown])
        return text + (f"; {len(groups) - shown} more places" if len(groups) > shown else "")


def name_culprits(dumps: Mapping[int, str | None], expected: Iterable[int] | None = None) -> CulpritReport:
    """Name the ranks holding up the others from each rank's dump text (None/"" = no dump).

    ``expected`` adds ranks that were asked for a dump but are absent from ``dumps``.
    """
    analyzed: dict[int, RankStack] = {}
    for rank, text in dumps.items():
        result = analyze_dump(rank, text) if text else None
        if result is not None:
            analyzed[rank] = result
    all_ranks = set(dumps) | set(expected or ())
    missing = tuple(sorted(all_ranks - set(analyzed)))
    inside = tuple(sorted(r for r, s in analyzed.items() if s.in_collective))
    outside = tuple(sorted(r for r, s in analyzed.items() if not s.in_collective))
    where = {r: s.where for r, s in analyzed.items()}
    calls = {r: s.call for r, s in analyzed.items() if s.call}
    if not analyzed:
        return CulpritReport("no_dumps", (), (), (), missing, where)
    if inside and outside:
        return CulpritReport("culprits", outside, inside, outside, missing, where)
    if inside:
        return CulpritReport("all_in_collective", missing, inside, (), missing, where, calls)
    return CulpritReport("none_in_collective", (), (), outside, missing, where)
