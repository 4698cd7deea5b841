/* The compiled latency path of a "shm" process group (lane.py says when it is used).

A Lane is installed on a ProcessGroupShm in place of five of its methods (allreduce,
broadcast, _allgather_base, _reduce_scatter_base, alltoall_base and their aliases). Each
call that fast.py's latency path would take -- synchronous, plain dense CPU tensors, a
collective the one-step kernel runs whole -- runs here: the argument checks, the plan
lookup and the kernel call (a numba cfunc, called with the GIL released as numba's nogil
dispatcher does) without the ~10 us of Python of fast.py, Group and Arena. Everything
else goes to the group's own Python method, which owns every check error and every other
path. State is written only through its owners: the lane reads the group's, the arena
clock's and the executor's state; after a clean pass the clock records the step (its
one_step, as Arena.one_step calls it) and the engine the pass (Group.lane_done), and a
pass the kernel did not finish goes on in Python (lane.py's resume, Arena.one_step_resume)
exactly as on the Python path. The one state the lane writes itself is the process
group's sequence number, which fast.py's latency path writes too (the lane is that path,
compiled).

No numpy and no torch headers: tensors are read through their Python attributes.

The module also holds the executor's doorbell (bell_ring, bell_taken, bell_wait; the
section at the end, doorbell.py says what for): how a submission wakes a group's worker
thread without the GIL. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
#include <stddef.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* protocol.kernels.one_step_entry: addresses as int64 */
typedef int64_t (*one_step_fn)(int64_t mode, int64_t src, int64_t src_n, int64_t out,
                               int64_t out_n, int64_t cfg, int64_t cfg_n, int64_t tab,
                               int64_t tab_rows, int64_t tab_cols, int64_t srcs,
                               int64_t world, int64_t plan, int64_t plan_n, double pre,
                               double post, int64_t seq, int64_t step, int64_t root);

enum { OP_ALLREDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_TO_ALL, N_OPS };

/* dtype flags (lane.py's _DTYPES): bits 0-7 the element size, then: */
#define DT_BYTES 0x100   /* moved as bytes (broadcast, gathers, all_to_all) */
#define DT_REDUCE 0x200  /* reduced by the latency path (fast._FAST_DTYPES) */
#define DT_COMPLEX 0x400 /* complex: a lazily conjugated tensor takes the Python path */

#define N_REDOPS 5  /* lane.py's REDUCE_OPS */
#define MAX_PLANS 64

typedef struct {
    PyObject_HEAD
    PyObject *pg_ref, *group, *clock;  /* pg: a weak reference (pg holds the lane) */
    PyObject *run_inline, *planner, *resume, *slow, *done;
    PyObject *fallbacks[N_OPS];
    PyObject *plans;       /* key tuple -> entry tuple, or None: not the lane's */
    PyObject *tensor_type, *strided, *dtypes, *redops, *opt_types, *keep;
    one_step_fn fn;
    int64_t *cfg, *tab, **slots;
    int64_t cfg_n, tab_rows, tab_cols, world, rank, nslots;
    int enabled;
    long long n_clean, n_resumed, n_slow;  /* calls by how they ended (stats()) */
    PyObject *weakrefs;
} Lane;

static PyObject *s_layout, *s_is_cpu, *s_requires_grad, *s_is_contiguous, *s_is_neg,
    *s_is_conj, *s_dtype, *s_numel, *s_data_ptr, *s_shape, *s_asyncOp, *s_timeout,
    *s_reduceOp, *s_rootRank, *s_rootTensor, *s_coalescing, *s_seq, *s_poison, *s_closed,
    *s_kernels, *s_next_slot, *s_known_min, *s_free_at, *s_step, *s_completed_work,
    *s_timeout_s, *s_one_step;

/* Sentinel: "not the lane's call", the caller takes the Python method. */
static PyObject DECLINE_OBJ;
#define DECLINE (&DECLINE_OBJ)

static int64_t clock_ns(clockid_t which) {
    struct timespec ts;
    clock_gettime(which, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double now(clockid_t which) { return clock_ns(which) * 1e-9; }

/* Whether `v` (a new reference, released here; NULL: an error) is `want` (identity): 1, 0,
   or -1 on the error. */
static int is_(PyObject *v, PyObject *want) {
    if (v == NULL) return -1;
    int r = v == want;
    Py_DECREF(v);
    return r;
}

/* `v` (a new reference, released here; NULL: an error) as an int64; *err set on an error. */
static int64_t int_(PyObject *v, int *err) {
    if (v == NULL) { *err = 1; return 0; }
    int64_t r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred()) *err = 1;
    return r;
}

/* obj.name / obj.name() is `want`, or as an int64 */
#define attr_is(obj, name, want) is_(PyObject_GetAttr(obj, name), want)
#define call_is(obj, name, want) is_(PyObject_CallMethodNoArgs(obj, name), want)
#define attr_int(obj, name, err) int_(PyObject_GetAttr(obj, name), err)
#define call_int(obj, name, err) int_(PyObject_CallMethodNoArgs(obj, name), err)

typedef struct {
    PyObject *dtype;  /* borrowed while the tensor lives: held by the caller's tensor */
    PyObject *shape;  /* new reference */
    int64_t flags, numel, ptr;
} TensorInfo;

/* A dense contiguous CPU tensor, not requiring grad, not lazily negated (nor conjugated),
   of a dtype with all of `need` set, not empty: fills `info` and returns 1; 0 when not
   (info->shape NULL); -1 on an error. fast._plain / fast._bytes_plain, compiled. */
static int tensor_info(Lane *self, PyObject *t, int64_t need, TensorInfo *info) {
    int r, err = 0;
    info->shape = NULL;
    if (Py_TYPE(t) != (PyTypeObject *)self->tensor_type) return 0;
    if ((r = attr_is(t, s_layout, self->strided)) != 1) return r;
    if ((r = attr_is(t, s_is_cpu, Py_True)) != 1) return r;
    if ((r = attr_is(t, s_requires_grad, Py_False)) != 1) return r;
    if ((r = call_is(t, s_is_contiguous, Py_True)) != 1) return r;
    if ((r = call_is(t, s_is_neg, Py_False)) != 1) return r;
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    if (dtype == NULL) return -1;
    PyObject *flags = PyDict_GetItemWithError(self->dtypes, dtype);
    Py_DECREF(dtype);  /* dtypes are interned by torch; the dict holds them too */
    if (flags == NULL) return PyErr_Occurred() ? -1 : 0;
    info->dtype = dtype;
    info->flags = PyLong_AsLongLong(flags);
    if ((info->flags & need) != need) return 0;
    if ((info->flags & DT_COMPLEX) && (r = call_is(t, s_is_conj, Py_False)) != 1) return r;
    info->numel = call_int(t, s_numel, &err);
    if (err) return -1;
    if (info->numel <= 0) return 0;  /* empty: data_ptr may be 0; the Python path */
    info->ptr = call_int(t, s_data_ptr, &err);
    if (err) return -1;
    info->shape = PyObject_GetAttr(t, s_shape);
    if (info->shape == NULL) return -1;
    return 1;
}

/* Synchronous, no coalescing, the group not poisoned. 1 ready, 0 not, -1 error. */
static int ready(Lane *self, PyObject *pg, PyObject *opts) {
    int r;
    if ((r = attr_is(opts, s_asyncOp, Py_False)) != 1) return r;
    if ((r = attr_is(pg, s_coalescing, Py_None)) != 1) return r;
    return attr_is(self->group, s_poison, Py_None);
}

/* The options' timeout in seconds (torch's "unset" is negative: the group's), a new
   float, or NULL on an error. Read only where Python goes on with the call: the kernel
   itself waits a bounded time and hands a late peer to Python. */
static PyObject *timeout_of(Lane *self, PyObject *opts) {
    PyObject *td = PyObject_GetAttr(opts, s_timeout);
    if (td == NULL) return NULL;
    double s = -1.0;
    if (PyDelta_Check(td))
        s = PyDateTime_DELTA_GET_DAYS(td) * 86400.0 + PyDateTime_DELTA_GET_SECONDS(td)
            + PyDateTime_DELTA_GET_MICROSECONDS(td) * 1e-6;
    Py_DECREF(td);
    if (s < 0) return PyObject_GetAttr(self->group, s_timeout_s);
    return PyFloat_FromDouble(s);
}

/* The plan entry for `key` (steals it): (plan, mode, words address, words length, pre,
   post, nbytes, name, engine reduce op, whether it may run with its output the input's
   memory), asked of the planner once per key; DECLINE where
   the lane does not run this call shape. New reference, or NULL on an error. */
static PyObject *plan_for(Lane *self, PyObject *pg, PyObject *key, int op, PyObject *out,
                          PyObject *in, long root, int redop) {
    if (key == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(self->plans, key);
    if (entry == NULL) {
        if (PyErr_Occurred()) { Py_DECREF(key); return NULL; }
        entry = PyObject_CallFunction(self->planner, "OiOOli", pg, op, out, in, root, redop);
        if (entry == NULL) { Py_DECREF(key); return NULL; }
        if (PyDict_GET_SIZE(self->plans) >= MAX_PLANS) PyDict_Clear(self->plans);
        if (PyDict_SetItem(self->plans, key, entry) < 0) {
            Py_DECREF(key); Py_DECREF(entry); return NULL;
        }
        Py_DECREF(entry);  /* the dict holds it */
    }
    Py_DECREF(key);
    if (entry == Py_None) return DECLINE;
    Py_INCREF(entry);
    return entry;
}

/* Plan keys: (op, dtype, shape, root or reduction index), reduce_scatter's with the
   output's shape before the index, all_to_all's (op, dtype, numel). */
static PyObject *key4(int op, PyObject *dtype, PyObject *shape, int64_t extra) {
    PyObject *a = PyLong_FromLong(op), *b = PyLong_FromLongLong(extra), *k = NULL;
    if (a != NULL && b != NULL) k = PyTuple_Pack(4, a, dtype, shape, b);
    Py_XDECREF(a); Py_XDECREF(b);
    return k;
}

static PyObject *key5(int op, PyObject *dtype, PyObject *shape, PyObject *shape2,
                      int64_t extra) {
    PyObject *a = PyLong_FromLong(op), *b = PyLong_FromLongLong(extra), *k = NULL;
    if (a != NULL && b != NULL) k = PyTuple_Pack(5, a, dtype, shape, shape2, b);
    Py_XDECREF(a); Py_XDECREF(b);
    return k;
}

static PyObject *key_n(int op, PyObject *dtype, int64_t numel) {
    PyObject *a = PyLong_FromLong(op), *b = PyLong_FromLongLong(numel), *k = NULL;
    if (a != NULL && b != NULL) k = PyTuple_Pack(3, a, dtype, b);
    Py_XDECREF(a); Py_XDECREF(b);
    return k;
}

/* Index of opts.reduceOp in REDUCE_OPS (== as torch compares them), N_REDOPS if none. */
static int redop_index(Lane *self, PyObject *opts) {
    PyObject *op = PyObject_GetAttr(opts, s_reduceOp);
    if (op == NULL) return -1;
    for (int k = 0; k < N_REDOPS; k++) {
        int r = PyObject_RichCompareBool(op, PyTuple_GET_ITEM(self->redops, k), Py_EQ);
        if (r != 0) { Py_DECREF(op); return r < 0 ? -1 : k; }
    }
    Py_DECREF(op);
    return N_REDOPS;
}

static PyObject *go_fn;  /* the module's _go, what run() hands Executor.run_inline */

/* Count the collective (as fast._run) and run it under the executor's inline protocol:
   run_inline(_go, lane, pg, op, out, in, entry, root, opts, src, out address). Steals
   entry. */
static PyObject *run(Lane *self, PyObject *pg, int op, PyObject *out, PyObject *in,
                     PyObject *entry, long root, PyObject *opts, int64_t src, int64_t dst) {
    int err = 0;
    PyObject *r = NULL, *nums[4] = {NULL, NULL, NULL, NULL};
    int64_t seq = attr_int(pg, s_seq, &err);
    if (err) goto done;
    nums[0] = PyLong_FromLongLong(seq + 1);
    if (nums[0] == NULL || PyObject_SetAttr(pg, s_seq, nums[0]) < 0) goto done;
    nums[1] = PyLong_FromLong(op);
    nums[2] = PyLong_FromLong(root);
    nums[3] = PyLong_FromLongLong(src);
    PyObject *d = PyLong_FromLongLong(dst);
    if (nums[1] == NULL || nums[2] == NULL || nums[3] == NULL || d == NULL) {
        Py_XDECREF(d);
        goto done;
    }
    PyObject *args[] = {go_fn, (PyObject *)self, pg, nums[1], out, in, entry, nums[2], opts,
                        nums[3], d};
    r = PyObject_Vectorcall(self->run_inline, args, 11, NULL);
    Py_DECREF(d);
done:
    for (int k = 0; k < 4; k++) Py_XDECREF(nums[k]);
    Py_DECREF(entry);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    return PyObject_GetAttr(pg, s_completed_work);
}

/* _go(lane, pg, ...): the collective on the calling thread, inside Executor.run_inline. Where the
   group cannot take it here (poisoned, closed, kernels not loaded, my slot still read by a
   peer) the whole call goes to `slow` (the engine's Python path); otherwise the kernel,
   then the engine's record of a clean pass or lane.py's resume. */
static PyTypeObject LaneType;

static PyObject *lane_go(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 || Py_TYPE(args[0]) != &LaneType) {
        PyErr_SetString(PyExc_TypeError, "_go(lane, pg, op, out, in, entry, root, opts, "
                                         "src, dst)");
        return NULL;
    }
    Lane *self = (Lane *)args[0];
    PyObject *pg = args[1];
    int op = (int)PyLong_AsLong(args[2]);
    PyObject *out = args[3], *in = args[4], *entry = args[5];
    long root = PyLong_AsLong(args[6]);
    PyObject *opts = args[7];
    int64_t src = PyLong_AsLongLong(args[8]), dst = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 10) {
        PyErr_SetString(PyExc_TypeError, "_go: a plan entry is a tuple of 10");
        return NULL;
    }
    int r, err = 0;
    int usable = 1;
    if ((r = attr_is(self->group, s_poison, Py_None)) < 0) return NULL;
    usable &= r;
    if ((r = attr_is(self->group, s_closed, Py_False)) < 0) return NULL;
    usable &= r;
    if ((r = attr_is(self->group, s_kernels, Py_None)) < 0) return NULL;
    usable &= r;
    int64_t i = attr_int(self->clock, s_next_slot, &err);
    int64_t known_min = attr_int(self->clock, s_known_min, &err);
    int64_t step = attr_int(self->clock, s_step, &err) + 1;
    int64_t seq = attr_int(self->group, s_seq, &err) + 1;
    if (err) return NULL;
    int publishes = root < 0 || root == self->rank;
    if (usable && publishes) {
        PyObject *free_at = PyObject_GetAttr(self->clock, s_free_at);
        if (free_at == NULL) return NULL;
        PyObject *f = PySequence_GetItem(free_at, (Py_ssize_t)i);
        Py_DECREF(free_at);
        if (f == NULL) return NULL;
        int64_t free_step = PyLong_AsLongLong(f);
        Py_DECREF(f);
        if (free_step == -1 && PyErr_Occurred()) return NULL;
        usable = known_min >= free_step;
    }
    if (!usable || i < 0 || i >= self->nslots) {
        self->n_slow++;
        PyObject *timeout = timeout_of(self, opts);
        if (timeout == NULL) return NULL;
        PyObject *res = PyObject_CallFunction(self->slow, "OOOOOOO", pg, args[2], out, in,
                                              entry, args[6], timeout);
        Py_DECREF(timeout);
        return res;
    }
    /* entry: (plan, mode, words address, words length, pre, post, nbytes, name, op) */
    int64_t mode = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
    int64_t *words = (int64_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 2));
    int64_t nwords = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
    double pre = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 4));
    double post = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 5));
    int64_t nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 6));
    if (PyErr_Occurred()) return NULL;
    /* what each collective hands the kernel (Group's one-step calls): the bytes of src;
       out for the gathers, reduce_scatter and all_to_all */
    int64_t src_n = nbytes, out_n = 0;
    static uint8_t no_bytes[8];
    uint8_t *outp = no_bytes;
    if (op == OP_ALL_GATHER) { outp = (uint8_t *)dst; out_n = nbytes * self->world; }
    else if (op == OP_REDUCE_SCATTER) { outp = (uint8_t *)dst; out_n = nbytes / self->world; }
    else if (op == OP_ALL_TO_ALL) { outp = (uint8_t *)dst; out_n = nbytes; }
    double t_start = now(CLOCK_REALTIME), t_mono = now(CLOCK_MONOTONIC);
    int64_t k;
    Py_BEGIN_ALLOW_THREADS
    k = self->fn(mode, src, src_n, (int64_t)(uintptr_t)outp, out_n, (int64_t)(uintptr_t)self->cfg,
                 self->cfg_n, (int64_t)(uintptr_t)self->tab, self->tab_rows, self->tab_cols,
                 (int64_t)(uintptr_t)self->slots[i], self->world, (int64_t)(uintptr_t)words,
                 nwords, pre, post, seq, step, root);
    Py_END_ALLOW_THREADS
    if (k == -1) {
        self->n_clean++;
        /* the clock's record of the step (as Arena.one_step's), then the group's:
           clock.one_step(slot, step, publishes, True); Group.lane_done(name, nbytes, seq,
           t_start) */
        PyObject *res = NULL, *n_i = PyLong_FromLongLong(i), *n_step = PyLong_FromLongLong(step);
        PyObject *n_seq = PyLong_FromLongLong(seq), *n_t = PyFloat_FromDouble(t_start);
        if (n_i != NULL && n_step != NULL && n_seq != NULL && n_t != NULL) {
            PyObject *cargs[] = {self->clock, n_i, n_step, publishes ? Py_True : Py_False,
                                 Py_True};
            res = PyObject_VectorcallMethod(s_one_step, cargs,
                                            5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (res != NULL) {
                Py_DECREF(res);
                PyObject *dargs[] = {PyTuple_GET_ITEM(entry, 7), PyTuple_GET_ITEM(entry, 6),
                                     n_seq, n_t};
                res = PyObject_Vectorcall(self->done, dargs, 4, NULL);
            }
        }
        Py_XDECREF(n_i); Py_XDECREF(n_step); Py_XDECREF(n_seq); Py_XDECREF(n_t);
        return res;
    }
    self->n_resumed++;
    PyObject *timeout = timeout_of(self, opts);
    if (timeout == NULL) return NULL;
    PyObject *res = PyObject_CallFunction(self->resume, "OiOOOLLLiLLOddLL", pg, op, out, in,
                                          entry, (long long)seq, (long long)i,
                                          (long long)step, publishes, (long long)k,
                                          (long long)root, timeout, t_start, t_mono,
                                          (long long)src, (long long)dst);
    Py_DECREF(timeout);
    return res;
}

/* A check that raised declines (the Python method then raises or words it). */
static PyObject *declined(int r) {
    if (r < 0) PyErr_Clear();
    return DECLINE;
}

static int opts_is(Lane *self, PyObject *opts, int op) {
    return (PyObject *)Py_TYPE(opts) == PyTuple_GET_ITEM(self->opt_types, op);
}

/* pg.allreduce([t], opts) of dist.all_reduce(t) */
static PyObject *try_allreduce(Lane *self, PyObject *pg, PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 2 || !opts_is(self, args[1], OP_ALLREDUCE) || !PyList_CheckExact(args[0])
            || PyList_GET_SIZE(args[0]) != 1)
        return DECLINE;
    PyObject *opts = args[1], *t = PyList_GET_ITEM(args[0], 0);
    TensorInfo a;
    int r = ready(self, pg, opts);
    if (r != 1) return declined(r);
    int k = redop_index(self, opts);
    if (k < 0 || k == N_REDOPS) return declined(k);
    if ((r = tensor_info(self, t, DT_REDUCE, &a)) != 1) return declined(r);
    PyObject *entry = plan_for(self, pg, key4(OP_ALLREDUCE, a.dtype, a.shape, k),
                               OP_ALLREDUCE, Py_None, t, -1, k);
    Py_DECREF(a.shape);
    if (entry == NULL || entry == DECLINE) return entry;
    return run(self, pg, OP_ALLREDUCE, Py_None, t, entry, -1, opts, a.ptr, 0);
}

/* pg.broadcast([t], opts) of dist.broadcast(t, src) */
static PyObject *try_broadcast(Lane *self, PyObject *pg, PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 2 || !opts_is(self, args[1], OP_BROADCAST) || !PyList_CheckExact(args[0])
            || PyList_GET_SIZE(args[0]) != 1)
        return DECLINE;
    PyObject *opts = args[1], *t = PyList_GET_ITEM(args[0], 0);
    TensorInfo a;
    int err = 0;
    int r = ready(self, pg, opts);
    if (r != 1) return declined(r);
    int64_t root = attr_int(opts, s_rootRank, &err);
    int64_t root_tensor = attr_int(opts, s_rootTensor, &err);
    if (err) return declined(-1);
    if (root_tensor != 0 || root < 0 || root >= self->world) return DECLINE;
    if ((r = tensor_info(self, t, DT_BYTES, &a)) != 1) return declined(r);
    PyObject *entry = plan_for(self, pg, key4(OP_BROADCAST, a.dtype, a.shape, root),
                               OP_BROADCAST, Py_None, t, (long)root, 0);
    Py_DECREF(a.shape);
    if (entry == NULL || entry == DECLINE) return entry;
    return run(self, pg, OP_BROADCAST, Py_None, t, entry, (long)root, opts, a.ptr, 0);
}

/* Two tensors of one dtype with `need`: the output and the input of a gather, a
   reduce_scatter or an all_to_all. 1 when both are the lane's, 0 not, -1 error (both
   shapes released unless 1). */
static int pair_info(Lane *self, PyObject *out, PyObject *in, int64_t need, TensorInfo *o,
                     TensorInfo *i) {
    int r = tensor_info(self, out, need, o);
    if (r != 1) return r;
    r = tensor_info(self, in, need, i);
    if (r == 1 && o->dtype == i->dtype) return 1;
    Py_DECREF(o->shape);
    Py_XDECREF(i->shape);
    return r < 0 ? -1 : 0;
}

/* pg._allgather_base(out, in, opts) of dist.all_gather_into_tensor */
static PyObject *try_all_gather(Lane *self, PyObject *pg, PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 3 || !opts_is(self, args[2], OP_ALL_GATHER)) return DECLINE;
    PyObject *out = args[0], *in = args[1];
    TensorInfo o, i;
    int r = ready(self, pg, args[2]);
    if (r != 1) return declined(r);
    if ((r = pair_info(self, out, in, DT_BYTES, &o, &i)) != 1) return declined(r);
    PyObject *entry = DECLINE;
    if (o.numel == i.numel * self->world)
        entry = plan_for(self, pg, key4(OP_ALL_GATHER, i.dtype, i.shape, 0),
                         OP_ALL_GATHER, out, in, -1, 0);
    Py_DECREF(o.shape);
    Py_DECREF(i.shape);
    if (entry == NULL || entry == DECLINE) return entry;
    return run(self, pg, OP_ALL_GATHER, out, in, entry, -1, args[2], i.ptr, o.ptr);
}

/* pg._reduce_scatter_base(out, in, opts) of dist.reduce_scatter_tensor */
static PyObject *try_reduce_scatter(Lane *self, PyObject *pg, PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 3 || !opts_is(self, args[2], OP_REDUCE_SCATTER)) return DECLINE;
    PyObject *out = args[0], *in = args[1];
    TensorInfo o, i;
    int r = ready(self, pg, args[2]);
    if (r != 1) return declined(r);
    int k = redop_index(self, args[2]);
    if (k < 0 || k == N_REDOPS) return declined(k);
    if ((r = pair_info(self, out, in, DT_REDUCE, &o, &i)) != 1) return declined(r);
    PyObject *entry = DECLINE;
    if (i.numel == o.numel * self->world)
        entry = plan_for(self, pg, key5(OP_REDUCE_SCATTER, i.dtype, i.shape, o.shape, k),
                         OP_REDUCE_SCATTER, out, in, -1, k);
    Py_DECREF(o.shape);
    Py_DECREF(i.shape);
    if (entry == NULL || entry == DECLINE) return entry;
    return run(self, pg, OP_REDUCE_SCATTER, out, in, entry, -1, args[2], i.ptr, o.ptr);
}

/* dim 0 of a torch.Size divides into world pieces (and there is a dim 0) */
static int splits_evenly(PyObject *shape, int64_t world) {
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) < 1) return 0;
    int64_t rows = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
    if (rows == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    return rows % world == 0;
}

static int empty_list(PyObject *splits) {
    return PyList_CheckExact(splits) && PyList_GET_SIZE(splits) == 0;
}

/* pg.alltoall_base(out, in, [], [], opts) of dist.all_to_all_single without splits */
static PyObject *try_all_to_all(Lane *self, PyObject *pg, PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 5 || !opts_is(self, args[4], OP_ALL_TO_ALL) || !empty_list(args[2])
            || !empty_list(args[3]))
        return DECLINE;
    PyObject *out = args[0], *in = args[1];
    TensorInfo o, i;
    int r = ready(self, pg, args[4]);
    if (r != 1) return declined(r);
    if ((r = pair_info(self, out, in, DT_BYTES, &o, &i)) != 1) return declined(r);
    PyObject *entry = DECLINE;
    if (o.numel == i.numel && splits_evenly(o.shape, self->world)
            && splits_evenly(i.shape, self->world))
        entry = plan_for(self, pg, key_n(OP_ALL_TO_ALL, i.dtype, i.numel),
                         OP_ALL_TO_ALL, out, in, -1, 0);
    Py_DECREF(o.shape);
    Py_DECREF(i.shape);
    if (entry == NULL || entry == DECLINE) return entry;
    int64_t nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 6));
    if (nbytes == -1 && PyErr_Occurred()) {
        Py_DECREF(entry);
        return NULL;
    }
    if (o.ptr < i.ptr + nbytes && i.ptr < o.ptr + nbytes
            && (o.ptr != i.ptr || PyTuple_GET_ITEM(entry, 9) != Py_True)) {
        /* overlapping, but for in place where the plan may: the group's method, which
           copies the input (a peer reading my buffer where it lies must not see my output
           written under it) */
        Py_DECREF(entry);
        return DECLINE;
    }
    return run(self, pg, OP_ALL_TO_ALL, out, in, entry, -1, args[4], i.ptr, o.ptr);
}

typedef PyObject *(*try_fn)(Lane *, PyObject *, PyObject *const *, Py_ssize_t);
static const try_fn TRIES[N_OPS] = {try_allreduce, try_broadcast, try_all_gather,
                                     try_reduce_scatter, try_all_to_all};

/* The lane's call, or the group's Python method (a function of the class, called with
   the group first). */
static PyObject *dispatch(Lane *self, int op, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    PyObject *pg = NULL;
#if PY_VERSION_HEX >= 0x030D0000
    if (self->pg_ref != NULL && PyWeakref_GetRef(self->pg_ref, &pg) < 0) return NULL;
#else
    if (self->pg_ref != NULL) {
        pg = PyWeakref_GetObject(self->pg_ref);
        if (pg == Py_None) pg = NULL;
        Py_XINCREF(pg);
    }
#endif
    if (pg == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmcoll: the process group of this lane is gone");
        return NULL;
    }
    PyObject *r = DECLINE;
    if (self->enabled && self->fn != NULL && kwnames == NULL)
        r = TRIES[op](self, pg, args, nargs);
    if (r == DECLINE) {
        Py_ssize_t n = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
        PyObject *small[8], **with_pg = n < 8 ? small : PyMem_Malloc((n + 1) * sizeof(PyObject *));
        if (with_pg == NULL) {
            Py_DECREF(pg);
            return PyErr_NoMemory();
        }
        with_pg[0] = pg;
        for (Py_ssize_t k = 0; k < n; k++) with_pg[k + 1] = args[k];
        r = PyObject_Vectorcall(self->fallbacks[op], with_pg, nargs + 1, kwnames);
        if (with_pg != small) PyMem_Free(with_pg);
    }
    Py_DECREF(pg);
    return r;
}

/* What a process group's methods become: a callable object of one lane and one op. Not a
   builtin method: pybind11 takes any C function found on a Python subclass for the base
   class's own method (get_type_override: is_cpp_function) and would send torch's C++
   callers (DDP's reducer, the dispatcher's ops) past it, to no backend. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Lane *lane;
    int op;
} LaneCall;

static const char *const OP_NAMES[N_OPS] = {"allreduce", "broadcast", "all_gather_single",
                                            "reduce_scatter_single", "all_to_all_single"};

static PyObject *lanecall_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    LaneCall *c = (LaneCall *)callable;
    return dispatch(c->lane, c->op, args, PyVectorcall_NARGS(nargsf), kwnames);
}

static int lanecall_traverse(LaneCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->lane);
    return 0;
}

static int lanecall_clear(LaneCall *self) {
    Py_CLEAR(self->lane);
    return 0;
}

static void lanecall_dealloc(LaneCall *self) {
    PyObject_GC_UnTrack(self);
    lanecall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *lanecall_repr(LaneCall *self) {
    return PyUnicode_FromFormat("<shmcoll lane %s>", OP_NAMES[self->op]);
}

static PyObject *lanecall_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    LaneCall *c = (LaneCall *)self;
    if (c->lane == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmcoll: a cleared lane call");
        return NULL;
    }
    return PyVectorcall_Call(self, args, kwargs);
}

static PyTypeObject LaneCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcoll.torch_backend._lane.LaneCall",
    .tp_basicsize = sizeof(LaneCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "One collective of a Lane, as a process group's method.",
    .tp_vectorcall_offset = offsetof(LaneCall, vectorcall),
    .tp_call = lanecall_call,
    .tp_repr = (reprfunc)lanecall_repr,
    .tp_traverse = (traverseproc)lanecall_traverse,
    .tp_clear = (inquiry)lanecall_clear,
    .tp_dealloc = (destructor)lanecall_dealloc,
};

/* Lane.call(op): a new LaneCall of this lane for op (lane.py's METHODS order). */
static PyObject *lane_call(Lane *self, PyObject *arg) {
    long op = PyLong_AsLong(arg);
    if (op == -1 && PyErr_Occurred()) return NULL;
    if (op < 0 || op >= N_OPS) {
        PyErr_Format(PyExc_ValueError, "Lane.call: op %ld is not one of 0-%d", op, N_OPS - 1);
        return NULL;
    }
    LaneCall *c = PyObject_GC_New(LaneCall, &LaneCallType);
    if (c == NULL) return NULL;
    c->vectorcall = lanecall_vectorcall;
    Py_INCREF(self);
    c->lane = self;
    c->op = (int)op;
    PyObject_GC_Track(c);
    return (PyObject *)c;
}

static PyObject *lane_arm(Lane *self, PyObject *address) {
    void *fn = PyLong_AsVoidPtr(address);
    if (fn == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Lane.arm: a null address");
        return NULL;
    }
    self->fn = (one_step_fn)(uintptr_t)fn;
    Py_RETURN_NONE;
}

static PyObject *lane_disable(Lane *self, PyObject *unused) {
    self->enabled = 0;
    Py_RETURN_NONE;
}

static PyObject *lane_stats(Lane *self, PyObject *unused) {
    return Py_BuildValue("{sLsLsL}", "clean", self->n_clean, "resumed", self->n_resumed,
                         "slow", self->n_slow);
}

static PyObject *lane_plans(Lane *self, PyObject *unused) {
    return PyDict_Copy(self->plans);
}

/* Lane(pg, group, clock, run_inline, planner, resume, slow, done, fallbacks, tensor_type,
        strided, dtypes, redops, opt_types, fn, cfg, cfg_n, tab, tab_rows, tab_cols,
        slots, rank, world, keep): lane.py's install() says what each is. fallbacks and
   opt_types: tuples in op order; slots: a tuple of the addresses of each slot's address
   array (`world` int64 each); keep: what the addresses live in. */
static int lane_init(Lane *self, PyObject *args, PyObject *kwds) {
    PyObject *fallbacks, *slots, *pg;
    unsigned long long fn, cfg, tab;
    if (self->plans != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Lane: already initialized");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOOO!OOO!O!O!KKLKLLO!LLO", &pg, &self->group,
                          &self->clock, &self->run_inline, &self->planner, &self->resume,
                          &self->slow, &self->done, &PyTuple_Type, &fallbacks,
                          &self->tensor_type, &self->strided, &PyDict_Type, &self->dtypes,
                          &PyTuple_Type, &self->redops, &PyTuple_Type, &self->opt_types, &fn,
                          &cfg, &self->cfg_n, &tab, &self->tab_rows, &self->tab_cols,
                          &PyTuple_Type, &slots, &self->rank, &self->world, &self->keep))
        return -1;
    if (PyTuple_GET_SIZE(fallbacks) != N_OPS || PyTuple_GET_SIZE(self->opt_types) != N_OPS
            || PyTuple_GET_SIZE(self->redops) != N_REDOPS || !PyType_Check(self->tensor_type)
            || PyTuple_GET_SIZE(slots) < 1) {
        PyErr_SetString(PyExc_ValueError, "Lane: bad arguments");
        return -1;
    }
    self->pg_ref = PyWeakref_NewRef(pg, NULL);
    if (self->pg_ref == NULL) return -1;
    PyObject **held[] = {&self->group, &self->clock, &self->run_inline,
                         &self->planner, &self->resume, &self->slow, &self->done,
                         &self->tensor_type, &self->strided, &self->dtypes, &self->redops,
                         &self->opt_types, &self->keep};
    for (size_t k = 0; k < sizeof held / sizeof held[0]; k++) Py_INCREF(*held[k]);
    for (int k = 0; k < N_OPS; k++) {
        self->fallbacks[k] = PyTuple_GET_ITEM(fallbacks, k);
        Py_INCREF(self->fallbacks[k]);
    }
    self->nslots = PyTuple_GET_SIZE(slots);
    self->slots = PyMem_Calloc((size_t)self->nslots, sizeof(int64_t *));
    if (self->slots == NULL) { PyErr_NoMemory(); return -1; }
    for (int64_t k = 0; k < self->nslots; k++) {
        self->slots[k] = (int64_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(slots, k));
        if (PyErr_Occurred()) return -1;
    }
    self->fn = (one_step_fn)(uintptr_t)fn;
    self->cfg = (int64_t *)(uintptr_t)cfg;
    self->tab = (int64_t *)(uintptr_t)tab;
    self->plans = PyDict_New();
    if (self->plans == NULL) return -1;
    self->enabled = 1;
    return 0;
}

static int lane_traverse(Lane *self, visitproc visit, void *arg) {
    Py_VISIT(self->pg_ref); Py_VISIT(self->group); Py_VISIT(self->clock);
    Py_VISIT(self->run_inline); Py_VISIT(self->planner); Py_VISIT(self->resume);
    Py_VISIT(self->slow); Py_VISIT(self->done); Py_VISIT(self->plans);
    Py_VISIT(self->tensor_type); Py_VISIT(self->strided); Py_VISIT(self->dtypes);
    Py_VISIT(self->redops); Py_VISIT(self->opt_types); Py_VISIT(self->keep);
    for (int k = 0; k < N_OPS; k++) Py_VISIT(self->fallbacks[k]);
    return 0;
}

static int lane_clear(Lane *self) {
    self->enabled = 0;
    Py_CLEAR(self->pg_ref); Py_CLEAR(self->group); Py_CLEAR(self->clock);
    Py_CLEAR(self->run_inline); Py_CLEAR(self->planner); Py_CLEAR(self->resume);
    Py_CLEAR(self->slow); Py_CLEAR(self->done); Py_CLEAR(self->plans);
    Py_CLEAR(self->tensor_type); Py_CLEAR(self->strided); Py_CLEAR(self->dtypes);
    Py_CLEAR(self->redops); Py_CLEAR(self->opt_types); Py_CLEAR(self->keep);
    for (int k = 0; k < N_OPS; k++) Py_CLEAR(self->fallbacks[k]);
    return 0;
}

static void lane_dealloc(Lane *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)self);
    lane_clear(self);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *lane_get_enabled(Lane *self, void *closure) {
    return PyBool_FromLong(self->enabled);
}

static PyObject *lane_get_armed(Lane *self, void *closure) {
    return PyBool_FromLong(self->fn != NULL);
}

static PyGetSetDef lane_getset[] = {
    {"enabled", (getter)lane_get_enabled, NULL, "False once disable() was called", NULL},
    {"armed", (getter)lane_get_armed, NULL, "Whether arm() gave it the kernel", NULL},
    {NULL}};

static PyMethodDef lane_methods[] = {
    {"call", (PyCFunction)lane_call, METH_O,
     "call(op): the lane's collective `op` (0-4: allreduce, broadcast, all_gather_single, "
     "reduce_scatter_single, all_to_all_single) as a callable taking the process group "
     "method's arguments."},
    {"arm", (PyCFunction)lane_arm, METH_O,
     "arm(address): the one-step kernel's C entry; calls decline until it is set."},
    {"disable", (PyCFunction)lane_disable, METH_NOARGS,
     "Every later call takes the group's Python method."},
    {"plans", (PyCFunction)lane_plans, METH_NOARGS, "A copy of the plan cache (tests)."},
    {"stats", (PyCFunction)lane_stats, METH_NOARGS,
     "Calls the lane ran: {'clean': one kernel pass, 'resumed': finished in Python after "
     "the kernel, 'slow': the engine's Python path (group unable to take it here)}."},
    {NULL}};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcoll.torch_backend._lane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The compiled latency path of one process group (lane.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
    .tp_getset = lane_getset,
    .tp_weaklistoffset = offsetof(Lane, weakrefs),
};

/* ---- The executor's doorbell (doorbell.py) ---------------------------------------------
The int32 words a Doorbell owns: SUBMITTED and TAKEN, the executor's jobs queued and taken
off its queue (counts); TOKENS, rings for one worker not yet taken by one (a condition's
notify()); ALL, bumped by a ring for every worker (notify_all()); SEQ, the futex word a
worker sleeps on, bumped by every ring that must wake one; PARKED and WAITERS, the
threads inside bell_wait that sleep without a deadline, and all of them. The executor
rings and takes holding its condition's lock; bell_wait sleeps with the GIL released and
returns only for something to do: a token it took, a changed ALL, or a job that was
already queued at the previous tick (every poll_ns) and still is -- one its submitter
took meanwhile (it waited for its Work) never makes the worker take the GIL. Submitting
wakes no thread unless the worker is parked: after idle_ns without a submission it sleeps
until woken. */

enum { BELL_SEQ, BELL_SUBMITTED, BELL_TAKEN, BELL_TOKENS, BELL_ALL, BELL_PARKED,
       BELL_WAITERS, BELL_WORDS };
enum { RING_JOB, RING_ONE, RING_ALL };  /* bell_ring's kinds */

static _Atomic int32_t *bell_words(PyObject *address) {
    long long a = PyLong_AsLongLong(address);
    if (a == -1 && PyErr_Occurred()) return NULL;
    if (a == 0 || a % (long long)sizeof(int32_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "doorbell: not the address of its words");
        return NULL;
    }
    return (_Atomic int32_t *)(intptr_t)a;
}

static _Atomic int32_t *bell_args(PyObject *const *args, Py_ssize_t nargs,
                                  const char *usage, long *value) {
    /* (address, value): bell_ring's and bell_taken's arguments; NULL with the error set */
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    _Atomic int32_t *w = bell_words(args[0]);
    *value = PyLong_AsLong(args[1]);
    return w == NULL || (*value == -1 && PyErr_Occurred()) ? NULL : w;
}

static void bell_sleep(_Atomic int32_t *seq, int32_t seen, int64_t ns) {
    /* until SEQ moves past `seen`, or ns (< 0: no limit) have passed (or spuriously) */
#ifdef __linux__
    struct timespec t = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    syscall(SYS_futex, (int32_t *)seq, FUTEX_WAIT_PRIVATE, seen, ns < 0 ? NULL : &t, NULL, 0);
#else
    struct timespec t = {0, ns < 0 || ns > 1000000 ? 1000000 : (long)ns};  /* polls each ms */
    (void)seq, (void)seen;
    nanosleep(&t, NULL);
#endif
}

static void bell_wake(_Atomic int32_t *w, int n) {
    atomic_fetch_add(&w[BELL_SEQ], 1);
#ifdef __linux__
    syscall(SYS_futex, (int32_t *)&w[BELL_SEQ], FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#else
    (void)n;
#endif
}

static PyObject *bell_ring(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    /* bell_ring(address, kind): RING_JOB, a job was queued (wakes a parked worker only);
       RING_ONE, one worker is needed now; RING_ALL, every worker is. */
    long kind;
    _Atomic int32_t *w = bell_args(args, nargs, "bell_ring(address, kind)", &kind);
    if (w == NULL) return NULL;
    if (kind == RING_JOB) {
        atomic_fetch_add(&w[BELL_SUBMITTED], 1);  /* then PARKED: see bell_wait's park */
        if (atomic_load(&w[BELL_PARKED]) > 0) bell_wake(w, 1);
    } else if (kind == RING_ONE) {
        atomic_fetch_add(&w[BELL_TOKENS], 1);
        if (atomic_load(&w[BELL_WAITERS]) > 0) bell_wake(w, 1);
    } else if (kind == RING_ALL) {
        atomic_fetch_add(&w[BELL_ALL], 1);
        if (atomic_load(&w[BELL_WAITERS]) > 0) bell_wake(w, INT_MAX);
    } else {
        PyErr_SetString(PyExc_ValueError, "bell_ring: an unknown kind");
        return NULL;
    }
    Py_RETURN_NONE;
}

static int bell_take_token(_Atomic int32_t *w) {
    int32_t t = atomic_load(&w[BELL_TOKENS]);
    while (t > 0)
        if (atomic_compare_exchange_weak(&w[BELL_TOKENS], &t, t - 1)) return 1;
    return 0;
}

static PyObject *bell_taken(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    /* bell_taken(address, n): n queued jobs left the queue (to run, or to fail). */
    long n;
    _Atomic int32_t *w = bell_args(args, nargs, "bell_taken(address, n)", &n);
    if (w == NULL) return NULL;
    atomic_fetch_add(&w[BELL_TAKEN], (int32_t)n);
    Py_RETURN_NONE;
}

static PyObject *bell_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    /* bell_wait(address, seen_all, poll_ns, idle_ns, timeout_ns) -> bool: True when it
       took a token, when ALL moved past seen_all, or when a job queued at one tick is
       still queued at the next (ticks every poll_ns; the first at the call); False after
       timeout_ns (< 0: none). Parks (no ticks; a submission wakes it) after idle_ns
       without a submission. The GIL is released throughout. Counts are compared as
       differences (they wrap). */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "bell_wait(address, seen_all, poll_ns, idle_ns, timeout_ns)");
        return NULL;
    }
    _Atomic int32_t *w = bell_words(args[0]);
    long seen_all = PyLong_AsLong(args[1]);
    long long poll = PyLong_AsLongLong(args[2]), idle = PyLong_AsLongLong(args[3]);
    long long timeout = PyLong_AsLongLong(args[4]);
    if (w == NULL || PyErr_Occurred()) return NULL;
    if (poll <= 0) poll = 1;
    int got = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t t = clock_ns(CLOCK_MONOTONIC), deadline = timeout < 0 ? INT64_MAX : t + timeout;
    int64_t active = t;  /* the last tick that saw a new submission */
    uint32_t last = (uint32_t)atomic_load(&w[BELL_SUBMITTED]);
    uint32_t queued = last;  /* jobs up to here were queued at the previous tick */
    atomic_fetch_add(&w[BELL_WAITERS], 1);
    for (;;) {
        /* SEQ first: a ring after this load (which bumps SEQ after its word) ends the
           sleep below at once, so no ring falls between the checks and the sleep */
        int32_t seq = atomic_load(&w[BELL_SEQ]);
        if (atomic_load(&w[BELL_ALL]) != (int32_t)seen_all || bell_take_token(w)) {
            got = 1;
            break;
        }
        uint32_t sub = (uint32_t)atomic_load(&w[BELL_SUBMITTED]);
        uint32_t taken = (uint32_t)atomic_load(&w[BELL_TAKEN]);
        if ((int32_t)(queued - taken) > 0) {  /* queued at the last tick, still queued */
            got = 1;
            break;
        }
        t = clock_ns(CLOCK_MONOTONIC);
        if (sub != last) {
            last = sub;
            active = t;
        }
        queued = sub;
        if (t >= deadline) break;
        if (t - active >= idle) {
            atomic_fetch_add(&w[BELL_PARKED], 1);  /* then SUBMITTED: see bell_ring */
            if ((uint32_t)atomic_load(&w[BELL_SUBMITTED]) == sub &&
                atomic_load(&w[BELL_ALL]) == (int32_t)seen_all &&
                atomic_load(&w[BELL_TOKENS]) == 0)
                bell_sleep(&w[BELL_SEQ], seq, deadline == INT64_MAX ? -1 : deadline - t);
            atomic_fetch_sub(&w[BELL_PARKED], 1);
            active = clock_ns(CLOCK_MONOTONIC);  /* a job woke it: one tick more before it is taken */
        } else {
            int64_t left = deadline - t;
            bell_sleep(&w[BELL_SEQ], seq, left < poll ? left : poll);
        }
    }
    atomic_fetch_sub(&w[BELL_WAITERS], 1);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(got);
}

static PyMethodDef module_methods[] = {
    {"_go", (PyCFunction)(void (*)(void))lane_go, METH_FASTCALL,
     "A lane's collective, run by Executor.run_inline."},
    {"bell_ring", (PyCFunction)(void (*)(void))bell_ring, METH_FASTCALL,
     "bell_ring(address, kind): a job queued (0), one worker needed now (1), all (2)."},
    {"bell_taken", (PyCFunction)(void (*)(void))bell_taken, METH_FASTCALL,
     "bell_taken(address, n): n queued jobs left the queue."},
    {"bell_wait", (PyCFunction)(void (*)(void))bell_wait, METH_FASTCALL,
     "bell_wait(address, seen_all, poll_ns, idle_ns, timeout_ns) -> bool (GIL "
     "released)."},
    {NULL}};

static struct PyModuleDef lane_module = {
    PyModuleDef_HEAD_INIT, .m_name = "_lane", .m_doc = "The compiled latency path (lane.py).",
    .m_size = -1, .m_methods = module_methods};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;

PyMODINIT_FUNC PyInit__lane(void) {
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL) return NULL;
    INTERN(s_layout, "layout") INTERN(s_is_cpu, "is_cpu")
    INTERN(s_requires_grad, "requires_grad") INTERN(s_is_contiguous, "is_contiguous")
    INTERN(s_is_neg, "is_neg") INTERN(s_is_conj, "is_conj") INTERN(s_dtype, "dtype")
    INTERN(s_numel, "numel") INTERN(s_data_ptr, "data_ptr") INTERN(s_shape, "shape")
    INTERN(s_asyncOp, "asyncOp") INTERN(s_timeout, "timeout") INTERN(s_reduceOp, "reduceOp")
    INTERN(s_rootRank, "rootRank") INTERN(s_rootTensor, "rootTensor")
    INTERN(s_coalescing, "_coalescing") INTERN(s_seq, "_seq") INTERN(s_poison, "_poison")
    INTERN(s_closed, "_closed") INTERN(s_kernels, "_kernels") INTERN(s_next_slot, "next_slot")
    INTERN(s_known_min, "known_min") INTERN(s_free_at, "free_at") INTERN(s_step, "step")
    INTERN(s_completed_work, "_completed_work") INTERN(s_timeout_s, "timeout_s")
    INTERN(s_one_step, "one_step")
    if (PyType_Ready(&LaneType) < 0 || PyType_Ready(&LaneCallType) < 0) return NULL;
    PyObject *m = PyModule_Create(&lane_module);
    if (m == NULL) return NULL;
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    go_fn = PyObject_GetAttrString(m, "_go");
    if (go_fn == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "N_OPS", N_OPS);
    PyModule_AddIntConstant(m, "BELL_WORDS", BELL_WORDS);
    PyModule_AddIntConstant(m, "BELL_SUBMITTED", BELL_SUBMITTED);
    PyModule_AddIntConstant(m, "BELL_TAKEN", BELL_TAKEN);
    PyModule_AddIntConstant(m, "BELL_ALL", BELL_ALL);
    PyModule_AddIntConstant(m, "BELL_PARKED", BELL_PARKED);
    PyModule_AddIntConstant(m, "BELL_WAITERS", BELL_WAITERS);
    PyModule_AddIntConstant(m, "RING_JOB", RING_JOB);
    PyModule_AddIntConstant(m, "RING_ONE", RING_ONE);
    PyModule_AddIntConstant(m, "RING_ALL", RING_ALL);
    return m;
}
