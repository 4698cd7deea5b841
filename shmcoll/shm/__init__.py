"""Layer 5, shm: POSIX shared-memory segments (segments.py), the file store (store.py) and
`new_shm_group` (factory.py): an engine Group over segments."""
