"""reservoir: GPU memory management for deep-learning programs.

Standalone use, on any device (HostDevice: real host memory, so contents and
resident memory can be checked without a GPU)::

    import reservoir
    dev = reservoir.HostDevice()
    saver = reservoir.Saver(dev, config="expandable_segments:True")
    with saver.region("weights", cpu_backup=True):
        ptr = saver.allocate(1 << 20)
    saver.pause("weights")     # physical memory released, contents on the host
    saver.resume("weights")    # same address, same bytes

With PyTorch (CUDA)::

    reservoir.install_torch("expandable_segments:True")   # before the first CUDA tensor
    with reservoir.region("kv_cache"):
        kv = torch.empty(..., device="cuda")
    reservoir.pause("kv_cache"); ...; reservoir.resume("kv_cache")

The module-level functions act on default_saver(device), the saver PyTorch
allocates from. reservoir.memory_saver is a drop-in for torch_memory_saver.

An out-of-memory error that explains itself, with PyTorch's own allocator or
reservoir's (reservoir.oom; RESERVOIR_EXPLAIN_OOM=1 without a code change)::

    reservoir.explain_oom()   # the next torch.OutOfMemoryError says why, and what fits

The package holds its native files itself (pip install . puts them there, and
the CMake build tree's build/python/reservoir has the same layout):
torch_library_path() is PyTorch's pluggable allocator for ctypes users
(reservoir_torch), preload_library_path() the LD_PRELOAD interposer for any
CUDA program, cli_path() the `reservoir` command-line tool (also installed as
the `reservoir` command, and run by `python -m reservoir`).
"""
import contextlib
import itertools
import logging
import os

from ._core import (  # noqa: F401
    ConfigError,
    CudaRuntimeDevice,
    CudaVmmDevice,
    Device,
    DeviceError,
    DeviceUnavailableError,
    Error,
    HostDevice,
    InvalidPointerError,
    InvariantError,
    OutOfMemoryError,
    Saver,
    SimDevice,
    TraceError,
    UsageError,
    __version__,
    default_saver,
    open_device,
    rss_bytes,
)
from . import _core
from .oom import explain_oom  # noqa: F401


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_logger = logging.getLogger("reservoir")
_torch_installed = False


def _package_file(relative, what):
    path = os.path.join(_PACKAGE_DIR, relative)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{what} is not in this reservoir package: {path} does not exist "
            f"(reservoir {__version__} at {_PACKAGE_DIR})")
    return path


def library_path():
    """The file PyTorch's CUDAPluggableAllocator loads (this module's own)."""
    return os.path.abspath(_core.__file__)


def torch_library_path():
    """libreservoir_torch.so: the pluggable allocator as a library of its own."""
    return _package_file(os.path.join("lib", "libreservoir_torch.so"), "libreservoir_torch.so")


def preload_library_path():
    """libreservoir_preload.so: LD_PRELOAD it to serve a CUDA program's allocations.

    Built only where CUDA's headers were found when the package was built.
    """
    return _package_file(os.path.join("lib", "libreservoir_preload.so"),
                         "libreservoir_preload.so (built only where CUDA's headers are found)")


def cli_path():
    """The `reservoir` command-line tool (replay, verify, export, advise...)."""
    return _package_file(os.path.join("bin", "reservoir"), "the reservoir command-line tool")


def advise(path, capacity=None, configs=None, torch_version=None, device=None):
    """`reservoir advise PATH --json` as a dict: why a recording ran out of
    memory and which setting makes it fit, the answer first (["answer"]);
    the same keys as the JSON (docs/tools.md). capacity is a size with a
    unit ("80GiB"); configs a list of settings to sweep instead of the
    default list. Raises reservoir.UsageError with the tool's message when
    it cannot advise (exit 2), reservoir.TraceError when a rank of a job
    cannot be read (exit 3)."""
    import json
    import subprocess

    args = [cli_path(), "advise", os.fspath(path), "--json"]
    if capacity is not None:
        args += ["--capacity", str(capacity)]
    for c in configs or []:
        args += ["-c", c]
    if torch_version is not None:
        args += ["--torch-version", str(torch_version)]
    if device is not None:
        args += ["--device", str(int(device))]
    r = subprocess.run(args, capture_output=True, text=True,
                       env={**os.environ, "RESERVOIR_PROGRESS": "0"})
    if r.returncode != 0:
        message = r.stderr.strip() or r.stdout.strip()
        raise (TraceError if r.returncode == 3 else UsageError)(f"advise {path}: {message}")
    return json.loads(r.stdout)


def install_torch(config=None, device_kind=None):
    """Make reservoir PyTorch's CUDA allocator (call before any CUDA allocation).

    config uses PYTORCH_CUDA_ALLOC_CONF's syntax (and reservoir's policies);
    device_kind is cuda-runtime (default), cuda-vmm, host or sim.
    """
    global _torch_installed
    import torch

    pluggable = getattr(torch.cuda.memory, "CUDAPluggableAllocator", None)
    if pluggable is None:
        raise RuntimeError(
            f"PyTorch {torch.__version__} has no CUDAPluggableAllocator (PyTorch 2.0 or later needed)")
    release = torch.__version__.split("+")[0]
    hooks = torch_hooks_path(release)
    with _install_settings(config, device_kind, "install_torch"):
        if hooks is not None:
            # Every hook connected: empty_cache, the memory fraction,
            # record_stream and the pools reach reservoir.
            _call_hooks(hooks, "reservoir_torch_install_hooks", release, "install_torch")
            _torch_installed = True
            return torch.cuda.memory._get_current_allocator()
        allocator = pluggable(library_path(), "reservoir_torch_malloc", "reservoir_torch_free")
        torch.cuda.memory.change_current_allocator(allocator)
    # Python's binding takes malloc and free only: PyTorch then ignores
    # empty_cache(), set_per_process_memory_fraction() and record_stream()
    # for this allocator (reservoir's own functions still do them).
    _logger.warning(
        "reservoir.install_torch: no hooks library for PyTorch %s in this package (built for: %s); "
        "installed through CUDAPluggableAllocator's malloc and free only: torch.cuda.empty_cache(), "
        "set_per_process_memory_fraction() and Tensor.record_stream() do not reach reservoir "
        "(call reservoir.empty_cache(), reservoir.set_memory_fraction() instead; "
        "record_stream is not honoured)", torch.__version__, ", ".join(torch_hook_releases()) or "none")
    _torch_installed = True
    return allocator


_SETTING_VARIABLES = ("RESERVOIR_ALLOC_CONF", "RESERVOIR_TORCH_DEVICE")


@contextlib.contextmanager
def _install_settings(config, device_kind, caller):
    """Sets the environment an install reads (config, device_kind), checks
    it as every allocator will take it, and puts it back as it was when the
    check or the install fails: a refused call changes nothing."""
    import ctypes

    saved = {name: os.environ.get(name) for name in _SETTING_VARIABLES}

    def restore():
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    if config is not None:
        os.environ["RESERVOIR_ALLOC_CONF"] = config
    if device_kind is not None:
        os.environ["RESERVOIR_TORCH_DEVICE"] = device_kind
    try:
        lib = ctypes.CDLL(library_path())
        lib.reservoir_torch_last_error.restype = ctypes.c_char_p
        if lib.reservoir_torch_check_settings() != 0:
            raise ValueError(f"reservoir.{caller}: " + lib.reservoir_torch_last_error().decode())
        yield
    except BaseException:
        restore()
        raise


def _call_hooks(hooks, function, release, caller):
    """Calls `function`(this module's path, release) of the release's hooks
    library; RuntimeError with the library's reason when it fails."""
    import ctypes

    lib = ctypes.CDLL(hooks)
    entry = getattr(lib, function)
    entry.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.reservoir_torch_hooks_error.restype = ctypes.c_char_p
    if entry(os.fsencode(library_path()), release.encode()) != 0:
        raise RuntimeError(f"reservoir.{caller}: " + lib.reservoir_torch_hooks_error().decode())


def use_as_allocator(config=None, device_kind=None):
    """Make reservoir PyTorch's own CUDA allocator (a CUDAAllocator, as PyTorch's
    native caching allocator is), before any CUDA allocation: unlike
    install_torch()'s pluggable allocator, torch.cuda.memory_stats(),
    memory_summary(), empty_cache(), set_per_process_memory_fraction(),
    reset_peak_memory_stats(), record_stream, MemPool and CUDA-graph pools and
    the out-of-memory observers all reach reservoir. Needs this package's
    library for the running PyTorch release (torch_hook_releases()); a
    RuntimeError names what is missing otherwise (install_torch() then).
    What reservoir does not implement raises PyTorch's error naming the
    method (docs/integrations.md lists it). Without changing
    the program: RESERVOIR_TORCH_ALLOCATOR=own (docs/integrations.md).

    config uses PYTORCH_CUDA_ALLOC_CONF's syntax (and reservoir's policies).
    """
    global _torch_installed
    import torch

    release = torch.__version__.split("+")[0]
    hooks = torch_hooks_path(release)
    if hooks is None:
        raise RuntimeError(_no_library("use_as_allocator", torch.__version__))
    with _install_settings(config, device_kind, "use_as_allocator"):
        _call_hooks(hooks, "reservoir_torch_use_as_allocator", release, "use_as_allocator")
    _torch_installed = True
    return torch.cuda.memory._get_current_allocator()


def torch_installed():
    """Whether install_torch() made reservoir PyTorch's allocator in this process."""
    return _torch_installed


def torch_hook_releases():
    """The PyTorch releases this package has its own-allocator library for, oldest first."""
    lib = os.path.join(_PACKAGE_DIR, "lib")
    if not os.path.isdir(lib):
        return []
    found = [d[len("torch-"):] for d in os.listdir(lib)
             if d.startswith("torch-") and
             os.path.exists(os.path.join(lib, d, "libreservoir_torch_hooks.so"))]
    return sorted(found, key=_release_key)


def _release_key(release):
    """(2, 12, 1) of "2.12.1+cu130"; missing or odd parts count as 0."""
    parts = []
    for piece in release.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def torch_hooks_path(version):
    """The library built for PyTorch `version`'s minor release ("2.12.0" or
    "2.12.0+cu130" runs 2.12.1's: a release's patches keep its allocator
    interface), or None."""
    minor = _release_key(version)[:2]
    for release in torch_hook_releases():
        if _release_key(release)[:2] == minor:
            return os.path.join(_PACKAGE_DIR, "lib", "torch-" + release, "libreservoir_torch_hooks.so")
    return None


def _no_library(caller, version):
    """What to do on a PyTorch release this package has no library for."""
    built = torch_hook_releases()
    listed = ", ".join(built) or "none"
    if built and _release_key(version) > _release_key(built[-1]):
        why = (f"PyTorch {version} is newer than every release this package was built for ({listed}): "
               "use a reservoir release built for it, or reservoir.install_torch() (the pluggable allocator: "
               "allocations and frees reach reservoir; torch.cuda.memory_stats(), snapshots and MemPool "
               "do not) until then")
    elif _release_key(version) < (2, 0, 0):
        why = f"PyTorch {version} is older than 2.0, which brought the pluggable allocator: reservoir needs 2.0 or later"
    else:
        why = (f"this package has no library for PyTorch {version} (built for: {listed}): use "
               "reservoir.install_torch() (the pluggable allocator: allocations and frees reach reservoir; "
               "torch.cuda.memory_stats(), snapshots and MemPool do not), or build reservoir against it "
               "(docs/integrations.md)")
    return f"reservoir.{caller}: {why}"


def region(tag, cpu_backup=False, device=0):
    """Context manager: allocations of this thread go to `tag` inside it."""
    return default_saver(device).region(tag, cpu_backup)


def untagged(device=0):
    """Context manager: allocations of this thread go outside every tag."""
    return default_saver(device).untagged()


def pause(tag=None, device=0):
    """Releases the physical memory of `tag` (every tag when None)."""
    default_saver(device).pause(tag)


def resume(tag=None, device=0):
    """Maps `tag`'s memory again at the same addresses (every tag when None)."""
    default_saver(device).resume(tag)


def tags(device=0):
    return default_saver(device).tags()


def stats(device=0, tag=None):
    """torch.cuda.memory_stats()'s keys, for everything or one tag."""
    return default_saver(device).stats(tag)


def reset_peak_stats(device=0):
    """Peaks fall to the current values, for everything and each tag."""
    default_saver(device).reset_peak_stats()


def reset_accumulated_stats(device=0):
    """Allocated and freed totals and the counters fall to zero."""
    default_saver(device).reset_accumulated_stats()


def memory_summary(device=0, abbreviated=False):
    return default_saver(device).memory_summary(abbreviated)


def snapshot(device=0):
    """PyTorch's snapshot dict (torch.cuda.memory._snapshot()'s layout)."""
    return default_saver(device).snapshot()


def empty_cache(device=0):
    """Returns every allocator's unused cached memory to the device."""
    default_saver(device).empty_cache()


def set_memory_fraction(fraction, device=0):
    default_saver(device).set_memory_fraction(fraction)


def record_memory_history(enabled=True, max_entries=1_000_000, stacks=False, device=0):
    """Records allocator events (with stacks when asked) for snapshot()."""
    default_saver(device).record_memory_history(enabled, max_entries, stacks)


def dump_snapshot(path, device=0):
    """Writes the snapshot as a pickle that pytorch.org/memory_viz opens."""
    import pickle

    with open(path, "wb") as f:
        pickle.dump(snapshot(device), f)
