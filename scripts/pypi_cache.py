#!/usr/bin/env python3
"""Installs pinned PyPI packages into a cache outside the checkout, one
folder per requirements file (keyed by its name: torch-2.15.0), so that a
clean clone reuses them and a second run downloads nothing.

A file named wheelhouse-NAME.txt is a wheelhouse: its wheels are downloaded,
not installed, into the folder wheelhouse-NAME, for pip's --find-links (an
isolated build's requirements, a test environment's tools). They are
pure-Python wheels unless the file has a line "# pip download: OPTIONS"
(the Python version and platforms of another machine, say).

A file named headers-torch.txt lists PyTorch releases (torch==2.6.0, one a
line) whose C++ headers reservoir builds a library against: for each, the
folder torch-headers-RELEASE holds the wheel's torch/include, interface
stubs of the three libraries the build links (libtorch_cuda.so, libc10_cuda.so,
libc10.so: their dynamic symbols and sonames, made by llvm-ifs, a few MB in
place of a GB) and the wheel's METADATA (the CUDA it was built for). The
wheel itself (about 1 GB) is downloaded into a temporary folder and deleted.

A file named debian-python.txt lists CPythons (python3.14, one a line) this
machine lacks, which the wheels are built for: for each, the folder
debian-NAME is a minimal root of Debian's unstable distribution
(debootstrap, as root) holding that interpreter, its venv module, headers
and pip; the interpreter is patched (patchelf) to run from there with that
root's C library and libraries, and ensurepip pointed at that root's wheels,
so that `debian-NAME/usr/bin/NAME -m venv` works on this machine.

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
import tempfile
import time
import zipfile
from pathlib import Path

# The libraries reservoir's PyTorch hooks link, by soname.
TORCH_LINKED = ("libtorch_cuda.so", "libc10_cuda.so", "libc10.so")
LLVM_IFS = "llvm-ifs-14"


def cache_root() -> Path:
    root = os.environ.get("RESERVOIR_PYPI_CACHE") or str(Path.home() / ".cache/reservoir/pypi")
    return Path(root)


def as_root(command: list) -> list:
    return command if os.geteuid() == 0 else ["sudo", *command]


def pending(name: str, wanted: str):
    """(the cache folder NAME, None) when it is complete for `wanted`; else
    (that folder, the empty place to make it in: NAME.partial, whatever an
    interrupted run left there removed)."""
    target = cache_root() / name
    marker = target / ".complete"
    if marker.exists() and marker.read_text() == wanted:
        return target, None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if partial.exists():  # a Debian root debootstrap made as root
        subprocess.run(as_root(["rm", "-rf", str(partial)]), check=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    return target, partial


def install(requirements: Path) -> Path:
    name = requirements.stem.removeprefix("requirements-")
    wheelhouse = name.startswith("wheelhouse-")
    wanted = requirements.read_text()
    target, partial = pending(name, wanted)
    if partial is None:
        return target
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
    size = publish(partial, target, wanted)
    print(f"pypi cache: {name}: {time.monotonic() - start:.0f} s, {size / 1e9:.1f} GB installed",
          file=sys.stderr)
    return target


def publish(partial: Path, target: Path, wanted: str) -> int:
    """Puts the finished folder `partial` in target's place and marks it
    complete with `wanted`; returns its size in bytes."""
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    (target / ".complete").write_text(wanted)
    return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())


def torch_headers(release: str) -> Path:
    """torch-headers-RELEASE: what building against PyTorch RELEASE needs."""
    target, partial = pending(f"torch-headers-{release}", f"torch=={release}\n")
    if partial is None:
        return target
    wanted = f"torch=={release}\n"
    (partial / "lib").mkdir(parents=True)
    start = time.monotonic()
    print(f"pypi cache: PyTorch {release}'s headers into {target} (once; the 1 GB wheel is not kept)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
                        "--disable-pip-version-check", "--quiet", "--only-binary=:all:",
                        "--dest", scratch, f"torch=={release}"], check=True)
        wheels = list(Path(scratch).glob("torch-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"pypi cache: expected one wheel of torch=={release}, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in wheel.infolist():
                name = member.filename
                if name.startswith("torch/include/") and not name.endswith("/"):
                    wheel.extract(member, partial)
                elif name.endswith(".dist-info/METADATA"):
                    (partial / "METADATA").write_bytes(wheel.read(member))
                elif name.startswith("torch/lib/") and name[len("torch/lib/"):] in TORCH_LINKED:
                    real = Path(wheel.extract(member, scratch))
                    subprocess.run([LLVM_IFS, f"--soname={real.name}",
                                    f"--output-elf={partial / 'lib' / real.name}", str(real)], check=True)
                    real.unlink()
    missing = [lib for lib in TORCH_LINKED if not (partial / "lib" / lib).exists()]
    if missing or not (partial / "torch/include/c10/cuda/CUDACachingAllocator.h").exists():
        sys.exit(f"pypi cache: torch=={release}'s wheel lacks {missing or 'CUDACachingAllocator.h'}")
    (partial / "torch/include").rename(partial / "include")
    (partial / "torch").rmdir()
    size = publish(partial, target, wanted)
    print(f"pypi cache: torch-headers-{release}: {time.monotonic() - start:.0f} s, {size / 1e6:.0f} MB",
          file=sys.stderr)
    return target


DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "unstable"


def debian_python(name: str) -> Path:
    """debian-NAME: CPython NAME (python3.14) from Debian's packages, runnable here."""
    # The recipe is part of what the folder is complete for: a folder made
    # by an earlier one is made again.
    wanted = f"{name}\nrecipe 2: the interpreter runs here; its headers build here\n"
    target, partial = pending(f"debian-{name}", wanted)
    if partial is None:
        return target
    start = time.monotonic()
    print(f"pypi cache: {name} from Debian's {DEBIAN_SUITE} packages into {target} (once)", file=sys.stderr)
    packages = f"{name}-venv,{name}-dev,python3-pip"
    debootstrap = subprocess.run(
        as_root(["debootstrap", "--variant=minbase", f"--include={packages}", DEBIAN_SUITE, str(partial),
                 DEBIAN_MIRROR]), capture_output=True, text=True)
    if debootstrap.returncode != 0:
        sys.exit(f"pypi cache: debootstrap of Debian {DEBIAN_SUITE} with {packages} failed "
                 f"(exit {debootstrap.returncode}):\n{debootstrap.stdout[-2000:]}{debootstrap.stderr[-2000:]}")
    if os.geteuid() != 0:
        subprocess.run(["sudo", "chown", "-R", f"{os.getuid()}:{os.getgid()}", str(partial)], check=True)
    usr = partial / "usr"
    final = target / "usr"  # where the folder will be: the paths written name it
    # Run from here: that root's loader, and its libraries before this
    # machine's (DT_RPATH, which every library the process loads inherits).
    subprocess.run(["patchelf", "--set-interpreter", f"{final}/lib64/ld-linux-x86-64.so.2", "--force-rpath",
                    "--set-rpath", f"{final}/lib/x86_64-linux-gnu", str(usr / "bin" / name)], check=True)
    # ensurepip takes pip's wheel from a folder compiled in as an absolute
    # path (/usr/share/python-wheels/): that root's.
    wheels = "'WHEEL_PKG_DIR': '/usr/share/python-wheels/'"
    patched = 0
    for data in (usr / "lib" / name).glob("_sysconfigdata_*.py"):
        text = data.read_text()
        if not data.is_symlink() and wheels in text:
            data.write_text(text.replace(wheels, f"'WHEEL_PKG_DIR': '{final}/share/python-wheels/'"))
            patched += 1
    if patched == 0:
        sys.exit(f"pypi cache: {name}'s sysconfig data does not name {wheels}: Debian's packaging changed")
    # Debian's pyconfig.h includes the multiarch one by a path under the
    # system's /usr/include: the compiler here would look in this machine's.
    wrapper = usr / "include" / name / "pyconfig.h"
    multiarch = usr / "include" / "x86_64-linux-gnu" / name / "pyconfig.h"
    if multiarch.exists():
        wrapper.unlink()
        shutil.copyfile(multiarch, wrapper)
    version = subprocess.run(["dpkg-query", f"--admindir={partial}/var/lib/dpkg", "-W", "-f=${Version}",
                              f"{name}-minimal"], capture_output=True, text=True, check=True).stdout.strip()
    (partial / "VERSION").write_text(f"{name} {version} (Debian {DEBIAN_SUITE})\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    (target / ".complete").write_text(wanted)
    probe = subprocess.run([str(target / "usr/bin" / name), "-c", "import ensurepip, venv, sysconfig, ssl; "
                            "print(sysconfig.get_paths()['include'])"], capture_output=True, text=True)
    if probe.returncode != 0 or not Path(probe.stdout.strip(), "Python.h").exists():
        (target / ".complete").unlink()
        sys.exit(f"pypi cache: {name} from Debian does not run here: {probe.stderr[-2000:]}")
    # Its headers with this machine's compiler, as an extension module's build takes them.
    compile_probe = subprocess.run(["c++", "-fsyntax-only", "-x", "c++", "-I", probe.stdout.strip(), "-"],
                                   input="#include <Python.h>\nint main() { return Py_IsInitialized(); }\n",
                                   capture_output=True, text=True)
    if compile_probe.returncode != 0:
        (target / ".complete").unlink()
        sys.exit(f"pypi cache: {name}'s headers do not build here: {compile_probe.stderr[-2000:]}")
    print(f"pypi cache: debian-{name}: {version}, {time.monotonic() - start:.0f} s", file=sys.stderr)
    return target


def releases(path: Path) -> list:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    out = []
    for line in filter(None, lines):
        name, _, release = line.partition("==")
        if name != "torch" or not release:
            sys.exit(f"{path}: expected torch==RELEASE, got {line!r}")
        out.append(release)
    return out


def main() -> None:
    for arg in sys.argv[1:]:
        path = Path(arg)
        if path.name == "headers-torch.txt":
            for release in releases(path):
                print(torch_headers(release))
        elif path.name == "debian-python.txt":
            for line in path.read_text().splitlines():
                name = line.split("#")[0].strip()
                if name:
                    print(debian_python(name))
        else:
            print(install(path))


if __name__ == "__main__":
    main()
