"""The planner: a validated ConvProblem (plus the caller's algo / config / precision) -> a Plan.

One resolution chain, in this order, the first link that answers deciding (Plan.decided_by names it, Plan.reason
says why; kernelgen.explain shows both):
  "config="          the caller's explicit config;
  "col2im"           backward-data with at most 4 channels a group, or strided with taps that never meet where the
                     chain plans no TMA tile, on the GPU, unless a tune timed col2im tiles on the problem: the GEMM
                     over dy's pixels with the col2im in its epilogue (_col2im_choice);
  "winograd backward-weight"  fp32 backward-weight the Winograd template suits (winograd_wgrad.suits: stride 1,
                     16 or more channels and filters a group, a width its tiles fill) on the GPU, unless a tune timed
                     it on the problem (_winograd_wgrad_choice);
  "tuned"            the tuned database's entry for exactly this problem (and precision) on this GPU - or, on the
                     CPU backend, the entry first-call autotuning (tuning/autotune.py) measured on this machine;
  "nearest tuned K"  fp32: the entry of the nearest tuned problem K, where it is near enough (tuning/database.py);
  "model"            the performance model fitted on the tuner's measurements (tuning/perf_model.py) ranks the
                     variant's configs (automatic fp32: every candidate variant's) and its best-scored one runs
                     (depthwise: its own fitted model, tuning/depthwise_model.py);
  "untuned sm_90 TMA tile"  fp16 on an sm_90 GPU without a model: the TMA tile measured best on average;
  "default"          the variant's cost-model default.
A forward or backward-data grid under half a wave that no tune measured is then split over its reduction (fp32:
_split_small_grid; 16-bit, into a float32 workspace: _split_small_half_grid); the reason says so.
With the autotune setting on, kernelgen.api hands a plan that no tuned entry decided to tuning/autotune.py, which
times it against the next candidates, records the fastest verified one and plans again (then "tuned" decides).
The database and model links are per GPU: they answer where a GPU is present (the model also offline where the
`model` setting is "on": then for the `target` setting's GPU), never on the CPU backend, and a GPU without a
database or model falls through them.  Every choice is made for the Target in effect (kernelgen.target: the GPU's
own facts, or the `target` setting's table entry offline), passed to the variants through the Variant protocol
(templates/variant.py).  A Plan knows everything that affects the generated source, so `Plan.key()` is the kernel
cache's key (tinygrad's realize.py keeps one such key the same way); which link decided is not part of it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kernelgen import compile_profile, settings
from kernelgen.plan import Plan, device_key, forget_rendered  # noqa: F401 (re-exported)
from kernelgen.runtime.cache import KERNELS
from kernelgen.runtime.launch import Launcher
from kernelgen.storage import (HALF_DTYPES, PRECISIONS, can_split, check_dtype_precision, check_precision,  # noqa: F401
                              check_split_k)
from kernelgen.target import Target, device_name, gpu_present, target_for  # noqa: F401 (re-exported)
from kernelgen.templates import (candidates, depthwise, get_variant, implicit_gemm, implicit_gemm_tc, ks_deconv,
                                 winograd_wgrad)
from kernelgen.templates.tile_space import fill_split
from kernelgen.tuning import database, depthwise_model_predict, perf_features, perf_model_predict

BACKENDS = ("cuda", "cpu")


def resolve_precision(precision):
    """A call's precision: its own argument, else the setting in force (kernelgen.set_precision / scope)."""
    return settings.get("precision") if precision is None else check_precision(precision)


def tuned_device():
    """The tuned databases' name of the GPU planned for ("sm_90_NVIDIA H100 80GB HBM3")."""
    return target_for("cuda").device_name


def _tuned_db():
    if not gpu_present() or settings.get("no_tuned"):
        return None  # databases are per GPU: rendering for CUDA on a GPU-less machine uses the heuristics
    return database


def tuned_choice(problem, preferred=None):
    """(variant name, TileConfig) from the tuned database for this GPU, or None."""
    db = _tuned_db()
    hit = None if db is None else db.lookup(problem, tuned_device(), preferred)
    return None if hit is None else hit[:2]


def tuned_variant_config(problem, variant):
    """The tuned database's fastest config of a forced variant on exactly this problem, or None."""
    db = _tuned_db()
    return None if db is None else db.tuned_config(problem, tuned_device(), variant)


def tuned_tensor_core_config(problem, precision):
    """The tuned database's fastest tensor-core config for exactly this problem at `precision` (written by
    `python -m kernelgen tune TABLE --precision ...`), or None."""
    db = _tuned_db()
    return None if db is None else db.tuned_config(problem, tuned_device(), implicit_gemm_tc.NAME, precision)


@dataclass(frozen=True)
class Choice:
    """One link's answer: the variant and config it chose, the link (Plan.decided_by) and why (Plan.reason)."""
    variant: str
    config: object
    decided_by: str
    reason: str


def model_device():
    """The device whose performance model the chain consults, or None (the link is skipped): where a GPU is present
    unless the `model` setting is "off"; offline only where it is "on", for the `target` setting's GPU."""
    mode = settings.get("model")
    if mode == "off" or not (gpu_present() or mode == "on"):
        return None
    return tuned_device()


def _given(variant, config) -> Choice:
    return Choice(variant.name, config, "config=", "the caller's config")


def _tuned_fp32(problem, variant, forced) -> Choice | None:
    """The tuned database's entry for exactly this problem (a forced variant's fastest config in it), else, for an
    automatic variant, the nearest tuned problem's entry (database.resolve), or None."""
    if forced:
        config = tuned_variant_config(problem, variant.name)
        return None if config is None else Choice(
            variant.name, config, "tuned", f"the tuned database of {database.described(tuned_device())} has this "
                                           f"problem: its fastest {variant.name} config")
    db = _tuned_db()
    hit = None if db is None else db.resolve(problem, tuned_device(), variant.name)
    if hit is None:
        return None
    name, config, how, key = hit
    if how == "tuned":
        return Choice(name, config, "tuned", f"the tuned database of {database.described(tuned_device())} has this "
                                             f"problem: its fastest measured candidate")
    return Choice(name, config, f"nearest tuned {key}", f"no tuned entry for this problem; the nearest tuned problem "
                                                        f"of the same direction, filter and stride, {key}, is within "
                                                        f"{database.NEAREST_MAX_DISTANCE} (sum of log size ratios)")


def _cpu_tuned(problem, precision, target: Target, variant_names) -> Choice | None:
    """The CPU backend's tuned link: the entry first-call autotuning (tuning/autotune.py) measured on this machine
    for exactly this problem at `precision` (the user's database only: none ships for CPUs), if its variant is one
    of `variant_names`; None under the no_tuned setting."""
    if settings.get("no_tuned"):
        return None
    hit = database.exact(problem, target.device_name, precision)
    if hit is None or hit[0] not in variant_names:
        return None
    return Choice(hit[0], hit[1], "tuned", f"the user's tuned database of {target.device_name} has this problem: "
                                          f"first-call autotuning measured it fastest")


def _model_choice(problem, variants, precision, target: Target) -> Choice | None:
    """The performance model's best-scored config of the variants (perf_model_predict.choose), or None where the link
    is off or the device has no model at this precision."""
    device = model_device()
    hit = None if device is None else perf_model_predict.choose(problem, variants, precision, target, device)
    if hit is None:
        return None
    names = ", ".join(v.name for v in variants)
    return Choice(hit[0], hit[1], "model", f"no tuned entry near this problem; the performance model of {device} "
                                          f"({precision}) scored {hit[0]} {hit[1]} best of the configs of {names}")


def _why_default(backend, precision) -> str:
    """Why no earlier link answered, for a default's reason."""
    if backend != "cuda":
        return f"the {backend} backend (tuned entries and the model are per GPU)"
    device = model_device()
    if device is None:
        off = settings.get("model") == "off"
        return "setting model is 'off'" if off else "no GPU present and setting model is not 'on'"
    return f"no tuned entry near this problem and no performance model of {device} at {precision}"


def _default(problem, variant, backend, precision, target: Target) -> Choice:
    return Choice(variant.name, variant.default_config(problem, target, precision), "default",
                  f"{variant.name}'s cost-model default on {target.name}: {_why_default(backend, precision)}")


def _hopper_untuned_config(problem, precision, target: Target):
    """fp16 on a GPU with TMA and warpgroup MMAs (sm_90) and no tuned entry: the TMA tile measured best on average
    there (implicit_gemm_tc.untuned_tma_config; the template's mma.sync default is 2-3x slower on those problems),
    or None."""
    if precision != "fp16" or not gpu_present():
        return None
    return implicit_gemm_tc.untuned_tma_config(problem, precision, target)


def _tensor_core_choice(problem, backend, config, precision, target: Target) -> Choice:
    """The chain at a tensor-core precision: config= -> tuned (exactly this problem and precision) -> model -> (fp16
    on sm_90) the untuned TMA tile -> the template's default.  (The model comes before the TMA tile: on the shipped
    H100 database its leave-one-out pick was within 10 % of the tuned best on 86 % of fp16 problems, the tile's on
    59 %; tuning/results/2026-11-26_cpu_perf_model_loo.json.)"""
    variant = implicit_gemm_tc.VARIANT
    if config is not None:
        return _given(variant, config)
    if backend == "cuda":
        tuned = tuned_tensor_core_config(problem, precision)
        if tuned is not None:
            return Choice(variant.name, tuned, "tuned", f"the tuned database of {database.described(tuned_device())} "
                                                        f"has this problem at {precision}: its fastest config")
        if problem.dtype == "bfloat16":  # (at bf16: check_dtype_precision)
            # bfloat16 moves the bytes float16 does, through the same tiles at the same MMA rate: the rest of the
            # chain is the float16 problem's at fp16 (its tuned entry, the fp16 model, the sm_90 TMA tile)
            twin = _tensor_core_choice(replace(problem, dtype="float16"), backend, None, "fp16", target)
            return Choice(twin.variant, twin.config, twin.decided_by, f"as the float16 problem at fp16: {twin.reason}")
        chosen = _model_choice(problem, [variant], precision, target)
        if chosen is not None:
            return chosen
        tile = _hopper_untuned_config(problem, precision, target)
        if tile is not None:
            return Choice(variant.name, tile, "untuned sm_90 TMA tile", "fp16 on an sm_90 GPU with no tuned entry or "
                                                                        "model: the TMA tile measured best on average")
    else:
        chosen = _cpu_tuned(problem, precision, target, {variant.name})
        if chosen is not None:
            return chosen
    return _default(problem, variant, backend, precision, target)


def _tensor_core_plan(problem, backend, algo, config, precision, target: Target) -> Plan:
    """The tensor-core implicit GEMM at `precision`, its config by _tensor_core_choice, checked."""
    variant = implicit_gemm_tc.VARIANT
    if algo not in (None, implicit_gemm.NAME, variant.name):
        raise ValueError(f"precision={precision!r} is implemented by algo={implicit_gemm.NAME!r} only, got "
                         f"algo={algo!r}")
    choice = _tensor_core_choice(problem, backend, config, precision, target)
    if backend == "cuda":
        choice = _split_small_half_grid(problem, choice, target)
    config = choice.config
    if not config.tensor_core:
        raise ValueError(f"config must be a tensor-core TileConfig (WM, WN > 0) for precision={precision!r}, "
                         f"got {config}")
    config.validate()
    implicit_gemm_tc.check_config(config, precision)
    check_split_k(problem, config)
    missing = [kind for kind, used in (("wgmma", config.wgmma), ("tma", config.tma)) if used and not target.has(kind)]
    if backend == "cuda" and missing:  # (the CPU backend emulates both)
        raise ValueError(f"config: {' and '.join(missing)} tiles need a GPU that has them (sm_90), and the target is "
                         f"{target.name} ({target.arch}); got {config}")
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.name, config, backend, precision, target, choice.decided_by, choice.reason)


def _narrow_groups_reason(problem, backend, precision, target: Target):
    """Narrow groups (2..8 channels a group), no config given: why the direct template computes them, or None where
    the GEMM variants should.  A measurement decides first: the fastest candidate of the tuned entry for exactly
    this problem (the GPU's database; on the CPU backend, first-call autotuning's), which a tune takes over both the
    direct configs and the GEMM variants' (tuning/tuner.py); else the two cost models."""
    if backend == "cuda":
        db, device = _tuned_db(), tuned_device()
    else:
        db, device = (None if settings.get("no_tuned") else database), target.device_name
    for at in ((precision, "fp32") if precision == "tf32" else (precision,)) if db is not None else ():
        hit = db.exact(problem, device, at)
        if hit is not None:
            return f"narrow groups: the tuned entry's fastest candidate is {hit[0]}" if hit[0] == depthwise.NAME \
                else None
    cuda = target_for("cuda")  # the cost models are the GPU's; the CPU backend plans as the GPU would
    faster, direct, gemm = depthwise.narrow_groups_verdict(problem, cuda)
    if not faster:
        return None
    return (f"narrow groups ({problem.Cg} channels, {problem.Kg} filters a group): the direct template's cost model "
            f"on {cuda.name} ({direct:.3g}) is below the GEMM variants' ({gemm:.3g})")


def _col2im_choice(problem, backend, precision, target: Target) -> Choice | None:
    """Backward-data with few input channels (implicit_gemm.col2im_suits: a first layer's, an image-producing
    transposed convolution's), no config given, on the GPU: the implicit GEMM over dy's pixels with the col2im in
    its epilogue (TileConfig.col2im), unless the tune of exactly this problem timed col2im tiles (database.measured:
    then its entry decides; a tune from before the col2im view did not) - or, for a strided filter whose taps never
    meet, unless the chain's own plan is a TMA tile (measured faster).  Its tile is the one the chain picks for the
    same GEMM as a 1x1 forward convolution (implicit_gemm.col2im_gemm), split_k 1 and without TMA boxes (col2im_view
    has none: the template's default tile where the chain picks one).  None where the rule does not apply."""
    db = _tuned_db() if backend == "cuda" and implicit_gemm.col2im_suits(problem) else None
    if db is None or any(getattr(c, "col2im", 0) for _, c in db.measured(problem, tuned_device(), precision)):
        return None
    if precision != "fp32" and not implicit_gemm.few_channels(problem) and \
            _tensor_core_choice(problem, backend, None, precision, target).config.tma:
        return None
    gemm = implicit_gemm.col2im_gemm(problem)
    if precision == "fp32":
        inner = _fp32_choice(gemm, backend, implicit_gemm.NAME, None, target)
    else:
        inner = _tensor_core_choice(gemm, backend, None, precision, target)
        if inner.config.tma or inner.config.wgmma:
            inner = _default(gemm, implicit_gemm_tc.VARIANT, backend, precision, target)
    config = replace(inner.config, split_k=1, col2im=1)
    variant = get_variant(inner.variant)
    if config.tma or config.wgmma or not variant.accepts(problem, config, precision):
        return None
    why = (f"{problem.C} input channels" if implicit_gemm.few_channels(problem) else
           f"a {'x'.join(map(str, problem.filter_size))} filter strided {'x'.join(map(str, problem.stride))}, whose "
           f"taps never meet")
    return Choice(variant.name, config, "col2im", f"backward-data with {why}: the GEMM over dy's pixels, {gemm.K} "
                  f"columns (taps x channels), the col2im in its epilogue; its tile is the one {inner.decided_by!r} "
                  f"chose for the same GEMM as the 1x1 forward {gemm.key()}")


def _winograd_wgrad_choice(problem, backend, target: Target) -> Choice | None:
    """fp32 backward-weight that winograd_wgrad.suits, no config given, on the GPU: the Winograd backward-weight's
    default tile, unless the tuned entry for exactly this problem timed that template (then "tuned" decides)."""
    if backend != "cuda" or not gpu_present() or not winograd_wgrad.suits(problem):
        return None
    db = _tuned_db()
    if db is not None and any(v == winograd_wgrad.NAME for v, _ in db.measured(problem, tuned_device())):
        return None
    config = winograd_wgrad.VARIANT.default_config(problem, target)
    S = problem.filter_size[2]
    return Choice(winograd_wgrad.NAME, config, "winograd backward-weight", f"stride-1 backward-weight, {problem.Cg} "
                  f"channels and {problem.Kg} filters a group, a width of {problem.out_size[2]}: F({S}, "
                  f"{winograd_wgrad.states_of(problem, config) - S + 1}) with the roles of filter and data exchanged, "
                  f"split {config.split_k} ways")


def _depthwise_plan(problem, backend, config, precision, target: Target, why=None) -> Plan:
    """The direct depthwise template (groups == C, or narrow groups: `why` says why it was chosen over the GEMM
    variants) at any precision: fp32 arithmetic for "fp32" and "tf32" (no
    tensor cores), 16-bit operands with fp32 accumulation for "fp16" / "bf16".  The given config, else (CUDA) the
    tuned database's fastest depthwise config for exactly this problem at this precision ("tf32" also reads the
    fp32 entry: the same fp32 FMAs), else (CUDA, depthwise) the fitted depthwise model's pick
    (tuning/depthwise_model.py: fitted on the tuner's measurements of other networks' depthwise layers), else its
    cost model's.  No nearest neighbour (a depthwise block's shape follows its channels and rows too closely to
    borrow another layer's) and no GEMM entry or model decides."""
    variant = depthwise.VARIANT
    db = _tuned_db() if config is None and backend == "cuda" else None
    tuned = None
    # tf32 runs the very fp32 kernel (no tensor cores here), so an fp32 tune's entry serves it too
    for tuned_at in ((precision, "fp32") if precision == "tf32" else (precision,)) if db is not None else ():
        tuned = tuned or db.tuned_config(problem, tuned_device(), variant.name, tuned_at)
    if config is not None:
        choice = _given(variant, config)
    elif tuned is not None:
        choice = Choice(variant.name, tuned, "tuned", f"the tuned database of {database.described(tuned_device())} "
                                                      f"has this problem: its fastest depthwise config")
    elif backend != "cuda" and (mine := _cpu_tuned(problem, precision, target, {variant.name})) is not None:
        choice = mine
    elif (fitted := _depthwise_model_choice(problem, backend, precision, target)) is not None:
        choice = fitted
    else:
        choice = Choice(variant.name, variant.default_config(problem, target, precision), "default",
                        f"depthwise's cost-model default on {target.name}: no tuned entry for this problem"
                        + (f"; {why}" if why else ""))
    if not variant.accepts(problem, choice.config, precision):
        raise ValueError(f"config must be a DepthwiseConfig that fits {problem.key()} for algo='depthwise', "
                         f"got {choice.config}")
    if choice.decided_by != "config=":  # (accepts() above: a DepthwiseConfig)
        shared = depthwise.with_shared_rows(problem, choice.config, target)
        if shared is not choice.config:
            choice = Choice(choice.variant, shared, choice.decided_by, f"{choice.reason}; its {shared.PH} output rows "
                                                                       f"a thread share their source rows (share_rows)")
    if backend != "cuda" and choice.config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {choice.config.split_k}")
    return Plan(problem, variant.name, choice.config, backend, precision, target, choice.decided_by, choice.reason)


def _depthwise_model_choice(problem, backend, precision, target: Target) -> Choice | None:
    """The fitted depthwise model's pick (tuning/depthwise_model.py) for a depthwise problem (one channel a group) on
    the GPU, or None where the link is off, the device has no such model or it does not rank the tensors' dtype."""
    device = model_device() if backend == "cuda" and problem.Cg == 1 else None
    config = None if device is None else depthwise_model_predict.choose(problem, precision, target, device)
    if config is None:
        return None
    return Choice(depthwise.NAME, config, "model", f"no tuned entry for this problem; the depthwise model of {device} "
                                                   f"(fitted on the tuner's measurements) ranked "
                                                   f"{depthwise_model_predict.KEEP} configs")


def _fp32_variants(problem, algo):
    """The variants an fp32 plan chooses among: the forced one (checked), else every candidate, preferred first."""
    if algo is None:
        return candidates(problem)
    variant = get_variant(algo)
    if not variant.applies(problem, variant.precisions[0]):
        raise ValueError(f"algo {algo!r} cannot compute this problem ({problem.key()})")
    if variant.precisions[0] != "fp32":
        raise ValueError(f"algo {algo!r} computes in {variant.precisions[0]}: ask for it with "
                         f"precision={variant.precisions[0]!r}")
    return [variant]


def _fp32_choice(problem, backend, algo, config, target: Target) -> Choice:
    """The chain at fp32: config= -> tuned (exactly) -> nearest tuned (automatic variant) -> model -> default; on
    the GPU a forward or backward-data grid under half a wave then split (_split_small_grid)."""
    variants = _fp32_variants(problem, algo)
    variant = variants[0]
    if config is not None:
        return _given(variant, config)
    if backend == "cuda":
        chosen = _tuned_fp32(problem, variant, algo is not None) or _model_choice(problem, variants, "fp32", target)
    else:
        chosen = _cpu_tuned(problem, "fp32", target, {v.name for v in variants})
    chosen = chosen or _default(problem, variant, backend, "fp32", target)
    return _split_small_grid(problem, chosen, target) if backend == "cuda" else chosen


SMALL_GRID_WAVES = 4  # blocks per SM a split small grid is given (pix2pix's batch-1 up4 split 2 / 4 / 8 ways - 1, 2,
# 4 blocks a SM - ran at 0.56 / 0.89 / 0.98 of cuDNN, unsplit 0.30: 2026-11-28_h100_split_k_small_grid_ad255c1)


def _split_small_grid(problem, chosen: Choice, target: Target) -> Choice:
    """A forward or backward-data fp32 plan that no tune measured (model, nearest entry, default) whose grid fills
    under half the SMs (a batch-1 layer with many channels): its reduction split over split_k blocks that add into
    the zeroed output, the largest power of two within SMALL_GRID_WAVES blocks a SM, each split keeping 8 or more BK
    slices (the fp32 tile space splits only backward-weight, and Winograd its own).  chosen itself elsewhere."""
    config = chosen.config
    if problem.direction == "bwd_weight" or chosen.decided_by in ("tuned", "config=") or problem.activation or \
            chosen.variant not in (implicit_gemm.NAME, ks_deconv.NAME) or config.split_k > 1 or config.col2im:
        return chosen
    g = perf_features.gemm_of(problem, chosen.variant, config)  # (KS-deconv: per stride class)
    blocks = -(-g.M // config.BM) * -(-g.N // config.BN) * g.groups
    split = fill_split(blocks, g.taps * -(-g.inner // config.BK), target, SMALL_GRID_WAVES, 16)
    if blocks * 2 > target.sm_count or split == 1:
        return chosen
    return Choice(chosen.variant, replace(config, split_k=split), chosen.decided_by,
                  f"{chosen.reason}; its {blocks} blocks fill under half of {target.sm_count} SMs: the reduction split "
                  f"{split} ways (split_k)")


def _split_small_half_grid(problem, chosen: Choice, target: Target) -> Choice:
    """A 16-bit forward or stride-1 backward-data tensor-core plan that no tune measured (model, untuned TMA tile,
    default) whose grid fills under half the SMs: its reduction split into the float32 workspace
    (storage.check_split_k), as many ways as keep to one block a SM (a TMA tile's shared memory holds one) and 8 or
    more BK slices a split, a divisor of the slices on TMA boxes (they must not run past the filter).  The model
    never ranks such splits (no tune measured one before 2026-11-28: perf_model_predict.unfitted).  Measured on the
    H200, split against unsplit in one process (tuning/results/2026-11-28_h200_split_ab_cc8fd74.*): c3d conv5a's 56
    blocks split 2, forward 0.81 -> 0.92 of cuDNN, backward-data 0.53 -> 0.63; EfficientNet-B0 batch-1 stage-5
    projection 0.79 -> 0.83; ResNet-50 batch-1 layer3 backward-data (0.2 GFLOP) 1.45 -> 1.32.  Larger tiles split
    further ran faster still (conv5a's 128 x 256 tile split 9: 1.03 / 0.64), which the rule does not choose."""
    config = chosen.config
    if problem.dtype not in HALF_DTYPES or problem.direction == "bwd_weight" or not can_split(problem) or \
            problem.activation or chosen.decided_by in ("tuned", "config=") or config.split_k > 1 or config.col2im:
        return chosen
    m, n, k, groups = implicit_gemm_tc.tc_gemm_shape(problem)
    blocks, slices = -(-m // config.BM) * -(-n // config.BN) * groups, -(-k // config.BK)
    fits = [s for s in range(2, target.sm_count // blocks + 1) if slices // s >= 8 and not (config.tma and slices % s)]
    if blocks * 2 > target.sm_count or not fits:
        return chosen
    return Choice(chosen.variant, replace(config, split_k=max(fits)), chosen.decided_by,
                  f"{chosen.reason}; its {blocks} blocks fill under half of {target.sm_count} SMs: the reduction split "
                  f"{max(fits)} ways into a float32 workspace (split_k)")


def make_plan(problem, backend, algo=None, config=None, precision="fp32") -> Plan:
    """precision: "fp32" (the fp32 variants) or "tf32" / "fp16" / "bf16" (the tensor-core implicit GEMM); never the global
    setting here: the API functions resolve that."""
    check_dtype_precision(problem.dtype, check_precision(precision))  # float16 tensors: precision="fp16" only
    if algo is not None:
        get_variant(algo)  # a TypeError / ValueError naming algo before any precision's own checks
    target = target_for(backend)
    # groups == C > 1 takes the depthwise template unless the call names another: an algo, or a GEMM tile config
    # (C = 1, groups = 1 is an ordinary convolution); narrow groups take it where it is tuned or modeled faster
    automatic_depthwise = algo is None and problem.groups > 1 and (config is None or
                                                                  isinstance(config, depthwise.DepthwiseConfig))
    if (automatic_depthwise or algo == depthwise.NAME) and depthwise.VARIANT.applies(problem, precision):
        automatic_narrow = algo is None and config is None and problem.Cg > 1
        why = _narrow_groups_reason(problem, backend, precision, target) if automatic_narrow else None
        if why or not automatic_narrow:
            return _depthwise_plan(problem, backend, config, precision, target, why)
    folded = algo is None and config is None and _col2im_choice(problem, backend, precision, target)
    if folded:
        return Plan(problem, folded.variant, folded.config, backend, precision if precision != "fp32" else None,
                    target, folded.decided_by, folded.reason)
    if precision != "fp32":
        return _tensor_core_plan(problem, backend, algo, config, precision, target)
    automatic = algo is None and config is None and _winograd_wgrad_choice(problem, backend, target)
    choice = automatic or _fp32_choice(problem, backend, algo, config, target)
    if backend != "cuda" and choice.config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {choice.config.split_k}")
    return Plan(problem, choice.variant, choice.config, backend, target=target, decided_by=choice.decided_by,
                reason=choice.reason)


def get_launcher(plan: Plan):
    label = plan.problem.key()  # (its name in kernelgen.profile_compile's report)
    with compile_profile.kernel_scope(label):  # (the cache's and the render's stages are this kernel's)
        return KERNELS.get(plan.key(), plan.render, lambda module: Launcher.from_module(module, plan.backend, label))
