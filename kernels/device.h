// Which accelerators this process can use.
#pragma once

#include <cstdint>
#include <string>

namespace keel {

bool cuda_built();             // was keel compiled with the CUDA backend?
int cuda_device_count();       // usable GPUs (0 when not built with CUDA or none present)
std::string cuda_device_name(int index);
int64_t cuda_current_device_memory();  // total bytes of this thread's current GPU (0: none)

// Called repeatedly, about every millisecond, while host code waits for a device (the CUDA
// backend's stream synchronisations), when set. The communication layer installs one for
// multi-GPU runs (parallel::poll_nccl_async_ops): a collective that never completes on the GPU
// then ends in the hang watchdog's report instead of a wait that never returns. It may throw
// to abandon the wait. Not set: devices are waited for with a plain blocking call.
using DeviceWaitHook = void (*)();
void set_device_wait_hook(DeviceWaitHook hook);
DeviceWaitHook device_wait_hook();

}  // namespace keel
