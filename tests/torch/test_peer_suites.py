"""scripts/peer_suites.py on a suite of the project's own (two tests in
PyTorch's test_cuda.py layout): it runs each test both ways, under PyTorch's
allocator and under reservoir's (RESERVOIR_TORCH_ALLOCATOR=own), prints the
table and the counts, and names what passes only the first way, with exit 1.

Environment (ctest): LD_PRELOAD is <build>/simcuda/libcudart.so.13; the
PyPI cache holds this PyTorch and the suites' requirements (make deps).
"""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.dirname(os.path.dirname(os.environ["LD_PRELOAD"].split(":")[0]))

SUITE = '''
import torch
from torch.testing._internal.common_utils import run_tests, TestCase


class TestCuda(TestCase):
    def test_memory_allocated_counts_a_tensor(self):
        x = torch.empty(1024, dtype=torch.uint8, device="cuda")
        self.assertEqual(torch.cuda.memory_allocated(), 1024)

    def test_memory_backend_is_native(self):
        torch.empty(1, device="cuda")
        self.assertEqual(torch.cuda.get_allocator_backend(), "native")

    def test_unrelated_name(self):
        pass


if __name__ == "__main__":
    run_tests()
'''


def test_the_table_counts_and_differences_of_a_suite(tmp_path):
    suite = tmp_path / "test_cuda.py"
    suite.write_text(textwrap.dedent(SUITE))
    release = torch.__version__.split("+")[0]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "peer_suites.py"), "--pytorch", str(suite),
                        "--release", release, "--build", BUILD, "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    # The default selection takes the allocator's tests by name: not the third.
    assert f"PyTorch {release}: 2 tests of {suite} selected" in lines
    row = [x for x in lines if "test_memory_allocated_counts_a_tensor" in x][0].split()
    assert row[1:] == ["pass", "pass"]
    row = [x for x in lines if "::test_memory_backend_is_native" in x and "differs" in x][0].split()
    assert row[1:3] == ["pass", "fail"]
    assert "passes: PyTorch's allocator 2 of 2, reservoir's 1" in lines
    assert any("test_memory_backend_is_native passes under PyTorch's allocator and not under reservoir's" in x
               for x in lines)
    import json
    report = json.loads((tmp_path / "out.json").read_text())["pytorch"]
    assert report["passes"] == {"pytorch": 2, "reservoir": 1}
    assert [d.split("::")[-1] for d in report["differ"]] == ["test_memory_backend_is_native"]


def test_bad_arguments_say_what_is_wrong(tmp_path):
    script = os.path.join(ROOT, "scripts", "peer_suites.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give --pytorch, --tms or both" in r.stderr
    r = subprocess.run([sys.executable, script, "--tms", str(tmp_path / "nowhere")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "nowhere does not exist" in r.stderr
