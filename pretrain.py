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

Reading order: PRESETS, the SPT objective (mask_batch, reconstruction_loss, spt_loss_fn), main. Below the
double line is the engine both stages share: flags, device, DDP, and the training loop `train`.
"""
import argparse
import copy
import math
import os
import shlex
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
from data import (NON_NEGATIVE, POSITIVE, POSITIVE_FLOAT, HelpFormatter, accumulator_dtype, autocast, device_name,
                  global_sum, local_rows, number_at_least, peak_flops, pick_device, pick_dtype, setup_distributed, wrap)
from model import INIT_SCHEMES, POSITIONS, ModelConfig, Transformer, checkpoint_dict, on

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
                    pretrain=dict(batch_size=16, lr=1e-3, warmup=50, epochs=1, eval_every=150, max_steps=450),
                    finetune=dict(batch_size=16, lr=1e-3, warmup=50, epochs=1, eval_every=150, max_steps=450))},
    # The minimal model of Coser et al. Sec. 4: one layer, one head, no LayerNorm, no MLP (width ours: 32).
    "synthetic": dict.fromkeys(("paper", "cpu"), dict(
        model=dict(n_layers=1, d_model=32, n_heads=1, d_mlp=32, layernorm=False, mlp=False),
        data=dict(n_train=5000, n_val=1000, n_test=1000),
        pretrain=dict(batch_size=64, lr=1e-3, warmup=0, epochs=15, eval_every=500),
        finetune=dict(batch_size=64, lr=1e-3, warmup=0, epochs=15, eval_every=500))),
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
    valid = torch.arange(L, device=x.device)[None, :] < on(lengths, x.device)[:, None]
    u = torch.rand(B, L, generator=generator, device=x.device)
    masked = (u < ratio) & valid
    # The real position with the smallest u is the one to force-mask in rows that drew none.
    forced = F.one_hot(u.masked_fill(~valid, 2.0).argmin(dim=1), L).bool()
    masked = masked | (forced & ~masked.any(dim=1, keepdim=True))
    if x.dtype == torch.long:
        return x.masked_fill(masked, mask_id), masked
    indicator = masked[..., None].to(x.dtype)                                  # (B, L, 1)
    return torch.cat([x * (1 - indicator), indicator], dim=-1), masked


def reconstruction_loss(outputs, targets, kind="ce", mask=None):
    """Mean reconstruction loss over the M masked positions (Coser et al., Sec. 2, L_SPT).

    Without `mask`: outputs (M, n_rec) at the masked positions; targets (M,) int64 for "ce" (cross-entropy over
    the vocabulary), (M, n_rec) float for "mse" (1/2 ||r - u||^2) and "l1". With `mask` (B, L) bool: outputs
    (B, L, n_rec) and targets (B, L) or (B, L, n_rec) at every position, and the loss of the positions where
    `mask` is True (the training step's form: no data-dependent shape, so no host synchronisation on a GPU).
    Normalized by M, the number of masked positions; M = 0 gives 0 (a zero with a graph, not 0/0 = NaN).
    """
    if kind == "ce":
        per = F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten(), reduction="none")
    elif kind in ("mse", "l1"):
        diff = outputs.float() - targets
        per = (0.5 * diff.pow(2) if kind == "mse" else diff.abs()).sum(dim=-1).flatten()
    else:
        raise ValueError(f"unknown reconstruction loss {kind!r}")
    if mask is None:
        return per.sum() / max(per.numel(), 1)
    mask = mask.flatten().to(per.dtype)
    return (per * mask).sum() / mask.sum().clamp(min=1)


def targets_at(x, masked, rec_loss, meta):
    """Reconstruction targets at the masked positions (`masked` (B, L) bool: (M,) or (M, C)) or, with masked
    None, at every position ((B, L) or (B, L, C)): token ids, values, or for pixel tasks with the cross-entropy
    loss the raw intensity class 0..255, undoing the normalization of data.get_batch."""
    targets = x if masked is None else x[masked]
    if rec_loss == "ce" and meta["kind"] == "pixels":
        pixels = (targets[..., 0] * meta["pixel_std"] + meta["pixel_mean"]) * 255
        return pixels.round().long().clamp(0, 255)
    return targets


def spt_loss_fn(net, split, args):
    """The training step's loss_fn for `train`: (idx (B,), step) -> (sum of the masked loss over this rank's
    masked positions, their number). Masks differ per step and are reproducible (seeded by seed and step), so a
    resumed run draws the same ones. Retrieval: each document of a pair is masked on its own."""
    meta, g = split["meta"], mask_generator(args, 0)

    def loss_fn(idx, step):
        x, lengths = data.single_sequences(*data.get_batch(split, idx, args.device)[:2])
        g.manual_seed(args.seed * 1_000_003 + step)
        inputs, masked = mask_batch(x, lengths, args.mask_ratio, meta.get("mask_id"), g)
        x, lengths, inputs, masked = local_rows(args, x, lengths, inputs, masked)  # this rank's rows
        with autocast(args.device, args.dtype):
            out = net(inputs, lengths, True)  # every position: (B, L, n_rec), no host synchronisation
        n = masked.sum()
        return reconstruction_loss(out, targets_at(x, None, args.rec_loss, meta), args.rec_loss, masked) * n, n
    return loss_fn


def evaluate_reconstruction(model, split, args):
    """Validation masked loss, and masked-token accuracy (cross-entropy) or masked MAE (regression: the mean
    absolute error per masked value, Amos et al.'s `masked_mae`).

    Returns {"val_loss", "val_acc" or "val_mae"}: floats. Batch i gets the same masks at every evaluation.
    """
    meta = split["meta"]

    def batch_sums(i, idx):  # loss sum, correct (or absolute error) sum, count
        x, lengths = data.single_sequences(*data.get_batch(split, idx, args.device)[:2])
        g = mask_generator(args, 12345 + i)  # the same masks at every evaluation: the weights decide the best
        inputs, masked = mask_batch(x, lengths, args.mask_ratio, meta.get("mask_id"), g)
        with autocast(args.device, args.dtype):
            out = model.reconstruct(inputs, lengths, True)  # as in training: every position, then the mask
        acc = accumulator_dtype(args.device)  # the sums in float64 (float32 on MPS), as the loop adds them
        targets, n = targets_at(x, None, args.rec_loss, meta), masked.sum().to(acc)
        if args.rec_loss == "ce":
            second = ((out.argmax(-1) == targets) & masked).sum()
        else:  # |r - u| averaged over the channels, summed over the masked positions
            second = ((out.float() - targets).abs().mean(dim=-1) * masked).sum()
        return torch.stack([reconstruction_loss(out, targets, args.rec_loss, masked).to(acc) * n, second.to(acc), n])

    loss_sum, second, count = data.evaluate(model, split, args, batch_sums, 3)
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
    """Self-pretraining: python pretrain.py --task TASK [flags]; writes data.run_paths(out_dir, task, "pretrain")."""
    parser = pretrain_parser()
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v != parser.get_default(k)}  # before the preset fills them
    args, preset = resolve(args, "pretrain")
    if args.mask_ratio is None:
        args.mask_ratio = MASK_RATIO[data.task_family(args.task)]
    splits = data.prepare_data(args, preset)
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
    paths = data.run_paths(args.out_dir, args.task, "pretrain")
    extra = dict(stage="pretrain", task=args.task, data_meta=meta, data_sha256=data.data_hashes(splits),
                 metric="val_loss", format_version=1)
    print(f"self-pretraining {args.task}: {cfg}")
    with data.own_run(paths, args):
        best = train(model, splits, args, spt_loss_fn(wrap(model, args), splits["train"], args),
                     lambda step: evaluate_reconstruction(model, splits["val"], args), paths, extra, False)
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
          f"to see SPT's effect on a CPU in about a minute: python ablate.py demo")


def next_commands(task, checkpoint, given):
    """The two finetune.py commands that follow a pretrain.py run (shell strings): from its checkpoint, and the
    from-scratch baseline. Both carry the run's data and run flags (`given`: {name: value} of the flags that
    differ from their defaults); the baseline also its model flags, so that it builds the model SPT trained."""
    def flags(names):
        return "".join(f" --{k}" if given[k] is True else f" --{k} {shlex.quote(str(given[k]))}"
                       for k in names if k in given and given[k] is not None)
    both = flags(("data_dir", "out_dir", "preset", "seed", "device", "dtype", "max_len", "resolution", "difficulty"))
    model = flags(MODEL_FLAGS)
    return (f"python finetune.py --task {task} --init {shlex.quote(checkpoint)}{both}",
            f"python finetune.py --task {task} --init scratch{both}{model}")


# ==== The engine shared with finetune.py (a first reading can stop here): flags and presets, device, the
# ==== training loop `train` with its step, logging and checkpoints (data.py holds the run's files and DDP).

MODEL_SIZE_FLAGS = ("n_layers", "d_model", "n_heads", "d_mlp")


def build_parser(stage, description):
    """The flags every stage shares (defaults of None are filled from the preset by `resolve`)."""
    p = data.ArgumentParser(description=description, formatter_class=HelpFormatter,
                            epilog="A flag shown without a default takes the preset's value (pretrain.PRESETS).")
    p.add_argument("--task", required=True, choices=data.TASKS, help="which data set")
    p.add_argument("--data_dir", default="data", help="root of data/<task>/*.pt")
    p.add_argument("--out_dir", default="out", help="root of out/<task>/ checkpoints and logs")
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
MODEL_FLAGS = {**{k: k for k in MODEL_SIZE_FLAGS}, "pos": "pos", "init_scheme": "init", "init_std": "init_std",
               "init_scale": "init_scale"}


def resolve(args, stage):
    """Fill unset flags from the preset; pick device and dtype. Returns args (modified) and the model preset."""
    args.device = pick_device(args.device)
    setup_distributed(args)
    if args.preset == "auto":
        args.preset = "paper" if args.device.type == "cuda" else "cpu"
    preset = fill_from_preset(args, stage)
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


def train(model, splits, args, loss_fn, eval_fn, paths, extra, higher_is_better):
    """Optimize `model` on splits["train"] with AdamW; evaluate and checkpoint every args.eval_every steps and,
    with args.eval_each_epoch, at the end of every epoch. With args.resume the run goes on exactly.

    loss_fn(idx (B,) global batch indices, step) -> (sum of the loss over this rank's items, their count).
    eval_fn(step) -> {"val_...": float}; extra["metric"] names the one that picks the best checkpoint.
    Returns the best evaluation's metrics with "step", "epoch", "elapsed_s" (wall-clock seconds over every
    process that resumed the run) and "steps_trained" (0 for a --resume of a finished run).
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay, fused=args.device.type == "cuda")
    n_batches = len(data.epoch_batches(splits["train"], args, 0))  # the same for every epoch
    total = min(args.max_steps or math.inf, args.epochs * n_batches)
    state = dict(step=0, epoch=0, batch_in_epoch=0, best=None, best_metrics=None, n_batches=n_batches)
    if args.resume:
        state = data.resume(model, opt, paths, n_batches, args, extra) or state
        if state["step"] > total:  # read back as this run, it would hand on weights trained longer than asked
            raise ValueError(f"--resume: the checkpoint in {os.path.dirname(paths['last']) or '.'} is at step "
                             f"{state['step']}, past this run's {total} steps (--epochs {args.epochs}, --max_steps "
                             f"{args.max_steps}): give the budget it ran with, or start a new --out_dir")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{n_params:,} trainable parameters; {total} steps ({n_batches} per epoch)")
    run = data.HELD["run"] = dict(
        model=model, opt=opt, state=state, args=args, paths=paths, extra=extra, record=data.run_record(args),
        eval_fn=eval_fn, higher_is_better=higher_is_better, total=total, t_process=time.time(),
        elapsed0=state.get("elapsed_s", 0.0))  # seconds the run spent in earlier processes (--resume)
    if state["step"] == 0:
        start_fresh(run)
    meter, width = new_meter(args), data.split_width(splits["train"])
    run["t_start"], run["start_step"] = time.time(), state["step"]
    model.train()
    while state["step"] < total:
        batches = data.epoch_batches(splits["train"], args, state["epoch"])
        for i in range(state["batch_in_epoch"], len(batches)):
            lr = get_lr(state["step"], args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = optimizer_step(run, loss_fn, batches[i])
            state["step"], state["batch_in_epoch"] = state["step"] + 1, i + 1
            count_step(meter, loss, splits["train"]["lengths"][batches[i]], model.cfg, width)
            done = state["step"] >= total
            if state["step"] % args.log_every == 0 or done:
                log_progress(run, meter, lr)
            end_of_epoch, epoch = i + 1 == len(batches), state["epoch"]
            if end_of_epoch:
                state["epoch"], state["batch_in_epoch"] = epoch + 1, 0
            if state["step"] % args.eval_every == 0 or done or (end_of_epoch and args.eval_each_epoch):
                if meter["steps"]:  # a NaN/inf loss since the last log line stops the run before any checkpoint
                    check_finite(run, meter["loss"].item(), state["step"] - meter["steps"] + 1)
                t_eval = time.time()  # .item() above waited for the queued steps: the evaluation's time starts now
                evaluate_and_checkpoint(run, epoch)
                meter["t_last"] += time.time() - t_eval  # evaluation time does not count in ms/step and tokens/s
            if done:
                break
    data.check_trained(state, extra["metric"], last_good(run))  # a finite evaluation, at most half the steps skipped
    if state["step"] > run["start_step"]:
        print(f"finished {state['step']} steps in {(time.time() - run['t_start']) / 60:.1f} min; "
              f"best {extra['metric']} {state['best']:.4f}")
    else:  # --resume of a finished run: its checkpoints are read back, not written again
        print(f"the run in {os.path.dirname(paths['last']) or '.'} had already finished its {total} steps: nothing "
              f"trained, its checkpoints are unchanged; best {extra['metric']} {state['best']:.4f}")
    if args.world_size > 1:
        dist.barrier()  # rank 0 has written its checkpoints before anyone reads them
    return dict(state["best_metrics"], step=state.get("best_step"), epoch=state.get("best_epoch"),
                elapsed_s=run["elapsed0"] + time.time() - run["t_process"],
                steps_trained=state["step"] - run["start_step"])


def start_fresh(run):
    """Step 0 of a new run: a fresh log, an evaluation of the initial weights (the log shows how far training
    moves the metric) and the _init.pt checkpoint the analyses start from."""
    if run["args"].rank == 0:
        open(run["paths"]["log"], "w").close()
    metrics = run["eval_fn"](0)
    print("eval at step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    data.append_log(run, dict(step=0, epoch=0, **metrics))
    save_checkpoint(run, run["paths"]["init"], metrics)


def optimizer_step(run, loss_fn, idx):
    """One AdamW step on the global batch `idx`; returns the loss as a device tensor (no host synchronisation,
    except with --skip_nonfinite), or None for a step that flag skipped."""
    args, opt, state = run["args"], run["opt"], run["state"]
    loss_sum, count = loss_fn(idx, state["step"])
    count = global_sum(count.detach().to(torch.float32), args)
    # DDP averages gradients over ranks, hence x world_size: the gradient is that of sum / count overall
    (loss_sum * args.world_size / count).backward()
    loss = global_sum(loss_sum.detach(), args) / count
    grads = [p.grad for p in run["model"].parameters() if p.grad is not None]
    # A host sync, only with this flag; a finite loss can still have an inf/NaN gradient, hence its norm too.
    if args.skip_nonfinite and not (torch.isfinite(loss) & torch.isfinite(torch.nn.utils.get_total_norm(grads))):
        print(f"step {state['step'] + 1}: non-finite loss or gradient, update skipped")
        opt.zero_grad(set_to_none=True)  # every gradient None: AdamW's step below changes nothing
        data.count_skipped(state)  # gives up at 50 of the last 100
        loss = None
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run["model"].parameters(), args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def new_meter(args):
    """What the next log line reports, summed since the last one: loss (a device tensor), steps, skipped steps,
    real tokens, padded tokens (the positions computed on), training FLOPs, and the wall-clock start."""
    return dict(t_last=time.time(), loss=torch.zeros((), device=args.device), steps=0, skipped=0, tokens=0, padded=0,
                flops=0.0)


def count_step(meter, loss, batch_lengths, cfg, width, multiple=64):
    """Add one step to the meter. batch_lengths (B,) or (B, 2) live on the CPU, so this never waits for the
    device; width and multiple give the batch's padded length (data.batch_width). loss None: a skipped step."""
    if loss is None:
        meter["skipped"] += 1
    else:
        meter["loss"] += loss.detach()
    meter["steps"] += 1
    meter["tokens"] += int(batch_lengths.sum())
    meter["padded"] += batch_lengths.numel() * data.batch_width(batch_lengths, width, multiple)
    L_batch = int(batch_lengths.max())
    meter["flops"] += data.flops_per_token(cfg, L_batch) * batch_lengths.numel() * L_batch  # x2 for pairs


def log_progress(run, meter, lr):
    """Print and log the mean loss, ms/step, real tokens/s, the real share of the padded tokens, MFU (GPUs in
    data.PEAK_BF16_FLOPS), CUDA's peak memory so far and an ETA. The .item() here is the loop's one regular host
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
    print(f"step {state['step']:6d}/{run['total']} | epoch {state['epoch']} | loss "
          f"{'-' if mean_loss is None else f'{mean_loss:.4f}'}{skipped} | lr {lr:.2e} | "
          f"{1000 * dt / meter['steps']:.0f} ms/step | {meter['tokens'] / dt:,.0f} tok/s | "
          f"{100 * meter['tokens'] / meter['padded']:.0f}% real | " + (f"MFU {100 * mfu:.1f}% | " if mfu else "")
          + (f"peak {mem:.1f} GiB | " if mem is not None else "") + f"ETA {eta / 60:.1f} min")
    data.append_log(run, dict(step=state["step"], epoch=state["epoch"], loss=mean_loss, lr=lr,
                              ms_per_step=1000 * dt / meter["steps"], tokens_per_s=meter["tokens"] / dt,
                              real_fraction=meter["tokens"] / meter["padded"], mfu=mfu, peak_memory_gib=mem,
                              **({"skipped": meter["skipped"]} if meter["skipped"] else {})))
    meter.update(new_meter(args))


def evaluate_and_checkpoint(run, epoch):
    """Evaluate (eval_fn), keep the best metrics (is_better), and write the best checkpoint (if improved), the
    last one (for --resume) and with --snapshots a copy per evaluation."""
    args, state, paths, metric = run["args"], run["state"], run["paths"], run["extra"]["metric"]
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
    data.append_log(run, dict(step=state["step"], epoch=epoch, **metrics))
    # Snapshot, best, last: a run stopped inside these writes resumes from the newest complete checkpoint
    # (data.load_newest): before this evaluation, which it then makes again, or from the best, after the snapshot.
    if args.snapshots:  # a copy per evaluation, for curves over training (analyze.py curves)
        save_checkpoint(run, paths["snapshot"].format(step=state["step"]), metrics)
    if improved:
        save_checkpoint(run, paths["best"], metrics)
    save_checkpoint(run, paths["last"], metrics)


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
    atomically (data.save_atomic)."""
    args = run["args"]
    if args.rank != 0:
        return
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


if __name__ == "__main__":
    data.run_cli(main)
