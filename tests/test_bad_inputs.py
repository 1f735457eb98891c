"""Bad input across the public API gets a clear error, raised by tecupy itself.

Each row: an id, the call, the exception type, and a regex of the message, which must name
the argument (and, where it has one, what it got). Every row also checks that tecupy's own
`raise` statement raised it, not numpy or CuPy failing deeper down (issue 19, point 5).
Messages follow "<function>: <argument> must be <accepted>, got <value>" (tecupy/_check.py),
or "<function>: <argument> has shape ..., expected ..." for arrays.
"""
import linecache
import os

import numpy as np
import pytest

import tecupy
from tecupy import nn
from tecupy.recipe import DelayedScaling, Float8CurrentScaling, Format

TECUPY_DIR = os.path.dirname(os.path.abspath(tecupy.__file__))


def f32(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def i64(*values):
    return np.array(values, np.int64)


def assert_raised_by_tecupy(excinfo):
    """The innermost frame is in tecupy's own files and is a `raise` statement: an error
    from inside numpy or CuPy (a Python frame of theirs, or C code called from a tecupy
    line, whose innermost Python frame is that tecupy line) fails this."""
    tb = excinfo.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    where = f"{path}:{tb.tb_lineno}"
    assert path.startswith(TECUPY_DIR + os.sep), f"raised outside tecupy, at {where}"
    line = linecache.getline(path, tb.tb_lineno).strip()
    assert line.startswith("raise "), f"not raised by a tecupy raise statement: {where}: {line}"


def ln_args(hidden=8, out=3):
    return f32(4, hidden), f32(hidden), f32(hidden), f32(out, hidden)


def mlp_args(fc1_rows=12, ffn=12):
    return f32(4, 8), f32(8), f32(8), f32(fc1_rows, 8), None, f32(8, ffn), None


def qkv(hk=2, h=4):
    return f32(2, 5, h, 8), f32(2, 5, hk, 8), f32(2, 5, hk, 8)


def fp8_tensor():
    return tecupy.quantize(f32(4, 4), 1.0, "e4m3")


def enter(context):
    """Enter and leave a context manager (autocast's arguments may be checked on entry)."""
    with context:
        pass


def on_tape(call):
    """call(tape, x, w, y) with y = linear(x, w) recorded on the tape."""
    x, w = f32(4, 8), f32(3, 8)
    with tecupy.Tape() as tape:
        y = tecupy.linear(x, w)
    return call(tape, x, w, y)


def fp8_backward_twice():
    """A second backward through FP8 ops would record the gradients' amaxes twice."""
    x, w, state = f32(16, 16), f32(16, 16), tecupy.FP8State()
    with tecupy.Tape() as tape, tecupy.fp8_autocast():
        y = tecupy.linear(x, w, fp8_state=state)
    tape.gradient(y, x)
    tape.gradient(y, w)


CPU = dict(device="cpu")
FUNCTIONAL = [
    # ---- linear
    ("linear-in", lambda: tecupy.linear(f32(4, 8), f32(3, 7)), ValueError,
     r"linear: weight has shape \(3, 7\), expected \(\*, 8\)"),
    ("linear-bias", lambda: tecupy.linear(f32(4, 8), f32(3, 8), f32(4)), ValueError,
     r"bias has shape \(4,\), expected \(3\)"),
    ("linear-dtypes", lambda: tecupy.linear(f32(4, 8), f32(3, 8).astype(np.float16)),
     TypeError, "weight has dtype float16 but x has float32"),
    ("linear-int", lambda: tecupy.linear(f32(4, 8).astype(np.int32), f32(3, 8)), TypeError,
     "x has dtype int32; accepted: float16, bfloat16"),
    ("linear-list", lambda: tecupy.linear([[1.0]], f32(1, 1)), TypeError,
     "x must be a numpy or cupy array, got list"),
    ("linear-no-weight", lambda: tecupy.linear(f32(4, 8), None), TypeError,
     "linear: weight must be an array, got None"),
    ("linear-no-x", lambda: tecupy.linear(None, f32(3, 8)), TypeError,
     "linear: x must be an array, got None"),
    ("linear-0d", lambda: tecupy.linear(np.ones((), np.float32), f32(3, 1)),
     ValueError, "linear: x must be .*at least 1 dimension"),
    ("linear-1d-weight", lambda: tecupy.linear(f32(4, 8), f32(8)), ValueError,
     r"weight has shape \(8,\), expected \(\*, 8\)"),
    ("linear-bias-list", lambda: tecupy.linear(f32(4, 8), f32(3, 8), [0.0] * 3), TypeError,
     "bias must be a numpy or cupy array"),
    ("linear-state", lambda: tecupy.linear(f32(4, 8), f32(3, 8), fp8_state="s"), TypeError,
     "fp8_state must be None or a tecupy.FP8State, got 's'"),
    ("linear-gemm-index", lambda: tecupy.linear(f32(4, 8), f32(3, 8),
                                                fp8_state=tecupy.FP8State(1), gemm_index=1),
     ValueError, r"gemm_index must be an int in \[0, 1\), got 1"),
    ("linear-gemm-index-type", lambda: tecupy.linear(
        f32(4, 8), f32(3, 8), fp8_state=tecupy.FP8State(1), gemm_index="0"), TypeError,
     "gemm_index must be an int"),
    # ---- layernorm / rmsnorm
    ("ln-weight", lambda: tecupy.layernorm(f32(4, 8), f32(7), f32(8)), ValueError,
     r"layernorm: weight has shape \(7,\), expected \(8\)"),
    ("ln-no-bias", lambda: tecupy.layernorm(f32(4, 8), f32(8), None), TypeError,
     r"layernorm: bias must be an array \[hidden\] \(LayerNorm has a bias.*got None"),
    ("ln-no-weight", lambda: tecupy.layernorm(f32(4, 8), None, f32(8)), TypeError,
     "layernorm: weight must be an array"),
    ("ln-eps-0", lambda: tecupy.layernorm(*ln_args()[:3], eps=0), ValueError,
     "layernorm: eps must be a finite number > 0, got 0"),
    ("ln-eps-neg", lambda: tecupy.layernorm(*ln_args()[:3], eps=-1e-5), ValueError,
     "eps must be a finite number > 0, got -1e-05"),
    ("ln-eps-nan", lambda: tecupy.layernorm(*ln_args()[:3], eps=float("nan")), ValueError,
     "eps must be a finite number > 0, got nan"),
    ("ln-eps-str", lambda: tecupy.layernorm(*ln_args()[:3], eps="1e-5"), TypeError,
     "eps must be a finite number > 0, got '1e-5'"),
    ("ln-zcg", lambda: tecupy.layernorm(*ln_args()[:3], zero_centered_gamma="yes"),
     TypeError, "zero_centered_gamma must be True or False, got 'yes'"),
    ("ln-int", lambda: tecupy.layernorm(np.ones((4, 8), np.int64), f32(8), f32(8)),
     TypeError, "x has dtype int64; accepted"),
    ("ln-empty", lambda: tecupy.layernorm(f32(4, 0), f32(0), f32(0)), ValueError,
     r"layernorm: x must be an array \[\.\.\., hidden\] with hidden >= 1"),
    ("ln-bias-dtype", lambda: tecupy.layernorm(f32(4, 8), f32(8), np.ones(8)), TypeError,
     "bias has dtype float64 but x has float32"),
    ("rms-weight", lambda: tecupy.rmsnorm(f32(4, 8), f32(9)), ValueError,
     r"rmsnorm: weight has shape \(9,\), expected \(8\)"),
    ("rms-eps", lambda: tecupy.rmsnorm(f32(4, 8), f32(8), eps=0.0), ValueError,
     "rmsnorm: eps must be"),
    ("rms-no-weight", lambda: tecupy.rmsnorm(f32(4, 8), None), TypeError,
     "rmsnorm: weight must be an array"),
    ("rms-0d", lambda: tecupy.rmsnorm(np.ones((), np.float32), f32(1)), ValueError,
     r"rmsnorm: x must be an array \[\.\.\., hidden\]"),
    # ---- activations
    ("act-name", lambda: tecupy.activation(f32(4), "tanh"), ValueError,
     "activation: name must be one of 'gelu', 'relu', .*'geglu'.*, got 'tanh'"),
    ("act-name-type", lambda: tecupy.activation(f32(4), 3), ValueError,
     "activation: name must be one of .*got 3"),
    ("swiglu-odd", lambda: tecupy.swiglu(f32(4, 7)), ValueError,
     r"swiglu: x must be an array \[\.\.\., 2n\].*shape \(4, 7\)"),
    ("geglu-odd", lambda: tecupy.geglu(f32(3)), ValueError, r"geglu: x must be .*shape \(3,\)"),
    ("gelu-int", lambda: tecupy.gelu(np.ones(4, np.int32)), TypeError,
     "gelu: x has dtype int32"),
    ("relu-list", lambda: tecupy.relu([1.0]), TypeError, "relu: x must be a numpy or cupy"),
    ("act-bias", lambda: tecupy.activation(f32(4, 8), "gelu", bias=f32(3)), ValueError,
     r"gelu: bias has shape \(3,\), expected \(8\)"),
    ("act-bias-0d", lambda: tecupy.activation(np.ones((), np.float32), "relu", bias=f32(1)),
     ValueError, "relu: x must be an array of at least 1 dimension when a bias is given"),
    # ---- add / reshape / split
    ("add-shapes", lambda: tecupy.add(f32(4, 3), f32(4, 2)), ValueError,
     r"add: a and b must have shapes that broadcast together, got \(4, 3\) and \(4, 2\)"),
    ("add-dtypes", lambda: tecupy.add(f32(4), np.ones(4)), TypeError,
     "add: b has dtype float64 but a has float32"),
    ("add-list", lambda: tecupy.add(f32(4), [1.0]), TypeError, "add: b must be a numpy or cupy"),
    ("add-int", lambda: tecupy.add(np.ones(4, np.int8), np.ones(4, np.int8)), TypeError,
     "add: a has dtype int8"),
    ("add_bias-not-a-row", lambda: tecupy.add_bias(f32(4, 3), f32(4, 1)), ValueError,
     r"add_bias: bias must be a row of x's last dimension \(3,\) \(x has shape \(4, 3\)\)"),
    ("add_bias-residual", lambda: tecupy.add_bias(f32(4, 3), f32(3), f32(3)), ValueError,
     r"add_bias: residual must be an array of x's shape \(4, 3\)"),
    ("add_bias-dtypes", lambda: tecupy.add_bias(f32(4, 3), np.ones(3)), TypeError,
     "add_bias: bias has dtype float64 but x has float32"),
    ("reshape-size", lambda: tecupy.reshape(f32(3, 4), (5, 2)), ValueError,
     r"reshape: shape must be a shape of 12 elements .*got \(5, 2\)"),
    ("reshape-two-free", lambda: tecupy.reshape(f32(3, 4), (-1, -1)), ValueError,
     r"reshape: shape must be .*at most one -1.*got \(-1, -1\)"),
    ("reshape-neg", lambda: tecupy.reshape(f32(3, 4), (-2, -6)), ValueError,
     "reshape: shape must be"),
    ("reshape-free-bad", lambda: tecupy.reshape(f32(3, 4), (5, -1)), ValueError,
     r"reshape: shape must be a shape of 12 elements"),
    ("reshape-str", lambda: tecupy.reshape(f32(3, 4), "12"), TypeError,
     "reshape: shape must be a tuple of ints, got '12'"),
    ("reshape-float", lambda: tecupy.reshape(f32(3, 4), (2.0, 6)), TypeError,
     r"reshape: shape must be a tuple of ints, got \(2.0, 6\)"),
    ("reshape-list-x", lambda: tecupy.reshape([1, 2], (2,)), TypeError,
     "reshape: x must be a numpy or cupy array"),
    ("split-sum", lambda: tecupy.split(f32(4, 6), [2, 3]), ValueError,
     r"split: sizes \[2, 3\] sum to 5, but axis -1 of x has 6"),
    ("split-axis", lambda: tecupy.split(f32(4, 6), [2, 4], axis=2), ValueError,
     r"split: axis must be an int in \[-2, 2\), got 2"),
    ("split-axis-type", lambda: tecupy.split(f32(4, 6), [2, 4], axis=1.0), TypeError,
     "split: axis must be an int"),
    ("split-negative", lambda: tecupy.split(f32(4, 6), [-1, 7]), ValueError,
     r"split: sizes must be a list of ints >= 0, got \[-1, 7\]"),
    ("split-sizes-type", lambda: tecupy.split(f32(4, 6), "33"), TypeError,
     "split: sizes must be a non-empty list of ints, got '33'"),
    ("split-empty", lambda: tecupy.split(f32(4, 6), []), TypeError,
     r"split: sizes must be a non-empty list of ints, got \[\]"),
    ("split-0d", lambda: tecupy.split(np.ones((), np.float32), [1]), ValueError,
     "split: x must be an array of at least 1 dimension"),
    # ---- softmax
    ("softmax-float-mask", lambda: tecupy.softmax(f32(4, 6), mask=np.zeros((4, 6))),
     TypeError, r"softmax: mask must be a bool array \(True = masked out\), got .*float64"),
    ("softmax-int-mask", lambda: tecupy.softmax(f32(4, 6), mask=np.ones((4, 6), np.int32)),
     TypeError, "softmax: mask must be a bool array.*int32"),
    ("softmax-mask-shape", lambda: tecupy.softmax(f32(4, 6), mask=np.zeros(3, bool)),
     ValueError, r"softmax: mask must broadcast to x's shape \(4, 6\), got shape \(3,\)"),
    ("softmax-mask-rank", lambda: tecupy.softmax(f32(4, 6), mask=np.zeros((2, 4, 6), bool)),
     ValueError, r"mask must broadcast to x's shape \(4, 6\), got shape \(2, 4, 6\)"),
    ("softmax-mask-list", lambda: tecupy.softmax(f32(4, 6), mask=[True]), TypeError,
     "softmax: mask must be a numpy or cupy array"),
    ("softmax-causal-1d", lambda: tecupy.softmax(f32(6), causal=True), ValueError,
     "softmax: x must be an array of at least 2 dimensions"),
    ("softmax-causal-str", lambda: tecupy.softmax(f32(4, 6), causal="yes"), TypeError,
     "softmax: causal must be True or False, got 'yes'"),
    ("softmax-scale-str", lambda: tecupy.softmax(f32(4, 6), scale="a"), TypeError,
     "softmax: scale must be a finite number, got 'a'"),
    ("softmax-scale-nan", lambda: tecupy.softmax(f32(4, 6), scale=float("nan")), ValueError,
     "softmax: scale must be a finite number, got nan"),
    ("softmax-int", lambda: tecupy.softmax(np.ones((4, 6), np.int64)), TypeError,
     "softmax: x has dtype int64"),
    # ---- dropout
    ("dropout-p-high", lambda: tecupy.dropout(f32(4), 1.5), ValueError,
     r"dropout: p must be a finite number in \[0, 1\], got 1.5"),
    ("dropout-p-neg", lambda: tecupy.dropout(f32(4), -0.1), ValueError, r"p must be .*-0.1"),
    ("dropout-p-nan", lambda: tecupy.dropout(f32(4), float("nan")), ValueError,
     "dropout: p must be .*got nan"),
    ("dropout-p-str", lambda: tecupy.dropout(f32(4), "0.1"), TypeError, "dropout: p must be"),
    ("dropout-seed-neg", lambda: tecupy.dropout(f32(4), 0.1, seed=-5), ValueError,
     r"dropout: seed must be None or an int in \[0, 2\*\*64\), got -5"),
    ("dropout-seed-big", lambda: tecupy.dropout(f32(4), 0.1, seed=2**64), ValueError,
     r"seed must be None or an int in \[0, 2\*\*64\), got 18446744073709551616"),
    ("dropout-seed-float", lambda: tecupy.dropout(f32(4), 0.1, seed=1.5), TypeError,
     "dropout: seed must be None or an int"),
    ("dropout-seed-str", lambda: tecupy.dropout(f32(4), 0.1, seed="1"), TypeError,
     "dropout: seed must be"),
    ("dropout-offset", lambda: tecupy.dropout(f32(4), 0.1, seed=1, offset=-1), ValueError,
     r"dropout: offset must be an int in \[0, 2\*\*64\), got -1"),
    ("dropout-residual", lambda: tecupy.dropout(f32(2, 3), 0.1, residual=f32(3)), ValueError,
     r"dropout: residual has shape \(3,\), x has \(2, 3\)"),
    ("dropout-training", lambda: tecupy.dropout(f32(4), 0.1, training="no"), TypeError,
     "dropout: training must be True or False, got 'no'"),
    ("dropout-int", lambda: tecupy.dropout(np.ones(4, np.int32), 0.1), TypeError,
     "dropout: x has dtype int32"),
    # ---- cross_entropy
    ("ce-target-shape", lambda: tecupy.cross_entropy(f32(4, 6), np.zeros(3, np.int64)),
     ValueError, r"cross_entropy: target must be an int array of shape \(4,\)"),
    ("ce-reduction", lambda: tecupy.cross_entropy(f32(4, 6), np.zeros(4, np.int64),
                                                  reduction="avg"),
     ValueError, "cross_entropy: reduction must be one of 'mean', 'sum', 'none', got 'avg'"),
    ("ce-negative", lambda: tecupy.cross_entropy(f32(4, 6), i64(0, -5, 1, 2)), ValueError,
     r"cross_entropy: target must be in \[0, 6\) or ignore_index \(-100\), got -5 at index "
     r"\(1,\)"),
    ("ce-too-big", lambda: tecupy.cross_entropy(f32(4, 6), i64(0, 1, 2, 6)), ValueError,
     r"target must be in \[0, 6\) or ignore_index \(-100\), got 6"),
    ("ce-ignore", lambda: tecupy.cross_entropy(f32(2, 3, 6), np.array([[3, 3, 0], [1, 100, 3]]),
                                               ignore_index=3),
     ValueError, r"target must be in \[0, 6\) or ignore_index \(3\), got 100 at index \(1, 1\)"),
    ("ce-float-target", lambda: tecupy.cross_entropy(f32(4, 6), np.zeros(4)), ValueError,
     "cross_entropy: target must be an int array"),
    ("ce-smoothing", lambda: tecupy.cross_entropy(f32(4, 6), i64(0, 1, 2, 3),
                                                  label_smoothing=1.5),
     ValueError, r"cross_entropy: label_smoothing must be a finite number in \[0, 1\]"),
    ("ce-smoothing-nan", lambda: tecupy.cross_entropy(f32(4, 6), i64(0, 1, 2, 3),
                                                      label_smoothing=float("nan")),
     ValueError, "label_smoothing must be .*got nan"),
    ("ce-ignore-float", lambda: tecupy.cross_entropy(f32(4, 6), i64(0, 1, 2, 3),
                                                     ignore_index=1.5),
     TypeError, "cross_entropy: ignore_index must be an int, got 1.5"),
    ("ce-int-logits", lambda: tecupy.cross_entropy(np.ones((4, 6), np.int32), i64(0, 1, 2, 3)),
     TypeError, "cross_entropy: logits has dtype int32"),
    ("ce-empty-vocab", lambda: tecupy.cross_entropy(f32(4, 0), i64(0, 0, 0, 0)), ValueError,
     r"cross_entropy: logits must be an array \[\.\.\., vocab\] with vocab >= 1"),
    ("ce-target-list", lambda: tecupy.cross_entropy(f32(4, 6), [0, 1, 2, 3]), TypeError,
     "cross_entropy: target must be a numpy or cupy array"),
    # ---- dot_product_attention
    ("dpa-heads", lambda: tecupy.dot_product_attention(*qkv(hk=3)), ValueError,
     "multiple of k's heads"),
    ("dpa-mask-type", lambda: tecupy.dot_product_attention(*qkv(), attn_mask_type="sliding"),
     ValueError, "dot_product_attention: attn_mask_type must be one of .*got 'sliding'"),
    ("dpa-mask-list", lambda: tecupy.dot_product_attention(*qkv(), attn_mask_type=["causal"]),
     ValueError, r"dot_product_attention: attn_mask_type must be one of .*got \['causal'\]"),
    ("dpa-Mask-flag", lambda: tecupy.ops.attention.Mask(causal=1, padding=False), TypeError,
     "Mask: causal must be True or False, got 1"),
    ("dpa-format", lambda: tecupy.dot_product_attention(*qkv(), qkv_format="thd"), ValueError,
     "dot_product_attention: qkv_format must be one of 'bshd', 'sbhd', got 'thd'"),
    ("dpa-no-seqlens", lambda: tecupy.dot_product_attention(*qkv(), attn_mask_type="padding"),
     ValueError, r"dot_product_attention: seqlens_q must be an int array \[batch\] with "
                 "'padding', got None"),
    ("dpa-seqlens-range", lambda: tecupy.dot_product_attention(
        *qkv(), attn_mask_type="padding", seqlens_q=i64(3, 9)), ValueError,
     r"seqlens_q must lie in \[0, 5\], got \[3, 9\]"),
    ("dpa-seqlens-float", lambda: tecupy.dot_product_attention(
        *qkv(), attn_mask_type="padding", seqlens_q=np.array([3.0, 4.0])), ValueError,
     r"seqlens_q must be an int array of shape \(2,\), got float64"),
    ("dpa-dropout-1", lambda: tecupy.dot_product_attention(*qkv(), attention_dropout=1.0),
     ValueError, r"attention_dropout must be a finite number in \[0, 1\), got 1.0"),
    ("dpa-dropout-str", lambda: tecupy.dot_product_attention(*qkv(), attention_dropout="0"),
     TypeError, "dot_product_attention: attention_dropout must be"),
    ("dpa-seed", lambda: tecupy.dot_product_attention(*qkv(), attention_dropout=0.1,
                                                      dropout_seed=-1),
     ValueError, r"dot_product_attention: dropout_seed must be None or an int in \[0, 2\*\*64\)"),
    ("dpa-scale-str", lambda: tecupy.dot_product_attention(*qkv(), softmax_scale="a"),
     TypeError, "dot_product_attention: softmax_scale must be a finite number, got 'a'"),
    ("dpa-scale-inf", lambda: tecupy.dot_product_attention(*qkv(), softmax_scale=np.inf),
     ValueError, "softmax_scale must be a finite number, got inf"),
    ("dpa-3d", lambda: tecupy.dot_product_attention(f32(2, 5, 8), f32(2, 5, 8), f32(2, 5, 8)),
     ValueError, r"q, k, v must be 4-D \(bshd\)"),
    ("dpa-no-q", lambda: tecupy.dot_product_attention(None, *qkv()[1:]), TypeError,
     "dot_product_attention: q must be an array, got None"),
    ("dpa-v-shape", lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8),
                                                         f32(2, 6, 2, 8)),
     ValueError, "with k and v of one shape"),
    ("dpa-zero-kv-heads", lambda: tecupy.dot_product_attention(*qkv(hk=0)), ValueError,
     "q's heads a multiple of k's heads"),
    ("dpa-int", lambda: tecupy.dot_product_attention(*(t.astype(np.int32) for t in qkv())),
     TypeError, "dot_product_attention: q has dtype int32"),
    # ---- layernorm_linear / layernorm_mlp
    ("lnl-norm", lambda: tecupy.layernorm_linear(*ln_args(), normalization="BatchNorm"),
     ValueError, "layernorm_linear: normalization must be one of 'LayerNorm', 'RMSNorm', "
                 "got 'BatchNorm'"),
    ("lnl-rms-bias", lambda: tecupy.layernorm_linear(*ln_args(), normalization="RMSNorm"),
     ValueError, r"layernorm_linear: ln_bias must be None for RMSNorm \(it has no bias\)"),
    ("lnl-no-bias", lambda: tecupy.layernorm_linear(f32(4, 8), f32(8), None, f32(3, 8)),
     TypeError, r"layernorm_linear: ln_bias must be an array \[hidden\] for LayerNorm"),
    ("lnl-weight", lambda: tecupy.layernorm_linear(*ln_args()[:3], f32(3, 7)), ValueError,
     r"layernorm_linear: weight has shape \(3, 7\), expected \(\*, 8\)"),
    ("lnl-ln-weight", lambda: tecupy.layernorm_linear(f32(4, 8), f32(7), f32(8), f32(3, 8)),
     ValueError, r"layernorm_linear: ln_weight has shape \(7,\), expected \(8\)"),
    ("lnl-eps", lambda: tecupy.layernorm_linear(*ln_args(), eps=0), ValueError,
     "layernorm_linear: eps must be a finite number > 0, got 0"),
    ("lnl-return", lambda: tecupy.layernorm_linear(*ln_args(), return_layernorm_output="y"),
     TypeError, "layernorm_linear: return_layernorm_output must be True or False"),
    ("lnl-no-weight", lambda: tecupy.layernorm_linear(*ln_args()[:3], None), TypeError,
     "layernorm_linear: weight must be an array, got None"),
    ("lnl-state", lambda: tecupy.layernorm_linear(*ln_args(), fp8_state=object()), TypeError,
     "layernorm_linear: fp8_state must be None or a tecupy.FP8State"),
    ("mlp-activation", lambda: tecupy.layernorm_mlp(*mlp_args(), activation="tanh"),
     ValueError, "layernorm_mlp: activation must be one of .*got 'tanh'"),
    ("mlp-fc2", lambda: tecupy.layernorm_mlp(*mlp_args(), activation="swiglu"), ValueError,
     r"layernorm_mlp: fc2_weight must be \[hidden, 6\]"),
    ("mlp-gated-odd", lambda: tecupy.layernorm_mlp(*mlp_args(fc1_rows=13), activation="geglu"),
     ValueError, r"layernorm_mlp: fc1_weight must be \[2 \* ffn, hidden\] for geglu"),
    ("mlp-fc1-in", lambda: tecupy.layernorm_mlp(f32(4, 8), f32(8), f32(8), f32(12, 7), None,
                                                f32(8, 12), None),
     ValueError, r"layernorm_mlp: fc1_weight has shape \(12, 7\), expected \(\*, 8\)"),
    ("mlp-fc1-bias", lambda: tecupy.layernorm_mlp(f32(4, 8), f32(8), f32(8), f32(12, 8),
                                                  f32(8), f32(8, 12), None),
     ValueError, r"layernorm_mlp: fc1_bias has shape \(8,\), expected \(12\)"),
    ("mlp-fc2-bias", lambda: tecupy.layernorm_mlp(f32(4, 8), f32(8), f32(8), f32(12, 8), None,
                                                  f32(8, 12), f32(12)),
     ValueError, r"layernorm_mlp: fc2_bias has shape \(12,\), expected \(8\)"),
    ("mlp-state", lambda: tecupy.layernorm_mlp(*mlp_args(), fp8_state=tecupy.FP8State(1)),
     ValueError, r"layernorm_mlp: fp8_state must be an FP8State of at least 2 GEMMs"),
    ("mlp-norm", lambda: tecupy.layernorm_mlp(*mlp_args(), normalization="rms"), ValueError,
     "layernorm_mlp: normalization must be one of"),
    ("mlp-zcg", lambda: tecupy.layernorm_mlp(*mlp_args(), zero_centered_gamma=1), TypeError,
     "layernorm_mlp: zero_centered_gamma must be True or False, got 1"),
]

MODULES = [
    # ---- constructors: sizes
    ("Linear-in-0", lambda: nn.Linear(0, 4, **CPU), ValueError,
     "Linear: in_features must be an int >= 1, got 0"),
    ("Linear-out-neg", lambda: nn.Linear(4, -3, **CPU), ValueError,
     "Linear: out_features must be an int >= 1, got -3"),
    ("Linear-in-float", lambda: nn.Linear(2.5, 4, **CPU), TypeError,
     "Linear: in_features must be an int >= 1, got 2.5"),
    ("Linear-in-str", lambda: nn.Linear("4", 4, **CPU), TypeError,
     "Linear: in_features must be an int"),
    ("Linear-out-bool", lambda: nn.Linear(4, True, **CPU), TypeError,
     "Linear: out_features must be an int >= 1, got True"),
    ("Linear-bias", lambda: nn.Linear(4, 4, bias="yes", **CPU), TypeError,
     "Linear: bias must be True or False, got 'yes'"),
    ("Linear-seed", lambda: nn.Linear(4, 4, seed=-1, **CPU), ValueError,
     r"Linear: seed must be None or an int in \[0, 2\*\*64\), got -1"),
    ("Linear-device", lambda: nn.Linear(4, 4, device="tpu"), ValueError,
     "Linear: device must be 'cuda', 'cpu' or None, got 'tpu'"),
    ("Linear-device-int", lambda: nn.Linear(4, 4, device=0), TypeError,
     "Linear: device must be 'cuda', 'cpu' or None, got 0"),
    ("Linear-dtype", lambda: nn.Linear(4, 4, params_dtype=np.int8, **CPU), TypeError,
     r"Linear: params_dtype must be None or a floating dtype \(float16, bfloat16, float32, "
     r"float64\), got <class 'numpy.int8'>"),
    ("Linear-dtype-name", lambda: nn.Linear(4, 4, params_dtype="foo", **CPU), TypeError,
     "Linear: params_dtype must be None or a floating dtype .*got 'foo'"),
    ("LayerNorm-dtype", lambda: nn.LayerNorm(8, params_dtype="int32", **CPU), TypeError,
     "LayerNorm: params_dtype must be None or a floating dtype .*got 'int32'"),
    ("MHA-device", lambda: nn.MultiheadAttention(64, 4, device="gpu"), ValueError,
     "MultiheadAttention: device must be 'cuda', 'cpu' or None, got 'gpu'"),
    ("Linear-train-str", lambda: nn.Linear(4, 4, **CPU).train("no"), TypeError,
     r"Linear.train: mode must be True or False, got 'no'"),
    ("TL-train-int", lambda: nn.TransformerLayer(8, 16, 2, **CPU).train(0), TypeError,
     r"TransformerLayer.train: mode must be True or False, got 0"),
    ("LayerNorm-size", lambda: nn.LayerNorm(0, **CPU), ValueError,
     "LayerNorm: hidden_size must be an int >= 1, got 0"),
    ("LayerNorm-eps-0", lambda: nn.LayerNorm(8, eps=0, **CPU), ValueError,
     "LayerNorm: eps must be a finite number > 0, got 0"),
    ("LayerNorm-eps-neg", lambda: nn.LayerNorm(8, eps=-1e-5, **CPU), ValueError,
     "LayerNorm: eps must be"),
    ("LayerNorm-zcg", lambda: nn.LayerNorm(8, zero_centered_gamma="no", **CPU), TypeError,
     "LayerNorm: zero_centered_gamma must be True or False"),
    ("LayerNorm-seed", lambda: nn.LayerNorm(8, seed=2**64, **CPU), ValueError,
     "LayerNorm: seed must be"),
    ("RMSNorm-size", lambda: nn.RMSNorm(-1, **CPU), ValueError,
     "RMSNorm: hidden_size must be an int >= 1, got -1"),
    ("RMSNorm-eps-nan", lambda: nn.RMSNorm(8, eps=float("nan"), **CPU), ValueError,
     "RMSNorm: eps must be a finite number > 0, got nan"),
    ("LNLinear-norm", lambda: nn.LayerNormLinear(8, 4, normalization="BatchNorm", **CPU),
     ValueError, "LayerNormLinear: normalization must be one of 'LayerNorm', 'RMSNorm'"),
    ("LNLinear-in", lambda: nn.LayerNormLinear(0, 4, **CPU), ValueError,
     "LayerNormLinear: in_features must be an int >= 1"),
    ("LNLinear-out", lambda: nn.LayerNormLinear(8, -1, **CPU), ValueError,
     "LayerNormLinear: out_features must be"),
    ("LNLinear-return", lambda: nn.LayerNormLinear(8, 4, return_layernorm_output="y", **CPU),
     TypeError, "LayerNormLinear: return_layernorm_output must be True or False"),
    ("LNLinear-eps", lambda: nn.LayerNormLinear(8, 4, eps=0.0, **CPU), ValueError,
     "LayerNormLinear: eps must be"),
    ("LNMLP-activation", lambda: nn.LayerNormMLP(8, 16, activation="tanh", **CPU), ValueError,
     "LayerNormMLP: activation must be one of 'gelu', 'relu', .*'geglu'.*, got 'tanh'"),
    ("LNMLP-ffn", lambda: nn.LayerNormMLP(8, 0, **CPU), ValueError,
     "LayerNormMLP: ffn_hidden_size must be an int >= 1, got 0"),
    ("LNMLP-hidden-float", lambda: nn.LayerNormMLP(8.0, 16, **CPU), TypeError,
     "LayerNormMLP: hidden_size must be an int"),
    ("LNMLP-norm", lambda: nn.LayerNormMLP(8, 16, normalization="layernorm", **CPU),
     ValueError, "LayerNormMLP: normalization must be one of"),
    ("LNMLP-bias", lambda: nn.LayerNormMLP(8, 16, bias=None, **CPU), TypeError,
     "LayerNormMLP: bias must be True or False, got None"),
    ("DPA-heads", lambda: nn.DotProductAttention(0, 8, **CPU), ValueError,
     "DotProductAttention: num_attention_heads must be an int >= 1, got 0"),
    ("DPA-kv", lambda: nn.DotProductAttention(4, 0, **CPU), ValueError,
     "DotProductAttention: kv_channels must be an int >= 1, got 0"),
    ("DPA-kv-none", lambda: nn.DotProductAttention(4, None, **CPU), TypeError,
     "DotProductAttention: kv_channels must be an int >= 1, got None"),
    ("DPA-groups", lambda: nn.DotProductAttention(4, 8, num_gqa_groups=3, **CPU), ValueError,
     r"DotProductAttention: num_gqa_groups must be a divisor of num_attention_heads \(4\), "
     "got 3"),
    ("DPA-dropout", lambda: nn.DotProductAttention(4, 8, attention_dropout=-0.1, **CPU),
     ValueError, r"DotProductAttention: attention_dropout must be a finite number in \[0, 1\)"),
    ("DPA-format", lambda: nn.DotProductAttention(4, 8, qkv_format="thd", **CPU), ValueError,
     "DotProductAttention: qkv_format must be one of 'bshd', 'sbhd', got 'thd'"),
    ("DPA-mask", lambda: nn.DotProductAttention(4, 8, attn_mask_type="sliding", **CPU),
     ValueError, "DotProductAttention: attn_mask_type must be one of .*got 'sliding'"),
    ("DPA-scale", lambda: nn.DotProductAttention(4, 8, softmax_scale="x", **CPU), TypeError,
     "DotProductAttention: softmax_scale must be a finite number"),
    ("DPA-seed", lambda: nn.DotProductAttention(4, 8, seed=1.5, **CPU), TypeError,
     "DotProductAttention: seed must be None or an int"),
    ("MHA-hidden-heads", lambda: nn.MultiheadAttention(10, 3, **CPU), ValueError,
     r"MultiheadAttention: hidden_size must be a multiple of num_attention_heads \(3\), or "
     "give kv_channels, got 10"),
    ("MHA-heads-0", lambda: nn.MultiheadAttention(64, 0, **CPU), ValueError,
     "MultiheadAttention: num_attention_heads must be an int >= 1, got 0"),
    ("MHA-hidden-0", lambda: nn.MultiheadAttention(0, 4, **CPU), ValueError,
     "MultiheadAttention: hidden_size must be an int >= 1, got 0"),
    ("MHA-kv", lambda: nn.MultiheadAttention(64, 4, kv_channels=-1, **CPU), ValueError,
     "MultiheadAttention: kv_channels must be an int >= 1, got -1"),
    ("MHA-groups", lambda: nn.MultiheadAttention(64, 4, num_gqa_groups=3, **CPU), ValueError,
     "MultiheadAttention: num_gqa_groups must be a divisor"),
    ("MHA-dropout", lambda: nn.MultiheadAttention(64, 4, attention_dropout=1.0, **CPU),
     ValueError, "MultiheadAttention: attention_dropout must be"),
    ("MHA-eps", lambda: nn.MultiheadAttention(64, 4, layernorm_epsilon=0, **CPU), ValueError,
     "MultiheadAttention: layernorm_epsilon must be a finite number > 0, got 0"),
    ("MHA-mask", lambda: nn.MultiheadAttention(64, 4, attn_mask_type="sliding", **CPU),
     ValueError, "MultiheadAttention: attn_mask_type must be one of"),
    ("MHA-format", lambda: nn.MultiheadAttention(64, 4, qkv_format="thd", **CPU), ValueError,
     "MultiheadAttention: qkv_format must be one of"),
    ("MHA-norm", lambda: nn.MultiheadAttention(64, 4, normalization="BatchNorm", **CPU),
     ValueError, "MultiheadAttention: normalization must be one of"),
    ("MHA-input-ln", lambda: nn.MultiheadAttention(64, 4, input_layernorm="yes", **CPU),
     TypeError, "MultiheadAttention: input_layernorm must be True or False"),
    ("TL-heads-0", lambda: nn.TransformerLayer(64, 256, 0, **CPU), ValueError,
     "TransformerLayer: num_attention_heads must be an int >= 1, got 0"),
    ("TL-hidden-heads", lambda: nn.TransformerLayer(64, 256, 3, **CPU), ValueError,
     r"TransformerLayer: hidden_size must be a multiple of num_attention_heads \(3\)"),
    ("TL-hidden-neg", lambda: nn.TransformerLayer(-64, 256, 4, **CPU), ValueError,
     "TransformerLayer: hidden_size must be an int >= 1, got -64"),
    ("TL-ffn", lambda: nn.TransformerLayer(64, 0, 4, **CPU), ValueError,
     "TransformerLayer: ffn_hidden_size must be an int >= 1, got 0"),
    ("TL-groups", lambda: nn.TransformerLayer(64, 256, 4, num_gqa_groups=3, **CPU), ValueError,
     "TransformerLayer: num_gqa_groups must be a divisor"),
    ("TL-eps-0", lambda: nn.TransformerLayer(64, 256, 4, layernorm_epsilon=0, **CPU),
     ValueError, "TransformerLayer: layernorm_epsilon must be a finite number > 0, got 0"),
    ("TL-eps-neg", lambda: nn.TransformerLayer(64, 256, 4, layernorm_epsilon=-1.0, **CPU),
     ValueError, "TransformerLayer: layernorm_epsilon must be"),
    ("TL-hidden-dropout", lambda: nn.TransformerLayer(64, 256, 4, hidden_dropout=2.0, **CPU),
     ValueError, r"TransformerLayer: hidden_dropout must be a finite number in \[0, 1\], "
                 "got 2.0"),
    ("TL-attn-dropout", lambda: nn.TransformerLayer(64, 256, 4, attention_dropout=-0.1, **CPU),
     ValueError, r"TransformerLayer: attention_dropout must be a finite number in \[0, 1\), "
                 "got -0.1"),
    ("TL-mask", lambda: nn.TransformerLayer(64, 256, 4, self_attn_mask_type="sliding", **CPU),
     ValueError, "TransformerLayer: self_attn_mask_type must be one of .*got 'sliding'"),
    ("TL-norm", lambda: nn.TransformerLayer(64, 256, 4, normalization="BatchNorm", **CPU),
     ValueError, "TransformerLayer: normalization must be one of"),
    ("TL-activation", lambda: nn.TransformerLayer(64, 256, 4, activation="tanh", **CPU),
     ValueError, "TransformerLayer: activation must be one of"),
    ("TL-format", lambda: nn.TransformerLayer(64, 256, 4, attn_input_format="thd", **CPU),
     ValueError, "TransformerLayer: attn_input_format must be one of 'bshd', 'sbhd', got 'thd'"),
    ("TL-kv", lambda: nn.TransformerLayer(64, 256, 4, kv_channels=0, **CPU), ValueError,
     "TransformerLayer: kv_channels must be an int >= 1, got 0"),
    ("TL-bias", lambda: nn.TransformerLayer(64, 256, 4, bias="yes", **CPU), TypeError,
     "TransformerLayer: bias must be True or False"),
    ("TL-zcg", lambda: nn.TransformerLayer(64, 256, 4, zero_centered_gamma=1, **CPU),
     TypeError, "TransformerLayer: zero_centered_gamma must be True or False, got 1"),
    ("TL-seed", lambda: nn.TransformerLayer(64, 256, 4, seed=-1, **CPU), ValueError,
     "TransformerLayer: seed must be"),
    # ---- forwards: the input is blamed, with the layer's size
    ("Linear-fwd", lambda: nn.Linear(8, 4, **CPU)(f32(2, 5)), ValueError,
     r"Linear: x must have last dimension 8 \(in_features\), got shape \(2, 5\)"),
    ("Linear-fwd-list", lambda: nn.Linear(8, 4, **CPU)([1.0] * 8), TypeError,
     "Linear: x must be a numpy or cupy array, got"),
    ("LayerNorm-fwd", lambda: nn.LayerNorm(8, **CPU)(f32(2, 6)), ValueError,
     r"LayerNorm: x must have last dimension 8 \(hidden_size\), got shape \(2, 6\)"),
    ("RMSNorm-fwd", lambda: nn.RMSNorm(8, **CPU)(f32(2, 6)), ValueError,
     r"RMSNorm: x must have last dimension 8 \(hidden_size\)"),
    ("LNLinear-fwd", lambda: nn.LayerNormLinear(8, 4, **CPU)(f32(2, 6)), ValueError,
     r"LayerNormLinear: x must have last dimension 8 \(in_features\)"),
    ("LNMLP-fwd", lambda: nn.LayerNormMLP(8, 16, **CPU)(f32(2, 6)), ValueError,
     r"LayerNormMLP: x must have last dimension 8 \(hidden_size\), got shape \(2, 6\)"),
    ("DPA-fwd-query", lambda: nn.DotProductAttention(4, 8, **CPU)(*qkv(hk=4, h=2)), ValueError,
     r"DotProductAttention: query must be an array \[\*, \*, 4, 8\]"),
    ("DPA-fwd-key", lambda: nn.DotProductAttention(4, 8, num_gqa_groups=2, **CPU)(*qkv(hk=1)),
     ValueError, r"DotProductAttention: key must be an array \[\*, \*, 2, 8\]"),
    ("MHA-fwd", lambda: nn.MultiheadAttention(8, 2, **CPU)(f32(5, 2, 6)), ValueError,
     r"MultiheadAttention: hidden_states must have last dimension 8 \(hidden_size\), got "
     r"shape \(5, 2, 6\)"),
    ("MHA-fwd-2d", lambda: nn.MultiheadAttention(8, 2, **CPU)(f32(5, 8)), ValueError,
     r"MultiheadAttention: hidden_states must be a 3-D array \[s, b, 8\]"),
    ("MHA-fwd-mask", lambda: nn.MultiheadAttention(8, 2, **CPU)(f32(5, 2, 8), "sliding"),
     ValueError, "MultiheadAttention: attn_mask_type must be one of .*got 'sliding'"),
    ("DPA-set-mask", lambda: setattr(nn.DotProductAttention(4, 8, **CPU), "attn_mask_type",
                                     "sliding"),
     ValueError, "DotProductAttention: attn_mask_type must be one of .*got 'sliding'"),
    ("MHA-fwd-seqlens", lambda: nn.MultiheadAttention(8, 2, attn_mask_type="padding", **CPU)(
        f32(5, 2, 8)), ValueError,
     r"MultiheadAttention: seqlens must be an int array \[batch\] with "
     "attn_mask_type='padding', got None"),
    ("TL-fwd", lambda: nn.TransformerLayer(8, 16, 2, **CPU)(f32(5, 2, 6)), ValueError,
     r"TransformerLayer: hidden_states must have last dimension 8 \(hidden_size\)"),
    ("TL-fwd-mask", lambda: nn.TransformerLayer(8, 16, 2, **CPU)(f32(5, 2, 8), "sliding"),
     ValueError, "TransformerLayer: self_attn_mask_type must be one of"),
    ("TL-fwd-seqlens", lambda: nn.TransformerLayer(8, 16, 2, **CPU)(f32(5, 2, 8),
                                                                     "padding_causal"),
     ValueError, "TransformerLayer: seqlens must be an int array"),
]

FP8 = [  # tecupy/fp8.py
    ("quantize-format", lambda: tecupy.quantize(f32(4, 4), 1.0, "e3m4"), ValueError,
     r"quantize: fmt must be 'e4m3', 'e5m2' or a tecupy.fp8 format \(tecupy.fp8.E4M3, E5M2\), "
     "got 'e3m4'"),
    ("quantize-int", lambda: tecupy.quantize(np.ones((4, 4), np.int32), 1.0, "e4m3"),
     TypeError, "quantize: x has dtype int32"),
    ("quantize-list", lambda: tecupy.quantize([1.0], 1.0, "e4m3"), TypeError,
     "quantize: x must be a numpy or cupy array"),
    ("quantize-scale", lambda: tecupy.quantize(f32(4, 4), np.ones(2, np.float32), "e4m3"),
     TypeError, "scale must be a float32 array of one element"),
    ("quantize-transpose", lambda: tecupy.quantize(f32(2, 4, 4), 1.0, "e4m3", transpose=True),
     ValueError, "transpose=True.*2-D x"),
    ("quantize-dbias", lambda: tecupy.quantize(f32(4, 4), 1.0, "e4m3",
                                               dbias_dtype=np.float32),
     ValueError, "dbias_dtype"),
    ("FP8Tensor-dtype", lambda: tecupy.FP8Tensor(f32(4), "e4m3", np.ones(1, np.float32)),
     TypeError, "FP8Tensor: data must be a uint8 array .*got a numpy array of dtype float32"),
    ("FP8Tensor-format", lambda: tecupy.FP8Tensor(np.zeros(4, np.uint8), "e9",
                                                  np.ones(1, np.float32)),
     ValueError, "FP8Tensor: fmt must be 'e4m3', 'e5m2' .*got 'e9'"),
    ("FP8Tensor-scale-inv", lambda: tecupy.FP8Tensor(np.zeros(4, np.uint8), "e4m3", [1.0]),
     TypeError, "FP8Tensor: scale_inv must be a numpy or cupy array"),
    ("FP8Tensor-transpose", lambda: tecupy.FP8Tensor(np.zeros((2, 2, 2), np.uint8), "e4m3",
                                                     np.ones(1, np.float32)).transpose(),
     ValueError, "FP8Tensor.transpose needs 2-D data"),
    # scale: a number, or a float32 array of one element; numbers and numpy arrays finite
    # and > 0 (a CuPy scale is not read: that would synchronise with the GPU)
    ("quantize-scale-nan-array", lambda: tecupy.quantize(f32(4, 4), np.array([np.nan],
                                                                          np.float32), "e4m3"),
     ValueError, r"quantize: scale must be a float32 array of one element or a number, finite "
                 r"and > 0, got a numpy array holding nan"),
    ("quantize-scale-zero-array", lambda: tecupy.quantize(f32(4), np.zeros(1, np.float32),
                                                          "e4m3"),
     ValueError, "quantize: scale must be .*got a numpy array holding 0.0"),
    ("quantize-scale-nan", lambda: tecupy.quantize(f32(4, 4), float("nan"), "e4m3"),
     ValueError, "quantize: scale must be .*finite and > 0, got nan"),
    ("quantize-scale-inf", lambda: tecupy.quantize(f32(4), np.inf, "e5m2"), ValueError,
     "quantize: scale must be .*got inf"),
    ("quantize-scale-zero", lambda: tecupy.quantize(f32(4), 0.0, "e4m3"), ValueError,
     "quantize: scale must be .*got 0.0"),
    ("quantize-scale-neg", lambda: tecupy.quantize(f32(4), -2, "e4m3"), ValueError,
     "quantize: scale must be .*got -2$"),
    ("quantize-scale-f32-overflow", lambda: tecupy.quantize(f32(4), 1e39, "e4m3"), ValueError,
     "quantize: scale must be .*got 1e[+]39"),
    ("quantize-scale-bool", lambda: tecupy.quantize(f32(4), True, "e4m3"), TypeError,
     "quantize: scale must be a float32 array of one element or a number.*got True"),
    ("quantize-scale-list", lambda: tecupy.quantize(f32(4), [1.0], "e4m3"), TypeError,
     r"quantize: scale must be .*got \[1.0\]"),
    ("quantize-scale-f64", lambda: tecupy.quantize(f32(4), np.ones(1), "e4m3"), TypeError,
     r"quantize: scale must be .*got a numpy array of dtype float64 and shape \(1,\)"),
    ("quantize-fmt-int", lambda: tecupy.quantize(f32(4), 1.0, 3), TypeError,
     "quantize: fmt must be 'e4m3', 'e5m2' or a tecupy.fp8 format .*got 3"),
    ("quantize-fmt-recipe", lambda: tecupy.quantize(f32(4), 1.0, Format.E4M3), TypeError,
     "quantize: fmt must be .*got <Format.E4M3"),
    ("quantize-amax-out", lambda: tecupy.quantize(f32(4), 1.0, "e4m3", amax_out=np.zeros(1)),
     TypeError, "quantize: amax_out must be None or a float32 array of one element, got a "
                "numpy array of dtype float64"),
    ("quantize-dbias-int", lambda: tecupy.quantize(f32(4, 4), 1.0, "e4m3", transpose=True,
                                                   dbias_dtype=np.int32),
     TypeError, "quantize: dbias_dtype must be a floating dtype .*got <class 'numpy.int32'>"),
    ("quantize-current-fmt", lambda: tecupy.fp8.quantize_current(f32(4), "e3m4"), ValueError,
     "quantize_current: fmt must be 'e4m3', 'e5m2'"),
    ("quantize-current-list", lambda: tecupy.fp8.quantize_current([1.0], "e4m3"), TypeError,
     "quantize_current: x must be a numpy or cupy array, got list"),
    ("dequantize-int", lambda: tecupy.dequantize(fp8_tensor(), np.int32), TypeError,
     r"dequantize: dtype must be a floating dtype \(float16, bfloat16, float32, float64\), "
     "got <class 'numpy.int32'>"),
    ("dequantize-none", lambda: tecupy.dequantize(fp8_tensor(), None), TypeError,
     "dequantize: dtype must be a floating dtype .*got None"),
    ("dequantize-name", lambda: fp8_tensor().dequantize("foo"), TypeError,
     "dequantize: dtype must be a floating dtype .*got 'foo'"),
    ("dequantize-str", lambda: tecupy.dequantize("x"), TypeError,
     r"dequantize: t must be a tecupy.FP8Tensor \(what quantize returns\), got 'x'"),
    ("FP8Tensor-list", lambda: tecupy.FP8Tensor([1], "e4m3", np.ones(1, np.float32)),
     TypeError, "FP8Tensor: data must be a numpy or cupy array, got list"),
    ("FP8Tensor-scale-inv-dtype", lambda: tecupy.FP8Tensor(np.zeros(4, np.uint8), "e4m3",
                                                           np.ones(1)),
     TypeError, "FP8Tensor: scale_inv must be a float32 array of one element, got a numpy "
                "array of dtype float64"),
    ("FP8Tensor-scale-inv-size", lambda: tecupy.FP8Tensor(np.zeros(4, np.uint8), "e4m3",
                                                          np.ones(4, np.float32)),
     TypeError, r"FP8Tensor: scale_inv must be .*shape \(4,\)"),
    ("FP8Tensor-data-t", lambda: tecupy.FP8Tensor(np.zeros((2, 3), np.uint8), "e4m3",
                                                  np.ones(1, np.float32),
                                                  data_t=np.zeros((2, 3), np.uint8)),
     ValueError, r"FP8Tensor: data_t has shape \(2, 3\), expected \(3, 2\)"),
    ("FP8Tensor-fmt-int", lambda: tecupy.FP8Tensor(np.zeros(4, np.uint8), 8,
                                                   np.ones(1, np.float32)),
     TypeError, "FP8Tensor: fmt must be .*got 8"),
]

RECIPES = [
    # ---- recipes: checked when made (and when a field is assigned)
    ("DS-margin-nan", lambda: DelayedScaling(margin=float("nan")), ValueError,
     r"DelayedScaling: margin must be an int in \[0, 126\], got nan"),
    ("DS-margin-float", lambda: DelayedScaling(margin=1.5), ValueError,
     r"DelayedScaling: margin must be an int in \[0, 126\], got 1.5"),
    ("DS-margin-str", lambda: DelayedScaling(margin="2"), TypeError,
     r"DelayedScaling: margin must be an int in \[0, 126\], got '2' \(str\)"),
    ("DS-margin-neg", lambda: DelayedScaling(margin=-1), ValueError,
     r"DelayedScaling: margin must be an int in \[0, 126\], got -1"),
    ("DS-margin-big", lambda: DelayedScaling(margin=127), ValueError,
     r"margin must be an int in \[0, 126\], got 127"),
    ("DS-margin-bool", lambda: DelayedScaling(margin=True), TypeError,
     "DelayedScaling: margin must be an int .*got True"),
    ("DS-margin-assigned", lambda: setattr(DelayedScaling(), "margin", -1), ValueError,
     "DelayedScaling: margin must be an int .*got -1"),
    ("DS-len-float", lambda: DelayedScaling(amax_history_len=2.7), ValueError,
     "DelayedScaling: amax_history_len must be an int >= 1, got 2.7"),
    ("DS-len-0", lambda: DelayedScaling(amax_history_len=0), ValueError,
     "DelayedScaling: amax_history_len must be an int >= 1, got 0"),
    ("DS-len-str", lambda: DelayedScaling(amax_history_len="16"), TypeError,
     "DelayedScaling: amax_history_len must be an int >= 1, got '16'"),
    ("DS-algo", lambda: DelayedScaling(amax_compute_algo="mean"), ValueError,
     r"DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a callable "
     r"f\(amax_history \[L, n\]\) -> amax \[n\], got 'mean'"),
    ("DS-algo-int", lambda: DelayedScaling(amax_compute_algo=3), ValueError,
     "DelayedScaling: amax_compute_algo must be .*got 3"),
    ("DS-sf-algo", lambda: DelayedScaling(scaling_factor_compute_algo=3), TypeError,
     "DelayedScaling: scaling_factor_compute_algo must be None or a callable .*got 3"),
    ("DS-format-str", lambda: DelayedScaling(fp8_format="HYBRID"), TypeError,
     r"DelayedScaling: fp8_format must be a tecupy.recipe.Format \(E4M3 or HYBRID\), got "
     "'HYBRID'"),
    ("DS-format-e5m2", lambda: DelayedScaling(fp8_format=Format.E5M2), ValueError,
     "DelayedScaling: fp8_format=Format.E5M2: pure E5M2 training is not supported"),
    ("DS-reduce", lambda: DelayedScaling(reduce_amax="no"), TypeError,
     "DelayedScaling: reduce_amax must be True or False, got 'no'"),
    ("CS-format-e5m2", lambda: Float8CurrentScaling(fp8_format=Format.E5M2), ValueError,
     "Float8CurrentScaling: fp8_format=Format.E5M2: pure E5M2 training is not supported"),
    ("CS-format-str", lambda: Float8CurrentScaling(fp8_format="E4M3"), TypeError,
     "Float8CurrentScaling: fp8_format must be a tecupy.recipe.Format"),
    # ---- autocast and FP8 state
    ("autocast-recipe", lambda: enter(tecupy.fp8_autocast(fp8_recipe="x")), TypeError,
     "fp8_autocast: fp8_recipe must be None, a tecupy.recipe.DelayedScaling, "
     "Float8CurrentScaling or Float8BlockScaling, got 'x'"),
    ("autocast-recipe-class", lambda: enter(tecupy.fp8_autocast(fp8_recipe=DelayedScaling)),
     TypeError, "fp8_autocast: fp8_recipe must be .*got <class 'tecupy.recipe.DelayedScaling'>"),
    ("autocast-enabled", lambda: enter(tecupy.fp8_autocast(enabled="yes")), TypeError,
     r"fp8_autocast: enabled must be True or False, got 'yes' \(str\)"),
    ("autocast-te2-recipe", lambda: enter(tecupy.autocast(recipe=Format.HYBRID)), TypeError,
     "autocast: recipe must be None, a tecupy.recipe.DelayedScaling, Float8CurrentScaling or "
     "Float8BlockScaling, got <Format.HYBRID"),
    ("FP8State-0", lambda: tecupy.FP8State(0), ValueError,
     "FP8State: num_gemms must be an int >= 1, got 0"),
    ("FP8State-float", lambda: tecupy.FP8State(1.5), TypeError,
     "FP8State: num_gemms must be an int >= 1, got 1.5"),
    ("FP8State-str", lambda: tecupy.FP8State("a"), TypeError,
     "FP8State: num_gemms must be an int >= 1, got 'a'"),
]

TAPE = [
    ("tape-wrt-str", lambda: on_tape(lambda t, x, w, y: t.gradient(y, "x")), TypeError,
     r"Tape.gradient: wrt\[0\] must be a numpy or cupy array, got str 'x'"),
    ("tape-wrt-list", lambda: on_tape(lambda t, x, w, y: t.gradient(y, [x, 3])), TypeError,
     r"Tape.gradient: wrt\[1\] must be a numpy or cupy array, got int 3"),
    ("tape-wrt-unknown", lambda: on_tape(lambda t, x, w, y: t.gradient(y, x.copy())),
     ValueError, r"Tape.gradient: wrt\[0\] \(shape \(4, 8\), float32\) is not on this tape"),
    ("tape-outputs-str", lambda: on_tape(lambda t, x, w, y: t.gradient("y", x)), TypeError,
     r"Tape.gradient: outputs\[0\] must be a numpy or cupy array, got str 'y'"),
    ("tape-output-unknown", lambda: on_tape(lambda t, x, w, y: t.gradient(f32(4, 3), x)),
     ValueError, r"Tape.gradient: output 0 \(shape \(4, 3\)\) was not produced by a tecupy op "
                 "recorded on this tape"),
    ("tape-output-grad-shape", lambda: on_tape(
        lambda t, x, w, y: t.gradient(y, x, output_grad=f32(4, 2))), ValueError,
     r"Tape.gradient: output_grad 0 has shape \(4, 2\), output has \(4, 3\)"),
    ("tape-output-grad-count", lambda: on_tape(
        lambda t, x, w, y: t.gradient(y, x, output_grad=[f32(4, 3), f32(4, 3)])), ValueError,
     "Tape.gradient: 1 outputs but 2 output grads"),
    ("tape-output-grad-type", lambda: on_tape(
        lambda t, x, w, y: t.gradient(y, x, output_grad="g")), TypeError,
     r"Tape.gradient: output_grad\[0\] must be a numpy or cupy array, got str 'g'"),
    ("tape-fp8-twice", fp8_backward_twice, RuntimeError,
     "Tape.gradient: the backward of FP8 ops on this tape already ran"),
]

ROWS = FUNCTIONAL + MODULES + FP8 + RECIPES + TAPE


def test_table_size_and_unique_ids():
    assert len(ROWS) >= 100, len(ROWS)
    ids = [r[0] for r in ROWS]
    assert len(set(ids)) == len(ids), "row ids must be unique"


@pytest.mark.parametrize("call, exc, msg", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg) as excinfo:
        call()
    assert type(excinfo.value) is exc, f"{type(excinfo.value).__name__}, expected {exc.__name__}"
    assert_raised_by_tecupy(excinfo)


def test_the_origin_check_catches_numpy_errors():
    """The helper itself: an error of numpy's, raised in numpy's C code from a tecupy line
    (the reference's `a + b`) or from outside tecupy, does not pass as tecupy's."""
    from tecupy import backends
    with pytest.raises(ValueError) as excinfo:
        backends.dispatch("add_fwd", np.ones((4, 3)), np.ones((4, 2)))
    with pytest.raises(AssertionError, match="not raised by a tecupy raise statement"):
        assert_raised_by_tecupy(excinfo)
    with pytest.raises(ValueError) as excinfo:
        np.ones(3).reshape(2)
    with pytest.raises(AssertionError, match="raised outside tecupy"):
        assert_raised_by_tecupy(excinfo)
