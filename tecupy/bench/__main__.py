"""python -m tecupy.bench SUITE: time tecupy on the GPU against the copy bandwidth and
PyTorch's ops (when torch is importable), measured in the same run. Suites: kernels
(memory-bound kernels), gemm (FP8 GEMM), attention (fused attention), layer (the main job's
TransformerLayer step), and train (a GPT trained in tecupy bf16, FP8 and as a PyTorch twin;
its own options: python -m tecupy.bench train --help). Each suite's module
(tecupy/bench/SUITE.py) says what it measures."""
import argparse
import importlib
import sys

SUITES = ("kernels", "gemm", "attention", "layer", "inspect")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # a suite with its own options (bench/train.py parses them)
        return importlib.import_module("tecupy.bench.train").main(argv[1:])
    if argv[:1] == ["distributed"]:  # NCCL on this host's GPUs (bench/distributed.py --help)
        return importlib.import_module("tecupy.bench.distributed").main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m tecupy.bench", description=__doc__)
    p.add_argument("suite", choices=SUITES)
    p.add_argument("--cpu", action="store_true",
                   help="kernels: also time the NumPy reference at 8192x4096")
    p.add_argument("--size", choices=("small", "medium", "full"), default="full",
                   help="layer: the TransformerLayer's size (the main job's --size)")
    p.add_argument("--layers", type=int, default=1,
                   help="layer: the memory of a stack of this many layers too (a deep "
                        "model's peak: saved activations; each layer checkpointed)")
    p.add_argument("--recipe", choices=("tensor", "block"), default="tensor",
                   help="gemm: per-tensor FP8 (against cuBLASLt) or block-scaled FP8 "
                        "(Float8BlockScaling, against our per-tensor GEMM and torch's); "
                        "layer: the step under Float8BlockScaling against delayed scaling; "
                        "inspect: the inspector's cost under Float8BlockScaling")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    import tecupy
    if not tecupy.gpu_available():
        raise SystemExit("tecupy.bench needs a CUDA device (CuPy sees none)")
    importlib.import_module(f"tecupy.bench.{args.suite}").run(args)


if __name__ == "__main__":
    main()
