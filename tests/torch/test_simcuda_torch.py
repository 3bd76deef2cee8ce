"""The real PyTorch from PyPI on reservoir's simulated CUDA device.

Run by ctest once per installed release (tests/torch/requirements-*.txt,
installed by the test's fixtures), with the simulated runtime preloaded
(LD_PRELOAD=<build>/simcuda/libcudart.so.13) and that release first on
PYTHONPATH. RESERVOIR names the reservoir CLI.

What it shows: PyTorch's own allocator runs unchanged on the simulated
device (tensors written and read back, memory info, streams and events,
the retry ladder under injected cudaMalloc failures, expandable segments on
real pages), and what the simulation does not serve fails naming the call.
test_oracle.py checks reservoir verify against the snapshots PyTorch writes
there.
"""
import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch

MiB = 1 << 20
CAPACITY = 81079 * MiB  # the simulated H100's default: what CUDA reports on one
RESERVOIR = os.environ["RESERVOIR"]
sim = ctypes.CDLL("libcuda.so.1")  # the simulation's driver: already loaded, by soname


def run_python(code, env=None, timeout=300):
    """Runs code in a fresh interpreter on the simulated device."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def test_the_device_is_the_simulation():
    assert sim.reservoirSimCudaIsSimulated() == 1
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 1
    p = torch.cuda.get_device_properties(0)
    assert p.name == "NVIDIA H100 80GB HBM3"
    assert p.total_memory == CAPACITY
    assert (p.major, p.minor) == (9, 0)
    assert p.multi_processor_count == 132
    free, total = torch.cuda.mem_get_info()
    assert total == CAPACITY


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 511, 4097, 3 * MiB + 5])
def test_tensors_read_back_what_was_written(dtype, n):
    cpu = (torch.arange(n, dtype=torch.float64) * 7 % 251).to(dtype)
    x = torch.empty(n, dtype=dtype, device="cuda")
    x.copy_(cpu)
    assert torch.equal(x.cpu(), cpu)
    y = torch.empty_like(x)
    y.copy_(x)  # device to device
    assert torch.equal(y.cpu(), cpu)


def test_device_memory_follows_what_pytorch_reserves():
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    t = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    free1, _ = torch.cuda.mem_get_info()
    assert torch.cuda.memory_reserved() - reserved0 == 100 * MiB
    assert free0 - free1 == 100 * MiB
    del t
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] == free0


def test_a_kernel_launch_is_refused_naming_the_call():
    x = torch.empty(16, device="cuda")
    with pytest.raises(RuntimeError) as e:
        x.fill_(3.0)  # a kernel
        torch.cuda.synchronize()
    assert "cudaLaunchKernel is not served by reservoir's simulated CUDA device" in str(e.value)
    torch.cuda.synchronize()


def test_an_unserved_call_fails_naming_it():
    cudart = ctypes.CDLL("libcudart.so.13")
    array = ctypes.c_void_p()
    assert cudart.cudaMallocArray(ctypes.byref(array), None, 1, 1, 0) == 801  # cudaErrorNotSupported
    cudart.cudaGetErrorString.restype = ctypes.c_char_p
    assert cudart.cudaGetErrorString(801) == (
        b"operation not supported: cudaMallocArray is not served by reservoir's simulated CUDA device")
    assert cudart.cudaGetLastError() == 801
    assert cudart.cudaGetLastError() == 0


def test_a_failed_cudamalloc_is_retried_by_pytorchs_ladder():
    torch.cuda.empty_cache()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    calls = sim.reservoirSimCudaCalls(b"cudaMalloc")
    sim.reservoirSimCudaFailAt(b"cudaMalloc", 1)  # the next one
    t = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")
    assert sim.reservoirSimCudaCalls(b"cudaMalloc") - calls == 2
    assert torch.cuda.memory_stats()["num_alloc_retries"] - retries == 1
    del t


def test_cudamalloc_failing_twice_raises_out_of_memory():
    # PyTorch tries cudaMalloc, frees its cache, tries once more, then raises.
    torch.cuda.empty_cache()
    ooms = torch.cuda.memory_stats().get("num_ooms", 0)
    calls = sim.reservoirSimCudaCalls(b"cudaMalloc")
    sim.reservoirSimCudaFailAt(b"cudaMalloc", 1)
    sim.reservoirSimCudaFailAt(b"cudaMalloc", 2)
    with pytest.raises(torch.cuda.OutOfMemoryError) as e:
        torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert "Tried to allocate 64.00 MiB" in str(e.value)
    assert sim.reservoirSimCudaCalls(b"cudaMalloc") - calls == 2
    assert torch.cuda.memory_stats()["num_ooms"] - ooms == 1
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # the device serves again
    del t


def test_record_stream_holds_a_block_until_its_event_completes():
    torch.cuda.empty_cache()
    side = torch.cuda.Stream()
    sim.reservoirSimCudaHoldEvents(1)
    try:
        x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        x.record_stream(side)
        first = x.data_ptr()
        del x  # waits on an event recorded on `side`, held pending
        y = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        assert y.data_ptr() != first
        del y
        sim.reservoirSimCudaCompleteEvents()
        z = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        assert z.data_ptr() == first
        del z
    finally:
        sim.reservoirSimCudaHoldEvents(0)
        sim.reservoirSimCudaCompleteEvents()


def test_expandable_segments_map_real_pages():
    r = run_python("""
        import torch
        MiB = 1 << 20
        x = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        cpu = torch.arange(300 * MiB, dtype=torch.int64).to(torch.uint8)
        x.copy_(cpu)
        assert torch.equal(x.cpu(), cpu)
        free_in_use = torch.cuda.mem_get_info()[0]
        del x
        torch.cuda.empty_cache()
        assert torch.cuda.mem_get_info()[0] - free_in_use == 300 * MiB
        seg = torch.cuda.memory_snapshot()
        print("ok", torch.cuda.memory_reserved())
    """, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "0"]


def test_several_devices():
    r = run_python("""
        import torch
        assert torch.cuda.device_count() == 2
        a = torch.empty(1000, dtype=torch.float32, device="cuda:0")
        a.copy_(torch.arange(1000, dtype=torch.float32))
        b = a.to("cuda:1")
        assert b.device.index == 1 and torch.equal(b.cpu(), torch.arange(1000, dtype=torch.float32))
        assert torch.cuda.memory_reserved(1) == 2 * 1024 * 1024
        print("ok")
    """, {"RESERVOIR_SIMCUDA_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
