"""Opt-in first-call autotuning (issue 25), as torch.backends.cudnn.benchmark does it for cuDNN.

With the `autotune` setting on (kernelgen.set_autotune(True), KERNELGEN_AUTOTUNE=1, nn's Module.autotune), the first
call of a problem that no tuned entry decides - the planner's pick came from the nearest tuned problem, the
performance model or a default - comes here before it runs:
  1. candidates: the planner's pick, the heuristic variant's default (so the entry also answers the planner's
     "tuned" lookup, which asks for that variant), then the next best configs - ranked by the performance model
     where the device has one (the variants taking turns), else each variant's cheapest under its own cost
     model - up to the `autotune_candidates` setting;
  2. they compile side by side in worker processes (tuning/compile_pool.compile_within, as kernelgen.precompile
     compiles), the planner's pick here: once the pick is in and three quarters of the `autotune_budget`
     setting's seconds are spent, those still compiling are stopped and left out (a candidate whose kernel takes
     a minute to compile would otherwise hold the call for that minute: on the H100, 60 s for a Winograd
     backward-data);
  3. each runs on scratch inputs (the caller's arrays and `out=` are never touched) and is verified against the
     float64 reference, as the tuner verifies: batch item 0 holds random data and the others zeros, so the
     reference of one batch item checks the whole output (a kernel that writes a wrong or stray value anywhere
     fails) at the cost of one item;
  4. the verified ones are timed on those inputs (on CUDA by the tuner's own measure, which also refuses a
     kernel that spills), the planner's pick first, while the next one would end within the budget (compiling
     included);
  5. the fastest is recorded in the user's tuned database (tuning/database.record: locked, atomic), so the next
     call - in this process or a later one - plans it as "tuned" without tuning again.
A problem where nothing verifies records nothing and runs the planner's pick.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from kernelgen import planner, settings
from kernelgen.planner import Plan
from kernelgen.runtime.cache import key_digest
from kernelgen.storage import poisoned, stored_values
from kernelgen.target import gpu_present
from kernelgen.templates import candidates as variant_candidates
from kernelgen.templates import depthwise, get_variant
from kernelgen.tuning import database, perf_model_predict, tuner
from kernelgen.tuning.compile_pool import compile_within
from kernelgen.tuning.timing import time_host

# the links whose plans autotuning leaves alone: the caller's config, and a measured entry for exactly the problem
DECIDED = ("config=", "tuned")
# the part of the budget the candidates may spend compiling; the rest is for loading, verifying and timing them
# (on the H100, ~0.1-0.5 s a candidate: with the whole budget for compiling, the first calls took 10.2 s median)
COMPILE_SHARE = 0.75


def wanted(plan: Plan | None, config=None) -> bool:
    """Does this call's plan go through autotuning?  The setting is on, no config= was given, no tuned entry
    decided, and its kernels can be timed here (the CPU backend, or CUDA on a real GPU: not the simulator)."""
    return plan is not None and config is None and settings.get("autotune") and plan.decided_by not in DECIDED \
        and (plan.backend == "cpu" or gpu_present())


def database_device(plan: Plan) -> str:
    """The tuned database a plan's entries go to: the GPU's ("sm_90_NVIDIA H100 80GB HBM3") or this CPU's."""
    return planner.tuned_device() if plan.backend == "cuda" else plan.target.device_name


def candidate_plans(plan: Plan, algo=None, k=None) -> list:
    """Up to k plans (the `autotune_candidates` setting): the planner's pick, the heuristic variant's default,
    then the best-ranked others of the variants the call may run (algo: that one only)."""
    k = k or settings.get("autotune_candidates")
    problem, precision, target = plan.problem, plan.precision, plan.target
    if tuner.planned_depthwise(problem, precision) or (plan.variant == depthwise.NAME and algo == depthwise.NAME):
        pairs = tuner.depthwise_candidates(problem, precision, keep=k, target=target)
    elif precision != "fp32":
        pairs = tuner.tc_candidates(problem, precision, keep=k, target=target)
    else:
        pairs = tuner.candidates(problem, [algo] if algo else None, keep=k, target=target)
        heuristic = get_variant(algo) if algo else variant_candidates(problem)[0]
        pairs.insert(0, (heuristic.name, heuristic.default_config(problem, target, precision)))
    pairs = [(v, c) for v, c in _ranked(plan, pairs) if _runs_here(plan, v, c)]
    out, seen = [plan], {(plan.variant, plan.config)}
    for v, c in pairs:
        if len(out) < k and (v, c) not in seen:
            seen.add((v, c))
            out.append(Plan(problem, v, c, plan.backend, precision, target, "autotune", "a first-call candidate"))
    return out


def _ranked(plan: Plan, pairs):
    """pairs best first by the performance model of the plan's GPU and precision (a pair of a variant it does not
    know after those it does), or as given (each variant's cheapest first) where there is none.  The first pair
    (the heuristic's default, where one was put first) stays first."""
    device = planner.model_device() if plan.backend == "cuda" else None
    model = None if device is None else perf_model_predict.model_for(device, plan.precision)
    if model is None or len(pairs) < 3:
        return pairs
    head, rest = pairs[:1], pairs[1:]
    known = [p for p in rest if p[0] in model.variants]
    scores = model.scores(plan.problem, known, plan.target) if known else []
    order = [known[i] for i in np.argsort(scores, kind="stable")]
    return head + _alternating(order) + [p for p in rest if p[0] not in model.variants]


def _alternating(pairs):
    """pairs with the variants taking turns, each in its own order (the variant of the best pair first): where the
    model misjudges a whole variant (Winograd against implicit GEMM at a new batch size, say), the timed
    candidates still hold the best of each."""
    by_variant = {}
    for v, c in pairs:
        by_variant.setdefault(v, []).append((v, c))
    queues = list(by_variant.values())
    out = []
    while queues:
        out += [q.pop(0) for q in queues]
        queues = [q for q in queues if q]
    return out


def _runs_here(plan: Plan, variant, config) -> bool:
    """Can the candidate run for this call: the variant accepts the config at the precision, the CPU backend takes
    no split-K, and a CUDA tensor-core tile uses only what the GPU has."""
    v = get_variant(variant)
    if not (v.applies(plan.problem, plan.precision) and v.accepts(plan.problem, config, plan.precision)):
        return False
    if plan.backend != "cuda":
        return getattr(config, "split_k", 1) == 1
    return not any(getattr(config, kind, False) and not plan.target.has(kind) for kind in ("wgmma", "tma"))


def autotune(plan: Plan, algo=None) -> Plan:
    """Time the plan against its candidates, record the fastest verified one, and return the plan the planner now
    makes (decided by "tuned"), or `plan` itself where none verified."""
    start = time.perf_counter()
    budget = settings.get("autotune_budget")
    plans = candidate_plans(plan, algo)
    compiled, failed = compile_within(plans, COMPILE_SHARE * budget)
    inputs, ref = _verification_case(plan.problem)
    device_sets = functools.cache(lambda: tuner.device_sets(inputs))  # (CUDA only, at its first candidate)
    tried, best, last = [], None, 0.0  # last: the seconds the last candidate's measure took
    for i, cand in enumerate(plans):
        label, digest = {"variant": cand.variant, "config": str(cand.config)}, key_digest(cand.key())
        if digest in failed:
            tried.append({**label, "error": "compile failed"})
            continue
        if digest not in compiled:
            tried.append({**label, "error": "not timed: not compiled within the budget"})
            continue
        if i > 0 and time.perf_counter() - start + last > budget:  # (the next one would end past the budget)
            # the rest listed untimed: the planner's lookup asks whether the heuristic's variant was a candidate
            tried += [{"variant": c.variant, "config": str(c.config), "error": "not timed: budget spent"}
                      for c in plans[i:]]
            break
        began = time.perf_counter()
        try:
            ms = _measure(cand, inputs, ref, device_sets)
        except Exception as e:  # a candidate that fails to run or verify is recorded and skipped, as the tuner does
            tried.append({**label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        tried.append({**label, "ms": ms})
        last = time.perf_counter() - began
        if best is None or ms < best[1]:
            best = (cand, ms)
    if best is None:
        return plan
    cand, ms = best
    entry = database.entry(plan.problem, cand.variant, cand.config, ms, tried, plan.precision)
    entry["autotuned"] = {"seconds": round(time.perf_counter() - start, 3), "decided_before": plan.decided_by}
    database.record(plan.problem, database_device(plan), entry, plan.precision)
    again = planner.make_plan(plan.problem, plan.backend, algo, None, plan.precision)
    return again if again.decided_by == "tuned" else dataclasses.replace(
        again, variant=cand.variant, config=cand.config, decided_by="tuned",
        reason=f"first-call autotuning measured {cand.variant} {cand.config} fastest of {len(tried)} candidates")


def _verification_case(problem):
    """(inputs, float64 reference of the whole output): random data in batch item 0, zeros in the others, and the
    reference of that one item placed in an output of zeros (a weight gradient sums over the batch: it is the one
    item's gradient)."""
    rng = np.random.default_rng(0)
    inputs = tuner.random_inputs(problem, rng)
    if problem.N > 1:
        for name, a in inputs.items():
            if name != "w":
                a[1:] = 0
    one = dataclasses.replace(problem, N=1)
    ref_one = tuner.reference_output(one, {n: (a if n == "w" else a[:1]) for n, a in inputs.items()})
    if problem.direction == "bwd_weight":
        return inputs, ref_one
    ref = np.zeros(problem.output_shape, np.float64)
    ref[:1] = ref_one
    return inputs, ref


def _measure(plan: Plan, inputs, ref, device_sets) -> float:
    """Milliseconds of the plan's kernel after its output on `inputs` (poisoned first) was verified against ref
    within the tuner's bound for its precision; raises if it fails to run or verify.  CUDA: the tuner's own
    measure (device_sets: the inputs' rotated device copies, made once a problem; it also refuses a kernel that
    spills); the CPU backend: the same on host arrays."""
    if plan.backend == "cuda":
        return tuner.measure(plan.problem, plan.variant, plan.config, device_sets(), ref, precision=plan.precision)[0]
    launcher = planner.get_launcher(plan)
    # (float16 storage reaches a CPU kernel as its bits: the launcher does that)
    args = {n: np.ascontiguousarray(a).reshape(-1) for n, a in inputs.items()}
    args[launcher.outputs[0]] = poisoned(ref.size, plan.problem.dtype)
    launcher(args)
    tuner.check_result(stored_values(args[launcher.outputs[0]], plan.problem.dtype).reshape(ref.shape), ref,
                       plan.precision)
    return time_host(lambda: launcher(args), warmup=1, repeat=3)
