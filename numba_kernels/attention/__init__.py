"""MLA attention kernels: the dispatcher, their shared rules, and the SIMT, decode and tensor-core paths."""
