"""setuptools' PEP 517 backend, asking the package index for CMake, ninja and
pybind11 only where the machine has none fit to build with (CMake 3.25 or
later, any ninja, pybind11's CMake files where CMake looks or an importable
pybind11, of a release that supports the Python building: 2.13 for 3.13). Everything else is setuptools.build_meta itself; setup.py drives
the CMake build."""
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

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
        needed.append("pybind11>=%d.%d" % _pybind11_minimum())
    return needed


# The first pybind11 release that supports each newer CPython; older ones
# build with any pybind11 from 2.10 on.
PYBIND11_FOR_PYTHON = {(3, 13): (2, 13), (3, 14): (3, 0)}


def _pybind11_minimum():
    fitting = [v for py, v in PYBIND11_FOR_PYTHON.items() if sys.version_info[:2] >= py]
    return max(fitting, default=(2, 10))


def _have_pybind11():
    """An importable pybind11, or pybind11's CMake files where CMake looks,
    recent enough for this Python."""
    minimum = _pybind11_minimum()
    if importlib.util.find_spec("pybind11") is not None:
        import pybind11
        return _version_tuple(pybind11.__version__) >= minimum
    prefixes = [p for p in os.environ.get("CMAKE_PREFIX_PATH", "").split(os.pathsep) if p]
    prefixes += ["/usr", "/usr/local"]
    for prefix in prefixes:
        for pattern in ("lib/cmake/pybind11", "lib/*/cmake/pybind11", "share/cmake/pybind11"):
            for config in glob.glob(os.path.join(prefix, pattern, "pybind11ConfigVersion.cmake")):
                with open(config, encoding="utf-8") as f:
                    match = re.search(r'set\(PACKAGE_VERSION "([0-9.]+)"\)', f.read())
                if match and _version_tuple(match.group(1)) >= minimum:
                    return True
    return False


def _version_tuple(text):
    return tuple(int(p) for p in re.findall(r"[0-9]+", text)[:2])


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _native_tools()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _native_tools()
