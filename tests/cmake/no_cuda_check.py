"""A build without CUDA's headers must register every test that does not
need them: compares `ctest -N` of a build with the CUDA backends and one
configured with RESERVOIR_CUDA=OFF. The tests only the first may have are the
CUDA backends' (on the fake CUDA: names with "Cuda"), the LD_PRELOAD
interposer's (which needs CUDA's headers for the signatures it intercepts:
names starting with "preload_") and the simulated CUDA device's, built from
CUDA's headers (simcuda_*, and torch_<release>_<file>, an entry per test
file of a release installed whole, torch_<release>_release and
torch_<release>_release_oracle, which run PyTorch on it,
vllm-<release>_sleep, which runs vLLM on it, and the PyPI folders
only those use: pypi_* fixtures, each registered where a test requires it,
are left out of the comparison, make_test_downloads, which counts those
folders, and pip_install, pip_install_cpythons and readme_sections, which run PyTorch on the
device); and the instruction budgets, which hold for make test's optimized
build only (the no-CUDA build is unoptimized, without benchmarks). Every
other test must be in both.

Usage: no_cuda_check.py CUDA_BUILD_DIR NO_CUDA_BUILD_DIR
"""
import re
import subprocess
import sys


def registered(build):
    out = subprocess.run(["ctest", "-N"], cwd=build, capture_output=True, text=True, check=True).stdout
    # A parameterized test's name ends with its parameter's printout, which
    # can hold addresses: only the name itself is compared.
    names = {n.split("  # GetParam()")[0].strip() for n in re.findall(r"Test\s+#\d+: (.+)$", out, re.M)}
    if not names:
        sys.exit(f"no tests registered in {build}")
    return names


# Registered only in make test's optimized build (docs/benchmarks.md), and
# where the benchmarks are built (the no-CUDA build builds none).
OPTIMIZED_BUILD_ONLY = {"instruction_budget", "documented_benchmarks"}


def cuda_only(name):
    return (name in ("make_test_downloads", "pip_install", "pip_install_cpythons", "readme_sections")
            or "Cuda" in name or name.startswith("preload_") or name.startswith("simcuda_")
            or re.fullmatch(r"torch_[0-9.]+_[a-z_]+", name) is not None
            or re.fullmatch(r"vllm-[0-9.]+_sleep", name) is not None)


with_cuda, without = registered(sys.argv[1]), registered(sys.argv[2])
missing = sorted(n for n in with_cuda - without
                 if not cuda_only(n) and n not in OPTIMIZED_BUILD_ONLY and not n.startswith("pypi_"))
unexpected = sorted(without - with_cuda)
leaked = sorted(n for n in without if cuda_only(n))
print(f"{len(with_cuda)} tests with CUDA's headers, {len(without)} without; "
      f"{len(with_cuda - without)} need them")
for what, names in (("missing without CUDA's headers", missing),
                    ("only without CUDA's headers", unexpected),
                    ("CUDA tests registered without CUDA's headers", leaked)):
    for n in names:
        print(f"{what}: {n}")
if missing or unexpected or leaked:
    sys.exit(1)
if not any(cuda_only(n) for n in with_cuda):
    sys.exit("the build with CUDA's headers registered no CUDA test: was it configured with them?")
print("every test that needs no CUDA headers is registered without them")
