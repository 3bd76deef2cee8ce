#!/usr/bin/env python3
"""CUDA graphs on a real GPU, with real kernels: what tests/torch/test_graphs.py
and test_torch_memory_saver.py check on the simulated device.

1. stream capture: tests/gpu/cuda_behaviour.py's stream_capture probe on
   this GPU's runtime, beside the simulated device's answers
   (stream_capture_sim.json): every answer that differs is listed.
2. pools: scenarios.GRAPHS under PyTorch's allocator, reservoir as
   PyTorch's own allocator and reservoir's pluggable allocator: the same
   pools, blocks and statistics after every step.
3. eager vs graph: a captured MLP forward in a tag of the
   torch_memory_saver drop-in (torch mode), under every policy: the
   replay equals eager before and after the tag is paused and resumed,
   at the same addresses, and the pause gives the graph's memory back.
4. the RL loop (scenarios.GRAPH_RL_LOOP) under the drop-in, and under the
   real torch_memory_saver's preload mode when --tms names its unpacked
   wheel: the figures side by side.

Prints one JSON line per check and a last JSON summary; exits 1 when a
check fails.

    python3 tests/gpu/graphs_check.py [--tms SITE]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the bundle keeps scenarios.py beside this file
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "torch"))  # a checkout keeps it there
from scenarios import GRAPH_RL_LOOP, GRAPHS, GRAPHS_PRELUDE  # noqa: E402

EAGER_VS_GRAPH = """
import json, torch
from reservoir.memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
x = torch.randn(256, 1024, device="cuda")
with torch.no_grad():
    eager = model(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x)  # warm-up on the capture stream, as PyTorch advises
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, tag="graph"):
        out = model(x)
g.replay()
torch.cuda.synchronize()
before = torch.allclose(out, eager, rtol=1e-4, atol=1e-5)
where = out.data_ptr()
free0 = torch.cuda.mem_get_info()[0]
tms.pause("graph")
freed = torch.cuda.mem_get_info()[0] - free0
tms.resume("graph")
out.zero_()
g.replay()
torch.cuda.synchronize()
after = torch.allclose(out, eager, rtol=1e-4, atol=1e-5)
print("RESULT " + json.dumps({"replay_equals_eager": before, "after_pause_and_resume": after,
                              "same_address": out.data_ptr() == where, "freed_bytes": freed}), flush=True)
import os
os._exit(0)
"""

RL_RESULT = ["5", "5", "True", "True", "0", "True"]  # all but the MiB given back (the policy's)


def python(code, argv=(), env=None, timeout=240):
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code, *argv], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    return r.returncode, r.stdout, r.stderr


def result_of(stdout):
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def stream_capture():
    r = subprocess.run([sys.executable, os.path.join(HERE, "cuda_behaviour.py"), "--only", "init,stream_capture"],
                       capture_output=True, text=True, timeout=120)
    try:
        gpu = json.loads(r.stdout)["probes"]["stream_capture"]
    except (ValueError, KeyError):
        return {"check": "stream_capture", "ok": False, "error": r.stderr[-800:]}
    with open(os.path.join(HERE, "stream_capture_sim.json")) as f:
        sim = json.load(f)
    differ = {k: {"gpu": gpu.get(k), "simulated": sim.get(k)} for k in sorted(set(gpu) | set(sim))
              if gpu.get(k) != sim.get(k)}
    # Recorded, not judged here: a difference is fixed in the simulated device
    # or listed in compare_behaviour.py's KNOWN once the record is kept.
    return {"check": "stream_capture", "ok": True, "answers": len(gpu), "differ": differ, "gpu": gpu}


def pools():
    code = textwrap.dedent(GRAPHS_PRELUDE) + textwrap.dedent(GRAPHS)
    results, errors = {}, {}
    for mode in ("native", "own", "pluggable"):
        rc, out, err = python(code, [mode])
        results[mode] = result_of(out)
        if rc != 0 or results[mode] is None:
            errors[mode] = err[-800:]
    differ = []
    if not errors:
        for mode in ("own", "pluggable"):
            differ += [f"{mode}: {step}" for step in results["native"]
                       if results[mode].get(step) != results["native"][step]]
    return {"check": "pools", "ok": not errors and not differ, "differ": differ, "errors": errors,
            "steps": list((results.get("native") or {}).keys())}


def eager_vs_graph():
    rows = {}
    for config in ("", "expandable_segments:True", "policy:paging", "policy:native_paged"):
        rc, out, err = python(EAGER_VS_GRAPH, env={"RESERVOIR_ALLOC_CONF": config})
        rows[config or "native"] = result_of(out) or {"error": err[-800:]}
    ok = all(r.get("replay_equals_eager") and r.get("after_pause_and_resume") and r.get("same_address")
             and r.get("freed_bytes", 0) > 0 for r in rows.values())
    return {"check": "eager_vs_graph", "ok": ok, "policies": rows}


def rl_loop(tms_site):
    runs = {}
    prelude = "import importlib, torch\ntms = importlib.import_module({impl!r}).torch_memory_saver\n" \
              "tms.hook_mode = {mode!r}\nMiB = 1 << 20\n"
    plans = [("reservoir.memory_saver", "torch", {})]
    if tms_site:
        libs = glob.glob(os.path.join(tms_site, "torch_memory_saver_hook_mode_preload_cu*.abi3.so"))
        if libs:
            env = {"PYTHONPATH": tms_site + ":" + os.environ.get("PYTHONPATH", ""),
                   "LD_PRELOAD": ":".join([libs[0]] + [x for x in [os.environ.get("LD_PRELOAD")] if x])}
            plans.append(("torch_memory_saver", "preload", env))
    for impl, mode, env in plans:
        t = time.monotonic()
        rc, out, err = python(prelude.format(impl=impl, mode=mode) + textwrap.dedent(GRAPH_RL_LOOP), env=env,
                              timeout=400)
        words = out.split()
        runs[f"{impl} ({mode})"] = {"output": words, "seconds": round(time.monotonic() - t, 1),
                                   "ok": rc == 0 and len(words) == 7 and words[:3] + words[4:] == RL_RESULT,
                                   "freed_mib": words[3] if len(words) == 7 else None,
                                   "error": err[-600:] if rc != 0 else ""}
    return {"check": "rl_loop", "ok": all(r["ok"] for r in runs.values()), "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tms", help="the real torch_memory_saver's unpacked wheel")
    args = ap.parse_args()
    checks = []
    for fn in (stream_capture, pools, eager_vs_graph, lambda: rl_loop(args.tms)):
        try:
            c = fn()
        except Exception as e:  # a broken check is recorded; the others go on
            c = {"check": getattr(fn, "__name__", "rl_loop"), "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(c), flush=True)
        checks.append(c)
    summary = {"checks": {c["check"]: c["ok"] for c in checks}}
    print(json.dumps(summary), flush=True)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
