"""The 12 FP8 GEMMs of one TransformerLayer step (forward, dgrad, wgrad of qkv, proj, fc1,
fc2) at the bench's sizes: each candidate configuration timed (tecupy.gemm.tune), the
default's time against the best's, and the layer's sum. --tp N: one rank's GEMMs under
tensor parallel of N (qkv and fc1 column-parallel: their outputs split; proj and fc2
row-parallel: their inputs split; every rank's GEMMs see the whole sequence). The tuned
table is written to a scratch TECUPY_CACHE_DIR copy and deleted: later runs keep the
defaults.

    python scripts/gemm_layer_tune.py [--sizes medium full]
"""
import argparse
import os
import pathlib

from tecupy import gemm
from tecupy.bench.layer import SIZES
from tecupy.kernels.fp8_gemm import default_config


def layer_gemms(hidden, ffn, tokens, tp=1):
    """[(name, m, n, k, a_fmt, split)] of one layer step (one rank's, tp > 1)."""
    h, f, t = hidden, ffn, tokens
    out = []
    for name, n_out, k_in in (("qkv", 3 * h // tp, h), ("proj", h, h // tp),
                              ("fc1", f // tp, h), ("fc2", h, f // tp)):
        out += [(f"{name} fwd", t, n_out, k_in, "e4m3", False),
                (f"{name} dgrad", t, k_in, n_out, "e5m2", True),
                (f"{name} wgrad", n_out, k_in, t, "e5m2", True)]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["medium", "full"])
    p.add_argument("--tp", type=int, default=1, help="one rank's GEMMs under TP of this size")
    a = p.parse_args()
    table = pathlib.Path(os.environ.get("TECUPY_CACHE_DIR", "")) / "fp8_gemm_tuned.json"
    existed = table.exists()
    try:
        for size in a.sizes:
            hidden, ffn, _, seq, batch = SIZES[size]
            tot_d = tot_b = 0.0
            tag = size if a.tp == 1 else f"{size} TP={a.tp}"
            print(f"{tag}: {'GEMM':12s}{'M':>7s}{'N':>7s}{'K':>7s}  default ms  best ms  best")
            for name, m, n, k, fa, split in layer_gemms(hidden, ffn, seq * batch, a.tp):
                times = gemm.tune(m, n, k, fa, "e4m3", split, calls=20)
                d = default_config(m, n, split, k=k)
                best = min(times, key=times.get)
                dt = times.get(d, float("nan"))
                tot_d, tot_b = tot_d + dt, tot_b + times[best]
                print(f"  {name:12s}{m:7d}{n:7d}{k:7d}{dt:11.4f}{times[best]:9.4f}  {best}"
                      + ("" if best == d else f"  (default {d})"))
            print(f"  layer sum: default {tot_d:.3f} ms, best {tot_b:.3f} ms "
                  f"({(tot_d - tot_b) / tot_d * 100:.1f}% less)")
    finally:
        if table.exists() and not existed:
            table.unlink()


if __name__ == "__main__":
    main()
