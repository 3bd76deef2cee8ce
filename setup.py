"""Builds the reservoir Python package with the project's CMake.

setuptools (pyproject.toml's backend) handles the package and the wheel;
CMakeBuild runs the CMake build (Release, every dependency but glibc and
libstdc++ linked in: RESERVOIR_PORTABLE) and puts what its "python" install
component holds into the package: the extension module reservoir._core,
lib/libreservoir_torch.so, lib/libreservoir_preload.so (where CUDA's headers
are found) and bin/reservoir.

reservoir as PyTorch's own allocator is a library per PyTorch release
(reservoir/lib/torch-<release>/), built against that release's headers,
which scripts/pypi_cache.py reads from its wheel on the package index (about
12 MB of it, once, into the PyPI cache). Which releases: those
RESERVOIR_TORCH_RELEASES names ("2.15", "2.11,2.15", "all" or "none"); unset,
the one of the PyTorch installed where the package is being installed (read
from its site-packages, which build isolation hides from the build but not
from this file), else every release scripts/packaging/headers-torch.txt
lists (a wheel for any PyTorch, as `make wheels` builds).

Environment: RESERVOIR_CMAKE_BUILD_DIR (the CMake build folder; default
build/python-package/<python>/cmake, kept between builds), CMAKE_ARGS (more
-D options for the configure step), CMAKE_BUILD_PARALLEL_LEVEL,
RESERVOIR_TORCH_RELEASES, RESERVOIR_PYPI_CACHE.
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.install import install

ROOT = os.path.dirname(os.path.abspath(__file__))


def cmake_project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(\s*reservoir\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if match is None:
        raise RuntimeError("CMakeLists.txt: no project(reservoir VERSION x.y.z) to take the version from")
    return match.group(1)


# Everything setuptools writes goes under build/ (one folder per Python), not
# into the checkout.
BUILD_BASE = os.path.join(ROOT, "build", "python-package",
                          f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}")


def copy_native_folders(source, package):
    """The package's lib/ and bin/ (beside the extension module), replaced."""
    for sub in ("lib", "bin"):
        shutil.rmtree(os.path.join(package, sub), ignore_errors=True)
        shutil.copytree(os.path.join(source, sub), os.path.join(package, sub))


HEADERS_TORCH = os.path.join(ROOT, "scripts", "packaging", "headers-torch.txt")


def _minor(version):
    """(2, 15) of "2.15.0+cu130"."""
    match = re.match(r"(\d+)\.(\d+)", version.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def listed_torch_releases():
    """The releases scripts/packaging/headers-torch.txt lists (torch==2.15.0)."""
    with open(HEADERS_TORCH, encoding="utf-8") as f:
        return re.findall(r"^torch==([0-9][0-9.]*)\s*$", f.read(), re.M)


def environment_torch():
    """The version of the PyTorch installed in the environment this package is
    being installed into (its site-packages' torch/version.py), or None."""
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        version_file = os.path.join(paths[key], "torch", "version.py")
        if os.path.exists(version_file):
            with open(version_file, encoding="utf-8") as f:
                match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
            if match:
                return match.group(1)
    return None


def torch_hook_releases():
    """(the PyTorch releases to build reservoir's own allocator for, why)."""
    listed = listed_torch_releases()
    asked = os.environ.get("RESERVOIR_TORCH_RELEASES", "").strip()
    if asked.lower() == "all":
        return listed, "RESERVOIR_TORCH_RELEASES=all"
    if asked.lower() == "none":
        return [], "RESERVOIR_TORCH_RELEASES=none"
    if asked:
        chosen = []
        for item in filter(None, (x.strip() for x in asked.split(","))):
            match = [r for r in listed if _minor(r) == _minor(item)]
            if not match:
                raise RuntimeError(f"RESERVOIR_TORCH_RELEASES={asked!r}: reservoir's own allocator is built for "
                                   f"{', '.join(listed)}, not {item}")
            chosen += match
        return chosen, f"RESERVOIR_TORCH_RELEASES={asked}"
    version = environment_torch()
    if version is None:
        return listed, "no PyTorch in the environment: every release, for whichever is installed later"
    match = [r for r in listed if _minor(r) == _minor(version)]
    if not match:
        return [], (f"PyTorch {version} in the environment, which reservoir's own allocator is not built for "
                    f"(it is for {', '.join(listed)}): reservoir.install_torch() serves it")
    return match, f"PyTorch {version} in the environment"


def fetch_torch_headers(releases):
    """Those releases' headers into the PyPI cache (nothing when there)."""
    if not releases:
        return
    script = os.path.join(ROOT, "scripts", "pypi_cache.py")
    result = subprocess.run([sys.executable, script, "--torch-headers", *releases])
    if result.returncode != 0:
        print(f"reservoir: could not fetch PyTorch {', '.join(releases)}'s headers from the package index "
              "(see above): the package is built without reservoir's own allocator for them "
              "(reservoir.install_torch() still serves PyTorch)", flush=True)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("RESERVOIR_CMAKE_BUILD_DIR") or os.path.join(BUILD_BASE, "cmake")
        configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                     "-DRESERVOIR_PORTABLE=ON", "-DRESERVOIR_BUILD_TESTS=OFF",
                     "-DRESERVOIR_BUILD_BENCH=OFF", "-DRESERVOIR_BUILD_SIMCUDA=OFF", "-DRESERVOIR_BUILD_TOOLS=ON",
                     "-DRESERVOIR_BUILD_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}",
                     # A unity build: each target's sources compiled a few to
                     # a translation unit, so that the headers every one of
                     # them parses (fmt, CLI11, nlohmann-json, PyTorch's) are
                     # parsed once a batch: 86 compilations become 19, and a
                     # build from nothing takes a fifth of the CPU
                     # (docs/benchmarks.md). CMAKE_ARGS=-DCMAKE_UNITY_BUILD=OFF
                     # builds file by file.
                     "-DCMAKE_UNITY_BUILD=ON"]
        cache = os.path.join(build_dir, "CMakeCache.txt")
        if not os.path.exists(cache):
            if shutil.which("ninja"):
                configure += ["-G", "Ninja"]
        else:
            # A kept build folder may have served another Python: FindPython
            # and pybind11 would keep that one's headers and module suffix, so
            # what they found is looked up again (unchanged findings rebuild
            # nothing; a new Python rebuilds the extension module alone).
            configure[5:5] = ["-U", "Python_*", "-U", "_Python_*", "-U", "PYTHON_*"]
        try:
            import pybind11  # pip's pybind11 where there is one; Debian's pybind11-dev otherwise
            configure.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass
        releases, why = torch_hook_releases()
        print(f"reservoir: own allocator for PyTorch {', '.join(releases) or 'none'} ({why})", flush=True)
        fetch_torch_headers(releases)
        configure.append(f"-DRESERVOIR_TORCH_HOOK_RELEASES={';'.join(releases) or 'none'}")
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        self._run(configure)
        with open(cache, encoding="utf-8") as f:
            if re.search(r"^pybind11_DIR:PATH=.*NOTFOUND", f.read(), re.M):
                raise RuntimeError(
                    "CMake found no pybind11 (pybind11Config.cmake): install Debian's pybind11-dev "
                    "or pip's pybind11, or pass -Dpybind11_DIR=... in CMAKE_ARGS")
        jobs = self.parallel or os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.cpu_count() or 1
        self._run(["cmake", "--build", build_dir, "--target", "reservoir_python_package",
                   "--parallel", str(jobs)])

        stage = os.path.join(self.build_temp, "cmake-install")
        shutil.rmtree(stage, ignore_errors=True)
        self._run(["cmake", "--install", build_dir, "--component", "python", "--prefix", stage])
        staged = os.path.join(stage, "reservoir")
        modules = glob.glob(os.path.join(staged, "_core*.so"))
        if len(modules) != 1:
            raise RuntimeError(f"the CMake install held {len(modules)} extension modules in {staged}, not one")
        target = self.get_ext_fullpath(ext.name)
        package = os.path.dirname(target)
        os.makedirs(package, exist_ok=True)
        shutil.copy2(modules[0], target)
        copy_native_folders(staged, package)

    def copy_extensions_to_source(self):
        """Editable installs (pip install -e .) and --inplace: the package's
        native files go into the source package beside the extension module."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            package = ext.name.rpartition(".")[0]
            built = os.path.dirname(os.path.join(self.build_lib, self.get_ext_filename(ext.name)))
            copy_native_folders(built, os.path.join(ROOT, build_py.get_package_dir(package)))

    def _run(self, command):
        print(" ".join(shlex.quote(c) for c in command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)


class BuildPy(build_py):
    """The package, and reservoir_autoinstall.pth at the top of the install
    (site-packages), where Python reads it at start-up: it installs reservoir
    as PyTorch's allocator when RESERVOIR_TORCH_ALLOCATOR is set
    (reservoir/_autoinstall.py)."""

    PTH = "reservoir_autoinstall.pth"

    def run(self):
        super().run()
        self.copy_file(os.path.join(ROOT, "python", self.PTH), os.path.join(self.build_lib, self.PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, self.PTH)]


class Install(install):
    """Debian's setuptools reads the `install_layout` and `prefix_option`
    options that only Debian's own distutils defines: give them their unset
    values, so that setuptools serves other interpreters too (a CPython 3.12
    building with it, say)."""

    def initialize_options(self):
        super().initialize_options()
        for option in ("install_layout", "prefix_option"):
            if not hasattr(self, option):
                setattr(self, option, None)


def license_metadata():
    """Apache-2.0 as an SPDX expression (License-Expression, PEP 639) where
    setuptools has it (77 and later), as the License field before."""
    import setuptools
    major = int(re.match(r"[0-9]+", setuptools.__version__).group(0))
    if major >= 77:
        return {"license_expression": "Apache-2.0", "license_files": ["LICENSE"]}
    return {"license": "Apache-2.0", "license_files": ["LICENSE"]}


os.makedirs(BUILD_BASE, exist_ok=True)
setup(
    **license_metadata(),
    version=cmake_project_version(),
    package_dir={"": "python"},
    packages=["reservoir"],
    py_modules=["reservoir_torch"],
    ext_modules=[CMakeExtension("reservoir._core")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy, "install": Install},
    zip_safe=False,
    options={"build": {"build_base": BUILD_BASE}, "egg_info": {"egg_base": BUILD_BASE}},
)
