"""Helpers shared by the test modules and the rank-side scenario modules, written once.

- `reference`: the reference arithmetic (bfloat16 rounding, the engine's reduction of per-rank
  inputs) that collective checks compare against.
- `devshm`: /dev/shm snapshots, segment ownership and the leak checks (conftest's check
  around every test, the rank-process tests' checks of a job's pids).
- `figures`: the `[figures]` lines tests print (seen with -s).
- `torch_reference`: the torch-level tests' inputs and expected values (small integers).
- `threaded`: the fixtures the test_threaded_pg_*.py modules share.

Importable from test modules, conftest.py and the `python tests/_ranks.py ...` entry points
(tests/ is on sys.path in all of them). `reference` and `devshm` stay free of torch:
engine-level rank processes block `import torch`.
"""
