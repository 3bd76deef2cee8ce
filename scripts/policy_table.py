"""The segment-policy comparison of docs/benchmarks.md, as Markdown.

Usage: policy_table.py [RESERVOIR_BINARY]
Replays every trace in ../shared/traces and examples/traces, and a fixed set
of generated programs (seeds 0 to 199, reservoir/generated.hpp), under the
native policy, expandable segments, policy:paging, policy:paging with the
native bound (paging_slack_mb:2) and policy:native_paged in one run (`reservoir replay ...
--generated 200 --min-capacity --vs-native --json`), then prints the
per-recording table and, per config over the recordings and over the
generated programs, the figures policy:paging is judged by, with how far
each config went above native at the same call (the bound's worst case).
"""
import glob
import json
import math
import os
import subprocess
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build", "bin", "reservoir")
traces = sorted(glob.glob(os.path.join(root, "..", "shared", "traces", "*.pickle")))
traces += sorted(glob.glob(os.path.join(root, "..", "shared", "traces", "oom", "*.pickle")))
traces += sorted(glob.glob(os.path.join(root, "examples", "traces", "*")))
configs = ["", "expandable_segments:True", "policy:paging", "policy:paging,paging_slack_mb:2", "policy:native_paged"]
generated = 200
command = [binary, "replay", *traces, "--generated", str(generated), "--min-capacity", "--vs-native", "--json"]
for c in configs:
    command += ["-c", c]
rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
by = {(os.path.basename(r["trace"]), r["config"]): r for r in rows}
recorded = sorted({name for name, _ in by if not name.startswith("generated #")},
                  key=lambda n: (not n.startswith("cs336") and not n.startswith("octree"), n))
programs = sorted({name for name, _ in by if name.startswith("generated #")},
                  key=lambda n: int(n.split("#")[1].split()[0]))
assert len(programs) == generated, len(programs)


def gib(b):
    return f"{b / 2**30:.3f} GiB"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def cell(r):
    return (f"{gib(r['min_capacity_bytes'])} ({r['min_capacity_over_requested']:.4f}) / "
            f"{gib(r['peak_reserved_bytes'])} / {r['device_calls_per_1000_allocs']:.1f} / "
            f"{r['device_call_seconds'] * 1e3:.1f} ms")


print("| trace | peak requested | " + " | ".join(c or "native" for c in configs) + " |")
print("|---|---|" + "---|" * len(configs))
for n in recorded:
    native = by[(n, "")]
    print(f"| {n} | {gib(native['peak_requested_bytes'])} | " +
          " | ".join(cell(by[(n, c)]) for c in configs) + " |")


def summary(title, names):
    print()
    print(f"{title}:")
    print()
    print("| config | min capacity / peak requested: geometric mean | worst | peak reserved vs native: worst | "
          "vs expandable: geometric mean | calls per 1k vs native: geometric mean | worst | "
          "device time vs native: geometric mean | above native + 2 MiB a stream at the same call: "
          "programs | most above native |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        rs = [by[(n, c)] for n in names]
        nat = [by[(n, "")] for n in names]
        exp = [by[(n, "expandable_segments:True")] for n in names]
        mins = [r["min_capacity_over_requested"] for r in rs]
        res_n = [r["peak_reserved_bytes"] / x["peak_reserved_bytes"] for r, x in zip(rs, nat)]
        res_e = [r["peak_reserved_bytes"] / x["peak_reserved_bytes"] for r, x in zip(rs, exp)]
        # A program with no device call under native (everything in one
        # segment it already had) counts as a ratio of 1 when the config makes
        # none either.
        calls = [(r["device_calls"] or 1) / (x["device_calls"] or 1) for r, x in zip(rs, nat)]
        time = [(r["device_call_seconds"] or 1e-9) / (x["device_call_seconds"] or 1e-9) for r, x in zip(rs, nat)]
        over = [r["over_native"] for r in rs]
        above = sum(1 for o in over if o["ops_over_bound"] > 0)
        worst_above = max(zip((o["worst_bytes"] for o in over), names))
        worst_calls = max(zip(calls, names))
        worst_res = max(zip(res_n, names))
        print(f"| {c or 'native'} | {geomean(mins):.4f} | {max(mins):.4f} | {worst_res[0]:.3f} ({worst_res[1]}) | "
              f"{geomean(res_e):.4f} | {geomean(calls):.2f}x | {worst_calls[0]:.2f}x ({worst_calls[1]}) | "
              f"{geomean(time):.2f}x | {above} of {len(names)} | "
              f"{worst_above[0] / 2**20:,.0f} MiB ({worst_above[1]}) |")


summary(f"Over the {len(recorded)} recordings", recorded)
summary(f"Over the {len(programs)} generated programs (seeds 0 to {len(programs) - 1})", programs)
