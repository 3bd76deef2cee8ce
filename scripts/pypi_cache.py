#!/usr/bin/env python3
"""Installs pinned PyPI packages into a cache outside the checkout, one
folder per requirements file (keyed by its name: torch-2.15.0), so that a
clean clone reuses them and a second run downloads nothing.

A file named wheelhouse-NAME.txt is a wheelhouse: its wheels are downloaded,
not installed, into the folder wheelhouse-NAME, for pip's --find-links (an
isolated build's requirements, a test environment's tools). They are
pure-Python wheels unless the file has a line "# pip download: OPTIONS"
(the Python version and platforms of another machine, say). Any other file
is installed (pip install --target) for the running interpreter, or for the
CPython a line "# pip install: OPTIONS" names.

A file named headers-torch.txt lists PyTorch releases (torch==2.6.0, one a
line) whose C++ headers reservoir builds a library against: for each, the
folder torch-headers-RELEASE holds the wheel's torch/include, interface
stubs of the three libraries the build links (libc10_cuda.so and libc10.so:
their dynamic symbols and sonames, made by llvm-ifs; libtorch_cuda.so: its
soname alone) and the wheel's METADATA (the CUDA it was built for). Where
there is no llvm-ifs (`pip install .` on a user's machine; RESERVOIR_LLVM_IFS
names another, or "" for none) every stub carries its soname alone, made by
the C compiler: the library then finds every symbol when it is loaded, as it
finds libtorch_cuda.so's. Only
those members of the wheel are downloaded, by HTTP range requests on the
index's file (about 12 MB of a wheel of 0.5 to 0.9 GB, most of which is
libtorch_cuda.so; what the library takes from it, the pluggable
allocator's functions, is bound when PyTorch has loaded it).

A file named debian-python.txt lists CPythons (python3.14, one a line) this
machine lacks, which the wheels are built for: for each, the folder
debian-NAME is a minimal root of Debian's unstable distribution
(debootstrap, as root) holding that interpreter, its venv module, headers
and pip; the interpreter is patched (patchelf) to run from there with that
root's C library and libraries, and ensurepip pointed at that root's wheels,
so that `debian-NAME/usr/bin/NAME -m venv` works on this machine.

usage: pypi_cache.py REQUIREMENTS...    (prints the folders, one a line)
       pypi_cache.py --torch-headers RELEASE...
                                        (those releases' headers alone: setup.py)

The cache is $RESERVOIR_PYPI_CACHE, else ~/.cache/reservoir/pypi. A folder
is complete when its .complete file holds the requirements it was made
from; anything else is made again (in a temporary folder, then renamed, so
that an interrupted install never passes for a complete one).
"""
import os
import shutil
import subprocess
import sys
import io
import json
import sysconfig
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

# The libraries reservoir's PyTorch hooks link, by soname; those whose
# symbols the stubs carry.
TORCH_LINKED = ("libtorch_cuda.so", "libc10_cuda.so", "libc10.so")
STUBBED = ("libc10_cuda.so", "libc10.so")
LLVM_IFS = os.environ.get("RESERVOIR_LLVM_IFS", "llvm-ifs-14")


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
        # Installed for this interpreter unless the file has a line "# pip
        # install: OPTIONS" (another CPython's: --python-version, --abi, ...).
        target_options = []
        for line in wanted.splitlines():
            if line.startswith("# pip install:"):
                target_options = ["--only-binary=:all:", *line.split(":", 1)[1].split()]
        command = ["install", *target_options, *common, "--root-user-action=ignore", "--target", str(partial)]
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


class RangeFile(io.RawIOBase):
    """A file on an HTTP server, read by range requests: what zipfile reads
    of a wheel (its central directory, the members asked for) is fetched,
    not the whole file. fetch() reads a span in one request, ahead of
    zipfile's many small reads there; `fetched` counts the bytes."""

    def __init__(self, url: str, size: int):
        super().__init__()
        self.url, self.size, self.pos, self.fetched = url, size, 0, 0
        self.spans = []  # (start, bytes), fetched

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def fetch(self, start: int, end: int) -> bytes:
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        for attempt in range(4):
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    data = response.read()
                    if response.status != 206 or len(data) != end - start:
                        sys.exit(f"pypi cache: {self.url} answered a range request with status "
                                 f"{response.status} and {len(data)} bytes, not {end - start}")
                break
            except OSError as error:
                if attempt == 3:
                    sys.exit(f"pypi cache: reading bytes {start}-{end - 1} of {self.url}: {error}")
                time.sleep(2 ** attempt)
        self.fetched += len(data)
        self.spans.append((start, data))
        return data

    def readinto(self, buffer):
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        for start, data in self.spans:
            if start <= self.pos < start + len(data):
                chunk = data[self.pos - start:self.pos - start + n]
                break
        else:
            chunk = self.fetch(self.pos, min(self.size, self.pos + max(n, 1 << 16)))[:n]
        buffer[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


def index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")


def wheel_on_index(name: str, release: str) -> dict:
    """The index's file entry (PEP 691 JSON: filename, url, size) of NAME
    RELEASE's x86_64 Linux wheel, this interpreter's where there is one."""
    request = urllib.request.Request(f"{index_url()}/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    tag = sysconfig.get_config_var("py_version_nodot")
    wheels = [f for f in files if f["filename"].startswith(f"{name}-{release}-")
              and f["filename"].endswith("_x86_64.whl") and "linux" in f["filename"] and f.get("size")]
    if not wheels:
        sys.exit(f"pypi cache: {index_url()} has no x86_64 Linux wheel of {name}=={release}")
    wheels.sort(key=lambda f: f"-cp{tag}-cp{tag}-" not in f["filename"])
    return wheels[0]


def soname_stub(soname: str, output: Path, scratch: Path) -> None:
    """A shared library with SONAME and no symbols, made by the C compiler."""
    empty = scratch / "empty.c"
    empty.write_text("")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    subprocess.run([compiler, "-shared", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(output), str(empty)],
                   check=True)


def torch_headers(release: str) -> Path:
    """torch-headers-RELEASE: what building against PyTorch RELEASE needs."""
    wanted = f"torch=={release}\nrecipe 2: the wheel's members by range requests; libtorch_cuda.so's soname\n"
    target, partial = pending(f"torch-headers-{release}", wanted)
    if partial is None:
        return target
    (partial / "lib").mkdir(parents=True)
    start = time.monotonic()
    entry = wheel_on_index("torch", release)
    print(f"pypi cache: PyTorch {release}'s headers into {target} (once; from {entry['filename']}, "
          f"{entry['size'] / 1e9:.1f} GB, what the build needs of it)", file=sys.stderr)
    remote = RangeFile(entry["url"], entry["size"])
    with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)) as wheel:
        members = wheel.infolist()
        ends = sorted(m.header_offset for m in members) + [remote.size]

        symbols = bool(LLVM_IFS) and shutil.which(LLVM_IFS) is not None

        def wanted_member(name):
            return ((name.startswith("torch/include/") and not name.endswith("/"))
                    or name.endswith(".dist-info/METADATA")
                    or (symbols and name.startswith("torch/lib/") and name[len("torch/lib/"):] in STUBBED))
        # The members asked for, in spans of the file read in one request
        # each (the headers lie together: a few requests in all).
        spans = []
        for member in sorted(filter(lambda m: wanted_member(m.filename), members), key=lambda m: m.header_offset):
            end = next(e for e in ends if e > member.header_offset)
            if spans and member.header_offset - spans[-1][1] < 1 << 20:
                spans[-1][1] = end
            else:
                spans.append([member.header_offset, end])
        for first, last in spans:
            remote.fetch(first, last)
        with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
            for member in members:
                name = member.filename
                if not wanted_member(name):
                    continue
                if name.endswith(".dist-info/METADATA"):
                    (partial / "METADATA").write_bytes(wheel.read(member))
                elif name.startswith("torch/include/"):
                    wheel.extract(member, partial)
                else:
                    real = Path(wheel.extract(member, scratch))
                    subprocess.run([LLVM_IFS, f"--soname={real.name}",
                                    f"--output-elf={partial / 'lib' / real.name}", str(real)], check=True)
                    real.unlink()
            # libtorch_cuda.so (and, without llvm-ifs, every one) by its
            # soname alone: the library is linked with --no-as-needed, so
            # that it names them as needed.
            for lib in TORCH_LINKED:
                if not (partial / "lib" / lib).exists():
                    soname_stub(lib, partial / "lib" / lib, Path(scratch))
    missing = [lib for lib in TORCH_LINKED if not (partial / "lib" / lib).exists()]
    if missing or not (partial / "torch/include/c10/cuda/CUDACachingAllocator.h").exists():
        sys.exit(f"pypi cache: torch=={release}'s wheel lacks {missing or 'CUDACachingAllocator.h'}")
    (partial / "torch/include").rename(partial / "include")
    (partial / "torch").rmdir()
    size = publish(partial, target, wanted)
    print(f"pypi cache: torch-headers-{release}: {time.monotonic() - start:.0f} s, "
          f"{remote.fetched / 1e6:.0f} MB downloaded, {size / 1e6:.0f} MB", file=sys.stderr)
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
    if sys.argv[1:2] == ["--torch-headers"]:
        for release in sys.argv[2:]:
            print(torch_headers(release))
        return
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
