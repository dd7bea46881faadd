"""Reading a file a user named (a config file, a planner input, a secret) without trusting it to
be one: a FIFO would block the read forever, ``/dev/zero`` or a huge file would fill memory."""

from __future__ import annotations

import os
import stat


class NotReadable(ValueError):
    """The path names something other than a regular file of bounded size; the message says
    what, for a one-line error."""


def read_regular(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them. Raises
    ``OSError`` when it cannot be opened, ``NotReadable`` when it is not a regular file or is
    larger than ``max_bytes``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without a writer, and is refused below
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise NotReadable("is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise NotReadable("is not a regular file")
        if st.st_size > max_bytes:
            raise NotReadable(f"is {st.st_size} bytes, more than the {max_bytes} a file here may have")
        chunks = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while read
        raise NotReadable(f"is more than the {max_bytes} bytes a file here may have")
    return data
