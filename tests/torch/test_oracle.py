"""PyTorch's own allocator as the oracle: thousands of random programs per
release (oracle.py), each snapshot verified by reservoir, under each
setting; programs driven into out-of-memory, whose dumps verify agrees with
and advise explains. Run by ctest once per installed release (see
test_simcuda_torch.py for the environment); RESERVOIR_ORACLE_PROGRAMS
(default 300) is the count per setting, reduced for the releases between the
oldest and the newest (tests/CMakeLists.txt)."""
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

RESERVOIR = os.environ["RESERVOIR"]
ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.py")
PROGRAMS = int(os.environ.get("RESERVOIR_ORACLE_PROGRAMS", "300"))

def release_key(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


RELEASE = release_key(importlib.metadata.version("torch"))
# Every setting the running release knows (an unknown key is refused):
# expandable segments and roundup_power2_divisions' list form came with
# PyTorch 2.1, large_segment_size_mb with 2.11, expandable_segments_reserve
# with 2.15 (whose programs annotate some of their tensors too).
SETTINGS = ["", "max_split_size_mb:64", "roundup_power2_divisions:4",
            *(["roundup_power2_divisions:[256:1,512:2,>:8]", "expandable_segments:True"]
              if RELEASE >= (2, 1) else []),
            *(["large_segment_size_mb:40"] if RELEASE >= (2, 11) else []),
            # 2.15's reserve of each expandable segment: a quarter of the device.
            *(["expandable_segments:True,expandable_segments_reserve:0.25"] if RELEASE >= (2, 15) else []),
            "garbage_collection_threshold:0.6,max_split_size_mb:128"]


def oracle(out, seed, programs, settings, *extra, env=None):
    r = subprocess.run([sys.executable, "-W", "ignore", ORACLE, str(out), str(seed), str(programs),
                        *extra],
                       env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": settings, **(env or {})},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    files = sorted(str(out / f) for f in os.listdir(out))
    assert len(files) == programs
    return files


def given(settings):
    """verify's options for programs run under `settings`: snapshots before
    PyTorch 2.3 do not record their allocator settings, so verify is told
    them, as a user of such a release tells it theirs."""
    return ["--settings", settings] if RELEASE < (2, 3) else []


def verify(files, *options, settings=""):
    v = subprocess.run([RESERVOIR, "verify", *given(settings), *options, *files], capture_output=True,
                       text=True, timeout=600)
    lines = [l for l in v.stdout.splitlines() if not l.startswith(" ")]
    disagreements = [l for l in lines if "agrees with the recording" not in l]
    assert v.returncode == 0 and not disagreements, "\n".join(disagreements[:5]) + v.stdout[-3000:]
    return v.stdout


@pytest.mark.parametrize("settings", SETTINGS)
def test_verify_agrees_with_every_program(settings, tmp_path):
    seed = 1 + SETTINGS.index(settings)
    out = verify(oracle(tmp_path, seed, PROGRAMS, settings), settings=settings)
    assert out.count("agrees with the recording") == PROGRAMS


def test_of_equal_cached_blocks_the_running_release_takes_the_one_its_rule_names(tmp_path):
    """Which of two cached blocks of equal size a request takes: the lower
    address (2.11 and before), the block made first (2.12), the oldest
    segment's (2.13 on). A 2.12 snapshot looks like a 2.11 one, so verify
    tries the older rule first and says when only 2.12's agrees; later
    snapshots show their release. Every program agrees (verify), each under
    its release's rule and no other."""
    files = oracle(tmp_path, 77, PROGRAMS, "")
    out = " ".join(verify(files).split())
    counts = {rule: out.count(f"rules of PyTorch {rule} (") for rule in ("2.12", "2.13 and later")}
    release = RELEASE
    if release >= (2, 13):
        assert counts == {"2.12": 0, "2.13 and later": PROGRAMS}, counts
    elif release == (2, 12):
        assert counts["2.13 and later"] == 0 and counts["2.12"] > 0, counts
    else:
        assert counts == {"2.12": 0, "2.13 and later": 0}, counts


def test_out_of_memory_dumps_verify_and_advise_explains_them(tmp_path):
    files = oracle(tmp_path, 99, 40, "", "--oom", env={"RESERVOIR_SIMCUDA_MEMORY": "8GiB"})
    out = verify(files)
    assert " ".join(out.split()).count("1 oom checked") == 40
    for f in files[:10]:
        a = subprocess.run([RESERVOIR, "advise", f], capture_output=True, text=True, timeout=120)
        assert a.returncode == 0, a.stderr
        flat = " ".join(a.stdout.split())  # lines wrap at 100 columns
        assert "at the out-of-memory error" in flat
        assert "failed request" in flat
        assert "(recorded with the oom)" in flat


GC = "garbage_collection_threshold:0.6,max_split_size_mb:128"
SMALL_DEVICE = {"RESERVOIR_SIMCUDA_MEMORY": "8GiB"}
LIMIT = ["--memory-fraction", "0.5", "--device-memory", "8GiB"]


def counted(out, what):
    """The sum over verify's report of the figures before `what`."""
    return sum(int(n) for n in re.findall(r"(\d+) " + re.escape(what), out))


@pytest.mark.parametrize("settings", ["", GC])
def test_programs_that_shed_load_under_a_memory_fraction(settings, tmp_path):
    # Half of an 8 GiB device: programs run out of memory again and again,
    # catch it and go on; with the threshold, garbage collection runs above
    # 2.4 GiB. Given the fraction and the device's memory, verify applies
    # the limit and the collection as PyTorch does.
    files = oracle(tmp_path, 41 + len(settings), 100, settings, "--keep-going", "--fraction", "0.5",
                   env=SMALL_DEVICE)
    out = verify(files, *LIMIT, settings=settings)
    assert out.count("agrees with the recording") == 100
    assert counted(out, "oom checked") > 100  # several per program
    # 2.0's events carry their allocation's stack, not the stack that
    # released: its ladder's releases (all unused segments, as empty_cache()
    # without max_split_size_mb) cannot be told from empty_cache()'s.
    undecided = counted(out, "of all unused segments before a device request") if RELEASE < (2, 1) else 0
    assert counted(out, "by the retry ladder") + undecided > 0
    if settings:
        assert counted(out, "by garbage collection") > 0


def test_out_of_memory_under_a_memory_fraction_with_garbage_collection(tmp_path):
    files = oracle(tmp_path, 98, 30, GC, "--oom", "--fraction", "0.5", env=SMALL_DEVICE)
    out = verify(files, *LIMIT, settings=GC)
    assert " ".join(out.split()).count("1 oom checked") == 30
    assert counted(out, "by garbage collection") > 0
    a = subprocess.run([RESERVOIR, "advise", files[0]], capture_output=True, text=True, timeout=120)
    assert a.returncode == 0, a.stderr
    assert "at the out-of-memory error" in " ".join(a.stdout.split())


def test_without_the_fraction_garbage_collection_is_named_as_what_was_assumed(tmp_path):
    files = oracle(tmp_path, 97, 10, GC, "--keep-going", "--fraction", "0.5", env=SMALL_DEVICE)
    v = subprocess.run([RESERVOIR, "verify", *given(GC), *files], capture_output=True, text=True,
                       timeout=600)
    # Some programs' collections are not what verify assumes without the limit.
    assert v.returncode == 3, v.stdout
    assert "--memory-fraction and --device-memory" in " ".join(v.stdout.split())  # lines wrap at 100
    bad = subprocess.run([RESERVOIR, "verify", "--memory-fraction", "0.5", files[0]],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--memory-fraction: give --device-memory with it" in bad.stderr


# The snapshots reservoir writes as PyTorch's own allocator verify against the
# running release's rules, as PyTorch's own do: random programs, programs
# that run out of memory and programs that catch their errors and go on,
# under PyTorch's settings and reservoir's page policies, each told the
# device's memory (how far a map gets before the device refuses it decides
# what follows; reservoir's page policies map by what is free).
OWN = os.environ.get("RESERVOIR_EXPECT_OWN_ALLOCATOR") == "1"
SIMULATED_DEVICE = "81079MiB"  # the simulated device's memory when not set


@pytest.mark.skipif(not OWN, reason="no own-allocator library for this release (before 2.6)")
@pytest.mark.parametrize("settings", ["", "max_split_size_mb:64", "roundup_power2_divisions:4",
                                      "expandable_segments:True", "policy:native_paged",
                                      "policy:paging"])
def test_the_own_allocators_snapshots_verify(settings, tmp_path):
    seed = 50 + len(settings)
    # reservoir's own keys are read from RESERVOIR_ALLOC_CONF (PyTorch's
    # variable refuses them).
    ours = settings.startswith("policy:")
    conf = {"RESERVOIR_ALLOC_CONF": settings} if ours else {}
    torch_settings = "" if ours else settings
    plain = oracle(tmp_path / "plain", seed, 30, torch_settings, "--own", env=conf)
    out = verify(plain, "--device-memory", SIMULATED_DEVICE, settings=torch_settings)
    small = oracle(tmp_path / "oom", seed, 10, torch_settings, "--own", "--oom", env={**SMALL_DEVICE, **conf})
    small += oracle(tmp_path / "going", seed, 10, torch_settings, "--own", "--keep-going",
                    env={**SMALL_DEVICE, **conf})
    out += verify(small, "--device-memory", SMALL_DEVICE["RESERVOIR_SIMCUDA_MEMORY"], settings=torch_settings)
    assert out.count("agrees with the recording") == 50
    if "expandable" in settings or ours:
        assert counted(out, "segment_map and") > 50  # page maps checked
    if ours:
        assert out.count(f"{settings}'s pages: ") > 0


@pytest.mark.skipif(not OWN, reason="no own-allocator library for this release (before 2.6)")
def test_a_page_policys_recording_takes_the_devices_memory_from_its_errors(tmp_path):
    # Without --device-memory: a recording that ran out of memory says how
    # much the device had (the pages mapped and the free memory at the error).
    files = oracle(tmp_path, 5, 4, "", "--own", "--oom",
                   env={**SMALL_DEVICE, "RESERVOIR_ALLOC_CONF": "policy:native_paged"})
    out = verify(files)
    assert out.count("agrees with the recording") == 4
    assert " ".join(out.split()).count("the device's memory taken as 8.00 GiB (8589934592 bytes)") == 4


@pytest.mark.skipif(RELEASE < (2, 1), reason="expandable segments came with PyTorch 2.1")
def test_pytorchs_expandable_segments_through_errors_a_program_goes_on_after(tmp_path):
    # PyTorch maps an expandable segment's pages one by one and stops where
    # the device refuses: told the device's memory, verify follows it.
    settings = "expandable_segments:True"
    files = oracle(tmp_path, 74, 10, settings, "--keep-going", env=SMALL_DEVICE)
    out = verify(files, "--device-memory", SMALL_DEVICE["RESERVOIR_SIMCUDA_MEMORY"], settings=settings)
    assert out.count("agrees with the recording") == 10
