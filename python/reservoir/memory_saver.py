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

On first use it makes reservoir PyTorch's allocator (reservoir.install_torch,
with RESERVOIR_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF), which must happen
before the first CUDA tensor; call reservoir.install_torch() yourself at
start-up to choose the config. Differences from torch_memory_saver are listed
in docs/integrations.md ("torch_memory_saver drop-in").
"""
import contextlib
import logging
import os

import reservoir

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"


class TorchMemorySaver:
    def __init__(self, device=0):
        self._device = device
        self._initialized = False
        self._hook_mode = None

    # Accepted for compatibility ("preload" or "torch"); reservoir has one
    # mechanism (the pluggable allocator), so both values behave the same.
    @property
    def hook_mode(self):
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value):
        self._hook_mode = value

    def _ensure_initialized(self):
        if self._initialized:
            return
        kind = os.environ.get("RESERVOIR_TORCH_DEVICE", "")
        if kind not in ("host", "sim"):
            import torch

            if torch.cuda.is_available():
                if not reservoir.torch_installed():
                    try:
                        reservoir.install_torch()
                    except RuntimeError as e:
                        raise RuntimeError(
                            "reservoir.memory_saver: could not make reservoir PyTorch's allocator "
                            f"({e}); call reservoir.install_torch() before the first CUDA tensor"
                        ) from e
        self._initialized = True

    def _saver(self):
        self._ensure_initialized()
        return reservoir.default_saver(self._device)

    def _known(self, tag):
        return any(t["tag"] == tag for t in self._saver().tags())

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
        """Allocations of this thread inside go to `tag`."""
        with self._saver().region(tag, enable_cpu_backup):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations of this thread inside go outside every tag."""
        with self._saver().untagged():
            yield

    def pause(self, tag=None):
        """Releases the memory of `tag` (every tag when None). A tag nothing was
        allocated under is ignored, as torch_memory_saver does; pausing a paused
        tag raises reservoir.UsageError (torch_memory_saver exits)."""
        if tag is not None and not self._known(tag):
            logger.debug("pause(%r): nothing was allocated under this tag", tag)
            return
        self._saver().pause(tag)

    def resume(self, tag=None):
        """Restores the memory of `tag` (every tag when None) at the same addresses."""
        if tag is not None and not self._known(tag):
            logger.debug("resume(%r): nothing was allocated under this tag", tag)
            return
        self._saver().resume(tag)

    @property
    def enabled(self):
        return True

    def cuda_graph(self, *args, **kwargs):
        raise NotImplementedError(
            "reservoir.memory_saver: cuda_graph() is not provided; capture CUDA graphs outside "
            "regions (their private pool is served by the untagged allocator)")


torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver
