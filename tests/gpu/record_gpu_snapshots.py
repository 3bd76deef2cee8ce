#!/usr/bin/env python3
"""Record real PyTorch memory snapshots on a GPU, one per allocator setting.

Each scenario runs in its own process (the allocator reads its settings once)
and trains a small transformer with PyTorch's native caching allocator and
memory history on, then writes torch.cuda.memory._dump_snapshot's pickle:

    default          a few steps of varying batch sizes with empty_cache() between some
    expandable       the same under expandable_segments:True
    split_roundup    the same under max_split_size_mb:64,roundup_power2_divisions:4
    two_streams      a side stream computes part of each step; tensors cross with
                     record_stream() and wait_stream()
    mempool_graph    a MemPool used for part of the work and a captured CUDA graph replayed
    oom              set_per_process_memory_fraction caps the device; the batch grows until
                     the allocator runs out, and the snapshot is dumped at the error by an
                     out-of-memory observer

Frames are deduplicated before the pickle is written again (the same frame
dict object is stored once), so the files stay small without losing any event.

    python3 tests/gpu/record_gpu_snapshots.py OUTDIR [--only NAME,...]
"""
import argparse
import os
import pickle
import subprocess
import sys
import time

SCENARIOS = {
    "default": "",
    "expandable": "expandable_segments:True",
    "split_roundup": "max_split_size_mb:64,roundup_power2_divisions:4",
    "two_streams": "",
    "mempool_graph": "",
    "oom": "",
}


def dedupe(path):
    """Rewrite the pickle with equal frames and strings shared (pickle memoizes by identity)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    frames, strings = {}, {}

    def frame(fr):
        key = tuple(sorted((k, v) for k, v in fr.items() if isinstance(v, (str, int, float))))
        got = frames.get(key)
        if got is None:
            got = frames[key] = {k: strings.setdefault(v, v) if isinstance(v, str) else v for k, v in fr.items()}
        return got

    def walk(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k == "frames" and isinstance(v, list):
                    obj[k] = [frame(fr) if isinstance(fr, dict) else fr for fr in v]
                else:
                    walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(snap)
    with open(path, "wb") as f:
        pickle.dump(snap, f, protocol=4)


def scenario(name, out):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    dev = torch.device("cuda")
    path = os.path.join(out, f"{name}.pickle")
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=200000)

    def model_and_opt(layers=3, d=256):
        if os.environ.get("RECORD_WITHOUT_BLAS"):  # the simulated device has no cuBLAS: a smoke test there
            class Scale(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.w = nn.Parameter(torch.ones(d))

                def forward(self, x):
                    return (x * self.w).relu()

            m = nn.Sequential(nn.Embedding(1000, d), nn.Sequential(*[Scale() for _ in range(layers)]),
                              nn.Embedding(d, 1000)).to(dev)
            m[2] = Scale().to(dev)
            return m, torch.optim.AdamW(m.parameters(), lr=1e-3)
        layer = nn.TransformerEncoderLayer(d_model=d, nhead=4, dim_feedforward=4 * d, batch_first=True)
        m = nn.Sequential(nn.Embedding(1000, d), nn.TransformerEncoder(layer, num_layers=layers),
                          nn.Linear(d, 1000)).to(dev)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step(m, opt, batch, seq=128):
        x = torch.randint(0, 1000, (batch, seq), device=dev)
        loss = nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
        if os.environ.get("RECORD_WITHOUT_BLAS"):
            return 0.0
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    if name in ("default", "expandable", "split_roundup"):
        m, opt = model_and_opt()
        for i, batch in enumerate((16, 24, 8, 32, 12, 20)):
            step(m, opt, batch)
            if i in (1, 3):
                torch.cuda.empty_cache()
        del m, opt
        torch.cuda.empty_cache()
        big = [torch.empty(n * (1 << 20) + 4096 * n, dtype=torch.uint8, device=dev) for n in (3, 70, 130, 9)]
        del big[1]
        torch.cuda.synchronize()
    elif name == "two_streams":
        m, opt = model_and_opt()
        side = torch.cuda.Stream()
        for batch in (16, 24, 8, 20):
            main = torch.cuda.current_stream()
            x = torch.randint(0, 1000, (batch, 128), device=dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                emb = m[0](x) * 1.0  # allocated on the side stream
                extra = torch.empty(batch * 1024 * 1024, device=dev)
            main.wait_stream(side)
            emb.record_stream(main)
            h = m[2](m[1](emb))
            loss = nn.functional.cross_entropy(h.flatten(0, 1), x.flatten())
            if not os.environ.get("RECORD_WITHOUT_BLAS"):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del emb, extra, h, loss
        torch.cuda.synchronize()
    elif name == "mempool_graph":
        m, opt = model_and_opt(layers=2)
        step(m, opt, 16)
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            kept = [torch.empty(n << 20, dtype=torch.uint8, device=dev) for n in (1, 5, 33)]
        del kept[0]
        m.eval()
        static_x = torch.randint(0, 1000, (8, 128), device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):  # warm-up on a side stream, as CUDA graph capture wants
                m(static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            static_y = m(static_x)
        for _ in range(3):
            static_x.copy_(torch.randint(0, 1000, (8, 128), device=dev))
            g.replay()
        torch.cuda.synchronize()
        m.train()
        step(m, opt, 12)
        torch.cuda.synchronize()  # the snapshot is taken with the pool and the graph alive
    elif name == "oom":
        cap = 1536 << 20
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
        dumped = []

        def observer(device, alloc, device_alloc, device_free):
            torch.cuda.memory._dump_snapshot(path)
            dumped.append((device, alloc, device_alloc, device_free))

        torch._C._cuda_attach_out_of_memory_observer(observer)
        m, opt = model_and_opt(layers=4, d=512)
        batch = 8
        try:
            while True:
                step(m, opt, batch, seq=256)
                batch *= 2
        except torch.OutOfMemoryError as e:
            print(f"oom at batch {batch}: {str(e).splitlines()[0]}")
        if not dumped:
            raise SystemExit("the out-of-memory observer never ran")
        print(f"observer: {dumped[0]}")
        dedupe(path)
        os._exit(0)
    torch.cuda.memory._dump_snapshot(path)
    dedupe(path)
    sys.stdout.flush()
    os._exit(0)  # no teardown: the snapshot is what this process was for


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", default="")
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.scenario:
        scenario(args.scenario, args.out)
        return 0
    failed = 0
    for name in (args.only.split(",") if args.only else SCENARIOS):
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        if SCENARIOS[name]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = SCENARIOS[name]
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        t = time.monotonic()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), args.out, "--scenario", name],
                               env=env, timeout=150, capture_output=True, text=True)
            code, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            code, text = "timeout", str(e)
        path = os.path.join(args.out, f"{name}.pickle")
        size = os.path.getsize(path) if os.path.exists(path) else 0
        print(f"{name}: exit {code}, {time.monotonic() - t:.1f} s, {size} bytes")
        if text.strip():
            print("  " + "\n  ".join(text.strip().splitlines()[-15:]))
        failed += code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
