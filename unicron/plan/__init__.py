"""Cluster model, cost-aware planner, nearest-source transfers and failure-trace simulator.

Pure code: the CLI (``unicron.plan.commands``) reads files; the coordinator builds a
``PlanInput`` from what its agents report (``PlanInput.from_dict``) and calls ``plan``.
"""

from unicron.plan.model import Job, Network, Node, PlanInput
from unicron.plan.simulate import POLICIES, SimParams, SimResult, simulate
from unicron.plan.solver import JobDecision, Plan, plan, solve_counts
from unicron.plan.throughput import ModelSpec, best_layout, throughput_table
from unicron.plan.trace import Trace, TraceEvent, llama3_trace, poisson_trace
from unicron.plan.transfers import Transfer, transfer_plan, transfer_summary

__all__ = [
    "POLICIES", "Job", "JobDecision", "ModelSpec", "Network", "Node", "Plan", "PlanInput", "SimParams",
    "SimResult", "Trace", "TraceEvent", "Transfer", "best_layout", "llama3_trace", "plan", "poisson_trace",
    "simulate", "solve_counts", "throughput_table", "transfer_plan", "transfer_summary",
]
