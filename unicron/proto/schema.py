"""Schemas of every message kind on the mesh.

A schema maps a field name to its expected type(s); a field whose name ends with ``?`` is
optional. Unknown fields are refused, so a peer with a newer incompatible idea of a message
fails loudly instead of being half understood.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NUM = (int, float)
OPT_STR = (str, type(None))
OPT_INT = (int, type(None))

SCHEMAS: dict[str, dict[str, Any]] = {
    # agent -> coordinator
    "join": {"node_id": str, "host": str, "nproc": int, "node_rank?": OPT_INT, "pid": int,
             "weight?": NUM, "min_nodes": int, "max_nodes": int, "max_restarts": int,
             "last_call_s": NUM, "heartbeat_timeout_s": NUM, "join_timeout_s": NUM,
             "stop_timeout_s": NUM, "heartbeat_interval_s?": NUM, "hang?": dict, "inject?": str, "role?": str,
             # a fenced node re-joining: the attempt it was lost from and the snapshots it kept
             "attempt?": int, "snapshots?": dict, "snapshot_bytes?": dict,
             # a member whose coordinator restarted: the attempt it runs (unicron.coord.resume)
             "resume?": dict},
    "heartbeat": {"node_id": str, "epoch": int, "attempt": int, "workers": list, "health": dict, "activity?": str,
                  "done?": bool},
    "fault": {"node_id": str, "attempt": int, "fault": dict},
    "stopped": {"node_id": str, "attempt": int, "snapshots": dict, "stacks": dict, "snapshot_bytes?": dict,
                "finished?": list},
    "finished": {"node_id": str, "attempt": int},
    "leave": {"node_id": str, "reason": str},
    "status_req": {},
    # coordinator -> agent
    "welcome": {"node_id": str, "epoch": int, "note?": str},  # note: what was changed in the join
    # done: the attempt (its number) in which some rank is past its last step: no hang can be called
    # deaf: the coordinator hears none of the nodes it could hear over the network (its own
    # link is likelier cut than theirs, unicron.coord.hearing): no hang is called meanwhile
    "ack": {"epoch": int, "state": str, "activity?": str, "done?": int, "deaf?": bool, "stopping?": int,
            "decided?": str},  # a decision to restart, as the console says it, told as it is taken
    "assign": {"epoch": int, "attempt": int, "restart_count": int, "node_rank": int, "nnodes": int,
               "rank_offset": int, "world_size": int, "local_world_sizes": list,
               "master_addr": str, "master_port": int, "restore_step?": OPT_INT,
               "restore_note?": str,  # why nothing is restored though snapshots were kept
               "why?": str,  # the decision this attempt carries out, as the console says it
               "inject": bool, "inject_faults?": str, "roles?": list,
               # every node of the attempt in node-rank order ([node id, host]) and the restarts
               # spent: what a restarted coordinator needs to take the attempt back
               "nodes": list, "restarts_used": int,
               # when the job was created and its restarts so far (newest last): what status
               # shows, given back by a resume so a restarted coordinator keeps the job's story
               "started_at?": NUM, "restarts?": list},
    # victim: the first report is a victim's (a lost peer): ranks caught failing are waited for
    "stop": {"attempt": int, "reason": str, "want_stacks": bool, "victim?": bool},
    "shutdown": {"exit_code": int, "reason": str},
    # fenced: no longer a member (re-join); wait: no place yet, ask again (a member may be lost soon);
    # unknown_job: a coordinator that does not know the job (it restarted): register it again
    # clock: this coordinator's time, to a node whose messages carry a time too far off it
    "reject": {"reason": str, "fenced?": bool, "lost?": bool, "wait?": bool, "unknown_job?": bool, "clock?": NUM},
    "status": {"snapshot": dict},
}


# Fields of a fault (``fault.fault``) whose type the coordinator relies on; others may ride along.
FAULT_FIELDS: dict[str, Any] = {"kind": str, "ts": NUM, "rank": OPT_INT, "node": OPT_STR, "host": OPT_STR,
                                "exitcode": OPT_INT, "signal": (str, int, type(None)), "error_type": OPT_STR,
                                "message": OPT_STR, "traceback": OPT_STR, "stderr_tail": OPT_STR,
                                "summary": OPT_STR, "steps_completed": OPT_INT, "attempt": int,
                                "culprit_ranks": list, "gpu": OPT_INT, "sys_exit": (bool, type(None))}
NESTED: dict[tuple[str, str], dict[str, Any]] = {("fault", "fault"): FAULT_FIELDS}


def _type_error(key: str, value: Any, types: Any) -> str | None:
    # bool is an int in Python; a schema that wants int must not accept True.
    if isinstance(value, bool) and types is not bool and (not isinstance(types, tuple) or bool not in types):
        return f"field {key!r} has type bool"
    if not isinstance(value, types):
        return f"field {key!r} has type {type(value).__name__}"
    return None


def schema_errors(kind: str, body: Any) -> str | None:
    """Return why ``body`` does not fit the schema of ``kind``, or None when it fits."""
    schema = SCHEMAS.get(kind)
    if schema is None:
        return f"unknown kind {kind!r}"
    if not isinstance(body, dict):
        return "body is not an object"
    allowed = {name.rstrip("?") for name in schema}
    extra = set(body) - allowed
    if extra:
        return f"unexpected field(s) {sorted(extra)}"
    problem = field_errors(schema, body, kind)
    check = VALUE_CHECKS.get(kind)
    return problem if problem is not None or check is None else check(body)


def field_errors(schema: dict[str, Any], body: dict[str, Any], kind: str = "") -> str | None:
    """Why the fields of ``body`` named in ``schema`` (``name?``: optional) are missing or of
    another type, or None; fields the schema does not name are not looked at. ``kind``: a mesh
    message's, whose nested fields (``NESTED``) are checked too."""
    for name, types in schema.items():
        optional = name.endswith("?")
        key = name.rstrip("?")
        if key not in body:
            if optional:
                continue
            return f"missing field {key!r}"
        problem = _type_error(key, body[key], types)
        if problem is not None:
            return problem
        nested = NESTED.get((kind, key))
        if nested is not None:
            for field, field_types in nested.items():
                if field in body[key]:
                    problem = _type_error(f"{key}.{field}", body[key][field], field_types)
                    if problem is not None:
                        return problem
    return None


# Values inside a message that its types do not say are right, checked at receipt: a message the
# handlers would fail on later (in the job's tick, where an exception fails the whole job, or in a
# metrics scrape) is dropped here with the other malformed ones (acceptance 29B F1: a signed
# ``fault`` of kind "martian" failed every node of the job).
# (The faults a ``join``'s resume carries are checked where it is taken: unicron.coord.resume.)
def _fault_value(body: dict[str, Any]) -> str | None:
    # Imported here: workers import the mesh's codec, and need none of unicron.detect.
    from unicron.detect.faults import report_problem

    problem = report_problem(dict(body["fault"], node_id=body["node_id"]))
    return None if problem is None else f"fault: {problem}"


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _heartbeat_value(body: dict[str, Any]) -> str | None:
    return None if all(isinstance(w, dict) for w in body["workers"]) else "workers: not a list of objects"


def _stopped_value(body: dict[str, Any]) -> str | None:
    # Ranks' stack dumps: {"rank": text}, read as int(rank) when the stop is decided.
    if not all(isinstance(r, str) and r.isascii() and r.isdigit() and isinstance(t, str)
               for r, t in body["stacks"].items()):
        return "stacks: not an object of rank -> text"
    return None


def _assign_value(body: dict[str, Any]) -> str | None:
    sizes = body["local_world_sizes"]
    if not sizes or not all(_count(n) and n > 0 for n in sizes) or not 0 <= body["node_rank"] < len(sizes):
        return "local_world_sizes: not every node's process count, or node_rank outside them"
    return None


VALUE_CHECKS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "fault": _fault_value, "heartbeat": _heartbeat_value, "stopped": _stopped_value, "assign": _assign_value}
