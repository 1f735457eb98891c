"""Issue 25's TP step with the FP8 forward all-gathers as peer pushes (distributed/peer.py,
peer.PEER) off and on, alternated, against the single-GPU step, on --gpus GPUs of one host:
rank 0's ms per step of the quickstart TransformerLayer (sequence parallel, FP8 delayed
scaling), graphed (make_graphed_step) and eager, then the single-GPU graphed step on GPU 0
(the other ranks wait).

    python scripts/tp_peer_ab.py --gpus 4 [--size full] [--rounds 2]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run(group, size, rounds):
    import cupy
    from tecupy.bench.distributed_tp import _tp_rate, graphed_rate, tp_build
    from tecupy.bench.layer import SIZES, _recipe
    from tecupy.distributed import peer
    recipe, rows = _recipe(), []
    for i in range(rounds):
        for on in (False, True):
            peer.PEER = on
            group.barrier()
            graphed = _tp_rate(group, size, recipe, True)
            group.barrier()
            eager = _tp_rate(group, size, recipe) if i == 0 else (float("nan"),) * 2
            rows.append((on, graphed, eager))
    peer.PEER = True
    single = None
    group.barrier()
    if group.rank == 0:
        layer, x, dy = tp_build(SIZES[size], None, "cuda", sequence_parallel=False)
        single = graphed_rate(layer, x, dy, recipe)
        del layer, x, dy
        cupy.get_default_memory_pool().free_all_blocks()
    group.barrier()
    return {"rows": rows, "single": single,
            "peer": sum(v is not None for v in getattr(group, "_peer_gathers", {}).values())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--size", default="full")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from tecupy.distributed.multiproc import spawn
    out = spawn(run, args.gpus, args.size, args.rounds, timeout=900)
    r0 = out[0]
    one = r0["single"][0]
    print(f"TP={args.gpus} +SP, {args.size} layer, FP8 delayed; rank 0; single GPU graphed "
          f"{one:.3f} ms; PeerGathers made: {[o['peer'] for o in out]}")
    print("| peer | graphed ms | / 1 GPU | eager ms | eager host ms |")
    print("| --- | --- | --- | --- | --- |")
    for on, (g_ms, _), (e_ms, e_host) in r0["rows"]:
        print(f"| {'on' if on else 'off'} | {g_ms:.3f} | {g_ms / one:.3f} | {e_ms:.3f} | "
              f"{e_host:.3f} |")


if __name__ == "__main__":
    main()
