"""Exported snapshots open in PyTorch's own tooling.

Usage: memory_viz_test.py RESERVOIR_BINARY WORK_DIR TRACE

Exports the trace, replayed under the native config, as a snapshot pickle
and as JSON; loads the pickle with Python's pickle module and checks the
structure memory_viz reads (segments with blocks, device_traces entries with
action/addr/size/stream/time_us/frames, allocator_settings); then runs the
functions of torch/cuda/_memory_viz.py from Debian's python3-torch (1.13:
stats, segments, memory and compare, which take the list of segments) and
checks their figures against the JSON export.
"""
import json
import os
import pickle
import subprocess
import sys

import torch.cuda._memory_viz as viz

binary, work, trace = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
pkl = os.path.join(work, "snapshot.pickle")
js = os.path.join(work, "snapshot.json")
for out in (pkl, js):
    subprocess.run([binary, "export", trace, "-c", "", "-o", out], check=True)

with open(pkl, "rb") as f:
    snap = pickle.load(f)
with open(js) as f:
    doc = json.load(f)

assert set(snap) >= {"segments", "device_traces", "allocator_settings"}, snap.keys()
assert len(snap["device_traces"]) == 1
events = snap["device_traces"][0]
assert len(events) == len(doc["device_traces"][0]) > 1000, len(events)
for e in events:
    assert set(e) == {"action", "addr", "size", "stream", "time_us", "frames"}, e
    assert e["action"] in {"alloc", "free_requested", "free_completed", "segment_alloc",
                           "segment_free", "segment_map", "segment_unmap", "snapshot", "oom"}
for seg in snap["segments"]:
    for key in ("address", "total_size", "stream", "segment_type", "allocated_size",
                "active_size", "requested_size", "blocks", "device", "is_expandable"):
        assert key in seg, key
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    for b in seg["blocks"]:
        assert b["state"] in {"active_allocated", "active_pending_free", "inactive"}, b

segments = snap["segments"]
stats = viz.stats(segments)
assert stats["segments"] == len(doc["segments"]), stats
assert stats["total_size"].value == sum(s["total_size"] for s in doc["segments"])
allocated = sum(b["size"] for s in doc["segments"] for b in s["blocks"]
                if b["state"] == "active_allocated")
assert stats.get("active_allocated", viz.Bytes(0)).value == allocated, (stats, allocated)

identity = lambda lines: lines  # noqa: E731  (flamegraph.pl is not needed to check the input)
seg_lines = viz.segments(segments, format_flamegraph=identity).splitlines()
mem_lines = viz.memory(segments, format_flamegraph=identity).splitlines()
blocks = sum(len(s["blocks"]) for s in segments)
assert len(seg_lines) == len(mem_lines) == blocks, (len(seg_lines), blocks)
assert sum(int(line.rsplit(" ", 1)[1]) for line in seg_lines) == stats["total_size"].value
cmp_lines = viz.compare(segments, segments[1:], format_flamegraph=identity).splitlines()
assert len(cmp_lines) == len(segments[0]["blocks"]), cmp_lines[:3]
print(f"memory_viz: {stats['segments']} segments, {len(events)} events, "
      f"{blocks} blocks; stats {stats}")
