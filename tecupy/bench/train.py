"""python -m tecupy.bench train: tecupy's GPT (python -m tecupy.train) beside its PyTorch twin.

The twin is the same model in PyTorch (F.embedding, F.layer_norm, F.linear, RoPE as TE's
non-interleaved form, F.scaled_dot_product_attention causal, tanh GELU, the LM head tied to
the embedding), started from tecupy's initial weights (copied), fed the same batches
(tecupy.data.Batches, same seed) with the same hyperparameters: torch.optim.AdamW (fused),
clip_grad_norm_, the same warm-up + cosine lr. PyTorch trains in its usual bf16 recipe: fp32
parameters and optimizer, the step under torch.autocast(bfloat16) (tecupy: bf16 parameters
with fp32 master weights in the optimizer).

Trains tecupy bf16, tecupy FP8 (delayed scaling, HYBRID) and PyTorch bf16 eager one after the
other for --steps each and prints each one's final validation loss (the same fixed validation
batches), the ratios the issue's targets name, and tokens/s (training steps only; the first
--log-every steps, compilation, are left out). For throughput where GEMMs dominate, use a wide
model: --hidden 2048 --heads 16 --steps 100. PyTorch is imported here only; without it the
PyTorch row is skipped with a message.
"""
import argparse
import time

import numpy as np

from .timing import gpu_name

ARGS = ("steps", "layers", "hidden", "heads", "seq", "batch", "lr", "seed", "log_every",
        "dropout")


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m tecupy.bench train",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.2,
                   help="hidden and attention dropout (the twin draws its own masks)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of the bench itself on the NumPy reference")
    p.add_argument("--no-fp8", action="store_true", help="skip the tecupy FP8 run")
    return p.parse_args(argv)


def train_argv(args, fp8):
    """python -m tecupy.train's arguments for this bench's run."""
    argv = ["--device", args.device, "--quiet", "--eval-every", str(args.steps)]
    for name in ARGS:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + (["--fp8"] if fp8 else [])


def tecupy_run(args, fp8):
    """(history, trained model) of a python -m tecupy.train run."""
    from tecupy import train
    trainer = train.Trainer(*train.parse(train_argv(args, fp8)))
    return trainer.run(), trainer.model


def _free_cupy(device):
    if device == "cuda":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


# ---- the PyTorch twin --------------------------------------------------------------------
def torch_twin(model, device):
    """A torch.nn.Module computing tecupy GPT `model`'s loss with fp32 copies of its
    current weights (kept under tecupy's parameter names, dots as '__')."""
    import torch
    import torch.nn.functional as F
    from .._array import to_numpy
    c = model.config
    heads, d, hidden = c.num_heads, c.hidden_size // c.num_heads, c.hidden_size
    freqs = torch.tensor(np.asarray(to_numpy(model.freqs(c.seq_len)))[:, 0, 0], device=device)

    def rope(t, cos, sin):  # t [s, b, h, d]: t cos + rotate_half(t) sin, rotate_half = [-t2, t1]
        t1, t2 = t.float().chunk(2, dim=-1)
        return (t.float() * cos + torch.cat([-t2, t1], dim=-1) * sin).to(t.dtype)

    p = c.dropout

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({
                k.replace(".", "__"): torch.nn.Parameter(torch.tensor(
                    np.asarray(to_numpy(v), np.float32), device=device))
                for k, v in model.named_parameters().items()})

        def w(self, name):
            return self.p[name.replace(".", "__")]

        def ln(self, x, prefix, norm="layer_norm_"):  # TE's names: <prefix>layer_norm_weight
            return F.layer_norm(x, (hidden,), self.w(prefix + norm + "weight"),
                                self.w(prefix + norm + "bias"), 1e-5)

        def attention(self, x, a, cos, sin):
            s, b, _ = x.shape
            qkv = F.linear(self.ln(x, a + "layernorm_qkv."),
                           self.w(a + "layernorm_qkv.weight"), self.w(a + "layernorm_qkv.bias"))
            q, k, v = qkv.view(s, b, 3 * heads, d).split([heads, heads, heads], dim=2)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (rope(q, cos, sin), rope(k, cos, sin), v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,  # [b, h, s, d]
                                               dropout_p=p if self.training else 0.0)
            o = o.permute(2, 0, 1, 3).reshape(s, b, hidden)
            return F.dropout(F.linear(o, self.w(a + "proj.weight"), self.w(a + "proj.bias")),
                             p, self.training)  # TE's hidden dropout, before the residual

        def mlp(self, h, m):
            u = F.linear(self.ln(h, m), self.w(m + "fc1_weight"),
                         self.w(m + "fc1_bias"))
            return F.dropout(F.linear(F.gelu(u, approximate="tanh"), self.w(m + "fc2_weight"),
                                      self.w(m + "fc2_bias")), p, self.training)

        def forward(self, ids, targets):  # ids, targets [b, s]: sbhd inside, as tecupy's
            s = ids.shape[1]
            cos, sin = (f(freqs[:s])[:, None, None, :] for f in (torch.cos, torch.sin))
            h = F.embedding(ids.T.long(), self.w("embedding.weight"))
            for i in range(c.num_layers):
                h = h + self.attention(h, f"layer{i}.self_attention.", cos, sin)
                h = h + self.mlp(h, f"layer{i}.layernorm_mlp.")
            logits = F.linear(self.ln(h, "final_norm.", ""), self.w("embedding.weight"))
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   targets.T.reshape(-1).long())
    return GPT()


def _torch_ids(a, device):
    import torch
    from .._array import to_numpy
    if device == "cuda":
        return torch.from_dlpack(a)  # no copy: the cupy batch as a torch tensor
    return torch.from_numpy(np.asarray(to_numpy(a)))


def torch_run(args, tecupy_init):
    """(history, tokens/s) of the PyTorch twin trained as tecupy.train trains."""
    import torch
    from tecupy import train
    from tecupy.optim import warmup_cosine
    targs, _ = train.parse(train_argv(args, False))
    _, batches, val = train.data(targs, train.device_xp(args.device))
    net = torch_twin(tecupy_init, args.device)
    opt = torch.optim.AdamW(net.parameters(), lr=targs.lr, betas=(0.9, 0.95),
                            weight_decay=targs.weight_decay, fused=args.device == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: warmup_cosine(
        k, targs.lr, targs.warmup, targs.steps, targs.min_lr) / targs.lr)
    dev = "cuda" if args.device == "cuda" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def step(x, y):
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = net(_torch_ids(x, dev), _torch_ids(y, dev))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), targs.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    losses, t_total, t0 = [], 0.0, None
    for k in range(targs.steps):
        if k == args.log_every:  # the first steps (warm-up, autotuning) are not timed
            sync()
            t0 = time.perf_counter()
        losses.append(step(*next(batches)))
    sync()
    if t0 is not None:
        t_total = time.perf_counter() - t0
    timed = targs.steps - args.log_every
    net.eval()  # (no dropout), as tecupy's validation
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
        v = float(sum(float(net(_torch_ids(x, dev), _torch_ids(y, dev))) for x, y in val)
                  / len(val))
    return {"train_loss": [float(v) for v in losses], "val_loss": [v],
            "tokens_per_s": timed * targs.batch * targs.seq / t_total if t_total else np.nan}


def initial_model(args):
    """A fresh tecupy GPT as the runs start from (same seed: the same weights)."""
    from tecupy import train
    targs, _ = train.parse(train_argv(args, False))
    tok, _, _ = train.data(targs, train.device_xp(args.device))
    return train.build(targs, tok.vocab_size)[0]


def twin_check(args, model):
    """(tecupy's val loss, the twin's) of `model`'s weights on the validation batches: the
    twin is the same model when they agree to bf16 rounding (a trained model, so that a
    mapping mistake shows; at the initial weights every loss is near log(vocab))."""
    import torch
    from tecupy import train
    targs, _ = train.parse(train_argv(args, False))
    _, _, val = train.data(targs, train.device_xp(args.device))
    twin = torch_twin(model, args.device).eval()
    with torch.no_grad():
        theirs = np.mean([float(twin(_torch_ids(x, args.device), _torch_ids(y, args.device)))
                          for x, y in val])
    model.eval()
    ours = np.mean([float(model(x, y)) for x, y in val])
    model.train()
    return ours, theirs


def run(args):
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    name = gpu_name() if args.device == "cuda" else "CPU (NumPy reference)"
    print(f"{name}: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch}, {args.steps} steps, lr {args.lr}, seed {args.seed}")
    rows, models = {}, {}
    for name, fp8 in (("tecupy bf16", False), ("tecupy FP8", True)):
        if not (fp8 and args.no_fp8):
            rows[name], models[name] = tecupy_run(args, fp8)
    if torch is None:
        print("PyTorch is not importable: no PyTorch twin (pip install torch to compare)")
    else:
        ours, theirs = twin_check(args, models["tecupy bf16"])
        print(f"tecupy's trained bf16 weights, val loss: tecupy {ours:.4f}, PyTorch twin "
              f"{theirs:.4f} (the same model: they agree to bf16 rounding)")
        models.clear()
        _free_cupy(args.device)
        rows["PyTorch bf16 eager"] = torch_run(args, initial_model(args))
    report(rows)


def report(rows):
    ref = rows.get("PyTorch bf16 eager")
    print(f"  {'':22s}{'final val loss':>15s}{'tokens/s':>12s}{'/ PyTorch':>11s}")
    for name, h in rows.items():
        ratio = f"{h['tokens_per_s'] / ref['tokens_per_s']:11.2f}" if ref else f"{'-':>11s}"
        print(f"  {name:22s}{h['val_loss'][-1]:15.4f}{h['tokens_per_s']:12,.0f}{ratio}")
    bf16 = rows["tecupy bf16"]["val_loss"][-1]
    if "tecupy FP8" in rows:
        fp8 = rows["tecupy FP8"]["val_loss"][-1]
        print(f"  FP8 / bf16 val loss: {fp8 / bf16:.4f} ({(fp8 / bf16 - 1) * 100:+.2f}%; "
              "target: within 0.5% after >= 2000 steps)")
    if ref:
        print(f"  tecupy bf16 / PyTorch bf16 val loss: {bf16 / ref['val_loss'][-1]:.4f} "
              "(target: within 1%)")


def main(argv=None):
    args = parse(argv)
    if args.device == "cuda":
        import tecupy
        if not tecupy.gpu_available():
            raise SystemExit("tecupy.bench train needs a CUDA device (CuPy sees none); "
                             "--device cpu runs a smoke test on the NumPy reference")
    run(args)


if __name__ == "__main__":
    main()
