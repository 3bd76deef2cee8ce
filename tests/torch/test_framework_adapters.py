"""The calling patterns of the frameworks that use torch_memory_saver, as
their adapters use it (written here from their documented use), against
reservoir's drop-in on the simulated CUDA device under the real PyTorch,
both as PyTorch's allocator and under reservoir's interposer. Each imports
`torch_memory_saver` by name, after reservoir.memory_saver.install_as_torch_memory_saver().

Environment (ctest): PyTorch and the reservoir package on PYTHONPATH;
LD_PRELOAD the simulated runtime; RESERVOIR_PRELOAD the interposer.
(Contents move by copies only: the simulated device runs no kernels.)
"""
import os
import subprocess
import sys
import textwrap

import pytest

SIMCUDA = os.environ["LD_PRELOAD"]

PRELUDE = """
import os, torch
from reservoir.memory_saver import install_as_torch_memory_saver
install_as_torch_memory_saver()
import torch_memory_saver
MiB = 1 << 20
def free():
    return torch.cuda.mem_get_info()[0] // MiB
"""

# sglang: an adapter over the module's singleton; the model runner loads
# weights (backed up) and the KV cache (not) in their regions and captures
# graphs in a third; release_memory_occupation pauses tags one by one for
# the trainer, resume_memory_occupation brings them back and the trainer's
# new weights are copied into the same tensors.
SGLANG = """
_memory_saver = torch_memory_saver.torch_memory_saver

class Adapter:
    def region(self, tag, enable_cpu_backup=False):
        return _memory_saver.region(tag=tag, enable_cpu_backup=enable_cpu_backup)
    def disable(self):
        return _memory_saver.disable()
    def pause(self, tag):
        return _memory_saver.pause(tag=tag)
    def resume(self, tag):
        return _memory_saver.resume(tag=tag)

adapter = Adapter()
with adapter.region("weights", enable_cpu_backup=True):
    weights = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
with adapter.region("kv_cache"):
    kv = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
with adapter.disable():
    pinned_forever = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
original = (torch.arange(16 * MiB) % 199).to(torch.uint8)
for w in weights:
    w.copy_(original)
addresses = [w.data_ptr() for w in weights] + [kv.data_ptr()]
start = free()
for tag in ["kv_cache", "weights"]:          # release_memory_occupation
    adapter.pause(tag)
print("released", free() - start)
trainer = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")   # the trainer runs here
del trainer
torch.cuda.empty_cache()
for tag in ["weights", "kv_cache"]:          # resume_memory_occupation
    adapter.resume(tag)
print("addresses kept", [w.data_ptr() for w in weights] + [kv.data_ptr()] == addresses)
print("weights kept", all(torch.equal(w.cpu(), original) for w in weights))
updated = (torch.arange(16 * MiB) % 97).to(torch.uint8)
for w in weights:                            # update_weights_from_tensor
    w.copy_(updated)
print("updated", all(torch.equal(w.cpu(), updated) for w in weights))
os._exit(0)
"""

# verl: the rollout engine's memory in the default tag; the sharding
# manager pauses everything after generation and resumes before the next
# weight sync, emptying PyTorch's cache in between.
VERL = """
tms = torch_memory_saver.torch_memory_saver
with tms.region():
    engine_weights = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    kv = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
start = free()
for step in range(3):
    tms.pause()
    torch.cuda.empty_cache()
    paused = free() - start
    actor = torch.empty(150 * MiB, dtype=torch.uint8, device="cuda")   # FSDP actor update
    del actor
    torch.cuda.empty_cache()
    tms.resume()
    engine_weights.copy_(torch.full((64 * MiB,), step, dtype=torch.uint8))  # weight sync
    print("step", step, paused >= 192, int(engine_weights.cpu()[-1]) == step)
os._exit(0)
"""

# slime: the Megatron actor's model and optimizer in a backed-up region,
# buffers that must live through offload made with disable(), offload and
# onload of everything, and a margin kept for the co-located rollout.
SLIME = """
tms = torch_memory_saver.torch_memory_saver
with tms.region(tag="default", enable_cpu_backup=True):
    params = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    with tms.disable():
        comm_buffer = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    optimizer_state = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
params.copy_(torch.full((32 * MiB,), 11, dtype=torch.uint8))
comm_buffer.copy_(torch.full((8 * MiB,), 3, dtype=torch.uint8))
start = free()
tms.pause()                                  # offload the actor
print("offloaded", free() - start >= 96)
print("comm buffer usable", int(comm_buffer.cpu()[0]) == 3)
backup = tms.get_cpu_backup(params)
print("backup readable", backup is not None and int(backup[0]) == 11)
tms.resume()                                 # onload
print("params kept", int(params.cpu()[-1]) == 11)
tms.memory_margin_bytes = torch.cuda.mem_get_info()[0] - 64 * MiB
try:
    with tms.region(tag="default", enable_cpu_backup=True):
        grow = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    print("margin ignored")
except torch.OutOfMemoryError:
    print("margin kept")
os._exit(0)
"""

EXPECTED = {
    "sglang": ["released", "320", "addresses", "kept", "True", "weights", "kept", "True",
               "updated", "True"],
    "verl": ["step", "0", "True", "True", "step", "1", "True", "True", "step", "2", "True", "True"],
    "slime": ["offloaded", "True", "comm", "buffer", "usable", "True", "backup", "readable", "True",
              "params", "kept", "True", "margin", "kept"],
}
SCRIPTS = {"sglang": SGLANG, "verl": VERL, "slime": SLIME}


@pytest.mark.parametrize("interposer", [False, True], ids=["allocator", "interposer"])
@pytest.mark.parametrize("framework", sorted(SCRIPTS))
def test_framework_calling_pattern(framework, interposer):
    env = dict(os.environ)
    if interposer:
        env["LD_PRELOAD"] = os.environ["RESERVOIR_PRELOAD"] + ":" + SIMCUDA
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(SCRIPTS[framework])
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == EXPECTED[framework], r.stdout
