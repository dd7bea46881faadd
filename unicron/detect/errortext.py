"""The words a failing component really prints, for the classifier's text rules (pure).

A rank's stderr tail holds everything it wrote, its own log lines too. A rule that looks for a
word anywhere in it reads a script's start-up check (``preflight: ECC errors: 0, NVLink links
down: 0``) as a hardware fault and leaves a healthy node out of the job; an optional helper's
``can't open file`` earlier in the output made a transient exit FATAL (acceptance 33A F1/F2).
So each pattern here is the wording of the component that reports the fault (the kernel, CUDA,
NVML, NCCL, CPython, argparse), and where a tool's output could hold it by the way, the line has
to be where that tool puts it (the last one, for a process that ended on it).
"""

from __future__ import annotations

import re

from unicron.detect.evidence import (
    FRAME_FILE,
    Evidence,
    drop_afterwords,
    final_traceback,
    strip_prefixes,
    without_source,
)
from unicron.detect.faults import Fault, stderr_summary

# The kernel's report (dmesg, or a script that forwards it): "NVRM: Xid (PCI:0000:3b:00): 79, pid=...".
# Never the bare word: "Xid" in a log line ("checked Xid events: none") is not one.
XID_LINE = re.compile(r"\bXid \(PCI:[0-9A-Fa-f:.]+\): \d{1,3}\b[^\n]*")
# CUDA's own message for cudaErrorECCUncorrectable (torch: "CUDA error: uncorrectable ECC error
# encountered"), and the error's names; not "ECC errors: 0" from a health check.
ECC_ERROR = re.compile(r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE")
# CUDA's cudaErrorNvlinkUncorrectable ("uncorrectable NVLink error was detected during the
# execution"), or an NCCL warning line about a link that failed; plain `via P2P/NVLink` INFO
# lines and a script's "NVLink links down: 0" are neither.
NVLINK_ERROR = re.compile(r"uncorrectable NVLink error|cudaErrorNvlinkUncorrectable|CUDA_ERROR_NVLINK_UNCORRECTABLE"
                          r"|NCCL WARN[^\n]*NVLink[^\n]*(?i:error|fail|fault|down)")
# The driver's Xid 79 text; NVML's NVML_ERROR_GPU_IS_LOST as nvidia-smi and pynvml print it
# ("...: GPU is lost.  Reboot the system", "NVMLError_GPUIsLost: GPU is lost"); CUDA's name.
GPU_LOST = re.compile(r"GPU has fallen off the bus|: GPU is lost(?:\.|[ \t]*$)|cudaErrorDevicesUnavailable",
                      re.MULTILINE)
# CPython's words when it cannot open the script it was given, which it prints and exits 2 on:
# "/usr/bin/python3: can't open file '/x/train.py': [Errno 2] No such file or directory"; and
# unicron's worker boot's, in the same case (unicron.worker.boot, exit 2 too).
_CANT_OPEN = re.compile(r"^(?:.*: can't open file '.*': \[Errno \d+\]|unicron worker: can't open file )")
# argparse ends on "prog: error: ..." after its "usage: ..." block; click on "Error: ...".
_USAGE_START = re.compile(r"^usage:", re.IGNORECASE)
_USAGE_ERROR = re.compile(r"^(?:.+: )?error: ", re.IGNORECASE)
# The allocators' and CUDA's own words for running out of memory (torch's caching allocator,
# "CUDA out of memory. Tried to allocate 2.00 GiB"; CUDA's cudaErrorMemoryAllocation as torch and
# the driver API print it; cuBLAS, C++'s bad_alloc, torch's CPU allocator), and torch's exception
# type as it ends a line of a traceback; not "OutOfMemoryError" in a log line about a retry with
# a smaller batch, nor "warning: CUDA out of memory on previous try" (acceptance 34A F2).
_OOM_WORDS = (r"(?:CUDA|HIP) out of memory\. Tried to allocate|CUDA error: out of memory"
              r"|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"
              r"|CUBLAS_STATUS_ALLOC_FAILED|std::bad_alloc|DefaultCPUAllocator: (?:can't allocate|not enough) memory")
OOM_TEXT = re.compile(_OOM_WORDS + r"|^(?:[\w.]+\.)?OutOfMemoryError:", re.MULTILINE)
# Without an exception that ended the process, its last line must be the allocator's or CUDA's
# own words: "OutOfMemoryError: retrying with smaller batch" alone is a log line (35A F4).
OOM_WORDS = re.compile(_OOM_WORDS)
OOM_TYPES = frozenset({"OutOfMemoryError", "MemoryError"})


def _last_lines(tail: str) -> list[str]:
    """The non-empty lines of a stderr tail (launcher prefixes off), without what a process
    prints after it failed (teardown warnings)."""
    return drop_afterwords([line.rstrip() for line in strip_prefixes(tail).splitlines() if line.strip()])


# CPython's words when ``python -m X`` finds no module X (it prints them and exits 1):
# "/usr/bin/python3: No module named missing_mod", or for a package's submodule "...: Error while
# finding module specification for 'pkg.sub' (ModuleNotFoundError: No module named 'pkg')".
_NO_MODULE = re.compile(r"^\S*python[\w.]*: (?:No module named [\w.]+|Error while finding module specification "
                        r"for '[\w.]+' \(ModuleNotFoundError: No module named '[\w.]+'\))$")


def _ended_on(fault: Fault, line: re.Pattern[str], exitcode: int) -> bool:
    """The process exited ``exitcode`` and ``line`` is the last it wrote: CPython's own words
    then, not a helper subprocess's printed earlier (``python optional_prefetch.py``, missing)."""
    lines = _last_lines(fault.stderr_tail)
    return fault.exitcode == exitcode and bool(lines) and bool(line.match(lines[-1]))


def missing_module(fault: Fault) -> bool:
    """CPython could not find the module ``-m`` named, and exited 1 (35A F3: under
    ``--no-inject`` this spent the whole restart budget)."""
    return _ended_on(fault, _NO_MODULE, 1)


def cant_open_script(fault: Fault) -> bool:
    """CPython could not open the script it was started with, and exited 2."""
    return _ended_on(fault, _CANT_OPEN, 2)


def usage_error(fault: Fault) -> bool:
    """The process ended on argparse's (or click's) error line, after a usage block: a
    subprocess's usage error printed earlier is not the script's."""
    lines = _last_lines(fault.stderr_tail)
    return (bool(lines) and bool(_USAGE_ERROR.match(lines[-1]))
            and any(_USAGE_START.match(line) for line in lines[:-1]))


def out_of_memory(fault: Fault, ev: Evidence) -> bool:
    """The error that ended the process is an out-of-memory one: its exception (type, message,
    the traceback's chain) or the line its stderr ended on (a C++ ``what()``); not any line: an
    earlier traceback the script caught (a ``traceback`` that is the stderr's copy holds them all)."""
    if ev.exception_type in OOM_TYPES:
        return True
    said = stderr_summary(strip_prefixes(fault.stderr_tail))
    if not ev.exception_type:
        return bool(OOM_WORDS.search(said))
    where = "\n".join((ev.exception_message, without_source(final_traceback(fault.traceback)), said))
    return bool(OOM_TEXT.search(where))


# torch.distributed's parts (its process groups, gloo, NCCL, the c10d store) as its exceptions'
# types and messages name them (gloo's and c10d's C++ sources: "[../third_party/gloo/...]"): a
# connection refused there is a peer's (or the store's) loss; anywhere else it is the script's own socket.
_COLLECTIVE_MARKS = ("gloo", "nccl", "processgroup", "c10d", "torch/distributed", "torch.distributed", "tcpstore",
                     "distnetworkerror", "diststoreerror")
# A Python frame of torch.distributed itself: a file of an installed torch (site-packages,
# dist-packages), not a script's own directory called nccl_experiments/ (34A F3) or
# proj/torch/distributed/, and not the ``@record`` decorator's wrapper
# (torch.distributed.elastic.multiprocessing.errors), in every traceback of a script using it (35A F2).
_TORCH_DISTRIBUTED_FRAME = re.compile(r"[/\\](?:site|dist)-packages[/\\]torch[/\\]distributed[/\\]"
                                      r"(?!elastic[/\\]multiprocessing[/\\]errors[/\\])")


def from_collective(fault: Fault, ev: Evidence, needle: str) -> bool:
    """The error came out of torch.distributed: its type or message name it, or a frame of its
    traceback (the final one, with its chain) is torch.distributed's own; or (no exception known)
    the very line that says ``needle`` does. Not any line of stderr: gloo prints at start-up
    (``[Gloo] Rank 0 is connected to 1 peer ranks``)."""
    if ev.exception_type:
        frames = FRAME_FILE.findall(final_traceback(fault.traceback or fault.stderr_tail))
        if any(_TORCH_DISTRIBUTED_FRAME.search(frame) for frame in frames):
            return True
        text = " ".join((fault.error_type, ev.exception_message))
    else:
        text = " ".join(line for line in ev.text.splitlines() if needle in line)
    return any(mark in text.lower() for mark in _COLLECTIVE_MARKS)
