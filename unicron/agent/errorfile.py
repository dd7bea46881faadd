"""The launcher's own ``TORCHELASTIC_ERROR_FILE``: what a tool that wraps the launcher reads.

torchrun's ``main`` is ``@record``ed: when the job fails it copies the root-cause rank's
error file (its ``@record`` JSON) to the error file named in the launcher's environment, which
TorchX and schedulers' wrappers read for the failure's message. unicron does the same: the root
cause's error file when that rank ran on this node and left one, else a record of the job's
failure line in the same format.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from unicron.agent.logs import RunLogDir

ENV = "TORCHELASTIC_ERROR_FILE"


def root_cause_file(message: str, run_logs: RunLogDir, attempt: int | None, rank_offset: int) -> str | None:
    """This node's error file of the rank the failure line names first, if it wrote one."""
    named = re.search(r"\brank (\d+)\b", message)
    directory = run_logs.attempt_dir(attempt) if attempt is not None else None
    if named is None or directory is None:
        return None
    path = os.path.join(directory, str(int(named.group(1)) - rank_offset), "error.json")
    return path if os.path.isfile(path) and os.path.getsize(path) > 0 else None


def record(message: str, exit_code: int, source: str | None) -> dict[str, Any]:
    """The JSON to write: the root cause's own (its error code set, as torchrun does), or one
    made of the failure line."""
    if source is not None:
        try:
            with open(source, encoding="utf-8") as fh:
                data = json.load(fh)
            if isinstance(data, dict) and isinstance(data.get("message"), dict):
                data["message"].setdefault("errorCode", exit_code)
                return data
        except (OSError, ValueError):
            pass  # unreadable or not JSON: say the failure line instead
    return {"message": {"message": message, "errorCode": exit_code,
                        "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}


def write(path: str, data: dict[str, Any]) -> str | None:
    """Write ``data`` to ``path`` (replacing what is there); the reason it could not, else None."""
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
    except OSError as err:
        return f"cannot write {ENV} {path}: {err.strerror}"
    return None
