namespace keel { int keel_kernels_placeholder = 0; }
