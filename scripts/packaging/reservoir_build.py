"""setuptools' PEP 517 backend, asking the package index for CMake, ninja and
pybind11 only where the machine has none fit to build with (CMake 3.25 or
later, any ninja, pybind11's CMake files where CMake looks or an importable
pybind11). Everything else is setuptools.build_meta itself; setup.py drives
the CMake build."""
import glob
import importlib.util
import os
import re
import shutil
import subprocess

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks this backend does not change)

CMAKE_MINIMUM = (3, 25)


def _cmake_version():
    cmake = shutil.which("cmake")
    if cmake is None:
        return None
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"version (\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _native_tools():
    needed = []
    version = _cmake_version()
    if version is None or version < CMAKE_MINIMUM:
        needed.append("cmake>=%d.%d" % CMAKE_MINIMUM)
    if shutil.which("ninja") is None:
        needed.append("ninja")
    if not _have_pybind11():
        needed.append("pybind11>=2.10")
    return needed


def _have_pybind11():
    if importlib.util.find_spec("pybind11") is not None:
        return True
    prefixes = [p for p in os.environ.get("CMAKE_PREFIX_PATH", "").split(os.pathsep) if p]
    prefixes += ["/usr", "/usr/local"]
    return any(glob.glob(os.path.join(prefix, pattern, "pybind11Config.cmake"))
               for prefix in prefixes
               for pattern in ("lib/cmake/pybind11", "lib/*/cmake/pybind11", "share/cmake/pybind11"))


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _native_tools()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _native_tools()
