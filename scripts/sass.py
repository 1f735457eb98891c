"""Print the SASS of one declared kernel (development aid, no GPU needed).

    pip install nvidia-cuda-nvdisasm==13.2.51     # 13.2 reads NVRTC 13.0's cubins
    PYTHONPATH=. python scripts/sass.py norm_fwd.cu \
        "norm_fwd_stream<__nv_bfloat16, 8, false, __nv_fp8_e4m3, 2, __nv_bfloat16>"
    PYTHONPATH=. python scripts/sass.py fp8_gemm.cu 0     # the file's first declared kernel

Compiles through the loader's cache (TECUPY_CACHE_DIR) for --arch (default sm_90a) and runs
nvdisasm from the nvidia-cuda-nvdisasm wheel (or PATH); --hex adds the encodings (control
bits: stall, yield, barriers, reuse; PERFLOG.md session 8 reads them).
"""
import argparse
import importlib.util
import pathlib
import shutil
import subprocess
import sys

import tecupy.build  # noqa: F401  (declares every kernel)
from tecupy import loader


def nvdisasm():
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for p in sorted(pathlib.Path(root).glob("cu*/bin/nvdisasm")):
            return str(p)
    return shutil.which("nvdisasm") or sys.exit("nvdisasm not found: pip install "
                                                 "nvidia-cuda-nvdisasm==13.2.51")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("name", help="a declared name expression, or its index")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--hex", action="store_true")
    args = ap.parse_args()
    names = loader.declared(args.arch).get(args.file, [])
    name = names[int(args.name)] if args.name.isdigit() else args.name
    cubin, _ = loader.compile_kernel(args.file, name, args.arch)
    cubin.write_bytes(loader.whole_elf(cubin.read_bytes()))  # caches from before the fix
    subprocess.run([nvdisasm()] + (["-hex"] if args.hex else []) + [str(cubin)], check=True)


if __name__ == "__main__":
    main()
