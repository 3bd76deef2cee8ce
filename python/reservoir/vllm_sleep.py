"""reservoir as vLLM's sleep mode: a sleep-mode backend named "reservoir"
(vLLM 0.33's SleepModeBackend seam, `--sleep-mode-backend reservoir`) whose
tagged allocations, sleeps, discards and wakes go through reservoir's saver.

vLLM registers the backend through the `vllm.general_plugins` entry point
this package declares (`register()` below). Two seams of vLLM are fixed to
its own allocator, and are redirected here while the selected backend is
reservoir's: the worker asks `get_mem_allocator_instance()` for the
allocator of its tagged pools (weights, kv_cache, runtime), which on CUDA is
`CuMemAllocator.get_instance()`; `register()` makes that return
`ReservoirMemAllocator` when the current vLLM config selects "reservoir".
(The CUDA-graph pool is vLLM's only with its own backend: vLLM routes graph
capture to a tag only when the backend is "cumem", docs/integrations.md.)

What a tag keeps while asleep is chosen per tag (RESERVOIR_VLLM_RESTORE, e.g.
"kv_cache:zero"; `ReservoirMemAllocator.set_restore_mode`):
  backup  copied to pinned host memory at sleep, whatever the offload tags
          say (the buffers are kept for the next cycle);
  zero    nothing copied; mapped and zeroed on wake, so a KV cache never
          comes back as garbage;
  none    nothing copied; the memory comes back holding whatever it holds;
and, unset, as vLLM's sleep says: backed up when the tag is among the
offload tags, else none.
"""
import contextlib
import gc
import os
import threading

MODES = ("backup", "zero", "none")
DEFAULT_TAG = "default"  # CuMemAllocator's tag for a pool opened without one
# Selective wake may defer only these (vLLM's DEFERRABLE_TAGS); a wake
# restores every other tag.
DEFERRABLE_TAGS = ("weights", "kv_cache")


def _parse_restore(text, what="RESERVOIR_VLLM_RESTORE"):
    modes = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        tag, sep, mode = item.partition(":")
        if not sep or not tag or mode not in MODES:
            raise ValueError(f"{what}: '{item}' is not TAG:MODE with MODE one of {', '.join(MODES)}")
        modes[tag] = mode
    return modes


class ReservoirMemAllocator:
    """vLLM's MemAllocator protocol (use_memory_pool, sleep, discard,
    wake_up, get_current_usage) over reservoir's saver: each tag a pool of
    its own, paused and resumed at the same addresses."""

    _instance = None
    _lock = threading.Lock()

    @classmethod
    def get_instance(cls):
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        import torch  # noqa: F401 - the saver's pools are PyTorch's MemPools
        from reservoir.memory_saver import _EveryDevice
        self._saver = _EveryDevice(pools=True)
        self._modes = _parse_restore(os.environ.get("RESERVOIR_VLLM_RESTORE", ""))
        self._tags = []  # in the order first used
        self.current_tag = DEFAULT_TAG

    # -- what a tag keeps --------------------------------------------------
    def set_restore_mode(self, tag, mode):
        """backup, zero or none for `tag` from its next sleep on; None: as
        vLLM's sleep says."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"restore mode of tag '{tag}': '{mode}' is not one of {', '.join(MODES)}")
        if mode is None:
            self._modes.pop(tag, None)
        else:
            self._modes[tag] = mode

    def restore_mode(self, tag):
        return self._modes.get(tag)

    def _asleep(self):
        """The tags paused now, from one look at every device's saver."""
        return {t["tag"] for t in self._saver.tags() if t["paused"]}

    def state(self, tag):
        """RUNNING or ASLEEP."""
        if tag not in self._tags:
            raise ValueError(f"unknown tag '{tag}' (known: {', '.join(self._tags) or 'none'})")
        return "ASLEEP" if tag in self._asleep() else "RUNNING"

    # -- vLLM's MemAllocator protocol ---------------------------------------
    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        tag = DEFAULT_TAG if tag is None else tag
        if not isinstance(tag, str):
            raise TypeError(f"use_memory_pool: a tag is a str, not {type(tag).__name__}")
        if tag not in self._tags:
            self._tags.append(tag)
        old, self.current_tag = self.current_tag, tag
        try:
            # Every tag can be backed up: which are is chosen at sleep.
            with self._saver.region(tag, cpu_backup=True):
                yield
        finally:
            self.current_tag = old

    def _running(self, tags):
        asleep = self._asleep()
        return [t for t in self._tags if t in tags and t not in asleep]

    def _contents(self, tag, offload):
        mode = self._modes.get(tag)
        if mode is None:
            mode = "backup" if offload else "none"
        return {"backup": "as_regions", "zero": "zero", "none": "discard"}[mode]

    def sleep(self, offload_tags=None):
        if offload_tags is None:
            offload_tags = (DEFAULT_TAG,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        import torch
        torch.cuda.synchronize()
        # Each running tag as one pause of its pool (one bulk copy, not a
        # call per allocation); a tag asleep already keeps its policy.
        for tag in self._running(self._tags):
            self._saver.pause(tag, contents=self._contents(tag, tag in offload_tags))
        gc.collect()
        torch.cuda.empty_cache()

    def discard(self, tags):
        if isinstance(tags, str):
            tags = (tags,)
        import torch
        torch.cuda.synchronize()
        for tag in self._running(tags):
            mode = self._modes.get(tag)
            self._saver.pause(tag, contents="zero" if mode == "zero" else "discard")

    def wake_up(self, tags=None):
        import torch
        gc.collect()
        torch.cuda.empty_cache()
        asleep = self._asleep()
        for tag in self._tags:
            if tag in asleep and (tags is None or tag in tags or tag not in DEFERRABLE_TAGS):
                self._saver.resume(tag)

    def get_current_usage(self):
        return sum(t["allocated_bytes"] for t in self._saver.tags())


# Set once a worker of this process was made with the reservoir backend
# selected: vLLM asks for the allocator of the weights' pool (load_model)
# before it makes the config current again.
_worker_selected = threading.Event()


def _selects(config):
    return getattr(getattr(config, "model_config", None), "sleep_mode_backend", None) == "reservoir"


def _env_selected():
    """RESERVOIR_VLLM_SLEEP=1: every vLLM worker of a process that has it
    (Ray's workers inherit it through a runtime_env's env_vars) takes
    reservoir's allocator for its tagged pools, whichever backend its config
    names: vLLM's own ("cumem") then drives it."""
    value = os.environ.get("RESERVOIR_VLLM_SLEEP", "")
    if value in ("", "0"):
        return False
    if value != "1":
        raise ValueError(f"RESERVOIR_VLLM_SLEEP='{value}': not accepted; accepted: 1 (reservoir's allocator for "
                         "vLLM's tagged pools) or 0 (vLLM's own)")
    return True


def _selected():
    """This process's vLLM worker, the current vLLM config, or
    RESERVOIR_VLLM_SLEEP selects the reservoir backend."""
    if _worker_selected.is_set() or _env_selected():
        return True
    try:
        from vllm.config import get_current_vllm_config
        return _selects(get_current_vllm_config())
    except Exception:  # noqa: BLE001 - no config current: vLLM's own
        return False


def _backend_class():
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

    class ReservoirSleepBackend(SleepModeBackend):
        """Level 1: weights backed up to host memory, the rest dropped (as
        each tag's restore mode says); level 2: weights dropped too (vLLM
        reloads them). Runtime state is backed up at every level, as vLLM's
        own backend keeps it."""

        def suspend(self, level=1):
            self._state = "SUSPENDED"
            offload = ("runtime", "cudagraph") + (("weights",) if level == 1 else ())
            ReservoirMemAllocator.get_instance().sleep(offload_tags=offload)

        def resume(self, tags=None):
            self._state = "RESUMING"
            ReservoirMemAllocator.get_instance().wake_up(tags)
            self._state = "RUNNING"

        def discard(self, tags):
            ReservoirMemAllocator.get_instance().discard(tags)
            self._state = "SUSPENDED"

        @classmethod
        def preserves_communicators(cls):
            return True  # NCCL's buffers are outside the tagged pools

    return ReservoirSleepBackend


def __getattr__(name):
    # The backend class is made on first use: vLLM imports this module by
    # name only once the backend is selected.
    if name == "ReservoirSleepBackend":
        cls = _backend_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def register():
    """vLLM's general-plugin hook: registers the "reservoir" sleep-mode
    backend, and has vLLM's allocator look-up give reservoir's allocator
    where the current config selects it."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    if "reservoir" not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend("reservoir", __name__, "ReservoirSleepBackend")
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # noqa: BLE001 - no CUDA allocator here: nothing to redirect
        return
    if getattr(CuMemAllocator.get_instance, "_reservoir", False):
        return
    own = CuMemAllocator.get_instance

    def get_instance():
        if _selected():
            return ReservoirMemAllocator.get_instance()
        return own()

    get_instance._reservoir = True
    CuMemAllocator.get_instance = staticmethod(get_instance)
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except Exception:  # noqa: BLE001 - no worker in this process's vLLM
        return
    made = WorkerBase.__init__

    def worker_init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if _selects(getattr(self, "vllm_config", None)):
            _worker_selected.set()

    WorkerBase.__init__ = worker_init
