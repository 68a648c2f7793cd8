"""Fixtures of the tuning tests: planning as on an H100, and no fitted model file cached across tests."""
from __future__ import annotations

import pytest

from kernelgen import api, planner
from kernelgen.target import CPU_TARGET, KNOWN_TARGETS
from kernelgen.tuning import database, depthwise_model_predict, perf_model_predict

H100 = KNOWN_TARGETS["h100"]


@pytest.fixture
def fresh_models():
    """No model file (the GEMM variants' or the depthwise template's) read before the test leaks into it, nor the
    test's into later ones."""
    perf_model_predict.models_for.cache_clear()
    depthwise_model_predict.models_for.cache_clear()
    yield
    perf_model_predict.models_for.cache_clear()
    depthwise_model_predict.models_for.cache_clear()


@pytest.fixture
def on_h100(monkeypatch):
    """Plan as on an H100 with the shipped database and models (the links need a GPU: pretend there is one)."""
    monkeypatch.setattr(planner, "gpu_present", lambda: True)
    monkeypatch.setattr(planner, "target_for", lambda backend: H100 if backend == "cuda" else CPU_TARGET)
    monkeypatch.setattr(planner, "tuned_device", lambda: H100.device_name)
    database.entries_for.cache_clear()
    api.clear_caches()
    yield
    api.clear_caches()
