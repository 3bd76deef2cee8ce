"""Hostile and careless input to every subcommand: each class of bad file or
argument (generated here, none stored) runs under a memory and a time limit,
and must end with the documented exit status and a message that says what
was wrong: never a crash, a hang, an abort or a silent exit 0.

Usage: hostile_test.py RESERVOIR_BINARY WORK_DIR

Exit statuses (reservoir --help): 2 bad input, 3 cannot verify or read,
4 a replay ran out of memory. Under ASan the memory limit is left to the
sanitizer (its shadow memory needs a large address space).
"""
import os
import pickle
import resource
import subprocess
import sys
import time

binary, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
failures = []
SECONDS = 60            # per run; every case here takes well under a second
MEMORY = 2 << 30        # address space per run (unless under a sanitizer)
sanitized = "asan" in os.path.basename(os.path.dirname(os.path.dirname(binary))) or \
    bool(os.environ.get("RESERVOIR_UNDER_SANITIZER"))


def limits():
    if not sanitized:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run(*args, stdin=None):
    start = time.monotonic()
    try:
        r = subprocess.run([binary, *args], capture_output=True, text=True, timeout=SECONDS,
                           preexec_fn=limits, stdin=stdin)
    except subprocess.TimeoutExpired:
        failures.append(f"{args}: still running after {SECONDS} s")
        return None
    r.seconds = time.monotonic() - start
    if r.returncode < 0 or r.returncode > 4:
        failures.append(f"{args}: exit {r.returncode} (a crash or an abort): {r.stderr[-2000:]}")
    return r


def said(r):
    """What a run printed, its lines wrapped at 100 columns rejoined."""
    return " ".join((r.stdout + r.stderr).split())


def expect(args, status, *words):
    r = run(*args)
    if r is None:
        return
    text = said(r)
    if r.returncode != status:
        failures.append(f"{args}: exit {r.returncode}, expected {status}: {text[-1500:]}")
    for w in words:
        if w not in text:
            failures.append(f"{args}: the output does not say {w!r}: {text[-1500:]}")


def write(name, obj, protocol=4):
    path = os.path.join(work, name)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


def event(action, size, addr=1 << 40, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


OUT = os.path.join(work, "out")
# Every subcommand that reads one trace, with what it needs besides.
ONE = [
    lambda t: ("replay", t),
    lambda t: ("replay", t, "-c", "expandable_segments:True"),
    lambda t: ("replay", t, "-c", "policy:paging"),
    lambda t: ("replay", t, "-c", "policy:native_paged"),
    lambda t: ("replay", t, "--min-capacity", "-c", "policy:native_paged"),
    lambda t: ("verify", t),
    lambda t: ("summary", t),
    lambda t: ("export", t, "-o", OUT + ".json"),
    lambda t: ("report", t, "-o", OUT + ".html"),
    lambda t: ("advise", t),
    lambda t: ("compare", t, t),
]

# 1. Snapshots of no device: every tool says so, exit 2.
for name, obj in [("empty.pickle", {"segments": [], "device_traces": []}),
                  ("traces_only.pickle", {"device_traces": []})]:
    path = write(name, obj)
    for make in ONE:
        expect(make(path), 2, "holds no device")
# ...and a job with one such rank names it and exits 3 (a rank not read).
good = write("good.pickle", {"segments": [], "device_traces": [
    [event("alloc", 4096), event("free_requested", 4096), event("free_completed", 4096)]]})
expect(("advise", good, os.path.join(work, "empty.pickle")), 3,
       "Job of 2 ranks", "1 could not be read", "empty.pickle", "holds no device")

# 2. Sizes that wrap or never end: out of memory (exit 4), quickly, under every policy.
for name, size in [("max.pickle", 2**64 - 1), ("wrap.pickle", 2**64 - 512), ("huge.pickle", 2**62),
                   ("eib.pickle", 2**60)]:
    path = write(name, {"segments": [], "device_traces": [[event("alloc", size)]]})
    for config in ("", "expandable_segments:True", "policy:paging", "policy:native_paged",
                   "roundup_power2_divisions:4", "max_split_size_mb:64"):
        expect(("replay", path, "-c", config), 4, "Tried to allocate more than 1EB memory",
               f"{size} bytes requested")
    expect(("replay", path, "--min-capacity"), 2, "no capacity up to", "more than 1EB")
# Beyond any GPU but below 1 EiB: out of memory on the unbounded device, in no time.
for name, size in [("pib.pickle", 2**50), ("beyond.pickle", 2**59)]:
    path = write(name, {"segments": [], "device_traces": [[event("alloc", size)]]})
    for config in ("", "expandable_segments:True", "policy:paging", "policy:native_paged"):
        r = run("replay", path, "-c", config)
        if r is not None:
            if r.returncode != 4 or "1 out-of-memory errors" not in said(r):
                failures.append(f"{name} [{config}]: exit {r.returncode}: {r.stdout}{r.stderr}")
            if r.seconds > 10:
                failures.append(f"{name} [{config}]: took {r.seconds:.1f} s")

# 3. Files built to exhaust memory: refused with exit 2, in bounded memory.
many = write("many_devices.pickle", {"segments": [], "device_traces": [[]] * 30000})
for make in ONE[:1] + ONE[5:6] + ONE[6:7]:
    expect(make(many), 2, "30000 device lists")
frame = {"filename": "train.py", "name": "step", "line": 7}
deep = write("deep_stack.pickle", {"segments": [], "device_traces": [
    [event("alloc", 512, frames=[frame] * 2_000_000)]]})
for make in (ONE[5], ONE[7], ONE[9]):
    expect(make(deep), 2, "2000000 frames in one stack")
long_name = write("long_name.pickle", {"segments": [], "device_traces": [
    [event("alloc", 512, frames=[{"filename": "x" * ((1 << 20) + 1), "name": "f", "line": 1}])]]})
expect(("verify", long_name), 2, "a name of 1048577 bytes")
# One long string shared by many distinct frames: a few MB naming GBs.
big = "y" * (1 << 20)
frames = [{"filename": big, "name": f"f{i}", "line": i} for i in range(5000)]
shared = write("shared_string.pickle", {"segments": [], "device_traces": [
    [event("alloc", 512, addr=(1 << 40) + 512 * i, frames=frames[5 * i:5 * i + 5])
     for i in range(1000)]]})
expect(("export", shared, "-o", OUT + ".json"), 2, "the stacks read so far take")
# Streams: a binary one is refused at its first bytes.
expect(("replay", "/dev/zero"), 2, "a NUL byte")

# 4. Corruption the format lets one see.
evs = [event("alloc", 512, addr=(1 << 40) + 512 * i) for i in range(3000)]
data = pickle.dumps({"segments": [], "device_traces": [evs]}, protocol=4)
import pickletools  # noqa: E402

dicts = [pos for op, _, pos in pickletools.genops(data) if op.name == "EMPTY_DICT"]
cut = os.path.join(work, "cut_frame.pickle")
with open(cut, "wb") as f:
    f.write(data[:dicts[100]] + data[dicts[101]:])  # one event cut out of the first frame
expect(("replay", cut), 2, "FRAME", "bytes are missing from that frame")
bad_utf8 = os.path.join(work, "bad_utf8.pickle")
with open(bad_utf8, "wb") as f:
    f.write(data.replace(b"alloc", b"all\xffc", 1))
expect(("replay", bad_utf8), 2, "not UTF-8")
short = os.path.join(work, "short_frame.pickle")
with open(short, "wb") as f:
    f.write(data[:1000])
expect(("replay", short), 2, "truncated: the FRAME holds")

# 5. Arguments: ranges said in words.
trace = good
expect(("replay", "--generated", "-1"), 2, "-1 programs: give 0 to 1000000")
expect(("replay", "--generated", "100000000000"), 2, "give 0 to 1000000")
expect(("replay", trace, "--device", "-1"), 2, "(a device index): give 0 to 1023")
expect(("replay", trace, "--memory-fraction", "nan"), 2, "'nan' is not a fraction")
expect(("replay", trace, "--memory-fraction", "1.5"), 2, "1.5 is not a fraction from 0 to 1")
expect(("verify", trace, "--memory-fraction", "0", "--device-memory", "8GiB"), 2,
       "0 is not a fraction above 0 and at most 1")
expect(("replay", trace, "--capacity", "0B"), 2, "'0B' is no memory at all")
expect(("advise", trace, "-o", ""), 2, "an empty path")
expect(("report", trace, "-o", ""), 2, "an empty path")
expect(("export", trace, "-o", ""), 2, "an empty path")
expect(("advise", trace, "--threads", "100000"), 2, "give 0 to 1024")
expect(("compare", trace, trace, "--top", "-1"), 2, "-1 rows: give 1 to 100000")

# A pool id on an event (PyTorch 2.15's pool_id) that is not two ints that are not negative.
for name, pool in [("pool_text.pickle", "x"), ("pool_three.pickle", (0, 1, 2)), ("pool_negative.pickle", (1, -1))]:
    ev = event("alloc", 4096)
    ev["pool_id"] = pool
    path = write(name, {"segments": [], "device_traces": [[ev]]})
    expect(("verify", path), 2, "device_traces[0][0].pool_id")

if failures:
    print(f"{len(failures)} failure(s):")
    for f in failures:
        print(" -", f)
    sys.exit(1)
print("every hostile input was refused in words, with its exit status")
