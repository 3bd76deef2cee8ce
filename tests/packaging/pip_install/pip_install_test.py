"""reservoir installed as a Python user installs it: `pip install .` from a
clone of the checkout, and `pip install` of the sdist, each into a fresh
virtual environment that holds PyPI's PyTorch (the PyPI cache's install of
the newest release, its packages linked into the environment's
site-packages, as pip would have put them there), with build isolation and
the build's requirements from the PyPI cache's wheelhouse (no index).

Then, from a folder outside the checkout, with nothing on PYTHONPATH and only
the environment's bin/ and the system's on PATH:
  - `reservoir --help` and `python -m reservoir --help` print the same usage;
  - the package holds reservoir's own allocator for the environment's
    PyTorch release alone (setup.py reads it from the environment);
  - on the simulated device (LD_PRELOAD, the one path a machine without a
    GPU needs), RESERVOIR_TORCH_ALLOCATOR=own makes reservoir PyTorch's
    allocator, and RESERVOIR_EXPLAIN_OOM=1 puts the answer into PyTorch's
    out-of-memory error, under PyTorch's allocator and under reservoir's.
Every other CPython 3.10+ builds reservoir without PyTorch to read a release
from (reservoir's own allocator for every release) in python_wheel
(tests/packaging/wheel/wheel_test.py: `pip wheel` of the sdist under each,
installed, its suite run), so that each release's library is compiled once
for the packages, not once more for each test. Prints how long each `pip install` took.

With --cpython-torch cpXY-torch-RELEASE (repeated), instead: under each of
those CPythons, `pip install .` into a fresh environment holding PyPI's
PyTorch for it (3.12 to 3.14: 2.15; 3.10: 2.14.1, pip's newest there), and
the checks above from that environment.

usage: pip_install_test.py --source CHECKOUT --work DIR --torch-site SITE
                           --simcuda LIBCUDART [--python PYTHON]
                           [--cpython-torch FOLDER ...]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "wheel"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts", "packaging"))
from wheel_test import clone_of, tracked_files  # noqa: E402
import wheels as release  # noqa: E402

failures = []

# Fragmentation on a 1 GiB simulated device (tests/torch/scenarios.py).
sys.path.insert(0, os.path.join(HERE, "..", "..", "torch"))
from scenarios import FRAGMENTATION_LINE as ANSWER, FRAGMENTED_REQUEST, FRAGMENTING_STEPS  # noqa: E402

PROGRAM = "import json, torch\nMiB = 1 << 20\n" + FRAGMENTING_STEPS + textwrap.dedent(f"""
    try:
        {FRAGMENTED_REQUEST}
        message = None
    except torch.OutOfMemoryError as e:
        message = str(e)
    print("RESULT " + json.dumps({{"backend": torch.cuda.get_allocator_backend(), "message": message,
                                  "torch": torch.__version__}}))
""")


def check(condition, what):
    print(("ok    " if condition else "FAIL  ") + what, flush=True)
    if not condition:
        failures.append(what)


def run(cmd, env, cwd=None, capture=True):
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=cwd, text=True, capture_output=capture)


def distribution(entry):
    """The distribution a site-packages entry belongs to, normalized
    ("torch-2.15.0.dist-info" and "torch": "torch")."""
    return re.split(r"-[0-9]", entry, maxsplit=1)[0].lower().replace("-", "_").removesuffix(".dist_info")


def environment(python, scratch, name, torch_site, first=None):
    """A fresh virtual environment with PyPI's PyTorch in its site-packages
    (with `first`, a folder of packages built for this CPython, before
    torch_site's: of a distribution in both, first's alone)."""
    venv = os.path.join(scratch, name)
    r = run([python, "-m", "venv", venv], env=dict(os.environ))
    check(r.returncode == 0, f"{python} -m venv {name} exits 0 ({r.stderr.strip()[-300:]})")
    vpy = os.path.join(venv, "bin", "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The environment's own pip and setuptools stay (torch needs setuptools
    # only to build extensions).
    own = ("setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth", "pip")
    taken = set()
    for folder in ([first] if first else []) + [torch_site]:
        names = [e for e in os.listdir(folder) if not e.startswith(".") and e not in ("bin", "__pycache__")
                 and e not in own and e.split("-")[0] not in own]
        for entry in names:
            if distribution(entry) not in taken:
                os.symlink(os.path.join(folder, entry), os.path.join(site, entry))
        taken |= {distribution(e) for e in names}
    return venv, vpy


def pip_install(vpy, target, env, cwd, what):
    """pip install TARGET; (whether it succeeded, what it printed)."""
    start = time.monotonic()
    r = run([vpy, "-m", "pip", "install", "-v", target], env=env, cwd=cwd)
    seconds = time.monotonic() - start
    out = r.stdout + r.stderr
    check(r.returncode == 0, f"pip install {what} exits 0 ({seconds:.0f} s)"
          + ("" if r.returncode == 0 else f":\n{out[-4000:]}"))
    print(f"pip install {what}: {seconds:.0f} s", flush=True)
    return r.returncode == 0, out


def commands(venv, vpy, scratch, what):
    """`reservoir --help` and `python -m reservoir --help` from the
    environment, outside the checkout; returns (the environment, the folder)."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=scratch)
    env = {"PATH": os.path.join(venv, "bin") + ":/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
           "PYTHONNOUSERSITE": "1"}
    tool = run(["reservoir", "--help"], env=env, cwd=run_dir)
    check(tool.returncode == 0 and tool.stdout.startswith("reservoir: replay, verify"),
          f"{what}: `reservoir --help` prints the usage ({tool.returncode}: {tool.stdout[:80]!r} {tool.stderr[-300:]})")
    module = run([vpy, "-m", "reservoir", "--help"], env=env, cwd=run_dir)
    check(module.returncode == 0 and module.stdout == tool.stdout,
          f"{what}: `python -m reservoir --help` prints the same ({module.returncode}, {module.stderr[-300:]})")
    return env, run_dir


def hook_releases(vpy, env, run_dir):
    r = run([vpy, "-c", "import reservoir; print(','.join(reservoir.torch_hook_releases()))"], env=env,
            cwd=run_dir)
    return r.stdout.strip() if r.returncode == 0 else f"exit {r.returncode}: {r.stderr[-300:]}"


def use(venv, vpy, scratch, simcuda, torch_release, what):
    """The installed package, from a folder outside the checkout."""
    env, run_dir = commands(venv, vpy, scratch, what)
    hooks = hook_releases(vpy, env, run_dir)
    check(hooks == torch_release,
          f"{what}: own allocator built for the environment's PyTorch alone, {torch_release} (got {hooks!r})")
    program = os.path.join(run_dir, "fragmented.py")
    with open(program, "w") as f:
        f.write(PROGRAM)
    device = dict(env, LD_PRELOAD=simcuda, RESERVOIR_SIMCUDA_MEMORY="1GiB", RESERVOIR_SIMCUDA_KERNELS="skip",
                  RESERVOIR_OOM_DIR=os.path.join(run_dir, "oom"))
    for label, extra, backend in (("RESERVOIR_EXPLAIN_OOM=1", {"RESERVOIR_EXPLAIN_OOM": "1"}, "native"),
                                  ("RESERVOIR_TORCH_ALLOCATOR=own RESERVOIR_EXPLAIN_OOM=1",
                                   {"RESERVOIR_TORCH_ALLOCATOR": "own", "RESERVOIR_EXPLAIN_OOM": "1"},
                                   "reservoir")):
        r = run([vpy, "-W", "ignore", program], env=dict(device, **extra), cwd=run_dir)
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        got = json.loads(lines[-1][len("RESULT "):]) if lines else {}
        check(r.returncode == 0 and got.get("backend") == backend,
              f"{what}, {label}: PyTorch's allocator backend is {backend!r} "
              f"(got {got.get('backend')!r}, exit {r.returncode}: {r.stderr[-1500:]})")
        message = got.get("message") or ""
        check(message.startswith("CUDA out of memory. Tried to allocate 500.00 MiB.") and ANSWER in message,
              f"{what}, {label}: the error carries PyTorch's message and reservoir's answer "
              f"({message[-600:]!r})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--torch-site", required=True)
    ap.add_argument("--simcuda", required=True)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--cpython-torch", action="append", default=[], metavar="FOLDER",
                    help="instead: PyPI's PyTorch for another CPython (a PyPI cache folder cpXY-torch-RELEASE "
                         "holding its packages built for cpXY; the rest from --torch-site): pip install . "
                         "into an environment of that CPython holding it, and use it there")
    args = ap.parse_args()
    source = os.path.abspath(args.source)
    files = tracked_files(source)
    if files is None:
        sys.exit(f"{source} is not a git checkout")
    with open(os.path.join(args.torch_site, "torch", "version.py")) as f:
        torch_release = re.search(r"^__version__ = '([0-9.]+)", f.read(), re.M).group(1)
    simcuda = os.path.abspath(args.simcuda)
    os.makedirs(args.work, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="pip-install-", dir=args.work)
    try:
        clone = clone_of(source, files, os.path.join(scratch, "clone"))
        # Build isolation, its requirements from the wheelhouse alone.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))
               and k not in ("RESERVOIR_CMAKE_BUILD_DIR", "RESERVOIR_TORCH_RELEASES", "CMAKE_ARGS")}
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=release.wheelhouse(), PIP_DISABLE_PIP_VERSION_CHECK="1",
                   CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2"))

        if args.cpython_torch:
            other_cpythons_with_torch(args, clone, env, scratch, simcuda)
            return summary()
        # 1. pip install . from the clone; 2. pip install of its sdist.
        sdist = release.build_sdist(clone, os.path.join(scratch, "sdist"), scratch)
        for name, target, cwd, what in (("venv-checkout", ".", clone, "from the checkout"),
                                        ("venv-sdist", sdist, scratch, "from the sdist")):
            venv, vpy = environment(args.python, scratch, name, args.torch_site)
            ok, out = pip_install(vpy, target, env, cwd, what)
            if ok:
                check(f"reservoir: own allocator for PyTorch {torch_release} (PyTorch {torch_release}" in out,
                      f"{what}: setup.py says which release it builds reservoir's own allocator for, and why")
                use(venv, vpy, scratch, simcuda, torch_release, what)

    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary()


def summary():
    if failures:
        print(f"{len(failures)} check(s) failed:")
        for f in failures:
            print("  " + f.splitlines()[0])
        return 1
    return 0


def other_cpythons_with_torch(args, clone, env, scratch, simcuda):
    """pip install . from the clone under each CPython named, into a fresh
    environment holding PyPI's PyTorch for it, then the package used there
    as under the first CPython (use())."""
    interpreters = {tag: python for tag, python, _ in release.cpythons()}
    for folder in args.cpython_torch:
        m = re.fullmatch(r"(cp3[0-9]+)-torch-([0-9.]+)", os.path.basename(os.path.normpath(folder)))
        check(m is not None, f"{folder} is named cpXY-torch-RELEASE")
        if m is None:
            continue
        tag, torch_release = m.groups()
        python = interpreters.get(tag)
        check(python is not None, f"a CPython {tag} is on this machine (found: {', '.join(interpreters)})")
        if python is None:
            continue
        what = f"{tag} with PyTorch {torch_release}, from the checkout"
        venv, vpy = environment(python, scratch, f"venv-{tag}-torch", args.torch_site, first=folder)
        ok, out = pip_install(vpy, ".", env, clone, what)
        if ok:
            check(f"reservoir: own allocator for PyTorch {torch_release} (PyTorch {torch_release}" in out,
                  f"{what}: setup.py builds reservoir's own allocator for the environment's PyTorch")
            use(venv, vpy, scratch, simcuda, torch_release, what)


if __name__ == "__main__":
    sys.exit(main())
