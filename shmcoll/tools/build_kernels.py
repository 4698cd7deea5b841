"""Builds the kernels a wheel ships (prebuilt.py; docs/COLD_START.md): setup.py runs
build(<the build directory's package>) after build_py.

    python -m shmcoll.tools.build_kernels build <package dir> [part,...]

build() compiles every kernel -- what `python -m shmcoll.engine.warmup` compiles -- for each
target CPU this machine runs (prebuilt.targets()), in child processes that run with
NUMBA_CPU_NAME=<target>, NUMBA_CPU_FEATURES='' and prebuilt.BUILD_ENV pointing at their
own directory, as many at a time as there are cores (PARTS: two, about as long each,
sharing no kernel), then
merges their files into <package dir>/_kernels/<cpu>/ with a manifest (prebuilt.fields,
prebuilt.key). Then a last child, on this machine's CPU with an empty numba cache, runs
the full warm-up from them and a few reductions against numpy: any compilation, or a
wrong result, fails the build and leaves no _kernels.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..native import jit, prebuilt

__all__ = ["build", "PARTS", "ALL", "main"]


def _warm_protocol():
    from ..native import atomics, reducers
    from ..p2p import cells as p2p_cells
    from ..protocol import kernels as protocol_kernels
    atomics.warm_up()
    protocol_kernels.warm_up_one_step()
    protocol_kernels.warm_up()
    p2p_cells.ensure_kernels()
    reducers.warm_up(reducers.KINDS_16, python_call=False)  # evens out the two children


def _warm_reducers():
    from ..native import reducers
    reducers.warm_up([kind for kind in reducers.KINDS if kind not in reducers.KINDS_16])


def _warm_first():
    """What a group's creation and its first small float32 all_reduce load, and the
    Python-callable reduction."""
    from ..native import reducers
    from ..p2p import cells as p2p_cells
    from ..protocol import kernels as protocol_kernels
    from ..engine import warmup
    warmup.warm_up(warmup.FIRST_REDUCERS)
    jit.once(reducers._REDUCE_CALL, reducers._warm_reduce_call)
    jit.once(protocol_kernels._EXCHANGE, protocol_kernels._warm_exchange)
    jit.once(p2p_cells._PROGRESS_WAIT, p2p_cells._warm_progress_wait)


# What the build compiles, in parts that share no kernel (each its own child, its own
# files; build() checks that no two write one file): together, everything `python -m
# shmcoll.engine.warmup` compiles (build() checks that too). About as long to compile each: the
# protocol kernels with the 16-bit reducers, the other reducers. "first" (a group's
# creation and first all_reduce alone) is for tests.
PARTS = {"protocol": _warm_protocol, "reducers": _warm_reducers, "first": _warm_first}
ALL = ("protocol", "reducers")


def _child_env(package_dir, cache_dir, **extra):
    """The build's environment for its children: the package to build first on the path
    (the rest of PYTHONPATH kept: pip's isolated build environment is a sitecustomize on
    it), no NUMBA_* / SHMCOLL_* settings of the builder's (NUMBA_OPT, NUMBA_BOUNDSCHECK...
    would change the code shipped), numba's cache in `cache_dir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "SHMCOLL_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(package_dir).parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                           else []))
    env["NUMBA_CACHE_DIR"] = str(cache_dir)
    env.update(extra)
    return env


def _start_child(what, package_dir, parts, env):
    # cwd: `python -m` puts it first on the path, before PYTHONPATH
    return subprocess.Popen(
        [sys.executable, "-m", "shmcoll.tools.build_kernels", what, str(package_dir),
         ",".join(parts)],
        env=env, cwd=package_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def _result(proc, what, timeout_s):
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"shmcoll.tools.build_kernels {what} took more than {timeout_s} s") \
            from None
    if proc.returncode != 0:
        raise RuntimeError(f"shmcoll.tools.build_kernels {what} failed (exit {proc.returncode}):\n"
                           f"{out[-2000:]}{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _merge(parts_dirs, out):
    """Move the children's files into `out`; parts share no kernel, so no file name
    twice (checked: two children writing one index would each hold only its own part)."""
    for src in parts_dirs:
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            dest = out / path.relative_to(src)
            if dest.exists():
                raise RuntimeError(f"two build parts wrote {dest.name}: they share a kernel")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(dest))


def build(package_dir, parts=ALL, cpus=None, check=True, timeout_s=1800):
    """Compile the kernels of `parts` into <package_dir>/_kernels/<cpu> (replacing
    _kernels) for each target CPU this machine can run (targets()), in parallel child
    processes, and check in another that this machine loads them and compiles nothing
    (see the module docstring). Returns {"manifests": {cpu: manifest}, "check": ...}, or
    {"skipped": why} when this machine runs none of the targets (it could not check
    them). Raises, leaving no _kernels, on any failure. `cpus` and `check`: other CPUs
    than the loader's, unchecked, for measurements (lab.kernel_target)."""
    package_dir = Path(package_dir).resolve()
    out = package_dir / prebuilt.DIR_NAME
    shutil.rmtree(out, ignore_errors=True)
    if cpus is None:
        cpus = [cpu for cpu, needs in prebuilt.targets()
                if not prebuilt.missing_features(needs)]
    if not cpus:  # what it built could not be checked: ship none
        return {"skipped": f"this machine runs none of the target CPUs "
                           f"{[cpu for cpu, _ in prebuilt.targets()]}"}
    tmp = Path(tempfile.mkdtemp(prefix="shmcoll-prebuild-"))
    jobs = [(cpu, part) for cpu in cpus for part in parts]
    procs, made = [], {}
    try:
        t0 = time.perf_counter()
        running = []
        for i, (cpu, part) in enumerate(jobs):
            running.append((_start_child("_compile", package_dir, [part], _child_env(
                package_dir, tmp / f"cache-{cpu}-{part}", NUMBA_CPU_NAME=cpu,
                NUMBA_CPU_FEATURES="", **{prebuilt.BUILD_ENV: str(tmp / cpu / part)})),
                cpu, part))
            procs.append(running[-1][0])
            if len(running) >= (os.cpu_count() or 1) or i == len(jobs) - 1:
                for p, c, what in running:
                    made.setdefault(c, []).append(_result(p, f"_compile {c} {what}",
                                                          timeout_s))
                running = []
        manifests = {}
        for cpu in cpus:
            f = made[cpu][0]["fields"]
            if any(m["fields"] != f for m in made[cpu]):
                raise RuntimeError(f"the build's children disagree on what they compiled "
                                   f"from: {[m['fields'] for m in made[cpu]]}")
            (out / cpu).mkdir(parents=True)
            _merge([tmp / cpu / part for part in parts], out / cpu)
            files = sorted(p for p in (out / cpu).rglob("*") if p.is_file())
            manifests[cpu] = dict(f, key=prebuilt.key(f), parts=list(parts),
                                  compile_s=[m["seconds"] for m in made[cpu]],
                                  compiled=sum(m["compiled"] for m in made[cpu]),
                                  files=len(files), nbytes=sum(p.stat().st_size for p in files))
            (out / cpu / prebuilt.MANIFEST).write_text(
                json.dumps(manifests[cpu], indent=1, sort_keys=True) + "\n")
        compile_s = time.perf_counter() - t0
        if not check:
            return dict(manifests=manifests, compile_s=round(compile_s, 2))
        t0 = time.perf_counter()
        proc = _start_child("_verify", package_dir, parts,
                            _child_env(package_dir, tmp / "cache-verify"))
        procs.append(proc)
        check = _result(proc, "_verify", timeout_s)
        if check["compiled"] or not check["counts"]["shipped"] or check["wrong"]:
            raise RuntimeError(f"the shipped kernels do not load (or reduce wrong) on the "
                               f"machine that built them: {check}")
        return dict(manifests=manifests, check=check, compile_s=round(compile_s, 2),
                    verify_s=round(time.perf_counter() - t0, 2))
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _child_of(package_dir, building):
    """Refuse to run a build child anywhere but in build()'s environment."""
    if bool(prebuilt.building()) != building or \
            prebuilt.PACKAGE_DIR != Path(package_dir).resolve():
        raise RuntimeError(f"run by build() only: {prebuilt.BUILD_ENV} "
                           f"{'set' if building else 'unset'}"
                           f", the package to build first on the path (imported from "
                           f"{prebuilt.PACKAGE_DIR}, building {package_dir})")


def _compile(package_dir, parts):
    """A build child: the kernels of `parts`, written through KernelCache."""
    _child_of(package_dir, True)
    t0 = time.perf_counter()
    for part in parts:
        PARTS[part]()
    st = prebuilt.status()
    return {"fields": {k: v for k, v in st.manifest.items() if k != "key"},
            "compiled": prebuilt.counts()["compiled"],
            "seconds": round(time.perf_counter() - t0, 2)}


def _verify(package_dir, parts):
    """The build's last child: the warm-ups of `parts` from the shipped kernels, counted
    (nothing may compile), and a few reductions checked against numpy."""
    _child_of(package_dir, False)
    recorder = prebuilt.CompileRecorder()
    if set(parts) == set(ALL):  # everything: a kernel the parts left out would compile
        from ..engine import warmup
        warmup.warm_up()
    for part in parts:
        PARTS[part]()
    wrong = _check_reductions() if "reducers" in parts else []
    recorder.close()
    st = prebuilt.status()
    return {"compiled": recorder.compiled, "counts": prebuilt.counts(), "wrong": wrong,
            "loaded": str(st.path) if st.path else None, "reason": st.reason}


def _check_reductions():
    import numpy as np

    from ..native import reducers
    wrong = []
    rng = np.random.default_rng(0)
    for kind, dt, op, want in (("float", np.float32, reducers.OP_SUM, np.add),
                               ("int", np.int64, reducers.OP_MAX, np.maximum),
                               ("complex", np.complex128, reducers.OP_PRODUCT, np.multiply)):
        a, b = ((rng.standard_normal(1000) * 100).astype(dt) for _ in range(2))
        out = a.copy()
        reducers.reduce_into(out, np.array([a.ctypes.data, b.ctypes.data], np.int64), op, kind)
        if not np.array_equal(out, want(a, b)):
            wrong.append(f"{kind} {np.dtype(dt)} op {op}")
    bits = reducers.f32_to_bf16(np.arange(1000, dtype=np.float32))
    out = bits.copy()
    reducers.reduce_into(out, np.array([bits.ctypes.data] * 2, np.int64), reducers.OP_SUM,
                        "bfloat16")
    if not np.array_equal(reducers.bf16_to_f32(out), 2 * reducers.bf16_to_f32(bits)):
        wrong.append("bfloat16 sum")
    return wrong


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"] and len(argv) in (2, 3):
        parts = argv[2].split(",") if len(argv) == 3 else ALL
        print(json.dumps(build(argv[1], parts), sort_keys=True))
        return 0
    if argv[:1] in (["_compile"], ["_verify"]) and len(argv) == 3:
        child = _compile if argv[0] == "_compile" else _verify
        print(json.dumps(child(argv[1], argv[2].split(","))))
        return 0
    print("usage: python -m shmcoll.tools.build_kernels build <package dir> [part,...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
