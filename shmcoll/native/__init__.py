"""Layer 1, native: numba and the machine (jit and the kernel cache, atomics, the reducers and
the ReduceOp / dtype vocabulary built on them, single copy, page sizes). Imports only
shmcoll's vocabulary (errors, config)."""
