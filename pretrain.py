"""pretrain.py -- self-pretraining (SPT): masked reconstruction on the task's own training split.

The story (Amos et al. ICLR 2024; Coser et al. Sec. 2). Each real position is masked independently with the
task's ratio (MASK_RATIO). Masked tokens become <mask>. Masked values and pixels become 0, and an extra input
channel says "masked". A linear head reconstructs every position; the loss counts the masked ones only
(cross-entropy for tokens, MSE for values), divided by their number. No external data is used. finetune.py then
starts from the checkpoint with the best validation masked loss.

    python pretrain.py --task listops                  # CPU: 2 x 64 model, 450 steps, ~3 min on 2 cores
    python pretrain.py --task listops --preset paper   # GPU: the paper's model (6 x 512, 8 heads), 100 epochs
    python pretrain.py --task synthetic --snapshots    # the minimal model on trajectories, ~10 s on CPU
    torchrun --standalone --nproc_per_node=8 pretrain.py --task text   # several GPUs (DDP)

Reads data/<task>/{train,val}.pt (made by data.py; here if missing). Writes out/<task>/pretrain.pt (best),
pretrain_last.pt (for --resume), pretrain_init.pt (the weights at step 0) and pretrain_log.jsonl.
Expect on ListOps' CPU preset: validation masked loss ~2.95 -> 2.64, the entropy of the token frequencies. Only
attention to neighbours (the proximity bias) goes below it, and that takes longer than the CPU budget. To see SPT
work on a CPU, run `python ablate.py demo`.

Reading order: PRESETS, the SPT objective (mask_batch, reconstruction_loss, spt_loss_fn), main. Below the double
line is the engine both stages share: flags, the training loop `train`, device, DDP, a run's files (checkpoints,
lock, resume) and the command line.
"""
import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import data
from data import NON_NEGATIVE, POSITIVE, POSITIVE_FLOAT, number_at_least
from model import INIT_SCHEMES, POOLINGS, POSITIONS, ModelConfig, Transformer, checkpoint_dict, real_positions
try:
    import fcntl
except ImportError:  # Windows: runs are not locked (lock_run says so)
    fcntl = None

# Presets per task: "paper" (Coser et al. Sec. 5; Amos et al.'s configs) and "cpu" (minutes on 2 cores). --preset
# auto picks paper on CUDA, cpu elsewhere; any flag overrides. eval_every 10**9: validate at the end of each epoch.
# The CPU presets of the long LRA tasks train for a few hundred steps: a pipeline check, not a result.
CPU_STAGE = dict(batch_size=16, lr=1e-3, warmup=20, epochs=1000, max_steps=200, eval_every=200)
PIXELS_CPU = dict(CPU_STAGE, max_steps=150, eval_every=150)  # L = 1024: attention is the cost
PRESETS = {
    "listops": {
        "paper": dict(model=dict(n_layers=6, d_model=512, n_heads=8, d_mlp=2048),
                      data=dict(n_train=96000, n_val=2000, n_test=2000),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=2000, epochs=100, eval_every=3000),
                      finetune=dict(batch_size=32, lr=1e-4, warmup=2000, epochs=100, eval_every=3000)),
        "cpu": dict(model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128),
                    data=dict(n_train=10000, n_val=1000, n_test=1000),
                    **dict.fromkeys(("pretrain", "finetune"), dict(batch_size=16, lr=1e-3, warmup=50, epochs=1,
                                                                  eval_every=150, max_steps=450)))},
    # The minimal model of Coser et al. Sec. 4: one layer, one head, no LayerNorm, no MLP (width ours: 32).
    "synthetic": dict.fromkeys(("paper", "cpu"), dict(
        model=dict(n_layers=1, d_model=32, n_heads=1, d_mlp=32, layernorm=False, mlp=False),
        data=dict(n_train=5000, n_val=1000, n_test=1000),
        **dict.fromkeys(("pretrain", "finetune"), dict(batch_size=64, lr=1e-3, warmup=0, epochs=15, eval_every=500)))),
    # Every UCR data set (task ucr/<Name>; the paper gives no sizes). A budget in steps, not epochs: GunPoint's 40
    # training series are 2 batches, and from scratch leaves chance level only after ~100-150 steps.
    "ucr": dict.fromkeys(("paper", "cpu"), dict(
        model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128), data=dict(val_fraction=0.2),
        pretrain=dict(batch_size=32, lr=3e-3, warmup=20, epochs=10**6, eval_every=20,
                      max_steps=500, eval_each_epoch=False),
        finetune=dict(batch_size=32, lr=1e-3, warmup=20, epochs=10**6, eval_every=20,
                      max_steps=500, eval_each_epoch=False))),
    "text": {
        "paper": dict(model=dict(n_layers=6, d_model=512, n_heads=8, d_mlp=2048, cls_mlp=True), data=dict(max_len=4096),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=5000, epochs=32, eval_every=10**9, weight_decay=0.1),
                      finetune=dict(batch_size=32, lr=1e-4, warmup=2000, epochs=65, eval_every=10**9, weight_decay=0.1)),
        "cpu": dict(model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128), data=dict(max_len=1024),
                    pretrain=CPU_STAGE, finetune=CPU_STAGE)},
    "retrieval": {
        "paper": dict(model=dict(n_layers=4, d_model=128, n_heads=4, d_mlp=512, pair=True), data=dict(max_len=4000),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=2000, epochs=32, eval_every=10**9),
                      finetune=dict(batch_size=32, lr=1e-4, warmup=5000, epochs=32, eval_every=10**9)),
        "cpu": dict(model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128, pair=True), data=dict(max_len=1000),
                    pretrain=CPU_STAGE, finetune=CPU_STAGE)},
    # Pixel tasks on the CPU: L = 1024 makes attention the cost, so a narrower model (d_model 32) and 150 steps.
    "image": {
        "paper": dict(model=dict(n_layers=3, d_model=64, n_heads=4, d_mlp=128, cls_mlp=True), data=dict(),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=2500, epochs=50, eval_every=10**9),
                      finetune=dict(batch_size=50, lr=1e-3, warmup=2000, epochs=200, eval_every=10**9)),
        "cpu": dict(model=dict(n_layers=2, d_model=32, n_heads=2, d_mlp=64), data=dict(),
                    pretrain=PIXELS_CPU, finetune=PIXELS_CPU)},
    "pathfinder": {
        "paper": dict(model=dict(n_layers=4, d_model=128, n_heads=8, d_mlp=128), data=dict(),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=2500, epochs=50, eval_every=10**9),
                      finetune=dict(batch_size=32, lr=5e-4, warmup=5000, epochs=200, eval_every=10**9)),
        "cpu": dict(model=dict(n_layers=2, d_model=32, n_heads=2, d_mlp=64), data=dict(generate_if_missing=4000),
                    pretrain=PIXELS_CPU, finetune=PIXELS_CPU)},
    # PathX: max pooling and local attention in windows of 4096 (Amos et al.'s PathX config). lr: Table 4 gives
    # none for PathX; their PathX config's 5e-4, both stages.
    "pathx": {
        "paper": dict(model=dict(n_layers=4, d_model=128, n_heads=4, d_mlp=128, pooling="max", attn_window=4096),
                      data=dict(),
                      pretrain=dict(batch_size=32, lr=5e-4, warmup=5000, epochs=200, eval_every=10**9),
                      finetune=dict(batch_size=32, lr=5e-4, warmup=5000, epochs=200, eval_every=10**9)),
        "cpu": dict(model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128, pooling="max", attn_window=256),
                    data=dict(generate_if_missing=200),
                    pretrain=dict(batch_size=2, lr=1e-3, warmup=20, epochs=1000, eval_every=20, max_steps=20),
                    finetune=dict(batch_size=2, lr=1e-3, warmup=20, epochs=1000, eval_every=20, max_steps=20))},
}
PRESETS["fashion_mnist"] = copy.deepcopy(PRESETS["image"])  # the offline stand-in for Image: the same sizes
# Masking ratios: Amos et al.; Coser et al. Sec. 2 (pixels 50%, Text/Retrieval 15%, ListOps 10%). UCR: the paper
# gives none; 50% as for pixels, the other continuous signal.
MASK_RATIO = {"listops": 0.10, "synthetic": 0.50, "ucr": 0.50, "text": 0.15, "retrieval": 0.15, "image": 0.50,
              "fashion_mnist": 0.50, "pathfinder": 0.50, "pathx": 0.50}


# ---- The SPT objective: masked reconstruction (Coser et al. Sec. 2, L_SPT) ----

def mask_batch(x, lengths, ratio, mask_id, generator):
    """Choose masked positions and hide them from the model.

    x: tokens (B, L) int64 or values (B, L, C) float; lengths (B,) int64.
    Returns (inputs, masked (B, L) bool). Every real position is masked independently with probability `ratio` (no
    spans, no 80/10/10, as in Amos et al.); padding is never masked; a sequence that drew no mask gets one at a
    uniformly random real position, so each sequence contributes to the loss. Tokens: masked ids become `mask_id`,
    inputs (B, L). Values: masked values become 0 and a mask-indicator channel is appended, inputs (B, L, C+1) (Amos
    et al.; the channel is sliced off at finetuning). `generator` makes the masks reproducible. No host
    synchronisation (a GPU never waits): tensor operations only, no .item(), nonzero, boolean indexing or loop over
    rows; draw with torch.rand(..., generator=generator, device=x.device). Tested on the meta device.
    """
    B, L = x.shape[:2]
    valid = real_positions(lengths, L, x.device)
    u = torch.rand(B, L, generator=generator, device=x.device)
    masked = (u < ratio) & valid
    # The real position with the smallest u is the one to force-mask in rows that drew none.
    forced = F.one_hot(u.masked_fill(~valid, 2.0).argmin(dim=1), L).bool()
    masked = masked | (forced & ~masked.any(dim=1, keepdim=True))
    if x.dtype == torch.long:
        return x.masked_fill(masked, mask_id), masked
    indicator = masked[..., None].to(x.dtype)                                  # (B, L, 1)
    return torch.cat([x * (1 - indicator), indicator], dim=-1), masked


def reconstruction_loss(outputs, targets, masked, kind="ce"):
    """Mean reconstruction loss over the M masked positions (Coser et al., Sec. 2, L_SPT).

    outputs (B, L, n_rec) at every position; targets (B, L) int64 for "ce" (cross-entropy over the vocabulary),
    (B, L, n_rec) float for "mse" (1/2 ||r - u||^2) and "l1" (||r - u||_1); masked (B, L) bool. The per-position
    losses where `masked` is True, summed and divided by M; M = 0 gives 0 (a zero with a graph, not 0/0 = NaN).
    No data-dependent shape (no outputs[masked]), so a GPU never waits for the device.
    """
    if kind == "ce":
        per = F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten(), reduction="none")
    else:
        diff = outputs.float() - targets
        per = (0.5 * diff.pow(2) if kind == "mse" else diff.abs()).sum(dim=-1).flatten()
    weight = masked.flatten().to(per.dtype)
    return (per * weight).sum() / weight.sum().clamp(min=1)


def targets_at(x, rec_loss, meta):
    """Reconstruction targets at every position, (B, L) or (B, L, C): token ids, values, or for pixel tasks with the
    cross-entropy loss the raw intensity class 0..255, undoing the normalization of data.get_batch."""
    if rec_loss == "ce" and meta["kind"] == "pixels":
        pixels = (x[..., 0] * meta["pixel_std"] + meta["pixel_mean"]) * 255
        return pixels.round().long().clamp(0, 255)
    return x


def spt_loss_fn(net, split, args):
    """The training step's loss_fn for `train`: (idx (B,), step) -> (sum of the masked loss over this rank's
    masked positions, their number). Masks differ per step and are reproducible (seeded by seed and step), so a
    resumed run draws the same ones. Retrieval: each document of a pair is masked on its own."""
    meta, g = split["meta"], torch.Generator(device=args.device)

    def loss_fn(idx, step):
        x, lengths = data.single_sequences(*data.get_batch(split, idx, args.device)[:2])
        g.manual_seed(args.seed * 1_000_003 + step)
        inputs, masked = mask_batch(x, lengths, args.mask_ratio, meta.get("mask_id"), g)
        x, lengths, inputs, masked = local_rows(args, x, lengths, inputs, masked)  # this rank's rows
        with autocast(args.device, args.dtype):
            out = net(inputs, lengths, reconstruct=True)
        n = masked.sum()
        return reconstruction_loss(out, targets_at(x, args.rec_loss, meta), masked, args.rec_loss) * n, n
    return loss_fn


def evaluate_reconstruction(model, split, args):
    """Validation masked loss, and masked-token accuracy (cross-entropy) or masked MAE (regression: the mean
    absolute error per masked value, Amos et al.'s `masked_mae`).

    Returns {"val_loss", "val_acc" or "val_mae"}: floats. Batch i gets the same masks at every evaluation.
    """
    meta = split["meta"]

    def batch_sums(i, idx):  # loss sum, correct (or absolute error) sum, count
        x, lengths = data.single_sequences(*data.get_batch(split, idx, args.device)[:2])
        g = torch.Generator(device=args.device).manual_seed(12345 + i)  # the weights decide the best, not the masks
        inputs, masked = mask_batch(x, lengths, args.mask_ratio, meta.get("mask_id"), g)
        with autocast(args.device, args.dtype):
            out = model.reconstruct(inputs, lengths)
        acc = accumulator_dtype(args.device)  # the sums in float64 (float32 on MPS), as the loop adds them
        targets, n = targets_at(x, args.rec_loss, meta), masked.sum().to(acc)
        if args.rec_loss == "ce":
            second = ((out.argmax(-1) == targets) & masked).sum()
        else:  # |r - u| averaged over the channels, summed over the masked positions
            second = ((out.float() - targets).abs().mean(dim=-1) * masked).sum()
        return torch.stack([reconstruction_loss(out, targets, masked, args.rec_loss).to(acc) * n, second.to(acc), n])

    loss_sum, second, count = evaluate(model, split, args, batch_sums, 3)
    return {"val_loss": loss_sum / count, ("val_acc" if args.rec_loss == "ce" else "val_mae"): second / count}


def pretrain_parser():
    """The flags of pretrain.py: the shared ones (build_parser), the masking and the reconstruction loss."""
    parser = build_parser("pretrain", __doc__.split("\n")[0])
    parser.add_argument("--mask_ratio", type=number_at_least(float, 0.0, high=1.0), default=None,
                        help="fraction of positions masked (task default)")
    parser.add_argument("--rec_loss", default="mse", choices=("mse", "l1", "ce"),
                   help="reconstruction loss for continuous inputs: MSE (the paper's), L1, or for pixel tasks "
                        "ce = 256-way cross-entropy over the raw intensity (Amos et al.'s code); tokens always "
                        "use cross-entropy over the vocabulary")
    return parser


def main(argv=None):
    """Self-pretraining: python pretrain.py --task TASK [flags]; writes run_paths(out_dir, task, "pretrain")."""
    parser = pretrain_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v != parser.get_default(k)}  # before the preset fills them
    args, preset = resolve(args, "pretrain", parser)
    if args.mask_ratio is None:
        args.mask_ratio = MASK_RATIO[data.task_family(args.task)]
    splits = prepare_data(args, preset)
    meta = splits["train"]["meta"]
    backbone = {k: v for k, v in preset["model"].items() if k != "cls_mlp"}  # the class head is finetune.py's
    if meta["kind"] == "tokens":
        args.rec_loss = "ce"  # cross-entropy over the vocabulary
        cfg = ModelConfig(vocab_size=meta["vocab_size"], max_len=meta["max_len"], n_rec=meta["vocab_size"],
                          **backbone)
    else:  # continuous values: one extra input channel for the mask indicator
        if args.rec_loss == "ce" and meta["kind"] != "pixels":
            parser.error(f"--rec_loss ce needs 8-bit pixels; {args.task} has continuous values (use mse or l1)")
        n_rec = 256 if args.rec_loss == "ce" else meta["d_input"]  # 256 intensity classes, or regress each channel
        cfg = ModelConfig(d_input=meta["d_input"] + 1, max_len=meta["max_len"], n_rec=n_rec, **backbone)
    model = Transformer(cfg).to(args.device)
    paths = run_paths(args.out_dir, args.task, "pretrain")
    extra = dict(stage="pretrain", task=args.task, data_meta=meta, data_sha256=data.data_hashes(splits),
                 metric="val_loss", format_version=1)
    print(f"self-pretraining {args.task}: {cfg}")
    with own_run(paths, args) as run:
        best = train(model, splits, args, spt_loss_fn(wrap(model, args), splits["train"], args),
                     lambda step: evaluate_reconstruction(model, splits["val"], args), run, extra, False)
    print(f"best validation masked loss {best['val_loss']:.4f} (step {best['step']}); "
          f"{'wrote' if best['steps_trained'] else 'kept'} {paths['best']}")
    if meta["kind"] == "tokens" and args.rank == 0:  # where the loss stands: frequencies only, or context
        h = data.token_frequency_entropy(splits["train"])
        gap = best["val_loss"] - h
        print(f"the token-frequency entropy of {args.task}'s training data is {h:.4f} nats; the validation masked "
              f"loss is " + ("below it: the model uses the context" if gap < -0.02 else "at it: the model predicts "
              "masked tokens from their frequencies only, not yet from the context (the plateau that attention to "
              "neighbours ends)" if gap <= 0.02 else f"above it by {gap:.3f}: train longer"))
    if args.world_size > 1:
        dist.destroy_process_group()
    spt, scratch = next_commands(args.task, paths["best"], given)
    print(f"next: {spt}\n  and {scratch}   (the baseline)\n"
          f"to see SPT's effect on a CPU in about 30 seconds: python ablate.py demo")


def next_commands(task, checkpoint, given):
    """The two finetune.py commands that follow a pretrain.py run (shell strings): from its checkpoint, and the
    from-scratch baseline. Both carry the run's data and run flags (`given`: {name: value} of the flags that
    differ from their defaults); the baseline also its model flags, so that it builds the model SPT trained."""
    def flags(names):
        return "".join(f" --{k}" if given[k] is True else f" --{k} {shlex.quote(str(given[k]))}"
                       for k in names if k in given and given[k] is not None)
    both = flags(("data_dir", "out_dir", "preset", "seed", "device", "dtype", "max_len", "resolution", "difficulty",
                  "pooling"))  # pooling: the finetuning task's own (finetune.FINETUNE_FIELDS), so both carry it
    model = flags([k for k in MODEL_FLAGS if k != "pooling"])
    return (f"python finetune.py --task {task} --init {shlex.quote(checkpoint)}{both}",
            f"python finetune.py --task {task} --init scratch{both}{model}")

# ======================================================================================================
# ==== The engine both stages share (a first reading can stop here): flags and presets, the training loop
# ==== `train` and its step, device and dtype, DDP, a run's files (lock, checkpoints, resume, log), the CLI.

MODEL_SIZE_FLAGS = ("n_layers", "d_model", "n_heads", "d_mlp")


def build_parser(stage, description):
    """The flags every stage shares (defaults of None are filled from the preset by `resolve`)."""
    p = data.ArgumentParser(description=description, formatter_class=HelpFormatter,
                            epilog="A flag shown without a default takes the preset's value (pretrain.PRESETS).")
    p.add_argument("--task", required=True, choices=data.TASKS, help="which data set")
    p.add_argument("--data_dir", type=data.folder, default="data", help="root of data/<task>/*.pt")
    p.add_argument("--out_dir", type=data.folder, default="out", help="root of out/<task>/ checkpoints and logs")
    p.add_argument("--preset", default="auto", choices=("auto", "cpu", "paper"),
                   help="model and training size; auto = paper on CUDA, cpu otherwise")
    p.add_argument("--epochs", type=POSITIVE, default=None, help="passes over the training split")
    p.add_argument("--max_steps", type=NON_NEGATIVE, default=None, help="cap on optimizer steps (0 = no cap)")
    p.add_argument("--batch_size", type=POSITIVE, default=None, help="sequences per step")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=None, help="peak learning rate of AdamW")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=None, help="linear warm-up steps, then constant")
    p.add_argument("--weight_decay", type=number_at_least(float, 0.0), default=None, help="AdamW weight decay")
    p.add_argument("--grad_clip", type=number_at_least(float, 0.0), default=0.0, help="clip the gradient norm (0 = off)")
    p.add_argument("--eval_every", type=POSITIVE, default=None, help="steps between validations and checkpoints")
    p.add_argument("--eval_each_epoch", action=argparse.BooleanOptionalAction, default=None,
                   help="also validate and checkpoint at the end of every epoch (default: yes, except UCR)")
    p.add_argument("--log_every", type=POSITIVE, default=10, help="steps between log lines")
    p.add_argument("--seed", type=data.SEED, default=0, help="training seed: init, batch order, masks")
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="auto = bf16 autocast where supported (CUDA), else fp32")
    p.add_argument("--resume", action="store_true", help=f"continue from out/<task>/{stage}*_last.pt")
    p.add_argument("--overwrite", action="store_true", help="remove this run's old files first")
    p.add_argument("--snapshots", action="store_true", help="also keep a checkpoint at every evaluation")
    p.add_argument("--skip_nonfinite", action="store_true",
                   help="skip steps with a NaN/inf loss or gradient (checked each step); stop at 50 of the last 100")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (needs a working Triton)")
    g = p.add_argument_group("model (overrides the preset; a finetuning from a checkpoint uses the checkpoint's)")
    for name, what in zip(MODEL_SIZE_FLAGS, ("Transformer blocks", "width of the residual stream",
                                              "attention heads (must divide d_model)", "hidden width of the MLP")):
        g.add_argument(f"--{name}", type=POSITIVE, default=None, help=what)
    g.add_argument("--pos", default=None, choices=POSITIONS,
                   help="positions (model.POSITIONS); the paper's are sinusoidal")
    g.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="pooling for the class head (model.POOLINGS); the paper's is mean; cls: a summary token")
    g.add_argument("--init_scheme", default=None, choices=INIT_SCHEMES,
                   help="initialization (model.init_weights); default reference = Amos et al.'s code")
    g.add_argument("--init_std", type=POSITIVE_FLOAT, default=None, help="std of --init_scheme normal, and of --pos learned (default 0.02)")
    g.add_argument("--init_scale", type=POSITIVE_FLOAT, default=None, help="multiply every initialized weight (default 1)")
    d = p.add_argument_group("data (used when data/<task>/ is made, and checked against it when it exists)")
    d.add_argument("--max_len", type=POSITIVE, default=None, help="longest sequence kept (Text, Retrieval, ListOps)")
    d.add_argument("--resolution", type=POSITIVE, default=None,
                   help="PathFinder/PathX image side (32 / 128); Fashion-MNIST 32 or 16 (2x2 means)")
    d.add_argument("--difficulty", default=None, choices=("easy", "intermediate", "hard"),
                   help="PathFinder/PathX contour length 6 / 9 / 14 (default hard)")
    d.add_argument("--download", action="store_true",
                   help="download missing data (IMDb 84 MB, CIFAR-10 163 MB, Fashion-MNIST 30 MB, LRA 8.2 GB, UCR)")
    d.add_argument("--accept_data", action="store_true",
                   help="train on data/<task>/ even if its settings differ from the preset's (a warning)")
    return p


# Flags that set ModelConfig fields (flag name -> field name); None means the preset's (or ModelConfig's) value.
MODEL_FLAGS = {**{k: k for k in MODEL_SIZE_FLAGS}, "pos": "pos", "pooling": "pooling", "init_scheme": "init",
               "init_std": "init_std", "init_scale": "init_scale"}


def resolve(args, stage, parser):
    """Fill unset flags from the preset; pick device and dtype. Returns args (modified) and the model preset. A model
    the preset and flags cannot build (d_model not divisible by n_heads) is the `parser`'s usage error."""
    args.device = pick_device(args.device)
    setup_distributed(args)
    if args.preset == "auto":
        args.preset = "paper" if args.device.type == "cuda" else "cpu"
    preset = fill_from_preset(args, stage)
    try:
        ModelConfig(**preset["model"])
    except ValueError as e:
        parser.error(str(e))
    if args.init_std is not None and (args.init_scheme or "reference") != "normal" and args.pos != "learned" and \
            getattr(args, "init", "scratch") == "scratch":  # finetuning from a checkpoint: its scheme (finetune.py)
        raise ValueError(f"--init_std sets the std of --init_scheme normal and of --pos learned's table; this run's "
                         f"scheme is {args.init_scheme or 'reference'} (pass --init_scheme normal, or drop --init_std)")
    args.dtype, reason = pick_dtype(args.dtype, args.device)
    torch.manual_seed(args.seed)  # the model's initialization
    if args.device.type == "cuda":  # TF32 matmuls, unless exact fp32 was asked for
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.dtype != torch.float32
    threads = f", {torch.get_num_threads()} thread(s)" if args.device.type == "cpu" else ""  # they change float sums
    ranks = f", {args.world_size} processes ({dist.get_backend()}, torchrun)" if args.world_size > 1 else ""
    print(f"device {args.device} ({device_name(args.device)}{threads}){ranks}, dtype "
          f"{str(args.dtype).replace('torch.', '')} ({reason}), preset {args.preset}")
    return args, preset


def fill_from_preset(args, stage):
    """Set every schedule flag of `stage` left at None from PRESETS[task family][args.preset]; returns the preset,
    its model entry updated with the model flags given. No side effect beyond args (ablate.py uses it too)."""
    preset = PRESETS[data.task_family(args.task)][args.preset]
    preset = dict(preset, model={**preset["model"], **{field: getattr(args, flag) for flag, field in MODEL_FLAGS.items()
                                                       if getattr(args, flag) is not None}})
    for key, value in {"max_steps": 0, "eval_each_epoch": True, "weight_decay": 0.0, **preset[stage]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return preset


def mask_generator(args, seed):
    """The seeded generator of the masks on args.device (a seam the no-host-synchronisation tests replace)."""
    return torch.Generator(device=args.device).manual_seed(seed)


def get_lr(step, lr, warmup):
    """Linear warm-up from lr/warmup to lr over `warmup` steps, then constant (Amos et al., constant_warmup)."""
    return lr * min(1.0, (step + 1) / max(1, warmup))


def train(model, splits, args, loss_fn, eval_fn, run, extra, higher_is_better):
    """Optimize `model` on splits["train"] with AdamW; evaluate and checkpoint every args.eval_every steps and,
    with args.eval_each_epoch, at the end of every epoch. With args.resume the run goes on exactly.

    loss_fn(idx (B,) global batch indices, step) -> (sum of the loss over this rank's items, their count).
    eval_fn(step) -> {"val_...": float}; extra["metric"] names the one that picks the best checkpoint.
    run: the dict own_run yields (its "paths"); train adds the model, optimizer and loop state to it.
    Returns the best evaluation's metrics with "step", "epoch", "elapsed_s" (wall-clock seconds over every
    process that resumed the run) and "steps_trained" (0 for a --resume of a finished run).
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay, fused=args.device.type == "cuda")
    n_batches = len(epoch_batches(splits["train"], args, 0))  # the same for every epoch
    total = min(args.max_steps or math.inf, args.epochs * n_batches)
    state = dict(step=0, epoch=0, batch_in_epoch=0, best=None, best_metrics=None, n_batches=n_batches)
    if args.resume:
        state = resume(model, opt, run["paths"], n_batches, total, args, extra) or state
    n_params, rows = sum(p.numel() for p in model.parameters() if p.requires_grad), len(splits["train"]["labels"])
    print(f"{n_params:,} trainable parameters; {total} steps ({n_batches} per epoch)" + (
        f"; --batch_size {args.batch_size} > the {rows} training rows: every batch holds all of them" * (
            args.batch_size > rows)))
    run.update(model=model, opt=opt, state=state, args=args, extra=extra, record=run_record(args), eval_fn=eval_fn,
               higher_is_better=higher_is_better, total=total, t_process=time.time(), start_step=state["step"],
               elapsed0=state.get("elapsed_s", 0.0))  # seconds the run spent in earlier processes (--resume)
    if state["step"] == 0:
        start_fresh(run)
    meter, lengths, width = new_meter(args), splits["train"]["lengths"], data.split_width(splits["train"])
    run["t_start"] = time.time()  # for the ETA: the steps from here on
    model.train()
    while state["step"] < total:
        batches = epoch_batches(splits["train"], args, state["epoch"])
        for i in range(state["batch_in_epoch"], len(batches)):
            idx = batches[i]                                        # the batch: row indices (B,), on the CPU
            lr = get_lr(state["step"], args.lr, args.warmup)        # the learning rate: warm-up, then constant
            for group in opt.param_groups:
                group["lr"] = lr
            loss_sum, count = loss_fn(idx, state["step"])           # forward and loss: this rank's sum and count
            count = global_sum(count.detach().to(torch.float32), args)
            # backward; DDP averages gradients over ranks, hence x world_size: the gradient of sum / count overall
            (loss_sum * args.world_size / count).backward()
            loss = global_sum(loss_sum.detach(), args) / count      # a device tensor: no host synchronisation
            if args.skip_nonfinite and not finite_step(run, loss):  # a host sync, only with this flag
                loss = None                                         # skipped: its gradients are dropped
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()                                              # the AdamW step
            opt.zero_grad(set_to_none=True)
            state["step"], state["batch_in_epoch"] = state["step"] + 1, i + 1
            count_step(meter, loss, lengths[idx], model.cfg, width)
            done, end_of_epoch, epoch = state["step"] >= total, i + 1 == len(batches), state["epoch"]
            if state["step"] % args.log_every == 0 or done:
                log_progress(run, meter, lr)                        # the loop's one regular host synchronisation
            if end_of_epoch:
                state["epoch"], state["batch_in_epoch"] = epoch + 1, 0
            if state["step"] % args.eval_every == 0 or done or (end_of_epoch and args.eval_each_epoch):
                evaluate_and_checkpoint(run, meter, epoch)
            if done:
                break
    return finish(run)


def start_fresh(run):
    """Step 0 of a new run: a fresh log, an evaluation of the initial weights (the log shows how far training
    moves the metric) and the _init.pt checkpoint the analyses start from."""
    if run["args"].rank == 0:
        check_owned(run)
        open(run["paths"]["log"], "w").close()
    metrics = run["eval_fn"](0)
    print("eval at step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if not all(map(math.isfinite, metrics.values())):  # before any step: the learning rate is not at fault
        raise FloatingPointError(f"the initial weights give a NaN or inf evaluation ({metrics}) before any training "
                                 f"step: the init is too large (--init_scale {run['model'].cfg.init_scale}), or the "
                                 f"data holds values too large for float32 arithmetic (check its largest values)")
    append_log(run, dict(step=0, epoch=0, **metrics))
    save_checkpoint(run, run["paths"]["init"], metrics)


def finite_step(run, loss, window=100, limit=50):
    """--skip_nonfinite: whether this step's loss and gradient norm are finite (a finite loss can still have an
    inf/NaN gradient). If not, the step is said and counted in the loop state ("skipped", and the steps skipped among
    the last `window`), and its gradients are dropped: AdamW's step skips a parameter whose gradient is None.
    FloatingPointError when `limit` of the last `window` steps were skipped: the run no longer trains."""
    grads = [p.grad for p in run["model"].parameters() if p.grad is not None]
    if bool(torch.isfinite(loss) & torch.isfinite(torch.nn.utils.get_total_norm(grads))):
        return True
    state = run["state"]
    print(f"step {state['step'] + 1}: non-finite loss or gradient, update skipped")
    run["opt"].zero_grad(set_to_none=True)
    state["skipped"] = state.get("skipped", 0) + 1
    state["recent_skips"] = [s for s in state.get("recent_skips", []) if s > state["step"] - window] + [state["step"]]
    if len(state["recent_skips"]) >= limit:
        raise FloatingPointError(f"--skip_nonfinite: {limit} of the last {window} steps (up to step "
                                 f"{state['step'] + 1}) had a NaN or inf loss or gradient: the run gives up; rerun "
                                 f"with a lower --lr, a --grad_clip or --dtype fp32")
    return False


def finish(run):
    """The end of `train`: check that the run trained (check_trained), say so, and return the best metrics."""
    args, state, metric = run["args"], run["state"], run["extra"]["metric"]
    check_trained(state, metric, last_good(run))  # a finite evaluation, at most half the steps skipped
    if state["step"] > run["start_step"]:
        print(f"finished {state['step']} steps in {(time.time() - run['t_start']) / 60:.1f} min; "
              f"best {metric} {state['best']:.4f}")
    else:  # --resume of a finished run: its checkpoints are read back, not written again
        print(f"the run in {os.path.dirname(run['paths']['last']) or '.'} had already finished its {run['total']} "
              f"steps: nothing trained, its checkpoints are unchanged; best {metric} {state['best']:.4f}")
    if args.world_size > 1:
        dist.barrier()  # rank 0 has written its checkpoints before anyone reads them
    return dict(state["best_metrics"], step=state.get("best_step"), epoch=state.get("best_epoch"),
                elapsed_s=run["elapsed0"] + time.time() - run["t_process"],
                steps_trained=state["step"] - run["start_step"])


def new_meter(args):
    """What the next log line reports, summed since the last one: loss (a device tensor), steps, skipped steps,
    real tokens, padded tokens (the positions computed on), training FLOPs, and the wall-clock start."""
    return dict(t_last=time.time(), loss=torch.zeros((), device=args.device), steps=0, skipped=0, tokens=0, padded=0,
                flops=0.0)


def count_step(meter, loss, batch_lengths, cfg, width):
    """Add one step to the meter. batch_lengths (B,) or (B, 2) live on the CPU, so this never waits for the
    device; width gives the batch's padded length (data.batch_width). loss None: a skipped step."""
    if loss is None:
        meter["skipped"] += 1
    else:
        meter["loss"] += loss.detach()
    meter["steps"] += 1
    meter["tokens"] += int(batch_lengths.sum())
    meter["padded"] += batch_lengths.numel() * data.batch_width(batch_lengths, width)
    L_batch = int(batch_lengths.max())
    meter["flops"] += flops_per_token(cfg, L_batch) * batch_lengths.numel() * L_batch  # x2 for pairs


def log_progress(run, meter, lr):
    """Print and log the mean loss, ms/step, real tokens/s, the real share of the padded tokens, MFU (GPUs in
    PEAK_BF16_FLOPS), CUDA's peak memory so far and an ETA. The .item() here is the loop's one regular host
    synchronisation. FloatingPointError on a non-finite mean loss; skipped steps are left out of the mean."""
    args, state = run["args"], run["state"]
    counted = meter["steps"] - meter["skipped"]
    mean_loss = meter["loss"].item() / counted if counted else None
    if counted:
        check_finite(run, mean_loss, state["step"] - meter["steps"] + 1)
    dt = time.time() - meter["t_last"]
    eta = (time.time() - run["t_start"]) / (state["step"] - run["start_step"]) * (run["total"] - state["step"])
    peak = peak_flops(args.device, args.dtype)
    mfu = None if peak is None else meter["flops"] / dt / (peak * args.world_size)  # per GPU
    mem = torch.cuda.max_memory_allocated(args.device) / 2 ** 30 if args.device.type == "cuda" else None
    skipped = f" ({meter['skipped']} skipped)" if meter["skipped"] else ""
    if meter["steps"] != args.log_every:  # after a --resume, or at the end: a mean over fewer steps
        skipped += f" (mean of {meter['steps'] - meter['skipped']} steps)"
    print(f"step {state['step']:6d}/{run['total']} | epoch {state['epoch']} | loss "
          f"{'-' if mean_loss is None else f'{mean_loss:.4f}'}{skipped} | lr {lr:.2e} | "
          f"{1000 * dt / meter['steps']:.0f} ms/step | {meter['tokens'] / dt:,.0f} tok/s | "
          f"{100 * meter['tokens'] / meter['padded']:.0f}% real | " + (f"MFU {100 * mfu:.1f}% | " if mfu else "")
          + (f"peak {mem:.1f} GiB | " if mem is not None else "") + f"ETA {eta / 60:.1f} min")
    append_log(run, dict(step=state["step"], epoch=state["epoch"], loss=mean_loss, lr=lr,
                              ms_per_step=1000 * dt / meter["steps"], tokens_per_s=meter["tokens"] / dt,
                              real_fraction=meter["tokens"] / meter["padded"], mfu=mfu, peak_memory_gib=mem,
                              **({"skipped": meter["skipped"]} if meter["skipped"] else {})))
    meter.update(new_meter(args))


def evaluate_and_checkpoint(run, meter, epoch):
    """Check that the loss since the last log line and the weights are finite, evaluate (eval_fn), keep the best
    metrics (is_better), and write the best checkpoint (if improved), the last one (for --resume) and with
    --snapshots a copy per evaluation. The evaluation's time is left out of the meter's ms/step and tokens/s."""
    args, state, paths, metric = run["args"], run["state"], run["paths"], run["extra"]["metric"]
    if meter["steps"] > meter["skipped"]:  # a NaN/inf loss since the last log line stops the run before any checkpoint
        check_finite(run, meter["loss"].item(), state["step"] - meter["steps"] + 1)
    t_eval = time.time()  # .item() above waited for the queued steps: the evaluation's time starts now
    if not bool(torch.stack([torch.isfinite(p).all() for p in run["model"].parameters()]).all()):  # one host sync
        bad = [n for n, p in run["model"].named_parameters() if not torch.isfinite(p).all()]
        raise FloatingPointError(f"non-finite weights at step {state['step']} ({bad[0]}" + (
            f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "): a gradient was NaN or inf although the loss "
            f"was finite, and none of them is checkpointed; {last_good(run)}, or --skip_nonfinite to skip such steps")
    metrics = run["eval_fn"](state["step"])
    improved = is_better(metrics, state, metric, run["higher_is_better"], run["extra"].get("tiebreak"))
    if improved:
        state["best"], state["best_metrics"] = metrics[metric], metrics
        state["best_step"], state["best_epoch"] = state["step"], state["step"] / state["n_batches"]
    print(f"eval at step {state['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
          + (" (best)" if improved else ""))
    append_log(run, dict(step=state["step"], epoch=epoch, **metrics))
    # Snapshot, best, last: a run stopped inside these writes resumes from the newest complete checkpoint
    # (load_newest): before this evaluation, which it then makes again, or from the best, after the snapshot.
    if args.snapshots:  # a copy per evaluation, for curves over training (analyze.py curves)
        save_checkpoint(run, paths["snapshot"].format(step=state["step"]), metrics)
    if improved:
        save_checkpoint(run, paths["best"], metrics)
    save_checkpoint(run, paths["last"], metrics)
    meter["t_last"] += time.time() - t_eval


def is_better(metrics, state, metric, higher_is_better, tiebreak=None):
    """Whether an evaluation's `metrics` beat the best so far (state["best_metrics"]) on `metric`. A tie (frequent
    for accuracy on a small validation split) goes to the lower `tiebreak` loss, and failing that to the later
    evaluation, so that a tie never keeps an early step merely because it came first."""
    best, value = state["best_metrics"], metrics[metric]
    if best is None or not (math.isfinite(value) and math.isfinite(best[metric])):  # NaN, inf: never the best
        return math.isfinite(value)
    ref = best[metric]
    if value != ref:
        return value > ref if higher_is_better else value < ref
    return tiebreak is None or metrics[tiebreak] <= best[tiebreak]


def save_checkpoint(run, path, metrics):
    """Write model, optimizer, loop state, RNG states, the run record and the stage's fields (rank 0 only),
    atomically (save_atomic)."""
    args = run["args"]
    if args.rank != 0:
        return
    check_owned(run)
    cuda_rng = torch.cuda.get_rng_state(args.device) if args.device.type == "cuda" else None
    run["state"]["elapsed_s"] = run["elapsed0"] + time.time() - run["t_process"]  # carried over a --resume
    data.save_atomic(checkpoint_dict(run["model"], optimizer=run["opt"].state_dict(), state=dict(run["state"]),
                                     metrics=metrics, rng_state=torch.get_rng_state(), cuda_rng_state=cuda_rng,
                                     **run["record"], **run["extra"]), path)


def check_finite(run, value, first):
    """FloatingPointError if `value` (a mean loss over steps first..now) is NaN or inf, saying what to do."""
    if not math.isfinite(value):
        raise FloatingPointError(f"non-finite loss between steps {first} and {run['state']['step']}; "
                                 f"{last_good(run)}, or --skip_nonfinite to skip such steps")


def last_good(run):
    """Where a run stopped by non-finite numbers can go on from (what the error says to do)."""
    last = run["paths"]["last"]
    return f"the last good checkpoint is {last} (--resume it with --skip_nonfinite, or rerun with a lower --lr in " \
        f"a new --out_dir)" if os.path.exists(last) else "no checkpoint was written yet (rerun with a lower --lr)"


def check_trained(state, metric, where):
    """FloatingPointError unless the loop `state` trained: some evaluation gave a finite `metric`, and --skip_nonfinite
    skipped fewer than half of its steps (finite_step's rule needs 100 steps to fire). where: pretrain.last_good."""
    if state["best_metrics"] is None:  # every evaluation NaN or inf
        raise FloatingPointError(f"no evaluation gave a finite {metric}: no best checkpoint; {where}")
    if state.get("skipped") and 2 * state["skipped"] >= state["step"]:
        raise FloatingPointError(f"--skip_nonfinite skipped {state['skipped']} of the run's {state['step']} steps: "
                                 f"it did not train, whatever its checkpoints hold; {where}")


# The batches of a training epoch, and the evaluation loop both stages share (sharded under torchrun).
def epoch_batches(split, args, epoch):
    """The training batches (index tensors) of one epoch, seeded by (seed, epoch) so that a resumed run sees
    the same ones; under torchrun every batch has at least one row per rank (data.batch_indices)."""
    return data.batch_indices(split["lengths"], args.batch_size, shuffle=True, seed=args.seed, epoch=epoch,
                         min_rows=args.world_size)


@torch.no_grad()
def evaluate(model, split, args, batch_sums, n_sums):
    """Sums of per-batch statistics over a split in eval mode, the evaluation loop of both stages: batch_sums(i,
    idx) -> tensor (n_sums,) for batch number i, rows idx (B,) (batches sorted by length). Under torchrun each rank
    takes every N-th batch and the sums are reduced. Returns n_sums floats (one host synchronisation)."""
    model.eval()
    sums = torch.zeros(n_sums, dtype=accumulator_dtype(args.device), device=args.device)
    for i, idx in enumerate(data.batch_indices(split["lengths"], args.batch_size, shuffle=False)):
        if i % args.world_size == args.rank:
            sums += batch_sums(i, idx).to(sums.dtype)
    model.train()
    return global_sum(sums, args).tolist()


# ---- Device and dtype: where a stage runs, in which precision, and what the hardware can do (MFU's peak).
def pick_device(name):
    """'auto' -> cuda if available, else mps, else cpu; any other string is passed to torch.device (and
    cuda:N becomes the current GPU, so that torch.cuda calls without a device argument mean it). ValueError naming
    the devices this machine has for one it does not have (cuda without a GPU, cuda:7 with one, foo)."""
    mps = torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string
        device = torch.device("meta", 1)  # refused below
    n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if not (device.type == "cpu" or device.type == "meta" and device.index is None or device.type == "mps" and mps
            or device.type == "cuda" and (device.index or 0) < n_gpus):
        there = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count())), *["mps"] * mps]
        raise ValueError(f"--device {name}: no such device here; this machine has {', '.join(there)} (or auto)")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def pick_dtype(name, device):
    """(dtype, reason): bf16 autocast only on CUDA devices that support it; fp16 is never used (NaN-prone)."""
    if name == "fp32":
        return torch.float32, "asked for"
    supported = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if name == "bf16":
        if not supported:
            raise ValueError(f"--dtype bf16 asked for, but {device} does not support bf16; use --dtype fp32")
        return torch.bfloat16, "asked for"
    return (torch.bfloat16, "CUDA with bf16") if supported else (torch.float32, f"no bf16 autocast on {device.type}")


def accumulator_dtype(device):
    """float64 for evaluation sums, except on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def autocast(device, dtype):
    """Mixed-precision context for the forward pass on `device` in `dtype` (a no-op in fp32)."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


# Dense bf16 peak FLOP/s of common GPUs (vendor data sheets); an unknown GPU gets no MFU rather than a wrong one.
PEAK_BF16_FLOPS = {"H200": 989e12, "H200 NVL": 835e12, "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12,
                   "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
                   "A6000": 155e12}


def peak_flops(device, dtype):
    """Peak FLOP/s for MFU, or None (CPU, fp32, or a GPU not in PEAK_BF16_FLOPS)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def device_name(device):
    """What ran the arithmetic, for run records and logs: the GPU's name on CUDA, "MPS, <arch>" on Apple's GPU,
    else the CPU's model name (Linux: /proc/cpuinfo; elsewhere platform.processor(), else the architecture)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"MPS, {platform.machine()}"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return (names[0] if names else "") or platform.processor() or platform.machine()


def peak_flops_of(name):
    """PEAK_BF16_FLOPS of a GPU name: the longest key found in it as whole words ("A10" is not "A10G")."""
    found = [k for k in PEAK_BF16_FLOPS if re.search(rf"(^|\W){re.escape(k)}($|\W)", name)]
    return PEAK_BF16_FLOPS[max(found, key=len)] if found else None


def flops_per_token(cfg, L):
    """Training FLOPs per token (forward + backward) at sequence length L, for MFU (Chowdhery et al. 2022, PaLM
    App. B): 6 x the weights used per token (W_Q, W_K, W_V, W_O and the MLP of every layer, a continuous input
    encoder, the reconstruction head, which SPT applies at every position), plus 12 x n_layers x d_model x keys for
    the scores and their product with V; a query sees L keys, or 3 attn_window under local attention."""
    per_layer = 4 * cfg.d_model ** 2 + (2 * cfg.d_model * cfg.d_mlp if cfg.mlp else 0)
    per_position = (cfg.d_input if cfg.vocab_size == 0 else 0) * cfg.d_model + cfg.n_rec * cfg.d_model
    keys = min(L, 3 * cfg.attn_window) if cfg.attn_window else L
    return 6 * (cfg.n_layers * per_layer + per_position) + 12 * cfg.n_layers * cfg.d_model * keys


# ---- torchrun (DDP): one process per GPU, each training on its share of the global batch.
def setup_distributed(args):
    """Join the process group when started by torchrun (WORLD_SIZE > 1); sets args.rank and args.world_size.
    Each of the N copies trains on rows rank::N of the same global batch; DDP averages the gradients; only rank 0
    prints and writes files. NCCL on CUDA (one GPU per process, LOCAL_RANK), gloo on CPU."""
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    if args.world_size > 1:
        if args.device.type == "cuda":
            args.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(args.device)
        dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo")
        if args.rank != 0:
            sys.stdout = open(os.devnull, "w")  # one copy of every message: rank 0's


def global_sum(t, args):
    """Sum of a tensor over all ranks (itself when not distributed)."""
    if args.world_size > 1:
        dist.all_reduce(t)
    return t


def wrap(model, args):
    """The module the training step calls: DDP under torchrun, torch.compile if asked. Checkpoints always hold
    the plain `model`, so they load anywhere."""
    # no buffer broadcast before each forward: the only buffers (positions, ALiBi slopes) are constants
    net = DistributedDataParallel(model, forward_sync_buffers=False) if args.world_size > 1 else model
    return torch.compile(net) if args.compile else net


def local_rows(args, *tensors):
    """This rank's share of a global batch: rows rank, rank + N, ... (all rows when not distributed)."""
    return [t[args.rank::args.world_size] for t in tensors]


# ---- A run's files: paths, checkpoints, the lock, the record of what made a run, resume ----

def load_newest(candidates, map_location="cpu", who="load"):
    """Of the checkpoints `candidates` (paths), the one of the latest state.step (a tie: the earlier). A missing or
    damaged file is reported (prefixed by `who`) and skipped. Returns (its path, it), or (None, None) when no file
    exists. ValueError with every reason when files exist but none loads."""
    reasons, newest, newest_path = [], None, None
    for path in candidates:
        if not os.path.lexists(path):  # the program's own guess at a name: no "did you mean" (not_a_file)
            print(f"{who}: {path}: no such file; skipped")
            continue
        try:
            ck = data.load_pt(path, map_location=map_location)
            state = ck.get("state") if isinstance(ck, dict) else None
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ValueError(f"{path}: holds no training state (state.step); not a checkpoint of this project")
        except (OSError, ValueError) as e:  # OSError: a folder or a broken link in the file's place, unreadable
            print(f"{who}: {e}; skipped")
            reasons.append(e)
            continue
        if newest is None or ck["state"]["step"] > newest["state"]["step"]:
            newest, newest_path = ck, path
    if newest is not None:
        print(f"{who}: continuing from {newest_path} (step {newest['state']['step']})")
        return newest_path, newest
    if not reasons:
        print(f"{who}: no checkpoint in {os.path.dirname(candidates[0]) or '.'}, starting from scratch")
        return None, None
    raise ValueError(f"{who}: no checkpoint could be loaded: " + "; ".join(map(str, reasons)) +
                     ". Remove them (or run without --resume) to start over")


RUN_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")  # no "/", "..", space or newline: it stays in its folder


def run_paths(out_dir, task, stage, name=None):
    """The files of one run under <out_dir>/<task>/: "pretrain": best = pretrain.pt (finetune.py --init), last =
    pretrain_last.pt (--resume), init = pretrain_init.pt, log = pretrain_log.jsonl, snapshot = pretrain_step{step}.pt;
    "finetune" with a run name: the same for finetune_<name>, and json = finetune_<name>.json. Else ValueError.
    A run name is a plain name (RUN_NAME), so that a run's files stay in <out_dir>/<task>/ and are its own."""
    if stage not in ("pretrain", "finetune") or (stage == "finetune") != (name is not None):
        raise ValueError(f"run_paths: stage {stage!r} with name {name!r}; expected 'pretrain', or 'finetune' "
                         f"with a run name")
    if name is not None and (not RUN_NAME.fullmatch(name) or re.search(r"_(last|init|step\d+)$", name)):
        raise ValueError(f"--name {name!r}: a run name is letters, digits, '_', '.', '+' and '-', not starting with '.' "
                         f"and not ending in _last, _init or _step<N> (the names of a run's own files)")
    stem = os.path.join(out_dir, task, "pretrain" if stage == "pretrain" else f"finetune_{name}")
    paths = dict(best=stem + ".pt", last=stem + "_last.pt", init=stem + "_init.pt", log=stem + "_log.jsonl",
                 snapshot=stem + "_step{step}.pt")
    return dict(paths, json=stem + ".json") if stage == "finetune" else paths


def run_stem(path):
    """The stem of the run a checkpoint belongs to (run_paths' names): out/x/pretrain_last.pt -> out/x/pretrain."""
    return re.sub(r"(_last|_step\d+|_init)$", "", os.path.splitext(path)[0])


def run_init_path(path):
    """The _init.pt of the run a checkpoint belongs to (run_paths' names), or None if it is missing."""
    init = run_stem(path) + "_init.pt"
    return init if os.path.exists(init) else None


def run_files(paths):
    """The files of the run `paths` (run_paths) that exist: checkpoints, snapshots, log, JSON, and save_atomic's
    temporaries of them (<file>.<pid>.tmp: left by a killed write). Not the lock."""
    folder, stem = os.path.split(paths["log"][:-len("_log.jsonl")])
    ends = "|".join(re.escape(os.path.basename(p)[len(stem):]).replace(r"\{step\}", r"\d+") for p in paths.values())
    pattern = re.compile(re.escape(stem) + f"({ends})" + r"(\.\d+\.tmp)?")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder or ".") if pattern.fullmatch(f))


def lock_run(path):
    """The lock file `path`, open and locked (fcntl.flock), holding this process's pid, host and command. The
    system drops the lock when the process ends, even killed. FileExistsError naming the holder if another process
    holds it; the record of a process that ended without releasing it (killed) is said and taken over."""
    f = open(path, "a+")
    f.seek(0)
    before = f.read().strip()  # the holder's record, or a killed process's
    try:
        if fcntl is None:
            print(f"{path}: not locked (no fcntl on {platform.system()}): start one run of it at a time")
        else:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise FileExistsError(f"{path}: this run is being written by {before or 'another process'}; wait for it to "
                              f"end, or give another --out_dir") from None
    f.seek(0)
    before = f.read().strip()  # read again under the lock: a record still there is a killed process's
    if before and fcntl is not None:
        print(f"{path}: taken over from {before}, which ended without releasing it (killed?)")
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {platform.node()}: {' '.join(sys.argv)}\n")
    f.flush()
    return f


def running_holder(checkpoint):
    """The record (pid, host, command) of the process that holds the run of `checkpoint` (a run_paths file) now,
    or None: its run is finished, stopped, or never locked (no fcntl)."""
    lock = run_stem(checkpoint) + ".lock"
    if fcntl is None or not os.path.exists(lock):
        return None
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
    return None


@contextlib.contextmanager
def own_run(paths, args):
    """Hold the run whose files are `paths` (run_paths) while a stage writes them: rank 0 takes <stem>.lock
    (lock_run; the file stays, emptied at the end: removing it would race with a process locking it). A run whose
    files exist is refused (FileExistsError) unless args.resume, or args.overwrite, which removes them first;
    left-over temporaries go. Yields the run: a dict with its "paths", that `train` fills (model, loop state, ...).
    On Ctrl-C, SIGTERM or SIGHUP the exception gets the one line run_stage prints: the step the run reached."""
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run, --overwrite removes it: give one of them")
    stem, folder, lock = paths["log"][:-len("_log.jsonl")], os.path.dirname(paths["log"]) or ".", None
    if args.rank == 0:  # the other ranks write nothing
        os.makedirs(folder, exist_ok=True)
        lock = lock_run(stem + ".lock")
    run = dict(paths=paths, args=args, lock=lock, folder=(folder, os.stat(folder)) if lock else None)
    try:
        old = run_files(paths) if os.path.isdir(folder) else []  # every rank: each refuses on its own
        kept = [os.path.basename(f) for f in old if not f.endswith(".tmp")]
        if kept and not (args.resume or args.overwrite):
            raise FileExistsError(f"{folder} holds this run's files already ({', '.join(kept[:4])}"
                                  f"{', ...' * (len(kept) > 4)}): --resume continues it, --overwrite removes it "
                                  f"first, or give another --out_dir")
        removed = (old if args.overwrite else [f for f in old if f.endswith(".tmp")]) if lock else []
        for f in removed:
            os.remove(f)
        if removed:
            print(f"removed {len(removed)} files in {folder}: " + (
                "the earlier run's (--overwrite)" if args.overwrite else "temporaries of killed writes"))
        if getattr(args, "world_size", 1) > 1:
            dist.barrier()  # every rank has checked the folder before rank 0 writes in it
        yield run
    except (KeyboardInterrupt, OSError) as e:  # one line: the step reached, the last checkpoint, how to continue
        last = paths["last"]
        try:
            saved = f"the last checkpoint is {last} (step {data.load_pt(last, mmap=True)['state']['step']})"
        except (OSError, ValueError, KeyError):
            saved = "no checkpoint was written yet"
        step = f"at step {run['state']['step']} of {run['total']}" if "state" in run else "before training"
        how = "--resume instead of --overwrite" if args.overwrite else "--resume"
        if isinstance(e, OSError):  # no space, a file too large, ...: once mended, the run goes on
            if e.strerror and "state" in run:
                e.strerror += f" (stopped {step}; {saved}; once that is mended, the same command with {how} continues)"
        else:
            e.args = (f"interrupted {step}; {saved}; the same command with {how} continues" if args.rank == 0 else
                      f"rank {args.rank} stopped (rank 0 says why)",)
        raise
    finally:
        if lock:
            lock.truncate(0)
            lock.close()


def plain_config(args):
    """The run's flags as a JSON- and weights_only-safe dict (devices and dtypes become strings)."""
    return {k: (str(v) if isinstance(v, (torch.device, torch.dtype)) else v) for k, v in vars(args).items()}


def git_state(folder=None):
    """(commit, modified) of the git checkout holding `folder` (default: this file's): HEAD's hash and the sorted
    tracked files that differ from it (a run made with uncommitted code says so); (None, None) outside one."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                              cwd=folder or os.path.dirname(os.path.abspath(__file__))).stdout
    try:
        commit = git("rev-parse", "HEAD").strip() or None
        if commit is None:
            return None, None
        return commit, sorted(line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines())
    except (OSError, subprocess.SubprocessError):
        return None, None


def truncate_log(path, step):
    """Drop the lines of a run's log past `step` (logged again by the resumed run) and an unfinished last line,
    so each step appears once. Rewritten atomically."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = [line for line in lines if line.endswith("\n") and json.loads(line).get("step", 0) <= step]
    if len(keep) < len(lines):
        data.save_atomic("".join(keep), path)
        print(f"--resume: dropped {len(lines) - len(keep)} lines of {path} logged after step {step} (logged again)")


# Flags a resumed run must share with its checkpoint (--epochs and --max_steps only say where to stop, and may
# grow; --dtype may change, e.g. fp32 after bf16 overflowed): the schedule and the evaluation grid.
RESUME_SAME = ("lr", "warmup", "weight_decay", "grad_clip", "seed", "mask_ratio", "rec_loss", "init", "inherit",
               "freeze", "batch_size", "eval_every", "eval_each_epoch")


def check_resumable(ck, cfg, n_batches, data_sha256=None, config=None, init_sha256=None):
    """Raise ValueError unless checkpoint `ck` continues this run: the same model config (cfg: ModelConfig's
    fields as a dict), epoch length (n_batches), data (data_sha256: {split: sha256}), RESUME_SAME flags (config:
    plain_config of this run) and, for finetuning, SPT weights (init_sha256: the --init file's sha256)."""
    saved = ck["model_config"]  # a field it lacks (or the code no longer has) is not a difference
    diff = {k: (saved[k], v) for k, v in cfg.items() if saved.get(k, v) != v}
    saved_config = ck.get("config") or {}
    same_weights = bool(ck.get("init_sha256") and init_sha256)  # --init compared by content, not by spelling
    diff.update({k: (saved_config[k], config[k]) for k in RESUME_SAME
                 if config and k in saved_config and k in config and saved_config[k] != config[k]
                 and not (k == "init" and same_weights)})
    if diff:
        raise ValueError("--resume: the checkpoint was made with " + ", ".join(
            f"{k}={old!r}" for k, (old, _) in diff.items()) + "; this run has " + ", ".join(
            f"{k}={new!r}" for k, (_, new) in diff.items()) + ": resume with the same flags (or start a new --out_dir)")
    if ck["state"]["n_batches"] != n_batches:
        raise ValueError(f"--resume: the checkpoint's epochs have {ck['state']['n_batches']} batches, this run's "
                         f"{n_batches} (another --batch_size or number of processes): resume with the same ones")
    saved_data = ck.get("data_sha256")
    if saved_data and data_sha256 and saved_data != data_sha256:
        split = next(s for s in saved_data if saved_data[s] != data_sha256.get(s))
        raise ValueError(f"--resume: the checkpoint was trained on other data ({split}.pt sha256 "
                         f"{saved_data[split][:12]}..., this run's {str(data_sha256.get(split))[:12]}...: another "
                         f"--data_dir, or the data was made again): resume on the same data (or start a new --out_dir)")
    saved_init = ck.get("init_sha256")
    if saved_init and init_sha256 and saved_init != init_sha256:
        raise ValueError(f"--resume: this run started from SPT weights of sha256 {saved_init[:12]}... (--init "
                         f"{ck.get('init')}), but --init {(config or {}).get('init')} holds {init_sha256[:12]}... "
                         f"(pretrained again or further?): finetune the new weights in a new run (another --name or "
                         f"--out_dir, without --resume)")


def run_record(args):
    """Plain-type description of the run: its settings and what produced it (stored in checkpoints). The CPU and
    thread count are recorded because float sums, and so trained weights, depend on them."""
    commit, modified = git_state()
    return dict(config=plain_config(args), git_commit=commit, git_modified=modified,
                torch_version=str(torch.__version__), python=platform.python_version(),
                device_name=device_name(args.device), threads=torch.get_num_threads())


def append_log(run, entry):
    """One JSON line in paths["log"] (rank 0 only), in the folder the run holds (check_owned). An OS fault (a full
    disk, a file size limit) names the log; resume drops a half-written last line (truncate_log)."""
    if run["args"].rank == 0:
        check_owned(run)
        try:
            with open(run["paths"]["log"], "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            e.filename = e.filename or run["paths"]["log"]
            raise


def check_owned(run):
    """FileNotFoundError unless the run's folder and lock file are still the ones own_run locked (the same device
    and inode): a run stopped for a while (kill -STOP) whose folder was removed, or taken by a new run, meanwhile,
    must not write into another run's files. Called before every checkpoint and log write (rank 0)."""
    if run.get("lock") is None:  # not a run own_run holds (ranks other than 0 write nothing)
        return
    (folder, folder_stat), lock = run["folder"], run["lock"]
    try:
        same = os.path.samestat(os.stat(folder), folder_stat) and os.path.samestat(os.stat(lock.name),
                                                                                    os.fstat(lock.fileno()))
    except FileNotFoundError:
        same = False
    if not same:
        raise FileNotFoundError(f"{folder}: this run's folder, or its lock {lock.name}, was removed or replaced while "
                                f"the run was stopped: it stops without writing, so as not to mix its files with "
                                f"another run's; start it again (in another --out_dir to keep both)")


def resume(model, opt, paths, n_batches, total, args, extra):
    """Load the newest of paths["last"], paths["best"] into model and optimizer, restore the RNG states and drop
    the log lines past it; returns the loop state, or None. ValueError for another run's (check_resumable) or one
    past this run's `total` steps."""
    # Loaded on the CPU: load_state_dict copies onto the model's device, and the CPU copy is freed right after.
    path, ck = load_newest([paths["last"], paths["best"]], "cpu", "--resume")
    if ck is None:
        return None
    check_resumable(ck, dataclasses.asdict(model.cfg), n_batches, extra.get("data_sha256"), plain_config(args),
                    extra.get("init_sha256"))
    if ck["state"]["step"] > total:  # read back as this run, it would hand on weights trained longer than asked
        raise ValueError(f"--resume: the checkpoint in {os.path.dirname(path) or '.'} is at step {ck['state']['step']}, "
                         f"past this run's {total} steps (--epochs {args.epochs}, --max_steps {args.max_steps}): give "
                         f"the budget it ran with, or start a new --out_dir")
    if path != paths["last"] and args.rank == 0:  # stopped before its last write, or that file is damaged
        data.save_atomic(ck, paths["last"])
    here = dict(device_name=device_name(args.device), threads=torch.get_num_threads())
    if other := {k: ck[k] for k, v in here.items() if ck.get(k) not in (None, v)}:  # float sums in another order
        print(f"note: the checkpoint was made with {other}, this process has {here}: the run goes on, but not "
              f"bit-identical to one that never stopped (float sums add in another order)")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    torch.set_rng_state(ck["rng_state"])
    if args.device.type == "cuda" and ck.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(ck["cuda_rng_state"], args.device)
    if args.rank == 0:
        truncate_log(paths["log"], ck["state"]["step"])
    print(f"resumed at step {ck['state']['step']} (epoch {ck['state']['epoch']})")
    return ck["state"]


# ---- The command line every stage shares ----

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except None: those flags take the preset's value (pretrain.resolve)."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def prepare_data(args, preset):
    """Load train/val/test of args.task onto args.device, made first if missing (by rank 0 under torchrun), and
    check them against the settings the preset and flags imply (data.check_settings)."""
    settings = data.expected_settings(args.task, preset["data"], {k: getattr(args, k) for k in data.STAGE_DATA_FLAGS})
    if args.rank == 0:
        data.make_data(args.task, args.data_dir, settings, args.download)
    if args.world_size > 1:  # a download may take hours: a barrier with a long timeout of its own
        dist.barrier(group=dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=3)))
    splits = data.load_splits(args.data_dir, args.task, args.device)
    data.check_settings(splits["train"]["meta"], settings, args.task, args.data_dir, args.preset, args.accept_data)
    print(f"data {args.data_dir}/{args.task}: " + ", ".join(
        f"{s} {len(splits[s]['labels'])} (sha256 {splits[s]['meta']['file_sha256'][:12]})" for s in data.SPLITS))
    return splits


def run_stage(main_fn):
    """data.run_cli for the stages, which also handle SIGTERM and SIGHUP (here only) as Ctrl-C: one line, the
    step reached (own_run), exit status 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    def stop(signum, frame):  # as Ctrl-C: own_run's line; data.run_cli exits with 128 + signum
        e = KeyboardInterrupt()
        e.signum = signum
        raise e
    for name in ("SIGTERM", "SIGHUP"):  # Windows has no SIGHUP
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)

    def main_within_memory(argv):  # out of memory: one line with the way out, not torch's 20 frames
        try:
            main_fn(argv)
        except RuntimeError as e:  # torch.OutOfMemoryError on a GPU, "can't allocate memory" on the CPU
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            raise MemoryError(f"out of memory ({str(e).strip().splitlines()[0][:160]}): rerun with a smaller "
                              f"--batch_size (or --max_len, or --preset cpu), in a new run (--overwrite or another "
                              f"--out_dir: --resume keeps the batch size)") from e
    data.run_cli(main_within_memory)


if __name__ == "__main__":
    run_stage(main)
