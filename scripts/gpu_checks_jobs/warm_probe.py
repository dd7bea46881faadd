"""Run by a worker the zygote forked (gpu_checks.py warm): CUDA init and a matmul on cuda:0."""
import time

import torch

t0 = time.perf_counter()
if torch.cuda.is_available():
    torch.cuda.init()
a = torch.arange(16.0, device="cuda:0" if torch.cuda.is_available() else "cpu").reshape(4, 4)
print(f"WARM_RESULT device={a.device} matmul_sum={(a @ a).sum().item():g} s={time.perf_counter() - t0:.3f}")
