#!/usr/bin/env python3
"""tests/torch/pypi_run.py, the launcher of the tests that use the PyPI
cache's folders: a folder not installed stops the test with what to do,
before anything runs; library folders go on LD_LIBRARY_PATH in the order
given, sorted within each pattern, before what was there."""
import os
import subprocess
import sys
import tempfile

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch", "pypi_run.py")
failures = []


def check(condition, what):
    print(("ok    " if condition else "FAIL  ") + what)
    if not condition:
        failures.append(what)


with tempfile.TemporaryDirectory() as root:
    complete = os.path.join(root, "cuda12-libs-12.8")
    for lib in ("nvidia/cublas/lib", "nvidia/cudnn/lib", "nvidia/nccl/lib"):
        os.makedirs(os.path.join(complete, lib))
    open(os.path.join(complete, ".complete"), "w").close()
    partial = os.path.join(root, "torch-only-2.9.1")  # interrupted: no .complete
    os.makedirs(partial)
    env = dict(os.environ, LD_LIBRARY_PATH="/before")

    r = subprocess.run([sys.executable, RUN, "--needs", complete, "--needs", partial, "--",
                        "sh", "-c", "echo ran"], capture_output=True, text=True, env=env)
    check(r.returncode == 2, f"a folder without .complete: exit 2 (got {r.returncode})")
    check("ran" not in r.stdout, "the command did not run")
    check(f"{partial} is not installed" in r.stderr and "pypi_torch-only-2.9.1" in r.stderr,
          f"the message names the folder and the fixture that installs it: {r.stderr.strip()!r}")
    check(complete not in r.stderr, "the complete folder is not named")

    r = subprocess.run([sys.executable, RUN, "--needs", complete,
                        "--lib-path", os.path.join(complete, "nvidia/cudnn/lib"),
                        "--lib-path", os.path.join(complete, "nvidia/*/lib"), "--",
                        "sh", "-c", "echo $LD_LIBRARY_PATH"], capture_output=True, text=True, env=env)
    expected = ":".join([os.path.join(complete, "nvidia/cudnn/lib")] +
                        [os.path.join(complete, f"nvidia/{p}/lib") for p in ("cublas", "cudnn", "nccl")] +
                        ["/before"])
    check(r.returncode == 0 and r.stdout.strip() == expected,
          f"LD_LIBRARY_PATH in order: {r.stdout.strip()!r} (exit {r.returncode}, {r.stderr.strip()!r})")

    r = subprocess.run([sys.executable, RUN, "--lib-path", os.path.join(root, "absent/*/lib"), "--", "true"],
                       capture_output=True, text=True)
    check(r.returncode == 2 and "no library folder matches" in r.stderr,
          f"a pattern that matches nothing: exit 2, said ({r.returncode}, {r.stderr.strip()!r})")

    r = subprocess.run([sys.executable, RUN, "--needs", complete], capture_output=True, text=True)
    check(r.returncode == 2 and "no command" in r.stderr, f"no command: a usage error ({r.returncode})")

if failures:
    sys.exit(f"{len(failures)} check(s) failed")
