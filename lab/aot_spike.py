"""Spike: a kernel compiled by numba at build time, run with no numba in the process.

Issue 23, item 6: a warm first collective waits ~0.4 s for `import numba` and the kernels'
loads. This builds the one-step kernel (protocol.kernels._one_step_kernel, what a small
collective runs) into a CPython extension that needs no numba at run time, and measures
what that would change:

    python -m lab.aot_spike                 # build, load time, call overhead, 2-rank A/B
    python -m lab.aot_spike --no-ranks      # without the 2-rank A/B

How it is built (in a temporary directory; needs cc and Python's headers):
- a numba cfunc taking only integers and doubles (addresses and sizes) wraps the kernel;
  numba compiles it with the kernel and everything it calls into one LLVM module;
- llvmlite compiles that module's IR again as position-independent code for x86-64-v3
  (numba's JIT code is static-relocation code, which no shared library can hold);
- a generated C module exposes it as a METH_FASTCALL function; cc links the two, plus
  stubs for the numba runtime symbols the IR references (NRT and exception raising: the
  kernel's views own nothing and its error paths return codes, so they are never called;
  a product would have to make that a checked property, not a stub that aborts).

Spike only: the exception stubs abort, the A/B's Python wrapper looks the arena's array
addresses up per call and takes the buffer's from the tensor (a product's Arena would hold
the former, its caller pass the latter), and nothing here is used by shmcoll.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import timeit

__all__ = ["main"]

_STUBS = r"""
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
/* numba's runtime symbols the kernel's IR references; never called (module docstring) */
int numba_gil_ensure(void *s) { *(PyGILState_STATE *)s = PyGILState_Ensure(); return 0; }
void numba_gil_release(void *s) { PyGILState_Release(*(PyGILState_STATE *)s); }
static void spike_abort(const char *what) { fprintf(stderr, "aot spike: %s\n", what); abort(); }
void NRT_Free(void *p) { spike_abort("NRT_Free"); }
void NRT_MemInfo_call_dtor(void *m) { spike_abort("NRT_MemInfo_call_dtor"); }
void numba_do_raise(void *e) { spike_abort("a kernel raised"); }
void *numba_runtime_build_excinfo_struct(void *a, void *b) { spike_abort("excinfo"); return 0; }
void *numba_unpickle(const char *d, int n, const char *h) { spike_abort("unpickle"); return 0; }
"""

_MODULE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
extern int64_t kernel(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t,
                      int64_t, int64_t) __asm__("SYMBOL");
static PyObject *one_step(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    int64_t v[18];
    double d[2];
    if (n != 18) { PyErr_SetString(PyExc_TypeError, "one_step takes 18 arguments"); return NULL; }
    for (int i = 0; i < 18; i++) {
        if (i == 13 || i == 14) d[i - 13] = PyFloat_AsDouble(args[i]);
        else v[i] = PyLong_AsLongLong(args[i]);
    }
    if (PyErr_Occurred()) return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS  /* as numba's nogil dispatcher does */
    r = kernel(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12],
               d[0], d[1], v[15], v[16], v[17]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(r);
}
static PyObject *noop(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    int64_t acc = 0;  /* the same argument conversion as one_step, no kernel */
    for (Py_ssize_t i = 0; i < n; i++)
        acc += (i == 13 || i == 14) ? (int64_t)PyFloat_AsDouble(args[i])
                                    : PyLong_AsLongLong(args[i]);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(acc & 0);
}
static PyMethodDef methods[] = {
    {"one_step", (PyCFunction)(void (*)(void))one_step, METH_FASTCALL, NULL},
    {"noop", (PyCFunction)(void (*)(void))noop, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_aot_spike", NULL, -1, methods};
PyMODINIT_FUNC PyInit__aot_spike(void) { return PyModule_Create(&def); }
"""


def build(out_dir, cpu="x86-64-v3"):
    """Build _aot_spike in `out_dir` for `cpu` ("host": this one, as numba's JIT does);
    returns {seconds, numba symbols the IR needs}."""
    import llvmlite.binding as ll
    import numba
    import numpy as np
    from numba import types
    from numba.extending import intrinsic

    from shmcoll.native.reducers import _view
    from shmcoll.protocol import kernels as pk

    @intrinsic
    def view2(typingctx, addr, rows, cols):
        """A C-contiguous int64 matrix at `addr` (the peer table), owning nothing."""
        arrty = types.Array(types.int64, 2, "C")

        def codegen(context, builder, sig, args):
            r, c = [context.cast(builder, a, t, types.intp)
                    for a, t in zip(args[1:], sig.args[1:])]
            eight = context.get_constant(types.intp, 8)
            ary = context.make_array(arrty)(context, builder)
            data = builder.inttoptr(args[0], context.get_data_type(types.int64).as_pointer())
            context.populate_array(ary, data=data, shape=[r, c],
                                   strides=[builder.mul(c, eight), eight], itemsize=8,
                                   meminfo=None)
            return ary._getvalue()

        return arrty(addr, rows, cols), codegen

    i8, f8 = types.int64, types.float64

    @numba.cfunc(i8(*([i8] * 13 + [f8, f8] + [i8] * 3)), nopython=True)
    def one_step_c(mode, src, src_n, out, out_n, cfg, cfg_n, tab, tab_r, tab_c, srcs, srcs_n,
                   plan, pre, post, seq, step, root):
        return pk._one_step_kernel(
            mode, _view(src, np.uint8, src_n), _view(out, np.uint8, out_n),
            _view(cfg, np.int64, cfg_n), view2(tab, tab_r, tab_c), _view(srcs, np.int64, srcs_n),
            _view(plan, np.int64, 8), pre, post, seq, step, root)

    t0 = time.perf_counter()
    module = ll.parse_assembly(one_step_c._library.get_llvm_str())
    module.verify()
    needs = sorted(f.name for f in module.functions
                   if f.is_declaration and f.name.startswith(("NRT_", "numba_")))
    cpu, features = (ll.get_host_cpu_name(), ll.get_host_cpu_features().flatten()) \
        if cpu == "host" else (cpu, "")
    machine = ll.Target.from_triple(ll.get_process_triple()).create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic", codemodel="default")
    obj = os.path.join(out_dir, "kernel.o")
    with open(obj, "wb") as f:
        f.write(machine.emit_object(module))
    inc = sysconfig.get_paths()["include"]
    module_c = _MODULE.replace("SYMBOL", one_step_c.native_name)
    for name, text in (("stubs", _STUBS), ("module", module_c)):
        with open(os.path.join(out_dir, name + ".c"), "w") as f:
            f.write(text)
        subprocess.run(["cc", "-O2", "-fPIC", "-c", name + ".c", f"-I{inc}", "-o", name + ".o"],
                       cwd=out_dir, check=True)
    so = "_aot_spike" + sysconfig.get_config_var("EXT_SUFFIX")
    subprocess.run(["cc", "-shared", "-o", so, "module.o", "kernel.o", "stubs.o"], cwd=out_dir,
                   check=True)
    return {"build_s": round(time.perf_counter() - t0, 3), "numba_symbols": needs}


def load_time(out_dir):
    """A fresh process (torch imported first, as in a rank) importing the module: ms, and
    whether numba came with it."""
    code = textwrap.dedent(f"""
        import json, sys, time
        import torch
        t0 = time.perf_counter()
        sys.path.insert(0, {out_dir!r})
        import _aot_spike
        print(json.dumps({{"load_ms": (time.perf_counter() - t0) * 1e3,
                          "numba_imported": "numba" in sys.modules}}))""")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _addresses():
    """at(array) -> its address, looked up by id (the spike's A/B wrapper; it keeps each
    array alive, so an id is never reused for another)."""
    addrs = {}

    def at(a):
        hit = addrs.get(id(a))
        if hit is None:
            hit = addrs[id(a)] = (a.ctypes.data, a)
        return hit[0]
    return at


def call_overhead(out_dir, calls=200_000):
    """us per call of a kernel that does nothing: numba's dispatcher with the one-step
    kernel's argument kinds (6 arrays), the C module with 18 numbers, ctypes with 18."""
    import ctypes

    import numba
    import numpy as np
    sys.path.insert(0, out_dir)
    import _aot_spike

    @numba.njit(nogil=True)
    def nothing(mode, src, out, cfg, tab, srcs, plan, pre, post, seq, step, root):
        return 0

    arrays = (np.zeros(8, np.uint8), np.zeros(0, np.uint8), np.zeros(16, np.int64),
              np.zeros((4, 2), np.int64), np.zeros(2, np.int64), np.zeros(8, np.int64))
    nothing(1, *arrays, 1.0, 1.0, 5, 6, -1)
    addr = 1 << 40
    nums = (1, addr, 8, addr, 0, addr, 16, addr, 4, 2, addr, 2, addr, 1.0, 1.0, 5, 6, -1)
    libc = ctypes.CDLL(None)
    fn = libc.labs  # any C function; ctypes' per-call cost is in converting the arguments
    fn.argtypes = [ctypes.c_int64] * 13 + [ctypes.c_double] * 2 + [ctypes.c_int64] * 3
    fn.restype = ctypes.c_int64
    at, noop = _addresses(), _aot_spike.noop

    def wrapped(mode, src, out, cfg, tab, srcs, plan, pre, post, seq, step, root):
        return noop(mode, at(src), src.size, at(out), out.size, at(cfg), cfg.size, at(tab),
                    tab.shape[0], tab.shape[1], at(srcs), srcs.size, at(plan), pre, post, seq,
                    step, root)

    rows = {"numba dispatcher (12 args, 6 arrays)": lambda: nothing(1, *arrays, 1.0, 1.0, 5, 6, -1),
            "C METH_FASTCALL (18 numbers)": lambda: noop(*nums),
            "ctypes (18 numbers)": lambda: fn(*nums),
            "C METH_FASTCALL behind the A/B's wrapper":
                lambda: wrapped(1, *arrays, 1.0, 1.0, 5, 6, -1)}
    return {name: round(min(timeit.repeat(f, number=calls, repeat=7)) / calls * 1e6, 3)
            for name, f in rows.items()}


def _rank(rank, world, store, out_dir, sizes, blocks, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=world)
    from shmcoll.protocol import compiled
    from shmcoll.torch_backend.convert import plain_array
    sys.path.insert(0, out_dir)
    import _aot_spike
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).group
    pk = compiled.protocol_kernels
    jitted, ext = pk._one_step_kernel, _aot_spike.one_step
    at = _addresses()

    src_addr = [0]  # the all_reduce buffer's address: `src` is a fresh view every call

    def aot(mode, src, out, cfg, tab, srcs, plan, pre, post, seq, step, root):
        return ext(mode, src_addr[0], src.size, at(out), out.size, at(cfg), cfg.size, at(tab),
                   tab.shape[0], tab.shape[1], at(srcs), srcs.size, at(plan), pre, post, seq,
                   step, root)

    rows = {}
    for n in sizes:
        t = torch.empty(n // 4)  # plain_array's view references no tensor: t keeps the memory
        a = plain_array(t)
        src_addr[0] = t.data_ptr()
        want = world * (world + 1) / 2
        for block in range(blocks):
            order = (("numba", jitted), ("aot", aot))
            for name, kernel in (order if block % 2 else order[::-1]):
                pk._one_step_kernel = kernel
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(200):
                    a[:] = rank + 1
                    group.all_reduce(a)
                rows.setdefault(f"{n} B {name}", []).append((time.perf_counter() - t0) / 200 * 1e6)
                if not (a == want).all():
                    raise AssertionError(f"{name}: wrong all_reduce at {n} B: {a[:4]}")
        pk._one_step_kernel = jitted
    if rank == 0:
        queue.put({k: round(statistics.median(v), 2) for k, v in rows.items()})
    dist.barrier()
    dist.destroy_process_group()


def two_ranks(out_dir, sizes=(8, 65536), blocks=24):
    """Engine all_reduce (one-step) at 2 ranks, us per call, median of alternating blocks:
    the numba kernel against the built one (the same code through the C module)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, 2, store, out_dir, sizes, blocks, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            return queue.get(timeout=600)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-ranks", action="store_true", help="skip the 2-rank A/B")
    ap.add_argument("--cpu", default="x86-64-v3", help="target CPU of the build ('host': this one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        report = {"build": build(out_dir, args.cpu), "load": load_time(out_dir),
                  "call_overhead_us": call_overhead(out_dir)}
        if not args.no_ranks:
            report["two_ranks_all_reduce_us"] = two_ranks(out_dir)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
