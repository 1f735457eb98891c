"""tecupy.save / tecupy.load: a resumed run is bit-identical to an uninterrupted one
(parameters, optimizer state, FP8 scales and histories, dropout generators, data position),
the file is a plain .npz with a JSON header, and a checkpoint that does not fit is a clear
error that loads nothing (issue 23)."""
import json
import os

import numpy as np
import pytest

import tecupy
from tecupy import data, serialization
from tecupy._array import xp_of
from tecupy.recipe import DelayedScaling, Format
from conftest import asnp

RECIPE = DelayedScaling(amax_history_len=4)


class SGD:
    """SGD with momentum, the duck-typed optimizer save/load take: a flat state_dict of
    arrays and python values; load_state_dict checks everything first (ValueError)."""

    def __init__(self, module, lr=0.05, momentum=0.9):
        self.params = module.named_parameters()
        self.lr, self.momentum, self.steps = lr, momentum, 0
        self.buf = {k: p.astype(np.float32) * 0 for k, p in self.params.items()}

    def step(self, grads):
        for k, g in grads.items():
            self.buf[k] = self.momentum * self.buf[k] + g.astype(np.float32)
            p = self.params[k]
            p[...] = (p.astype(np.float32) - self.lr * self.buf[k]).astype(p.dtype)
        self.steps += 1

    def state_dict(self):
        sd = {"buf." + k: asnp(b).copy() for k, b in self.buf.items()}
        return dict(sd, lr=self.lr, momentum=self.momentum, steps=self.steps, name="sgd")

    def load_state_dict(self, sd):
        want = self.state_dict()
        bad = sorted(set(want) ^ set(sd)) + [k for k in want if k.startswith("buf.") and k in sd
                                             and sd[k].shape != want[k].shape]
        if bad:
            raise ValueError(f"SGD.load_state_dict: keys {bad} do not fit")
        self.lr, self.momentum, self.steps = sd["lr"], sd["momentum"], sd["steps"]
        for k, b in self.buf.items():
            b[...] = xp_of(b).asarray(sd["buf." + k])


class MLPBlock(tecupy.nn.Module):
    """dropout(LayerNormMLP(x)) + x: FP8 and dropout without attention, whose GPU backward
    sums dQ with atomics (a whole layer's run is not bit-reproducible on the GPU)."""

    def __init__(self, params_dtype=None, device=None, seed=None):
        super().__init__(params_dtype, device, seed)
        self.mlp = tecupy.nn.LayerNormMLP(32, 64, **self._child_kwargs())

    def forward(self, x):
        return tecupy.dropout(self.mlp(x), 0.1, self.next_seed(), training=self.training,
                              residual=x)


def make(seed, dtype=None, device="cpu", kind="layer"):
    if kind == "mlp":
        return MLPBlock(dtype, device, seed)
    return tecupy.nn.TransformerLayer(32, 64, 2, hidden_dropout=0.1, attention_dropout=0.1,
                                      params_dtype=dtype, device=device, seed=seed)


def step(layer, opt, i, recipe, xp=np):
    """Training step `i` (its data depends only on i); returns the output as numpy."""
    rng = np.random.default_rng([7, i])
    x, dy = (xp.asarray(rng.standard_normal((8, 2, 32)).astype(layer.params_dtype))
             for _ in range(2))
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                    fp8_recipe=recipe):
        y = layer(x)
    opt.step(tape.gradient(y, layer, output_grad=dy))
    return asnp(y)


def assert_same(a, b):
    """Equal state dicts: arrays bit for bit (bfloat16 compared as its bits)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k].view(f"u{a[k].itemsize}"),
                                          b[k].view(f"u{b[k].itemsize}"), err_msg=k)
        else:
            assert a[k] == b[k], k


def resume_matches(tmp_path, recipe, dtype=None, device="cpu", make_opt=SGD, kind="layer"):
    """10 steps == 5 steps, save, load into a fresh module (other seed), 5 steps."""
    xp = np if device == "cpu" else __import__("cupy")
    ref = make(0, dtype, device, kind)
    ref_opt = make_opt(ref)
    outs = [step(ref, ref_opt, i, recipe, xp) for i in range(10)]
    first = make(0, dtype, device, kind)
    opt = make_opt(first)
    for i in range(5):
        step(first, opt, i, recipe, xp)
    tecupy.save(tmp_path / "ckpt.npz", first, opt, extra={"step": 5})
    fresh = make(123, dtype, device, kind)  # other weights, generators, no FP8 state yet
    fresh_opt = make_opt(fresh)
    extra = tecupy.load(tmp_path / "ckpt.npz", fresh, fresh_opt)
    assert extra == {"step": 5}
    for i in range(extra["step"], 10):
        np.testing.assert_array_equal(step(fresh, fresh_opt, i, recipe, xp), outs[i])
    assert_same(fresh.state_dict(), ref.state_dict())
    assert_same(fresh_opt.state_dict(), ref_opt.state_dict())
    return ref


@pytest.mark.parametrize("recipe", [RECIPE, None], ids=["fp8", "high precision"])
def test_resume_is_bit_identical(tmp_path, recipe):
    ref = resume_matches(tmp_path, recipe)
    if recipe is not None:  # real FP8 state went through the file
        assert asnp(ref.layernorm_mlp.fp8_state.bwd.amax_history).any()


def test_resume_bfloat16_parameters(tmp_path):
    ref = resume_matches(tmp_path, RECIPE, dtype=tecupy.bfloat16)
    assert ref.layernorm_mlp.fc1_weight.dtype == tecupy.bfloat16


def adamw(module):
    """tecupy.optim.AdamW with everything that has state: master weights and bf16 moments
    (bf16 parameters), clipping, weight decay and a warm-up + cosine schedule."""
    from tecupy import optim
    return optim.AdamW(module.named_parameters(), lr=1e-3, weight_decay=0.1,
                       moments_dtype=tecupy.bfloat16, max_grad_norm=1.0,
                       schedule=optim.WarmupCosine(1e-3, 3, 10, 1e-4))


def sgd(module):
    from tecupy import optim
    return optim.SGD(module.named_parameters(), lr=0.05, momentum=0.9, nesterov=True)


@pytest.mark.parametrize("make_opt", [adamw, sgd], ids=["AdamW", "SGD"])
def test_resume_tecupy_optim(tmp_path, make_opt):
    resume_matches(tmp_path, RECIPE, dtype=tecupy.bfloat16, make_opt=make_opt)


def test_resume_mlp_block(tmp_path):
    resume_matches(tmp_path, RECIPE, kind="mlp", make_opt=adamw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", [RECIPE, None], ids=["fp8", "high precision"])
def test_resume_is_bit_identical_gpu(tmp_path, recipe, dtype):
    resume_matches(tmp_path, recipe, dtype, device="cuda", kind="mlp", make_opt=adamw)


def test_data_position_resumes(tmp_path):
    """A Batches loader's state and the tokenizer go through `extra` (JSON)."""
    tok = data.CharTokenizer.from_text("to be or not to be, that is the question")
    tokens = tok.encode("to be or not to be, that is the question" * 20)
    a = data.Batches(tokens, 4, 16, seed=3)
    want = [next(a) for _ in range(6)]
    layer = tecupy.nn.LayerNormMLP(32, 64, device="cpu", seed=0)
    b = data.Batches(tokens, 4, 16, seed=3)
    [next(b) for _ in range(2)]
    tecupy.save(tmp_path / "c", layer, extra={"data": b.state_dict(), "vocab": tok.vocab})
    extra = tecupy.load(tmp_path / "c", layer)
    c = data.Batches(tokens, 4, 16, seed=3).load_state_dict(extra["data"])
    assert data.CharTokenizer(extra["vocab"]).vocab == tok.vocab
    for x, y in want[2:]:
        x2, y2 = next(c)
        np.testing.assert_array_equal(x2, x)
        np.testing.assert_array_equal(y2, y)


def trained(seed=0, recipe=RECIPE):
    layer = make(seed, tecupy.bfloat16)
    opt = SGD(layer)
    step(layer, opt, 0, recipe)
    return layer, opt


def read(path):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(arrays.pop("__tecupy__").tobytes()), arrays


def test_file_format_is_documented_npz(tmp_path):
    layer, opt = trained()
    tecupy.save(tmp_path / "c.ckpt", layer, opt, extra={"step": 1, "note": None})
    assert os.listdir(tmp_path) == ["c.ckpt"]  # used as given; no temporary file left
    header, arrays = read(tmp_path / "c.ckpt")
    assert header["format"] == "tecupy-checkpoint" and header["version"] == 1
    assert header["module_type"] == "TransformerLayer"
    assert header["extra"] == {"step": 1, "note": None}
    assert header["optimizer"] == {"lr": 0.05, "momentum": 0.9, "steps": 1, "name": "sgd"}
    sd = layer.state_dict()
    assert header["module"]["rng_state"] == sd["rng_state"]  # 128-bit ints stay exact
    w = "module/layernorm_mlp.fc1_weight"
    assert arrays[w].dtype == np.uint16 and header["views"][w] == "bfloat16"
    np.testing.assert_array_equal(arrays[w], sd["layernorm_mlp.fc1_weight"].view(np.uint16))
    f = "layernorm_mlp.fp8_state."
    assert header["module"][f + "fp8_format"] == "HYBRID"
    for d in ("fwd", "bwd"):
        for k in ("scale", "scale_inv", "amax_history"):
            np.testing.assert_array_equal(arrays[f"module/{f}{d}.{k}"], sd[f"{f}{d}.{k}"])
    assert "optimizer/buf.layernorm_mlp.fc1_weight" in arrays
    assert set(arrays) == {"module/" + k for k, v in sd.items() if isinstance(v, np.ndarray)} \
        | {"optimizer/" + k for k in opt.state_dict() if k.startswith("buf.")}


def rewrite(path, edit):
    """Edit a saved checkpoint's (header, arrays) in place, as a broken writer might."""
    header, arrays = read(path)
    edit(header, arrays)
    arrays["__tecupy__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


W, F = "layernorm_mlp.fc1_weight", "layernorm_mlp.fp8_state."
BAD = [
    ("missing", lambda h, a: a.pop("module/" + W), rf"key '{W}': got missing"),
    ("unexpected", lambda h, a: a.update({"module/extra.w": np.zeros(3)}),
     "key 'extra.w': got an unexpected key"),
    ("shape", lambda h, a: a.update({"module/" + W: a["module/" + W][:3]}),
     rf"key '{W}': got shape \(3, 32\), expected shape \(64, 32\)"),
    ("dtype", lambda h, a: h["views"].pop("module/" + W), "got dtype uint16, expected dtype "
     "bfloat16"),
    ("fp8 format", lambda h, a: h["module"].update({F + "fp8_format": "E4M3"}),
     rf"key '{F}fp8_format': got 'E4M3', expected 'HYBRID'"),
    ("history length", lambda h, a: h["module"].update({F + "amax_history_len": 8}),
     rf"key '{F}amax_history_len': got 8, expected 4"),
    ("rng", lambda h, a: h["module"].update({"rng_state": {"bit_generator": "MT19937"}}),
     "key 'rng_state'"),
    ("version", lambda h, a: h.update(version=2), "format version 2; this tecupy reads "
     "version 1"),
    ("no version", lambda h, a: h.pop("version"), "format version 'missing'"),
    ("format", lambda h, a: h.update(format="other"), "not a tecupy checkpoint .*'other'"),
    ("stray entry", lambda h, a: a.update(junk=np.zeros(1)), "unexpected entry 'junk'"),
    ("bad view", lambda h, a: h["views"].update({"module/" + W: "float8_e4m3fn"}),
     "view dtype 'float8_e4m3fn' does not fit"),
    ("optimizer", lambda h, a: a.pop("optimizer/buf." + W), "optimizer state does not fit "
     "SGD: .*buf.layernorm_mlp.fc1_weight"),
    ("no optimizer", lambda h, a: [h.update(optimizer=None)] + [
        a.pop(k) for k in list(a) if k.startswith("optimizer/")], "holds no optimizer state"),
]


@pytest.mark.parametrize("edit, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_checkpoint_that_does_not_fit_loads_nothing(tmp_path, edit, message):
    tecupy.save(tmp_path / "c", *trained(0))
    rewrite(tmp_path / "c", edit)
    layer, opt = trained(5)
    before, before_opt = layer.state_dict(), opt.state_dict()
    with pytest.raises(ValueError, match=message):
        tecupy.load(tmp_path / "c", layer, opt)
    assert_same(layer.state_dict(), before)
    assert_same(opt.state_dict(), before_opt)


def test_other_model_and_fp8_recipe_named(tmp_path):
    tecupy.save(tmp_path / "c", tecupy.nn.LayerNormMLP(32, 64, device="cpu", seed=0))
    with pytest.raises(ValueError, match="saved from a LayerNormMLP.* does not fit this "
                                         "TransformerLayer.*mismatch"):
        tecupy.load(tmp_path / "c", make(1))
    e4m3 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
    tecupy.save(tmp_path / "c", trained(0, e4m3)[0])
    with pytest.raises(ValueError, match="fp8_format': got 'E4M3', expected 'HYBRID'"):
        tecupy.load(tmp_path / "c", trained(1)[0])


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "text").write_text("hello")
    np.save(tmp_path / "a.npy", np.zeros(3))
    np.savez(tmp_path / "b.npz", x=np.zeros(3))
    tecupy.save(tmp_path / "c", *trained())
    (tmp_path / "cut").write_bytes((tmp_path / "c").read_bytes()[:2000])
    for name, why in [("text", "pickled"), ("a.npy", "single .npy"), ("b.npz", "no '__tecupy__'"),
                      ("cut", "BadZipFile|EOFError|OSError|ValueError")]:
        with pytest.raises(ValueError, match=f"not a tecupy checkpoint .*({why})"):
            tecupy.load(tmp_path / name, make(0))
    with pytest.raises(FileNotFoundError):
        tecupy.load(tmp_path / "nothing", make(0))


def test_save_refuses_what_it_cannot_store(tmp_path, monkeypatch):
    """Nothing is written (an old checkpoint stays) when a value cannot be stored or the
    write fails halfway; no temporary file is left."""
    layer = make(0)
    tecupy.save(tmp_path / "c", layer, extra={"step": 1})
    with pytest.raises(TypeError, match="extra cannot be stored as JSON"):
        tecupy.save(tmp_path / "c", layer, extra={"x": object()})
    with pytest.raises(TypeError, match="extra must be a dict with str keys"):
        tecupy.save(tmp_path / "c", layer, extra={1: 2})
    with pytest.raises(TypeError, match="optimizer must have state_dict"):
        tecupy.save(tmp_path / "c", layer, optimizer=object())

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(serialization.np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        tecupy.save(tmp_path / "c", layer, extra={"step": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["c"]
    assert tecupy.load(tmp_path / "c", layer) == {"step": 1}
    os.chmod(tmp_path / "c", 0o640)
    tecupy.save(tmp_path / "c", layer)  # replaces the file, keeps its mode
    assert os.stat(tmp_path / "c").st_mode & 0o777 == 0o640
    tecupy.save(tmp_path / "d", layer)  # a new file: the mode open() would give
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "d").st_mode & 0o777 == 0o666 & ~umask


def test_json_values_round_trip(tmp_path):
    """numpy scalars become numbers; arrays inside a value (MT19937's key) come back."""
    layer = tecupy.nn.Linear(8, 4, device="cpu", seed=0)
    layer.rng = np.random.Generator(np.random.MT19937(5))
    tecupy.save(tmp_path / "c", layer, extra={"step": np.int64(3), "lr": np.float32(0.5)})
    other = tecupy.nn.Linear(8, 4, device="cpu", seed=1)
    other.rng = np.random.Generator(np.random.MT19937(6))
    assert tecupy.load(tmp_path / "c", other) == {"step": 3, "lr": 0.5}
    assert other.rng.integers(0, 2**62) == layer.rng.integers(0, 2**62)
