"""python -m tecupy.build --arch sm_90a [--arch sm_89 ...]: compile every kernel ahead of
time into the cache (TECUPY_CACHE_DIR), so a first call does not pay for NVRTC. Needs no GPU."""
import argparse
import time

from . import kernels  # noqa: F401  (declares every kernel file)
from . import loader


def build(archs):
    """Compile every declared kernel file for each arch; returns [(file, arch, seconds)]."""
    done = []
    for arch in archs:
        for file in sorted(loader.declared()):
            t0 = time.perf_counter()
            loader.compile_file(file, arch)
            done.append((file, arch, time.perf_counter() - t0))
    return done


def main():
    p = argparse.ArgumentParser(prog="python -m tecupy.build", description=__doc__)
    p.add_argument("--arch", action="append", help="sm_90a (Hopper), sm_89 (Ada), sm_80, ...")
    args = p.parse_args()
    for file, arch, secs in build(args.arch or ["sm_90a"]):
        print(f"{file:24s} {arch:8s} {secs:6.2f} s")
    print(f"cache: {loader.cache_dir()}")


if __name__ == "__main__":
    main()
