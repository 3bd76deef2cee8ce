"""Careless and hostile use of the PyTorch integration, on the simulated
device: a refused call changes nothing, bad settings fail at install, a NaN
fraction is refused on every path with PyTorch's words, a loop of failed
allocations into a paused tag does not flood stderr, and a paused tensor
touched is CUDA's illegal address, as on a GPU, not a crash. Each program
runs in its own process under native, reservoir's own allocator ("own")
and the pluggable one ("plug")."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

PRELUDE = """
import json, os, sys
import torch
mode = sys.argv[1]
import reservoir
def install(**kw):
    if mode == "own":
        return reservoir.use_as_allocator(**kw)
    if mode == "plug":
        return reservoir.install_torch(**kw)
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run(mode, body, env=None):
    code = PRELUDE + textwrap.dedent(body)
    # Kernels (torch.ones' fill) run nothing on the simulated device.
    env = {**os.environ, "RESERVOIR_SIMCUDA_KERNELS": "skip", **(env or {})}
    env.pop("RESERVOIR_TORCH_ALLOCATOR", None)
    r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                       timeout=300, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):]), r.stderr


@pytest.mark.parametrize("mode", ["own", "plug"])
def test_bad_settings_fail_at_install_and_leave_the_environment_as_it_was(mode):
    out, _ = run(mode, """
        errors = []
        for kw in ({"config": "bogus_key:1"}, {"config": "max_split_size_mb:-3"},
                   {"device_kind": "gpu9"}):
            try:
                install(**kw)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        env = [os.environ.get("RESERVOIR_ALLOC_CONF"), os.environ.get("RESERVOIR_TORCH_DEVICE")]
        install()
        x = torch.ones(1000, device="cuda")
        emit(errors=errors, env=env, allocated=torch.cuda.memory_allocated() if mode == "own" else -1)
    """)
    caller = "use_as_allocator" if mode == "own" else "install_torch"
    bogus, negative, kind = out["errors"]
    assert bogus.startswith(f"reservoir.{caller}: allocator config \"bogus_key:1\": unknown key 'bogus_key'")
    assert negative is not None and negative.startswith(f"reservoir.{caller}: ") and "max_split_size_mb" in negative
    assert kind == (f"reservoir.{caller}: RESERVOIR_TORCH_DEVICE: unknown device kind 'gpu9' "
                    "(sim, host, cuda-runtime, cuda-vmm)")
    assert out["env"] == [None, None]
    if mode == "own":
        assert out["allocated"] == 4096


def test_a_refused_second_install_changes_nothing():
    # After a tensor exists PyTorch refuses to swap allocators: reservoir's
    # state stays, so frees and new allocations go on.
    out, _ = run("own", """
        install()
        x = torch.ones(1 << 20, device="cuda")
        try:
            install(config="max_split_size_mb:64")
            refused = None
        except RuntimeError as e:
            refused = str(e)
        del x
        y = torch.empty(3 << 20, device="cuda")
        del y
        torch.cuda.empty_cache()
        emit(refused=refused, env=os.environ.get("RESERVOIR_ALLOC_CONF"),
             allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
             backend=torch.cuda.get_allocator_backend())
    """)
    assert out["refused"] == "reservoir.use_as_allocator: Can't swap an already initialized allocator"
    assert out["env"] is None
    assert out["allocated"] == 0 and out["reserved"] == 0
    assert out["backend"] == "reservoir"


@pytest.mark.parametrize("mode", ["native", "own", "plug"])
def test_a_nan_memory_fraction_is_refused_with_pytorchs_words(mode):
    out, _ = run(mode, """
        install()
        x = torch.ones(1000, device="cuda")
        said = []
        for f in (float("nan"), 0.25):
            try:
                torch.cuda.set_per_process_memory_fraction(f)
                said.append("ok")
            except RuntimeError as e:
                said.append(str(e).splitlines()[0])
        emit(said=said)
    """)
    assert out["said"] == ["invalid fraction:nan. Please set within [0, 1].", "ok"]


@pytest.mark.parametrize("mode", ["own", "plug"])
def test_failed_allocations_into_a_paused_tag_raise_without_a_line_each(mode):
    out, stderr = run(mode, """
        install()
        with reservoir.region("kv"):
            k = torch.ones(1 << 20, device="cuda")
        reservoir.pause("kv")
        messages = set()
        for _ in range(200):
            try:
                with reservoir.region("kv"):
                    torch.empty(1 << 20, device="cuda")
            except RuntimeError as e:
                messages.add(str(e).splitlines()[0])
        reservoir.resume("kv")
        emit(messages=sorted(messages))
    """)
    assert len(out["messages"]) == 1
    assert "into tag 'kv', which is paused (resume it first, or allocate outside it)" in out["messages"][0]
    assert "paused" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("mode", ["own", "plug"])
def test_a_paused_tensor_touched_is_cudas_illegal_address(mode):
    # As on a GPU: the copy faults with cudaErrorIllegalAddress, which PyTorch
    # raises, and CUDA's context is lost for the rest of the process.
    out, _ = run(mode, """
        install()
        x = torch.ones(1 << 20, device="cuda")
        with reservoir.region("kv"):
            k = torch.ones(1 << 20, device="cuda")
        reservoir.pause("kv")
        said = []
        for t in (k, x):
            try:
                t.cpu()
                said.append("read")
            except Exception as e:
                said.append(str(e).splitlines()[0])
        emit(said=said)
    """)
    assert out["said"] == ["CUDA error: an illegal memory access was encountered"] * 2
