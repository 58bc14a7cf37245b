#include "kernels/profile_range.h"

#ifdef KEEL_HAVE_CUDA
#include <nvtx3/nvToolsExt.h>  // header-only NVTX 3 (CUDA toolkit)
#endif

namespace keel {

#ifdef KEEL_HAVE_CUDA
void profile_range_push(const char* name) { nvtxRangePushA(name); }
void profile_range_pop() { nvtxRangePop(); }
#else
void profile_range_push(const char*) {}
void profile_range_pop() {}
#endif

}  // namespace keel
