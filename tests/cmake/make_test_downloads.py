#!/usr/bin/env python3
"""What `make test` downloads from PyPI on a fresh machine stays within its
budget: the build's folders, and the PyPI cache's folders its tests require
(ctest fixtures pypi_*, cmake/PyPIFolders.cmake), for whichever release the
commit chooses beside the fixed ones, the costliest choice counted.

Reads the selection from `ctest --show-only=json-v1` with make test's label
filter, and each folder's download from tests/cmake/pypi_downloads.json: a
folder without a figure there fails the check (a new pin needs its size).

usage: make_test_downloads.py BUILD_DIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# make test's selection (Makefile).
MAKE_TEST = ["-LE", "torch_extra|pypi"]


def selection(build, *filters):
    out = subprocess.run(["ctest", "--show-only=json-v1", *filters], cwd=build, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)["tests"]


def fixtures_of(test):
    return {f.removeprefix("pypi_") for f in prop_of(test, "FIXTURES_REQUIRED", []) if f.startswith("pypi_")}


def prop_of(test, name, default):
    for prop in test.get("properties", []):
        if prop["name"] == name:
            return prop["value"]
    return default


def labels_of(test):
    return set(prop_of(test, "LABELS", []))


def environment_of(test):
    return prop_of(test, "ENVIRONMENT", [])


def release_of(name):
    """torch_2.10.0_release -> (2, 10, 0)"""
    return tuple(int(x) for x in name.split("_")[1].split("."))


def main() -> int:
    build = sys.argv[1]
    data = json.load(open(os.path.join(HERE, "pypi_downloads.json")))
    sizes, budget = data["fixtures"], data["budget_bytes"]
    built = sum(data["build"].values())
    tests = selection(build, *MAKE_TEST)
    if not tests:
        sys.exit(f"make test selects no test in {build}")
    every = selection(build)
    unknown = sorted({f for t in every for f in fixtures_of(t)} - set(sizes))
    if unknown:
        print(f"no download size in tests/cmake/pypi_downloads.json for {', '.join(unknown)}")
        return 1
    # The releases run alone (torch_release tests): make test runs the
    # oldest with reservoir's own allocator on every commit, and one other
    # the commit chooses; the costliest choice is what is counted.
    # (Each release's oracle runs as a test of its own beside it, with the same folders.)
    releases = {t["name"]: t for t in every if "torch_release" in labels_of(t) and t["name"].endswith("_release")}
    own = [n for n, t in releases.items() if "RESERVOIR_EXPECT_OWN_ALLOCATOR=1" in environment_of(t)]
    oldest_own = min(own, key=release_of)
    chosen = [t["name"] for t in tests if t["name"] in releases and t["name"] != oldest_own]
    if len(chosen) != 1:
        print(f"make test runs {len(chosen)} releases beside {oldest_own}, not one: {chosen}")
        return 1
    needed, fixed = set(), set()
    for t in tests:
        needed |= fixtures_of(t)
        if t["name"] not in (chosen[0], chosen[0] + "_oracle"):
            fixed |= fixtures_of(t)
    now = built + sum(sizes[f] for f in needed)
    base = built + sum(sizes[f] for f in fixed)
    worst, costliest = max((base + sum(sizes[f] for f in fixtures_of(t) - fixed), name)
                           for name, t in releases.items() if name != oldest_own)
    print(f"make test requires {len(needed)} folders from PyPI: {', '.join(sorted(needed))}")
    print(f"this commit ({chosen[0]} chosen): {now / 1e9:.2f} GB, the build's {built / 1e9:.2f} GB included")
    print(f"the costliest choice ({costliest}): {worst / 1e9:.2f} GB; the budget: {budget / 1e9:.2f} GB")
    if max(now, worst) > budget:
        print("make test downloads more than its budget")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
