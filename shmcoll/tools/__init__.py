"""Tools above the engine: the doctor (`python -m shmcoll.doctor` runs tools/doctor.py) and the
kernel build setup.py runs (tools/build_kernels.py)."""
