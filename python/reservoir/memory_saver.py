"""A drop-in for torch_memory_saver, backed by reservoir.

Switch with one import::

    # from torch_memory_saver import torch_memory_saver
    from reservoir.memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = Model().cuda()
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.resume("kv_cache")

On first use, before CUDA is initialized (the first CUDA tensor, or any call
that initializes it, torch.cuda.mem_get_info() among them), it makes reservoir
PyTorch's allocator (reservoir.use_as_allocator where this package has the
running release's library, else reservoir.install_torch; with
RESERVOIR_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF; call either yourself at
start-up to choose the config); after it, PyTorch refuses a change of
allocator: its own stays and regions allocate from MemPools of reservoir's
allocator, as torch_memory_saver's torch mode does.
Tags span devices: a region tags what its thread allocates on any device,
and pause and resume act on every device holding the tag. Differences from torch_memory_saver are listed
in docs/integrations.md ("torch_memory_saver drop-in").
"""
import contextlib
import ctypes
import json
import logging
import os
import threading
from typing import Literal, Optional

try:
    import torch
except ImportError:  # the saver works on reservoir's own devices without PyTorch
    torch = None
# (A stand-in torch, as the GPU bundle's checks use without a GPU, may lack it.)
_Tensor = getattr(torch, "Tensor", "torch.Tensor")

import reservoir

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["mmap", "pinned"]


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _check_backup_arguments(enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
    """torch_memory_saver's checks of a region's backup arguments, with its errors."""
    if cpu_backup_backend is not None:
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in ("mmap", "pinned"):
            raise ValueError(f"cpu_backup_backend={cpu_backup_backend!r}: expected 'pinned' or 'mmap'")
    assert not (enable_cpu_backup and enable_disk_backup), \
        "enable_cpu_backup and enable_disk_backup are mutually exclusive"


def _interposer():
    """reservoir's LD_PRELOAD interposer when this process runs under it
    (configure_subprocess() puts it in children's LD_PRELOAD), else None."""
    lib = ctypes.CDLL(None)
    try:
        lib.reservoir_preload_region_push
    except AttributeError:
        return None
    lib.reservoir_preload_last_error.restype = ctypes.c_char_p
    lib.reservoir_preload_last_error_kind.restype = ctypes.c_char_p
    lib.reservoir_preload_region_push.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                  ctypes.POINTER(ctypes.c_ulonglong)]
    lib.reservoir_preload_region_pop.argtypes = [ctypes.c_ulonglong]
    lib.reservoir_preload_pause.argtypes = [ctypes.c_char_p]
    lib.reservoir_preload_resume.argtypes = [ctypes.c_char_p]
    lib.reservoir_preload_tags_json.restype = ctypes.c_void_p
    lib.reservoir_preload_set_disk_backup_dir.argtypes = [ctypes.c_char_p]
    lib.reservoir_preload_set_retain_backup.argtypes = [ctypes.c_int]
    lib.reservoir_preload_set_memory_margin.argtypes = [ctypes.c_ulonglong]
    lib.reservoir_preload_set_free_releases.argtypes = [ctypes.c_int]
    lib.reservoir_preload_read_backup.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


class _InterposerSaver:
    """The saver of reservoir's interposer, with the Python module's Saver
    methods the drop-in uses. PyTorch's own caching allocator stays in
    charge: a region allocates from a MemPool of its own (as
    torch_memory_saver's preload mode does), whose segments the interposer
    serves from the tag's memory."""

    def __init__(self, lib):
        self._lib = lib
        self._pools = {}
        self._local = threading.local()
        # PyTorch frees segments only to give them back (empty_cache).
        lib.reservoir_preload_set_free_releases(1)

    def _check(self, rc, what):
        if rc < 0:
            message = self._lib.reservoir_preload_last_error().decode()
            kind = self._lib.reservoir_preload_last_error_kind().decode()
            raise getattr(reservoir, kind, reservoir.Error)(message)
        return rc

    @contextlib.contextmanager
    def _scope(self, tag, storage, pool):
        token = ctypes.c_ulonglong(0)
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            with torch.cuda.use_mem_pool(pool):
                self._check(self._lib.reservoir_preload_region_push(
                    None if tag is None else tag.encode(), (storage or "").encode(),
                    ctypes.byref(token)), "region")
                try:
                    yield
                finally:
                    self._check(self._lib.reservoir_preload_region_pop(token), "region")
        finally:
            self._local.depth -= 1
            if self._local.depth == 0:
                # PyTorch before 2.15 asserts when a MemPool dies while another
                # pool is in use on the thread: spent pools go here.
                self._local.spent = []

    def region(self, tag, cpu_backup=False, storage=None):
        key = (tag, storage if cpu_backup else None, torch.cuda.current_device())
        if key not in self._pools:
            self._pools[key] = torch.cuda.MemPool()
        return self._scope(tag, storage if cpu_backup else None, self._pools[key])

    @contextlib.contextmanager
    def untagged(self):
        pool = torch.cuda.MemPool()  # used once, as torch_memory_saver's disable()
        if not hasattr(self._local, "spent"):
            self._local.spent = []
        self._local.spent.append(pool)  # released when the outermost region closes
        with self._scope(None, None, pool):
            yield

    def pause(self, tag=None):
        self._check(self._lib.reservoir_preload_pause(None if tag is None else tag.encode()), "pause")

    def resume(self, tag=None):
        self._check(self._lib.reservoir_preload_resume(None if tag is None else tag.encode()), "resume")

    def tags(self):
        raw = self._lib.reservoir_preload_tags_json()
        if not raw:
            self._check(-1, "tags")
        try:
            return json.loads(ctypes.string_at(raw).decode())
        finally:
            ctypes.CDLL(None).free(ctypes.c_void_p(raw))

    def set_disk_backup_dir(self, path):
        self._check(self._lib.reservoir_preload_set_disk_backup_dir(path.encode()), "set_disk_backup_dir")

    @property
    def retain_backup(self):
        return bool(self._check(self._lib.reservoir_preload_retain_backup(), "retain_backup"))

    @retain_backup.setter
    def retain_backup(self, value):
        self._check(self._lib.reservoir_preload_set_retain_backup(1 if value else 0), "retain_backup")

    @property
    def memory_margin(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin.setter
    def memory_margin(self, value):
        self._check(self._lib.reservoir_preload_set_memory_margin(int(value)), "memory_margin")

    def read_backup(self, ptr, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        found = self._check(self._lib.reservoir_preload_read_backup(ptr, nbytes, buf), "read_backup")
        return buf.raw if found else None


class _EveryDevice:
    """reservoir's default savers of every device as one, as
    torch_memory_saver's tags span devices: a region tags what its thread
    allocates on any device (savers created inside it too), and pause and
    resume act on every device that holds the tag.

    With `pools` (PyTorch's own allocator was in use before the first
    region), a region also routes its device's allocations through a MemPool
    of reservoir's pluggable allocator, one per tag, backup and device, as
    torch_memory_saver's torch mode does: PyTorch keeps caching, and the
    pool's segments are the tag's memory."""

    def __init__(self, pools=False):
        self._pools = {} if pools else None
        self._allocator = None
        self._settings = {}  # what set_disk_backup_dir and the properties set, for every saver
        self._configured = set()  # devices whose saver has them

    def _savers(self):
        devices = reservoir._core.default_saver_devices()
        for d in devices:
            if d not in self._configured:
                saver = reservoir.default_saver(d)
                for name, value in self._settings.items():
                    if name == "disk_backup_dir":
                        saver.set_disk_backup_dir(value)
                    else:
                        setattr(saver, name, value)
                self._configured.add(d)
        return [reservoir.default_saver(d) for d in devices]

    def _current_device(self):
        return torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0

    def _pool(self, key):
        if key not in self._pools:
            if self._allocator is None:
                self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                    reservoir.library_path(), "reservoir_torch_malloc", "reservoir_torch_free")
            self._pools[key] = torch.cuda.MemPool(allocator=self._allocator.allocator())
        return self._pools[key]

    @contextlib.contextmanager
    def _open(self, tag, cpu_backup, storage):
        reservoir.default_saver(self._current_device())  # the current device's, with its settings
        self._savers()
        region = reservoir._core._push_region_everywhere(tag, cpu_backup, storage)
        try:
            yield
        finally:
            reservoir._core._pop_region_everywhere(region)

    @contextlib.contextmanager
    def region(self, tag, cpu_backup=False, storage=None):
        if self._pools is None:
            with self._open(tag, cpu_backup, storage):
                yield
            return
        pool = self._pool((tag, storage if cpu_backup else None, self._current_device()))
        with torch.cuda.use_mem_pool(pool), self._open(tag, cpu_backup, storage):
            yield

    @contextlib.contextmanager
    def untagged(self):
        if self._pools is None:
            with self._open(None, False, None):
                yield
            return
        # PyTorch's own memory, in a pool of its own used once (as
        # torch_memory_saver's disable()), so that no block of a tag's pool
        # is handed out inside.
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            yield

    def _holding(self, tag):
        return [s for s in self._savers() if tag is None or any(t["tag"] == tag for t in s.tags())]

    def pause(self, tag=None, contents="as_regions"):
        for saver in self._holding(tag):
            saver.pause(tag, contents=contents)

    def resume(self, tag=None):
        for saver in self._holding(tag):
            saver.resume(tag)

    def tags(self):
        return [t for s in self._savers() for t in s.tags()]

    def read_backup(self, ptr, nbytes):
        for saver in self._savers():
            data = saver.read_backup(ptr, nbytes)
            if data is not None:
                return data
        return None

    def _set(self, name, value):
        self._settings[name] = value
        self._configured.clear()
        self._savers()

    def set_disk_backup_dir(self, path):
        self._set("disk_backup_dir", path)

    @property
    def retain_backup(self):
        if "retain_backup" in self._settings:
            return self._settings["retain_backup"]
        return reservoir.default_saver(self._current_device()).retain_backup

    @retain_backup.setter
    def retain_backup(self, value):
        self._set("retain_backup", bool(value))

    @property
    def memory_margin(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin.setter
    def memory_margin(self, value):
        self._set("memory_margin", int(value))


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside run under reservoir's interposer
    (LD_PRELOAD), where the drop-in drives its tags: every CUDA allocation of
    the child is reservoir's from the start."""
    lib = reservoir.preload_library_path()
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{lib}:{old}" if old else lib
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


class TorchMemorySaver:
    def __init__(self, device=0):
        self._device = device
        self._initialized = False
        self._hook_mode = None
        self._impl = None

    # Accepted for compatibility ("preload" or "torch"); reservoir chooses by
    # itself: under its interposer (configure_subprocess) it drives the
    # interposer's tags, else it makes reservoir PyTorch's allocator.
    @property
    def hook_mode(self):
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value):
        self._hook_mode = value

    def _ensure_initialized(self):
        if self._initialized:
            return
        lib = _interposer()
        if lib is not None and torch is not None and not hasattr(torch.cuda, "MemPool"):
            # The interposer's regions allocate from MemPools of their own,
            # which PyTorch has from 2.5: before, reservoir becomes PyTorch's
            # allocator in this process instead (its device calls reach the
            # CUDA runtime itself, past the interposer).
            lib = None
        if lib is not None:
            self._impl = _InterposerSaver(lib)
            saver = self._impl
        else:
            saver = self._install()
        self._configure(saver)
        self._initialized = True

    def _install(self):
        kind = os.environ.get("RESERVOIR_TORCH_DEVICE", "")
        pools = False
        if kind not in ("host", "sim") and torch is not None and torch.cuda.is_available():
            if not reservoir.torch_installed():
                if torch.cuda.is_initialized():
                    # PyTorch's own allocator holds memory already: regions
                    # go through MemPools of reservoir's allocator instead.
                    if not hasattr(torch.cuda, "MemPool"):
                        raise RuntimeError(
                            f"reservoir.memory_saver: PyTorch {torch.__version__} has allocated CUDA "
                            "memory already and has no torch.cuda.MemPool (2.5 or later) to route "
                            "regions through: use the memory saver (or call reservoir.install_torch()) "
                            "before the first CUDA tensor")
                    pools = True
                else:
                    try:
                        # PyTorch's own allocator interface where this package
                        # has the running release's library (memory_stats(),
                        # memory_allocated() and snapshots then answer), the
                        # pluggable allocator elsewhere.
                        if reservoir.torch_hooks_path(torch.__version__) is not None:
                            reservoir.use_as_allocator()
                        else:
                            reservoir.install_torch()
                    except RuntimeError as e:
                        raise RuntimeError(
                            "reservoir.memory_saver: could not make reservoir PyTorch's allocator "
                            f"({e}); call reservoir.install_torch() before the first CUDA tensor"
                        ) from e
        self._impl = _EveryDevice(pools=pools)
        return self._impl

    def _configure(self, saver):
        # torch_memory_saver's environment, read once as it reads it.
        if os.environ.get("TMS_DISK_BACKUP_DIR"):
            saver.set_disk_backup_dir(os.environ["TMS_DISK_BACKUP_DIR"])
        if _env_flag("TMS_RETAIN_CPU_BACKUP"):
            saver.retain_backup = True
        self._default_backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
        if self._default_backend not in ("pinned", "mmap"):
            raise ValueError(f"TMS_INIT_CPU_BACKUP_BACKEND={self._default_backend!r}: "
                             "expected 'pinned' or 'mmap'")

    def _saver(self):
        self._ensure_initialized()
        return self._impl

    def _known(self, tag):
        return any(t["tag"] == tag for t in self._saver().tags())

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ):
        """Allocations of this thread inside go to `tag`. enable_cpu_backup
        keeps their contents over a pause in host memory: pinned buffers, or
        with cpu_backup_backend="mmap" a file mapping whose pages leave the
        process's resident memory; enable_disk_backup keeps them in a file of
        the directory set_disk_backup_dir() (or TMS_DISK_BACKUP_DIR) names."""
        _check_backup_arguments(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        saver = self._saver()
        if enable_disk_backup:
            scope = saver.region(tag, True, "disk")
        elif enable_cpu_backup:
            scope = saver.region(tag, True, cpu_backup_backend or self._default_backend)
        else:
            scope = saver.region(tag, False)
        with scope:
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations of this thread inside go outside every tag."""
        with self._saver().untagged():
            yield

    def pause(self, tag: Optional[str] = None):
        """Releases the memory of `tag` (every tag when None). A tag nothing was
        allocated under is ignored, as torch_memory_saver does; pausing a paused
        tag raises reservoir.UsageError (torch_memory_saver exits)."""
        if tag is not None and not self._known(tag):
            logger.debug("pause(%r): nothing was allocated under this tag", tag)
            return
        self._saver().pause(tag)

    def resume(self, tag: Optional[str] = None):
        """Restores the memory of `tag` (every tag when None) at the same addresses."""
        if tag is not None and not self._known(tag):
            logger.debug("resume(%r): nothing was allocated under this tag", tag)
            return
        self._saver().resume(tag)

    @property
    def enabled(self):
        return True

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        """Tagged allocations that would leave less than this much device
        memory free fail with PyTorch's out-of-memory error."""
        self._saver().memory_margin = int(value)

    @property
    def retain_cpu_backup(self) -> bool:
        return self._saver().retain_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        """Keep each tag's backup after resume, so get_cpu_backup() still
        finds it (its host memory stays held until the next pause)."""
        self._saver().retain_backup = bool(value)

    def get_cpu_backup(self, x: _Tensor, zero_copy: bool = False):
        """The host copy of `x` taken at its tag's last pause (a CPU tensor of
        the same dtype, shape and strides), or None when there is none. Always
        a copy: zero_copy is accepted and gives a copy too."""
        assert x.is_cuda, f"{x.device=}"
        assert x.is_contiguous(), f"{x.shape=} {x.stride()=} {x.dtype=}"
        data = self._saver().read_backup(x.data_ptr(), x.nbytes)
        if data is None:
            return None
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(x.dtype).view(x.shape)

    def set_disk_backup_dir(self, path: str):
        """Where enable_disk_backup regions write their backup files from the
        next pause on (created if needed)."""
        os.makedirs(path, exist_ok=True)
        self._saver().set_disk_backup_dir(path)

    @contextlib.contextmanager
    def cuda_graph(
            self,
            cuda_graph, pool=None, stream=None, capture_error_mode='global',
            tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
            cpu_backup_backend: Optional[CpuBackupBackend] = None,
    ):
        """torch.cuda.graph(...) whose memory goes to `tag`: the graph's
        private pool is kept in the tag's allocator, so pause(tag) releases
        it and resume(tag) maps it again at the same addresses (the graph
        replays after resume)."""
        _check_backup_arguments(enable_cpu_backup, False, cpu_backup_backend)  # before the capture
        self._ensure_initialized()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                              capture_error_mode=capture_error_mode):
            with self.region(tag=tag, enable_cpu_backup=enable_cpu_backup,
                             cpu_backup_backend=cpu_backup_backend):
                yield


torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver


def install_as_torch_memory_saver():
    """Makes `import torch_memory_saver` give this module from now on (in this
    process), for frameworks that import torch_memory_saver by name (sglang,
    verl, slime): call it before they import it."""
    import sys

    sys.modules["torch_memory_saver"] = sys.modules[__name__]
