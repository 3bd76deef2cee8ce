#!/usr/bin/env python3
"""The simulated CUDA device against a real GPU's answers, probe by probe.

Reads a real GPU's record (tests/gpu/cuda_behaviour.py's JSON, kept in
tests/data/gpu/<machine>/cuda_behaviour.json), runs the same probes on the
simulated device (--cudart/--cuda name its libraries), and compares every
value except times and raw addresses. Each difference must be one listed in
KNOWN below, with the reason the simulation keeps it; a difference not
listed, or a listed one that no longer differs, fails.

    python3 tests/gpu/compare_behaviour.py REAL.json --cudart SIM/libcudart.so.13 --cuda SIM/libcuda.so.1
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# Not compared: times (the simulation does not model them; the latency model
# in docs/config.md does, for replays) and raw addresses (a process's own).
SKIP_PROBES = {"timings", "call_costs", "malloc_sequence"}

# probe/key -> why the simulation answers differently from the GPU.
KNOWN = {
    "malloc_layout/1048576/steps": "the GPU packs 1 MiB blocks after earlier small slots and starts its "
                                   "third in another 2 MiB page elsewhere in its range; the simulation's "
                                   "pages ascend",
    "malloc_layout/2097152/steps": "the GPU's first 2 MiB block lands past the small pages, then ascends; the "
                                   "simulation ascends from the first free hole",
    "malloc_layout/20971521/steps": "the GPU places allocations of 20 MiB and more downward, 32 MiB aligned; "
                                    "the simulation ascends, 2 MiB aligned",
    "malloc_layout/1073741824/steps": "see 20971521/steps",
    "vmm_bad_handles/crashed": "a made-up handle is the driver's own pointer: the real driver crashes "
                               "(SIGSEGV); the simulation answers an error instead",
}


def normalize(key, value):
    """Alignment beyond 2 MiB is compared as 2 MiB: the GPU aligned its 4 MiB blocks to 4 MiB, its
    22 MiB ones to 8 MiB and its 1 GiB ones to 32 MiB; the simulation promises 2 MiB, and where
    its range happens to start decides the rest."""
    if key.endswith("/low_zero_bits") and isinstance(value, int):
        return min(value, 21)
    return value


def flatten(obj, prefix=""):
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    else:
        out[prefix] = obj
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("real")
    ap.add_argument("--cudart", required=True)
    ap.add_argument("--cuda", required=True)
    args = ap.parse_args()
    with open(args.real) as f:
        real = json.load(f)["probes"]
    p = subprocess.run([sys.executable, os.path.join(HERE, "cuda_behaviour.py"), "--isolate",
                        "--cudart", args.cudart, "--cuda", args.cuda],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(f"the probes failed on the simulated device: {p.stderr[-2000:]}")
        return 1
    sim = json.loads(p.stdout)["probes"]
    problems, agreed, differ = [], 0, []
    for probe in sorted(real):
        if probe in SKIP_PROBES:
            continue
        r, s = flatten(real[probe], probe), flatten(sim.get(probe, {}), probe)
        # A crash on the GPU is compared as a whole: its partial record is the crash's.
        if "crashed" in real[probe]:
            r = {f"{probe}/crashed": real[probe]["crashed"]}
            s = {f"{probe}/crashed": sim.get(probe, {}).get("crashed")}
        for key in sorted(set(r) | set(s)):
            if key.endswith("/stderr"):
                continue
            r[key], s[key] = normalize(key, r.get(key)), normalize(key, s.get(key))
            if r.get(key) == s.get(key):
                agreed += 1
                if key in KNOWN:
                    problems.append(f"{key}: listed as a difference but now agrees ({r.get(key)!r})")
                continue
            differ.append(key)
            if key not in KNOWN:
                problems.append(f"{key}: GPU {r.get(key)!r}, simulated {s.get(key)!r}")
    for key in differ:
        if key in KNOWN:
            print(f"known   {key}: {KNOWN[key]}")
    print(f"{agreed} values agree, {len(differ)} differ ({len(differ) - len([k for k in differ if k not in KNOWN])} "
          f"known)")
    for line in problems:
        print("PROBLEM " + line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
