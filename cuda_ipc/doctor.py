"""cuda_ipc's section of `python -m shmcoll.doctor` (GPUs, P2P, IPC, tiers: info.report)."""

from shmcoll.tools import doctor

from .info import report

__all__ = []


def _gpus(opts):
    return [doctor.Finding(level, text, fix) for level, text, fix in report()]


doctor.register_section("GPUs (cuda_ipc)", _gpus)
