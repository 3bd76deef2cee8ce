// torch.multiprocessing's CUDA tensors under reservoir's own allocator:
// PyTorch's own handle format ([version]['c'][cudaIpcMemHandle_t of the
// segment], the block's offset in it), so that a process under PyTorch's
// native allocator opens what reservoir shares and the other way round.
// Version 2 up to PyTorch 2.12, 3 from 2.13 (the same 'c' payload). Segments
// of cudaMalloc only: under expandable segments and paging, memory is mapped
// through CUDA's virtual memory API, which a cudaIpcMemHandle cannot name.
// Thread-safe (a lock of its own: a deleter runs wherever the last user lets
// go). Internal to the per-release libraries.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "torch_types.hpp"

namespace reservoir_torch_hooks {

class IpcHandles {
 public:
  // The handle of the segment at `base` for the allocation at `ptr` in it.
  cca::ShareableHandle share(void* ptr, void* base);
  // Opens what another process shared, once per handle while it is in use
  // (as PyTorch's allocator caches it); closed when the last user lets go.
  std::shared_ptr<void> open(const std::string& handle);

 private:
  static constexpr char kHandleVersion = RESERVOIR_TORCH_IPC_HANDLE_VERSION;
  std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;  // while in use
};

}  // namespace reservoir_torch_hooks
