"""The planner's input: a plain description of the cluster, its jobs and what just failed.

``PlanInput.from_dict`` checks everything and raises ``InputError`` naming the offending
field (``jobs[1].throughput["3"]: ...``); ``to_dict`` gives back a dict ``from_dict`` accepts.
Nothing here reads files: the CLI loads JSON/YAML, the coordinator builds the dict from what
agents report.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from unicron.errors import InputError
from unicron.plan.throughput import GPUS, ModelSpec, throughput_table

# Defaults in Gbit/s; sources and assumptions in docs/planner.md.
LOCAL_GBPS = 8 * 450 * 8  # copy inside a node over NVLink: 8 GPUs x 450 GB/s (H100 SXM)
NODE_GBPS = 8 * 400  # DGX H100: eight 400 Gb/s NDR InfiniBand ports for the compute fabric
STORAGE_GBPS = 100  # assumption: what a shared checkpoint store gives one job


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int = 8
    rack: str = "r0"


@dataclass(frozen=True)
class Network:
    local_gbps: float = LOCAL_GBPS
    node_gbps: float = NODE_GBPS
    rack_uplink_gbps: float | None = None  # None: half the rack's node bandwidth (2:1 oversubscribed)
    storage_gbps: float = STORAGE_GBPS


@dataclass(frozen=True)
class Job:
    name: str
    weight: float = 1.0
    nodes: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int | None = None
    throughput: dict[int, float] = field(default_factory=dict)  # node count -> achieved throughput
    model: ModelSpec | None = None  # when set, ``throughput`` was computed from it
    state_gb: float = 0.0  # training state of one replica (weights + optimizer), GB
    model_parallel: int = 1  # shards of the state; rank r needs shard r % model_parallel
    snapshots: dict[str, tuple[str, ...]] = field(default_factory=dict)  # holder -> nodes it holds a copy of

    def runnable(self, count: int) -> bool:
        if count == 0:
            return True
        if count < self.min_nodes or (self.max_nodes is not None and count > self.max_nodes):
            return False
        return count in self.throughput

    def rate(self, count: int) -> float:
        """T(count); 0 for 0 nodes or a count the job cannot run on."""
        return self.throughput.get(count, 0.0) if count and self.runnable(count) else 0.0


@dataclass(frozen=True)
class PlanInput:
    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    failed: tuple[str, ...] = ()
    horizon_s: float = 3600.0
    transition_s: float = 120.0
    network: Network = Network()

    @property
    def healthy(self) -> tuple[str, ...]:
        failed = set(self.failed)
        return tuple(n.name for n in self.nodes if n.name not in failed)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    @staticmethod
    def from_dict(data: Any) -> PlanInput:
        return _parse_input(data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [{"name": n.name, "gpus": n.gpus, "rack": n.rack} for n in self.nodes],
            "network": {k: v for k, v in vars(self.network).items() if v is not None},
            "jobs": [_job_to_dict(j) for j in self.jobs],
            "failed": list(self.failed),
            "horizon_s": self.horizon_s,
            "transition_s": self.transition_s,
        }


def _job_to_dict(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {"name": job.name, "weight": job.weight, "nodes": list(job.nodes),
                           "min_nodes": job.min_nodes}
    if job.max_nodes is not None:
        out["max_nodes"] = job.max_nodes
    if job.model is not None:
        out["model"] = dict(vars(job.model))
    else:
        out["throughput"] = {str(k): v for k, v in sorted(job.throughput.items())}
    out.update(state_gb=job.state_gb, model_parallel=job.model_parallel,
               snapshots={k: list(v) for k, v in job.snapshots.items()})
    return out


# ---- checking -------------------------------------------------------------------------------

def _obj(value: Any, path: str, allowed: set[str], required: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{path or 'input'}: expected an object, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise InputError(f"{_join(path, str(key))}: unknown field (allowed: {', '.join(sorted(allowed))})")
    for key in sorted(required):
        if key not in value:
            raise InputError(f"{_join(path, key)}: missing")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# Above any real duration, rate or weight (a rate may be FLOP/s: a 100,000-GPU cluster is about
# 1e20), and far below where the reward's products of three such numbers overflow (1e308 s x a
# throughput was inf, and the plan's JSON carried -Infinity).
NUMBER_MAX = 1e30


def _num(value: Any, path: str, *, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{path}: expected a number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise InputError(f"{path}: must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    if value > NUMBER_MAX:
        raise InputError(f"{path}: must be <= {NUMBER_MAX:g}, got {value!r}")
    return float(value)


# Sizes that drive the planner's work or memory, far above any real cluster or model; beyond
# them an input is a typo or an attack, and one gpus: 100000000 had `unicron plan` build a tuple
# per GPU until it was killed at 23 GB (acceptance 29C F1). See docs/planner.md, "Limits".
MAX_GPUS_PER_NODE = 1024  # ranks per node: the transfer plan enumerates every one
MAX_TOTAL_GPUS = 262_144  # all nodes' GPUs: every rank the transfer plan may enumerate (1 s of CPU)
MAX_NODES = 65_536  # cluster size, node counts, min/max_nodes: the knapsack's and model table's size
MAX_JOBS = 4_096  # the knapsack does a pass per job and option over every node count (30B F7: 20,000 jobs took 27 s)
MAX_LAYERS = 10_000  # a model table searches the divisors of the layer count for every node count
MAX_SHAPE = 10**9  # hidden, heads, batch, sequence, vocabulary: arithmetic only, kept far from overflow


def _int(value: Any, path: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{path}: expected an integer, got {value!r}")
    if value < minimum:
        raise InputError(f"{path}: must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InputError(f"{path}: must be <= {maximum:,}, got {value:,}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def _names(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise InputError(f"{path}: expected a list of node names, got {type(value).__name__}")
    names = tuple(_str(v, f"{path}[{i}]") for i, v in enumerate(value))
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise InputError(f"{path}: node {dup[0]!r} listed twice")
    return names


def _parse_input(data: Any) -> PlanInput:
    top = _obj(data, "", {"nodes", "jobs", "failed", "horizon_s", "transition_s", "network"}, {"nodes", "jobs"})
    if not isinstance(top["nodes"], list) or not top["nodes"]:
        raise InputError("nodes: expected a non-empty list")
    if len(top["nodes"]) > MAX_NODES:
        raise InputError(f"nodes: {len(top['nodes']):,} nodes, at most {MAX_NODES:,} are supported")
    nodes: list[Node] = []
    for i, raw in enumerate(top["nodes"]):
        path = f"nodes[{i}]"
        item = _obj(raw, path, {"name", "gpus", "rack"}, {"name"})
        nodes.append(Node(name=_str(item["name"], f"{path}.name"),
                          gpus=_int(item.get("gpus", 8), f"{path}.gpus", minimum=1, maximum=MAX_GPUS_PER_NODE),
                          rack=_str(item.get("rack", "r0"), f"{path}.rack")))
    total_gpus = sum(n.gpus for n in nodes)
    if total_gpus > MAX_TOTAL_GPUS:
        raise InputError(f"nodes: {total_gpus:,} GPUs in all, at most {MAX_TOTAL_GPUS:,} are supported "
                         f"(the transfer plan enumerates every rank)")
    known = Counter(n.name for n in nodes)
    dup = [n for n, c in known.items() if c > 1]
    if dup:
        raise InputError(f"nodes: node {dup[0]!r} defined twice")
    failed = _names(top.get("failed", []), "failed")
    for i, name in enumerate(failed):
        if name not in known:
            raise InputError(f"failed[{i}]: unknown node {name!r}")
    network = _parse_network(top.get("network", {}))
    gpus_per_node = Counter(n.gpus for n in nodes).most_common(1)[0][0]
    if not isinstance(top["jobs"], list):
        raise InputError("jobs: expected a list")
    if len(top["jobs"]) > MAX_JOBS:
        raise InputError(f"jobs: {len(top['jobs']):,} jobs, at most {MAX_JOBS:,} are supported")
    jobs: list[Job] = []
    owner: dict[str, str] = {}
    for i, raw in enumerate(top["jobs"]):
        job = _parse_job(raw, f"jobs[{i}]", set(known), len(nodes), gpus_per_node)
        if any(j.name == job.name for j in jobs):
            raise InputError(f"jobs[{i}].name: job {job.name!r} defined twice")
        for name in job.nodes:
            if name in owner:
                raise InputError(f"jobs[{i}].nodes: node {name!r} already belongs to job {owner[name]!r}")
            owner[name] = job.name
        jobs.append(job)
    return PlanInput(nodes=tuple(nodes), jobs=tuple(jobs), failed=failed,
                     horizon_s=_num(top.get("horizon_s", 3600.0), "horizon_s", strict=True),
                     transition_s=_num(top.get("transition_s", 120.0), "transition_s"),
                     network=network)


def _parse_network(raw: Any) -> Network:
    keys = {"local_gbps", "node_gbps", "rack_uplink_gbps", "storage_gbps"}
    item = _obj(raw, "network", keys)
    values = {k: _num(v, f"network.{k}", strict=True) for k, v in item.items()}
    return Network(**values)


def _parse_job(raw: Any, path: str, known: set[str], cluster_size: int, gpus_per_node: int) -> Job:
    allowed = {"name", "weight", "nodes", "min_nodes", "max_nodes", "throughput", "model", "state_gb",
               "model_parallel", "snapshots"}
    item = _obj(raw, path, allowed, {"name"})
    name = _str(item["name"], f"{path}.name")
    nodes = _names(item.get("nodes", []), f"{path}.nodes")
    for k, node in enumerate(nodes):
        if node not in known:
            raise InputError(f"{path}.nodes[{k}]: unknown node {node!r}")
    min_nodes = _int(item.get("min_nodes", 1), f"{path}.min_nodes", minimum=1, maximum=MAX_NODES)
    max_nodes = None if item.get("max_nodes") is None else _int(item["max_nodes"], f"{path}.max_nodes", minimum=1,
                                                                maximum=MAX_NODES)
    if max_nodes is not None and max_nodes < min_nodes:
        raise InputError(f"{path}.max_nodes: {max_nodes} is below min_nodes {min_nodes}")
    if ("throughput" in item) == ("model" in item):
        raise InputError(f"{path}: give exactly one of 'throughput' (a table) or 'model' (a description)")
    model = None
    if "model" in item:
        model = _parse_model(item["model"], f"{path}.model")
        # No job runs on more nodes than the cluster has: counts above it would be computed for nothing.
        table = throughput_table(model, min(max_nodes or cluster_size, cluster_size), gpus_per_node)
    else:
        table = _parse_table(item["throughput"], f"{path}.throughput")
    job = Job(name=name, weight=_num(item.get("weight", 1.0), f"{path}.weight", strict=True), nodes=nodes,
              min_nodes=min_nodes, max_nodes=max_nodes, throughput=table, model=model,
              state_gb=_num(item.get("state_gb", 0.0), f"{path}.state_gb"),
              model_parallel=_int(item.get("model_parallel", 1), f"{path}.model_parallel", minimum=1,
                                  maximum=MAX_TOTAL_GPUS),
              snapshots=_parse_snapshots(item.get("snapshots", {}), f"{path}.snapshots", known, set(nodes)))
    if nodes and not job.runnable(len(nodes)):
        raise InputError(f"{path}.nodes: the job runs on {len(nodes)} node(s) but that count is not runnable "
                         f"(needs a throughput entry within min_nodes..max_nodes)")
    return job


def _parse_table(raw: Any, path: str) -> dict[int, float]:
    if not isinstance(raw, dict) or not raw:
        raise InputError(f"{path}: expected a non-empty object mapping node count to throughput")
    table: dict[int, float] = {}
    for key, value in raw.items():
        where = f'{path}["{key}"]'
        count = key if isinstance(key, int) and not isinstance(key, bool) else None
        digits = key.strip() if isinstance(key, str) else ""
        if digits.isascii() and digits.isdigit():  # int() refuses "²" and 5,000 digits with a ValueError
            count = int(digits) if len(digits) <= 12 else MAX_NODES + 1
        if count is None or count < 1:
            raise InputError(f"{where}: key is not a positive node count")
        if count > MAX_NODES:
            raise InputError(f"{where}: node count must be <= {MAX_NODES:,}")
        if count in table:
            raise InputError(f"{where}: node count {count} given twice")
        table[count] = _num(value, where)
    return dict(sorted(table.items()))


def _parse_model(raw: Any, path: str) -> ModelSpec:
    shape = {"layers", "hidden", "heads", "global_batch", "seq_len", "vocab"}
    item = _obj(raw, path, {"params_b", "gpu"} | shape, {"params_b", "gpu"})
    gpu = _str(item["gpu"], f"{path}.gpu")
    if gpu not in GPUS:
        raise InputError(f"{path}.gpu: unknown GPU {gpu!r} (known: {', '.join(GPUS)})")
    overrides = {k: _int(item[k], f"{path}.{k}", minimum=1, maximum=MAX_LAYERS if k == "layers" else MAX_SHAPE)
                 for k in shape if k in item}
    return ModelSpec.gpt3_like(_num(item["params_b"], f"{path}.params_b", strict=True), gpu, **overrides)


def _parse_snapshots(raw: Any, path: str, known: set[str], own: set[str]) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected an object mapping a holder node to the nodes it has copies of")
    out: dict[str, tuple[str, ...]] = {}
    for holder, held in raw.items():
        if holder not in known:
            raise InputError(f"{path}.{holder}: unknown node {holder!r}")
        names = _names(held, f"{path}.{holder}")
        for k, name in enumerate(names):
            if name not in own:
                raise InputError(f"{path}.{holder}[{k}]: {name!r} is not one of the job's nodes")
        out[str(holder)] = names
    return out
