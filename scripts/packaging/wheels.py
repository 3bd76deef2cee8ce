#!/usr/bin/env python3
"""reservoir's distributions as a release has them: the sdist, and from it
one wheel per CPython on this machine (3.10 and later), each built the way
`pip install .` builds (PEP 517 with build isolation: setuptools, wheel and
pybind11 come from a package index) and repaired by PyPA's auditwheel to the
manylinux tag its symbols allow.

The package index is the wheelhouse in the PyPI cache (scripts/pypi_cache.py
downloads it once from PyPI: scripts/packaging/wheelhouse-build.txt), given
to pip with --no-index --find-links, so that nothing downloads here.
auditwheel runs from the cache too (requirements-auditwheel-*.txt).

usage: wheels.py --out DIR [--work DIR] [--python PYTHON]...
       (no --python: every CPython 3.10+ found on PATH, in pyenv, in /usr/bin
       and taken from Debian's packages into the PyPI cache, debian-python3.*:
       scripts/packaging/debian-python.txt)

Used by `make wheels` and by tests/packaging/wheel/wheel_test.py.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import pypi_cache  # noqa: E402

MINIMUM_PYTHON = (3, 10)
# The CPythons the newest PyTorch release reservoir is built for (2.15) has
# wheels for on PyPI: a release of reservoir has a wheel for each.
PYTORCH_CPYTHONS = ("cp310", "cp311", "cp312", "cp313", "cp314")
# The hooks libraries bind to the PyTorch that loads them: never grafted
# into the wheel.
TORCH_LIBRARIES = ["libtorch_cuda.so", "libc10_cuda.so", "libc10.so"]
WHEELHOUSE_REQUIREMENTS = os.path.join(ROOT, "scripts", "packaging", "wheelhouse-build.txt")


def log(message):
    print(message, flush=True)


def run(command, env=None, cwd=None):
    log("$ " + " ".join(command))
    subprocess.run(command, env=env, cwd=cwd, check=True)


def wheelhouse():
    return str(pypi_cache.install(pypi_cache.Path(WHEELHOUSE_REQUIREMENTS)))


def auditwheel_site():
    found = sorted(glob.glob(os.path.join(ROOT, "scripts", "packaging", "requirements-auditwheel-*.txt")))
    if len(found) != 1:
        raise SystemExit(f"want one scripts/packaging/requirements-auditwheel-*.txt, found {found}")
    return str(pypi_cache.install(pypi_cache.Path(found[0])))


def interpreter(python):
    """(tag, real executable, version) of a CPython fit to build for, or None."""
    probe = ("import sys, sysconfig, os, importlib.util as u; "
             "ok = sys.implementation.name == 'cpython' and "
             "os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) and "
             "u.find_spec('pip') is not None and u.find_spec('ensurepip') is not None; "
             "print(ok, sys.version_info[0], sys.version_info[1], sys.executable)")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = out.stdout.split()
    if out.returncode != 0 or len(fields) != 4 or fields[0] != "True":
        return None
    version = (int(fields[1]), int(fields[2]))
    if version < MINIMUM_PYTHON:
        return None
    return f"cp{version[0]}{version[1]}", os.path.realpath(fields[3]), version


def cpythons(explicit=None):
    """One interpreter per CPython tag: those asked for, else every one found
    (pyenv's and PATH's before Debian's /usr/bin, whose pip may be absent;
    then those the PyPI cache holds from Debian's packages)."""
    if explicit:
        candidates = explicit
    else:
        root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
        candidates = sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3.*[0-9]")))
        for folder in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/local/bin", "/usr/bin"]:
            candidates += sorted(glob.glob(os.path.join(folder, "python3.*[0-9]")))
        debian = pypi_cache.cache_root() / "debian-python3.*" / "usr" / "bin" / "python3.*[0-9]"
        candidates += sorted(glob.glob(str(debian)))
    chosen = {}
    for c in candidates:
        if not re.search(r"python3\.[0-9]+$", c) and not explicit:
            continue
        found = interpreter(c)
        if found is not None and found[0] not in chosen:
            chosen[found[0]] = found
    return [chosen[tag] for tag in sorted(chosen, key=lambda t: int(t[3:]))]


def build_env(cmake_dir, releases="all"):
    """The environment of a build under isolation. A release's wheel serves
    any PyTorch: reservoir's own allocator for every release (setup.py),
    whatever the building interpreter holds; releases=None leaves the choice
    to setup.py (under build isolation, which hides any PyTorch: every
    release too)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))
           and k not in ("RESERVOIR_CMAKE_BUILD_DIR", "RESERVOIR_TORCH_RELEASES")}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=wheelhouse(), PIP_DISABLE_PIP_VERSION_CHECK="1",
               RESERVOIR_CMAKE_BUILD_DIR=cmake_dir)
    if releases is not None:
        env["RESERVOIR_TORCH_RELEASES"] = releases
    return env


def build_sdist(source, out, work):
    """The sdist, with PyPA's build under build isolation (its requirements
    from the wheelhouse), made by Debian's python3 with python3-build."""
    fresh = fresh_folder(out)
    run(["/usr/bin/python3", "-m", "build", "--sdist", "--outdir", fresh, source],
        env=build_env(os.path.join(work, "cmake-unused")))
    return move_one(fresh, out, "python -m build --sdist", "*.tar.gz")


def unpack_sdist(sdist, work):
    """The sdist unpacked once into work/sdist, so that one CMake build
    folder (work/cmake) serves every interpreter's build from it. Both start
    empty: the files keep their times from the sdist, which can be older than
    objects an earlier sdist left, so a kept build folder could link stale
    objects."""
    target = os.path.join(work, "sdist")
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(os.path.join(work, "cmake"), ignore_errors=True)
    os.makedirs(target)
    with tarfile.open(sdist) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(target, filter="data")
        else:
            t.extractall(target)
    (top,) = os.listdir(target)
    return os.path.join(target, top)


def build_wheel(python, project, out, cmake_dir, releases="all"):
    """`pip wheel` of the project with build isolation: the wheel pip makes
    for `pip install .` (releases: as build_env's)."""
    fresh = fresh_folder(out)
    run([python, "-m", "pip", "wheel", project, "--no-deps", "--wheel-dir", fresh],
        env=build_env(cmake_dir, releases))
    return move_one(fresh, out, "pip wheel")


def repair(wheel, out):
    """auditwheel repair: the manylinux tag the wheel's symbols allow, with
    nothing grafted but what the wheel needs beyond glibc, libstdc++ and
    libgcc (nothing, for a portable build) and never PyTorch's libraries."""
    site = auditwheel_site()
    env = dict(os.environ, PYTHONPATH=site, PATH=os.path.join(site, "bin") + os.pathsep + os.environ["PATH"])
    fresh = fresh_folder(out)
    command = ["/usr/bin/python3", "-m", "auditwheel", "repair", "--wheel-dir", fresh]
    for library in TORCH_LIBRARIES:
        command += ["--exclude", library]
    run(command + [wheel], env=env)
    return move_one(fresh, out, "auditwheel repair")


def fresh_folder(out):
    """An empty folder beside out for one tool's output, so that a wheel of
    the same name from an earlier run is never taken for the new one."""
    fresh = os.path.join(os.path.dirname(os.path.abspath(out)), ".incoming")
    shutil.rmtree(fresh, ignore_errors=True)
    os.makedirs(fresh)
    os.makedirs(out, exist_ok=True)
    return fresh


def move_one(fresh, out, tool, pattern="*.whl"):
    """The one file `tool` made in `fresh`, moved into `out`."""
    made = glob.glob(os.path.join(fresh, pattern))
    if len(made) != 1:
        raise SystemExit(f"{tool} made {made}, not one {pattern}")
    target = os.path.join(out, os.path.basename(made[0]))
    os.replace(made[0], target)
    shutil.rmtree(fresh, ignore_errors=True)
    return target


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the sdist and the repaired wheels go")
    ap.add_argument("--work", help="build folders (default: OUT/work)")
    ap.add_argument("--python", action="append", help="an interpreter to build for (repeatable)")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work or os.path.join(out, "work"))
    pythons = cpythons(args.python)
    if not pythons:
        raise SystemExit("no CPython 3.10 or later with its headers and pip on this machine")
    log("building for " + ", ".join(f"{tag} ({exe})" for tag, exe, _ in pythons))
    sdist = build_sdist(ROOT, out, work)
    project = unpack_sdist(sdist, work)
    made = [sdist]
    for tag, python, _ in pythons:
        raw = build_wheel(python, project, os.path.join(work, "raw", tag), os.path.join(work, "cmake"))
        made.append(repair(raw, out))
    log("\n".join(["made:"] + made))


if __name__ == "__main__":
    main()
