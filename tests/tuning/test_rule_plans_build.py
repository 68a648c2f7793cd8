"""Every plan the planner's rules (col2im, Winograd backward-weight) make for the shipped tables' layers, as on an
H100 with the shipped database and model, builds: a rule that takes a problem its template cannot build would fail
the user's call on the GPU (the 9x9 backward-weight's 16-state tile did, until suits checked it)."""
from __future__ import annotations

import glob
import os

import pytest

from kernelgen.tuning import shapes

TABLES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(os.path.dirname(shapes.__file__), "tables",
                                                                            "*.json")))
RULES = ("col2im", "winograd backward-weight")


@pytest.mark.parametrize("table", TABLES)
def test_every_rule_plan_builds(table, on_h100):
    from kernelgen import planner
    from kernelgen.templates import implicit_gemm, winograd_wgrad
    built = 0
    for layer in shapes.load_table(table)[1]:
        if layer.transposed:
            continue
        for direction in ("bwd_data", "bwd_weight"):
            for precision, dtype in (("fp32", "float32"), ("tf32", "float32"), ("fp16", "float16")):
                p = layer.problem(direction, dtype)
                if not (implicit_gemm.col2im_suits(p) or winograd_wgrad.suits(p)):
                    continue  # (neither rule's problem: planning it is the other tests')
                plan = planner.make_plan(p, "cuda", None, None, precision)
                if plan.decided_by in RULES:
                    assert plan.kernel_ir().name, (layer.name, direction, precision)
                    built += 1
    assert built or table not in ("gpu_md", "unseen", "winograd"), table
