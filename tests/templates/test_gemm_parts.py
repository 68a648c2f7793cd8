"""The tiled-GEMM schedule's parts (templates/gemm_*.py): TileConfig derives its pipeline and compute kinds from the
fields it always stored, the shipped database's configs keep their dicts and strings, and validate() refuses a
config by the rule of the mode it asks for (each kind's rules beside its code).  The rendered sources of every
variant are guarded byte for byte by tests/ir/test_golden_source.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from kernelgen.templates.config import TileConfig
from kernelgen.templates.gemm_compute import check_mma_tile, check_warpgroup
from kernelgen.templates.gemm_layout import check_swizzle
from kernelgen.templates.gemm_pipelines import PIPELINES
from kernelgen.tuning import database

DB_DIR = Path(__file__).resolve().parent.parent.parent / "tuning" / "db"
# the pipeline kinds scripts/golden_source.py (Case.pipeline) and tests/ir/test_golden_source.py name
GOLDEN_PIPELINES = {"tma", "tma_warp_specialised", "cp_async", "cp_async_wgmma", "register_double_buffer",
                    "single_stage"}

KINDS = [  # (config, pipeline, compute)
    (TileConfig(32, 32, 8, 4, 4), "single_stage", "fp32_tile"),
    (TileConfig(64, 64, 8, 4, 4, stages=2, smem_pad=4), "register_double_buffer", "fp32_tile"),
    (TileConfig(128, 64, 16, WM=64, WN=32, stages=2, swizzle=1), "register_double_buffer", "warp_mma"),
    (TileConfig(32, 16, 8, WM=16, WN=8), "single_stage", "warp_mma"),
    (TileConfig(128, 64, 16, WM=64, WN=32, stages=3, swizzle=1, async_copy=1), "cp_async", "warp_mma"),
    (TileConfig(128, 64, 32, WM=64, WN=64, stages=4, async_copy=1, wgmma=1), "cp_async_wgmma", "warpgroup_mma"),
    (TileConfig(128, 64, 64, WM=64, WN=64, stages=3, wgmma=1, tma=1), "tma", "warpgroup_mma"),
    (TileConfig(128, 128, 64, WM=64, WN=128, stages=6, wgmma=1, tma=2, b_mn=1), "tma_warp_specialised",
     "warpgroup_mma"),
]


@pytest.mark.parametrize("cfg, pipeline, compute", KINDS, ids=[str(k[0]) for k in KINDS])
def test_modes_are_derived_from_the_stored_fields(cfg, pipeline, compute):
    assert cfg.validate() is cfg
    assert (cfg.pipeline, cfg.compute) == (pipeline, compute)
    assert TileConfig.parse(str(cfg)) == cfg and TileConfig(**cfg.as_dict()) == cfg
    assert "pipeline" not in cfg.as_dict() and "compute" not in cfg.as_dict()


def test_pipeline_kinds_are_the_golden_tests():
    assert set(PIPELINES) == GOLDEN_PIPELINES
    assert {cfg.pipeline for cfg, _, _ in KINDS} == GOLDEN_PIPELINES


def test_shipped_database_loads_unchanged():
    """Every shipped entry's config: its stored dict and its string round-trip, it validates, and (the GEMM
    variants') its kinds are among the schedule's."""
    # (model_* and depthwise_model_*: the fitted models beside the database)
    paths = sorted(p for p in DB_DIR.glob("*.json") if not p.name.startswith(("model_", "depthwise_model_")))
    assert paths
    seen = set()
    for path in paths:
        entries = database.load(path)
        assert entries, path
        for key, entry in entries.items():
            cfg = database.config_from(entry)
            assert cfg.as_dict() == entry["config"], key
            assert type(cfg).parse(str(cfg)) == cfg, key
            cfg.validate()
            if entry["variant"] == "depthwise":  # (the direct template's own config: no GEMM pipeline)
                continue
            assert cfg.pipeline in PIPELINES and cfg.compute in ("fp32_tile", "warp_mma", "warpgroup_mma")
            seen.add(cfg.pipeline)
    assert {"tma", "tma_warp_specialised", "single_stage"} <= seen  # the shipped H100 database's kinds


# (config fields, the rule that refuses them: the mode's own check, and a text of its message)
REFUSED = [
    (dict(stages=3), PIPELINES["register_double_buffer"].check_config, "stages must be 1 or 2"),
    (dict(stages=0), PIPELINES["single_stage"].check_config, "stages must be 1 or 2"),
    (dict(WM=16, WN=8, BK=16, stages=5, swizzle=1, async_copy=1), PIPELINES["cp_async"].check_config,
     "async_copy needs"),
    (dict(BM=128, BN=64, BK=32, WM=64, WN=64, stages=1, wgmma=1, tma=1), PIPELINES["tma"].check_config,
     "tma=1 needs wgmma=1"),
    (dict(BM=128, BN=64, BK=32, WM=64, WN=64, stages=3, wgmma=1, tma=2, b_mn=1),
     PIPELINES["tma_warp_specialised"].check_config, "b_mn=1 needs"),
    (dict(b_mn=1), PIPELINES["single_stage"].check_config, "b_mn=1 needs"),
    (dict(WM=24, WN=8), check_mma_tile, "tensor-core tile"),
    (dict(WM=16, WN=8, BK=32, swizzle=2), check_swizzle, "swizzle=2"),
    (dict(BM=128, BN=64, BK=16, WM=32, WN=32, stages=3, async_copy=1, wgmma=1), check_warpgroup,
     "wgmma needs WM a multiple of 64"),
]


@pytest.mark.parametrize("fields, rule, message", REFUSED, ids=[r[2] for r in REFUSED])
def test_validate_refuses_by_the_modes_rule(fields, rule, message):
    cfg = TileConfig(**fields)
    with pytest.raises(ValueError, match=message) as by_validate:
        cfg.validate()
    with pytest.raises(ValueError, match=message) as by_rule:
        rule(cfg)
    assert str(by_validate.value) == str(by_rule.value)
