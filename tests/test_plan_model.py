"""Planner input: schema errors name the field; round trip; throughput from a model description."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from unicron.errors import InputError
from unicron.plan.model import PlanInput
from unicron.plan.throughput import ModelSpec, best_layout, throughput_table

GOOD: dict[str, Any] = {
    "nodes": [{"name": "n0", "gpus": 8, "rack": "r0"}, {"name": "n1", "gpus": 8, "rack": "r0"},
              {"name": "n2", "gpus": 8, "rack": "r1"}],
    "jobs": [{"name": "a", "weight": 1.0, "nodes": ["n0", "n1"], "min_nodes": 1,
              "throughput": {"1": 1.0, "2": 1.9, "4": 3.6}, "state_gb": 10, "model_parallel": 2,
              "snapshots": {"n2": ["n1"]}}],
    "failed": ["n1"], "horizon_s": 3600, "transition_s": 120,
}


def edited(path: list[Any], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, field", [
    (["nodes"], [], "nodes"),
    (["nodes", 0, "gpus"], 0, "nodes[0].gpus"),
    (["nodes", 0, "gpus"], "8", "nodes[0].gpus"),
    (["nodes", 1, "name"], "n0", "nodes: node 'n0' defined twice"),
    (["nodes", 0, "colour"], "red", "nodes[0].colour: unknown field"),
    (["jobs", 0, "weight"], -1, "jobs[0].weight"),
    (["jobs", 0, "weight"], True, "jobs[0].weight"),
    (["jobs", 0, "name"], KeyError, "jobs[0].name: missing"),
    (["jobs", 0, "nodes"], ["n0", "zz"], "jobs[0].nodes[1]: unknown node 'zz'"),
    (["jobs", 0, "nodes"], ["n0", "n0"], "jobs[0].nodes: node 'n0' listed twice"),
    (["jobs", 0, "nodes"], ["n0", "n1", "n2"], "jobs[0].nodes: the job runs on 3 node(s)"),
    (["jobs", 0, "throughput"], {"two": 1.0}, 'jobs[0].throughput["two"]'),
    (["jobs", 0, "throughput"], {"0": 1.0}, 'jobs[0].throughput["0"]'),
    (["jobs", 0, "throughput"], {"2": "fast"}, 'jobs[0].throughput["2"]'),
    (["jobs", 0, "throughput"], {"2": float("nan")}, 'jobs[0].throughput["2"]'),
    (["jobs", 0, "throughput"], KeyError, "jobs[0]: give exactly one of"),
    (["jobs", 0, "model"], {"params_b": 7, "gpu": "TPU"}, "jobs[0]: give exactly one of"),
    (["jobs", 0, "min_nodes"], 3, "jobs[0].nodes: the job runs on 2 node(s)"),
    (["jobs", 0, "max_nodes"], 0, "jobs[0].max_nodes"),
    (["jobs", 0, "snapshots"], {"n9": ["n1"]}, "jobs[0].snapshots.n9"),
    (["jobs", 0, "snapshots"], {"n2": ["n2"]}, "jobs[0].snapshots.n2[0]"),
    (["jobs", 0, "model_parallel"], 0, "jobs[0].model_parallel"),
    (["failed"], ["n7"], "failed[0]: unknown node 'n7'"),
    (["failed"], "n1", "failed: expected a list"),
    (["horizon_s"], 0, "horizon_s: must be > 0"),
    (["transition_s"], -5, "transition_s"),
    (["network"], {"node_gbps": -1}, "network.node_gbps"),
    (["extra"], 1, "extra: unknown field"),
])
def test_bad_input_names_the_field(path: list[Any], value: Any, field: str) -> None:
    with pytest.raises(InputError) as err:
        PlanInput.from_dict(edited(path, value))
    assert field in str(err.value)
    assert "\n" not in str(err.value)
    assert err.value.exit_code != 0


def test_not_an_object() -> None:
    with pytest.raises(InputError, match="input: expected an object"):
        PlanInput.from_dict([1, 2])


def test_node_shared_by_two_jobs() -> None:
    data = copy.deepcopy(GOOD)
    data["jobs"].append({"name": "b", "nodes": ["n1"], "throughput": {"1": 1}})
    with pytest.raises(InputError, match=r"jobs\[1\].nodes: node 'n1' already belongs to job 'a'"):
        PlanInput.from_dict(data)


def test_unknown_gpu_in_model() -> None:
    data = edited(["jobs", 0, "throughput"], KeyError)
    data["jobs"][0]["model"] = {"params_b": 7, "gpu": "TPU"}
    with pytest.raises(InputError, match=r"jobs\[0\].model.gpu: unknown GPU 'TPU'"):
        PlanInput.from_dict(data)


def test_round_trip() -> None:
    inp = PlanInput.from_dict(GOOD)
    assert PlanInput.from_dict(inp.to_dict()) == inp
    assert inp.healthy == ("n0", "n2")
    modelled = edited(["jobs", 0, "throughput"], KeyError)
    modelled["jobs"][0]["model"] = {"params_b": 1.3, "gpu": "A100"}
    inp = PlanInput.from_dict(modelled)
    assert "model" in inp.to_dict()["jobs"][0] and PlanInput.from_dict(inp.to_dict()) == inp


def test_model_description_gives_throughput_table() -> None:
    data = edited(["jobs", 0, "throughput"], KeyError)
    data["jobs"][0]["model"] = {"params_b": 1.3, "gpu": "A100"}
    job = PlanInput.from_dict(data).jobs[0]
    assert set(job.throughput) <= {1, 2, 3} and 1 in job.throughput and 2 in job.throughput
    assert job.throughput[2] > job.throughput[1]


def test_more_jobs_than_the_planner_takes_is_one_error() -> None:
    data = copy.deepcopy(GOOD)
    data["jobs"] = [{"name": f"j{i}", "throughput": {"1": 1.0}} for i in range(4_097)]
    with pytest.raises(InputError, match="jobs: 4,097 jobs, at most 4,096 are supported"):
        PlanInput.from_dict(data)


def test_a_table_written_out_in_flops_is_taken_as_the_model_table_it_came_from() -> None:
    # A model-derived table is in FLOP/s (1.3e15 for one DGX node, 1e18 for a thousand): a user
    # who writes such a table out, or bench_plan.py's --tables model, must get the same plan input.
    table = throughput_table(ModelSpec.gpt3_like(13, "A100"), 1024, 8)
    assert max(table.values()) > 1e17
    data = copy.deepcopy(GOOD)
    data["jobs"][0]["throughput"] = {str(count): flops for count, flops in table.items()}
    assert PlanInput.from_dict(data).jobs[0].throughput == table


def test_megatron_gpt3_175b_calibration() -> None:
    # Megatron-LM (SC'21, Table 1): 175B on 1,024 A100s, t=8 p=8, about 140 TFLOP/s per GPU.
    layout = best_layout(ModelSpec.gpt3_like(175, "A100"), nodes=128, gpus_per_node=8)
    assert layout is not None
    per_gpu = layout.flops / 1024
    assert 120e12 < per_gpu < 160e12
    assert (layout.tp, layout.pp) == (8, 8)


def test_model_that_does_not_fit_is_not_runnable() -> None:
    model = ModelSpec.gpt3_like(175, "V100")
    table = throughput_table(model, max_nodes=4, gpus_per_node=8)
    assert table == {}  # 175B needs more than 32 V100s' memory
    small = throughput_table(ModelSpec.gpt3_like(6.7, "H100"), max_nodes=4, gpus_per_node=8)
    assert list(small) == [1, 2, 4]  # 24 GPUs: no t x p x d with p | 32 layers and d | 1,024 sequences
    assert small[4] < 4 * small[1]  # all-reduce across nodes costs something


def _model_job(**shape: int) -> dict[str, Any]:
    data = edited(["jobs", 0, "throughput"], KeyError)
    data["jobs"][0]["model"] = {"params_b": 1.3, "gpu": "A100", **shape}
    return data


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data, field", [
    (edited(["nodes", 0, "gpus"], 100_000_000), "nodes[0].gpus: must be <= 1,024, got 100,000,000"),
    ({**GOOD, "nodes": [{"name": f"n{i}", "gpus": 1024} for i in range(257)]},
     "nodes: 263,168 GPUs in all, at most 262,144"),
    ({**GOOD, "nodes": [{"name": f"n{i}", "gpus": 1} for i in range(65_537)]}, "nodes: 65,537 nodes, at most 65,536"),
    (edited(["jobs", 0, "model_parallel"], 10**12), "jobs[0].model_parallel: must be <= 262,144"),
    (edited(["jobs", 0, "max_nodes"], 10**9), "jobs[0].max_nodes: must be <= 65,536"),
    (edited(["jobs", 0, "min_nodes"], 10**9), "jobs[0].min_nodes: must be <= 65,536"),
    (edited(["jobs", 0, "throughput"], {"2": 1.0, "100000": 2.0}), 'jobs[0].throughput["100000"]: node count must be <='),
    (edited(["jobs", 0, "throughput"], {"2": 1.0, "9" * 5000: 2.0}), "node count must be <= 65,536"),
    (edited(["jobs", 0, "throughput"], {"2": 1.0, "\u00b2": 2.0}), "key is not a positive node count"),
    (_model_job(layers=10**9), "jobs[0].model.layers: must be <= 10,000"),
    (_model_job(hidden=10**200), "jobs[0].model.hidden: must be <= 1,000,000,000"),
])
def test_sizes_that_drive_work_or_memory_are_bounded(data: dict[str, Any], field: str) -> None:
    """Acceptance 29C F1: a node of 100,000,000 GPUs had the transfer plan build a tuple per GPU
    (23 GB before the OOM killer); a model's layer count or a max_nodes of 1e9 made the model
    table loop for ever; a 5,000-digit or unicode-digit count key was an internal error."""
    with pytest.raises(InputError) as err:
        PlanInput.from_dict(data)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(30)
def test_a_model_table_stops_at_the_cluster_size() -> None:
    job = PlanInput.from_dict({**_model_job(), "jobs": [{**_model_job()["jobs"][0], "max_nodes": 65_536}]}).jobs[0]
    assert max(job.throughput) <= 3
