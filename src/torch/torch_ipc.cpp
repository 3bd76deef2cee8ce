// CUDA IPC handles in PyTorch's format (torch_ipc.hpp).
#include "torch_ipc.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

namespace reservoir_torch_hooks {

cca::ShareableHandle IpcHandles::share(void* ptr, void* base) {
  cudaIpcMemHandle_t handle;
  const cudaError_t rc = cudaIpcGetMemHandle(&handle, base);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(
        false, "reservoir (PyTorch's allocator): shareIpcHandle of ", ptr,
        ": CUDA cannot export its segment at ", base, " (", cudaGetErrorString(rc),
        "); tensors shared between processes need reservoir's native policy, whose segments are "
        "cudaMalloc's (expandable segments and paging map memory through CUDA's virtual memory "
        "API)");
  }
  std::string out;
  out.push_back(kHandleVersion);
  out.push_back('c');
  out.append(reinterpret_cast<const char*>(&handle), sizeof handle);
  return cca::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base), out};
}

std::shared_ptr<void> IpcHandles::open(const std::string& handle) {
  std::lock_guard lock(mutex_);
  if (auto it = opened_.find(handle); it != opened_.end()) {
    if (std::shared_ptr<void> alive = it->second.lock()) return alive;
  }
  const char* payload = handle.data();
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {  // a bare handle predates the version byte
    TORCH_CHECK(handle.size() >= 2, "reservoir (PyTorch's allocator): getIpcDevPtr: a handle of ",
                handle.size(), " bytes");
    TORCH_CHECK(handle[0] <= kHandleVersion,
                "received sharable handle from a future version of torch that this version does "
                "not know how "
                "to handle");
    TORCH_CHECK(handle[1] == 'c', "reservoir (PyTorch's allocator): getIpcDevPtr: ",
                handle[1] == 'e'
                    ? "a handle of PyTorch's expandable segments is not supported (the sharing "
                      "process can use expandable_segments:False for the tensors it shares)"
                    : "not a handle of PyTorch's (unknown type)");
    TORCH_CHECK(handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                "reservoir (PyTorch's allocator): getIpcDevPtr: a cudaMalloc handle of ",
                handle.size(), " bytes, not ", 2 + sizeof(cudaIpcMemHandle_t));
    payload += 2;
  }
  cudaIpcMemHandle_t ipc;
  std::memcpy(&ipc, payload, sizeof ipc);
  const c10::DeviceIndex device = c10::cuda::current_device();
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, ipc, cudaIpcMemLazyEnablePeerAccess));
  std::shared_ptr<void> opened(ptr, [this, device, handle](void* p) {
    {
      c10::cuda::CUDAGuard guard(device);
      if (cudaIpcCloseMemHandle(p) != cudaSuccess)
        (void)cudaGetLastError();  // a deleter does not throw
    }
    std::lock_guard lock(mutex_);
    auto it = opened_.find(handle);
    if (it != opened_.end() && it->second.expired()) opened_.erase(it);  // not a newer opening's
  });
  opened_[handle] = opened;
  return opened;
}

}  // namespace reservoir_torch_hooks
