"""tecupy.models.GPT and python -m tecupy.train: the tiny CPU model learns (bf16 and FP8 on
the reference), resuming from a checkpoint is bit-identical, the CSV is written, the CLI
runs and rejects bad arguments; GPU (marked gpu): a few steps in bf16 and FP8 on cuda, and
the --graph path against eager steps."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tecupy
from tecupy import train
from tecupy.models import GPT, GPTConfig

TECUPY_ROOT = Path(tecupy.__file__).resolve().parent.parent
TINY = ["--device", "cpu", "--quiet", "--layers", "1", "--hidden", "32", "--heads", "2",
        "--seq", "16", "--batch", "4", "--eval-batches", "1"]


def _run(argv):
    return train.Trainer(*train.parse(argv)).run()


def _checkpoint(path):
    """Every array of a checkpoint, and its header's module, optimizer and extra values."""
    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k].tobytes() for k in z.files if k != "__tecupy__"}
        header = json.loads(z["__tecupy__"].tobytes())
    out.update({s: json.dumps(header[s], sort_keys=True) for s in ("module", "optimizer",
                                                                    "extra")})
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tiny_model_learns(fp8):
    h = _run(["--device", "cpu", "--quiet", "--steps", "20"] + (["--fp8"] if fp8 else []))
    first, last = np.mean(h["train_loss"][:3]), np.mean(h["train_loss"][-3:])
    assert h["step"] == list(range(1, 21))
    assert last < first - 0.5, h["train_loss"]
    assert h["val_loss"][-1] < h["val_loss"][0] < np.log(65) + 0.2, h["val_loss"]


def test_resume_is_bit_identical(tmp_path):
    """10 steps == 5 steps, save, resume in a new Trainer, 5 steps: parameters, optimizer,
    FP8 and RNG state and the CSV, with FP8 and dropout (seeds from the modules' RNGs)."""
    common = TINY + ["--steps", "10", "--fp8", "--dropout", "0.1", "--eval-every", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    _run(common + ["--save", f"{a}.ckpt", "--csv", f"{a}.csv"])
    _run(common + ["--save", f"{b}.ckpt", "--csv", f"{b}.csv", "--stop-after", "5"])
    assert len(Path(f"{b}.csv").read_text().splitlines()) == 6
    _run(["--device", "cpu", "--quiet", "--resume", f"{b}.ckpt", "--save", f"{b}.ckpt",
          "--csv", f"{b}.csv"])
    want, got = _checkpoint(f"{a}.ckpt"), _checkpoint(f"{b}.ckpt")
    assert want.keys() == got.keys() and "module/layer0.layernorm_mlp.fp8_state.fwd.scale" in want
    for k in want:
        assert want[k] == got[k], k
    assert Path(f"{a}.csv").read_text() == Path(f"{b}.csv").read_text()


def test_csv_is_written(tmp_path):
    path = tmp_path / "loss.csv"
    _run(TINY + ["--steps", "6", "--eval-every", "3", "--log-every", "4", "--csv", str(path)])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert all(np.isfinite(float(r["train_loss"])) and float(r["lr"]) > 0 for r in rows)
    assert [r["step"] for r in rows if r["val_loss"]] == ["3", "6"]


def test_cli_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TECUPY_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                              if p]))
    out = subprocess.run([sys.executable, "-m", "tecupy.train", "--steps", "3", "--device",
                          "cpu", "--csv", "loss.csv"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "step 3: train loss" in out.stdout and "tokens/s" in out.stdout
    assert (tmp_path / "loss.csv").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--hidden", "30", "--heads", "4"], "multiple of --heads"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--save-every", "2"], "--save-every needs --save"),
    (["--stop-after", "50", "--steps", "10"], "--stop-after must be in"),
    (["--graph"], "--graph needs a GPU"),
    (["--fp8", "--hidden", "40", "--heads", "2"], "FP8 GEMMs' shape rule"),
    (["--resume", "/nonexistent.ckpt"], "no such file"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.parse(["--device", "cpu"] + argv)
    assert message in capsys.readouterr().err


def test_resume_refuses_another_model(tmp_path, capsys):
    path = tmp_path / "r.ckpt"
    _run(TINY + ["--steps", "2", "--save", str(path), "--weight-decay", "0.05"])
    with pytest.raises(SystemExit):
        train.parse(["--device", "cpu", "--resume", str(path), "--layers", "3"])
    assert "leave the option out" in capsys.readouterr().err
    args, saved = train.parse(["--device", "cpu", "--resume", str(path), "--steps", "2"])
    assert (args.weight_decay, args.layers, saved["step"]) == (0.05, 1, 2)


def test_gpt_shapes_and_errors():
    cfg = GPTConfig(vocab_size=11, num_layers=1, hidden_size=16, num_heads=2, seq_len=8)
    model = GPT(cfg, device="cpu", seed=0)
    ids = np.zeros((3, 8), np.int32)
    assert model(ids).shape == (8, 3, 11)  # sbhd logits
    assert model(ids, ids).shape == ()
    assert "embedding.weight" in model.named_parameters()
    with pytest.raises(ValueError, match="seq <= 8"):
        model(np.zeros((3, 9), np.int32))
    with pytest.raises(ValueError, match="hidden_size"):
        GPTConfig(hidden_size=30, num_heads=4)


def test_graph_falls_back_to_eager(monkeypatch, capsys):
    """A step the capture refuses: the warm-up step counts, the next steps run eagerly, and
    the message says so; a failing warm-up step is an error of its own."""
    calls = []

    def refuse(fn, sample_args):
        fn(*sample_args)
        raise RuntimeError("make_graphed_step: the step could not be captured")
    monkeypatch.setattr(tecupy, "make_graphed_step", refuse)
    stepper = train.Stepper(lambda x, y: calls.append(int(x)) or np.float32(len(calls)), True)
    a = [np.array(v) for v in range(4)]
    assert [stepper(a[1], a[2]), stepper(a[3], a[0])] == [1, 2] and calls == [1, 3]
    assert "could not be captured in a CUDA graph, continuing with eager" in \
        capsys.readouterr().err

    def broken(x, y):
        raise ValueError("a bug in the step")
    with pytest.raises(ValueError, match="a bug"):
        train.Stepper(broken, True)(a[1], a[2])


# ---- GPU ---------------------------------------------------------------------------------
# 2 heads: head dim 64, one the CUDA attention kernels take (32 ran the reference's cuBLAS
# matmul, which a CUDA graph capture refuses: --graph then fell back to eager steps)
GPU_SMALL = ["--device", "cuda", "--quiet", "--layers", "2", "--hidden", "128", "--heads",
             "2", "--seq", "64", "--batch", "8", "--eval-batches", "2", "--eval-every", "10"]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_steps(fp8):
    h = _run(GPU_SMALL + ["--steps", "20"] + (["--fp8"] if fp8 else []))
    assert all(np.isfinite(h["train_loss"]))
    assert np.mean(h["train_loss"][-3:]) < np.mean(h["train_loss"][:3]) - 0.3
    assert h["tokens_per_s"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_graph_equals_eager(fp8, capsys):
    """--graph against eager steps: the step was captured (not the eager fallback, which
    prints why to stderr), and the loss curves agree to bf16 rounding (attention's dQ sums
    with atomics, so a GPU step is not bit-reproducible even eagerly)."""
    argv = GPU_SMALL + ["--steps", "12"] + (["--fp8"] if fp8 else [])
    eager = _run(argv)
    trainer = train.Trainer(*train.parse(argv + ["--graph"]))
    graphed = trainer.run()
    assert trainer.step.graph is not None, capsys.readouterr().err
    np.testing.assert_allclose(graphed["train_loss"], eager["train_loss"], rtol=2e-2)
    np.testing.assert_allclose(graphed["val_loss"], eager["val_loss"], rtol=2e-2)


# ---- the PyTorch twin (tecupy/bench/train.py) --------------------------------------------
BENCH_TINY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq",
              "16", "--batch", "4", "--log-every", "2"]


def test_bench_train_runs_on_the_reference(capsys):
    from tecupy.bench import train as bench_train
    bench_train.main(BENCH_TINY + ["--steps", "4", "--no-fp8"])
    out = capsys.readouterr().out
    assert "tecupy bf16" in out and "final val loss" in out


def test_torch_twin_is_the_same_model():
    """The twin computes tecupy's loss from tecupy's weights (trained ones: at the initial
    weights every loss is near log(vocab) and a mapping mistake would not show)."""
    pytest.importorskip("torch")
    from tecupy.bench import train as bench_train
    args = bench_train.parse(BENCH_TINY + ["--steps", "10", "--lr", "1e-2"])
    _, model = bench_train.tecupy_run(args, False)
    ours, theirs = bench_train.twin_check(args, model)
    assert abs(ours - theirs) < 2e-3 * ours, (ours, theirs)
