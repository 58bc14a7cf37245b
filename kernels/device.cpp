#include "kernels/device.h"

#ifdef KEEL_HAVE_CUDA
namespace keel::cuda {
int device_count();
std::string device_name(int index);
int64_t current_device_memory();
}  // namespace keel::cuda
#endif

namespace keel {

namespace {
DeviceWaitHook g_device_wait_hook = nullptr;
}
void set_device_wait_hook(DeviceWaitHook hook) { g_device_wait_hook = hook; }
DeviceWaitHook device_wait_hook() { return g_device_wait_hook; }

#ifdef KEEL_HAVE_CUDA
bool cuda_built() { return true; }
int cuda_device_count() { return cuda::device_count(); }
std::string cuda_device_name(int index) { return cuda::device_name(index); }
int64_t cuda_current_device_memory() { return cuda::current_device_memory(); }
#else
bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { return ""; }
int64_t cuda_current_device_memory() { return 0; }
#endif

}  // namespace keel
