"""Does importing the zygote's PRELOAD (or asking for the device count) load libcuda? (gpu_checks.py warm)"""
import contextlib
import importlib
import json

import torch

from unicron.worker import zygote

for name in zygote.PRELOAD:
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
out = {"after_preload": zygote.cuda_driver_loaded(), "cuda_initialized": torch.cuda.is_initialized()}
out.update(device_count=torch.cuda.device_count(), after_device_count=zygote.cuda_driver_loaded())
print(json.dumps(out))
