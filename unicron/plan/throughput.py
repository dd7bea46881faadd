"""Achieved throughput T(n) of a GPT-style model on n nodes, from a model description.

For every node count the best Megatron-style layout (tensor x pipeline x data parallel) is
searched and its iteration time estimated with a simple analytic model; T(n) is the model
FLOP/s that layout achieves. Counts with no layout that fits in memory are not runnable.

Where the numbers come from (see docs/planner.md for the full derivation):
- GPU peak dense BF16/FP16 tensor FLOP/s, memory, NVLink and NIC bandwidth: NVIDIA's V100, A100,
  H100 and H200 datasheets and the DGX-1 / DGX A100 / DGX H100 system specs (one NIC per GPU).
- Model FLOPs per iteration, 72*B*s*l*h^2*(1 + s/(6h) + V/(12lh)): Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (no recompute).
- Pipeline bubble of 1F1B, (p-1)/m: same paper.
- Memory per parameter with Megatron's distributed optimizer, 6 + 12/d bytes (bf16 params,
  fp32 grads and Adam state): Megatron-LM docs, "Distributed Optimizer".
- Activation memory, 34*s*b*h bytes per layer per micro-batch divided by t (sequence
  parallelism and selective recomputation): Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022.
- GPT-3 shapes when only a parameter count is given: Brown et al., "Language Models are Few-Shot
  Learners", 2020, Table 2.1.
- KERNEL_EFFICIENCY is an assumption: the fraction of peak the matrix kernels reach. 0.55 puts
  GPT-3 175B on 1,024 A100s at 144 TFLOP/s per GPU with t=8, p=8, d=16: Megatron-LM reports
  140 TFLOP/s (45% of peak) with that same layout (SC'21, Table 1).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

KERNEL_EFFICIENCY = 0.55
MEMORY_HEADROOM = 0.9  # fraction of GPU memory the layout may fill (allocator, buffers)
BYTES_BF16 = 2


@dataclass(frozen=True)
class GpuSpec:
    peak_flops: float  # dense BF16/FP16 tensor FLOP/s
    memory_gb: float
    nvlink_gbyte_s: float  # per GPU, all links, one direction (GB/s)
    nic_gbit_s: float  # inter-node bandwidth per GPU (Gbit/s)


GPUS: dict[str, GpuSpec] = {
    "V100": GpuSpec(125e12, 32, 150, 100),
    "A100": GpuSpec(312e12, 80, 300, 200),
    "H100": GpuSpec(989e12, 80, 450, 400),
    "H200": GpuSpec(989e12, 141, 450, 400),
}

# name: (layers, hidden, heads, global batch in sequences of 2,048 tokens), Brown et al. Table 2.1
GPT3_SHAPES: dict[float, tuple[int, int, int, int]] = {
    0.125: (12, 768, 12, 256),
    0.35: (24, 1024, 16, 256),
    0.76: (24, 1536, 16, 256),
    1.3: (24, 2048, 24, 512),
    2.7: (32, 2560, 32, 512),
    6.7: (32, 4096, 32, 1024),
    13.0: (40, 5120, 40, 1024),
    175.0: (96, 12288, 96, 1536),
}


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder; layers/hidden/heads/global_batch default to the closest GPT-3 shape."""

    params_b: float
    gpu: str
    layers: int
    hidden: int
    heads: int
    global_batch: int
    seq_len: int = 2048
    vocab: int = 51200

    @staticmethod
    def gpt3_like(params_b: float, gpu: str, **overrides: int) -> ModelSpec:
        closest = min(GPT3_SHAPES, key=lambda size: abs(math.log(size) - math.log(params_b)))
        layers, hidden, heads, batch = GPT3_SHAPES[closest]
        shape = {"layers": layers, "hidden": hidden, "heads": heads, "global_batch": batch}
        shape.update(overrides)
        return ModelSpec(params_b=params_b, gpu=gpu, **shape)

    @property
    def params(self) -> float:
        """Parameters implied by the shape (12*l*h^2 + V*h), not the nominal params_b."""
        return 12 * self.layers * self.hidden**2 + self.vocab * self.hidden

    def flops_per_iteration(self) -> float:
        s, h, layers = self.seq_len, self.hidden, self.layers
        return 72.0 * self.global_batch * s * layers * h * h * (1 + s / (6 * h) + self.vocab / (12 * layers * h))


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batches: int
    iteration_s: float
    flops: float  # achieved model FLOP/s of the whole job


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    """Cached: a model table asks for the layer count's divisors once per node count."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def layout_time(model: ModelSpec, gpus_per_node: int, tp: int, pp: int, dp: int) -> float | None:
    """Estimated seconds per iteration of one layout, or None when it does not fit or is invalid."""
    gpu = GPUS[model.gpu]
    if model.global_batch % dp:
        return None
    micro = model.global_batch // dp  # micro-batch size 1
    s, h = model.seq_len, model.hidden
    params_per_gpu = model.params / (tp * pp)
    weights = (6 + 12 / dp) * params_per_gpu
    activations = min(pp, micro) * (model.layers / pp) * 34 * s * h / tp
    if weights + activations > MEMORY_HEADROOM * gpu.memory_gb * 1e9:
        return None
    per_stage_compute = model.flops_per_iteration() / model.global_batch / (tp * pp)
    compute_s = per_stage_compute / (gpu.peak_flops * KERNEL_EFFICIENCY)
    # Tensor parallelism stays inside a node: 4 all-reduces of s*h activations per layer per micro-batch.
    tp_bytes = 0.0 if tp == 1 else (model.layers / pp) * 4 * 2 * (tp - 1) / tp * s * h * BYTES_BF16
    tp_s = tp_bytes / (gpu.nvlink_gbyte_s * 1e9)
    nic_bytes_s = gpu.nic_gbit_s * 1e9 / 8
    pp_s = 0.0 if pp == 1 else 2 * s * h * BYTES_BF16 / nic_bytes_s
    pipeline_s = (micro + pp - 1) * (compute_s + tp_s + pp_s)
    dp_bw = gpu.nvlink_gbyte_s * 1e9 if tp * pp * dp <= gpus_per_node else nic_bytes_s
    dp_s = 0.0 if dp == 1 else 2 * (dp - 1) / dp * params_per_gpu * BYTES_BF16 / dp_bw
    return pipeline_s + dp_s


def best_layout(model: ModelSpec, nodes: int, gpus_per_node: int) -> Layout | None:
    """The fastest valid (tp, pp, dp) on ``nodes`` nodes, or None when none fits."""
    world = nodes * gpus_per_node
    best: Layout | None = None
    for tp in (1, 2, 4, 8):
        if tp > gpus_per_node or model.heads % tp or model.hidden % tp or world % tp:
            continue
        for pp in _divisors(model.layers):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            seconds = layout_time(model, gpus_per_node, tp, pp, dp)
            if seconds is None:
                continue
            flops = model.flops_per_iteration() / seconds
            if best is None or flops > best.flops:
                best = Layout(tp, pp, dp, model.global_batch // dp, seconds, flops)
    return best


def throughput_table(model: ModelSpec, max_nodes: int, gpus_per_node: int) -> dict[int, float]:
    """T(n) in FLOP/s for n = 1..max_nodes; counts without a valid layout are left out."""
    table: dict[int, float] = {}
    for nodes in range(1, max_nodes + 1):
        layout = best_layout(model, nodes, gpus_per_node)
        if layout is not None:
            table[nodes] = layout.flops
    return table
