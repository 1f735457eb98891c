"""Part 4 of `python -m tecupy.bench distributed` (bench/distributed.py runs it): tensor
parallel with sequence parallel, the quickstart layer at TP = nproc against one GPU, with
the comm-GEMM overlap off and on (issue 25's targets: <= 0.6x at TP=2, <= 0.35x at TP=4)."""


def tp_build(shape, group, device, sequence_parallel=True):
    """Part 4's layer: the quickstart TransformerLayer of `shape` (bench layer's SIZES) and
    seed 0 split over `group` (TP = its size, with sequence parallel: this rank's chunk of
    the sequence of x and dy, as tecupy.__main__.build makes them for one GPU)."""
    import numpy as np

    import tecupy
    from tecupy import distributed as dist
    hidden, ffn, heads, seq, batch = shape
    dtype = tecupy.bfloat16 if device == "cuda" else np.float32
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                       attention_dropout=0.0, params_dtype=dtype, device=device,
                                       seed=0, tp_group=group,
                                       sequence_parallel=sequence_parallel)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((seq, batch, hidden)).astype(dtype)
    dy = (rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(dtype)
    if sequence_parallel:
        x, dy = dist.shard(x, group, 0), dist.shard(dy, group, 0)
    return layer, layer.xp.asarray(x), layer.xp.asarray(dy)


def tp_step(layer, x, dy, recipe):
    """One forward + backward of a tensor-parallel layer -> its gradients (by name)."""
    import tecupy

    def step():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                        fp8_recipe=recipe):
            y = layer(x)
        return tape.gradient(y, layer, output_grad=dy)
    return step


def _tp_rows(g, layer_size):
    """Part 4 on this rank: {precision: {overlap: (GPU ms, host ms)}} of the TP=size+SP
    step with the comm-GEMM overlap off (False: NCCL all-gather / reduce-scatter) and on
    (True: overlap.py's rings), a layer each, every precision's plain row first (a ring's
    run once made the plain rows after it slower on 4 GPUs: PERFLOG.md, session 16); every
    rank runs it (its collectives need them all). Should the overlapped step raise (on
    every rank alike: a Python error before the ranks' calls differ), its rows are left
    out, "error" says why, and the plain rows still come back. The plain step is timed in
    a CUDA graph too ("graphed"; where the capture raises, "graphed error" says why)."""
    from tecupy.distributed import overlap
    from .layer import _recipe
    rows, default = {}, overlap.OVERLAP
    g.barrier()  # (ranks as threads share the module: each reads it before any sets it)
    try:
        for ring in OVERLAPS:
            for name, recipe in (("HP", None), ("FP8", _recipe())):
                if ring and "error" in rows:
                    continue
                overlap.OVERLAP = ring
                g.barrier()
                try:
                    rows.setdefault(name, {})[ring] = _tp_rate(g, layer_size, recipe)
                    if not ring:
                        _graphed_row(g, layer_size, recipe, name, rows)
                except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
                    if not ring:
                        raise
                    rows["error"] = f"{name} with the overlap: {type(e).__name__}: {e}"
                g.barrier()
    finally:
        overlap.OVERLAP = default
    return rows


def _graphed_row(g, layer_size, recipe, name, rows):
    """rows[name]["graphed"]: the plain step in a CUDA graph (none off a GPU); a capture
    that raises (on every rank alike) leaves the row out and says why."""
    try:
        got = _tp_rate(g, layer_size, recipe, True)
    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
        rows["graphed error"] = f"{name} graphed: {type(e).__name__}: {e}"
        return
    if got is not None:
        rows[name]["graphed"] = got


def _tp_rate(g, layer_size, recipe, graphed=False):
    """(GPU ms, host ms) of the TP step of a fresh layer under recipe, eager or captured
    in a CUDA graph (graphed_rate; None where the layer is not on a GPU); its memory
    freed."""
    import cupy

    from tecupy._array import is_cupy
    from .layer import SIZES, _rate
    layer, x, dy = tp_build(SIZES[layer_size], g, "cuda")
    try:
        if not graphed:
            return _rate(tp_step(layer, x, dy, recipe), cupy)
        return graphed_rate(layer, x, dy, recipe) if is_cupy(x) else None
    finally:
        del layer, x, dy
        cupy.get_default_memory_pool().free_all_blocks()


def graphed_rate(layer, x, dy, recipe):
    """(GPU ms, host ms) of the layer's step (forward + backward, dy its output's gradient)
    captured in a CUDA graph by make_graphed_step (NCCL's collectives are captured too)."""
    import cupy

    import tecupy
    from .layer import _rate
    step = tecupy.make_graphed_step(layer, (x, dy), fp8_recipe=recipe)
    return _rate(lambda: step(x, dy), cupy)


OVERLAPS = (False, True)  # part 4's rows: the comm-GEMM overlap off, on
TP_TARGETS = {2: 0.6, 4: 0.35}  # issue 25: TP step / single-GPU step, sequence parallel on


def print_tp(tp_rows, step_rows, n, layer_size):
    """Part 4's table: rank 0's TP step (overlap off and on) against the single-GPU step,
    and the ratio; tp_rows {precision: {overlap: (GPU ms, host ms)}}."""
    from .layer import SIZES
    target = TP_TARGETS.get(n)
    print(f"\nTensor parallel TP={n} with sequence parallel, TransformerLayer {layer_size} "
          f"{SIZES[layer_size]} (the same global batch as one GPU); rank 0's GPU ms per step"
          f"; issue 25's target: {'<= %.2fx' % target if target else 'none at this size'}; "
          "overlap: the sequence-parallel collectives as rings overlapped with the GEMMs "
          "(TECUPY_TP_OVERLAP)")
    from tecupy.distributed import peer
    print("graphed: the step captured in a CUDA graph (make_graphed_step), against the "
          "single-GPU step graphed too; the others eager against eager. FP8's forward "
          "gathers without the rings: "
          + ("copy-engine pushes read by the GEMM as they land (TECUPY_TP_PEER=1)"
             if peer.PEER else "NCCL's all-gather, then the GEMM (TECUPY_TP_PEER=0)"))
    print("| precision | overlap | 1 GPU ms | TP ms | host ms | TP / 1 GPU | target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, by_overlap in tp_rows.items():
        if name in ("error", "graphed error"):
            continue
        for ring, (gpu, host) in by_overlap.items():
            graphed = ring == "graphed"
            one = step_rows[name].get("single graphed" if graphed else "single")
            if one is None:  # (no graphed single step to compare with)
                continue
            one = one[0]
            ratio = gpu / one
            verdict = "-" if target is None else ("met" if ratio <= target else "missed")
            kind = "off, graphed" if graphed else "on" if ring else "off"
            print(f"| {name} | {kind} | {one:.2f} | {gpu:.2f} | "
                  f"{host:.2f} | {ratio:.2f}x | {verdict} |")
    if "error" in tp_rows:
        print(f"overlap rows left out: {tp_rows['error']}")
    if "graphed error" in tp_rows:
        print(f"graphed rows left out: {tp_rows['graphed error']}")
