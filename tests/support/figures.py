"""Measured figures a test prints (run pytest with -s to see them)."""


def report(what, **figures):
    """One line: `[figures] what: k=v, ...`."""
    print(f"\n[figures] {what}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
