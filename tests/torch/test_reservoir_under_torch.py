"""reservoir under the real PyTorch from PyPI, on the simulated CUDA device.

Run by ctest once per installed release, as test_simcuda_torch.py is, with
the reservoir Python package (build/python) on PYTHONPATH and RESERVOIR_PRELOAD
naming libreservoir_preload.so. Each case runs in a fresh interpreter: the
allocator PyTorch uses is chosen once per process.
"""
import os
import subprocess
import sys
import textwrap

import pytest
from scenarios import PAUSE_RESUME

PRELOAD = os.environ["RESERVOIR_PRELOAD"]
SIMCUDA = os.environ["LD_PRELOAD"]


def run(code, env=None, preload=SIMCUDA):
    full = dict(os.environ)
    full.update(env or {})
    full["LD_PRELOAD"] = preload
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("config", ["", "expandable_segments:True", "policy:paging"])
def test_the_pluggable_allocator_serves_pytorch(config):
    out = run(f"""
        import torch, reservoir
        MiB = 1 << 20
        reservoir.install_torch({config!r})
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(1000, dtype=torch.float32, device="cuda")
        cpu = torch.arange(30 * MiB, dtype=torch.int64).to(torch.uint8)
        x.copy_(cpu)
        y.copy_(torch.arange(1000, dtype=torch.float32))
        assert torch.equal(x.cpu(), cpu)
        assert torch.equal(y.cpu(), torch.arange(1000, dtype=torch.float32))
        s = reservoir.stats(0)
        print(s["allocated_bytes.all.current"], s["active.all.current"])
        del x, y
        print(reservoir.stats(0)["allocated_bytes.all.current"])
    """)
    assert out == [str(30 * 2**20 + 4096), "2", "0"]


def test_a_mempool_of_the_pluggable_allocator():
    # PyTorch's own allocator stays current; the pool's segments come from
    # reservoir (PyTorch refuses a MemPool while a pluggable allocator is
    # the current one).
    out = run("""
        import torch, reservoir
        MiB = 1 << 20
        alloc = torch.cuda.memory.CUDAPluggableAllocator(
            reservoir.library_path(), "reservoir_torch_malloc", "reservoir_torch_free")
        pool = torch.cuda.MemPool(alloc.allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")  # PyTorch's own
        x.copy_(torch.full((8 * MiB,), 7, dtype=torch.uint8))
        assert torch.equal(x.cpu(), torch.full((8 * MiB,), 7, dtype=torch.uint8))
        # The pool's segment (20 MiB for an 8 MiB request) is reservoir's.
        print(reservoir.stats(0)["allocated_bytes.all.current"], torch.cuda.memory_reserved())
        del x, pool
        torch.cuda.empty_cache()
        print(reservoir.stats(0)["allocated_bytes.all.current"])
    """)
    assert out == [str(20 * 2**20), str(40 * 2**20), "0"]


@pytest.mark.parametrize("hook_mode", ["preload", "torch"])
def test_pause_and_resume_keep_addresses_and_bytes(hook_mode):
    out = run(f"from reservoir.memory_saver import torch_memory_saver as tms\n"
              f"import torch\ntms.hook_mode = {hook_mode!r}\nMiB = 1 << 20\n"
              + textwrap.dedent(PAUSE_RESUME))
    # The device's free memory rose by what each pause released.
    assert out == ["128", "64", "True", "True", "True", "True", "True", "True"]


def test_the_interposer_serves_pytorchs_cudamalloc():
    code = """
        import ctypes, torch
        sim = ctypes.CDLL("libcuda.so.1")
        MiB = 1 << 20
        torch.cuda.init()
        before = sim.reservoirSimCudaCalls(b"cudaMalloc")
        for i in range(20):
            x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            x.copy_(torch.full((64 * MiB,), i, dtype=torch.uint8))
            assert int(x[-1].item()) == i
            del x
            torch.cuda.empty_cache()  # PyTorch hands the segment back: cudaFree
        print(sim.reservoirSimCudaCalls(b"cudaMalloc") - before)
    """
    # PyTorch alone: a cudaMalloc each time; under the interposer reservoir
    # caches what PyTorch frees, and the device sees one.
    assert run(code) == ["20"]
    assert run(code, preload=PRELOAD + " " + SIMCUDA) == ["1"]  # the interposer first
