"""The lean eager path (issue 21), no GPU needed: what one FP8 linear dispatches, the
common-case checks agreeing with the full ones, and the CUDA wrappers' launch plans (the
kernel lookups faked, so the plan logic runs on a machine without a GPU)."""
import contextlib
import ctypes
import importlib
import struct
import sys
import threading

import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, E5M2
from tecupy.inspect import ACTIVE_INSPECTOR
from tecupy.kernels import cast as cast_kernels
from tecupy.kernels import fp8_gemm as gemm_kernels
from tecupy.kernels import launch as launch_mod
from tecupy.kernels import scaling as scaling_kernels
from tecupy.recipe import DelayedScaling

linear_op = importlib.import_module("tecupy.ops.linear")  # (tecupy.ops.linear: the function)
blocks_op = importlib.import_module("tecupy.ops.blocks")


def _count_dispatches(monkeypatch, fn):
    seen, real = {}, backends.dispatch

    def dispatch(op, *args, **kwargs):
        seen[op] = seen.get(op, 0) + 1
        return real(op, *args, **kwargs)
    monkeypatch.setattr(backends, "dispatch", dispatch)
    fn()
    monkeypatch.setattr(backends, "dispatch", real)
    return seen


def test_fp8_linear_dispatches(monkeypatch, rng):
    """One FP8 nn.Linear forward under a Tape: two casts (with their transposes), one GEMM,
    the forward update at autocast exit; its backward: one cast of dy (with dbias), two
    GEMMs, the backward update. Each is a kernel launch or more on a GPU."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    recipe = DelayedScaling(amax_history_len=4)

    def step():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
            y = lin(x)
        step.grads = tape.gradient(y, lin, output_grad=y)
    step()  # (the state is made at the first call)
    assert _count_dispatches(monkeypatch, step) == {
        "cast_transpose": 2, "fp8_gemm": 3, "delayed_scaling_update": 2,
        "cast_transpose_dbias": 1}


@pytest.mark.parametrize("case", [
    ((4, 8), (3, 8), (3,), np.float32),
    ((2, 3, 8), (3, 8), None, np.float16),
    ((8,), (3, 8), (3,), np.float64)])
def test_common_case_check_accepts(case):
    xs, ws, bs, dt = case
    x, w = np.ones(xs, dt), np.ones(ws, dt)
    b = None if bs is None else np.ones(bs, dt)
    assert linear_op._plain(x, w, b) and linear_op._check_args("linear", x, w, b) is np


@pytest.mark.parametrize("args", [
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float16), None),   # dtypes differ
    (np.ones((4, 8), np.int32), np.ones((3, 8), np.int32), None),       # not floating
    (np.ones((4, 8), np.float32), np.ones((3, 7), np.float32), None),   # K differs
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), np.ones((4,), np.float32)),
    (np.ones((4, 8), np.float32), np.ones((3, 8), np.float32), np.ones((1, 3), np.float32)),
    (np.ones((), np.float32), np.ones((3, 1), np.float32), None),       # 0-d x
    (np.ones((4, 8), np.float32), np.ones((8,), np.float32), None),     # 1-d weight
    (None, np.ones((3, 8), np.float32), None)])
def test_common_case_check_refuses_what_the_full_check_refuses(args):
    assert not linear_op._plain(*args)
    with pytest.raises((TypeError, ValueError)):
        linear_op._check_args("linear", *args)


def _norm_args(hidden=8, dt=np.float32, norm="LayerNorm"):
    """(x, ln_weight, ln_bias, eps, zero_centered_gamma, normalization,
    return_layernorm_output, linear arrays) of a plain layernorm_linear call."""
    return (np.ones((4, hidden), dt), np.ones(hidden, dt),
            np.zeros(hidden, dt) if norm == "LayerNorm" else None, 1e-5, False, norm, False,
            {"weight": np.ones((3, hidden), dt), "bias": None})


@pytest.mark.parametrize("norm, dt", [("LayerNorm", np.float32), ("RMSNorm", np.float16),
                                      ("LayerNorm", np.float64)])
def test_norm_common_case_check_agrees_with_the_full_one(monkeypatch, norm, dt):
    """The norm blocks' fast path gives what the full checks give (they run when it
    declines: made to decline here)."""
    *args, arrays = _norm_args(dt=dt, norm=norm)
    fast = blocks_op._check_norm("layernorm_linear", *args, **arrays)
    assert blocks_op._plain_norm(*args, arrays) is np
    monkeypatch.setattr(blocks_op, "_plain_norm", lambda *a: None)
    assert blocks_op._check_norm("layernorm_linear", *args, **arrays) == fast


@pytest.mark.parametrize("change", [
    {0: np.ones((4, 8), np.float16)},           # x's dtype is not the weights'
    {3: 1}, {3: 0.0}, {3: float("nan")},        # eps an int, zero, not finite
    {4: 1}, {6: np.bool_(False)},               # flags not exactly bool
    {5: "BatchNorm"}, {5: ["LayerNorm"]},       # normalization
    {2: None},                                  # LayerNorm without its bias
    {1: np.ones(7, np.float32)},                # ln_weight's shape
    {0: np.ones((4, 0), np.float32)},           # hidden 0
    {"weight": None}, {"weight": np.ones((3, 8), np.float16)}])
def test_norm_common_case_check_declines(change):
    """Anything but the common case goes to the full checks (their errors, or an answer
    they give after converting: an int eps, a NumPy bool)."""
    *args, arrays = _norm_args()
    for k, v in change.items():
        if isinstance(k, int):
            args[k] = v
        else:
            arrays[k] = v
    assert blocks_op._plain_norm(*args, arrays) is None


class _Kernel:
    """A stand-in for a loaded kernel: a name, its handle and the attribute the plans set."""
    def __init__(self, name):
        self.name, self.max_dynamic_shared_size_bytes = name, 0
        self.kernel = type("CUfunction", (), {"ptr": id(self)})()


@pytest.fixture
def fake_driver(monkeypatch):
    """A Hopper with PDL, its cuLaunchKernelEx recording (config, function, the packed
    argument bytes); returns that record."""
    import cupy
    launched, sizes, real_state = [], {}, launch_mod._launch_state

    def launch_state(*args):  # (each argument buffer's size, by its params' address)
        st, buf, params, cfg = real_state(*args)
        sizes[ctypes.addressof(params)] = st.size
        return st, buf, params, cfg

    def launch_ex(cfg_ptr, f, params, extra):
        cfg = launch_mod._LaunchConfig.from_address(cfg_ptr)
        ptrs = (ctypes.c_void_p * 1).from_address(params)  # the first argument's slot
        raw = ctypes.string_at(ptrs[0], sizes[params])
        launched.append((tuple(cfg.grid), tuple(cfg.block), cfg.stream, f, raw,
                         cfg.num_attrs, cfg.shared))
        return 0
    monkeypatch.setattr(launch_mod, "_launch_state", launch_state)
    stream = type("Stream", (), {"ptr": 0x5000, "is_capturing": lambda self: False})()
    monkeypatch.setattr(launch_mod, "_cupy", [cupy.ndarray, lambda: stream, launch_ex])
    monkeypatch.setattr(launch_mod, "hopper", lambda: True)
    monkeypatch.setattr(launch_mod, "PDL", True)
    return launched


def _fake_gpu(monkeypatch, module, sms=132):
    made = []

    def function(file, name, options=()):
        made.append(name)
        return _Kernel(name)
    monkeypatch.setattr(module.loader, "function", function)
    monkeypatch.setattr(module, "sm_count", lambda: sms)
    monkeypatch.setattr(module, "current_device", lambda: 0)
    monkeypatch.setattr(module, "_plans", {})
    return made


def test_fp8_gemm_plan_is_the_default_then_the_tuned_config(monkeypatch, tmp_path,
                                                           fake_driver):
    made = _fake_gpu(monkeypatch, gemm_kernels)
    monkeypatch.setenv("TECUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_kernels, "_tuned_cache", {})
    args = (256, 4096, 4096, E4M3, E4M3, True, tecupy.bfloat16, False, False, False)
    plan = gemm_kernels._shape_plan(*args)
    fn, grid, smem, staged, out_dtype, bn, gelu, b_dtype, ints, _, run = plan
    # PDL as launch.PDL was at the plan (the kernel waits in griddepcontrol.wait: 5fe48bb)
    assert (run.k, run.grid, run.shared_mem, run.pdl) == (fn, grid, smem, launch_mod.PDL)
    config = gemm_kernels.default_config(256, 4096, True)
    assert fn.name == gemm_kernels.kernel_name("e4m3", "e4m3", "__nv_bfloat16", 1, False,
                                               config)
    assert (bn, smem, out_dtype) == (config[0], gemm_kernels.smem_bytes(config, staged),
                                     np.dtype(tecupy.bfloat16))
    assert fn.max_dynamic_shared_size_bytes == smem and not gelu
    assert b_dtype == np.dtype(tecupy.bfloat16)  # the epilogue reads a bf16 bias
    assert ints == (256, 4096, 4096) and {type(i) for i in ints} == {np.int32}
    assert grid == (min(2 * -(-4096 // bn), 132),)
    version = gemm_kernels._version[0]
    tuned = next(c for c in gemm_kernels.CANDIDATES[True] if c != config)
    gemm_kernels.remember(256, 4096, 4096, "e4m3", "e4m3", True, tuned)
    assert gemm_kernels._version[0] == version + 1  # (a new key: the plan is made again)
    assert gemm_kernels._shape_plan(*args)[0].name == made[-1] == gemm_kernels.kernel_name(
        "e4m3", "e4m3", "__nv_bfloat16", 1, False, tuned)


def test_fp8_gemm_fp8_output_needs_its_scale():
    with pytest.raises(ValueError, match="needs out_scale and amax_out"):
        gemm_kernels._check_fp8_out(E5M2, None, np.ones(1, np.float32))
    gemm_kernels._check_fp8_out(np.float32, None, None)


def test_cast_transpose_plan(monkeypatch, fake_driver):
    made = _fake_gpu(monkeypatch, cast_kernels, sms=100)
    monkeypatch.setattr(cast_kernels, "resident_blocks", lambda k, threads, smem: 4)
    run, rows, cols, tail = cast_kernels._ct_plan(256, 4096, tecupy.bfloat16, "e5m2", True)
    name = "cast_transpose_tiled<__nv_bfloat16, __nv_fp8_e5m2, 1, true, false>"
    assert made == [run.k.name] == [name]
    assert run.grid == (min(2 * 64, 400),) and run.block == (256,)
    assert (type(rows), rows, type(cols), cols) == (np.int32, 256, np.int32, 4096)
    # the plain kernel's arguments from rows on: rows, cols, null h and hbias, ldh, ldq
    assert tail[:2] == (rows, cols) and tail[2:] == (0, 0, 4096, 4096)
    assert list(map(type, tail)) == [np.int32] * 2 + [np.uint64] * 2 + [np.int64] * 2
    run, _, _, _ = cast_kernels._ct_plan(24, 40, np.dtype(np.float32), "e4m3",
                                      False)  # a tail: 40 % 16
    assert run.k.name.endswith("false, true>") and run.grid == (1,)


def test_fp8_gemm_tma_descriptors_are_kept(monkeypatch):
    class Array:  # what tma_desc reads of a CuPy array
        def __init__(self, ptr, shape, dtype):
            self.data = type("Mem", (), {"ptr": ptr})()
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.itemsize = self.dtype.itemsize
    calls = []
    monkeypatch.setattr(gemm_kernels, "tma_encode", lambda *args: calls.append(args) or
                        len(calls))
    monkeypatch.setattr(gemm_kernels, "_descs", {})
    a = Array(1 << 20, (256, 4096), np.uint8)
    assert gemm_kernels.tma_desc(a, 128) == gemm_kernels.tma_desc(a, 128) == 1
    assert calls == [(1 << 20, np.dtype(np.uint8), (4096, 256), (4096,), (128, 128))]
    out = Array(1 << 20, (256, 64), tecupy.bfloat16)  # same address, another array
    assert gemm_kernels.tma_desc(out, 64) == 2
    assert calls[1] == (1 << 20, np.dtype(tecupy.bfloat16), (64, 256), (128,), (64, 64))


# ---- CuPy faked: the wrappers' per-call work, on a machine without a GPU ----------------
class _Mem:
    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    def __init__(self, c_contiguous):
        self.c_contiguous = c_contiguous


class FakeArray:
    """What the CUDA wrappers read of a CuPy array; made only through the faked CuPy
    functions below, which count them (allocations) and the copies (astype)."""
    made = []

    def __init__(self, shape, dtype, contiguous=True):
        self.shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.dtype = np.dtype(dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.size = int(np.prod(self.shape))
        self.data = _Mem((len(FakeArray.made) + 1) << 20)
        self.flags = _Flags(contiguous)
        FakeArray.made.append(self)

    def astype(self, dtype, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return FakeArray(self.shape, dtype)


class _LaunchedKernel(_Kernel):
    def __init__(self, name):
        super().__init__(name)
        self.kernel = _Mem(id(self))
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args))


@pytest.fixture
def fake_cupy(monkeypatch):
    """CuPy's ndarray, allocations and device queries faked; loader.function gives kernels
    that record their launches ({name: kernel})."""
    import cupy
    FakeArray.made = []
    kernels = {}
    monkeypatch.setattr(cupy, "ndarray", FakeArray)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: FakeArray(shape, dtype))
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32: FakeArray(shape, dtype))
    monkeypatch.setattr(cupy, "ascontiguousarray",
                        lambda a: a if a.flags.c_contiguous else FakeArray(a.shape, a.dtype))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(gemm_kernels.loader, "function", lambda file, name, options=():
                        kernels.setdefault(name, _LaunchedKernel(name)))
    return kernels


@pytest.mark.parametrize("out_dtype,bias_dtype", [
    (tecupy.bfloat16, tecupy.bfloat16), (np.float16, np.float16), (np.float32, np.float32),
    (E4M3, np.float32)])
def test_fp8_gemm_epilogue_reads_the_bias_in_the_output_type(out_dtype, bias_dtype):
    """bf16 and half D read a bias of their own type (exact in float32); float32 and FP8 D
    a float32 bias: one bias type per output type, so no kernel more."""
    assert gemm_kernels.bias_dtype(out_dtype) == np.dtype(bias_dtype)


def _gemm_operands(m, n, k):
    a, b = FakeArray((m, k), np.uint8), FakeArray((n, k), np.uint8)
    return a, FakeArray((1,), np.float32), b, FakeArray((1,), np.float32)


def _fake_gemm(monkeypatch):
    encoded = []
    monkeypatch.setattr(gemm_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(gemm_kernels, "hopper", lambda: True)
    monkeypatch.setattr(gemm_kernels, "_plans", {})
    monkeypatch.setattr(gemm_kernels, "_descs", {})
    monkeypatch.setattr(gemm_kernels, "_gemm_desc_sets", {})
    monkeypatch.setattr(gemm_kernels, "tma_encode", lambda *args: encoded.append(args) or
                        np.full(16, len(encoded), np.uint64).view("V128"))
    return encoded


_GEMM_ARGS = "Q" * 7 + "i4x" * 3 + "128s" * 3  # pointers, M, N, K, 3 TMA descriptors


def _gemm_launch(fake_driver, i=-1):
    """The i-th launch's arguments, pointers named by their FakeArray (None: a raw one),
    descriptors by the number the fake encoder gave them."""
    grid, block, _, _, raw, num_attrs, shared = fake_driver[i]
    assert block == (384, 1, 1) and num_attrs == 1 and shared > 0  # PDL (fake_driver's)
    args = _packed(raw, _GEMM_ARGS)
    arrays = {a.data.ptr: a for a in FakeArray.made}
    return ([arrays.get(p) for p in args[:7]] + list(args[7:10])
            + [np.frombuffer(d, np.uint64)[0] for d in args[10:]])


@pytest.mark.parametrize("out_dtype", [tecupy.bfloat16, np.float16])
def test_fp8_gemm_16bit_bias_goes_to_the_kernel_as_it_is(fake_cupy, fake_driver, monkeypatch,
                                                         out_dtype):
    """The FP8 linears' case (bias in x's dtype, D in x's dtype): the bias array itself is
    the kernel's argument, no float32 copy per call (issue 21: ~17 us of host time)."""
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(256, 4096, 4096)
    bias = FakeArray((4096,), out_dtype)
    args = (a, E4M3, sa, b, E4M3, sb, np.dtype(out_dtype), bias)
    assert gemm_kernels.supported(*args)
    before = len(FakeArray.made)
    out = gemm_kernels.fp8_gemm(*args)
    assert FakeArray.made[before:] == [out]  # the output, and no copy of the bias
    sent = _gemm_launch(fake_driver)
    assert sent[:7] == [sa, sb, bias, sa, sa, out, out] and sent[7:10] == [256, 4096, 4096]
    (name,) = fake_cupy
    assert ", 1, false, false>" in name  # EPI 1


@pytest.mark.parametrize("out_dtype,bias_dtype,copied", [
    (np.float32, tecupy.bfloat16, True),     # float32 D: bf16 -> float32, exact
    (np.float32, np.float32, False),
    (tecupy.bfloat16, tecupy.bfloat16, True)])  # (a strided view: made contiguous)
def test_fp8_gemm_bias_copies_only_where_needed(fake_cupy, fake_driver, monkeypatch,
                                                out_dtype, bias_dtype, copied):
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(64, 32, 48)
    strided = out_dtype != np.float32
    bias = FakeArray((32,), bias_dtype, contiguous=not strided)
    args = (a, E4M3, sa, b, E4M3, sb, np.dtype(out_dtype), bias)
    assert gemm_kernels.supported(*args)
    gemm_kernels.fp8_gemm(*args)
    sent = _gemm_launch(fake_driver)[2]
    assert (sent is not bias) == copied
    assert sent.dtype == gemm_kernels.bias_dtype(out_dtype) and sent.flags.c_contiguous


@pytest.mark.parametrize("out_dtype,bias_dtype", [
    (tecupy.bfloat16, np.float32), (np.float16, tecupy.bfloat16), (tecupy.bfloat16, np.float16)])
def test_fp8_gemm_refuses_a_bias_its_epilogue_would_round(fake_cupy, monkeypatch, out_dtype,
                                                           bias_dtype):
    """A bias the 16-bit epilogue type would round (the reference adds it in float32): the
    kernel declines (the reference runs it) rather than give other sums."""
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(64, 32, 48)
    args = (a, E4M3, sa, b, E4M3, sb, np.dtype(out_dtype))
    assert gemm_kernels.supported(*args, FakeArray((32,), out_dtype))
    assert not gemm_kernels.supported(*args, FakeArray((32,), bias_dtype))


def test_fp8_gemm_dgelu_without_bias_gets_zeros_of_the_bias_type(fake_cupy, fake_driver,
                                                                 monkeypatch):
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(64, 32, 48)
    aux = FakeArray((64, 32), tecupy.bfloat16)
    out = gemm_kernels.fp8_gemm(a, E5M2, sa, b, E4M3, sb, tecupy.bfloat16, None,
                                split_accumulator=True, dgelu_aux=aux)
    sent = _gemm_launch(fake_driver)
    assert sent[2].shape == (32,) and sent[2].dtype == tecupy.bfloat16
    assert sent[5:7] == [out, aux] and ", 3, false, " in next(iter(fake_cupy))


def test_fp8_gemm_descriptors_per_call_addresses(fake_cupy, fake_driver, monkeypatch):
    """A call's three TMA descriptors are looked up by its plan and A, B, D's addresses:
    encoded once per address set, the same ones launched again."""
    encoded = _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(256, 512, 128)
    out = FakeArray((256, 512), tecupy.bfloat16)
    for _ in range(2):
        gemm_kernels.fp8_gemm(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, out=out)
    assert len(encoded) == 3 and [e[0] for e in encoded] == [a.data.ptr, b.data.ptr,
                                                             out.data.ptr]
    assert _gemm_launch(fake_driver, 0)[7:] == _gemm_launch(fake_driver, 1)[7:] == [
        256, 512, 128, 1, 2, 3]
    a2 = FakeArray((256, 128), np.uint8)  # another A: its own descriptor, B's and D's kept
    gemm_kernels.fp8_gemm(a2, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, out=out)
    assert len(encoded) == 4 and _gemm_launch(fake_driver)[-3:] == [4, 2, 3]
    fp32 = gemm_kernels.fp8_gemm(a, E4M3, sa, b, E4M3, sb, np.float32)  # another plan, D
    assert _gemm_launch(fake_driver)[-3:] == [1, 2, 1]  # not staged: A's descriptor there
    assert _gemm_launch(fake_driver)[5] is fp32 and len(encoded) == 4


# ---- the delayed-scaling update's launch plan (kernels/scaling.py) ----------------------
class _Meta:
    def __init__(self, n, length=16):
        self.amax_history = FakeArray((length, n), np.float32)
        self.scale, self.scale_inv, self.fp8_max = (FakeArray((n,), np.float32)
                                                    for _ in range(3))


@pytest.fixture
def fake_scaling(fake_cupy, monkeypatch):
    """scaling's plans and tables emptied; returns (the tables it copies, what keep_alive
    got)."""
    copies, kept = [], []
    monkeypatch.setattr(scaling_kernels, "_plans", {})
    monkeypatch.setattr(scaling_kernels, "_tables", {})
    monkeypatch.setattr(scaling_kernels, "keep_alive", kept.append)
    import cupy
    monkeypatch.setattr(cupy, "asarray", lambda a: copies.append(a) or FakeArray(a.shape,
                                                                                a.dtype))
    return copies, kept


def test_update_plan_is_kept_for_the_same_metas(fake_cupy, fake_driver, fake_scaling):
    """A repeated update of the same metas launches the plan's Launcher with the same
    arguments, no table built or copied; the table holds each meta's 4 pointers then the
    slot offsets."""
    copies, kept = fake_scaling
    metas = [_Meta(3), _Meta(6)]
    for _ in range(3):
        scaling_kernels.delayed_scaling_update(metas, "max", 2)
    (k,) = fake_cupy.values()
    assert len(copies) == 1 and len(fake_driver) == 3 and k.calls == []
    ptrs = [getattr(m, name).data.ptr for m in metas
            for name in ("amax_history", "scale", "scale_inv", "fp8_max")]
    np.testing.assert_array_equal(copies[0], ptrs + [0, 3, 9])
    ((_, _, args),) = scaling_kernels._plans.values()  # one prebuilt argument tuple
    grid, block, _, f, raw, pdl, _ = fake_driver[0]
    assert (grid, block, f, pdl) == ((9, 1, 1), (128, 1, 1), k.kernel.ptr, 1)
    assert _packed(raw, "Qi4xi4xi4xf4x") == (args[0].data.ptr, 2, 16, 0, 0.25)
    assert all(r[4] == raw for r in fake_driver)
    assert len(kept) == 3 and all(t is args[0] for t in kept)  # kept by a capture


def _update_ints(launch):
    """(nmetas, length, most_recent) packed for a launch of delayed_scaling_update."""
    return _packed(launch[4], "8xi4xi4xi4x")


def test_update_plan_follows_the_settings_and_reallocated_arrays(fake_cupy, fake_driver,
                                                                 fake_scaling):
    copies, _ = fake_scaling
    metas = [_Meta(3)]
    scaling_kernels.delayed_scaling_update(metas, "max", 0)
    scaling_kernels.delayed_scaling_update(metas, "most_recent", 0)  # another algo
    assert _update_ints(fake_driver[1])[2] == 1 and len(copies) == 1  # (the same table)
    metas[0].amax_history = FakeArray((4, 3), np.float32)  # a resized history
    scaling_kernels.delayed_scaling_update(metas, "max", 0)
    assert len(copies) == 2 and _update_ints(fake_driver[-1])[1] == 4
    assert copies[-1][0] == metas[0].amax_history.data.ptr
    metas[0].scale = FakeArray((3,), np.float32)  # any of the 4 arrays
    scaling_kernels.delayed_scaling_update(metas, "max", 0)
    assert len(copies) == 3 and copies[-1][1] == metas[0].scale.data.ptr
    other = [_Meta(3)]  # other metas: their own plan
    scaling_kernels.delayed_scaling_update(other, "max", 0)
    assert copies[-1][0] == other[0].amax_history.data.ptr


def test_update_takes_cupy_metas_of_one_history_length(fake_cupy):
    assert scaling_kernels.supported([_Meta(3), _Meta(5)], "max", 0)
    assert not scaling_kernels.supported([_Meta(3), _Meta(3, length=8)], "max", 0)
    assert not scaling_kernels.supported([_Meta(3), _FakeNp(16)], "max", 0)
    assert not scaling_kernels.supported([], "max", 0)


class _FakeNp:
    def __init__(self, length):
        self.amax_history = np.zeros((length, 3), np.float32)


# ---- launches with their arguments' kinds fixed by a plan (kernels/launch.py) -----------
def _packed(raw, fmt):
    return struct.unpack_from("<" + fmt, raw)


def test_launcher_packs_arrays_raw_pointers_and_scalars(fake_cupy, fake_driver):
    """A pointer position takes an array (its address) or an np.uint64 (a raw address, a
    null) from call to call; scalars are packed 8 bytes each as the driver reads them."""
    k = _LaunchedKernel("k")
    nd = FakeArray
    run = launch_mod.Launcher(k, (3,), (256,), (nd, np.uint64, np.int32, np.float32), 0)
    a, b = FakeArray((4,), np.float32), FakeArray((8,), np.uint8)
    run((a, b, np.int32(-7), np.float32(0.5)))
    run((b, np.uint64(0), np.int32(9), np.float32(2.0)))
    (g0, blk, stream, f, raw0, pdl, _), (_, _, _, _, raw1, _, _) = fake_driver
    assert (g0, blk, stream, f, pdl) == ((3, 1, 1), (256, 1, 1), 0x5000, k.kernel.ptr, 1)
    assert _packed(raw0, "QQi4xf4x") == (a.data.ptr, b.data.ptr, -7, 0.5)
    assert _packed(raw1, "QQi4xf4x") == (b.data.ptr, 0, 9, 2.0)
    assert k.calls == []  # (cuLaunchKernelEx, not CuPy's launch)


def test_launcher_buffers_are_per_thread(fake_cupy, fake_driver):
    """Each thread packs into a buffer of its own (a thread switch between another thread's
    pack and launch cannot change this thread's arguments)."""
    run = launch_mod.Launcher(_LaunchedKernel("k"), (1,), (32,), (np.int32,), 0)
    bufs = []

    def call(v):
        run((np.int32(v),))
        bufs.append(ctypes.addressof(run.local.state[1]))
    call(1)
    t = threading.Thread(target=call, args=(2,))
    t.start()
    t.join()
    assert bufs[0] != bufs[1]
    assert [_packed(r[4], "i")[0] for r in fake_driver] == [1, 2]


def test_launcher_with_pdl_turned_off_launches_without_the_attribute(fake_cupy, fake_driver,
                                                                     monkeypatch):
    """PDL off after the plan was made (an A/B in one process): the same driver launch
    without the attribute, and with it again when PDL is back on (CuPy's own launch, taken
    before, refused the FP8 GEMM's bytes: TMA descriptors)."""
    k = _LaunchedKernel("k")
    run = launch_mod.Launcher(k, (2,), (64,), (np.int32,), 128)
    monkeypatch.setattr(launch_mod, "PDL", False)
    run((np.int32(5),))
    monkeypatch.setattr(launch_mod, "PDL", True)
    run((np.int32(6),))
    assert not k.calls and [r[5] for r in fake_driver] == [0, 1]
    assert [_packed(r[4], "i")[0] for r in fake_driver] == [5, 6]


def test_launcher_off_hopper_is_cupys_launch(fake_cupy, fake_driver, monkeypatch):
    monkeypatch.setattr(launch_mod, "hopper", lambda: False)
    k = _LaunchedKernel("k")
    run = launch_mod.Launcher(k, (2,), (64,), (np.int32,), 128)
    run((np.int32(5),))
    assert k.calls == [((2,), (64,), (np.int32(5),))] and not fake_driver


def test_launch_keeps_a_launcher_per_kernel_types_and_shape(fake_cupy, fake_driver,
                                                            monkeypatch):
    monkeypatch.setattr(launch_mod, "_launchers", {})
    k = _LaunchedKernel("k")
    x = FakeArray((4,), np.float32)
    for v in (1, 2):
        launch_mod.launch(k, (1,), (32,), (x, np.int32(v)))
    launch_mod.launch(k, (1,), (32,), (x, np.int64(3)))  # other types: another launcher
    assert len(launch_mod._launchers) == 2
    assert [_packed(r[4], "Qi")[1] for r in fake_driver[:2]] == [1, 2]
    assert _packed(fake_driver[2][4], "Qq") == (x.data.ptr, 3)
    with pytest.raises(TypeError, match="int.*accepted"):
        launch_mod.launch(k, (1,), (32,), (x, 4))  # a Python int: no width


def test_cast_transpose_call_allocates_the_codes_only(fake_cupy, fake_driver, monkeypatch):
    """With the state's amax row and a scale_inv given (the FP8 linear's case), a
    cast_transpose call makes its two code arrays and launches with the plan's Launcher,
    the shape's int32s made once: a second call of the shape plans nothing."""
    monkeypatch.setattr(cast_kernels, "_plans", {})
    monkeypatch.setattr(cast_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(cast_kernels, "resident_blocks", lambda k, threads, smem: 4)
    x = FakeArray((256, 4096), tecupy.bfloat16)
    scale, amax, inv = (FakeArray((1,), np.float32) for _ in range(3))
    for _ in range(2):
        before = len(FakeArray.made)
        q, qt, got_amax = cast_kernels.cast_transpose(x, scale, E4M3, amax, inv)
        assert FakeArray.made[before:] == [q, qt] and got_amax is amax
        assert (q.shape, qt.shape, q.dtype) == ((256, 4096), (4096, 256), np.uint8)
    assert len(fake_cupy) == 1 and len(cast_kernels._plans) == 1
    raw = fake_driver[-1][4]
    want = (x.data.ptr, scale.data.ptr, q.data.ptr, qt.data.ptr, inv.data.ptr, amax.data.ptr,
            0, amax.data.ptr, 256, 4096, 0, 0)
    assert _packed(raw, "Q" * 8 + "i4xi4xQQ") == want


def test_cast_transpose_checks_what_its_common_case_skips(fake_cupy, fake_driver,
                                                          monkeypatch):
    """The quantizers' case (a float32 amax_out and scale_inv_out of one element) packs the
    same arguments as the general path; any other amax_out or scale_inv_out takes that path
    and its errors."""
    monkeypatch.setattr(cast_kernels, "_plans", {})
    monkeypatch.setattr(cast_kernels, "sm_count", lambda: 132)
    monkeypatch.setattr(cast_kernels, "resident_blocks", lambda k, threads, smem: 4)
    x = FakeArray((32, 64), tecupy.bfloat16)
    scale, amax, inv = (FakeArray((1,), np.float32) for _ in range(3))
    q, qt, _ = cast_kernels.cast_transpose(x, scale, E4M3, amax, inv)
    q2, qt2, _ = cast_kernels._cast_transpose(x, scale, E4M3, None, amax, inv)
    fmt = "Q" * 8 + "i4xi4xQQqq"
    fast, general = (_packed(r[4], fmt) for r in fake_driver[-2:])
    assert fast[4:] == general[4:] and fast[2:4] == (q.data.ptr, qt.data.ptr)
    for bad_amax, bad_inv in ((FakeArray((1,), np.float64), inv), (amax, FakeArray((2,),
                                                                                   np.float32))):
        with pytest.raises(TypeError, match="float32 CuPy array of one element"):
            cast_kernels.cast_transpose(x, scale, E4M3, bad_amax, bad_inv)


def test_cast_to_fp8_call_packs_its_plan(fake_cupy, fake_driver, monkeypatch):
    """cast_to_fp8 through its plan's Launcher: no scale_inv_out is a null pointer, the
    size the plan's int64."""
    import cupy
    monkeypatch.setattr(cast_kernels, "_plans", {})
    monkeypatch.setattr(cast_kernels, "amax_grid", lambda k, n, vec: 7)
    monkeypatch.setattr(cast_kernels, "amax_args", lambda amax_out, n: (amax_out, np.uint64(0)))
    monkeypatch.setattr(cupy, "ascontiguousarray", lambda a: a)
    x, scale, amax = FakeArray((3, 40), np.float32), *(FakeArray((1,), np.float32)
                                                         for _ in range(2))
    q, got = cast_kernels.cast_to_fp8(x, scale, E5M2, amax)
    assert got is amax and q.shape == (3, 40) and q.dtype == np.uint8
    grid, _, _, _, raw, _, _ = fake_driver[-1]
    assert grid == (7, 1, 1)
    assert _packed(raw, "QQQQQQq") == (x.data.ptr, scale.data.ptr, q.data.ptr, 0,
                                       amax.data.ptr, 0, 120)



def test_fp8_gemm_cupy_launch_gets_the_same_arguments(fake_cupy, fake_driver, monkeypatch):
    """CTYPES_LAUNCH off (the comparison scripts/linear_host.py runs on the GPU): CuPy's
    launch gets the same pointers, int32s and descriptors (as NumPy V128)."""
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(256, 512, 128)
    bias = FakeArray((512,), tecupy.bfloat16)
    out = gemm_kernels.fp8_gemm(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, bias)
    monkeypatch.setattr(gemm_kernels, "CTYPES_LAUNCH", False)
    gemm_kernels.fp8_gemm(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, bias, out=out)
    (k,) = fake_cupy.values()
    assert len(fake_driver) == 1 and len(k.calls) == 1
    grid, block, args = k.calls[0]
    assert (grid, block) == (fake_driver[0][0][:1], (384,))
    assert args[:10] == (sa, sb, bias, sa, sa, out, out, 256, 512, 128)
    assert [d.tobytes() for d in args[10:]] == list(_packed(fake_driver[0][4], _GEMM_ARGS)[10:])


def test_fp8_gemm_declines_operands_tma_cannot_load(fake_cupy, monkeypatch):
    """A, B and D contiguous at 16-byte aligned addresses (TMA), else the reference runs."""
    _fake_gemm(monkeypatch)
    a, sa, b, sb = _gemm_operands(64, 32, 48)
    out = FakeArray((64, 32), np.float32)
    assert gemm_kernels.supported(a, E4M3, sa, b, E4M3, sb, np.float32, out=out)
    for t in (a, b, out):
        ptr = t.data.ptr
        t.data = _Mem(ptr + 8)  # misaligned
        assert not gemm_kernels.supported(a, E4M3, sa, b, E4M3, sb, np.float32, out=out)
        t.data, t.flags = _Mem(ptr), _Flags(False)  # strided
        assert not gemm_kernels.supported(a, E4M3, sa, b, E4M3, sb, np.float32, out=out)
        t.flags = _Flags(True)
    assert gemm_kernels.supported(a, E4M3, sa, b, E4M3, sb, np.float32, out=out)


@pytest.mark.parametrize("out_dtype,kw,ok", [
    (tecupy.bfloat16, {}, True),
    (E4M3, {}, True),
    (E4M3, {"split_accumulator": True}, False),  # FP8 D: forward GEMMs only
    (np.float64, {}, False),
    (tecupy.bfloat16, {"gelu": True}, True),
    (tecupy.bfloat16, {"gelu": True, "split_accumulator": True}, False),
    (np.float32, {"accumulate": True}, False),  # accumulates into a given out only
    (np.float32, {"accumulate": True, "out": "out32"}, True),
    (tecupy.bfloat16, {"accumulate": True, "out": "out16"}, False),
    (tecupy.bfloat16, {"dgelu_aux": "aux16", "split_accumulator": True}, True),
    (tecupy.bfloat16, {"dgelu_aux": "aux16"}, False),  # built for dgrad: split
    (np.float32, {"dgelu_aux": "aux32", "split_accumulator": True}, False)])  # 16-bit D
def test_fp8_gemm_supports_what_is_built(fake_cupy, monkeypatch, out_dtype, kw, ok):
    """supports(): the output, bias and epilogue combinations a kernel is built for (kept per
    combination), the same answer at a second call."""
    _fake_gemm(monkeypatch)
    monkeypatch.setattr(gemm_kernels, "_built", {})
    a, sa, b, sb = _gemm_operands(64, 32, 48)
    arrays = {"out32": FakeArray((64, 32), np.float32), "out16": FakeArray((64, 32),
                                                                           tecupy.bfloat16),
              "aux16": FakeArray((64, 32), tecupy.bfloat16),
              "aux32": FakeArray((64, 32), np.float32)}
    kw = {k: arrays.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}
    for _ in range(2):
        assert gemm_kernels.supported(a, E4M3, sa, b, E4M3, sb, out_dtype, **kw) is ok


# ---- the FP8 linear's kept plan (ops/linear.py, issue 21) ------------------------------
def _linear_host():
    """scripts/linear_host.py as a module (its FakeCupy: a whole nn.Linear on CPU)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "linear_host.py"
    spec = importlib.util.spec_from_file_location("linear_host", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.M, mod.K, mod.N = 64, 256, 128  # (its shapes, smaller: the weights made on the CPU)
    return mod


def fresh_plans(monkeypatch):
    """Every kernel wrapper's launch plans (and launch()'s Launchers) fresh for this test: on
    a GPU machine, plans made by earlier tests hold real kernels, which faked CuPy's arrays
    and the fake launch recorder cannot take."""
    # (and the update's pointer tables, keyed by addresses: the fakes' start over per
    # FakeCupy, so a table kept from an earlier test could share a later array's address)
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("tecupy.kernels."):
            continue
        for name in ("_plans", "_tables"):
            if isinstance(getattr(module, name, None), dict):
                monkeypatch.setattr(module, name, {})
    monkeypatch.setattr(launch_mod, "_launchers", {})


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    fresh_plans(monkeypatch)


@contextlib.contextmanager
def fake_launches(monkeypatch, kept, carve=False, pair=False):
    """Faked CuPy (scripts/linear_host.py's FakeCupy) with fresh launch plans, the FP8
    linear's kept plan on or off (its pair of casts in one launch: pair), and every Launcher
    launch recorded: yields (host module,
    the fake cupy, the list of launches: kernel, grid, block, shared bytes, packed
    arguments). Every allocation gets a new address, so an address names one array."""
    host = _linear_host()
    fresh_plans(monkeypatch)
    monkeypatch.setattr(linear_op, "_kept", {})
    monkeypatch.setattr(linear_op, "KEPT", kept)
    monkeypatch.setattr(linear_op, "KEPT_PAIR", pair)
    monkeypatch.setattr(cast_kernels, "CARVE_SCALE_INV", carve)
    sizes, launched, real_state = {}, [], launch_mod._launch_state

    def launch_state(*args):
        st, buf, params, cfg = real_state(*args)
        sizes[ctypes.addressof(params)] = st.size
        return st, buf, params, cfg

    def launch_ex(cfg_ptr, f, params, extra):
        cfg = launch_mod._LaunchConfig.from_address(cfg_ptr)
        first = (ctypes.c_void_p * 1).from_address(params)[0]
        name = ctypes.cast(f, ctypes.py_object).value.name  # (the fake kernel: f is its id)
        launched.append((name, tuple(cfg.grid), tuple(cfg.block), cfg.shared,
                         ctypes.string_at(first, sizes[params])))
        return 0
    monkeypatch.setattr(launch_mod, "_launch_state", launch_state)

    class NoReuse(dict):
        def get(self, key, default=None):
            return None
    monkeypatch.setattr(host.FakeArray, "_free", NoReuse())
    with host.FakeCupy():
        import cupy
        launch_mod._cupy[2] = launch_ex
        yield host, cupy, launched


def numbered(launched):
    """The recorded launches with each address replaced by its order of first appearance."""
    names = {}
    return [(f, grid, block, shared, [names.setdefault(w, len(names)) if w >= 1 << 32 else w
                                      for w in struct.unpack(f"<{len(raw) // 8}Q", raw)])
            for f, grid, block, shared, raw in launched]


def _recorded_steps(monkeypatch, kept, steps=3, carve=False, pair=False):
    """The launches of the last of `steps` training forwards of an FP8 nn.Linear and one
    with FP8 weights (faked CuPy), addresses numbered; pair: the kept plan's one launch for
    both casts (ops.linear.KEPT_PAIR)."""
    r = DelayedScaling(amax_history_len=4)
    with fake_launches(monkeypatch, kept, carve, pair) as (host, cupy, launched):
        lin, x = host.make(cupy, True)
        lin8 = host.make_fp8_weights(cupy, True, r)
        for _ in range(steps):
            del launched[:]
            with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
                ys = [lin(x), lin8(x)]
            assert [(y.shape, y.dtype) for y in ys] == [((64, 128), tecupy.bfloat16)] * 2
    return numbered(launched)


def test_kept_plan_launches_what_the_general_path_launches(monkeypatch):
    """Under a Tape, the kept plan's forward launches the same kernels with the same grids
    and arguments (x, weight, bias, the state's slots, codes and outputs in the same places)
    as dispatching every call: the same bits on a GPU. 2 casts + GEMM, a cast + GEMM (FP8
    weights), then the update at the autocast's exit."""
    general = _recorded_steps(monkeypatch, False)
    kept = _recorded_steps(monkeypatch, True)
    assert [k[0].split("<")[0] for k in kept] == ["cast_transpose_tiled"] * 2 + [
        "tc::fp8_gemm_tn", "cast_transpose_tiled", "tc::fp8_gemm_tn", "delayed_scaling_update"]
    assert len(kept) == 6 and len(linear_op._kept) == 2 and all(linear_op._kept.values())
    assert kept == general
    assert _recorded_steps(monkeypatch, True, carve=True) == general  # scale_inv carved


def test_kept_plan_pair_casts_what_the_two_casts_cast(monkeypatch):
    """KEPT_PAIR: x and the weight cast by one cast_transpose_pair launch whose arguments are
    the two casts' (x, scale, q, qt, scale_inv, amax, rows, cols, each; the same arrays and
    slots), then a's block count; the GEMM and the rest as before."""
    general = _recorded_steps(monkeypatch, False)
    paired = _recorded_steps(monkeypatch, True, pair=True)
    assert [k[0].split("<")[0] for k in paired] == ["cast_transpose_pair", "tc::fp8_gemm_tn",
                                                     "cast_transpose_tiled", "tc::fp8_gemm_tn",
                                                     "delayed_scaling_update"]
    (name, grid, block, shared, words), cx, cw = paired[0], general[0], general[1]
    assert words[:6] + words[6:8] == cx[4][:6] + cx[4][8:10]  # x: arrays, rows, cols
    assert words[8:14] + words[14:16] == cw[4][:6] + cw[4][8:10]  # the weight's
    assert (grid[0], block, shared) == (cx[1][0] + cw[1][0], (256, 1, 1), 0)
    assert words[16] == cx[1][0] and name == cx[0].replace("tiled", "pair").split(", 1,")[0] + ">"
    assert paired[1:] == general[2:]


def test_kept_plan_casts_rows_into_held_arrays(monkeypatch):
    """ops.linear.HELD_ROWS_BYTES: the kept plan's row-wise codes (x's and the weight's, read
    by the forward GEMM only) go into arrays held per thread, stream, device and shapes: one
    address each at every call, shared by two linears of those shapes, apart per stream and
    per device (every device's null stream is 0); fresh arrays while the stream captures or
    with the switch at 0 (the fakes give each allocation a new address)."""
    r = DelayedScaling(amax_history_len=4)

    def rows(streams, cap=False, held=HELD_DEFAULT, devices=None):
        monkeypatch.setattr(linear_op, "_held", threading.local())
        monkeypatch.setattr(linear_op, "HELD_ROWS_BYTES", held)
        with fake_launches(monkeypatch, True, pair=True) as (host, cupy, launched):
            now = []  # (set as FakeCupy sets them, which puts CuPy's own back at its exit)
            cupy.cuda.get_current_stream = lambda: now[0]
            cupy.cuda.runtime.getDevice = lambda: now[1]
            launch_mod._hopper[1], launch_mod._sm_counts[1] = True, 132  # (FakeCupy's dicts)
            (a, x), (b, _) = host.make(cupy, True), host.make(cupy, True)
            with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
                for i, ptr in enumerate((0,) + streams):
                    now[:] = [type("S", (), {"ptr": ptr, "is_capturing": lambda s: cap})(),
                              devices[i - 1] if devices and i else 0]
                    a(x), b(x)  # (the first calls plan: the general path)
                    if not i:
                        del launched[:]
            return [struct.unpack("<17Q", w)[2::8][:2] for f, *_, w in launched
                    if f.startswith("cast_transpose_pair")]  # (x's rows, the weight's)
    held = rows((0, 0, 0))
    assert len(held) == 6 and len(set(held)) == 1 and len(set(held[0])) == 2
    two = rows((0, 7, 0, 7))
    assert len(two) == 8 and len(set(two)) == 2 and two[:2] == two[4:6] and two[2] != two[0]
    # another device's null stream (its first call there plans: the general path, no pair)
    dev = rows((0, 0, 0, 0), devices=(0, 1, 1, 0))
    assert len(dev) == 6 and dev[0] == dev[1] == dev[4] != dev[2] == dev[3]
    for fresh in (rows((0, 0), cap=True), rows((0, 0), held=0)):
        assert len(fresh) == 4 and len({w for pair in fresh for w in pair}) == 8


HELD_DEFAULT = linear_op.HELD_ROWS_BYTES


def _two_linears(monkeypatch, held, steps=3):
    """Outputs, gradients and FP8 states of `steps` steps of two bf16 FP8 nn.Linear of one
    shape, each called twice per Tape in turns (the kept plan from their second call: x's and
    the weight's rows held and shared where `held`), every other step on a stream of its own."""
    import cupy
    monkeypatch.setattr(linear_op, "_kept", {})
    monkeypatch.setattr(linear_op, "_held", threading.local())
    monkeypatch.setattr(linear_op, "HELD_ROWS_BYTES", held)
    r = DelayedScaling(amax_history_len=4)
    mods = [tecupy.nn.Linear(512, 384, params_dtype=tecupy.bfloat16, seed=s, device="cuda")
            for s in (0, 1)]
    rng, side, out = np.random.default_rng(1), cupy.cuda.Stream(non_blocking=True), []
    for step in range(steps):
        with side if step % 2 else cupy.cuda.Stream.null:
            x, dy = (cupy.asarray(rng.standard_normal(s).astype(tecupy.bfloat16))
                     for s in ((256, 512), (256, 384)))
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=r):
                ys = [m(x) for _ in range(2) for m in mods]
            params = [p for m in mods for p in m.parameters()]
            out += ys + tape.gradient(ys, [x] + params, output_grad=[dy] * 4)
        side.synchronize()
    for m in mods:
        out += [m.fp8_state.fwd.scale, m.fp8_state.fwd.amax_history]
    assert all(linear_op._kept.values()) and len(linear_op._kept) == 2
    return [cupy.asnumpy(a) for a in out]


@pytest.mark.gpu
def test_held_rows_give_the_same_bits(monkeypatch):
    """Two FP8 linears sharing the held row-wise codes, in turns, on two streams: every
    output, gradient and FP8 state bit for bit as with fresh arrays (HELD_ROWS_BYTES 0)."""
    want = _two_linears(monkeypatch, 0)
    got = _two_linears(monkeypatch, HELD_DEFAULT)
    assert len(linear_op._held.rows) == 2  # (one pair of arrays per stream)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))


def test_carved_scale_inv_lies_after_the_transposed_codes(monkeypatch):
    """CARVE_SCALE_INV: the bound cast's scale_inv is the float32 at the first 256-byte
    boundary after the transposed codes, in their allocation; the row-wise codes apart."""
    host = _linear_host()
    monkeypatch.setattr(cast_kernels, "CARVE_SCALE_INV", True)
    with host.FakeCupy():
        import cupy
        x = cupy.empty((48, 80), tecupy.bfloat16)
        scale, amax = cupy.empty((1,), np.float32), cupy.empty((1,), np.float32)
        q, qt, inv = cast_kernels._ct_bind(48, 80, x.dtype, E4M3)(x, scale, amax)
        assert (qt.shape, qt.dtype, inv.shape, inv.dtype) == ((80, 48), np.uint8, (1,),
                                                               np.float32)
        assert inv.data.ptr - qt.data.ptr == 3840  # 48 * 80 = 15 * 256 bytes
        _, qt, inv = cast_kernels._ct_bind(48, 88, x.dtype, E4M3)(x, scale, amax)
        assert inv.data.ptr - qt.data.ptr == 4352  # 48 * 88 = 4224 -> 17 * 256
        assert q.shape == (48, 80) and q.data.ptr not in range(qt.data.ptr, inv.data.ptr + 4)


def test_kept_plan_is_dropped_where_it_fails(monkeypatch):
    """A kept GEMM that raises: the general path runs that call (dispatch, its fallback) and
    the key's plan is dropped for good."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("a launch failure")
    real = linear_op._kept_plan

    def plan(*args):
        got = real(*args)
        return got and (got[0], got[1], failing) + got[3:]
    monkeypatch.setattr(linear_op, "_kept_plan", plan)
    general = _recorded_steps(monkeypatch, True)
    assert len(calls) == 2 and not any(linear_op._kept.values())
    monkeypatch.setattr(linear_op, "_kept_plan", real)
    assert general == _recorded_steps(monkeypatch, False)


def test_kept_plan_follows_the_settings_and_the_registry(monkeypatch):
    """backends.token() is part of the key: a changed setting or a registration plans
    again; NumPy inputs, an FP8Inspector or no Tape never plan."""
    host = _linear_host()
    monkeypatch.setattr(linear_op, "_kept", {})
    r = DelayedScaling(amax_history_len=4)
    with host.FakeCupy():
        import cupy
        lin, x = host.make(cupy, True)
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            lin(x)
            assert len(linear_op._kept) == 1
            monkeypatch.setenv("TECUPY_BACKEND", "cuda")
            lin(x)
            backends.register("demo_kept", "reference")(lambda: None)
            backends._registry.pop("demo_kept")
            lin(x)
            assert len(linear_op._kept) == 3
            seen = []  # an inspector sees every cast: the general path
            token = ACTIVE_INSPECTOR.set(type("Inspector", (), {
                "record": lambda self, q, x, out: seen.append(q)})())
            try:
                lin(x)
            finally:
                ACTIVE_INSPECTOR.reset(token)
            assert len(seen) == 2
        with tecupy.fp8_autocast(fp8_recipe=r):  # no Tape: no transposed copies, no plan
            lin(x)
        assert len(linear_op._kept) == 3
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
        lin(np.ones((16, 32), np.float32))
    assert len(linear_op._kept) == 3


@pytest.mark.parametrize("carve", [False, True])
def test_kept_plan_reuses_the_row_wise_blocks(monkeypatch, carve):
    """In one Tape (every transposed copy alive), each forward's row-wise codes take the
    block the last forward's freed, as on the general path (the fake reuses a freed address
    per size, as CuPy's pool): the GEMM's TMA descriptors are encoded at the first calls
    only, not at every call."""
    host = _linear_host()
    for module in (cast_kernels, gemm_kernels):
        monkeypatch.setattr(module, "_plans", {})
    monkeypatch.setattr(gemm_kernels, "_descs", {})
    monkeypatch.setattr(gemm_kernels, "_gemm_desc_sets", {})
    monkeypatch.setattr(cast_kernels, "CARVE_SCALE_INV", carve)
    r = DelayedScaling(amax_history_len=4)
    counts = []
    for kept in (False, True):
        monkeypatch.setattr(linear_op, "KEPT", kept)
        monkeypatch.setattr(linear_op, "_kept", {})
        with host.FakeCupy():
            import cupy
            encoded, real = [], gemm_kernels.tma_encode
            gemm_kernels.tma_encode = lambda *args: encoded.append(args) or real(*args)
            lin, x = host.make(cupy, True)
            with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
                for _ in range(40):
                    lin(x)
            counts.append(len(encoded))
    assert counts[1] <= counts[0] < 40
