// What the simulated cuDNN's sources share (cudnn.cpp, cudnn_backend.cpp).
#pragma once

#include <cudnn.h>

#include <string>

#include "sim.hpp"

namespace reservoir::simcuda::cudnn {

// A call that computes: taken without computing when kernels are allowed,
// else refused, naming it (CUDNN_STATUS_NOT_SUPPORTED, its reason left for
// cudnnGetLastErrorString).
cudnnStatus_t kernel(const char* name);
// Whether `h` is a live handle of cudnnCreate's.
bool valid_handle(cudnnHandle_t h);
// What cudnnGetLastErrorString says next.
void set_last_error(const std::string& what);

}  // namespace reservoir::simcuda::cudnn
