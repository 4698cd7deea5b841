"""The reducers' op codes: the numbers the compiled reducers (reducers.py) switch on and
their callers (ops.py, cuda_ipc) pass; here, without numba, so that ops.py and the code
that builds a group import no kernel."""

__all__ = ["OP_SUM", "OP_PRODUCT", "OP_MIN", "OP_MAX", "OP_BAND", "OP_BOR", "OP_BXOR"]

OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_BAND, OP_BOR, OP_BXOR = range(7)
