"""cudadriver.driver_state() through torch's CUDA life cycle on a real driver, one JSON line:
after import, after a device count, after torch.cuda.init(); and whether a fork made after a
plain import (what the zygote does) can use CUDA."""
import json
import os

import torch

from unicron.worker import cudadriver


def child_uses_cuda() -> int:
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if torch.ones(4, device="cuda").sum().item() == 4.0 else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


if not torch.cuda.is_available():
    print(json.dumps({"after_import": cudadriver.driver_state(), "cuda": False}))
    raise SystemExit(0)
out = {"after_import": cudadriver.driver_state(), "fork_after_import_exit": child_uses_cuda()}
out["device_count"] = torch.cuda.device_count()
out["after_device_count"] = cudadriver.driver_state()
torch.cuda.init()
out["after_init"] = cudadriver.driver_state()
print(json.dumps(out))
