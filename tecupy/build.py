"""python -m tecupy.build --arch sm_90a [--arch sm_89 ...]: compile every kernel ahead of
time into the cache (TECUPY_CACHE_DIR), so a first call does not pay for NVRTC. Needs no GPU."""
import argparse
import concurrent.futures
import os
import time

from . import kernels  # noqa: F401  (declares every kernel file)
from . import loader
from ._progress import Progress


def build(archs, jobs=None, progress=None):
    """Compile every declared kernel for each arch, `jobs` NVRTC programs at a time;
    returns [(file, arch, seconds of compile time summed over its kernels)]. `progress`
    (a Progress) advances once per kernel."""
    work = [(f, n, a) for a in archs for f, names in sorted(loader.declared(a).items())
            for n in names]

    def one(item):
        t0 = time.perf_counter()
        loader.compile_kernel(item[0], item[1], item[2])
        return item[0], item[2], time.perf_counter() - t0
    totals = {}
    for file, arch, secs in _run(one, work, jobs, progress):
        totals[(file, arch)] = totals.get((file, arch), 0.0) + secs
    return [(f, a, s) for (f, a), s in sorted(totals.items())]


def _run(fn, work, jobs, progress):
    """fn over work on `jobs` threads (NVRTC releases the GIL), advancing `progress` as each
    item finishes; results in completion order."""
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count()) as pool:
        results = []
        for done in concurrent.futures.as_completed([pool.submit(fn, w) for w in work]):
            results.append(done.result())
            if progress is not None:
                progress.advance()
    return results


def check_all(archs, jobs=None, progress=None):
    """Compile each declared file for each arch as ONE NVRTC program holding all of its
    instantiations, and keep nothing: proves that every kernel compiles with about a quarter
    of the NVRTC time of a program per kernel (the headers are parsed once per file; sm_90a:
    ~250 CPU-s against ~950). Returns [(file, arch, seconds, kernels)], `progress` advancing
    once per file."""
    work = sorted(((f, a, n) for a in archs for f, n in loader.declared(a).items()),
                  key=lambda w: -len(w[2]))  # the biggest files first: the pool ends together

    def one(item):
        file, arch, names = item
        t0 = time.perf_counter()
        loader.compile_together(file, names, arch)
        return file, arch, time.perf_counter() - t0, len(names)
    return sorted(_run(one, work, jobs, progress))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tecupy.build", description=__doc__)
    p.add_argument("--arch", action="append",
                   help="sm_90a (Hopper), sm_89 (Ada), sm_80, ...; repeat for several "
                        "(default: sm_90a)")
    p.add_argument("--check-only", action="store_true",
                   help="compile each file as one program and keep nothing: proves every "
                        "kernel compiles, in a quarter of the time (what CI runs)")
    args = p.parse_args(argv)
    archs = args.arch or ["sm_90a"]
    if args.check_only:
        return _check_only(archs)
    total = sum(len(n) for a in archs for n in loader.declared(a).values())
    print(f"compiling {total} kernels for {', '.join(archs)} with NVRTC "
          f"({os.cpu_count()} threads); cached kernels are not compiled again")
    t0 = time.perf_counter()
    with Progress(total, "kernels") as progress:
        done = build(archs, progress=progress)
    for file, arch, secs in done:
        print(f"{file:24s} {arch:8s} {secs:6.2f} s of NVRTC time")
    print(f"total {time.perf_counter() - t0:.1f} s")
    print(f"cache: {loader.cache_dir()}")


def _check_only(archs):
    files = sum(len(loader.declared(a)) for a in archs)
    print(f"compiling {files} kernel files for {', '.join(archs)}, one NVRTC program each")
    t0 = time.perf_counter()
    with Progress(files, "files") as progress:
        done = check_all(archs, progress=progress)
    for file, arch, secs, n in done:
        print(f"{file:24s} {arch:8s} {n:4d} kernels {secs:6.1f} s")
    print(f"every kernel compiles; total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
