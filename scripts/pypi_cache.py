#!/usr/bin/env python3
"""Installs pinned PyPI packages into a cache outside the checkout, one
folder per requirements file (keyed by its name: torch-2.15.0), so that a
clean clone reuses them and a second run downloads nothing.

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
    target = cache_root() / name
    wanted = requirements.read_text()
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == wanted:
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"pypi cache: installing {name} into {target} (downloaded once; PyTorch is about 3 GB)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir",
                    "--disable-pip-version-check", "--root-user-action=ignore", "--quiet", "--target", str(partial),
                    "-r", str(requirements)], check=True)
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
