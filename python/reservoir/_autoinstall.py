"""Makes reservoir PyTorch's CUDA allocator from the environment, and explains
out-of-memory errors (RESERVOIR_EXPLAIN_OOM=1: reservoir.explain_oom()), for
programs that cannot be changed: with RESERVOIR_TORCH_ALLOCATOR set, the moment
`import torch` finishes (before any CUDA tensor can exist), reservoir is
installed as

  own        PyTorch's own allocator (reservoir.use_as_allocator)
  pluggable  a CUDAPluggableAllocator (reservoir.install_torch)

with the settings of RESERVOIR_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF's syntax and
reservoir's policies) and the backend of RESERVOIR_TORCH_DEVICE.

reservoir_autoinstall.pth, installed beside the package, imports this module
at interpreter start-up when the variable is set; it costs nothing otherwise.
A value it does not know, or an install that fails, makes `import torch` fail
with the reason: a job never runs on an allocator it was not meant to. It
steps aside, saying so in one line on stderr, where PyTorch's own settings
(PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF) ask for another backend
(backend:cudaMallocAsync), and in a process under reservoir's interposer
(LD_PRELOAD: the drop-in's configure_subprocess()), whose CUDA allocations
the interposer serves already: a variable inherited from a parent breaks
neither.
"""
import importlib.abc
import importlib.util
import os
import sys

VARIABLE = "RESERVOIR_TORCH_ALLOCATOR"
# reservoir.explain_oom() for a program that cannot be changed (docs/tools.md).
EXPLAIN_VARIABLE = "RESERVOIR_EXPLAIN_OOM"
CHOICES = ("own", "pluggable")


def _choice():
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value not in CHOICES:
        raise RuntimeError(f"{VARIABLE}={os.environ.get(VARIABLE, '')!r}: expected one of "
                           f"{', '.join(CHOICES)} (or unset, for PyTorch's allocator)")
    return value


def _settings_items(text):
    """The key:value items of an allocator settings string, split at the
    commas outside brackets (roundup_power2_divisions:[256:1,>:4])."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth <= 0:
            key, _, value = text[start:i].partition(":")
            if key.strip():
                items.append((key.strip(), value.strip()))
            start = i + 1
    return items


def _other_backend():
    """The backend other than the native one that PyTorch's own settings ask
    for (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF: backend:cudaMallocAsync),
    and the variable that asks, or None."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for key, value in _settings_items(os.environ.get(name, "")):
            if key == "backend" and value != "native":
                return value, name
    return None


def _under_interposer():
    """Whether reservoir's LD_PRELOAD interposer serves this process's CUDA
    allocations already (a child of the drop-in's configure_subprocess())."""
    import ctypes

    try:
        ctypes.CDLL(None).reservoir_preload_region_push
        return True
    except (AttributeError, OSError):
        return False


def install():
    """Installs the allocator the variable names, then the explanation of
    out-of-memory errors where RESERVOIR_EXPLAIN_OOM asks for it; torch must
    be imported."""
    if os.environ.get(VARIABLE):
        _install_allocator()
    if _explain_requested():
        import reservoir

        reservoir.explain_oom()


def _explain_requested():
    value = os.environ.get(EXPLAIN_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise RuntimeError(f"{EXPLAIN_VARIABLE}={os.environ.get(EXPLAIN_VARIABLE)!r}: expected 1 (on) or 0 (off)")


def _install_allocator():
    """Installs the allocator the variable names. Steps aside, with one line
    on stderr, where the process asked PyTorch for another backend or runs
    under reservoir's interposer."""
    import reservoir

    choice = _choice()
    other = _other_backend()
    if other is not None:
        print(f"reservoir: {VARIABLE}={choice} ignored: {other[1]} asks PyTorch for backend:{other[0]}, "
              "which PyTorch keeps", file=sys.stderr)
        return
    if _under_interposer():
        print(f"reservoir: {VARIABLE}={choice} ignored: this process runs under reservoir's interposer "
              "(LD_PRELOAD), which serves its CUDA allocations already", file=sys.stderr)
        return
    try:
        if choice == "own":
            reservoir.use_as_allocator()
        else:
            reservoir.install_torch()
    except Exception as e:
        raise RuntimeError(f"{VARIABLE}={choice}: reservoir could not be installed: {e}") from e


class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds torch as the other finders would, and installs reservoir as
    soon as torch's own module has run."""

    def __init__(self):
        self._spec = None

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._spec is not None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._spec = spec
                spec.loader = _Wrapped(spec.loader, self)
                return spec
        return None

    def done(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _Wrapped(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._finder.done()
        self._loader.exec_module(module)
        install()

    def __getattr__(self, name):  # the wrapped loader's other methods
        return getattr(self._loader, name)


def arm():
    """Installs now when torch is imported already, else right after it is
    (a wrong value too fails then, as `import torch`: an error at start-up
    would only be printed, and the job would run on PyTorch's allocator)."""
    if "torch" in sys.modules:
        install()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


if os.environ.get(VARIABLE) or os.environ.get(EXPLAIN_VARIABLE):
    arm()
