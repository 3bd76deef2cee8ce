"""reservoir as a pip package, both ways it is installed:

1. Offline, as on a machine without a package index: the wheel built from the
   checkout's tracked files (copied as a fresh clone has them) by each
   --python with `python -m build --no-isolation` or `pip wheel
   --no-build-isolation` (Debian's setuptools, wheel and pytest serve an
   interpreter that lacks them: scripts/debian_python_tools.py, by
   PYTHONPATH, never installed into the environment under test); reservoir's
   own allocator for the newest PyTorch release.
2. As a release: the sdist, and from it, for every CPython 3.10+ on the
   machine, the wheel `pip install .` builds (build isolation; setuptools,
   wheel and pybind11 from the PyPI cache's wheelhouse) repaired by
   auditwheel to a manylinux tag (scripts/packaging/wheels.py). With no
   PyTorch to read a release from (build isolation hides any), setup.py
   builds reservoir's own allocator for every release: checked.

Every wheel: what it holds is checked, it is installed into a fresh virtual
environment and, from a folder outside the checkout, the project's Python
test suite and the installed package's own checks run against the installed
package, never the build tree.

Usage: wheel_test.py --source DIR --work DIR --version X.Y.Z --python PYTHON...
                     [--release] [--expect-preload ON|OFF]
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
from debian_python_tools import BUILD_TOOLS, TEST_TOOLS, fill as debian_tools  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts", "packaging"))
import wheels as release  # noqa: E402

# What a portable build may need of the machine it runs on.
ALLOWED_NEEDED = re.compile(r"^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so")
# The hooks library of a PyTorch release binds to that PyTorch's libraries,
# loaded (by soname) once `import torch` has run.
HOOKS = re.compile(r"^reservoir/lib/torch-2\.[0-9]+\.[0-9]+/libreservoir_torch_hooks\.so$")
TORCH_NEEDED = re.compile(r"^(libtorch_cuda|libc10_cuda|libc10)\.so$")

failures = []


def check(condition, what):
    print(("ok    " if condition else "FAIL  ") + what, flush=True)
    if not condition:
        failures.append(what)


def run(cmd, env=None, cwd=None, capture=False):
    print("$ " + " ".join(cmd), flush=True)
    result = subprocess.run(cmd, env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None)
    if capture:
        print(result.stdout, end="", flush=True)
    return result


def interpreter_info(python):
    code = ("import sys, sysconfig; print(sys.version_info[0], sys.version_info[1]); "
            "print(sysconfig.get_config_var('EXT_SUFFIX'))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    major, minor = out[0].split()
    return f"cp{major}{minor}", out[1].strip()


def has_modules(python, modules, env):
    return subprocess.run([python, "-c", "import " + ", ".join(modules)], env=env,
                          capture_output=True).returncode == 0


def tracked_files(checkout):
    """The files a fresh clone of the checkout has (git ls-files), or None
    where it is not a git checkout."""
    if not os.path.isdir(os.path.join(checkout, ".git")) or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "ls-files", "-z"], cwd=checkout, capture_output=True, check=True).stdout
    return {f for f in out.decode().split("\0") if f and os.path.lexists(os.path.join(checkout, f))}


def clone_of(checkout, files, dest):
    """The tracked files' working-tree contents copied to dest, as a fresh
    clone holds them (a file the build needs but git does not track fails
    here, as it would for anyone installing from a clone); unchanged files
    keep their times, so the kept CMake build rebuilds only what changed."""
    for rel in untracked_outside_build(dest, files):
        os.remove(os.path.join(dest, rel))
    for rel in files:
        src, dst = os.path.join(checkout, rel), os.path.join(dest, rel)
        st = os.lstat(src)
        if os.path.lexists(dst):
            dt = os.lstat(dst)
            if dt.st_size == st.st_size and dt.st_mtime_ns == st.st_mtime_ns:
                continue
            os.remove(dst)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    return dest


def untracked_outside_build(tree, files):
    """Files in tree that git does not track, outside build/ and Python's
    bytecode caches (the build backend is imported from the tree)."""
    left = []
    for folder, dirs, names in os.walk(tree):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), tree)
            if rel not in files and not rel.startswith("build" + os.sep):
                left.append(rel)
    return sorted(left)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--python", action="append", default=[])
    ap.add_argument("--release", action="store_true",
                    help="also the sdist and the manylinux wheels for every CPython 3.10+ found")
    ap.add_argument("--expect-preload", default="ON")
    args = ap.parse_args()
    checkout = os.path.abspath(args.source)
    files = tracked_files(checkout)
    args.tracked = files
    args.source = checkout if files is None else clone_of(checkout, files,
                                                          os.path.join(os.path.abspath(args.work), "src"))
    print(f"building from {args.source}"
          + ("" if files is None else f" ({len(files)} tracked files of {checkout})"))
    built = 0
    for python in args.python:
        wheel = offline_wheel(python, args)
        if wheel is None or install_and_test(wheel, python, args, release=False) != 0:
            break
        built += 1
    if args.release and not failures:
        try:
            built += release_wheels(args)
        except (subprocess.CalledProcessError, SystemExit) as e:
            check(False, f"the release build: {e}")
    print(f"{len(failures)} failure(s)" if failures else f"{built} wheel(s): every check passed")
    return 1 if failures else 0


def release_wheels(args):
    """The sdist, and from it the manylinux wheel of every CPython found."""
    work = os.path.join(os.path.abspath(args.work), "release")
    out = os.path.join(work, "dist")
    shutil.rmtree(out, ignore_errors=True)
    pythons = release.cpythons()
    check(pythons, "CPythons 3.10+ with headers and pip on this machine: "
          + ", ".join(f"{tag} {exe}" for tag, exe, _ in pythons))
    missing = sorted(set(release.PYTORCH_CPYTHONS) - {tag for tag, _, _ in pythons})
    check(not missing, "a CPython for every one PyTorch ships wheels for ("
          + ", ".join(release.PYTORCH_CPYTHONS) + ")" + (f": missing {missing} (make deps)" if missing else ""))
    for tag, exe, _ in pythons:
        version = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(exe))), "VERSION")
        if os.path.exists(version):
            print(f"{tag}: {open(version).read().strip()}", flush=True)
    sdist = release.build_sdist(args.source, out, work)
    name = os.path.basename(sdist)
    check(name == f"reservoir-{args.version}.tar.gz", f"sdist {name} carries version {args.version}")
    with tarfile.open(sdist) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
        pkg_info = t.extractfile(f"reservoir-{args.version}/PKG-INFO").read().decode()
    wanted = {"LICENSE", "README.md", "CMakeLists.txt", "pyproject.toml", "setup.py", "PKG-INFO",
              "scripts/packaging/reservoir_build.py", "python/reservoir/__init__.py"}
    check(wanted <= members, "the sdist holds " + ", ".join(sorted(wanted))
          + ("" if wanted <= members else f" (missing {sorted(wanted - members)})"))
    stray = sorted(m for m in members if m.startswith(("build/", "tests/", ".git")) or m.endswith(".so"))
    check(not stray, "the sdist holds no build output, tests or git files" + (f": {stray[:10]}" if stray else ""))
    check_metadata(pkg_info, "the sdist's PKG-INFO", args.version)
    if args.tracked is not None:
        left = untracked_outside_build(args.source, args.tracked)
        check(not left, "building the sdist writes nothing into the tree outside build/"
              + (f": {left[:10]}" if left else ""))
    project = release.unpack_sdist(sdist, work)
    built = 0
    for tag, python, _ in pythons:
        print(f"\n== release wheel for {tag} with {python}, from the sdist", flush=True)
        # RESERVOIR_TORCH_RELEASES unset, as `pip install` of the sdist by a
        # user without PyTorch (setup.py's default): every release.
        raw = release.build_wheel(python, project, os.path.join(work, "raw", tag), os.path.join(work, "cmake"),
                                  releases=None)
        wheel = release.repair(raw, out)
        if install_and_test(wheel, python, args, release=True) != 0:
            break
        built += 1
    return built


def check_metadata(text, where, version):
    """The package's metadata as an index shows it."""
    check(re.search(rf"^Version: {re.escape(version)}$", text, re.M) is not None,
          f"{where}: Version is the CMake project's {version}")
    check(re.search(r"^(License-Expression|License): Apache-2\.0$", text, re.M) is not None,
          f"{where}: the licence is Apache-2.0")
    check(re.search(r"^Requires-Python: >=3\.10$", text, re.M) is not None, f"{where}: Requires-Python >=3.10")
    check(re.search(r"^Description-Content-Type: text/markdown$", text, re.M) is not None
          and "# reservoir" in text, f"{where}: the README is the long description")
    for tag in release.PYTORCH_CPYTHONS:
        minor = f"3.{tag[3:]}"
        check(re.search(rf"^Classifier: Programming Language :: Python :: {re.escape(minor)}$", text, re.M)
              is not None, f"{where}: classifiers name Python {minor}, which a wheel is built for")


def listed_torch_releases(source):
    """The releases scripts/packaging/headers-torch.txt lists."""
    with open(os.path.join(source, "scripts", "packaging", "headers-torch.txt"), encoding="utf-8") as f:
        return re.findall(r"^torch==([0-9][0-9.]*)\s*$", f.read(), re.M)


def newest_torch_release(source):
    """The newest release scripts/packaging/headers-torch.txt lists."""
    return max(listed_torch_releases(source), key=lambda r: tuple(int(x) for x in r.split(".")))


def offline_wheel(python, args):
    """The wheel for one interpreter from the checkout, without a package
    index; one CMake build folder serves every interpreter (only the
    extension module differs, so a second one rebuilds little)."""
    source = os.path.abspath(args.source)
    tag, _ = interpreter_info(python)
    print(f"\n== building for {tag} with {python}, offline", flush=True)
    work = os.path.join(os.path.abspath(args.work), tag)
    os.makedirs(work, exist_ok=True)
    # 1. The wheel, from the checkout.
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("RESERVOIR_", "PYTHON", "VIRTUAL_ENV", "PIP_"))}
    # reservoir's own allocator for the newest release alone: the release
    # wheels (below) are built for every release; building each release's
    # library twice more here checked nothing new and was a third of the
    # test's time on a machine without a compiler cache.
    build_env = dict(base_env, RESERVOIR_CMAKE_BUILD_DIR=os.path.join(os.path.abspath(args.work), "cmake"),
                     RESERVOIR_TORCH_RELEASES=newest_torch_release(source),
                     PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if not has_modules(python, BUILD_TOOLS, build_env):
        build_env["PYTHONPATH"] = debian_tools(os.path.join(work, "build-tools"), BUILD_TOOLS)
    dist = os.path.join(work, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    # PyPA's build where the interpreter has it, pip otherwise: both front ends.
    if has_modules(python, ["build"], build_env):
        command = [python, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, source]
    else:
        command = [python, "-m", "pip", "wheel", source, "--no-build-isolation", "--no-deps", "-w", dist]
    rc = run(command, env=build_env).returncode
    check(rc == 0, f"{' '.join(command[1:4])} ... exits 0 (got {rc})")
    if rc != 0:
        return None
    if args.tracked is not None:
        left = untracked_outside_build(source, args.tracked)
        check(not left, "building the wheel writes nothing into the tree outside build/"
              + (f": {left[:10]}" if left else ""))
    wheels = glob.glob(os.path.join(dist, "*.whl"))
    check(len(wheels) == 1, f"one wheel in {dist} (found {wheels})")
    return wheels[0] if len(wheels) == 1 else None


def install_and_test(wheel, python, args, release):
    """Checks what a wheel holds, installs it into a fresh virtual
    environment and runs the tests against it."""
    source = os.path.abspath(args.source)
    tag, ext_suffix = interpreter_info(python)
    work = os.path.join(os.path.abspath(args.work), ("release-" if release else "") + tag)
    os.makedirs(work, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("RESERVOIR_", "PYTHON", "VIRTUAL_ENV", "PIP_"))}

    # 2. What the wheel holds.
    name = os.path.basename(wheel)
    platform = r"manylinux_2_[0-9]+_x86_64" if release else r"linux_x86_64"
    check(re.fullmatch(rf"reservoir-{re.escape(args.version)}-{tag}-{tag}-{platform}\.whl", name) is not None,
          f"wheel name {name} carries version {args.version}, tag {tag} and platform {platform}")
    with zipfile.ZipFile(wheel) as z:
        members = {i.filename: i for i in z.infolist()}
        info = f"reservoir-{args.version}.dist-info"
        expected = {"reservoir_torch.py", "reservoir_autoinstall.pth", "reservoir/__init__.py",
                    "reservoir/__main__.py", "reservoir/_autoinstall.py",
                    "reservoir/memory_saver.py", "reservoir/oom.py", "reservoir/vllm_sleep.py", f"reservoir/_core{ext_suffix}", "reservoir/bin/reservoir",
                    "reservoir/lib/libreservoir_torch.so"}
        # Folders' own entries (auditwheel writes them) are not files.
        payload = {n for n in members if not n.startswith(info + "/") and not n.endswith("/")}
        # auditwheel's folder of grafted libraries: none for a portable build.
        check(not any(n.startswith("reservoir.libs/") for n in payload),
              "nothing grafted into the wheel (reservoir.libs/ absent)")
        hooks = {n for n in payload if HOOKS.match(n)}
        if args.expect_preload.upper() in ("ON", "1", "TRUE", "YES"):
            expected.add("reservoir/lib/libreservoir_preload.so")
            # Built with CUDA's headers: a hooks library per PyTorch release in the PyPI cache.
            check(hooks, "the wheel holds PyTorch's hooks libraries (reservoir/lib/torch-<release>/)")
            if release:
                # Built with no PyTorch to read the release from: every one listed.
                every = {f"reservoir/lib/torch-{r}/libreservoir_torch_hooks.so"
                         for r in listed_torch_releases(source)}
                check(hooks == every, "the release wheel holds reservoir's own allocator for every release "
                      "headers-torch.txt lists" + ("" if hooks == every else
                                                   f": missing {sorted(every - hooks)}, unexpected {sorted(hooks - every)}"))
        expected |= hooks
        check(payload == expected, "the wheel holds exactly the package's files"
              + ("" if payload == expected else f": missing {sorted(expected - payload)}, "
                 f"unexpected {sorted(payload - expected)}"))
        metadata = z.read(f"{info}/METADATA").decode()
        check_metadata(metadata, f"{name}'s METADATA", args.version)
        check(f"{info}/licenses/LICENSE" in members or f"{info}/LICENSE" in members,
              f"{name} carries the licence text")
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        check(re.search(r"^reservoir = reservoir\.__main__:main$", entry_points, re.M) is not None,
              "a console script `reservoir` runs reservoir.__main__:main")
        check(re.search(r"^\[vllm\.general_plugins\]\nreservoir = reservoir\.vllm_sleep:register$", entry_points,
                        re.M) is not None,
              "vLLM's plugin loader finds reservoir's sleep-mode backend (vllm.general_plugins: reservoir)")
        tool = members.get("reservoir/bin/reservoir")
        check(tool is not None and (tool.external_attr >> 16) & 0o111 != 0,
              "reservoir/bin/reservoir is executable in the wheel")
        unpacked = os.path.join(work, "unpacked")
        shutil.rmtree(unpacked, ignore_errors=True)
        z.extractall(unpacked, [n for n in expected if n.endswith(".so") or n.endswith("/reservoir")])
    for member in sorted(n for n in expected if n.endswith(".so") or n.endswith("/reservoir")):
        dynamic = subprocess.run(["readelf", "-d", os.path.join(unpacked, member)], capture_output=True,
                                 text=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)
        extra = [n for n in needed if not ALLOWED_NEEDED.match(n)
                 and not (HOOKS.match(member) and TORCH_NEEDED.match(n))]
        check(needed and not extra and "RPATH" not in dynamic and "RUNPATH" not in dynamic,
              f"{member} needs only glibc, libstdc++ and libgcc"
              + (" and PyTorch's libraries" if HOOKS.match(member) else "") + f", no run path (needs {needed})")

    # 3. A fresh virtual environment with the wheel installed, used from a
    # folder outside the checkout.
    scratch = tempfile.mkdtemp(prefix=f"reservoir-wheel-{tag}-")
    try:
        venv = os.path.join(scratch, "venv")
        # With the interpreter's own site-packages visible (Debian's PyTorch,
        # for the suite's PyTorch test), which hold no reservoir.
        # A release wheel: a bare environment, with pytest from the wheelhouse.
        rc = run([python, "-m", "venv", venv] + ([] if release else ["--system-site-packages"]),
                 env=base_env).returncode
        check(rc == 0, f"{python} -m venv exits 0")
        if rc != 0:
            return 1
        vpy = os.path.join(venv, "bin", "python")
        install = [vpy, "-m", "pip", "install", "--no-index", wheel]
        if release:
            install += ["--find-links", release_wheelhouse(), "pytest"]
        else:
            install.insert(5, "--no-deps")
        rc = run(install, env=dict(base_env, PIP_DISABLE_PIP_VERSION_CHECK="1")).returncode
        check(rc == 0, "pip install of the wheel into the fresh environment exits 0")
        if rc != 0:
            return 1
        test_env = {"PATH": os.path.join(venv, "bin") + ":/usr/bin:/bin", "HOME": scratch,
                    "PYTHONNOUSERSITE": "1", "LANG": "C.UTF-8"}
        if not has_modules(vpy, ["pytest"], test_env):
            test_env["PYTHONPATH"] = debian_tools(os.path.join(scratch, "test-tools"), TEST_TOOLS)
        run_dir = os.path.join(scratch, "run")
        os.makedirs(run_dir)
        for f in glob.glob(os.path.join(source, "tests", "python", "*.py")):
            shutil.copy(f, run_dir)
        shutil.copy(os.path.join(source, "tests", "packaging", "wheel", "installed_check.py"), run_dir)
        trace = os.path.join(run_dir, "small.trace")
        shutil.copy(os.path.join(source, "examples", "traces", "transformer_training.trace"), trace)

        rc = run([vpy, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                  "-W", "ignore::DeprecationWarning:_pytest.assertion.rewrite", run_dir], env=test_env,
                 cwd=run_dir).returncode
        check(rc == 0, "the project's Python test suite passes against the installed package")
        site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              env=test_env, capture_output=True, text=True, check=True).stdout.strip()
        rc = run([vpy, "installed_check.py", site, os.path.join(venv, "bin"), args.version, trace,
                  args.expect_preload], env=test_env, cwd=run_dir).returncode
        check(rc == 0, "installed_check.py: the installed package's location, version, files and command")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def release_wheelhouse():
    return release.wheelhouse()


if __name__ == "__main__":
    sys.exit(main())
