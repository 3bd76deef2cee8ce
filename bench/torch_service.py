"""An inference service under the real PyTorch that meets out-of-memory
errors for hours: bench/service_bench.cpp's model and request mix (a
diffusion-like model, 4 GiB of weights on a 12 GiB device; activations grow
with batch x resolution^2, attention with its square; the largest requests
never fit), each failed request caught and the next one served, as a web
service does. Each setting runs in a process of its own:

  default        PyTorch's allocator, its default settings
  expandable     PyTorch's allocator, expandable_segments:True
  native         reservoir as PyTorch's own allocator, its native policy
  native_paged   reservoir as PyTorch's own allocator, policy:native_paged

and reports requests served and failed, "fragmentation" (failures of
requests the device serves alone: the weights and the request's own
activations, as in a fresh process, measured in the same process before the
service starts, with the cache released after each), peak reserved memory
and time per request.

--explained N: the first N requests again under each allocator with the live
answer on (reservoir.explain_oom(), the latest 20 answers kept on disk): its
cost per error (the failed request's time beyond the same request's without
the answer) and its verdict, the first line's class against the ground truth.

--errors N: one process, PyTorch's allocator or reservoir's (--errors-allocator),
the live answer on, serving until N requests have failed: the time of each
error's answer over the first and the last hundred errors, the served
requests' time at the start and the end, the answer folder's files and bytes
at the end, and the process's resident memory before and after.

On the simulated device (nothing computed: the tensors are allocated, not
written; the device's pages are not touched):
  PYTHONPATH=$HOME/.cache/reservoir/pypi/torch-2.15.0:build/python \\
  LD_PRELOAD=build/simcuda/libcudart.so.13 RESERVOIR_SIMCUDA_KERNELS=skip \\
  RESERVOIR_SIMCUDA_MEMORY=12GiB python3 bench/torch_service.py
On a GPU the same without the three variables: a memory fraction makes the
device 12 GiB (the GPU bundle's `service` step runs it).
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
DEVICE = 12 * GiB
WEIGHTS = 4 * GiB
RESOLUTIONS = [(512, 40), (640, 15), (768, 20), (1024, 17), (1536, 6), (2048, 2)]
BATCHES = [(1, 50), (2, 25), (4, 20), (8, 5)]
MODES = {"default": ("pytorch", ""), "expandable": ("pytorch", "expandable_segments:True"),
         "native": ("reservoir", ""), "native_paged": ("reservoir", "policy:native_paged")}


def requests(n, seed=2026):
    rng = random.Random(seed)

    def draw(table):
        return rng.choices([v for v, _ in table], weights=[w for _, w in table])[0]

    return [(draw(BATCHES), draw(RESOLUTIONS)) for _ in range(n)]


def serve(torch, batch, resolution):
    """One request's forward pass (fp16 tensors): a down path whose stages keep
    a skip connection, attention at the three highest resolutions, an up path
    that consumes the skips, the decoded image. Frees what it holds, also when
    an allocation fails (the exception's traceback must not keep tensors)."""
    skips, held = [], []

    def take(nbytes):
        held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))

    def release(v):
        while v:
            v.pop()

    try:
        channels = (320, 640, 1280, 1280)
        side = resolution // 8
        for stage in range(4):
            act = batch * channels[stage] * side * side * 2
            take(act)
            take(act)
            if stage <= 2:
                take(batch * 8 * side ** 4 * 2)  # self-attention's scores, 8 heads
            skips.append(torch.empty(act, dtype=torch.uint8, device="cuda"))
            release(held)
            side //= 2
        for stage in reversed(range(4)):
            side *= 2
            act = batch * channels[stage] * side * side * 2
            take(2 * act)  # the skip concatenated
            take(act)
            skips.pop()
            release(held)
        take(batch * 3 * resolution * resolution * 2)
        release(held)
    except BaseException:
        release(held)
        release(skips)
        raise


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def folder_usage(path):
    files, size = 0, 0
    for root, _, names in os.walk(path):
        for name in names:
            files += 1
            size += os.path.getsize(os.path.join(root, name))
    return files, size


def verdict_of(message):
    """The class the answer's first line names, or None. Its causes are
    joined by "; and ", each headed by its class ("fragmentation: ...",
    "too little memory: ..."), after what refused the request where that
    was the process's memory fraction; a line naming both classes names
    neither (the whole line is returned)."""
    at = message.find("\nreservoir: out of memory on a ")
    if at < 0:
        return None
    first = message[at + 1:].split("\n", 1)[0]
    named = [c for c in ("fragmentation", "too little memory")
             if f": {c}: " in first or f"; and {c}: " in first]
    return named[0] if len(named) == 1 else first


def history_events(torch):
    """Events in the allocator's history now (the live answer keeps the
    latest 100,000)."""
    return len(torch.cuda.memory._snapshot()["device_traces"][0])


def child(args):
    allocator, settings = MODES[args.child]
    if allocator == "pytorch":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
    import torch

    if allocator == "reservoir":
        import reservoir

        reservoir.use_as_allocator(settings)
    total = torch.cuda.mem_get_info()[1]
    if total > DEVICE * 1.01:  # a GPU: a 12 GiB process
        torch.cuda.set_per_process_memory_fraction(DEVICE / total)
    weights = torch.empty(WEIGHTS, dtype=torch.uint8, device="cuda")  # noqa: F841 - held throughout

    # Ground truth: which request classes the device serves alone.
    alone = {}
    for b, _ in BATCHES:
        for r, _ in RESOLUTIONS:
            try:
                serve(torch, b, r)
                alone[(b, r)] = True
            except torch.OutOfMemoryError:
                alone[(b, r)] = False
            torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    folder = None
    if args.explain:
        import reservoir

        folder = tempfile.mkdtemp(prefix="reservoir-service-oom-")
        reservoir.explain_oom(folder, keep=args.keep)
    out = {"mode": args.child, "torch": torch.__version__, "served": 0, "failed": 0, "fragmentation": 0}
    verdicts = {"agree": 0, "disagree": 0, "none": 0}
    error_s, served_s = [], []
    rss0 = rss_mib()
    n_requests = args.requests if args.errors == 0 else 10 ** 9
    mix = requests(min(n_requests, 100_000))
    started = time.perf_counter()
    i = 0
    while i < n_requests and (args.errors == 0 or out["failed"] < args.errors):
        b, r = mix[i % len(mix)]
        i += 1
        t0 = time.perf_counter()
        message = None
        try:
            serve(torch, b, r)
        except torch.OutOfMemoryError as e:
            message = str(e)
        t = time.perf_counter() - t0
        if message is None:
            out["served"] += 1
            served_s.append(t)
            continue
        out["failed"] += 1
        out["fragmentation"] += alone[(b, r)]
        error_s.append(t)
        if args.explain:
            v = verdict_of(message)
            truth = "fragmentation" if alone[(b, r)] else "too little memory"
            verdicts["none" if v is None else "agree" if v == truth else "disagree"] += 1
    seconds = time.perf_counter() - started
    out["requests"] = i
    out["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / GiB, 3)
    out["ms_per_request"] = round(seconds * 1e3 / max(i, 1), 4)
    out["ms_per_served"] = round(sum(served_s) * 1e3 / max(len(served_s), 1), 4)
    out["ms_per_failed"] = round(sum(error_s) * 1e3 / max(len(error_s), 1), 4)
    if args.explain:
        out["verdicts"] = verdicts
        files, size = folder_usage(folder)
        out["answer_folder"] = {"files": files, "bytes": size}
        if args.errors:
            def mean_ms(v):
                return round(sum(v) * 1e3 / max(len(v), 1), 3)

            out["error_ms_first_100"] = mean_ms(error_s[:100])
            out["error_ms_last_100"] = mean_ms(error_s[-100:])
            out["served_ms_first_500"] = mean_ms(served_s[:500])
            out["served_ms_last_500"] = mean_ms(served_s[-500:])
            # Each tenth of the run: the answer's mean time over its errors,
            # a served request's over its served requests.
            out["error_ms_by_tenth"] = [mean_ms(error_s[k * len(error_s) // 10:(k + 1) * len(error_s) // 10])
                                        for k in range(10)]
            out["served_ms_by_tenth"] = [mean_ms(served_s[k * len(served_s) // 10:(k + 1) * len(served_s) // 10])
                                         for k in range(10)]
            out["history_events"] = history_events(torch)
            out["rss_MiB"] = {"start": round(rss0, 1), "end": round(rss_mib(), 1)}
            out["maxrss_MiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


def run_child(mode, extra, timeout):
    argv = [sys.executable, os.path.abspath(__file__), "--child", mode] + extra
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{mode}: exit {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--explained", type=int, default=1_000,
                    help="requests served again with the live answer on (0: none)")
    ap.add_argument("--errors", type=int, default=0, help="serve until this many requests failed")
    ap.add_argument("--errors-allocator", default="default", choices=list(MODES))
    ap.add_argument("--keep", type=int, default=20, help="answers kept on disk (explain_oom(keep=))")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for each process")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--explain", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    figures = {"service": {}, "explained": {}, "errors": None}
    modes = [m for m in args.modes.split(",") if m]
    print(f"{'setting':14} {'served':>7} {'failed':>7} {'fragm.':>7} {'peak GiB':>9} {'ms/request':>11}")
    for mode in modes:
        r = run_child(mode, ["--requests", str(args.requests)], args.timeout)
        figures["service"][mode] = r
        print(f"{mode:14} {r['served']:7} {r['failed']:7} {r['fragmentation']:7} "
              f"{r['peak_reserved_GiB']:9.2f} {r['ms_per_request']:11.3f}", flush=True)
    if args.explained:
        print(f"\nthe first {args.explained} requests with the live answer on (verdict: the first line's class)")
        print(f"{'setting':14} {'failed':>7} {'ms/error':>9} {'without':>9} {'agree':>6} {'disagree':>9} "
              f"{'none':>5}")
        for mode in modes:
            plain = run_child(mode, ["--requests", str(args.explained)], args.timeout)
            r = run_child(mode, ["--requests", str(args.explained), "--explain", "--keep", str(args.keep)],
                          args.timeout)
            r["ms_per_failed_without"] = plain["ms_per_failed"]
            figures["explained"][mode] = r
            v = r["verdicts"]
            print(f"{mode:14} {r['failed']:7} {r['ms_per_failed']:9.1f} {plain['ms_per_failed']:9.2f} "
                  f"{v['agree']:6} {v['disagree']:9} {v['none']:5}", flush=True)
    if args.errors:
        r = run_child(args.errors_allocator, ["--errors", str(args.errors), "--explain", "--keep",
                                              str(args.keep)], args.timeout)
        figures["errors"] = r
        print(f"\n{args.errors_allocator}: {r['failed']} errors in {r['requests']} requests, the live answer "
              f"on (keep {args.keep}): answer {r['error_ms_first_100']:.1f} ms over the first 100 errors, "
              f"{r['error_ms_last_100']:.1f} ms over the last 100; a served request {r['served_ms_first_500']:.3f} "
              f"/ {r['served_ms_last_500']:.3f} ms (first / last 500); answer folder {r['answer_folder']['files']} "
              f"files, {r['answer_folder']['bytes'] / (1 << 20):.1f} MiB; resident {r['rss_MiB']['start']:.0f} -> "
              f"{r['rss_MiB']['end']:.0f} MiB; verdicts {r['verdicts']}; history {r['history_events']} events")
        print("  the answer's ms by tenth of the errors:", " ".join(f"{x:.0f}" for x in r["error_ms_by_tenth"]))
        print("  a served request's ms by tenth:", " ".join(f"{x:.3f}" for x in r["served_ms_by_tenth"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
