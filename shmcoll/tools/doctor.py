"""`python -m shmcoll.doctor`: what the engine will do on this machine, and why.

    python -m shmcoll.doctor                    # for as many ranks as cores
    python -m shmcoll.doctor --world-size 8 --threads 1
    python -m shmcoll.doctor --shm-bytes 64M    # as if /dev/shm had 64 MiB free (Docker's default)

One section per subject -- dependencies, /dev/shm, single copy (CMA), page sizes, cores
and threads, numba's kernel cache, GPUs -- each line marked OK, INFO, WARN or FAIL. A
FAIL is something that will make a job fail; it comes with the fix, and the exit status
is then 1 (0 otherwise, 2 for a bad command line). Nothing here changes the machine.

GPUs are an extension point: another package adds a section with register_section(title,
fn), fn(options) returning Findings, in the module its "shmcoll.doctor" entry point names
(imported by the GPU check): cuda_ipc declares `cuda_ipc.doctor`, so the CUDA IPC package
reports its devices, P2P matrix and tier there. Without it (or
without a GPU) the section says so.
"""

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

from .. import config
from ..native import jit, pages, prebuilt
from ..algorithms import SINGLE_COPY_MIN
from ..protocol import RegionLayout
from ..native.single_copy import CMA

__all__ = ["Finding", "register_section", "run", "main"]

MIB = 1 << 20
OK, INFO, WARN, FAIL = "OK", "INFO", "WARN", "FAIL"


@dataclass
class Finding:
    """One line of the report: level (OK / INFO / WARN / FAIL), what, and the fix."""

    level: str
    text: str
    fix: str = ""


_SECTIONS = []  # (title, fn) added by other packages


def register_section(title, fn):
    """Add a report section: fn(options) -> list of Finding (options: the parsed command
    line: world_size, threads, shm_bytes). An exception in fn becomes a WARN line."""
    _SECTIONS.append((title, fn))


# ---------------------------------------------------------------------------- sections

def check_dependencies(opts):
    found = []
    for name, dist, need in (("numpy", "numpy", True), ("numba", "numba", True),
                             ("posix_ipc", "posix-ipc", True), ("torch", "torch", False)):
        if importlib.util.find_spec(name) is None:
            level = FAIL if need else INFO
            found.append(Finding(level, f"{name}: not installed" + (
                "" if need else " (the numpy engine and threaded_pg's engine API work "
                "without it)"), f"pip install {dist}" if need else ""))
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        found.append(Finding(OK, f"{name} {version}"))
    if importlib.util.find_spec("shmcoll.torch_backend._lane") is None:
        found.append(Finding(WARN, "the compiled latency path (shmcoll/torch_backend/_lane.c) "
                                   "was not built at install: small synchronous collectives "
                                   "take the Python path, ~5-20 us slower each",
                             "install a C compiler and Python's headers (e.g. gcc, "
                             "python3-dev), then reinstall shmcoll"))
    else:
        found.append(Finding(OK, "compiled latency path built"))
    return found


def region_nbytes(cfg, world_size):
    """Bytes of one rank's region in a group of `world_size` ranks (shm.py creates one
    per rank, per process group)."""
    return RegionLayout(cfg.slot_nbytes, cfg.nslots, world_size,
                        config.p2p_cells(cfg, world_size), cfg.p2p_cell_nbytes).nbytes


def check_shm(opts, cfg):
    ws = opts.world_size
    per_rank = region_nbytes(cfg, ws)
    need = ws * per_rank
    fix_size = f"{max(64, 2 ** math.ceil(math.log2(2 * need / MIB)))}m"
    fixes = (f"run the container with --shm-size={fix_size} (or --ipc=host); on Kubernetes "
             f"mount an emptyDir with medium: Memory at /dev/shm; or lower SHMCOLL_SLOT_BYTES "
             f"(now {cfg.slot_nbytes // MIB} MiB; each region is {cfg.nslots} slots + the p2p "
             f"area)")
    try:
        st = os.statvfs(cfg.shm_dir)
    except OSError as e:
        return [Finding(FAIL, f"{cfg.shm_dir}: {e.strerror}", "POSIX shared memory needs a "
                        "tmpfs at /dev/shm (or point SHMCOLL_SHM_DIR at where it is)")]
    free = st.f_bavail * st.f_frsize if opts.shm_bytes is None else opts.shm_bytes
    total = st.f_blocks * st.f_frsize if opts.shm_bytes is None else opts.shm_bytes
    where = "(--shm-bytes)" if opts.shm_bytes is not None else f"({cfg.shm_dir})"
    found = [Finding(INFO, f"{ws} ranks need {need / MIB:.1f} MiB: {ws} regions of "
                           f"{per_rank / MIB:.1f} MiB ({cfg.nslots} slots of "
                           f"{cfg.slot_nbytes // MIB} MiB + p2p mailboxes), one per rank, "
                           f"for each process group; a region lives while its group does")]
    if free < need:
        found.append(Finding(FAIL, f"/dev/shm has {free / MIB:.1f} MiB free of "
                                   f"{total / MIB:.1f} MiB {where}: init_process_group will "
                                   f"fail (SegmentError: cannot reserve)", fixes))
    elif free < 2 * need:
        found.append(Finding(WARN, f"/dev/shm has {free / MIB:.1f} MiB free {where}: enough "
                                   f"for the default group, not for a second group of all "
                                   f"ranks (new_group, subgroups)", fixes))
    else:
        found.append(Finding(OK, f"/dev/shm has {free / MIB:.1f} MiB free of "
                                 f"{total / MIB:.1f} MiB {where}"))
    return found


_HOLDER = ("import ctypes,sys\nb=ctypes.create_string_buffer(b'shmcoll-doctor')\n"
           "print(ctypes.addressof(b),flush=True)\nsys.stdin.read()\n")
_READER = ("import ctypes,sys\npid,addr=map(int,sys.argv[1:3])\n"
           "class V(ctypes.Structure):_fields_=[('b',ctypes.c_void_p),('n',ctypes.c_size_t)]\n"
           "g=ctypes.create_string_buffer(14)\nlibc=ctypes.CDLL(None,use_errno=True)\n"
           "k=libc.process_vm_readv(pid,ctypes.byref(V(ctypes.addressof(g),14)),1,"
           "ctypes.byref(V(addr,14)),1,0)\nprint(k,ctypes.get_errno(),g.raw==b'shmcoll-doctor')\n")


def probe_cma(timeout_s=20.0):
    """Whether one process can read a sibling's memory with process_vm_readv, as ranks
    (siblings under torchrun or mp.spawn) do at init: (works, errno)."""
    cmd = [sys.executable, "-I", "-c"]
    holder = subprocess.Popen(cmd + [_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        addr = int(holder.stdout.readline())
        r = subprocess.run(cmd + [_READER, str(holder.pid), str(addr)], capture_output=True,
                           text=True, timeout=timeout_s)
        got, err, same = r.stdout.split()
        return int(got) == 14 and same == "True", int(err)
    except (ValueError, subprocess.TimeoutExpired):
        return False, 0
    finally:
        holder.stdin.close()
        holder.wait(timeout_s)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _container():
    if os.path.exists("/.dockerenv"):
        return "Docker (/.dockerenv)"
    if os.path.exists("/run/.containerenv"):
        return "Podman (/run/.containerenv)"
    cgroup = _read("/proc/1/cgroup") or ""
    for word in ("kubepods", "docker", "containerd", "lxc"):
        if word in cgroup:
            return f"a container ({word} in /proc/1/cgroup)"
    return None


def check_single_copy(opts, cfg, probe=probe_cma):
    lo = SINGLE_COPY_MIN[CMA]
    uses = (f"all_reduce from {lo['all_reduce'][0] // MIB} MiB and reduce_scatter from "
            f"{lo['reduce_scatter'][0] // MIB} MiB read peers' buffers in place "
            f"(process_vm_readv, one pass over memory less)")
    if cfg.single_copy == "off":
        return [Finding(INFO, "single copy is off (SHMCOLL_SINGLE_COPY=off): every collective "
                              "goes through the shared-memory slots")]
    works, err = probe()
    why = []
    scope = (_read("/proc/sys/kernel/yama/ptrace_scope") or "").strip()
    if scope:
        why.append(f"kernel.yama.ptrace_scope={scope}" + {
            "0": "", "1": " (only a process's descendants: ranks are siblings)",
            "2": " (needs CAP_SYS_PTRACE)", "3": " (no process may)"}.get(scope, ""))
    status = _read("/proc/self/status") or ""
    seccomp = next((ln.split()[1] for ln in status.splitlines()
                    if ln.startswith("Seccomp:")), "0")
    if seccomp != "0":
        why.append("a seccomp filter is active (Docker's default profile refuses "
                   "process_vm_readv without CAP_SYS_PTRACE)")
    inside = _container()
    if inside:
        why.append(f"running in {inside}")
    if works:
        return [Finding(OK, f"single copy works between sibling processes: {uses}")]
    reason = os.strerror(err) if err else "no result"
    return [Finding(INFO, f"single copy is not available ({reason}"
                          f"{'; ' + '; '.join(why) if why else ''}): every collective goes "
                          f"through the slots, which works, one copy slower from a few MiB",
                    "sysctl kernel.yama.ptrace_scope=0, or run the container with "
                    "--cap-add=SYS_PTRACE")]


def check_pages(opts):
    mode = pages.thp_mode()
    small = pages.torch_buffers_small_pages(mode)
    found = [Finding(INFO, f"transparent huge pages: {mode}; THP_MEM_ALLOC_ENABLE="
                           f"{os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")]
    if small:
        found.append(Finding(
            INFO, "torch's CPU tensors are likely on 4 KiB pages: process_vm_readv pins every "
                  "page, so all_reduce never reads peers' tensors where they lie (it goes "
                  "through the slots)",
            "THP_MEM_ALLOC_ENABLE=1 (with THP mode madvise or always) puts large tensors on "
            "huge pages: faster large collectives with any backend"))
    else:
        found.append(Finding(OK, "torch's large CPU tensors get huge pages: single copy is "
                                 "used wherever it pays"))
    return found


def _default_threads(cores):
    """torch's intra-op threads: OMP_NUM_THREADS, else OpenMP's default, the cores."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    return cores


def check_cores(opts, cfg):
    cores = len(os.sched_getaffinity(0))
    ws, threads = opts.world_size, opts.threads
    found = []
    if cfg.spin != "auto":
        found.append(Finding(INFO, f"SHMCOLL_SPIN={cfg.spin}: waits "
                                   f"{'never ' if cfg.spin == 'yield' else ''}spin"))
    elif ws > cores:
        found.append(Finding(INFO, f"{ws} ranks on {cores} cores: oversubscribed, so waits "
                                   f"yield the core instead of spinning (correct, slower)"))
    else:
        found.append(Finding(OK, f"{ws} ranks on {cores} cores: waits spin briefly, then "
                                 f"yield"))
    if ws * threads > cores:
        found.append(Finding(WARN, f"{ws} ranks x {threads} intra-op threads exceed {cores} "
                                   f"cores: idle OpenMP workers spin on the cores the peers "
                                   f"need (a 16 MiB all_reduce took 9-72 ms instead of 3 ms "
                                   f"on the 2-core dev VM)",
                             f"OMP_NUM_THREADS={max(1, cores // ws)} (torchrun sets 1), or "
                             f"torch.set_num_threads({max(1, cores // ws)}) in each rank"))
    else:
        found.append(Finding(OK, f"{ws} ranks x {threads} intra-op threads fit {cores} cores"))
    return found


def _kernel_functions():
    """Every compiled shmcoll kernel's Python function; one closure standing for each of
    the two reducer builders (their compiled versions share one cache index per builder),
    and how many reducers there are: a sum and a general one per storage dtype of
    int/float/complex, and per 16-bit kind."""
    import numpy as np
    import numba
    from ..native import atomics, reducers as kernels, single_copy_kernels
    from ..p2p import cells as p2p_cells
    from ..protocol import kernels as protocol_kernels
    funcs = [d.py_func for mod in (atomics, kernels, protocol_kernels, single_copy_kernels,
                                   p2p_cells)
             for d in vars(mod).values()
             if isinstance(d, numba.core.dispatcher.Dispatcher) and d.__module__ == mod.__name__]
    same = {np.dtype(d) for k in ("int", "float", "complex") for d in kernels.KINDS[k]}
    return funcs, [kernels._build_same(np.dtype(np.float32), True),
                   kernels._build_16(True, True)], 2 * len(same) + 2 * 2


def check_cache(opts):
    where = jit.cache_dir()
    if where is None:
        return [Finding(WARN, "numba's cache location is unknown (a numba version whose "
                              "cache internals this was not written for): kernels may "
                              "compile in every process")]
    found = [Finding(INFO, f"numba caches shmcoll's kernels in {where}")]
    shipped = prebuilt.status()
    if shipped.path is not None:
        return found + [Finding(OK, f"the kernels shipped in the wheel match this install "
                                    f"({shipped.manifest.get('cpu')}, numba "
                                    f"{shipped.manifest.get('numba')}): nothing to compile "
                                    f"({shipped.path})")]
    found.append(Finding(INFO, f"shipped kernels not used: {shipped.reason}"))
    funcs, reducers, n_reducers = _kernel_functions()
    counts = [jit.cached_entries(f) for f in funcs]
    if None in counts:
        return found + [Finding(INFO, "whether they are compiled: unknown with this numba")]
    have = sum(1 for c in counts if c)
    reduce_n = sum(jit.cached_entries(f) or 0 for f in reducers)
    one_step = next(c for f, c in zip(funcs, counts) if f.__name__ == "_one_step_kernel")
    summary = (f"{have} of {len(funcs)} kernels and {reduce_n} of {n_reducers} reducers "
               f"compiled for this CPU, Python and numba")
    if have == len(funcs) and reduce_n >= n_reducers:
        return found + [Finding(OK, f"warm: {summary}")]
    fix = ("python -m shmcoll.engine.warmup (~10-20 s, once per machine, Python and numba "
           "version; e.g. in the container image)")
    if one_step:
        return found + [Finding(INFO, f"partly warm: {summary}; a first collective of "
                                      f"another dtype or size compiles ~0.3-0.5 s", fix)]
    return found + [Finding(WARN, f"cold: {summary}; the first job compiles its kernels: "
                                  f"~2 s before the first collective, ~0.5 s for each new "
                                  f"dtype (one rank compiles, the others wait and load)",
                            fix)]


def check_gpus(opts):
    found = []
    for ep in _extensions():  # each registers its own section(s) when imported
        try:
            ep.load()
        except ModuleNotFoundError as e:
            top = ep.value.split(":")[0]
            if e.name not in (top.split(".")[0], top):
                found.append(Finding(WARN, f"{top} could not be imported: {e}"))
        except Exception as e:  # noqa: BLE001 -- an extension's bug must not hide the report
            found.append(Finding(WARN, f"{ep.value} could not be imported: {e!r}"))
    if found or _SECTIONS:
        return found
    return [Finding(INFO, "no GPU section (cuda_ipc is not installed): shm handles CPU "
                          "tensors; CUDA tensors need another backend (nccl)")]


def _extensions():
    """The installed packages' sections: the entry points of the group "shmcoll.doctor"
    (cuda_ipc declares `cuda_ipc.doctor` there: pyproject.toml). The doctor names no
    package above it; a package adds its section by declaring one."""
    try:
        return list(importlib.metadata.entry_points(group="shmcoll.doctor"))
    except Exception:  # noqa: BLE001 -- broken metadata elsewhere must not end the report
        return []


# ------------------------------------------------------------------------------ driver

def run(opts, out=sys.stdout, cfg=None):
    """Print the report for `opts` (see main); returns the exit status."""
    cfg = cfg or config.from_env()
    sections = [("dependencies", lambda: check_dependencies(opts)),
                ("/dev/shm", lambda: check_shm(opts, cfg)),
                ("single copy (CMA)", lambda: check_single_copy(opts, cfg)),
                ("page sizes", lambda: check_pages(opts)),
                ("cores and threads", lambda: check_cores(opts, cfg)),
                ("numba kernel cache", lambda: check_cache(opts)),
                ("GPUs", lambda: check_gpus(opts))]
    report = []
    for title, fn in sections:
        found = fn()
        if found or title != "GPUs":  # GPUs: an extension's own sections replace it
            report.append((title, found))
    for title, fn in list(_SECTIONS):
        try:
            report.append((title, fn(opts)))
        except Exception as e:  # noqa: BLE001
            report.append((title, [Finding(WARN, f"this section failed: {e!r}")]))
    failed = any(f.level == FAIL for _, found in report for f in found)
    if opts.json:
        json.dump({"world_size": opts.world_size, "threads": opts.threads, "failed": failed,
                   "sections": {t: [vars(f) for f in found] for t, found in report}},
                  out, indent=1)
        out.write("\n")
    else:
        out.write(f"shmcoll doctor: {opts.world_size} ranks, {opts.threads} intra-op "
                  f"threads each\n")
        for title, found in report:
            out.write(f"\n{title}\n")
            for f in found:
                out.write(f"  {f.level:4}  {f.text}\n")
                if f.fix:
                    out.write(f"        fix: {f.fix}\n")
        out.write("\n" + ("FAIL: a job will fail here; see the fix lines above\n" if failed
                          else "no problem that would make a job fail\n"))
    return 1 if failed else 0


def _bytes(text):
    units = {"": 1, "K": 1 << 10, "M": MIB, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units and not text[-1].isdigit():
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv=None):
    cores = len(os.sched_getaffinity(0))
    ws_env = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    ap = argparse.ArgumentParser(prog="python -m shmcoll.doctor",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=int(ws_env) if ws_env else cores,
                    help="ranks on this machine (default: LOCAL_WORLD_SIZE or WORLD_SIZE, "
                         "else the cores)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads per rank (default: OMP_NUM_THREADS, else the "
                         "cores, torch's default)")
    ap.add_argument("--shm-bytes", type=_bytes, default=None,
                    help="pretend /dev/shm has this much free (e.g. 64M) to see what a "
                         "container's limit would do")
    ap.add_argument("--json", action="store_true", help="machine-readable report")
    opts = ap.parse_args(argv)
    if opts.world_size < 1 or (opts.threads is not None and opts.threads < 1):
        ap.error("--world-size and --threads must be >= 1")
    if opts.threads is None:
        opts.threads = _default_threads(cores)
    return run(opts)


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy of the module: run the one
    # that extensions (cuda_ipc.doctor) import and register their sections with.
    from shmcoll.tools import doctor as _doctor
    sys.exit(_doctor.main())
