#!/usr/bin/env python3
"""Other projects' own test suites against reservoir, on the simulated CUDA
device: PyTorch's allocator and memory tests (test/test_cuda.py), and its
tests of the paths that ask the allocator for workspaces (convolutions,
attention backends, sorting; any test file given), under
PyTorch's allocator and under reservoir's (RESERVOIR_TORCH_ALLOCATOR=own),
and torch_memory_saver's suite (its test/ folder) against the real package
and against reservoir's drop-in (reservoir.memory_saver). Every test runs in
a process of its own, as PyTorch's runner does after a failure; the script
prints a table of both columns, the counts, and every test that passes the
original's way and fails reservoir's.

The suites are not part of this repository: fetch them yourself, outside
it (docs/integrations.md, "Other projects' suites"):

  test_cuda.py   PyTorch's test/test_cuda.py at the release under test
                 (https://github.com/pytorch/pytorch/blob/v2.15.0/test/test_cuda.py)
  others         any of its test files at that release: test/nn/test_convolution.py,
                 test/test_transformers.py, test/test_sort_and_select.py, ...
  tms/test       torch_memory_saver's test/ at the commit whose Python files
                 equal the wheel in the PyPI cache (0.0.10)

usage: scripts/peer_suites.py [--pytorch TEST_FILE ...] [--tms TEST_DIR]
           [--release 2.15.0] [--build build] [-k REGEX] [--jobs 2]
           [--timeout 600] [--batch] [--json OUT]
       scripts/peer_suites.py --device as-is --pytorch TEST_FILE ...
           [--package DIR] [--site DIR ...] [--python PY] [--batch] ...

It needs `make build` (the simulated device, the Python package) and
PyTorch, torch_memory_saver and the suites' own requirements (expecttest and
psutil) in the PyPI cache: `make deps-all`, or the tests that run it. With `--device as-is` it runs
PyTorch's tests on the CUDA device the environment has (a GPU: the GPU
bundle's pytorch_tests step), with the PyTorch of --python (default: this
one), reservoir from --package (a folder the package is installed in) and
what --site adds to the import path; nothing of the PyPI cache or the build.
--batch runs the selected tests in one process per way and every test that
did not pass there again in a process of its own (PyTorch's runner's way
after a failure), which is much faster than a process per test. Exit status:
0 when reservoir passes every test the original passes (private-attribute
tests apart), 1 otherwise, 2 for bad arguments.
"""
import argparse
import ast
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# PyTorch's tests about the caching allocator, memory statistics, snapshots,
# settings, memory pools, out-of-memory, pinned and managed memory.
PYTORCH_SELECTION = (r"memory|alloc|mempool|mem_pool|snapshot|oom|out_of_memory|pinned|caching|cache|"
                     r"fraction|expandable|record_stream|register|managed|max_split|garbage|fuzz|"
                     r"cublas_workspace|host_memory|set_per_process|graph_.*pool|pool|"
                     r"graph_(two|three)_successive|graph_concurrent_replay")
# Classes whose every test is about the allocator: snapshots and settings,
# graph pools' checkpoints, pinned memory under capture, memory pools.
PYTORCH_CLASSES = re.compile(r"^(TestCudaMallocAsync|TestBlockStateAbsorption|TestCachingHostAllocatorCudaGraph|"
                             r"TestMemPool)$")

# Tests of torch_memory_saver's suite that patch the package's private
# module attributes: not part of the drop-in's contract
# (docs/integrations.md).
PRIVATE_ATTRIBUTES = ("is_xpu", "get_binary_path_from_package", "hooks.mode_preload", "_binary_wrapper",
                      "binary_wrapper")

OUTCOME = re.compile(r"\b(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)\b")


def outcome_of(returncode, output):
    counts = {}
    for n, word in OUTCOME.findall(output):
        counts[word.rstrip("s") if word == "errors" else word] = int(n)
    if returncode == 124:
        return "timeout"
    if counts.get("failed") or counts.get("error"):
        return "fail"
    if counts.get("passed") or counts.get("xfailed"):
        return "pass"
    if counts.get("skipped"):
        return "skip"
    return "fail" if returncode != 0 else "none"


def cache_root():
    """The PyPI cache (scripts/pypi_cache.py), for the simulated device's runs
    only: the GPU bundle carries this script without it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from pypi_cache import cache_root as root
    return root()


def run_one(test_id, cwd, env, timeout):
    start = time.monotonic()
    try:
        r = subprocess.run([sys.executable if env.get("PEER_PYTHON") is None else env["PEER_PYTHON"],
                            "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", test_id],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code, output = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
    return outcome_of(code, output), output, time.monotonic() - start


def run_batch(ids, cwd, env, timeout, tag):
    """Runs `ids` in one pytest process; returns {id: outcome} for the tests
    its JUnit report names (a test the process never reached is absent)."""
    report = Path(cwd) / f"junit-{tag}.xml"
    report.unlink(missing_ok=True)
    try:
        subprocess.run([env["PEER_PYTHON"], "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={report}"] + ids, cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    by_name = {tuple(i.split("::")[-2:]): i for i in ids}
    outcomes = {}
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        return outcomes
    for case in root.iter("testcase"):
        key = (case.get("classname", "").split(".")[-1], case.get("name", ""))
        if key not in by_name:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "fail"
        elif case.find("skipped") is not None:
            outcome = "skip"
        else:
            outcome = "pass"
        outcomes[by_name[key]] = outcome
    return outcomes


def collect(path, cwd, env, selection, classes=None):
    """The tests of `path` whose name matches `selection`, or whose class
    matches `classes`."""
    r = subprocess.run([env["PEER_PYTHON"], "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"peer_suites: no tests collected from {path}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    pattern = re.compile(selection)
    return [i for i in ids if pattern.search(i.split("::")[-1].split("[")[0])
            or (classes is not None and len(i.split("::")) > 2 and classes.match(i.split("::")[-2]))]


def private_tests(test_dir):
    """Names of test functions whose body patches a private attribute of the package."""
    names = set()
    for f in Path(test_dir).glob("test_*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = ast.get_source_segment(f.read_text(), node) or ""
                helpers = re.findall(r"\b(_\w+)\(", text)
                for h in helpers:  # a helper the test calls, in the same file
                    for other in ast.walk(tree):
                        if isinstance(other, ast.FunctionDef) and other.name == h:
                            text += ast.get_source_segment(f.read_text(), other) or ""
                if "patch" in text and any(p in text for p in PRIVATE_ATTRIBUTES):
                    names.add(node.name)
    return names


def base_env(args, site_dirs):
    """This process's environment without allocator settings, importing from
    site_dirs; on the simulated device, with it preloaded."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RESERVOIR_TORCH_ALLOCATOR", "RESERVOIR_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                        "PYTORCH_ALLOC_CONF")}
    env.update({"PYTHONPATH": ":".join(str(s) for s in site_dirs), "PEER_PYTHON": args.python,
                "PYTHONDONTWRITEBYTECODE": "1"})
    if args.device == "as-is":
        return env
    simcuda = Path(args.build) / "simcuda" / "libcudart.so.13"
    if not simcuda.exists():
        raise SystemExit(f"peer_suites: {simcuda} is missing: run make build first")
    env.update({"LD_PRELOAD": str(simcuda.resolve()), "RESERVOIR_SIMCUDA_KERNELS": "skip",
                # the driver and NVML beside the runtime, for what loads them by name
                "LD_LIBRARY_PATH": str(simcuda.resolve().parent), "PEER_PYTHON": "/usr/bin/python3"})
    return env


def table(title, columns, rows, results):
    width = max([len(r) for r in rows] + [20])
    print(f"\n== {title}")
    print(f"{'test':<{width}}  {columns[0]:>10}  {columns[1]:>10}")
    for r in rows:
        a, b = results[r]
        mark = "  <-- differs" if a == "pass" and b != "pass" else ""
        print(f"{r:<{width}}  {a:>10}  {b:>10}{mark}")


def run_pair(ids, cwd, envs, args):
    """Each test both ways: {id: [outcome, outcome]} and the outputs of the
    runs of a test alone. With --batch, first all of them in one process per
    way; a test that did not pass there runs again alone."""
    results = {i: [None, None] for i in ids}
    outputs = {}
    alone = [(i, k) for i in ids for k in range(len(envs))]
    if args.batch:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(args.jobs, len(envs))) as pool:
            batches = list(pool.map(lambda k: run_batch(ids, cwd, envs[k], args.timeout * 4, k), range(len(envs))))
        for k, outcomes in enumerate(batches):
            for i, outcome in outcomes.items():
                if outcome in ("pass", "skip"):
                    results[i][k] = outcome
        alone = [(i, k) for i, k in alone if results[i][k] is None]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, i, cwd, envs[k], args.timeout): (i, k) for i, k in alone}
        for fut in concurrent.futures.as_completed(futures):
            i, k = futures[fut]
            outcome, output, _ = fut.result()
            results[i][k] = outcome
            outputs[(i, k)] = output
    return results, outputs


def release_of(python, env):
    r = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"peer_suites: {python} cannot import torch:\n{r.stderr[-2000:]}")
    return r.stdout.strip().split("+")[0]


def pytorch_suite(args, report):
    """Each of PyTorch's test files given (--pytorch, repeatable) both ways;
    report["pytorch"] holds them all (test ids begin with the file's name),
    with each file's counts under "files"."""
    if args.device == "as-is":
        sites = [Path(s).resolve() for s in args.site]
        package = Path(args.package).resolve()
    else:
        cache = cache_root()
        sites = [cache / f"torch-{args.release}", cache / "peer-suites"]
        for site in sites:
            if not (site / ".complete").exists():
                raise SystemExit(f"peer_suites: {site} is not installed: run make deps-all")
        package = Path(args.package or Path(args.build) / "python").resolve()
    work = Path(tempfile.mkdtemp(prefix="reservoir-peer-pytorch-"))
    # The reservoir package and its start-up hook (as the installed wheel's .pth).
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(package)!r})\n")
    plain = base_env(args, sites)
    ours = dict(base_env(args, [hook] + sites), RESERVOIR_TORCH_ALLOCATOR="own")
    if args.device == "as-is":
        args.release = release_of(args.python, plain)
    merged = {"release": args.release, "results": {}, "differ": [], "passes": {"pytorch": 0, "reservoir": 0},
              "files": {}}
    for given in args.pytorch:
        test_file = Path(given).resolve()
        name = test_file.name
        if name in merged["files"]:
            raise SystemExit(f"peer_suites: two test files named {name}: give each once")
        shutil.copy(test_file, work / name)
        # test_cuda.py: the allocator's tests by default; another file: all of its tests.
        if args.k:
            selection, classes = args.k, None
        elif name == "test_cuda.py":
            selection, classes = PYTORCH_SELECTION, PYTORCH_CLASSES
        else:
            selection, classes = ".", None
        ids = collect(name, work, plain, selection, classes)
        print(f"PyTorch {args.release}: {len(ids)} tests of {test_file} selected", flush=True)
        results, outputs = run_pair(ids, work, [plain, ours], args)
        names = sorted(results)
        table(f"PyTorch {args.release}'s {name}", ("PyTorch", "reservoir"), names, results)
        differ = [n for n in names if results[n][0] == "pass" and results[n][1] != "pass"]
        counts = {side: sum(results[n][k] == "pass" for n in names) for k, side in enumerate(("pytorch", "reservoir"))}
        print(f"\npasses: PyTorch's allocator {counts['pytorch']} of {len(names)}, reservoir's {counts['reservoir']}")
        for n in differ:
            print(f"\n-- {n} passes under PyTorch's allocator and not under reservoir's:")
            print("\n".join(outputs[(n, 1)].splitlines()[-25:]))
        merged["results"].update(results)
        merged["differ"] += differ
        for side in counts:
            merged["passes"][side] += counts[side]
        merged["files"][name] = dict(counts, tests=len(names))
    report["pytorch"] = merged
    shutil.rmtree(work, ignore_errors=True)
    return not merged["differ"]


def tms_suite(args, report):
    cache = cache_root()
    sites = sorted(cache.glob("torch_memory_saver-*/.complete"))
    if not sites:
        raise SystemExit("peer_suites: torch_memory_saver is not in the PyPI cache: run make deps-all")
    tms_site = sites[-1].parent
    torch_site = cache / f"torch-{args.release}"
    tools = cache / "peer-suites"
    test_dir = Path(args.tms).resolve()
    work = Path(tempfile.mkdtemp(prefix="reservoir-peer-tms-"))
    shutil.copytree(test_dir, work / "test")
    # The drop-in under the package's name; the suite's helpers
    # (testing_utils, utils: memory readings through PyTorch and NVML) are
    # the package's own.
    shim = work / "shim" / "torch_memory_saver"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "from reservoir.memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver  # noqa\n")
    # The module the class is defined in, which the suite imports it from.
    (shim / "entrypoint.py").write_text("from reservoir.memory_saver import TorchMemorySaver  # noqa\n")
    for helper in ("testing_utils.py", "utils.py"):
        shutil.copy(tms_site / "torch_memory_saver" / helper, shim / helper)
    python_dir = Path(args.build).resolve() / "python"
    real = dict(base_env(args, [tms_site, torch_site, tools]), RESERVOIR_SIMCUDA_DEVICES="2")
    ours = dict(base_env(args, [shim.parent, python_dir, torch_site, tools]), RESERVOIR_SIMCUDA_DEVICES="2")
    ids = collect("test", work, real, args.k or ".")
    private = private_tests(work / "test")
    print(f"torch_memory_saver ({tms_site.name}): {len(ids)} tests of {test_dir}", flush=True)
    results, outputs = run_pair(ids, work, [real, ours], args)
    names = sorted(results)
    table("torch_memory_saver's suite", ("package", "drop-in"), names, results)
    is_private = {n: n.split("::")[-1].split("[")[0] in private for n in names}
    differ = [n for n in names if results[n][0] == "pass" and results[n][1] != "pass" and not is_private[n]]
    counts = {side: sum(results[n][k] == "pass" for n in names) for k, side in enumerate(("package", "drop_in"))}
    print(f"\npasses: the package {counts['package']} of {len(names)}, the drop-in {counts['drop_in']}; "
          f"{sum(is_private.values())} patch private attributes (not compared): "
          + ", ".join(n.split("::")[-1] for n in names if is_private[n]))
    for n in differ:
        print(f"\n-- {n} passes with the package and not with the drop-in:")
        print("\n".join(outputs[(n, 1)].splitlines()[-25:]))
    report["tms"] = {"results": results, "differ": differ, "passes": counts,
                     "private": [n for n in names if is_private[n]]}
    shutil.rmtree(work, ignore_errors=True)
    return not differ


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pytorch", action="append",
                   help="a PyTorch test file, a local copy (test/test_cuda.py: its allocator tests by default; "
                        "another file: all its tests); repeatable")
    p.add_argument("--tms", help="torch_memory_saver's test/ folder (a local copy)")
    p.add_argument("--release", default="2.15.0", help="the PyTorch release in the PyPI cache (2.15.0)")
    p.add_argument("--build", default=str(ROOT / "build"), help="the CMake build folder (build)")
    p.add_argument("-k", help="a regular expression the test names must match (default: the allocator's tests)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=600, help="seconds per test and way")
    p.add_argument("--batch", action="store_true",
                   help="all tests in one process per way first; those that do not pass, again alone")
    p.add_argument("--device", choices=("simulated", "as-is"), default="simulated",
                   help="the simulated CUDA device (default), or the device the environment has (a GPU)")
    p.add_argument("--python", default=sys.executable, help="with --device as-is: the Python with PyTorch")
    p.add_argument("--package", help="the folder reservoir's package is installed in (default: BUILD/python)")
    p.add_argument("--site", action="append", default=[],
                   help="with --device as-is: a folder to import from (repeatable)")
    p.add_argument("--json", help="write every outcome here")
    args = p.parse_args()
    if not args.pytorch and not args.tms:
        p.error("give --pytorch, --tms or both")
    if args.device == "as-is" and (args.tms or not args.package):
        p.error("--device as-is runs PyTorch's tests (--pytorch) and needs --package")
    for path in (args.pytorch or []) + [args.tms]:
        if path and not Path(path).exists():
            p.error(f"{path} does not exist")
    report = {}
    ok = True
    if args.pytorch:
        ok = pytorch_suite(args, report) and ok
    if args.tms:
        ok = tms_suite(args, report) and ok
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
