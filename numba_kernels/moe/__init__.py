"""MoE kernels: the router, the grouped routed experts, and the dense SwiGLU pieces."""
