"""python -m cuda_ipc.info: what backend "shm" will do with CUDA tensors on this machine.

Reports the visible GPUs, the CUDA runtime and driver versions, their peer-to-peer matrix,
whether the stream memory operations cuda_ipc orders streams with work on shared memory
registered with the GPU (the probe every process runs at its first use of a device),
whether CUDA IPC works between two processes here (a child process opens a handle this
one exported and reads it back: it fails in containers without a shared PID namespace),
how long a handoff between two processes' streams on one GPU takes through those flag
words (a child's stream waits for each value this one's writes and answers; the GPU
time-slices between the two processes), and the tier ranks would get on one GPU and
across GPUs. Exits 0 when device tensors will work (or there is no GPU: then CPU tensors
are unaffected), 1 when they would fail, with the fix. Every check has a deadline.
"""

import os
import subprocess
import sys
import tempfile
import time

__all__ = ["report", "main"]

_CHILD = """
import sys, torch
from cuda_ipc.cuda import CudaDevice
dev = CudaDevice(0)
m = dev.open(bytes.fromhex(sys.argv[1]), 64)
print(dev.read_bytes(m.tensor[:16], 20).hex())
dev.close_mapping(m)
"""

# The child of the flag handoff: for k = 1..n its stream waits PING >= k, then writes
# PONG := k. The parent's stream writes PING := k and waits PONG >= k.
_PING, _PONG, _READY = 0, 16, 32  # word indices, on separate lines
_PINGPONG_CHILD = """
import mmap, sys, time, numpy as np, torch
from cuda_ipc.cuda import CudaDevice
from cuda_ipc.device import read_word, write_word
path, n, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
dev = CudaDevice(0)
with open(path, "r+b") as f:
    buf = mmap.mmap(f.fileno(), mmap.PAGESIZE)
view = np.frombuffer(buf, np.uint8)
host, base = view.ctypes.data, dev.register_host(view)
stream = torch.cuda.Stream(0)
write_word(host + 8 * %d, 1)  # before enqueueing: waits on counters pass when late
for k in range(1, n + 1):
    dev.wait_value(stream, base + 8 * %d, k)
    dev.write_value(stream, base + 8 * %d, k)
try:
    dev.synchronize(stream, timeout_s)
    print("ok")
finally:
    write_word(host + 8 * %d, n)  # released, whatever happened
    dev.synchronize(stream, 10)
    dev.unregister_host(view)
""" % (_READY, _PING, _PONG, _PING)


def _ipc_works(timeout_s=45.0):
    """(ok, detail): a child process maps a buffer this process exported and reads it."""
    import numpy as np
    from .cuda import CudaDevice
    dev = CudaDevice(0)
    alloc = dev.alloc(64)
    try:
        pattern = np.arange(16, dtype=np.uint8) + 101
        dev.write_bytes(alloc.tensor[:16], pattern)
        out = subprocess.run([sys.executable, "-c", _CHILD, dev.export(alloc).hex()],
                             capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            return False, (out.stderr.strip().splitlines() or ["child failed"])[-1]
        ok = out.stdout.strip() == pattern.tobytes().hex()
        return ok, "read back" if ok else f"read {out.stdout.strip()!r}"
    except subprocess.TimeoutExpired:
        return False, f"the child did not finish in {timeout_s:.0f} s"
    finally:
        dev.free(alloc)


def _flag_handoff(n=200, timeout_s=20.0):
    """(ok, detail): n handoffs between this process's stream and a child's, through flag
    words in /dev/shm (stream writes and waits only); the time per round trip."""
    import mmap

    import numpy as np
    import torch

    from .cuda import CudaDevice
    from .device import read_word, write_word
    dev = CudaDevice(0)
    fd, path = tempfile.mkstemp(prefix="cuda_ipc-probe-", dir="/dev/shm")
    os.ftruncate(fd, mmap.PAGESIZE)
    buf = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    view = np.frombuffer(buf, np.uint8)
    host, base = view.ctypes.data, dev.register_host(view)
    child = subprocess.Popen([sys.executable, "-c", _PINGPONG_CHILD, path, str(n),
                              str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    stream = torch.cuda.Stream(0)
    try:
        deadline = time.monotonic() + 45  # the child imports torch and probes first
        while read_word(host + 8 * _READY) != 1:
            if child.poll() is not None or time.monotonic() > deadline:
                return False, "the child did not start: " + \
                    ((child.communicate(timeout=5)[1] or "").strip().splitlines() or ["?"])[-1]
            time.sleep(1e-3)
        t0 = time.perf_counter()
        for k in range(1, n + 1):
            dev.write_value(stream, base + 8 * _PING, k)
            dev.wait_value(stream, base + 8 * _PONG, k)
        enqueued = time.perf_counter() - t0
        deadline = time.monotonic() + timeout_s
        while read_word(host + 8 * _PONG) != n and time.monotonic() < deadline:
            time.sleep(1e-4)
        took = time.perf_counter() - t0
        done = read_word(host + 8 * _PONG)
        if done != n:
            return False, (f"only {done} of {n} handoffs between two processes' streams in "
                           f"{timeout_s:.0f} s")
        # NOTE: no gate holds the streams until everything is enqueued: a stream whose
        # head waits for the host could fill its queue and block the enqueue itself.
        # So `took` is an upper bound when the host's enqueue (also shown) dominates.
        return True, (f"{n} round trips in {took * 1e3:.1f} ms: at most {took / n * 1e6:.1f} "
                      f"us each (host enqueue of a write+wait: {enqueued / n * 1e6:.1f} us)")
    finally:
        write_word(host + 8 * _PING, n)  # nothing is left waiting, whatever happened
        write_word(host + 8 * _PONG, n)
        if child.poll() is None:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        os.unlink(path)
        dev.synchronize(stream, 10)
        dev.unregister_host(view)
        del view


def _guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported as a finding
        return False, f"{type(e).__name__}: {e}"


def report():
    """[(level, text, fix)], level OK / INFO / WARN / FAIL (shmcoll.doctor's levels)."""
    return list(findings())


def findings():
    """The findings of report(), each as soon as it is known (main prints them so: a
    deadline that stops this process still leaves what was found before it)."""
    import torch
    if not torch.cuda.is_available():
        yield ("INFO", "no CUDA device visible (torch.cuda.is_available() is False): "
               "backend 'shm' moves CPU tensors only", "")
        return
    from .cuda_api import (ATTR_CAN_MAP_HOST_MEMORY, ATTR_HOST_REGISTER_SUPPORTED,
                           ATTR_UNIFIED_ADDRESSING, Api)
    n = torch.cuda.device_count()
    yield ("INFO", f"{n} CUDA device(s), torch {torch.__version__} (CUDA "
           f"{torch.version.cuda})", "")
    try:
        api = Api.get()
    except Exception as e:  # noqa: BLE001 - reported
        yield ("FAIL", f"the CUDA runtime/driver functions cuda_ipc needs are not "
                       f"available ({e})", "a CUDA 12 or newer driver")
        return
    rt, drv = api.versions()
    yield ("INFO", f"CUDA runtime {rt // 1000}.{rt % 1000 // 10} ({api.runtime_path}), "
           f"driver API {drv // 1000}.{drv % 1000 // 10}, stream memory operations "
           f"{'_v2' if api.memops_v2 else 'v1 (needs NVreg_EnableStreamMemOPs=1)'}", "")
    from .cuda import CudaDevice
    devs = []
    for i in range(n):
        attrs = ", ".join(f"{name}={api.attribute(a, i)}" for name, a in (
            ("CanMapHostMemory", ATTR_CAN_MAP_HOST_MEMORY),
            ("UnifiedAddressing", ATTR_UNIFIED_ADDRESSING),
            ("HostRegisterSupported", ATTR_HOST_REGISTER_SUPPORTED)))
        try:
            d = CudaDevice(i)
        except Exception as e:  # noqa: BLE001 - the probe's finding, with its fix
            yield ("FAIL", f"cuda:{i}: {e} [{attrs}]", "see the message")
            continue
        devs.append(d)
        free, total = d.mem_get_info()
        yield ("OK", f"cuda:{d.index} {d.describe()} uuid {d.uuid}, {free / 2**30:.1f} of "
                     f"{total / 2**30:.1f} GiB free; stream memory operations on shared memory "
                     f"registered with it work (probed) [{attrs}]", "")
    if not devs or devs[0].index != 0:
        return
    if len(devs) > 1:
        yield ("INFO", "peer-to-peer (row can map column): " + "; ".join(
            f"{a.index}->{b.index} {'yes' if a.can_access_peer(b.uuid) else 'no'}"
            for a in devs for b in devs if a is not b), "")
    ipc, detail = _guarded(_ipc_works)
    yield ("OK" if ipc else "WARN", f"CUDA IPC between processes: "
           f"{'works' if ipc else 'fails'} ({detail})",
           "" if ipc else "run the ranks in one container/PID namespace (docker "
           "--ipc=host --pid=host); meanwhile the host tier works, slower")
    flags, detail = _guarded(_flag_handoff)
    yield ("OK" if flags else "FAIL", f"stream handoffs between two processes on "
           f"cuda:0 through flag words: {detail}",
           "" if flags else "collectives on CUDA tensors would hang or time out here")
    p2p = ipc and all(a.can_access_peer(b.uuid) for a in devs for b in devs if a is not b)
    yield ("INFO", f"tier for ranks sharing one GPU: "
           f"{'same_gpu' if ipc else 'host (staged through /dev/shm)'}", "")
    if len(devs) > 1:
        yield ("INFO", f"tier for ranks on different GPUs: {'p2p' if p2p else 'host'}", "")


def main():
    failed = False
    for level, text, fix in findings():
        print(f"{level:5} {text}" + (f"\n      fix: {fix}" if fix else ""), flush=True)
        failed = failed or level == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
