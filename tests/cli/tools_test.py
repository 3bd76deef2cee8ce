"""The command-line tools end to end: progress on a terminal and not in a pipe,
summary, compare, export round trips, RMM logs.

Usage: tools_test.py RESERVOIR_BINARY WORK_DIR SOURCE_DIR
"""
import json
import os
import pty
import subprocess
import sys

binary, work, src = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
traces = os.path.join(src, "examples", "traces")
transformer = os.path.join(traces, "transformer_training.trace")
failures = []


def check(cond, what):
    if not cond:
        failures.append(str(what))


def run(*args, env=None):
    r = subprocess.run([binary, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        failures.append(f"{args}: exit {r.returncode}: {r.stderr}")
    return r


def run_on_terminal(*args, env=None):
    """stderr on a pseudo-terminal; returns what it received."""
    master, slave = pty.openpty()
    p = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=slave,
                         env={**os.environ, **(env or {})})
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        out += chunk
    p.wait()
    os.close(master)
    check(p.returncode == 0, f"{args} on a terminal: exit {p.returncode}")
    return out.decode(errors="replace")


# Progress: drawn on a terminal, erased at the end; silent in a pipe or when disabled.
tty = run_on_terminal("replay", transformer, "--min-capacity")
check("\r\x1b[K[1/1] transformer_training.trace [native defaults], finding the minimum capacity"
      in tty, f"no progress line on the terminal: {tty!r}")
check(tty.endswith("\r\x1b[K"), f"the progress line is not erased at the end: {tty[-40:]!r}")
piped = run("replay", transformer, "--min-capacity")
check(piped.stderr == "", f"progress written to a pipe: {piped.stderr!r}")
quiet = run_on_terminal("replay", transformer, env={"RESERVOIR_PROGRESS": "0"})
check(quiet == "", f"progress despite RESERVOIR_PROGRESS=0: {quiet!r}")

# summary: PyTorch's table for the replayed trace.
s = run("summary", transformer).stdout
check("| GPU reserved memory   |   5022 MiB |   5022 MiB |   5022 MiB |      0 B   |" in s, s)
check("| Allocations           |     363    |     495    |    1977    |    1614    |" in s, s)
check(s.startswith(f"{transformer}: 3591 recorded events replayed with the native defaults"), s)

# Export round trips: text -> pickle -> JSON -> text replay the same.
pkl, js, txt = (os.path.join(work, n) for n in ("t.pickle", "t.json", "t.trace"))
run("export", transformer, "-o", pkl)
run("export", pkl, "-o", js)
run("export", js, "-o", txt)


def replay_json(path):
    rows = json.loads(run("replay", path, "--json", "-c", "", "-c", "policy:paging").stdout)
    for r in rows:
        for volatile in ("trace", "replay_seconds"):
            r.pop(volatile)
    return rows


base = replay_json(transformer)
for path in (pkl, js, txt):
    check(replay_json(path) == base, f"{path} replays differently from the original")
with open(txt) as f, open(transformer) as g:
    ops = lambda lines: [l for l in lines if l.startswith(("alloc", "free", "empty_cache"))]  # noqa: E731
    check(len(ops(f.read().splitlines())) == len(ops(g.read().splitlines())), "text ops differ")

# compare: a snapshot with itself, and native against expandable segments.
same = json.loads(run("compare", pkl, pkl, "--json").stdout)
check(all(v["delta"] == 0 for v in same["figures"].values()), same["figures"])
check(same["segments_only_in_a"] == [] and same["segments_only_in_b"] == [], same)
native, expandable = os.path.join(work, "native.pickle"), os.path.join(work, "exp.pickle")
run("export", transformer, "-c", "", "-o", native)
run("export", transformer, "-c", "expandable_segments:True", "-o", expandable)
diff = json.loads(run("compare", native, expandable, "--json").stdout)
f = diff["figures"]
# Expandable segments: one segment per pool in use (small and large), the same
# requests, 3 MiB less in rounded blocks (the 512-byte split rule), less reserved.
check(f["segments"]["a"] == 179 and f["segments"]["b"] == 2, f["segments"])
check(f["requested_bytes"]["delta"] == 0, f["requested_bytes"])
check(f["allocated_bytes"]["delta"] == -3145728, f["allocated_bytes"])
check(f["reserved_bytes"]["a"] == 5265948672 and f["reserved_bytes"]["b"] == 4974444544,
      f["reserved_bytes"])
text = run("compare", native, expandable).stdout
check("segments only in A: 179 (4.90 GiB)" in text, text)

# RMM's CSV log: read, replayed, exported.
rmm = os.path.join(src, "tests", "data", "rmm_log.csv")
rows = json.loads(run("replay", rmm, "--json").stdout)
check(rows[0]["peak_requested_bytes"] == 1048576 + 4194304 + 33554432, rows[0])
check(rows[0]["allocations"] == 4, rows[0])
bad = subprocess.run([binary, "replay", os.path.join(src, "tests", "data", "corrupt.csv")],
                     capture_output=True, text=True)
check(bad.returncode == 2 and bad.stderr.strip() == (
    "reservoir: RMM log " + os.path.join(src, "tests", "data", "corrupt.csv") +
    ": line 4: Pointer 0x7f8a40000000 is freed with Size 4096 but was allocated with 1048576 "
    "(line 2)"), bad.stderr)

# verify: exit 0 agreed, 1 diverged, 3 cannot verify; devices one by one.
import pickle
exported = os.path.join(work, "verify_me.pickle")
run("export", transformer, "-c", "", "-o", exported)
with open(exported, "rb") as fh:
    snap = pickle.load(fh)


def verify(*paths):
    return subprocess.run([binary, "verify", *paths], capture_output=True, text=True)


def write(name, data):
    path = os.path.join(work, name)
    with open(path, "wb") as fh:
        pickle.dump(data, fh, protocol=4)
    return path


ok = verify(exported)
check(ok.returncode == 0 and "agrees with the recording" in ok.stdout, ok.stdout + ok.stderr)
# A snapshot our export writes from an expandable replay: every map and unmap checked.
ok = verify(expandable)
check(ok.returncode == 0 and "agrees with the recording" in ok.stdout, ok.stdout + ok.stderr)
two = dict(snap)
two["device_traces"] = [snap["device_traces"][0], snap["device_traces"][0]]
two["segments"] = snap["segments"] + [{**s, "device": 1} for s in snap["segments"]]
both = verify(write("two_devices.pickle", two))
check(both.returncode == 0 and (exported.replace("verify_me", "two_devices") +
                               " (device 1): agrees") in both.stdout, both.stdout + both.stderr)
events = snap["device_traces"][0]
# Verified as if recorded with max_split_size_mb:20: an oversize cached block
# no longer serves a smaller request, so a new segment is asked for.
moved = dict(snap)
moved["allocator_settings"] = {**snap["allocator_settings"], "max_split_size": 20 << 20}
wrong = write("diverges.pickle", moved)
diverged = verify(wrong)
check(diverged.returncode == 1 and "DIVERGES at event" in diverged.stdout,
      diverged.stdout + diverged.stderr)
# A private pool: its segment's first event is where verify stops.
pooled = dict(snap)
target = next(e["addr"] for e in events if e["action"] == "segment_alloc")
pooled["segments"] = [{**s, "segment_pool_id": (1, 0)} if s["address"] == target else s
                      for s in snap["segments"]]
private = write("private_pool.pickle", pooled)
cannot = verify(private)
check(cannot.returncode == 3 and "CANNOT VERIFY at event" in cannot.stdout and
      "private pool (1, 0)" in cannot.stdout, cannot.stdout + cannot.stderr)
worst = verify(private, wrong)
check(worst.returncode == 1, f"a divergence outranks: exit {worst.returncode}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("tools behave")
