"""reservoir's exports in torch/cuda/_memory_viz.py of each installed PyTorch
release: every subcommand's function on a snapshot reservoir exported (a
recorded trace replayed under PyTorch's defaults), with its figures checked
against the export. Run by ctest once per installed release.

The subcommands: stats (segsum, whose own accounting check must hold),
trace, segments and memory (flame graph input; flamegraph.pl, which the
module downloads, is not needed to check it), compare (called with the
segment lists: the command line passes whole snapshots, which its function
cannot iterate, for PyTorch's own snapshots too), trace_plot and
segment_plot (the MemoryViz page with the snapshot embedded, read back).
"""
import base64
import json
import os
import pickle
import subprocess

import pytest
import torch.cuda._memory_viz as viz

RESERVOIR = os.environ["RESERVOIR"]
TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "traces",
                     "transformer_training.trace")
identity = lambda text: text  # noqa: E731


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    out = tmp_path_factory.mktemp("viz") / "snapshot.pickle"
    subprocess.run([RESERVOIR, "export", TRACE, "-c", "", "-o", str(out)], check=True,
                   capture_output=True)
    with open(out, "rb") as f:
        return pickle.load(f)


def blocks(snap):
    return [b for s in snap["segments"] for b in s["blocks"]]


def test_stats(snapshot):
    out = viz.segsum(snapshot)  # raises on an accounting error
    total = sum(s["total_size"] for s in snapshot["segments"])
    allocated = sum(b["size"] for b in blocks(snapshot) if b["state"] == "active_allocated")
    assert f"segments: {len(snapshot['segments'])}\n" in out
    assert f"total_reserved: {viz.Bytes(total)}\n" in out
    assert f"total_allocated: {viz.Bytes(allocated)}\n" in out


def test_trace(snapshot):
    lines = viz.trace(snapshot).splitlines()
    events = snapshot["device_traces"][0]
    assert lines[1] == f"{len(events)} entries"
    allocs = sum(1 for e in events if e["action"] == "alloc")
    assert sum(1 for line in lines if " = " in line and "[" in line) == allocs


def test_segments_memory_and_compare(snapshot):
    # A line a block, and one for its gap where its requested size falls short.
    n = sum(1 + (b["size"] != viz._block_extra(b)[1]) for b in blocks(snapshot))
    assert n > len(blocks(snapshot))
    seg = viz.segments(snapshot, format_flamegraph=identity).splitlines()
    mem = viz.memory(snapshot, format_flamegraph=identity).splitlines()
    assert len(seg) == len(mem) == n
    assert sum(int(line.rsplit(" ", 1)[1]) for line in seg) == sum(
        s["total_size"] for s in snapshot["segments"])
    only_before = viz.compare(snapshot["segments"], snapshot["segments"][1:],
                              format_flamegraph=identity).splitlines()
    first = snapshot["segments"][0]["blocks"]
    assert len(only_before) == sum(1 + (b["size"] != viz._block_extra(b)[1]) for b in first)


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_the_memoryviz_page_embeds_the_snapshot(snapshot, plot):
    html = getattr(viz, plot)(snapshot)
    start = html.index('[{"name": "snapshot.pickle"')
    entry = json.JSONDecoder().raw_decode(html[start:])[0][0]
    embedded = pickle.loads(base64.b64decode(entry["base64"]))
    assert embedded["segments"] == snapshot["segments"]
    assert len(embedded["device_traces"][0]) == len(snapshot["device_traces"][0])
