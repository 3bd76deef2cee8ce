#!/usr/bin/env python3
"""Runs a test's command with folders of the PyPI cache (scripts/pypi_cache.py)
it needs: each must be complete (ctest's fixture pypi_NAME installs it
first: cmake/PyPIFolders.cmake); the CUDA libraries' folders they hold go
on LD_LIBRARY_PATH, found when the test runs, since the folders may not
exist when CMake configures.

usage: pypi_run.py [--needs FOLDER]... [--lib-path PATTERN]... -- COMMAND...

FOLDER: a path in the cache; PATTERN: a glob of library folders
(CACHE/cuda12-libs-12.8/nvidia/*/lib), in order, sorted within each.
"""
import argparse
import glob
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--needs", action="append", default=[], metavar="FOLDER")
    parser.add_argument("--lib-path", action="append", default=[], metavar="PATTERN")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    missing = [f for f in args.needs if not os.path.isfile(os.path.join(f, ".complete"))]
    if missing:
        for folder in missing:
            name = os.path.basename(folder)
            print(f"pypi_run: {folder} is not installed (or was interrupted): ctest installs it with the "
                  f"test pypi_{name} before the tests that need it; by hand, scripts/pypi_cache.py with "
                  f"the requirements file named {name}", file=sys.stderr)
        return 2
    dirs = []
    for pattern in args.lib_path:
        found = sorted(glob.glob(pattern))
        if not found:
            print(f"pypi_run: no library folder matches {pattern}", file=sys.stderr)
            return 2
        dirs += found
    env = dict(os.environ)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
