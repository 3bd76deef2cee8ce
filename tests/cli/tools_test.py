"""The command-line tools end to end: progress on a terminal and not in a pipe,
summary, compare, export round trips, RMM logs.

Usage: tools_test.py RESERVOIR_BINARY WORK_DIR SOURCE_DIR
"""
import json
import os
import shutil
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


def too_wide(text):
    """Lines over 100 columns, but for those whose excess is a file's path
    (never broken: it stays copyable) standing nearly alone on its line."""
    def path_alone(line):
        paths = [w for w in line.split() if "/" in w]
        return paths and len(line) - max(len(w) for w in paths) <= 40
    return [line for line in text.splitlines() if len(line) > 100 and not path_alone(line)]


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
check("\r\x1b[K[1/2] transformer_training.trace [native defaults], finding the minimum capacity"
      in tty and "\r\x1b[K[2/2] transformer_training.trace [policy:native_paged], finding the "
      "minimum capacity" in tty, f"no progress line on the terminal: {tty!r}")
check(tty.endswith("\r\x1b[K"), f"the progress line is not erased at the end: {tty[-40:]!r}")
# With no config named, replay runs PyTorch's defaults and policy:native_paged.
unnamed = json.loads(run("replay", transformer, "--json").stdout)
check([r["config"] for r in unnamed] == ["", "policy:native_paged"]
      and unnamed[1]["peak_reserved_bytes"] <= unnamed[0]["peak_reserved_bytes"],
      f"replay's default configs: {[(r['config'], r['peak_reserved_bytes']) for r in unnamed]}")
piped = run("replay", transformer, "--min-capacity")
check(piped.stderr == "", f"progress written to a pipe: {piped.stderr!r}")
quiet = run_on_terminal("replay", transformer, env={"RESERVOIR_PROGRESS": "0"})
check(quiet == "", f"progress despite RESERVOIR_PROGRESS=0: {quiet!r}")

# replay's text: one block per trace in 100 columns, long settings wrapped at
# their commas (the wrapped lines read back as the setting); --wide keeps the
# wide table of every figure.
long = "garbage_collection_threshold:0.6,max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"
for extra in ([], ["--min-capacity"]):
    text = run("replay", transformer, "-c", "", "-c", long, *extra).stdout
    lines = text.splitlines()
    check(not too_wide(text), f"replay {extra}: lines over 100 columns: {too_wide(text)}")
    check(lines[0] == transformer and lines[1] == "  3591 recorded events, 3591 allocator calls; "
          "peak requested 4.61 GiB", f"replay {extra}: the trace's heading: {lines[:2]}")
    row = next(i for i, line in enumerate(lines) if line.startswith("  garbage_collection_threshold"))
    pieces = [lines[row][2:].split()[0]]
    for line in lines[row + 1:]:
        if not line.startswith("    "):
            break
        pieces.append(line.strip())
    check("".join(pieces) == long, f"replay {extra}: the wrapped setting reads back as {''.join(pieces)!r}")
    check(any(line.startswith("  native defaults") and " 4.90 GiB " in line for line in lines),
          f"replay {extra}: the native row: {lines}")
wide = run("replay", transformer, "--wide").stdout.splitlines()
check(wide[0].split()[:4] == ["trace", "config", "peak", "request"] and len(wide[1]) > 100,
      f"replay --wide: the wide table: {wide[:2]}")
for args in (["verify", os.path.join(src, "tests", "data", "torch", "mixed_sizes_expandable_2.15.0.pickle")],
             ["advise", os.path.join(traces, "gpt_training.pickle")], ["advise", transformer]):
    text = run(*args).stdout
    check(text and not too_wide(text), f"{args[0]}: lines over 100 columns: {too_wide(text)[:3]}")

# Generated programs, compared with the native policy at every call.
gen = json.loads(run("replay", "--generated", "2", "--first-seed", "1", "-c", "", "-c", "policy:paging",
                     "-c", "policy:paging,paging_slack_mb:2", "--vs-native", "--json").stdout)
check([r["trace"] for r in gen][::3] == ["generated #1 (streams+huge)", "generated #2 (inference)"],
      f"replay --generated: the programs: {[r['trace'] for r in gen]}")
check(all(r["over_native"]["worst_bytes"] == 0 for r in gen if r["config"] == ""),
      f"replay --vs-native: native above itself: {[r['over_native'] for r in gen]}")
# The bound holds on #2 (an inference program); #1's huge allocations are
# where it does not yet hold (docs/config.md, "The native bound").
bounded = [r["over_native"] for r in gen if r["config"].endswith("slack_mb:2")]
check(len(bounded) == 2 and all(o["slack_bytes_per_stream"] == 2 << 20 for o in bounded)
      and bounded[1]["ops_over_bound"] == 0 and bounded[1]["worst_over_bound_bytes"] == 0,
      f"replay --vs-native: the bound on program #2: {bounded}")
text = run("replay", "--generated", "1", "--first-seed", "1", "-c", "policy:paging", "--vs-native").stdout
check("vs native: at most +" in text and not too_wide(text), f"replay --vs-native's text: {text}")
nothing_named = subprocess.run([binary, "replay"], capture_output=True, text=True)
check(nothing_named.returncode == 2 and "name a trace, or --generated N" in nothing_named.stderr,
      f"replay with nothing to replay: {nothing_named.returncode} {nothing_named.stderr}")

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

# advise: the classic fragmentation case, recorded by an export under a
# 300 MiB device: two 100 MiB holes in a 256 MiB segment, a 160 MiB request.
MiB = 1 << 20
classic_text = os.path.join(work, "classic.trace")
with open(classic_text, "w") as fh:
    fh.write("reservoir-trace 1\n")
    for line in (f"alloc 0 {256 * MiB}", "free 0", f"alloc 1 {28 * MiB}", f"alloc 2 {100 * MiB}",
                 f"alloc 3 {28 * MiB}", f"alloc 4 {100 * MiB}", "free 2", "free 4",
                 f"alloc 5 {160 * MiB}", "free 5"):
        fh.write(line + "\n")
classic = os.path.join(work, "classic_oom.pickle")
exported_oom = subprocess.run([binary, "export", classic_text, "-c", "", "--capacity", "300MiB",
                               "-o", classic], capture_output=True, text=True)
check(exported_oom.returncode == 0 and "1 out-of-memory errors" in exported_oom.stderr,
      exported_oom.stderr)
advice = json.loads(run("advise", classic, "--json").stdout)
for key in ("trace", "peak_requested_bytes", "capacity_bytes", "fits", "diagnosis", "candidates",
            "recommendation"):
    check(key in advice, f"advise --json has no '{key}'")
for c in advice["candidates"]:
    for key in ("config", "min_capacity_bytes", "min_capacity_over_requested",
                "device_calls_per_1000_allocs", "device_call_seconds", "ooms_at_capacity"):
        check(key in c, f"candidate {c.get('config')!r} has no '{key}'")
d = advice["diagnosis"]
check(d["moment"] == "oom" and d["source"] == "verified", d)
check(d["request"]["size_bytes"] == 160 * MiB and d["device_free_bytes"] == 44 * MiB, d)
check(d["split_free"] == [{"pool": "large", "stream": 0, "bytes": 200 * MiB, "blocks": 2,
                           "largest_bytes": 100 * MiB}], d["split_free"])
check(advice["capacity_bytes"] == 300 * MiB and advice["fits"] is True, advice["capacity_bytes"])
py = advice["recommendation"]["pytorch"]
check(py["min_capacity_bytes"] == 256 * MiB and py["env"].startswith("PYTORCH_CUDA_ALLOC_CONF=") and
      py["headroom_bytes"] == 44 * MiB, py)
check(advice["recommendation"]["reservoir"]["env"].startswith("RESERVOIR_ALLOC_CONF="),
      advice["recommendation"]["reservoir"])
check(advice["recommendation"]["shrink_bytes"] is None, advice["recommendation"])
text = run("advise", classic).stdout
# Lines longer than 100 columns wrap at spaces: the checks read the words.
flat = " ".join(text.split())
check("the largest was 100.00 MiB, the request needs 160.00 MiB" in flat and
      "fragmentation" in flat and "With PyTorch:   PYTORCH_CUDA_ALLOC_CONF=" in text,
      text)
check(not too_wide(text), f"advise: lines over 100 columns: {too_wide(text)[:3]}")
# The answer first, in words: did it run out, the line to set, what it saves.
lines = text.splitlines()
# The recording ends at its failed request: the answer says what that covers.
scope_at = next(i for i, x in enumerate(lines) if x.startswith("These capacities cover the recording"))
check(" ".join(" ".join(lines[scope_at:lines.index("")]).split()) ==
      "These capacities cover the recording, which ends at the failed request: the rest of that step "
      "(for a training step, the backward pass and the optimizer) was never recorded. To check it, "
      "rerun with the setting and RESERVOIR_EXPLAIN_OOM=1, or record a whole step.", text[:900])
check(advice["answer"]["scope"] == " ".join(" ".join(lines[scope_at:lines.index("")]).split()) and
      advice["diagnosis"]["ends_at_error"] is True, advice["answer"])
check(lines[0] == "The job ran out of memory: a 160.00 MiB request found 44.00 MiB free on the device."
      and lines[1].startswith("Set PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:128,")
      and " ".join(" ".join(lines[1:scope_at]).split()) ==
      "Set PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:128, with "
      "torch.cuda.set_per_process_memory_fraction(1.0) (garbage collection runs only under a memory "
      "fraction): it needs 256.00 MiB, 0.16 GiB (38.5%) less than your settings (416.00 MiB); "
      "44.00 MiB of headroom on 300.00 MiB.", text[:600])
answer = advice["answer"]
check(answer["ran_out_of_memory"] and answer["settings_matter"] and
      answer["recorded_min_capacity_bytes"] == 416 * MiB and answer["best_min_capacity_bytes"] == 256 * MiB
      and answer["saves_bytes"] == 160 * MiB and abs(answer["saves_percent"] - 38.46) < 0.01 and
      answer["line"] == advice["recommendation"]["pytorch"]["env"], answer)
# Where no setting saves more than 1%: the settings are fine, and what would help.
fine = json.loads(run("advise", classic, "--json", "-c", "", "-c", "roundup_power2_divisions:4").stdout)
check(not fine["answer"]["settings_matter"] and fine["answer"]["line"] == "" and
      fine["answer"]["action"] == "Your settings are already within 0.0% of the best stock PyTorch "
      "setting; the program itself needs 256.00 MiB at its peak. What would help instead: less live "
      "memory at the peak (the allocations listed below).", fine["answer"])
# The same for a job: reservoir's policy is named only where its own replay
# needs less than the settings the program runs with (native_paged serves the
# fragmented request in 256 MiB); with only stock settings swept, none is named.
job_a, job_b = os.path.join(work, "rank0.pickle"), os.path.join(work, "rank1.pickle")
shutil.copyfile(classic, job_a)
shutil.copyfile(classic, job_b)
stock = json.loads(run("advise", job_a, job_b, "--json", "-c", "", "-c", "roundup_power2_divisions:4").stdout)
check(stock["answer"]["action"].endswith("(its own advice names the allocations).") and
      "reservoir's" not in stock["answer"]["action"], stock["answer"])
paged = json.loads(run("advise", job_a, job_b, "--json", "-c", "", "-c", "policy:native_paged").stdout)
check(paged["answer"]["action"].endswith(
    "(its own advice names the allocations), or reservoir's policy:native_paged "
    "(RESERVOIR_ALLOC_CONF=policy:native_paged: the hungriest rank, rank 0, needs 256.00 MiB under it)."),
    paged["answer"])
# A capacity too small for the program itself: how much it must shrink.
small = json.loads(run("advise", classic, "--capacity", "200MiB", "--json", "-c", "").stdout)
check(small["fits"] is False and small["recommendation"]["shrink_bytes"] == 56 * MiB, small)
# Several traces: one job, a rank each; the job's page and a page per rank.
page = os.path.join(work, "advice.html")
both = json.loads(run("advise", classic, transformer, "--json", "-o", page).stdout)
# The job's answer first: which ranks ran out, the one line for every rank.
job_answer = both["answer"]
check(job_answer["ranks_out_of_memory"] == ["classic_oom.pickle"] and job_answer["ran_out_of_memory"]
      and job_answer["outcome"] == "1 of 2 ranks ran out of memory: classic_oom.pickle."
      and job_answer["recorded_worst_rank"] == "transformer_training.trace"
      and job_answer["recorded_worst_min_capacity_bytes"] > job_answer["best_worst_min_capacity_bytes"]
      and job_answer["action"].startswith("Set " + job_answer["line"] + " on every rank"), job_answer)
job_text = run("advise", classic, transformer).stdout
check(job_text.splitlines()[0] == job_answer["outcome"], job_text[:300])
check(isinstance(both, dict) and [r["name"] for r in both["ranks"]] ==
      ["classic_oom.pickle", "transformer_training.trace"] and both["ranks"][0]["ran_out"] and
      not both["ranks"][1]["ran_out"] and both["recommendation"]["pytorch"]["worst_rank"] ==
      "transformer_training.trace", both)
check(os.path.getsize(page) > 1000, "advise -o wrote no page")
with open(page) as fh:
    job_page = fh.read()
rank_page = os.path.join(work, "advice_ranks", "classic_oom_pickle.html")
check('href="advice_ranks/classic_oom_pickle.html"' in job_page and os.path.exists(rank_page),
      "the job page does not link the rank's page")
# A glob naming one file (quoted, as the shell leaves it) advises on that file.
one = subprocess.run([binary, "advise", os.path.join(work, "classic_oom.pick*"), "--json"],
                     capture_output=True, text=True)
check(one.returncode == 0 and json.loads(one.stdout)["diagnosis"]["moment"] == "oom",
      f"a glob naming one file: exit {one.returncode}: {one.stderr}")
# A folder of ranks, one unreadable: the others advised, the line and exit 3 say so.
ranks = os.path.join(work, "ranks")
os.makedirs(ranks, exist_ok=True)
with open(classic, "rb") as fh:
    classic_bytes = fh.read()
for name in ("rank0.pickle", "rank10.pickle"):
    with open(os.path.join(ranks, name), "wb") as fh:
        fh.write(classic_bytes)
with open(os.path.join(ranks, "rank2.pickle"), "wb") as fh:
    fh.write(b"\x80\x04truncated")
job = subprocess.run([binary, "advise", ranks], capture_output=True, text=True)
flat = " ".join(job.stdout.split())
check(job.returncode == 3 and "Job of 3 ranks" in flat and "ran out of memory: rank 0, rank 10" in flat and
      "cannot read rank 2: snapshot " + os.path.join(ranks, "rank2.pickle") + ": pickle: byte 2" in flat and
      "One setting for every rank" in flat and not too_wide(job.stdout),
      f"exit {job.returncode}: {job.stdout}{job.stderr}")
# Bad input: an unknown setting and a trace with nothing to replay.
bad = subprocess.run([binary, "advise", classic, "-c", "max_split_size_mb:x"], capture_output=True,
                     text=True)
check(bad.returncode == 2 and "max_split_size_mb" in bad.stderr, bad.stderr)
empty = os.path.join(work, "empty.trace")
with open(empty, "w") as fh:
    fh.write("reservoir-trace 1\n")
nothing = subprocess.run([binary, "advise", empty], capture_output=True, text=True)
check(nothing.returncode == 2 and "no allocations to replay" in nothing.stderr, nothing.stderr)
tty = run_on_terminal("advise", classic)
# Our export records allocator_settings as 2.3 to 2.8 write them, which shows 2.3 or newer:
# max_non_split_rounding_mb (2.4's) is not swept (--torch-version 2.4 would sweep it).
check("classic_oom.pickle: 23/23 settings swept" in tty,
      f"no advise progress on the terminal: {tty!r}")
check(tty.endswith("\r\x1b[K"), f"advise's progress line is not erased: {tty[-40:]!r}")

# Exit statuses of our own (docs/tools.md): 2 for every kind of bad input,
# CLI11's own codes (105, 106, 109) never reach the user; 4 when a replay runs
# out of memory; sizes need a unit.
def status(*args):
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    return r.returncode, r.stderr


code, err = status("replay", os.path.join(work, "no_such_file.pickle"))
check(code == 2 and err == f"reservoir replay: no such file: {os.path.join(work, 'no_such_file.pickle')}\n",
      f"a missing file: {code} {err}")
# CLI11's own sentences never reach the user: each mistake in reservoir's words.
commands = "replay, verify, export, summary, compare, report, advise, settings, completion"
code, err = status()
check(code == 2 and err == f"reservoir: no command given: the commands are {commands} (`reservoir --help` "
      "says what each does)\n", f"no arguments: {code} {err}")
code, err = status("frobnicate")
check(code == 2 and err == f"reservoir: 'frobnicate' is not a command: the commands are {commands} "
      "(`reservoir --help` says what each does)\n", f"an unknown command: {code} {err}")
code, err = status("compare", classic)
check(code == 2 and err == "reservoir compare: the argument 'b' is missing (the second); `reservoir compare "
      "--help` shows how it is called\n", f"a missing argument: {code} {err}")
code, err = status("summary", classic, classic, classic)
check(code == 2 and err.startswith("reservoir summary: not an argument or option of summary: ") and
      "--help` shows how it is called" in err, f"an extra argument: {code} {err}")
with open(os.path.join(work, "notes.txt"), "w") as f:
    f.write("these are my notes\n")
code, err = status("summary", os.path.join(work, "notes.txt"))
check(code == 2 and "line 1: no trace format reservoir reads: reservoir reads PyTorch memory snapshots" in err
      and "its own text traces (first line 'reservoir-trace 1')" in err, f"a text file: {code} {err}")
code, err = status("replay", transformer, "--no-such-flag")
check(code == 2 and "--no-such-flag" in err, f"an unknown flag: {code} {err}")
code, err = status("replay", transformer, "--capacity", "80")
check(code == 2 and "--capacity: '80' has no unit: write 80GiB, 80MiB or 80KiB (80B for bytes)" in err,
      f"a bare size: {code} {err}")
code, err = status("verify", classic, "--memory-fraction", "0.5", "--device-memory", "85017493504")
check(code == 2 and "--device-memory: '85017493504' has no unit" in err, f"a bare size: {code} {err}")
code, err = status("replay", transformer, "--capacity", "80XB")
check(code == 2 and "unknown unit 'XB'" in err, f"a bad unit: {code} {err}")
code, _ = status("replay", transformer, "--capacity", "80GiB")
check(code == 0, f"a size with a unit: {code}")
code, _ = status("--help")
check(code == 0, f"--help: {code}")
r = subprocess.run([binary, "replay", classic, "-c", "", "--capacity", "200MiB"], capture_output=True,
                   text=True)
check(r.returncode == 4 and "out-of-memory errors; the first, at" in " ".join(r.stdout.split()),
      f"a replay that runs out of memory: exit {r.returncode}: {r.stdout[-300:]}{r.stderr}")
for sub in ["replay", "verify", "export", "summary", "compare", "report", "advise", "settings",
            "completion"]:
    helptext = subprocess.run([binary, sub, "--help"], capture_output=True, text=True).stdout
    check("Examples:\n  reservoir " in helptext or "Examples:\n  source <(reservoir" in helptext,
          f"{sub} --help has no examples")

# advise names one peak and what it means: resnet_training's reserved memory
# never rose above what was cached when its recording started (82.00 MiB);
# replays start without that cache, and the recorded settings need 78.00 MiB.
resnet = json.loads(run("advise", os.path.join(traces, "resnet_training.pickle"), "--json").stdout)
ans = resnet["answer"]
check(ans["peak_at_recording_start"] and ans["reserved_at_moment_bytes"] == 82 << 20 and
      ans["recorded_min_capacity_bytes"] == 78 << 20 and ans["moment"].startswith("when your recording started")
      and "That was when your recording started" in ans["outcome"]
      and "the recording's own requests need 78.00 MiB" in ans["outcome"], ans)
# Every capacity advise claims holds under the command it prints to check it.
for which in ("pytorch", "reservoir"):
    choice = advice["recommendation"][which] if which == "pytorch" else resnet["recommendation"][which]
    command = choice["replay_command"].split()
    check(command[:2] == ["reservoir", "replay"], command)
    r = subprocess.run([binary, *[c.strip("'") for c in command[1:]]], capture_output=True, text=True)
    check(r.returncode == 0, f"{choice['replay_command']}: exit {r.returncode} {r.stdout[-300:]}{r.stderr}")

# A snapshot recorded with C++ stacks alone: the request is named by the
# operator PyTorch ran (at::_ops::mm::call), never by the unwinder or "??".
import pickle  # noqa: E402
cpp_frames = [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
              {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::malloc(...)"},
              {"filename": "??", "line": 0, "name": "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"},
              {"filename": "??", "line": 0, "name": "_PyEval_EvalFrameDefault"}]
seg = 0x7F0000000000
snapshot = {"segments": [], "device_traces": [[
    {"action": "segment_alloc", "addr": seg, "size": 20 * MiB, "stream": 0, "frames": cpp_frames},
    {"action": "alloc", "addr": seg, "size": 20 * MiB, "stream": 0, "frames": cpp_frames},
    {"action": "oom", "addr": 0, "size": 40 * MiB, "stream": 0, "device_free": 10 * MiB, "frames": cpp_frames}]]}
cpp_only = os.path.join(work, "cpp_frames.pickle")
with open(cpp_only, "wb") as fh:
    pickle.dump(snapshot, fh)
text = run("advise", cpp_only).stdout
check("at aten::mm (C++)" in text and "unwind" not in text and "??" not in text, text[:1500])

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("tools behave")
