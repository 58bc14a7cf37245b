// Which accelerators this process can use.
#pragma once

#include <string>

namespace keel {

bool cuda_built();             // was keel compiled with the CUDA backend?
int cuda_device_count();       // usable GPUs (0 when not built with CUDA or none present)
std::string cuda_device_name(int index);

}  // namespace keel
