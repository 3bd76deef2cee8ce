"""Scripts run by more than one test, under reservoir's torch_memory_saver
drop-in and the real torch_memory_saver alike (`tms`, `torch` and `MiB` are
set before them)."""

# Two tags, one backed up: each pause frees exactly its tag's memory, the
# device's free memory rises by it, resume keeps addresses and bytes; a tag
# with no memory pauses as a no-op; pause()/resume() take every tag.
PAUSE_RESUME = """
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with tms.region(tag="kv"):
        kv = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    cpu = torch.arange(64 * MiB, dtype=torch.int64).to(torch.uint8)
    w.copy_(cpu)
    pw, pk = w.data_ptr(), kv.data_ptr()
    free0 = torch.cuda.mem_get_info()[0]
    tms.pause("kv")
    free1 = torch.cuda.mem_get_info()[0]
    tms.pause("weights")
    free2 = torch.cuda.mem_get_info()[0]
    tms.resume("weights")
    tms.resume("kv")
    print((free1 - free0) // MiB, (free2 - free1) // MiB, w.data_ptr() == pw, kv.data_ptr() == pk,
          torch.equal(w.cpu(), cpu), torch.cuda.mem_get_info()[0] == free0)
    tms.pause("nosuch")  # a tag with no memory: nothing to do, both ways
    tms.pause()
    tms.resume()
    print(torch.equal(w.cpu(), cpu), w.data_ptr() == pw, flush=True)
    import os
    os._exit(0)  # torch_memory_saver's torch mode fails at interpreter exit (frees outside a region)
"""
