"""scripts/peer_suites.py on a suite of the project's own (two tests in
PyTorch's test_cuda.py layout): it runs each test both ways, under PyTorch's
allocator and under reservoir's (RESERVOIR_TORCH_ALLOCATOR=own), prints the
table and the counts, and names what passes only the first way, with exit 1.

Environment (ctest): LD_PRELOAD is <build>/simcuda/libcudart.so.13; the
PyPI cache holds this PyTorch and the suites' requirements (the test's fixtures).
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

# Another of PyTorch's test files (a sort's workspace through CUB, in the
# device-type layout its test_sort_and_select.py has): every test of it is
# taken, whatever its name.
SORT_SUITE = '''
import torch
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.testing._internal.common_device_type import instantiate_device_type_tests


class TestSortAndSelect(TestCase):
    def test_stride_of_a_sorted_view(self, device):
        values, indices = torch.randn(3, 5, device=device)[:, 0].sort()
        self.assertEqual(values.stride(), (1,))
        self.assertEqual(indices.shape, (3,))


instantiate_device_type_tests(TestSortAndSelect, globals(), only_for=("cuda",))

if __name__ == "__main__":
    run_tests()
'''


def test_the_table_counts_and_differences_of_a_suite(tmp_path):
    suite = tmp_path / "test_cuda.py"
    suite.write_text(textwrap.dedent(SUITE))
    (tmp_path / "more").mkdir()
    sort_suite = tmp_path / "more" / "test_sort_and_select.py"
    sort_suite.write_text(SORT_SUITE)
    release = torch.__version__.split("+")[0]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "peer_suites.py"), "--pytorch", str(suite),
                        "--pytorch", str(sort_suite), "--release", release, "--build", BUILD,
                        "--json", str(tmp_path / "out.json")],
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
    assert f"PyTorch {release}: 1 tests of {sort_suite} selected" in lines
    row = [x for x in lines if "::test_stride_of_a_sorted_view_cuda" in x][0].split()
    assert row[1:] == ["pass", "pass"]
    assert "passes: PyTorch's allocator 1 of 1, reservoir's 1" in lines
    assert any("test_memory_backend_is_native passes under PyTorch's allocator and not under reservoir's" in x
               for x in lines)
    import json
    report = json.loads((tmp_path / "out.json").read_text())["pytorch"]
    assert report["passes"] == {"pytorch": 3, "reservoir": 2}
    assert report["files"] == {"test_cuda.py": {"pytorch": 2, "reservoir": 1, "tests": 2},
                               "test_sort_and_select.py": {"pytorch": 1, "reservoir": 1, "tests": 1}}
    assert [d.split("::")[-1] for d in report["differ"]] == ["test_memory_backend_is_native"]
    assert sorted(k.split("::")[0] for k in report["results"]) == ["test_cuda.py", "test_cuda.py",
                                                                   "test_sort_and_select.py"]


def test_the_gpu_bundles_way_on_the_device_it_is_given(tmp_path):
    """--device as-is (the GPU bundle's pytorch_tests step): PyTorch and the
    suite's requirements from --site, reservoir from --package, the device
    the environment has (here LD_PRELOAD's simulated one); --batch runs each
    way's tests in one process and the one that fails there again alone."""
    suite = tmp_path / "test_cuda.py"
    suite.write_text(textwrap.dedent(SUITE))
    sites = [p for p in os.environ["PYTHONPATH"].split(":") if os.path.isdir(os.path.join(p, "torch"))]
    tools = os.path.join(os.path.dirname(sites[0]), "peer-suites")
    argv = [sys.executable, os.path.join(ROOT, "scripts", "peer_suites.py"), "--device", "as-is",
            "--pytorch", str(suite), "--package", os.path.join(BUILD, "python"), "--site", sites[0],
            "--site", tools, "--batch", "--jobs", "1", "--json", str(tmp_path / "out.json")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RESERVOIR_SIMCUDA_KERNELS"] = "skip"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    release = torch.__version__.split("+")[0]
    assert f"PyTorch {release}: 2 tests of {suite} selected" in r.stdout.splitlines()
    import json
    report = json.loads((tmp_path / "out.json").read_text())["pytorch"]
    assert report["release"] == release
    assert report["passes"] == {"pytorch": 2, "reservoir": 1}
    assert {k.split("::")[-1]: v for k, v in report["results"].items()} == {
        "test_memory_allocated_counts_a_tensor": ["pass", "pass"],
        "test_memory_backend_is_native": ["pass", "fail"]}
    # The failure's output is the test's own run alone, shown under its name.
    assert "test_memory_backend_is_native passes under PyTorch's allocator and not under reservoir's" in r.stdout
    assert "AssertionError" in r.stdout.split("not under reservoir's:")[1]
    # Without --package the way in is not known.
    r = subprocess.run(argv[:argv.index("--package")] + ["--batch"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and "--device as-is runs PyTorch's tests (--pytorch) and needs --package" in r.stderr


def test_bad_arguments_say_what_is_wrong(tmp_path):
    script = os.path.join(ROOT, "scripts", "peer_suites.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "give --pytorch, --tms or both" in r.stderr
    r = subprocess.run([sys.executable, script, "--tms", str(tmp_path / "nowhere")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "nowhere does not exist" in r.stderr
