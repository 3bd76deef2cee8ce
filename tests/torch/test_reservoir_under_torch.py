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

SIMCUDA = os.environ["LD_PRELOAD"]


def run(code, env=None, preload=SIMCUDA):
    full = dict(os.environ)
    full.update(env or {})
    full["LD_PRELOAD"] = preload
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)], env=full,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("config", ["", "expandable_segments:True", "policy:paging", "policy:native_paged"])
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


# The interposer under PyTorch's own allocator: test_release.py, under every
# release.


# ---- every hook of CUDAPluggableAllocator (the hooks library per release) ----

HOOKS = """
    import ctypes, os, torch, reservoir
    MiB = 1 << 20
    sim = ctypes.CDLL("libcuda.so.1")
    sim.reservoirSimCudaUsed.restype = ctypes.c_size_t
    assert reservoir.torch_hooks_path(torch.__version__), reservoir.torch_hook_releases()
    reservoir.install_torch({config!r})
"""


def hooks(config, body, env=None):
    return run(textwrap.dedent(HOOKS.format(config=config)) + textwrap.dedent(body), env=env)


@pytest.mark.parametrize("config", ["", "expandable_segments:True", "policy:paging"])
def test_empty_cache_reaches_reservoir(config):
    out = hooks(config, """
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del x
        s = reservoir.stats(0)
        used = sim.reservoirSimCudaUsed(0)
        print(s["allocated_bytes.all.current"], s["reserved_bytes.all.current"] >= 64 * MiB)
        torch.cuda.empty_cache()
        print(reservoir.stats(0)["reserved_bytes.all.current"], used - sim.reservoirSimCudaUsed(0) >= 64 * MiB)
    """)
    assert out == ["0", "True", "0", "True"]


def test_set_per_process_memory_fraction_reaches_reservoir():
    # An 8 GiB device limited to a quarter: 1.5 GiB fits, 3 GiB does not,
    # and PyTorch raises its out-of-memory error for it.
    out = hooks("", """
        torch.cuda.set_per_process_memory_fraction(0.25)
        x = torch.empty(1536 * MiB, dtype=torch.uint8, device="cuda")
        try:
            y = torch.empty(3072 * MiB, dtype=torch.uint8, device="cuda")
            print("allocated")
        except torch.cuda.OutOfMemoryError:
            print("OutOfMemoryError")
        print(reservoir.stats(0)["num_ooms"])
    """, env={"RESERVOIR_SIMCUDA_MEMORY": "8GiB"})
    assert out == ["OutOfMemoryError", "1"]


@pytest.mark.parametrize("config", ["", "policy:paging"])
def test_record_stream_keeps_a_block_until_the_other_stream_is_done(config):
    # Events held: the block freed after record_stream on a second stream is
    # not handed out again until that stream's work completes.
    out = hooks(config, """
        side = torch.cuda.Stream()
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        first = x.data_ptr()
        sim.reservoirSimCudaHoldEvents(1)
        x.record_stream(side)
        del x
        y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        print(y.data_ptr() != first)
        del y
        sim.reservoirSimCudaCompleteEvents()
        z = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        print(z.data_ptr() == first)
    """)
    assert out == ["True", "True"]


# Freeing the pool's tensor x leaves its segment with the pool until the
# pool is released; then empty_cache hands it back.
RELEASE_THE_POOL = """
    del x
    torch.cuda.empty_cache()
    print(pools() == [(0, 0), pool])  # the pool still holds its segment
    torch._C._cuda_releasePool(0, pool)
    torch.cuda.empty_cache()
    print(pools() == [(0, 0)])
"""


def test_the_pool_hooks_route_allocations_to_a_private_pool():
    # What use_mem_pool and CUDA graph capture ask of the current allocator,
    # through PyTorch's own bindings: allocations of this thread go to a
    # private pool of reservoir's (its segment carries the pool's id) until
    # the route ends; releasing the pool lets empty_cache hand it back.
    out = hooks("", textwrap.dedent("""
        pool = (0, 77)
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        torch._C._cuda_endAllocateToPool(0, pool)
        y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        x.copy_(torch.full((8 * MiB,), 3, dtype=torch.uint8))
        assert torch.equal(x.cpu(), torch.full((8 * MiB,), 3, dtype=torch.uint8))
        def pools():
            return sorted(tuple(s["segment_pool_id"]) for s in reservoir.snapshot(0)["segments"])
        print(pools() == [(0, 0), pool])
    """) + textwrap.dedent(RELEASE_THE_POOL))
    assert out == ["True", "True", "True"]


def test_pytorch_refuses_a_mempool_object_for_a_pluggable_allocator():
    # PyTorch 2.11 to 2.15 raise for torch.cuda.MemPool() when a pluggable
    # allocator is current (reservoir as PyTorch's own allocator, not a
    # pluggable one, is what lifts this). A release that lifts it fails here.
    out = hooks("", """
        try:
            torch.cuda.MemPool()
            print("created")
        except RuntimeError as e:
            print("createOrIncrefPool" in str(e))
    """)
    assert out == ["True"]


def test_an_allocation_reservoir_cannot_serve_raises_pytorchs_error():
    out = hooks("", """
        try:
            x = torch.empty(200 * 1024 * MiB, dtype=torch.uint8, device="cuda")
            print("allocated", x.data_ptr())
        except torch.cuda.OutOfMemoryError as e:
            print("OutOfMemoryError", "Tried to allocate 200.00 GiB" in str(e))
    """)
    assert out == ["OutOfMemoryError", "True"]


def test_without_a_hooks_library_install_says_what_does_not_reach_reservoir():
    # A package without the hooks (a release it was not built for) still
    # installs, and says which calls PyTorch will not pass on.
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent("""
        import logging, torch, reservoir
        logging.basicConfig()
        reservoir.torch_hooks_path = lambda version: None
        reservoir.install_torch("")
        x = torch.empty(1000, device="cuda")
        print(reservoir.stats(0)["allocation.all.current"])
    """)], env={**os.environ, "LD_PRELOAD": SIMCUDA}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["1"], r.stderr
    assert "no hooks library for PyTorch" in r.stderr
    assert "record_stream is not honoured" in r.stderr


def test_graph_pool_memory_made_in_a_region_pauses_with_its_tag():
    # A graph captured with a region of reservoir's open inside the capture
    # (torch_memory_saver.cuda_graph's order): the graph's private pool is
    # the tag's memory. pause gives it back to the device, resume maps it at
    # the same addresses with its bytes, and the replayed copy reads the new
    # input. Deleting the graph and emptying the cache hands the pool back.
    out = hooks("", """
        side = torch.cuda.Stream()
        inp = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            with reservoir.region("graph", cpu_backup=True):
                x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
                x.copy_(inp)
        def pools():
            return sorted(tuple(s["segment_pool_id"]) for s in reservoir.snapshot(0)["segments"])
        print(set(pools()) == {(0, 0), tuple(g.pool())}, [t["tag"] for t in reservoir.tags(0)])
        inp.copy_(torch.full((8 * MiB,), 5, dtype=torch.uint8))
        g.replay()
        torch.cuda.synchronize()
        where = x.data_ptr()
        free0 = torch.cuda.mem_get_info()[0]
        reservoir.pause("graph")
        print((torch.cuda.mem_get_info()[0] - free0) // MiB)
        reservoir.resume("graph")
        print(torch.equal(x.cpu(), torch.full((8 * MiB,), 5, dtype=torch.uint8)), x.data_ptr() == where)
        inp.copy_(torch.full((8 * MiB,), 6, dtype=torch.uint8))
        g.replay()
        print(torch.equal(x.cpu(), torch.full((8 * MiB,), 6, dtype=torch.uint8)))
        del g, x
        torch.cuda.empty_cache()
        print(set(pools()) == {(0, 0)})
    """, env={"RESERVOIR_SIMCUDA_KERNELS": "skip"})
    assert out == ["True", "['graph']", "20", "True", "True", "True", "True"]


def test_the_drop_ins_cuda_graph_takes_torch_memory_savers_arguments():
    # The same signature as torch_memory_saver 0.0.10's, and its argument
    # checks (the graph itself: test_torch_memory_saver.py's RL loop).
    out = hooks("", """
        import inspect
        from reservoir.memory_saver import torch_memory_saver as tms
        print(str(inspect.signature(tms.cuda_graph)).replace(" ", ""))
        try:
            with tms.cuda_graph(torch.cuda.CUDAGraph(), cpu_backup_backend="mmap"):
                pass
        except ValueError as e:
            print(str(e).replace(" ", "_"))
    """)
    assert out == ["(cuda_graph,pool=None,stream=None,capture_error_mode='global',tag:str='default',"
                   "enable_cpu_backup:bool=False,cpu_backup_backend:Optional[Literal['mmap','pinned']]=None)",
                   "cpu_backup_backend_requires_enable_cpu_backup=True"]
