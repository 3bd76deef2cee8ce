"""The extension module on host memory, for a Python without pytest: a tag
with backup is paused and resumed under every policy; its bytes come back at
the same addresses, and the host memory it held is given back while paused."""
import ctypes
import os

import reservoir
from reservoir.memory_saver import torch_memory_saver  # noqa: F401 (the drop-in imports)

MiB = 1 << 20
for config in ("", "expandable_segments:True", "policy:paging", "policy:native_paged"):
    dev = reservoir.HostDevice()
    saver = reservoir.Saver(dev, config=config, chunk_bytes=MiB, copy_streams=2)
    blocks = []
    with saver.region("weights", cpu_backup=True):
        for n in (4096, 3 * MiB + 512, 24 * MiB):
            ptr = saver.allocate(n)
            data = os.urandom(n)
            ctypes.memmove(ptr, data, n)
            blocks.append((ptr, data))
    used = dev.used_bytes
    physical = saver.tag_info("weights")["physical_bytes"]
    saver.pause("weights")
    assert dev.used_bytes == used - physical, (config, dev.used_bytes, used, physical)
    saver.resume("weights")
    for ptr, data in blocks:
        assert ctypes.string_at(ptr, len(data)) == data, config
        saver.free(ptr)
    saver.validate()
    print(f"policy '{config}': {len(blocks)} blocks paused and resumed, every byte back")
print("module ok:", reservoir.__file__)
