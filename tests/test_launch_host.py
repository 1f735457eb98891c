"""The host side of the PDL launch (kernels/launch.launch), no GPU needed: the ctypes
structs match cuda.h, arguments are packed 8 bytes each as the driver reads them, and an
argument type the kernels do not take is refused by name."""
import ctypes
import struct

import numpy as np
import pytest

from tecupy.kernels import launch

cupy = pytest.importorskip("cupy")


def test_launch_structs_match_cuda_h():
    cfg, attr = launch._LaunchConfig, launch._LaunchAttr
    # CUlaunchConfig: 7 unsigned ints, then hStream, attrs, numAttrs (8-byte aligned)
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(cfg) == 56
    # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    assert (attr.value.offset, ctypes.sizeof(attr)) == (8, 72)
    assert launch._PDL_ATTR.id == 6 and launch._PDL_ATTR.value[0] == 1


def test_arguments_packed_8_bytes_each():
    kinds = (cupy.ndarray, np.int32, np.float32, np.int64, np.uint32, np.uint64)
    st, buf, params, cfg = launch._launch_state(kinds, (7, 2), (256,), 1024)
    st.pack_into(buf, 0, 0x7F0012345678, np.int32(-5), np.float32(1.5), np.int64(-(2**40)),
                 np.uint32(2**32 - 1), np.uint64(2**63 + 9))
    raw = buf.raw
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x7F0012345678
    assert struct.unpack_from("<i", raw, 8)[0] == -5
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5
    assert struct.unpack_from("<q", raw, 24)[0] == -(2**40)
    assert struct.unpack_from("<I", raw, 32)[0] == 2**32 - 1
    assert struct.unpack_from("<Q", raw, 40)[0] == 2**63 + 9
    base = ctypes.addressof(buf)
    assert [params[i] for i in range(len(kinds))] == [base + 8 * i for i in range(len(kinds))]
    assert (list(cfg.grid), list(cfg.block), cfg.shared, cfg.num_attrs) == \
        ([7, 2, 1], [256, 1, 1], 1024, 1)


@pytest.mark.parametrize("bad", [int, float, np.float64, np.int16])
def test_unsupported_argument_type_is_named(bad):
    with pytest.raises(TypeError, match=f"{bad.__name__}.*accepted: CuPy arrays and NumPy "
                                        "int32/int64/float32/uint32/uint64"):
        launch._launch_state((cupy.ndarray, bad), (1,), (32,), 0)


def test_128_byte_arguments_and_no_pdl():
    """The FP8 GEMM's arguments: 7 pointers, 3 int32, 3 TMA descriptors of 128 bytes; each
    void* points at its own argument (the driver copies each parameter's size from there),
    and a launch without PDL carries no attribute."""
    kinds = (cupy.ndarray,) * 7 + (np.int32,) * 3 + (bytes,) * 3
    st, buf, params, cfg = launch._launch_state(kinds, (132,), (384,), 200000, pdl=False)
    descs = [bytes([i]) * 128 for i in (1, 2, 3)]
    st.pack_into(buf, 0, *range(10, 17), 256, 4096, 1024, *descs)
    base = ctypes.addressof(buf)
    offsets = [params[i] - base for i in range(len(kinds))]
    assert offsets == [8 * i for i in range(10)] + [80, 208, 336] and st.size == 464
    assert [struct.unpack_from("<Q", buf.raw, o)[0] for o in offsets[:7]] == list(range(10, 17))
    assert [struct.unpack_from("<i", buf.raw, o)[0] for o in offsets[7:10]] == [256, 4096, 1024]
    assert [buf.raw[o:o + 128] for o in offsets[10:]] == descs
    assert (cfg.num_attrs, bool(cfg.attrs), cfg.shared) == (0, False, 200000)


def test_struct_arguments_by_value():
    """A kind n (a multiple of 8) is an n-byte struct passed by value (attention's
    BwdSm90Strides: 4 int64): one parameter, its bytes where its void* points; other sizes
    are refused."""
    kinds = (cupy.ndarray, 32, np.float32)
    st, buf, params, _ = launch._launch_state(kinds, (1,), (32,), 0, pdl=False)
    blob = np.array([1, -2, 3, 2**40], np.int64).tobytes()
    st.pack_into(buf, 0, 0xABC, blob, np.float32(0.5))
    base = ctypes.addressof(buf)
    assert [params[i] - base for i in range(3)] == [0, 8, 40] and st.size == 48
    assert buf.raw[8:40] == blob and struct.unpack_from("<f", buf.raw, 40)[0] == 0.5
    for bad in (12, 0, -8):
        with pytest.raises(TypeError, match="an n-byte struct"):
            launch._launch_state((cupy.ndarray, bad), (1,), (32,), 0)


def test_sm_margin_is_checked_nested_and_restored():
    """launch.sm_margin: an int >= 0 (else a ValueError naming the argument); margin() is
    the innermost context's, 0 outside; restored after an exception too."""
    assert launch.margin() == 0
    for bad in (-1, 1.5, "8", None):
        with pytest.raises(ValueError, match="sm_margin: n must be an int >= 0"):
            with launch.sm_margin(bad):
                pass
    with launch.sm_margin(16):
        assert launch.margin() == 16
        with launch.sm_margin(0):
            assert launch.margin() == 0
        assert launch.margin() == 16
        with pytest.raises(KeyError):
            with launch.sm_margin(24):
                raise KeyError("inside")
        assert launch.margin() == 16
    assert launch.margin() == 0
