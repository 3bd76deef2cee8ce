// What each PyTorch release's allocator interface has, named by the release
// that brought it: the one place the libraries built per release
// (torch_allocator.cpp, torch_hooks.cpp) differ. Each line was read from the
// release's own headers (c10/cuda/CUDACachingAllocator.h,
// c10/core/CachingDeviceAllocator.h, c10/core/AllocatorConfig.h).
#pragma once

#ifndef RESERVOIR_TORCH_MINOR
#error "RESERVOIR_TORCH_MINOR (the minor release of the PyTorch headers) must be defined"
#endif

#define RESERVOIR_TORCH_SINCE(minor) (RESERVOIR_TORCH_MINOR >= (minor))

// 2.9: c10's allocator settings parser takes a hook that follows
// torch.cuda.memory._set_allocator_settings at run time.
#define RESERVOIR_TORCH_SETTINGS_HOOK RESERVOIR_TORCH_SINCE(9)
// 2.12: getContextForPointer() (a live allocation's frames) and
// attachOomRejectionObserver().
#define RESERVOIR_TORCH_CONTEXT_FOR_POINTER RESERVOIR_TORCH_SINCE(12)
#define RESERVOIR_TORCH_OOM_REJECTION_OBSERVER RESERVOIR_TORCH_SINCE(12)
// 2.13: DeviceStats::reserved_bytes_by_private_pools; AllocatorConfigInfo's
// max_round_threshold and max_cached_size; IPC handles of version 3.
#define RESERVOIR_TORCH_PRIVATE_POOL_STATS RESERVOIR_TORCH_SINCE(13)
#define RESERVOIR_TORCH_CONFIG_ROUND_AND_CACHED RESERVOIR_TORCH_SINCE(13)
#define RESERVOIR_TORCH_IPC_HANDLE_VERSION (RESERVOIR_TORCH_SINCE(13) ? 3 : 2)
// 2.14: supportsUserMetadata() and annotateMemory()
// (torch.cuda.memory._annotate_memory).
#define RESERVOIR_TORCH_ANNOTATE_MEMORY RESERVOIR_TORCH_SINCE(14)
