"""python -m tecupy.train: train a small GPT (tecupy.models.GPT) on tiny Shakespeare,
character-level, in bf16 or FP8 (--fp8: Transformer Engine's delayed scaling, HYBRID).

AdamW (fused on the GPU, FP32 master weights) with warm-up + cosine lr and gradient clipping;
a progress bar with the loss and tokens/s; the validation loss on fixed validation batches
every --eval-every steps; the loss curve as a CSV (--csv); checkpoints (--save, every
--save-every steps and at the end) that --resume continues bit for bit (the data loader's
position and the step are in the checkpoint's extra). On a GPU the defaults are a 6-layer,
384-wide model, seq 256, batch 32, 2000 steps; without one, a tiny model for 20 steps on the
NumPy reference (seconds). --graph replays each step (forward, backward, optimizer) as one
CUDA graph.
"""
import argparse
import csv
import json
import os
import sys
import time

import numpy as np

import tecupy
from tecupy._array import to_numpy
from tecupy._progress import Progress
from tecupy.data import Batches, CharTokenizer, load_text, train_val_split
from tecupy.models import GPT, GPTConfig
from tecupy.recipe import DelayedScaling, Format

# per device: layers, hidden, heads, seq, batch, steps, lr, eval_every, eval_batches,
# dropout (on the GPU nanoGPT's shakespeare-char value: without it the 6-layer model
# overfits by step 2000, train loss 0.7 against validation 1.9 on an H100, where the
# validation loss is noise: two seeds 3.5% apart)
DEFAULTS = {
    "cuda": dict(layers=6, hidden=384, heads=6, seq=256, batch=32, steps=2000, lr=1e-3,
                 eval_every=100, eval_batches=20, dropout=0.2),
    "cpu": dict(layers=2, hidden=64, heads=4, seq=32, batch=4, steps=20, lr=1e-2,
                eval_every=10, eval_batches=2, dropout=0.0),
}
MODEL_ARGS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_heads",
              "seq": "seq_len", "dropout": "dropout"}
COMMON = dict(weight_decay=0.1, grad_clip=1.0, amax_history=1024, seed=0)
CSV_FIELDS = ("step", "train_loss", "val_loss", "lr")


def parser():
    p = argparse.ArgumentParser(prog="python -m tecupy.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="per-device defaults:\n" + "\n".join(
                                    f"  {d}: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                           for k, v in kw.items())
                                    for d, kw in DEFAULTS.items()))
    a = p.add_argument
    a("--device", choices=("auto", "cuda", "cpu"), default="auto",
      help="auto (default): cuda when CuPy sees a usable GPU, else the NumPy reference")
    for name, what in (("steps", "optimizer steps in all (the lr schedule's length)"),
                       ("batch", "sequences per step"), ("seq", "tokens per sequence"),
                       ("layers", "TransformerLayers"), ("hidden", "hidden size"),
                       ("heads", "attention heads"),
                       ("eval-every", "steps between validation losses"),
                       ("eval-batches", "fixed validation batches per validation loss")):
        a(f"--{name}", type=int, default=None, help=f"{what} (default: per device)")
    a("--lr", type=float, default=None, help="peak lr (default: 1e-3 GPU, 1e-2 CPU)")
    a("--min-lr", type=float, default=None, help="final lr of the cosine (default: lr / 10)")
    a("--warmup", type=int, default=None, help="warm-up steps (default: min(100, steps/10))")
    a("--weight-decay", type=float, default=None, help="AdamW's (default 0.1)")
    a("--grad-clip", type=float, default=None, help="max global gradient norm (0: off; "
      "default 1)")
    a("--dropout", type=float, default=None,
      help="hidden and attention dropout (default: per device)")
    a("--fp8", action="store_true", default=None,
      help="FP8 delayed scaling (HYBRID) around the model's forward")
    a("--amax-history", type=int, default=None,
      help="DelayedScaling's amax_history_len (default 1024, TE's)")
    a("--seed", type=int, default=None, help="init and data order (default 0)")
    a("--csv", help="write the loss curve here (step, train_loss, val_loss, lr)")
    a("--save", help="checkpoint path, written every --save-every steps and at the end")
    a("--save-every", type=int, default=None, help="default: only at the end")
    a("--resume", help="continue the run saved in this checkpoint, bit for bit")
    a("--stop-after", type=int, default=None,
      help="stop after this step (the schedule still spans --steps; resume later)")
    a("--log-every", type=int, default=10, help="steps between loss read-backs (default 10)")
    a("--graph", action="store_true", help="replay each step as one CUDA graph (GPU only)")
    a("--quiet", action="store_true", help="no progress bar")
    return p


def parse(argv=None):
    """The arguments, with device defaults filled in and every value checked."""
    p = parser()
    args = p.parse_args(argv)
    from tecupy.__main__ import pick_device
    args.device = pick_device(args.device)
    if args.graph and args.device != "cuda":
        p.error("--graph needs a GPU (CUDA graphs); drop it to run on the CPU")
    saved = _resume_extra(p, args.resume) if args.resume else None
    _fill_defaults(p, args, saved)
    _check_args(p, args)
    return args, saved


def _resume_extra(p, path):
    """The `extra` of checkpoint `path`, read from its JSON header (serialization.py's
    format) before any model exists: the model is built from the saved config."""
    if not os.path.isfile(path):
        p.error(f"--resume {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            extra = json.loads(z["__tecupy__"].tobytes().decode("utf-8"))["extra"]
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--resume {path}: not a tecupy checkpoint ({type(e).__name__}: {e})")
    if not {"step", "data", "config", "fp8", "args"} <= set(extra):
        p.error(f"--resume {path}: not a checkpoint of python -m tecupy.train (its extra has "
                f"{sorted(extra)})")
    return extra


def _fill_defaults(p, args, saved):
    """Device defaults; on --resume the saved run's settings, where a value given on the
    command line must agree with them (another model or data order cannot continue)."""
    if saved is not None:
        run = dict(saved["args"], fp8=saved["fp8"])
        for name, value in run.items():
            given = getattr(args, name, None)
            if given is not None and given != value:
                p.error(f"--{name.replace('_', '-')} {given}: the run in {args.resume} used "
                        f"{value}; leave the option out to continue it")
            setattr(args, name, value)
    for name, value in dict(DEFAULTS[args.device], **COMMON).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.fp8 = bool(args.fp8)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if args.warmup is None:
        args.warmup = min(100, args.steps // 10)


def _check_args(p, args):
    for name in ("steps", "batch", "seq", "layers", "hidden", "heads", "eval_every",
                 "eval_batches", "log_every", "amax_history"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("save_every", "stop_after"):
        v = getattr(args, name)
        if v is not None and not 1 <= v <= args.steps:
            p.error(f"--{name.replace('_', '-')} must be in [1, --steps={args.steps}], got {v}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps={args.steps}), got {args.warmup}")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads} with an "
                "even head size (RoPE)")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        p.error(f"--lr must be > 0 and --min-lr in [0, lr], got {args.lr}, {args.min_lr}")
    if args.weight_decay < 0 or args.grad_clip < 0 or not 0 <= args.dropout < 1:
        p.error("--weight-decay and --grad-clip must be >= 0, --dropout in [0, 1)")
    if args.save_every is not None and not args.save:
        p.error("--save-every needs --save PATH")
    if args.fp8 and ((args.batch * args.seq) % 8 or args.hidden % 16):
        p.error(f"--fp8: batch * seq ({args.batch * args.seq}) must be a multiple of 8 and "
                f"--hidden ({args.hidden}) of 16 (FP8 GEMMs' shape rule)")


# ---- the run's objects -------------------------------------------------------------------
def saved_args(args):
    """What a resume must reuse: the model, the data order and the optimizer's settings."""
    keys = ("steps", "batch", "seq", "layers", "hidden", "heads", "lr", "min_lr", "warmup",
            "weight_decay", "grad_clip", "dropout", "seed", "amax_history", "eval_every",
            "eval_batches")
    return {k: getattr(args, k) for k in keys}


def build(args, vocab_size):
    """(model, optimizer, recipe) for the run."""
    dtype = tecupy.bfloat16
    cfg = GPTConfig(vocab_size=vocab_size, params_dtype=dtype,
                    **{MODEL_ARGS[k]: getattr(args, k) for k in MODEL_ARGS})
    model = GPT(cfg, device=args.device, seed=args.seed)
    schedule = tecupy.optim.WarmupCosine(args.lr, args.warmup, args.steps, args.min_lr)
    opt = tecupy.optim.AdamW(model.named_parameters(), lr=args.lr, betas=(0.9, 0.95),
                             weight_decay=args.weight_decay,
                             max_grad_norm=args.grad_clip or None, schedule=schedule)
    recipe = None
    if args.fp8:
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=args.amax_history,
                                amax_compute_algo="max")
    return model, opt, recipe


def data(args, xp):
    """(tokenizer, training Batches, the fixed validation batches)."""
    text = load_text()
    tok = CharTokenizer.from_text(text)
    train, val = train_val_split(tok.encode(text))
    batches = Batches(train, args.batch, args.seq, seed=args.seed, xp=xp)
    val_batches = Batches(val, args.batch, args.seq, seed=args.seed + 1, xp=xp)
    return tok, batches, [val_batches.batch_at(i) for i in range(args.eval_batches)]


def make_step(model, opt, recipe):
    """One training step: forward under fp8_autocast, backward, AdamW; -> the loss (a
    device array: reading it is left to the caller, every --log-every steps)."""
    def step(x, y):
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                loss = model(x, y)
        opt.step(tape.gradient(loss, model))
        return loss
    return step


def val_loss(model, batches, recipe):
    """Mean loss over the fixed validation batches, in eval mode (no dropout), under the
    same autocast as training (it is the FP8 model's loss); no tape: the forward FP8 scales
    do not update (TE: forward meta updates only with gradients)."""
    model.eval()
    with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        losses = [model(x, y) for x, y in batches]
    model.train()
    return float(sum(float(v) for v in losses) / len(losses))


class Stepper:
    """Runs the step eagerly, or with --graph as a replayed CUDA graph: the first call is
    make_graphed_step's warm-up (a real step) and captures; a step that cannot be captured
    falls back to eager steps with a message."""

    def __init__(self, fn, graph):
        self.fn, self.want_graph, self.graph = fn, graph, None

    def __call__(self, x, y):
        if self.graph is not None:
            return self.graph(x, y).copy()  # (the graph's output is overwritten next replay)
        if self.want_graph:
            return self._capture(x, y)
        return self.fn(x, y)

    def _capture(self, x, y):
        self.want_graph = False
        done = []

        def fn(x, y):
            done.append(self.fn(x, y))
            return done[-1]
        try:
            self.graph = tecupy.make_graphed_step(fn, (x.copy(), y.copy()))
        except Exception as e:  # noqa: BLE001 (any refusal: the run goes on eagerly)
            if not done:  # the warm-up step itself failed: not a capture problem
                raise
            print(f"--graph: the step could not be captured in a CUDA graph, continuing with "
                  f"eager steps (no longer bit-identical to a run without --graph): "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
        return done[0]  # the warm-up's loss: the capture records the step, it runs nothing


class CsvLog:
    """The loss curve as CSV rows (CSV_FIELDS). On resume the rows up to the checkpoint's
    step are kept and the rest dropped, so the file matches an uninterrupted run's."""

    def __init__(self, path, start):
        self.file = None
        if path is None:
            return
        kept = []
        if start and os.path.exists(path):
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
        self.file = open(path, "w", newline="")
        self.writer = csv.DictWriter(self.file, CSV_FIELDS)
        self.writer.writeheader()
        self.write(kept)

    def write(self, rows):
        if self.file is not None:
            self.writer.writerows(rows)
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()


class TrainProgress(Progress):
    """The progress bar with the last loss and tokens/s after it."""
    status = ""

    def line(self):
        return super().line() + self.status


class Trainer:
    def __init__(self, args, saved=None):
        self.args = args
        self.tok, self.batches, self.val = data(args, device_xp(args.device))
        self.model, self.opt, self.recipe = build(args, self.tok.vocab_size)
        self.start = 0
        if saved is not None:
            tecupy.load(args.resume, self.model, self.opt)
            self.batches.load_state_dict(saved["data"])
            self.start = saved["step"]
        self.stop = args.stop_after or args.steps
        self.step = Stepper(make_step(self.model, self.opt, self.recipe), args.graph)
        self.history = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
        self.pending, self.tokens, self.rate = [], 0, (0, 0.0)

    def run(self):
        """Train from self.start to self.stop; -> self.history (+ tokens_per_s)."""
        a = self.args
        self.log = CsvLog(a.csv, self.start)
        self.mark = time.perf_counter()
        try:
            with TrainProgress(self.stop - self.start, "steps", show=not a.quiet) as bar:
                for step in range(self.start + 1, self.stop + 1):
                    x, y = next(self.batches)
                    self.pending.append((step, self.step(x, y)))
                    self.tokens += a.batch * a.seq
                    self._after(step, bar)
                    bar.advance()
        finally:
            self.log.close()
        tokens, seconds = self.rate
        self.history["tokens_per_s"] = tokens / seconds if seconds else float("nan")
        return self.history

    def _after(self, step, bar):
        """Read the losses back, validate and save when due (host syncs only here)."""
        a = self.args
        last = step == self.stop
        # not at --stop-after: validation is part of the run (it draws dropout seeds, its
        # FP8 amaxes reach the next scale update), so it runs where an uninterrupted run's does
        evaluate = step % a.eval_every == 0 or step == a.steps
        save = a.save and (last or (a.save_every and step % a.save_every == 0))
        if not (evaluate or save or step % a.log_every == 0):
            return
        # one read-back (one sync) for the losses since the last one
        losses = to_numpy(self.model.xp.stack([v for _, v in self.pending])).tolist()
        rate = self._measure()
        rows = [{"step": s, "train_loss": f"{v:.6f}", "val_loss": "",
                 "lr": f"{self.opt.schedule(s - 1):.6g}"} for (s, _), v in zip(self.pending,
                                                                              losses)]
        self.history["step"] += [s for s, _ in self.pending]
        self.history["train_loss"] += losses
        self.pending = []
        status = f", loss {losses[-1]:.4f}, {rate:,.0f} tok/s"
        if evaluate:
            v = val_loss(self.model, self.val, self.recipe)
            rows[-1]["val_loss"] = f"{v:.6f}"
            self.history["val_step"].append(step)
            self.history["val_loss"].append(v)
            status += f", val {v:.4f}"
        self.log.write(rows)
        bar.status = status
        if save:
            self.save(step)
        self.mark = time.perf_counter()  # validation and saving are not training time

    def _measure(self):
        """Tokens/s since the last mark (the read-back synchronised); the run's rate leaves
        out the first interval (kernel compilation, graph capture)."""
        seconds = time.perf_counter() - self.mark
        rate = self.tokens / seconds if seconds > 0 else float("nan")
        if self.history["step"]:
            t, s = self.rate
            self.rate = (t + self.tokens, s + seconds)
        self.tokens = 0
        return rate

    def save(self, step):
        a = self.args
        extra = {"step": step, "data": self.batches.state_dict(), "fp8": a.fp8,
                 "config": self.model.config.to_dict(), "vocab": self.tok.vocab,
                 "args": saved_args(a)}
        tecupy.save(a.save, self.model, self.opt, extra=extra)


def device_xp(device):
    if device == "cuda":
        import cupy
        return cupy
    return np


def describe(args, model):
    c = model.config
    mode = "FP8 delayed scaling (HYBRID)" if args.fp8 else "bf16"
    return (f"tecupy.train: GPT {c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} "
            f"heads, seq {c.seq_len}, vocab {c.vocab_size}, {model.num_parameters():,} "
            f"parameters; batch {args.batch}, {args.steps} steps, {mode} on {args.device}"
            + (", CUDA graph" if args.graph else ""))


def main(argv=None):
    args, saved = parse(argv)
    trainer = Trainer(args, saved)
    print(describe(args, trainer.model))
    if saved is not None:
        print(f"resumed from {args.resume} at step {trainer.start}")
    if trainer.start >= trainer.stop:
        print(f"nothing to do: the run is at step {trainer.start} of {trainer.stop}")
        return
    h = trainer.run()
    val = f", val loss {h['val_loss'][-1]:.4f}" if h["val_loss"] else ""
    rate = h["tokens_per_s"]  # NaN when every step was an untimed warm-up one
    rate = "tokens/s not timed (too few steps)" if rate != rate else f"{rate:,.0f} tokens/s"
    print(f"step {h['step'][-1]}: train loss {h['train_loss'][-1]:.4f}{val}, {rate}")
    for what, path in (("loss curve", args.csv), ("checkpoint", args.save)):
        if path:
            print(f"{what}: {path}")


if __name__ == "__main__":
    sys.exit(main())
