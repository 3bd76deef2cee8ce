"""vLLM's sleep mode on reservoir's simulated CUDA device: the real vLLM
0.33.0 from PyPI (its CuMemAllocator, the cumem_allocator extension on the
simulated driver's virtual-memory calls, and CudaRTLibrary, which opens the
libcudart it finds mapped, by its path), under the PyTorch release it pins
(2.14.0), with PyTorch's allocator and with reservoir's own beside it.

Run by ctest (vllm_0.33.0_sleep) with the simulated runtime preloaded and
tests/torch/requirements-vllm-0.33.0.txt's folder first on PYTHONPATH.
"""
import json
import os
import subprocess
import sys
import textwrap

MiB = 1 << 20

PROGRAM = """
import json, os
import torch
from vllm.device_allocator.cumem import CuMemAllocator
from vllm.utils.system_utils import find_loaded_library
import vllm.device_allocator.cumem as cumem
MiB = 1 << 20
a = CuMemAllocator.get_instance()
with a.use_memory_pool(tag="weights"):
    w = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
with a.use_memory_pool(tag="kv_cache"):
    kv = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
pattern = (torch.arange(64 * MiB, dtype=torch.int64) * 7 % 251).to(torch.uint8)
w.copy_(pattern)
outside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")  # the caching allocator's, not vLLM's
outside.copy_(torch.full((8 * MiB,), 3, dtype=torch.uint8))
ptrs = (w.data_ptr(), kv.data_ptr())
cycles = []
for cycle in range(2):
    free0, _ = torch.cuda.mem_get_info()
    a.sleep(offload_tags=("weights",))
    free1, _ = torch.cuda.mem_get_info()
    a.wake_up()
    free2, _ = torch.cuda.mem_get_info()
    cycles.append({"released": free1 - free0, "retaken": free1 - free2,
                   "same_pointers": (w.data_ptr(), kv.data_ptr()) == ptrs,
                   "weights_restored": torch.equal(w.cpu(), pattern),
                   "outside_kept": bool((outside.cpu() == 3).all())})
print("RESULT " + json.dumps({"cycles": cycles, "backend": torch.cuda.get_allocator_backend(),
                              "cudart": find_loaded_library("libcudart"), "torch": torch.__version__,
                              "cudart_opened": cumem.libcudart is not None}), flush=True)
"""


def run(allocator):
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_TORCH_ALLOCATOR"}
    env["RESERVOIR_SIMCUDA_KERNELS"] = "skip"  # torch.empty's own kernels; the bytes move by copies
    code = textwrap.dedent(PROGRAM)
    if allocator == "own":
        import reservoir
        site_dir = os.path.dirname(os.path.dirname(os.path.abspath(reservoir.__file__)))
        code = f"import site; site.addsitedir({site_dir!r})\n" + code
        env["RESERVOIR_TORCH_ALLOCATOR"] = "own"
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{allocator}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def check(result, backend):
    assert result["torch"].startswith("2.14.0")
    assert result["backend"] == backend
    # CudaRTLibrary opened the runtime it found mapped: the simulated one,
    # the only libcudart in the process.
    assert result["cudart_opened"]
    assert os.path.realpath(result["cudart"]) == os.path.realpath(os.environ["LD_PRELOAD"].split(":")[0])
    # Each cycle: both tags' 96 MiB leave the device and come back at the
    # same addresses, the offloaded weights with their bytes; memory outside
    # vLLM's pool stays.
    for c in result["cycles"]:
        assert c == {"released": 96 * MiB, "retaken": 96 * MiB, "same_pointers": True, "weights_restored": True,
                     "outside_kept": True}, result["cycles"]


def test_sleep_and_wake_under_pytorchs_allocator():
    check(run("native"), "native")


def test_sleep_and_wake_beside_reservoirs_own_allocator():
    check(run("own"), "reservoir")
