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

# An RL loop's memory around a captured graph: tags for the weights (backed
# up), the KV cache and the graph's private pool (backed up); each of 100
# rounds releases all three for training (which allocates untagged memory),
# resumes the weights, then the KV cache and the graph, and replays the
# graph, whose captured copies read the input and write into the graph's
# pool and the KV cache. Printed: the device memory each pause gives back
# (MiB), the replayed values, whether addresses and bytes held, and the
# growth of device and host memory over the rounds.
GRAPH_RL_LOOP = """
    import resource
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    wbytes = torch.arange(32 * MiB, dtype=torch.int64).to(torch.uint8)
    w.copy_(wbytes)
    with tms.region(tag="kv_cache"):
        kv = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
    static_in = torch.zeros(4 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, stream=side, tag="graph", enable_cpu_backup=True):
        out = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        out.copy_(static_in)
        kv[:4 * MiB].copy_(out)
        last = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        last.copy_(w[:4 * MiB])
    static_in.fill_(0) if False else static_in.copy_(torch.full((4 * MiB,), 5, dtype=torch.uint8))
    g.replay()
    torch.cuda.synchronize()
    first = [int(out[0]), int(kv[4 * MiB - 1]), torch.equal(last.cpu(), wbytes[:4 * MiB])]
    addresses = (w.data_ptr(), kv.data_ptr(), out.data_ptr(), last.data_ptr())
    freed, ok = [], True
    free_start = torch.cuda.mem_get_info()[0]
    rss = []
    for i in range(100):
        before = torch.cuda.mem_get_info()[0]
        tms.pause("kv_cache")
        tms.pause("graph")
        tms.pause("weights")
        paused = torch.cuda.mem_get_info()[0]
        if i == 0:
            freed.append((paused - before) // MiB)
        grad = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")  # training's memory
        del grad
        tms.resume("weights")
        tms.resume("kv_cache")
        tms.resume("graph")
        value = i % 250 + 1
        static_in.copy_(torch.full((4 * MiB,), value, dtype=torch.uint8))
        g.replay()
        torch.cuda.synchronize()
        ok = ok and int(out[123]) == value and int(kv[4 * MiB - 7]) == value
        ok = ok and (w.data_ptr(), kv.data_ptr(), out.data_ptr(), last.data_ptr()) == addresses
        if i in (9, 99):
            ok = ok and torch.equal(w.cpu(), wbytes) and torch.equal(last.cpu(), wbytes[:4 * MiB])
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    torch.cuda.empty_cache()
    print(first[0], first[1], first[2], freed[0], ok, (free_start - torch.cuda.mem_get_info()[0]) // MiB,
          (rss[1] - rss[0]) // 1024 < 64, flush=True)
    import os
    os._exit(0)
"""
