// No fused multiply-add for the rest of the file that includes this: every product and sum is
// rounded to fp32 on its own, as PyTorch's elementwise kernels (and the CUDA kernels' __fmul_rn /
// __fadd_rn) compute them. Include it after all other headers, so that only the file's own
// functions are affected.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
