"""python -m cuda_ipc.info: what backend "shm" will do with CUDA tensors on this machine.

Reports the visible GPUs, their peer-to-peer matrix, whether the driver has the stream
memory operations cuda_ipc orders streams with, whether CUDA IPC works between two
processes here (a child process opens a handle this one exported and reads it back: it
fails in containers without a shared PID namespace), and the tier ranks would get on one
GPU and across GPUs. Exits 0 when device tensors will work (or there is no GPU: then CPU
tensors are unaffected), 1 when they would fail, with the fix.
"""

import subprocess
import sys

__all__ = ["report", "main"]

_CHILD = """
import sys, torch
from cuda_ipc.cuda import CudaDevice
dev = CudaDevice(0)
m = dev.open(bytes.fromhex(sys.argv[1]), 64)
print(dev.read_bytes(m.tensor[:16], 20).hex())
dev.close_mapping(m)
"""


def _ipc_works(timeout_s=60.0):
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


def report():
    """[(level, text, fix)], level OK / INFO / FAIL (shmcoll.doctor's levels)."""
    import torch
    if not torch.cuda.is_available():
        return [("INFO", "no CUDA device visible (torch.cuda.is_available() is False): "
                 "backend 'shm' moves CPU tensors only", "")]
    from .cuda import CudaDevice
    from .cuda_api import Api
    n = torch.cuda.device_count()
    devs = [CudaDevice(i) for i in range(n)]
    out = [("INFO", f"{n} CUDA device(s), torch {torch.__version__} (CUDA "
            f"{torch.version.cuda})", "")]
    for d in devs:
        free, total = d.mem_get_info()
        out.append(("INFO", f"cuda:{d.index} {d.describe()} uuid {d.uuid}, "
                    f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free", ""))
    if n > 1:
        out.append(("INFO", "peer-to-peer (row can map column): " + "; ".join(
            f"{a.index}->{b.index} {'yes' if a.can_access_peer(b.uuid) else 'no'}"
            for a in devs for b in devs if a is not b), ""))
    try:
        Api.get()
        out.append(("OK", "stream memory operations (cuStreamWrite/WaitValue32) available", ""))
    except Exception as e:  # noqa: BLE001 - reported
        out.append(("FAIL", f"stream memory operations unavailable ({e})",
                    "a CUDA 12 or newer driver"))
    ipc, detail = _ipc_works()
    out.append(("OK" if ipc else "WARN", f"CUDA IPC between processes: "
                f"{'works' if ipc else 'fails'} ({detail})",
                "" if ipc else "run the ranks in one container/PID namespace (docker "
                "--ipc=host --pid=host); meanwhile the host tier works, slower"))
    p2p = ipc and all(a.can_access_peer(b.uuid) for a in devs for b in devs if a is not b)
    out.append(("INFO", f"tier for ranks sharing one GPU: "
                f"{'same_gpu' if ipc else 'host (staged through /dev/shm)'}", ""))
    if n > 1:
        out.append(("INFO", f"tier for ranks on different GPUs: {'p2p' if p2p else 'host'}",
                    ""))
    return out


def main():
    found = report()
    for level, text, fix in found:
        print(f"{level:5} {text}" + (f"\n      fix: {fix}" if fix else ""))
    return 1 if any(level == "FAIL" for level, _, _ in found) else 0


if __name__ == "__main__":
    sys.exit(main())
