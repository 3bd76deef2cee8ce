// What each PyTorch release's allocator interface has, named by the release
// that brought it: the one place the libraries built per release
// (torch_allocator.hpp and its files, torch_hooks.cpp) differ. Each line was read from the
// release's own headers (c10/cuda/CUDACachingAllocator.h,
// c10/core/CachingDeviceAllocator.h, c10/core/AllocatorConfig.h).
#pragma once

#ifndef RESERVOIR_TORCH_MINOR
#error "RESERVOIR_TORCH_MINOR (the minor release of the PyTorch headers) must be defined"
#endif

#define RESERVOIR_TORCH_SINCE(minor) (RESERVOIR_TORCH_MINOR >= (minor))

// 2.8: emptyCache() and snapshot() of one pool; createOrIncrefPool() (was
// ensureExistsAndIncrefPool()); setUseOnOOM() (MemPool(use_on_oom=True));
// recordHistory()'s clearHistory; torch.compile's contexts
// (push/popCompileContext) and a trace entry's pool and compile context.
#define RESERVOIR_TORCH_POOL_EMPTY_CACHE RESERVOIR_TORCH_SINCE(8)
#define RESERVOIR_TORCH_POOL_SNAPSHOT RESERVOIR_TORCH_SINCE(8)
#define RESERVOIR_TORCH_CREATE_OR_INCREF_POOL RESERVOIR_TORCH_SINCE(8)
#define RESERVOIR_TORCH_USE_ON_OOM RESERVOIR_TORCH_SINCE(8)
#define RESERVOIR_TORCH_HISTORY_CLEAR RESERVOIR_TORCH_SINCE(8)
#define RESERVOIR_TORCH_COMPILE_CONTEXT RESERVOIR_TORCH_SINCE(8)
// 2.9: MempoolId_t moved from c10::cuda to c10; the DeviceAllocator base
// (c10/core/CachingDeviceAllocator.h) took the statistics and emptyCache.
#define RESERVOIR_TORCH_C10_MEMPOOL_ID RESERVOIR_TORCH_SINCE(9)
// 2.9: AllocatorConfigInfo::graph_capture_record_stream_reuse.
#define RESERVOIR_TORCH_CONFIG_RECORD_STREAM_REUSE RESERVOIR_TORCH_SINCE(9)
// 2.10: getExpandableSegmentSizes(), setNoSplit() (MemPool(no_split=True)),
// set/getUserMetadata() and a trace entry's user metadata.
#define RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES RESERVOIR_TORCH_SINCE(10)
#define RESERVOIR_TORCH_NO_SPLIT_POOLS RESERVOIR_TORCH_SINCE(10)
#define RESERVOIR_TORCH_USER_METADATA RESERVOIR_TORCH_SINCE(10)
// 2.11: the snapshot and trace types (TraceEntry, AnnotationEntry,
// SegmentInfo, BlockInfo) moved from c10::cuda::CUDACachingAllocator to
// c10::CachingDeviceAllocator; snapshot() takes include_traces;
// recordHistory() takes skip_actions; setUseOnOOM() takes the flag;
// createOrIncrefPool() takes the allocator as a shared_ptr.
#define RESERVOIR_TORCH_DEVICE_TRACE_TYPES RESERVOIR_TORCH_SINCE(11)
#define RESERVOIR_TORCH_SNAPSHOT_INCLUDE_TRACES RESERVOIR_TORCH_SINCE(11)
#define RESERVOIR_TORCH_HISTORY_SKIP_ACTIONS RESERVOIR_TORCH_SINCE(11)
#define RESERVOIR_TORCH_USE_ON_OOM_FLAG RESERVOIR_TORCH_SINCE(11)
#define RESERVOIR_TORCH_POOL_ALLOCATOR_SHARED RESERVOIR_TORCH_SINCE(11)

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
