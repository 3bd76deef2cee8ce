"""Libraries that reach CUDA without PyTorch's runtime, on reservoir's
simulated device beside PyTorch: Numba's CUDA target (numba-cuda 0.30.4,
whose cuda-bindings open libcuda.so themselves and call the driver) shares
PyTorch's tensors and device both ways, under PyTorch's allocator and under
reservoir's own; CuPy 14.2 (CUDA 13), which links CUDA's runtime statically,
is refused with a reason (that runtime asks the driver for its private
export tables, which the simulation does not serve: docs/simcuda.md).

Run by ctest (cuda_python_libraries) with the simulated runtime preloaded;
RESERVOIR_CUDA_LIBS_SITE is tests/torch/requirements-cuda-python-libraries.txt's
folder of the PyPI cache (added as a site folder: numba-cuda's .pth file
redirects numba.cuda to it).
"""
import json
import os
import subprocess
import sys
import textwrap

MiB = 1 << 20

PROGRAM = """
import json, os, site
site.addsitedir(os.environ["RESERVOIR_CUDA_LIBS_SITE"])
import numpy as np
import torch
from numba import cuda
MiB = 1 << 20
out = {"backend": None}
# PyTorch's tensor, its bytes put there by a copy, read through Numba's view.
t = torch.arange(MiB, dtype=torch.int32).to("cuda")
out["backend"] = torch.cuda.get_allocator_backend()
view = cuda.as_cuda_array(t)
out["view_pointer_is_tensors"] = view.__cuda_array_interface__["data"][0] == t.data_ptr()
out["view_reads_tensor"] = bool((view.copy_to_host() == np.arange(MiB, dtype=np.int32)).all())
# Numba's own allocation: the driver's memory, not the caching allocator's.
allocated = torch.cuda.memory_allocated()
free0, total = torch.cuda.mem_get_info()
d = cuda.to_device(np.full(3 * MiB, 7, dtype=np.uint8))
free1, _ = torch.cuda.mem_get_info()
out["numba_took"] = free0 - free1
out["allocated_unchanged"] = torch.cuda.memory_allocated() == allocated
# ... seen by PyTorch as a tensor over the same bytes.
shared = torch.as_tensor(d, device="cuda")
out["tensor_pointer_is_numbas"] = shared.data_ptr() == d.device_ctypes_pointer.value
out["tensor_reads_numba"] = bool((shared.cpu() == 7).all())
shared.copy_(torch.full((3 * MiB,), 9, dtype=torch.uint8))
out["numba_reads_tensor_write"] = bool((d.copy_to_host() == 9).all())
del shared, d
cuda.current_context().memory_manager.deallocations.clear()  # Numba frees late, in batches
free2, _ = torch.cuda.mem_get_info()
out["numba_gave_back"] = free2 - free1
out["devices"] = [str(x.name) for x in cuda.list_devices()]
out["same_total"] = cuda.current_context().get_memory_info()[1] == total
# CuPy: its statically linked runtime needs the driver's private export tables.
try:
    import cupy
    cupy.cuda.runtime.getDeviceProperties(0)
    out["cupy"] = "served"
except Exception as e:
    out["cupy"] = type(e).__name__ + ": " + str(e)
print("RESULT " + json.dumps(out), flush=True)
"""


def run(allocator):
    env = {k: v for k, v in os.environ.items() if k != "RESERVOIR_TORCH_ALLOCATOR"}
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
    return json.loads(lines[-1][len("RESULT "):]), r.stderr


def check(result, stderr, backend):
    assert result["backend"] == backend
    assert result["devices"] == ["NVIDIA H100 80GB HBM3"]
    assert result["same_total"]
    assert result["view_pointer_is_tensors"] and result["view_reads_tensor"]
    # 3 MiB through cuMemAlloc: two whole 2 MiB pages of the device, given
    # back when Numba frees it; the caching allocator's count stays.
    assert result["numba_took"] == 4 * MiB and result["numba_gave_back"] == 4 * MiB
    assert result["allocated_unchanged"]
    assert result["tensor_pointer_is_numbas"] and result["tensor_reads_numba"]
    assert result["numba_reads_tensor_write"]
    assert result["cupy"].startswith("CUDARuntimeError: cudaErrorNotSupported"), result["cupy"]
    assert "cuGetExportTable is not served by the simulated device" in stderr


def test_numba_and_cupy_under_pytorchs_allocator():
    check(*run("native"), "native")


def test_numba_and_cupy_beside_reservoirs_own_allocator():
    check(*run("own"), "reservoir")
