"""PyTorch's own allocator as the oracle: thousands of random programs per
release (oracle.py), each snapshot verified by reservoir, under each
setting; programs driven into out-of-memory, whose dumps verify agrees with
and advise explains. Run by ctest once per installed release (see
test_simcuda_torch.py for the environment)."""
import os
import subprocess
import sys

import pytest

RESERVOIR = os.environ["RESERVOIR"]
ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oracle.py")
PROGRAMS = 300

SETTINGS = ["", "max_split_size_mb:64", "roundup_power2_divisions:4",
            "roundup_power2_divisions:[256:1,512:2,>:8]", "expandable_segments:True",
            "large_segment_size_mb:40", "garbage_collection_threshold:0.6,max_split_size_mb:128"]


def oracle(out, seed, programs, settings, *extra, env=None):
    r = subprocess.run([sys.executable, "-W", "ignore", ORACLE, str(out), str(seed), str(programs),
                        *extra],
                       env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": settings, **(env or {})},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    files = sorted(str(out / f) for f in os.listdir(out))
    assert len(files) == programs
    return files


def verify(files):
    v = subprocess.run([RESERVOIR, "verify", *files], capture_output=True, text=True, timeout=600)
    lines = [l for l in v.stdout.splitlines() if not l.startswith(" ")]
    disagreements = [l for l in lines if "agrees with the recording" not in l]
    assert v.returncode == 0 and not disagreements, "\n".join(disagreements[:5]) + v.stdout[-3000:]
    return v.stdout


@pytest.mark.parametrize("settings", SETTINGS)
def test_verify_agrees_with_every_program(settings, tmp_path):
    seed = 1 + SETTINGS.index(settings)
    out = verify(oracle(tmp_path, seed, PROGRAMS, settings))
    assert out.count("agrees with the recording") == PROGRAMS


def test_out_of_memory_dumps_verify_and_advise_explains_them(tmp_path):
    files = oracle(tmp_path, 99, 40, "", "--oom", env={"RESERVOIR_SIMCUDA_MEMORY": "8GiB"})
    out = verify(files)
    assert out.count("1 oom checked") == 40
    for f in files[:10]:
        a = subprocess.run([RESERVOIR, "advise", f], capture_output=True, text=True, timeout=120)
        assert a.returncode == 0, a.stderr
        assert "at the first out-of-memory error" in a.stdout
        assert "failed request" in a.stdout
        assert "(recorded with the oom)" in a.stdout
