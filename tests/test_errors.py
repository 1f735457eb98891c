"""Bad input gets a clear error naming what is wrong and what is accepted."""
import numpy as np
import pytest

import tecupy


def f32(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: tecupy.linear(f32(4, 8), f32(3, 7)), ValueError, r"weight has shape \(3, 7\), expected \(\*, 8\)"),
    (lambda: tecupy.linear(f32(4, 8), f32(3, 8), f32(4)), ValueError, r"bias has shape \(4,\), expected \(3\)"),
    (lambda: tecupy.linear(f32(4, 8), f32(3, 8).astype(np.float16)), TypeError, "one floating dtype"),
    (lambda: tecupy.linear(f32(4, 8).astype(np.int32), f32(3, 8)), TypeError, "accepted: float16, bfloat16"),
    (lambda: tecupy.linear([[1.0]], f32(1, 1)), TypeError, "must be a numpy or cupy array"),
    (lambda: tecupy.layernorm(f32(4, 8), f32(7), f32(8)), ValueError, "weight has shape"),
    (lambda: tecupy.layernorm(f32(4, 8), f32(8), f32(8), eps=0), ValueError, "eps must be > 0"),
    (lambda: tecupy.swiglu(f32(4, 7)), ValueError, "must be even"),
    (lambda: tecupy.activation(f32(4), "tanh"), ValueError, "one of"),
    (lambda: tecupy.dropout(f32(4), 1.5), ValueError, r"p must be in \[0, 1\]"),
    (lambda: tecupy.split(f32(4, 6), [2, 3]), ValueError, "sum to 5"),
    (lambda: tecupy.cross_entropy(f32(4, 6), np.zeros(3, np.int64)), ValueError, "target must be an int array of shape"),
    (lambda: tecupy.cross_entropy(f32(4, 6), np.zeros(4, np.int64), reduction="avg"), ValueError, "reduction"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 3, 8), f32(2, 5, 3, 8)), ValueError, "multiple of k's heads"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8), attn_mask_type="sliding"), ValueError, "attn_mask_type must be one of"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8), qkv_format="thd"), ValueError, "qkv_format must be one of"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8), attn_mask_type="padding"), ValueError, "need seqlens_q"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8), attn_mask_type="padding", seqlens_q=np.array([3, 9])), ValueError, r"must lie in \[0, 5\]"),
    (lambda: tecupy.dot_product_attention(f32(2, 5, 4, 8), f32(2, 5, 2, 8), f32(2, 5, 2, 8), attention_dropout=1.0), ValueError, "attention_dropout"),
    (lambda: tecupy.layernorm_mlp(f32(4, 8), f32(8), f32(8), f32(12, 8), None, f32(8, 12), None, activation="swiglu"), ValueError, r"fc2_weight must be \[hidden, 6\]"),
    (lambda: tecupy.layernorm_linear(f32(4, 8), f32(8), f32(8), f32(3, 8), normalization="RMSNorm"), ValueError, "RMSNorm takes no bias"),
    (lambda: tecupy.layernorm_linear(f32(4, 8), f32(8), f32(8), f32(3, 8), normalization="BatchNorm"), ValueError, "normalization must be one of"),
    (lambda: tecupy.nn.Linear(4, 4, device="tpu"), ValueError, "device must be"),
    (lambda: tecupy.nn.Linear(4, 4, params_dtype=np.int8, device="cpu"), TypeError, "params_dtype"),
    (lambda: tecupy.nn.MultiheadAttention(10, 3, device="cpu"), ValueError, "multiple of num_attention_heads"),
])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.gpu
def test_mixed_numpy_and_cupy_is_an_error():
    import cupy
    with pytest.raises(TypeError, match="x is a numpy array but weight is a cupy array"):
        tecupy.linear(f32(4, 8), cupy.asarray(f32(3, 8)))


def test_fp8_state_cannot_change_device():
    st = tecupy.FP8State()
    st.bind(np, tecupy.recipe.DelayedScaling())

    class FakeXP:  # another array module
        pass
    with pytest.raises(TypeError, match="one device"):
        st.bind(FakeXP, tecupy.recipe.DelayedScaling())
    with pytest.raises(IndexError, match="1 GEMMs"):
        st.quantize_fwd(f32(16, 16), 1, "input")
