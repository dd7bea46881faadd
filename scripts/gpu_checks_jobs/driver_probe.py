"""Does importing the zygote's PRELOAD (or asking for the device count) load or initialise the
CUDA driver? (gpu_checks.py warm: a zygote may fork from a loaded driver, not an initialised one)"""
import contextlib
import importlib
import json

import torch

from unicron.worker import cudadriver, zygote

for name in zygote.PRELOAD:
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
out = {"after_preload": cudadriver.driver_state(), "cuda_initialized": torch.cuda.is_initialized()}
out.update(device_count=torch.cuda.device_count(), after_device_count=cudadriver.driver_state())
print(json.dumps(out))
