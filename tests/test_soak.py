"""Soak: many small collectives on real rank processes, no error, flat memory.

Guards: per-call leaks (Python objects, numpy temporaries, mappings, fds, the flight record
growing) and rare protocol failures that only show after many slot rotations and counter
increments. Memory is the process RSS, sampled after a warm-up and at the end.
"""

import pytest

from _ranks import Job

pytestmark = [pytest.mark.multiprocess]

MIB = 1 << 20


def _soak(tmp_path, iters, checkpoints, max_growth):
    with Job("soak", 2, tmp_path, args={"iters": iters, "checkpoints": checkpoints},
             timeout_s=120) as job:
        results = job.all_ranks("soak", timeout_s=3000)
        codes = job.join(60)
    assert codes == {0: 0, 1: 0}
    for r, ev in results.items():
        rss = {int(k): v for k, v in ev["rss"].items()}
        growth = rss[checkpoints[-1]] - rss[checkpoints[0]]
        print(f"\n[figures] soak {iters} rank {r}: bad={ev['bad']}, "
              f"us/collective={ev['per_call_us']:.1f}, "
              f"rss MiB={ {k: round(v / MIB, 1) for k, v in rss.items()} }, "
              f"growth={growth / 1024:.0f} KiB")
        assert ev["bad"] == 0, ev
        assert growth < max_growth, (r, rss)


@pytest.mark.timeout(600)
def test_soak_short(tmp_path):
    """5,000 small collectives (all_reduce, broadcast, all_gather, barrier)."""
    _soak(tmp_path, 5_000, [1_000, 5_000], 2 * MIB)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_100k(tmp_path):
    """100,000 small collectives; RSS flat from 10k on."""
    _soak(tmp_path, 100_000, [10_000, 50_000, 100_000], 4 * MIB)
