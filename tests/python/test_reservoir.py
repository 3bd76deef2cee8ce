"""The Python module on HostDevice (real memory): regions, pause/resume,
contents, addresses, resident memory, errors, stats, snapshots, the process
saver PyTorch allocates from, and the torch_memory_saver drop-in."""
import ctypes
import json
import os
import re
import subprocess
import sys
import threading

import pytest

os.environ["RESERVOIR_TORCH_DEVICE"] = "host"  # the process saver on real host memory
import reservoir  # noqa: E402
from reservoir.memory_saver import torch_memory_saver  # noqa: E402

MiB = 1 << 20
POLICIES = ["", "expandable_segments:True", "policy:paging"]


def write(ptr, data):
    ctypes.memmove(ptr, data, len(data))


def read(ptr, n):
    return ctypes.string_at(ptr, n)


def segment_addresses(saver):
    return sorted(s["address"] for s in saver.snapshot()["segments"])


@pytest.mark.parametrize("config", POLICIES)
def test_contents_survive_byte_for_byte_at_the_same_addresses(config):
    dev = reservoir.HostDevice()
    saver = reservoir.Saver(dev, config=config, chunk_bytes=1 * MiB, copy_streams=2)
    sizes = [4096, 3 * MiB + 512, 24 * MiB]
    blocks = []
    with saver.region("weights", cpu_backup=True):
        for n in sizes:
            ptr = saver.allocate(n)
            data = os.urandom(n)
            write(ptr, data)
            blocks.append((ptr, data))
    addresses = segment_addresses(saver)
    physical = saver.tag_info("weights")["physical_bytes"]
    used = dev.used_bytes

    saver.pause("weights")
    info = saver.tag_info("weights")
    assert info["paused"] and info["physical_bytes"] == 0
    assert info["backup_bytes"] == sum(sizes)
    assert dev.used_bytes == used - physical
    assert segment_addresses(saver) == addresses

    saver.resume("weights")
    assert dev.used_bytes == used
    assert segment_addresses(saver) == addresses
    for ptr, data in blocks:
        assert read(ptr, len(data)) == data
    for ptr, _ in blocks:
        saver.free(ptr)
    saver.validate()


def test_what_a_pause_keeps_is_chosen_at_the_pause():
    saver = reservoir.Saver(reservoir.HostDevice(), chunk_bytes=1 * MiB)
    with saver.region("kv_cache", cpu_backup=True):
        kv = saver.allocate(3 * MiB)
    with saver.region("weights", cpu_backup=True):
        w = saver.allocate(2 * MiB)
    data = os.urandom(3 * MiB)
    write(kv, data)
    write(w, data[:2 * MiB])
    saver.pause("kv_cache", contents="zero")
    assert saver.tag_info("kv_cache")["last_pause_copied"] == 0
    saver.resume("kv_cache")
    assert read(kv, 3 * MiB) == bytes(3 * MiB)
    # Every running tag at once, discarding: nothing copied either way.
    saver.pause(contents="discard")
    assert saver.is_paused("kv_cache") and saver.is_paused("weights")
    assert saver.tag_info("weights")["last_pause_copied"] == 0
    saver.resume()
    with pytest.raises(reservoir.UsageError, match=r"pause: contents: 'cpu' is not a way to pause "
                                                   r"\(as_regions, discard or zero\)"):
        saver.pause("kv_cache", contents="cpu")
    assert not saver.is_paused("kv_cache")
    saver.free(kv)
    saver.free(w)
    saver.validate()


def test_resident_memory_falls_after_pause_and_rises_after_resume():
    # Margins leave room for what a sanitizer's shadow memory adds.
    saver = reservoir.Saver(reservoir.HostDevice(), storage="mmap")
    n = 128 * MiB
    with saver.region("weights", cpu_backup=True):
        ptr = saver.allocate(n)
    data = os.urandom(n)
    write(ptr, data)
    running = reservoir.rss_bytes()
    saver.pause("weights")
    paused = reservoir.rss_bytes()
    assert paused < running - n * 6 // 10, (running, paused)
    saver.resume("weights")
    resumed = reservoir.rss_bytes()
    assert resumed > paused + n * 6 // 10, (paused, resumed)
    assert read(ptr, n) == data
    saver.free(ptr)


def test_without_backup_memory_is_released_and_usable_again():
    saver = reservoir.Saver(reservoir.HostDevice())
    n = 64 * MiB
    with saver.region("kv_cache"):
        ptr = saver.allocate(n)
    ones, twos = b"\x01" * n, b"\x02" * n
    write(ptr, ones)
    running = reservoir.rss_bytes()
    saver.pause("kv_cache")
    paused = reservoir.rss_bytes()
    assert paused < running - n * 6 // 10, (running, paused)
    assert saver.tag_info("kv_cache")["last_pause_copied"] == 0
    saver.resume("kv_cache")  # the memory is there again, at the same address
    assert reservoir.rss_bytes() > paused + n * 6 // 10
    write(ptr, twos)
    assert read(ptr, n) == twos
    saver.free(ptr)


def test_errors_are_exceptions_that_say_what_was_wrong():
    saver = reservoir.Saver(reservoir.HostDevice())
    with saver.region("kv"):
        ptr = saver.allocate(MiB)
    with pytest.raises(reservoir.UsageError, match=r"^pause: unknown tag 'nope' \(known tags: 'kv'\)$"):
        saver.pause("nope")
    with pytest.raises(reservoir.UsageError, match=r"^resume: tag 'kv' is not paused$"):
        saver.resume("kv")
    saver.pause("kv")
    with pytest.raises(reservoir.UsageError, match=r"^pause: tag 'kv' is paused already$"):
        saver.pause("kv")
    with pytest.raises(reservoir.UsageError, match=r"into tag 'kv', which is paused"):
        with saver.region("kv"):
            saver.allocate(100)
    assert saver.current_tag() == ""
    saver.free(ptr)  # applied on resume
    assert saver.tag_info("kv")["pending_frees"] == 1
    with pytest.raises(reservoir.InvalidPointerError, match="freed already"):
        saver.free(ptr)
    saver.resume("kv")
    assert saver.tag_info("kv")["allocated_bytes"] == 0
    with pytest.raises(reservoir.InvalidPointerError):
        saver.free(ptr)
    assert issubclass(reservoir.UsageError, reservoir.Error)
    assert issubclass(reservoir.Error, RuntimeError)
    with pytest.raises(reservoir.UsageError, match="Saver: storage: 'tape' is not 'pinned', 'mmap' or 'disk'"):
        reservoir.Saver(reservoir.HostDevice(), storage="tape")
    with pytest.raises(reservoir.ConfigError):
        reservoir.Saver(reservoir.HostDevice(), config="expandable_segments:maybe")
    saver.validate()


def test_regions_nest_per_thread_and_untagged_allocates_outside():
    saver = reservoir.Saver(reservoir.HostDevice())
    with saver.region("outer"):
        a = saver.allocate(1024)
        with saver.region("inner"):
            assert saver.current_tag() == "inner"
            b = saver.allocate(1024)
            with saver.untagged():
                assert saver.current_tag() == ""
                c = saver.allocate(1024)
        seen = []
        t = threading.Thread(target=lambda: seen.append(saver.current_tag()))
        t.start()
        t.join()
        assert seen == [""]
        assert saver.current_tag() == "outer"
    assert saver.tag_info("outer")["allocated_bytes"] == 1024
    assert saver.tag_info("inner")["allocated_bytes"] == 1024
    assert saver.stats()["allocated_bytes.all.current"] == 3072
    for p in (a, b, c):
        saver.free(p)


def test_stats_summary_and_snapshot_cover_tags():
    saver = reservoir.Saver(reservoir.HostDevice())
    with saver.region("weights"):
        a = saver.allocate(MiB)
    b = saver.allocate(2 * MiB)
    assert saver.stats("weights")["allocated_bytes.all.current"] == MiB
    assert saver.stats()["allocated_bytes.all.current"] == 3 * MiB
    snap = saver.snapshot()
    assert len(snap["segments"]) == 2
    tagged = [blk for seg in snap["segments"] for blk in seg["blocks"]
              if any(f.get("filename") == "<annotation>" and f.get("name") == "reservoir.tag=weights"
                     for f in blk.get("frames", []))]
    assert tagged, snap["segments"]
    saver.pause("weights")
    assert "Tag 'weights': paused, 0 bytes of physical memory" in saver.memory_summary()
    (info,) = saver.tags()
    assert list(info) == ["tag", "cpu_backup", "backup_storage", "paused", "allocated_bytes", "reserved_bytes",
                          "physical_bytes", "backup_bytes", "pending_frees", "pauses", "resumes",
                          "last_pause_seconds", "last_resume_seconds", "last_pause_copied",
                          "last_resume_copied", "last_released_bytes"]
    assert (info["tag"], info["paused"], info["pauses"], info["physical_bytes"]) == ("weights", True, 1, 0)
    assert info["allocated_bytes"] == MiB and info["last_released_bytes"] == 2 * MiB
    saver.resume("weights")
    saver.free(a)
    saver.free(b)


def test_peaks_are_those_of_everything_together_and_reset():
    saver = reservoir.Saver(reservoir.HostDevice())
    a = saver.allocate(8 * MiB)
    saver.free(a)
    with saver.region("kv"):
        b = saver.allocate(8 * MiB)
    s = saver.stats()
    assert s["allocated_bytes.all.current"] == 8 * MiB
    assert s["allocated_bytes.all.peak"] == 8 * MiB  # not 16: they never coexisted
    c = saver.allocate(2 * MiB)
    assert saver.stats()["allocated_bytes.all.peak"] == 10 * MiB
    saver.free(c)
    saver.reset_peak_stats()
    s = saver.stats()
    assert s["allocated_bytes.all.peak"] == 8 * MiB
    assert saver.stats("kv")["allocated_bytes.all.peak"] == 8 * MiB
    saver.reset_accumulated_stats()
    assert saver.stats()["allocated_bytes.all.allocated"] == 0
    saver.validate()
    saver.free(b)
    summed = reservoir.Saver(reservoir.HostDevice(), exact_peaks=False)
    summed.free(summed.allocate(8 * MiB))
    with summed.region("kv"):
        d = summed.allocate(8 * MiB)
    assert summed.stats()["allocated_bytes.all.peak"] == 16 * MiB  # each allocator's peak, added
    summed.free(d)
    reservoir.reset_peak_stats()  # the process saver's
    reservoir.reset_accumulated_stats()
    s = reservoir.stats()
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"]
    assert s["num_device_alloc"] == 0


def test_the_process_saver_is_the_one_pytorchs_allocator_entry_points_use():
    lib = ctypes.CDLL(reservoir.library_path())
    lib.reservoir_torch_malloc.restype = ctypes.c_void_p
    lib.reservoir_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.reservoir_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    with reservoir.region("torch_tag", cpu_backup=True):
        ptr = lib.reservoir_torch_malloc(5 * MiB, 0, None)  # what PyTorch calls
    assert ptr
    data = os.urandom(5 * MiB)
    write(ptr, data)
    assert reservoir.default_saver().tag_info("torch_tag")["allocated_bytes"] == 5 * MiB
    reservoir.pause("torch_tag")
    assert reservoir.default_saver().tag_info("torch_tag")["physical_bytes"] == 0
    reservoir.resume("torch_tag")
    assert read(ptr, 5 * MiB) == data
    lib.reservoir_torch_free(ptr, 5 * MiB, 0, None)
    assert reservoir.default_saver().tag_info("torch_tag")["allocated_bytes"] == 0
    assert "allocated_bytes.all.current" in reservoir.stats()
    assert "Untagged memory" in reservoir.memory_summary()
    reservoir.record_memory_history(True)
    p = lib.reservoir_torch_malloc(4096, 0, None)
    lib.reservoir_torch_free(p, 4096, 0, None)
    history = reservoir.snapshot()["device_traces"][0]
    # A first untagged allocation: its small segment, then the block.
    assert [e["action"] for e in history] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "snapshot"]
    assert history[1]["addr"] == history[2]["addr"] == history[0]["addr"]
    assert (history[0]["size"], history[1]["size"]) == (2 * MiB, 4096)
    reservoir.record_memory_history(False)
    reservoir.empty_cache()


def test_torch_memory_saver_drop_in():
    saver = reservoir.default_saver()
    with torch_memory_saver.region(tag="tms_weights", enable_cpu_backup=True):
        w = saver.allocate(2 * MiB)
        with torch_memory_saver.disable():
            plain = saver.allocate(MiB)
    with torch_memory_saver.region():  # tag "default", no backup
        kv = saver.allocate(MiB)
    data = os.urandom(2 * MiB)
    write(w, data)
    torch_memory_saver.pause("never_used")  # as torch_memory_saver: nothing to do
    torch_memory_saver.pause("tms_weights")
    assert saver.is_paused("tms_weights") and not saver.is_paused("default")
    with pytest.raises(reservoir.UsageError):
        torch_memory_saver.pause("tms_weights")  # torch_memory_saver exits here
    torch_memory_saver.pause()  # every running tag
    assert saver.is_paused("default")
    write(plain, b"x" * MiB)  # outside every tag: never paused
    torch_memory_saver.resume()
    assert read(w, 2 * MiB) == data
    for p in (w, plain, kv):
        saver.free(p)


def test_install_torch_says_what_it_needs():
    torch = pytest.importorskip("torch")
    if hasattr(torch.cuda.memory, "CUDAPluggableAllocator"):
        pytest.skip("this PyTorch has a pluggable allocator; the GPU suite covers it")
    with pytest.raises(RuntimeError, match=r"has no CUDAPluggableAllocator \(PyTorch 2.0 or later needed\)"):
        reservoir.install_torch()


def test_open_device_by_kind_gives_the_backend_and_rejects_unknown_kinds():
    host = reservoir.open_device("host", capacity=1 << 30, granularity=4 * MiB)
    assert isinstance(host, reservoir.HostDevice)
    assert (host.name, host.granularity) == ("host", 4 * MiB)
    sim = reservoir.open_device("sim")
    assert isinstance(sim, reservoir.SimDevice) and sim.granularity == 2 * MiB
    with pytest.raises(reservoir.UsageError,
                       match=r"^unknown device kind 'tpu' \(sim, host, cuda-runtime, cuda-vmm\)$"):
        reservoir.open_device("tpu")


def test_native_files_and_the_tool_are_found_through_the_package():
    package = os.path.dirname(os.path.abspath(reservoir.__file__))
    assert re.fullmatch(r"\d+\.\d+\.\d+", reservoir.__version__)
    found = [reservoir.torch_library_path(), reservoir.cli_path()]
    try:
        found.append(reservoir.preload_library_path())
    except FileNotFoundError as e:  # a build without CUDA's headers has no interposer
        assert "libreservoir_preload.so" in str(e) and package in str(e)
    for path in found:
        assert os.path.dirname(os.path.dirname(path)) == package and os.path.isfile(path), path
    assert os.path.basename(reservoir.torch_library_path()) == "libreservoir_torch.so"
    out = subprocess.run([sys.executable, "-m", "reservoir", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"reservoir {reservoir.__version__}\n", out
    out = subprocess.run([sys.executable, "-m", "reservoir", "replay", "no-such-trace"], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "no-such-trace" in out.stderr, out


def test_advise_from_python_is_the_tools_json():
    here = os.path.dirname(os.path.abspath(__file__))
    trace = os.path.join(here, "small.trace")  # beside the installed wheel's copy of this file
    if not os.path.exists(trace):
        trace = os.path.join(here, "..", "..", "examples", "traces", "transformer_training.trace")
    from_python = reservoir.advise(trace, capacity="24GiB", configs=["", "max_split_size_mb:128"])
    tool = subprocess.run([reservoir.cli_path(), "advise", trace, "--json", "--capacity", "24GiB",
                           "-c", "", "-c", "max_split_size_mb:128"], capture_output=True, text=True)
    expected = json.loads(tool.stdout)
    for d in (from_python, expected):
        d.pop("seconds")  # wall time
    assert from_python == expected
    assert from_python["answer"]["outcome"].startswith("The job did not run out of memory")
    with pytest.raises(reservoir.UsageError, match="has no unit"):
        reservoir.advise(trace, capacity="24")
