"""Compile the TF32 tensor-core kernels for sm_90 without a GPU and report what ptxas says.

    NUMBA_ENABLE_CUDASIM=0 python scripts/ptx_check.py [--keep DIR]

For forward, backward-data and backward-weight of a ResNet-like 3x3 layer this renders the
implicit_gemm_tc kernel (precision="tf32", the default CUDA tensor-core config), compiles it to PTX
with numba (NVVM, cc 9.0), counts mma.sync / cvt.rna.tf32 in the PTX, then assembles it with
`ptxas -arch=sm_90 -v` (registers, spill stores/loads, local memory, shared memory).  With
cuobjdump or nvdisasm on the PATH it also counts HMMA instructions in the SASS.  Exit status 1 if a
kernel spills, uses local memory or lacks mma.sync.
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

from numba import cuda, float32  # noqa: E402

from kernelgen.api import make_plan  # noqa: E402
from kernelgen.problem import make_problem  # noqa: E402
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


LAYER = dict(x=(32, 28, 28, 128), w=(128, 3, 3, 128), padding=1)


def problems():
    x, w, pad = LAYER["x"], LAYER["w"], LAYER["padding"]
    y = (x[0], x[1], x[2], w[0])
    yield make_problem("fwd", x, w, padding=pad)
    yield make_problem("bwd_data", x, w, padding=pad, y_shape=y)
    yield make_problem("bwd_weight", x, w, padding=pad, y_shape=y)


def compile_ptx(source, workdir, name):
    path = os.path.join(workdir, f"{name}.py")
    with open(path, "w") as f:
        f.write(source.replace("_CACHE = True", "_CACHE = False"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ptx, _ = cuda.compile_ptx(mod.KERNEL.py_func, tuple(float32[::1] for _ in mod.PARAMS), cc=(9, 0))
    return ptx


def ptxas(ptx_path, cubin_path):
    out = subprocess.run(["ptxas", "-arch=sm_90", "-v", ptx_path, "-o", cubin_path],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    text = out.stderr + out.stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else None
    return text, {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
                  "spill_loads": grab(r"(\d+) bytes spill loads"), "local_bytes": grab(r"(\d+) bytes stack frame"),
                  "smem_bytes": grab(r"(\d+) bytes smem")}


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


def sass_hmma(cubin_path):
    tool = _disassembler()
    if tool is None:
        return None  # no disassembler here (pip install nvidia-cuda-nvdisasm); the GPU probe counts SASS
    sass = subprocess.run([*tool, cubin_path], capture_output=True, text=True).stdout
    return len(re.findall(r"\bHMMA\.", sass))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="write the .py/.ptx/.cubin files here")
    ap.add_argument("--config", help="a TileConfig as keyword arguments, e.g. 'BM=128,BN=64,BK=8,WM=64,WN=32,"
                    "smem_pad=8,stages=2' (default: the variant's default per direction)")
    args = ap.parse_args(argv)
    _allow_missing_nvrtc()
    workdir = args.keep or tempfile.mkdtemp(prefix="kg_ptx_")
    os.makedirs(workdir, exist_ok=True)
    cfg = None
    if args.config:
        from kernelgen.templates.config import TileConfig
        cfg = TileConfig(**{k: int(v) for k, v in (kv.split("=") for kv in args.config.split(","))})
    ok = True
    for p in problems():
        plan = make_plan(p, "cuda", config=cfg, precision="tf32")
        name = f"tc_{p.direction}"
        ptx = compile_ptx(render_cuda(plan.kernel_ir()), workdir, name)
        ptx_path, cubin = os.path.join(workdir, f"{name}.ptx"), os.path.join(workdir, f"{name}.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        _, res = ptxas(ptx_path, cubin)
        n_mma = len(re.findall(r"mma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32", ptx))
        n_cvt = len(re.findall(r"cvt\.rna\.tf32\.f32", ptx))
        n_local = len(re.findall(r"\b(?:ld|st)\.local", ptx))
        hmma = sass_hmma(cubin)
        print(f"{p.direction:10s} {plan.config}  threads {plan.kernel_ir().threads}: PTX mma.sync {n_mma}, "
              f"cvt.rna.tf32 {n_cvt}, ld/st.local {n_local} | ptxas sm_90: {res['registers']} registers, "
              f"{res['local_bytes']} B stack, spills {res['spill_stores']}/{res['spill_loads']} B, "
              f"{res['smem_bytes']} B smem | SASS HMMA: {'n/a (no cuobjdump/nvdisasm)' if hmma is None else hmma}")
        ok &= n_mma > 0 and not res["spill_stores"] and not res["local_bytes"] and n_local == 0 and hmma != 0
    print("files in", workdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
