"""Compile the tensor-core kernels for sm_90 without a GPU and report what ptxas and the SASS say.

    NUMBA_ENABLE_CUDASIM=0 python scripts/ptx_check.py [--layers r50_3x3_28,r18_c64_32] [--config K=V,...]...
        [--precision tf32|fp16|bf16] [--dtype float32|float16|bfloat16] [--keep DIR]

For forward, backward-data and backward-weight of each layer (gpu_md table names) this renders the
implicit_gemm_tc kernel (--precision, default "tf32"; the variant's default CUDA config per direction, or each
--config given), compiles it to PTX with numba (NVVM, cc 9.0), counts mma.sync in the PTX,
then assembles it with `ptxas -arch=sm_90 -v` (registers, spill stores/loads, local memory, shared
memory).  With cuobjdump or nvdisasm (pip nvidia-cuda-nvdisasm) it disassembles the cubin and counts
HMMA and the shared loads/stores by width (LDS = 32-bit, LDS.64, LDS.128, LDSM = ldmatrix): shared load
instructions per HMMA is the fragment-feed cost; all SASS instructions per HMMA (whole kernel) is the issue
cost that the first H100 run tracked (PERF_NOTES #19).  Occupancy is predicted from registers (allocated per
warp in units of 256, 64K per SM), shared memory (228 KB per SM, 1 KB reserved per block) and the
limits of 64 warps / 32 blocks per SM.  Exit status 1 if a kernel spills, uses local memory or lacks
mma.sync, or if ptxas serialised its warpgroup MMAs (C7518).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.exit("ptx_check: the CUDA simulator must be off (NUMBA_ENABLE_CUDASIM=0): it cannot compile PTX")
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
# numba asks NVRTC for the supported architectures unless the CC is forced; forcing it lets this run where
# only libnvvm and ptxas are installed (no NVRTC, no driver)
os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

from numba import cuda  # noqa: E402

from kernelgen.api import make_plan  # noqa: E402
from kernelgen.render_cuda import render_cuda  # noqa: E402

def _allow_missing_nvrtc():
    """numba-cuda looks NVRTC up together with NVVM and libdevice; PTX generation needs only the latter
    two, so where NVRTC is absent fill numba's path cache without it."""
    from numba.cuda import cuda_paths as cp
    try:
        cp._get_nvrtc_path()
    except Exception:
        cp.get_cuda_paths._cached_result = {
            "nvrtc": None, "nvvm": cp._get_nvvm_path(), "libdevice": cp._get_libdevice_path(),
            "cudalib_dir": cp._get_cudalib_dir(), "static_cudalib_dir": cp._get_static_cudalib_dir(),
            "include_dir": cp._get_include_dir()}


def problems(layers, dtype="float32"):
    from kernelgen.tuning.shapes import load_table
    _, table = load_table("gpu_md")
    by_name = {layer.name: layer for layer in table}
    for name in layers:
        for direction in ("fwd", "bwd_data", "bwd_weight"):
            yield name, by_name[name].problem(direction, dtype=dtype)


def occupancy(regs, smem, threads):
    """(blocks per SM, occupancy) on sm_90 from ptxas's registers and shared bytes."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    warp_slots = 4 * (16384 // regs_per_warp)  # 4 sub-partitions of 16K registers each
    blocks = min(32, 64 // warps, warp_slots // warps, (228 * 1024) // (smem + 1024))
    return blocks, round(blocks * warps / 64, 3)


def compile_ptx(source, workdir, name, param_dtypes=None):
    """PTX of a rendered module's kernel; param_dtypes: the kernel's parameters' dtypes (default all float32)."""
    path = os.path.join(workdir, f"{name}.py")
    with open(path, "w") as f:
        f.write(source.replace("_CACHE = True", "_CACHE = False"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bounds = getattr(mod, "LAUNCH_BOUNDS", None)  # TileConfig.min_blocks (py_func drops jit's options)
    from numba import types
    dtypes = param_dtypes or ["float32"] * len(mod.PARAMS)
    ptx, _ = cuda.compile_ptx(mod.KERNEL.py_func, tuple(getattr(types, d)[::1] for d in dtypes), cc=(9, 0),
                              **({"launch_bounds": bounds} if bounds else {}))
    # wgmma is an sm_90a instruction: numba targets sm_90a on an H100 by itself; here the CC is forced
    return ptx.replace(".target sm_90\n", ".target sm_90a\n") if "wgmma." in ptx else ptx


def ptxas(ptx_path, cubin_path):
    with open(ptx_path) as f:
        arch = "sm_90a" if ".target sm_90a" in f.read() else "sm_90"
    out = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx_path, "-o", cubin_path],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    text = out.stderr + out.stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else None
    return text, {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
                  "spill_loads": grab(r"(\d+) bytes spill loads"), "local_bytes": grab(r"(\d+) bytes stack frame"),
                  "smem_bytes": grab(r"(\d+) bytes smem"),
                  # C7518 etc.: ptxas made every warpgroup MMA wait for the one before (a divergent path it could
                  # not prove uniform): the kernel runs, at a fraction of the tensor cores' rate
                  "serialised": "wgmma.mma_async instructions are serialized" in text}


def _disassembler():
    """cuobjdump or nvdisasm on the PATH, else the nvdisasm of the pip package nvidia-cuda-nvdisasm."""
    for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
        if shutil.which(tool):
            return [shutil.which(tool), *args]
    try:
        import nvidia
        for root in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_nvdisasm"):
                path = os.path.join(root, sub, "bin", "nvdisasm")
                if os.path.exists(path):
                    return [path]
    except ImportError:
        pass
    return None


def sass_census(cubin_path):
    """{HMMA, LDS, LDS.64, LDS.128, LDSM, STS, STS.64, STS.128} counts in the SASS, or None (no disassembler)."""
    tool = _disassembler()
    if tool is None:
        return None  # no disassembler here (pip install nvidia-cuda-nvdisasm); the GPU probe counts SASS
    sass = subprocess.run([*tool, cubin_path], capture_output=True, text=True).stdout
    out = {"HMMA": len(re.findall(r"\bHG?MMA\.", sass)),  # HGMMA: warpgroup MMAs
           "instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))}
    for op in ("LDS", "STS"):
        for width in ("", ".64", ".128"):
            out[op + width] = len(re.findall(rf"\b{op}(?:\.U)?{re.escape(width)}(?![.\w])", sass))
    out["LDSM"] = len(re.findall(r"\bLDSM\b", sass))
    return out


MMA_PTX = {"tf32": r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32",
           "fp16": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32",
           "bf16": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"}


def parse_config(text):
    from kernelgen.templates.config import TileConfig
    return TileConfig(**{k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="write the .py/.ptx/.cubin files here")
    ap.add_argument("--layers", default="r50_3x3_28,r18_c64_32", help="gpu_md layer names, comma-separated")
    ap.add_argument("--config", action="append", default=[],
                    help="a TileConfig as keyword arguments, e.g. 'BM=128,BN=64,BK=16,WM=32,WN=32,stages=2,"
                         "swizzle=1' (repeatable; default: the variant's default per direction)")
    ap.add_argument("--directions", default="fwd,bwd_data,bwd_weight")
    ap.add_argument("--precision", default="tf32", choices=("tf32", "fp16", "bf16"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="the arrays' dtype (float16: fp16 kernels on 16-bit tensors, as the bench runs them)")
    args = ap.parse_args(argv)
    _allow_missing_nvrtc()
    workdir = args.keep or tempfile.mkdtemp(prefix="kg_ptx_")
    os.makedirs(workdir, exist_ok=True)
    configs = [parse_config(c) for c in args.config] or [None]
    ok = True
    print("| layer | dir | config | threads | regs | local B | spills | smem B | blocks/SM | occupancy | HMMA | "
          "LDS | LDS.64 | LDS.128 | LDSM | LDS per HMMA | STS | STS.64 | STS.128 | SASS instr per HMMA |")
    print("|" + "---|" * 20)
    for layer, p in problems(args.layers.split(","), args.dtype):
        if p.direction not in args.directions.split(","):
            continue
        for cfg in configs:
            plan = make_plan(p, "cuda", config=cfg, precision=args.precision)
            kernel = plan.kernel_ir()
            name = f"tc_{args.precision}_{layer}_{p.direction}_{plan.config}"
            ptx = compile_ptx(render_cuda(kernel), workdir, name,
                              ["uint16" if b.dtype == "bfloat16" else b.dtype for b in kernel.params])
            ptx_path, cubin = os.path.join(workdir, f"{name}.ptx"), os.path.join(workdir, f"{name}.cubin")
            with open(ptx_path, "w") as f:
                f.write(ptx)
            _, res = ptxas(ptx_path, cubin)
            n_mma = len(re.findall(MMA_PTX[args.precision], ptx)) + ptx.count("wgmma.mma_async")
            n_local = len(re.findall(r"\b(?:ld|st)\.local", ptx))
            sass = sass_census(cubin)
            blocks, occ = occupancy(res["registers"], res["smem_bytes"] or 0, kernel.threads)
            c = sass or {}
            lds = sum(c.get(k, 0) for k in ("LDS", "LDS.64", "LDS.128", "LDSM"))
            per = f"{lds / c['HMMA']:.2f}" if c.get("HMMA") else "n/a"
            cells = [layer, p.direction, f"`{plan.config}`", kernel.threads, res["registers"], res["local_bytes"],
                     f"{res['spill_stores']}/{res['spill_loads']}", res["smem_bytes"], blocks, occ,
                     c.get("HMMA", "n/a"), *(c.get(k, "n/a") for k in ("LDS", "LDS.64", "LDS.128", "LDSM")), per,
                     *(c.get(k, "n/a") for k in ("STS", "STS.64", "STS.128")),
                     f"{c['instructions'] / c['HMMA']:.1f}" if c.get("HMMA") else "n/a"]
            print("| " + " | ".join(str(x) for x in cells) + " |", flush=True)
            if res["serialised"]:
                print(f"ptx_check: {name}: ptxas serialised its warpgroup MMAs (see ptxas -v in {workdir})")
            ok &= n_mma > 0 and not res["spill_stores"] and not res["local_bytes"] and n_local == 0 \
                and c.get("HMMA") != 0 and not res["serialised"]
    print("files in", workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
