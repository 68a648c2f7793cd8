"""Plans made with another tuned database and models than the shipped ones: what `bench --against DIR` plans its
second side with, so that a merge or a refit is measured old against new per problem, in one process.

Two processes one after the other are not a fair A/B on the GPU machine: cuDNN's own times moved 16 % between the
two sides of one call (BENCHMARKS.md, 2026-11-28, the depthwise refit); alternatives benched problem by problem in
one process see the same machine.

    git show REV:tuning/db/<file> > old/<file>    # for each of the device's database and model files
    python -m kernelgen bench unseen --against old --layers ...
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from kernelgen.tuning import database, depthwise_model_predict, perf_model_predict


def _clear_caches():
    database.entries_for.cache_clear()
    perf_model_predict.models_for.cache_clear()
    depthwise_model_predict.models_for.cache_clear()


def database_directory(directory) -> Path:
    """`directory` as a Path, or ValueError where it is no directory (what --against is given)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"--against: {directory} is not a directory (it should hold a tuned database and models)")
    return directory


@contextlib.contextmanager
def shipped_from(directory):
    """Within the block, the planner reads the tuned database and the model files of `directory` where it reads
    tuning/db/'s (the user's own database and models still come first, as they do over the shipped ones).

    It swaps a module global, and the caches that read it are cleared on the way in and out: for a single-threaded
    command's planning phase (the bench plans every problem before it times any), never under a library call."""
    directory = database_directory(directory)
    shipped = database.SHIPPED
    database.SHIPPED = directory
    _clear_caches()
    try:
        yield directory
    finally:
        database.SHIPPED = shipped
        _clear_caches()
