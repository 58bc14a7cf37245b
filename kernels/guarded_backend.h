// A backend whose memory the host cannot touch between ops: the CPU reference, with every
// allocation made inaccessible (mprotect PROT_NONE) except while one of the backend's own ops
// runs. Host code that reads or writes backend memory directly, which on a GPU would be a
// device pointer, then faults at once, and a SIGSEGV handler names the allocation. This tests,
// on machines without a GPU, that the model and train layers move data only through backend
// ops and copies.
//
// keel train runs on it with KEEL_GUARD_BACKEND_MEMORY=1 (one process on the CPU; multi-rank
// CPU communicators read host memory legitimately). Slow: every op changes page protections.
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace keel {

std::unique_ptr<Backend> make_guarded_backend(std::unique_ptr<Backend> inner);

// KEEL_GUARD_BACKEND_MEMORY set (and not "0").
bool guard_backend_memory_requested();

}  // namespace keel
