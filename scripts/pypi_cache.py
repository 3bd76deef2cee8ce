#!/usr/bin/env python3
"""Installs pinned PyPI packages into a cache outside the checkout, one
folder per requirements file (keyed by its name: torch-2.15.0), so that a
clean clone reuses them and a second run downloads nothing.

A file named wheelhouse-NAME.txt is a wheelhouse: its wheels are downloaded,
not installed, into the folder wheelhouse-NAME, for pip's --find-links (an
isolated build's requirements, a test environment's tools). They are
pure-Python wheels unless the file has a line "# pip download: OPTIONS"
(the Python version and platforms of another machine, say).

usage: pypi_cache.py REQUIREMENTS...    (prints the folders, one a line)

The cache is $RESERVOIR_PYPI_CACHE, else ~/.cache/reservoir/pypi. A folder
is complete when its .complete file holds the requirements it was made
from; anything else is made again (in a temporary folder, then renamed, so
that an interrupted install never passes for a complete one).
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("RESERVOIR_PYPI_CACHE") or str(Path.home() / ".cache/reservoir/pypi")
    return Path(root)


def install(requirements: Path) -> Path:
    name = requirements.stem.removeprefix("requirements-")
    wheelhouse = name.startswith("wheelhouse-")
    target = cache_root() / name
    wanted = requirements.read_text()
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == wanted:
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"pypi cache: {'downloading' if wheelhouse else 'installing'} {name} into {target} "
          f"(once{'; PyTorch is about 3 GB' if name.startswith('torch') else ''})", file=sys.stderr)
    common = ["--no-deps", "--no-cache-dir", "--disable-pip-version-check", "--quiet"]
    if wheelhouse:
        # Pure-Python wheels only, so that one wheelhouse serves every CPython,
        # unless the file names the machine the wheels are for.
        target_options = ["--platform", "any", "--implementation", "py", "--abi", "none"]
        for line in wanted.splitlines():
            if line.startswith("# pip download:"):
                target_options = line.split(":", 1)[1].split()
        command = ["download", "--only-binary=:all:", *target_options, *common, "--dest", str(partial)]
    else:
        command = ["install", *common, "--root-user-action=ignore", "--target", str(partial)]
    subprocess.run([sys.executable, "-m", "pip", *command, "-r", str(requirements)], check=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    marker.write_text(wanted)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    print(f"pypi cache: {name}: {time.monotonic() - start:.0f} s, {size / 1e9:.1f} GB installed",
          file=sys.stderr)
    return target


def main() -> None:
    for arg in sys.argv[1:]:
        print(install(Path(arg)))


if __name__ == "__main__":
    main()
