"""Several "hosts" on one machine, for multi-node tests and benchmarks (needs root).

    with Hosts(2) as hosts:                 # creates the namespaces; always removes them
        p = hosts.popen(0, ["torchrun", ...], env={...})
        hosts.address(0)                    # "10.77.0.1": host 0 on the test network
        hosts.kill(1)                       # SIGKILL every process of host 1 (a lost node)
    ok, why = Hosts.available()

Host k is a network namespace `<prefix>-h<k>` whose eth0 (10.77.0.<k+1>/24) is one end of
a veth pair; the other ends sit in a bridge in a switch namespace `<prefix>-sw`, so the
hosts reach each other and nothing else (no address or route is added to the machine's
own namespace). Every command run on host k gets, on top of that, a private mount
namespace with its own tmpfs on /dev/shm and its own UTS namespace with hostname
`host<k>`: shared memory cannot cross hosts, and hostnames differ as on real machines
(the boot id is the machine's, as in containers). When the command exits, the entries
left in its /dev/shm are written to `<shm_dir>/host<k>.shm` (leak checks).

Cleanup: leaving the `with` block SIGKILLs every process in each host's network
namespace (`ip netns pids`: torchrun's workers included, whatever their process group)
and deletes the namespaces (their veths go with them); namespaces of ours whose creating
process is dead are swept at the next start. `leftovers()` lists what remains.
"""

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["Hosts", "leftovers", "torchrun_env"]

PREFIX = "shmcoll-ns"
SUBNET = "10.77.0"
_COUNTER = itertools.count()
_AVAILABLE = None

# Runs the command on a host: a private /dev/shm and hostname, the command, the leak list.
_SCRIPT = ('mount -t tmpfs -o size="$SHMCOLL_HOST_SHM_SIZE",mode=1777 tmpfs /dev/shm && '
           'hostname "$SHMCOLL_HOST_NAME" && "$@"; rc=$?; '
           'ls -A /dev/shm > "$SHMCOLL_HOST_SHM_LIST" 2>/dev/null; exit $rc')


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def _namespaces():
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers():
    """Namespaces of ours that still exist (any creator)."""
    return [ns for ns in _namespaces() if ns.startswith(PREFIX + "-")]


def _sweep_stale():
    """Delete namespaces of ours whose creating process is gone."""
    for ns in leftovers():
        try:
            pid = int(ns.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)


def _kill_namespace(ns):
    out = _ip("netns", "pids", ns, check=False).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return [int(p) for p in out.split() if p.isdigit()]


class Hosts:
    """`n` namespaced hosts (see the module docstring)."""

    def __init__(self, n, shm_size="2g"):
        self.n = n
        self.shm_size = shm_size
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_COUNTER)}"
        self.shm_dir = tempfile.mkdtemp(prefix="shmcoll-hosts-")
        self._procs = []
        self._made = []

    @staticmethod
    def available():
        """(True, "") when this process can create the namespaces, else (False, why)."""
        global _AVAILABLE
        if _AVAILABLE is None:
            _AVAILABLE = _probe()
        return _AVAILABLE

    def namespace(self, k):
        return f"{self.prefix}-h{k}"

    def address(self, k):
        return f"{SUBNET}.{k + 1}"

    def __enter__(self):
        _sweep_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _create(self):
        sw = f"{self.prefix}-sw"
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for k in range(self.n):
            ns = self.namespace(k)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{k}",
                "netns", sw)
            _ip("-n", sw, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{k}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, k, argv, env=None, **kw):
        """Start `argv` on host k (own /dev/shm, hostname host<k>); a new session."""
        full = dict(os.environ if env is None else env)
        full.update(SHMCOLL_HOST_SHM_SIZE=self.shm_size, SHMCOLL_HOST_NAME=f"host{k}",
                    SHMCOLL_HOST_SHM_LIST=os.path.join(self.shm_dir, f"host{k}.shm"))
        cmd = ["ip", "netns", "exec", self.namespace(k), "unshare", "--mount", "--uts",
               "--propagation", "private", "sh", "-c", _SCRIPT, f"host{k}", *argv]
        p = subprocess.Popen(cmd, env=full, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def torchrun(self, nproc, target, env=None, logs=None, port=29500, cwd=None):
        """`torchrun --nnodes H --node-rank k --nproc-per-node nproc[k]` on every host k,
        rendezvous on host 0; `target`: what follows torchrun's options (a script and its
        arguments, or "-m", module, ...). `logs[k]`: a path for host k's output (None:
        inherited). -> the Popen of every host."""
        nproc = [nproc] * self.n if isinstance(nproc, int) else list(nproc)
        procs = []
        for k in range(self.n):
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}",
                    f"--node-rank={k}", f"--nproc-per-node={nproc[k]}", "--max-restarts=0",
                    f"--master-addr={self.address(0)}", f"--master-port={port}", *target]
            out = open(logs[k], "wb") if logs else None
            procs.append(self.popen(k, argv, env=torchrun_env(env), cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT if out else None))
        return procs

    def shm_left(self, k):
        """Entries left in host k's /dev/shm when its last command exited (None: unknown)."""
        try:
            with open(os.path.join(self.shm_dir, f"host{k}.shm")) as f:
                return f.read().split()
        except OSError:
            return None

    def kill(self, k):
        """SIGKILL every process on host k (a lost node); -> their pids."""
        return _kill_namespace(self.namespace(k))

    def close(self):
        for k in range(self.n):
            _kill_namespace(self.namespace(k))
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            for _ in range(50):  # a namespace is busy until its last process is reaped
                if _ip("netns", "del", ns, check=False).returncode == 0 or \
                        ns not in _namespaces():
                    break
                _kill_namespace(ns)
                time.sleep(0.1)
        self._made = []
        shutil.rmtree(self.shm_dir, ignore_errors=True)


def torchrun_env(extra=None):
    """The environment of ranks on the hosts: this repository first on PYTHONPATH, gloo on
    the hosts' eth0, one intra-op thread per rank, and no SHMCOLL_NODE_ID (the nodes must
    be found by detection)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("SHMCOLL_NODE_ID", None)
    env.update(extra or {})
    return env


def _probe():
    if os.geteuid() != 0:
        return False, "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return False, f"needs the `{tool}` command"
    try:
        with Hosts(1) as h:
            p = h.popen(0, ["true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = p.communicate(timeout=30)
            if p.returncode != 0:
                return False, f"cannot run a command on a namespaced host: {err.decode()[-300:]}"
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot create namespaces: {e}"
    return True, ""
