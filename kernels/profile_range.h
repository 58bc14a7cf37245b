// Named ranges on a profiler's timeline: NVTX, which Nsight Systems (nsys profile) shows above
// the kernels and copies each range launched. keel marks the step's phases, each layer's
// forward, backward and recomputation, the head, every collective (by group) and the run's
// evaluations and saves. Without an attached profiler a range costs a call through a pointer
// NVTX keeps; in a build without CUDA it is nothing.
#pragma once

namespace keel {

void profile_range_push(const char* name);  // name must live until the matching pop
void profile_range_pop();

// The range from construction to destruction.
class ProfileRange {
 public:
  explicit ProfileRange(const char* name) { profile_range_push(name); }
  ~ProfileRange() { profile_range_pop(); }
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;
};

}  // namespace keel
