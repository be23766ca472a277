"""pretrain.py -- self-pretraining (SPT): masked reconstruction on the task's own training split.

The story (Amos et al. ICLR 2024; Coser et al. Sec. 2). Each real position is masked independently with the
task's ratio (MASK_RATIO). Masked tokens become <mask>. Masked values and pixels become 0, and an extra input
channel says "masked". A linear head reconstructs every position; the loss counts the masked ones only
(cross-entropy for tokens, MSE for values), divided by their number. No external data is used. finetune.py then
starts from the checkpoint with the best validation masked loss.

    python pretrain.py --task listops                  # CPU: 2 x 64 model, 450 steps
    python pretrain.py --task listops --preset paper   # GPU: the paper's model (6 x 512, 8 heads), 100 epochs
    python pretrain.py --task synthetic --snapshots    # the minimal model on trajectories
    torchrun --standalone --nproc_per_node=8 pretrain.py --task text   # several GPUs (DDP)

Reads data/<task>/{train,val}.pt (made by data.py; here if missing). Writes out/<task>/pretrain*.* (run_paths).
On ListOps' CPU preset SPT shows that the pipeline runs, not an SPT effect. To see SPT work on a CPU: ablate.py demo.

Reading order: PRESETS, the SPT objective (mask_batch, reconstruction_loss, spt_loss_fn), main. Below the double
line is the engine both stages share: flags, the training loop `train` (with its checkpoints and --resume), device,
DDP, a run's files (names, lock, record) and the command line.
"""
import argparse
import contextlib
import copy
import dataclasses
import datetime
import fcntl
import glob
import json
import math
import os
import platform
import re
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
    # Every UCR data set (task ucr/<Name>; the paper gives no sizes): a budget in steps, as sets have a few batches.
    "ucr": dict.fromkeys(("paper", "cpu"), dict(
        model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128), data=dict(val_fraction=0.2),
        pretrain=dict(batch_size=32, lr=3e-3, warmup=20, epochs=10**6, eval_every=20,
                      max_steps=500, eval_each_epoch=False),
        finetune=dict(batch_size=32, lr=1e-3, warmup=20, epochs=10**6, eval_every=20,
                      max_steps=500, eval_each_epoch=False))),
    "text": {
        "paper": dict(model=dict(n_layers=6, d_model=512, n_heads=8, d_mlp=2048, cls_mlp=True), data=dict(max_len=4096),
                      pretrain=dict(batch_size=32, lr=1e-3, warmup=5000, epochs=32, eval_every=10**9, weight_decay=0.1),
                      finetune=dict(batch_size=32, lr=1e-4, warmup=2000, epochs=65, eval_every=10**9,
                                    weight_decay=0.1)),
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
                      data=dict(), **dict.fromkeys(("pretrain", "finetune"), dict(
                          batch_size=32, lr=5e-4, warmup=5000, epochs=200, eval_every=10**9))),
        "cpu": dict(model=dict(n_layers=2, d_model=64, n_heads=4, d_mlp=128, pooling="max", attn_window=256),
                    data=dict(generate_if_missing=200), **dict.fromkeys(("pretrain", "finetune"), dict(
                        batch_size=2, lr=1e-3, warmup=20, epochs=1000, eval_every=20, max_steps=20)))},
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
                        help="of values and pixels (reconstruction_loss; ce: pixels only); tokens: always ce")
    return parser


def main(argv=None):
    """Self-pretraining: python pretrain.py --task TASK [flags]; writes run_paths(out_dir, task, "pretrain")."""
    parser = pretrain_parser()
    args = parser.parse_args(argv)
    preset = resolve(args, "pretrain", parser)
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
    record = run_record(args, stage="pretrain", task=args.task, data_meta=meta, data_sha256=data.data_hashes(splits),
                        same=dict(data=data.data_hashes(splits), mask_ratio=args.mask_ratio, rec_loss=args.rec_loss))
    print(f"self-pretraining {args.task}: {cfg}")
    with own_run(paths, args):
        best = train(model, splits, args, spt_loss_fn(wrap(model, args), splits["train"], args),
                     lambda step: evaluate_reconstruction(model, splits["val"], args), paths, record,
                     metric="val_loss", maximize=False)
    print(f"best validation masked loss {best['val_loss']:.4f} (step {best['step']}): {paths['best']}")
    if args.world_size > 1:
        dist.destroy_process_group()
    print(f"next: python finetune.py --task {args.task} --init {paths['best']}, and --init scratch for the baseline")


# ======================================================================================================
# ==== The engine both stages share (a first reading can stop here): flags and presets, the training loop
# ==== `train`, device and dtype, DDP, a run's files (paths, the lock, the record) and the command line.

MODEL_SIZE_FLAGS = ("n_layers", "d_model", "n_heads", "d_mlp")


def build_parser(stage, description):
    """The flags every stage shares (defaults of None are filled from the preset by `resolve`)."""
    p = data.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                            epilog="A flag of default None takes the preset's value (pretrain.PRESETS).")
    p.add_argument("--task", required=True, choices=data.TASKS, help="which data set")
    p.add_argument("--data_dir", type=data.folder, default="data", help="root of data/<task>/*.pt")
    p.add_argument("--out_dir", type=data.folder, default="out", help="root of out/<task>/ checkpoints and logs")
    p.add_argument("--preset", default="auto", choices=("auto", "cpu", "paper"), help="auto: paper on CUDA, else cpu")
    p.add_argument("--epochs", type=POSITIVE, default=None, help="passes over the training split")
    p.add_argument("--max_steps", type=NON_NEGATIVE, default=None, help="cap on optimizer steps (0 = no cap)")
    p.add_argument("--batch_size", type=POSITIVE, default=None, help="sequences per step")
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=None, help="peak learning rate of AdamW")
    p.add_argument("--warmup", type=NON_NEGATIVE, default=None, help="linear warm-up steps, then constant")
    p.add_argument("--weight_decay", type=number_at_least(float, 0.0), default=None, help="AdamW weight decay")
    p.add_argument("--eval_every", type=POSITIVE, default=None, help="steps between validations and checkpoints")
    p.add_argument("--eval_each_epoch", action=argparse.BooleanOptionalAction, default=None, help="also at epoch ends")
    p.add_argument("--log_every", type=POSITIVE, default=10, help="steps between log lines")
    p.add_argument("--seed", type=data.SEED, default=0, help="training seed: init, batch order, masks")
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="auto: bf16 on CUDA, else fp32")
    p.add_argument("--resume", action="store_true", help=f"continue from out/<task>/{stage}*_last.pt")
    p.add_argument("--overwrite", action="store_true", help="remove this run's old files first")
    p.add_argument("--snapshots", action="store_true", help="also keep a checkpoint at every evaluation")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (needs a working Triton)")
    g = p.add_argument_group("model (overrides the preset; a finetuning from a checkpoint uses the checkpoint's)")
    for name in MODEL_SIZE_FLAGS:  # model.ModelConfig's fields
        g.add_argument(f"--{name}", type=POSITIVE, default=None)
    g.add_argument("--pos", default=None, choices=POSITIONS, help="model.POSITIONS; the paper's: sinusoidal")
    g.add_argument("--pooling", default=None, choices=POOLINGS, help="model.POOLINGS; the paper's: mean")
    g.add_argument("--init_scheme", default=None, choices=INIT_SCHEMES, help="model.init_weights")
    g.add_argument("--init_scale", type=POSITIVE_FLOAT, default=None, help="multiplies every initialized weight")
    d = p.add_argument_group("data (used when data/<task>/ is made, and checked against it when it exists)")
    d.add_argument("--max_len", type=POSITIVE, default=None, help="longest sequence kept (Text, Retrieval, ListOps)")
    d.add_argument("--resolution", type=POSITIVE, default=None, help="image side (PathFinder, PathX, Fashion-MNIST)")
    d.add_argument("--difficulty", default=None, choices=tuple(data.PATHFINDER_DIFFICULTY), help="PathFinder, PathX")
    d.add_argument("--download", action="store_true", help="download missing data (LRA's release: 8.2 GB)")
    d.add_argument("--accept_data", action="store_true", help="train on data of other settings (a warning)")
    return p


# Flags that set ModelConfig fields (flag name -> field name); None means the preset's (or ModelConfig's) value.
MODEL_FLAGS = {**{k: k for k in MODEL_SIZE_FLAGS}, "pos": "pos", "pooling": "pooling", "init_scheme": "init",
               "init_scale": "init_scale"}
# The flags a --resume must share with its checkpoint (--epochs and --max_steps say where to stop and may grow;
# --dtype may change, e.g. to fp32 after bf16 overflowed). Each stage adds its own (train's record["same"]).
SCHEDULE_FLAGS = ("lr", "warmup", "weight_decay", "seed", "batch_size", "eval_every", "eval_each_epoch")


def resolve(args, stage, parser):
    """Pick device, processes (torchrun) and dtype, fill every flag left at None from the preset (fill_from_preset)
    and seed the initialization. Returns the preset, its model entry updated with the model flags. A model the
    flags cannot build (d_model not divisible by n_heads) is the `parser`'s usage error."""
    args.device = pick_device(args.device)
    setup_distributed(args)
    preset = fill_from_preset(args, stage)
    try:
        ModelConfig(**preset["model"])
    except ValueError as e:
        parser.error(str(e))
    args.dtype, reason = pick_dtype(args.dtype, args.device)
    torch.manual_seed(args.seed)  # the model's initialization
    if args.device.type == "cuda":  # TF32 matmuls, unless exact fp32 was asked for
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.dtype != torch.float32
    print(f"device {args.device}, {args.world_size} process(es), dtype {str(args.dtype)[6:]} ({reason}), "
          f"preset {args.preset}")
    return preset


def fill_from_preset(args, stage):
    """Set every schedule flag of `stage` left at None from PRESETS[task family][args.preset] (auto: paper on CUDA,
    cpu elsewhere); returns the preset, its model entry updated with the model flags given. No side effect beyond
    args (ablate.py uses it too)."""
    if args.preset == "auto":
        args.preset = "paper" if pick_device(args.device).type == "cuda" else "cpu"
    preset = PRESETS[data.task_family(args.task)][args.preset]
    given = {field: getattr(args, flag) for flag, field in MODEL_FLAGS.items() if getattr(args, flag) is not None}
    preset = dict(preset, model={**preset["model"], **given})
    for key, value in {"max_steps": 0, "eval_each_epoch": True, "weight_decay": 0.0, **preset[stage]}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return preset


def get_lr(step, lr, warmup):
    """Linear warm-up from lr/warmup to lr over `warmup` steps, then constant (Amos et al., constant_warmup)."""
    return lr * min(1.0, (step + 1) / max(1, warmup))


def train(model, splits, args, loss_fn, eval_fn, paths, record, metric, maximize):
    """Optimize `model` on splits["train"] with AdamW; evaluate and checkpoint every args.eval_every steps, at the
    end of every epoch (args.eval_each_epoch) and at the last step. loss_fn(idx (B,) rows, step) -> (the loss summed
    over this rank's items, their count); eval_fn(step) -> {"val_loss": float, ...}; `metric` picks the best
    checkpoint, the higher the better if `maximize` (ties: the lower val_loss, then the later evaluation). record:
    what every checkpoint stores, record["same"] what a --resume (exact, from paths["last"]) must share. Returns the
    best metrics with "step", "epoch", "evals", "n_batches" per epoch and "elapsed_s" (over every process)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.999),
                            weight_decay=args.weight_decay, fused=args.device.type == "cuda")
    lengths = splits["train"]["lengths"]  # on the CPU: counting tokens never waits for the device
    n_batches = len(data.batch_indices(lengths, args.batch_size, True, args.seed, 0, args.world_size))
    total = min(args.max_steps or math.inf, args.epochs * n_batches)
    same = dict(record["same"], n_batches=n_batches, **{k: getattr(args, k) for k in SCHEDULE_FLAGS},
                **{f"model {k}": v for k, v in dataclasses.asdict(model.cfg).items()})
    record, score = dict(record, same=same), lambda m: (m[metric] if maximize else -m[metric], -m["val_loss"])
    state = dict(step=0, epoch=0, batch_in_epoch=0, n_batches=n_batches, best=None, evals=[], elapsed_s=0.0)
    if args.resume and os.path.exists(paths["last"]):  # exact resume: every bit of the loop's state
        ck = data.load_pt(paths["last"])
        if ck["state"]["step"] > total:  # read back as this run, it would hand on weights trained longer than asked
            raise ValueError(f"--resume: {paths['last']} is at step {ck['state']['step']}, past this run's {total} "
                             f"steps: give the --epochs and --max_steps it ran with")
        differ = [k for k in same if ck["same"].get(k) != same[k]]
        if differ:
            raise ValueError(f"--resume: {paths['last']} was made with {differ[0]} {ck['same'].get(differ[0])!r}, "
                             f"this run has {same[differ[0]]!r}: resume with its flags and data, or another --out_dir")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        torch.set_rng_state(ck["rng_state"])
        if ck["cuda_rng_state"] is not None:
            torch.cuda.set_rng_state(ck["cuda_rng_state"], args.device)
        state = ck["state"]
        print(f"resumed {paths['last']} at step {state['step']}")
    if args.rank == 0:  # the log keeps each step once: lines past the checkpoint, or a torn last line, go
        old = open(paths["log"]).readlines() if state["step"] and os.path.exists(paths["log"]) else []
        kept = [line for line in old if line.endswith("\n") and json.loads(line)["step"] <= state["step"]]
        data.save_atomic("".join(kept), paths["log"])
    t_process, elapsed0 = time.time(), state["elapsed_s"]
    if state["step"] == 0:  # evaluate the initial weights, and keep them for the analyses
        metrics = eval_fn(0)
        print("eval at step 0: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        state["evals"].append(dict(step=0, epoch=0, **metrics))
        if args.rank == 0:
            append_log(paths["log"], state["evals"][-1])
            save_checkpoint(paths["init"], model, opt, state, record)
    meter = dict(loss=torch.zeros((), device=args.device), steps=0, tokens=0, flops=0.0, t=time.time())
    start_step, peak = state["step"], peak_flops(args.device, args.dtype)
    model.train()
    while state["step"] < total:
        batches = data.batch_indices(lengths, args.batch_size, True, args.seed, state["epoch"], args.world_size)
        for i in range(state["batch_in_epoch"], n_batches):
            idx, lr = batches[i], get_lr(state["step"], args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            loss_sum, count = loss_fn(idx, state["step"])           # forward: this rank's sum and count
            count = global_sum(count.detach().float(), args)
            # DDP averages gradients over ranks, hence x world_size: the gradient of the global sum / count
            (loss_sum * args.world_size / count).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            meter["loss"] += global_sum(loss_sum.detach(), args) / count  # a device tensor: no host synchronisation
            L_batch = int(lengths[idx].max())
            meter["steps"] += 1
            meter["tokens"] += int(lengths[idx].sum())
            meter["flops"] += flops_per_token(model.cfg, L_batch) * lengths[idx].numel() * L_batch
            epoch = state["epoch"]  # the epoch of this step; the state moves on to the next step's place
            state.update(step=state["step"] + 1, epoch=epoch + (i + 1) // n_batches, batch_in_epoch=(i + 1) % n_batches)
            done = state["step"] >= total
            evaluate_now = state["step"] % args.eval_every == 0 or done or (state["batch_in_epoch"] == 0 and
                                                                             args.eval_each_epoch)
            if state["step"] % args.log_every == 0 or evaluate_now:
                loss = meter["loss"].item() / meter["steps"]  # the loop's one regular host synchronisation
                if not math.isfinite(loss):  # before any checkpoint holds the weights it made
                    raise FloatingPointError(f"a NaN or inf training loss before step {state['step']}: rerun with a "
                                             f"lower --lr or --dtype fp32")
                dt = time.time() - meter["t"]
                eta = (time.time() - t_process) / (state["step"] - start_step) * (total - state["step"])
                mfu = meter["flops"] / dt / (peak * args.world_size) if peak else None
                print(f"step {state['step']:6d}/{total} | epoch {epoch} | loss {loss:.4f} | lr {lr:.2e} | "
                      f"{1000 * dt / meter['steps']:.0f} ms/step | {meter['tokens'] / dt:,.0f} tok/s | "
                      + (f"MFU {100 * mfu:.1f}% | " if mfu else "") + f"ETA {eta / 60:.1f} min")
                if args.rank == 0:
                    append_log(paths["log"], dict(step=state["step"], epoch=epoch, loss=loss, lr=lr, mfu=mfu,
                                                  ms_per_step=1000 * dt / meter["steps"],
                                                  tokens_per_s=meter["tokens"] / dt))
                meter = dict(loss=torch.zeros((), device=args.device), steps=0, tokens=0, flops=0.0, t=time.time())
            if evaluate_now:
                metrics = eval_fn(state["step"])
                improved = all(map(math.isfinite, score(metrics))) and (
                    state["best"] is None or score(metrics) >= score(state["best"]))
                if improved:
                    state["best"] = dict(metrics, step=state["step"], epoch=state["step"] / n_batches)
                state["evals"].append(dict(step=state["step"], epoch=epoch, **metrics))
                state["elapsed_s"] = elapsed0 + time.time() - t_process
                print(f"eval at step {state['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                      + (" (best)" if improved else ""))
                if args.rank == 0:
                    append_log(paths["log"], state["evals"][-1])
                    if args.snapshots:  # for curves over training (analyze.py curves)
                        save_checkpoint(paths["snapshot"].format(step=state["step"]), model, opt, state, record)
                    if improved:
                        save_checkpoint(paths["best"], model, opt, state, record)
                    save_checkpoint(paths["last"], model, opt, state, record)  # the last write: --resume's start
                meter["t"] = time.time()  # the evaluation's time is not the steps'
            if done:
                break
    if state["best"] is None:
        raise FloatingPointError(f"no evaluation gave a finite {metric}, so there is no best checkpoint")
    print(f"finished {state['step']} steps; best {metric} {state['best'][metric]:.4f} at step {state['best']['step']}")
    if args.world_size > 1:
        dist.barrier()  # rank 0 has written its checkpoints before any rank reads them
    return dict(state["best"], evals=state["evals"], n_batches=n_batches, elapsed_s=elapsed0 + time.time() - t_process)


def save_checkpoint(path, model, opt, state, record):
    """Write a checkpoint atomically (data.save_atomic): the weights and model config (model.checkpoint_dict), the
    optimizer, the loop state, the latest evaluation ("metrics"), the RNG states and the run's record."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    data.save_atomic(checkpoint_dict(model, optimizer=opt.state_dict(), state=state, metrics=state["evals"][-1],
                                     rng_state=torch.get_rng_state(), cuda_rng_state=cuda, **record), path)


def append_log(path, entry):
    """One JSON line at the end of the run's log, opened without following a link (O_NOFOLLOW): a link planted at
    the log's name is an error, not a way to write into another file."""
    with open(path, "a", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
        f.write(json.dumps(entry) + "\n")


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
    """'auto' -> cuda if available, else mps, else cpu; any other string is torch.device's (cuda:N becomes the
    current GPU, so that torch.cuda calls without a device argument mean it). ValueError for a device not here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available()
                            else "cpu")
    device = torch.device(name)  # RuntimeError naming the device types for a string that is none
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count() or \
            device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: not on this machine ({torch.cuda.device_count()} CUDA device(s))")
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


# Dense bf16 peak FLOP/s of common GPUs (vendor data sheets), longest names first: "H100 PCIe" before "H100".
# An unknown GPU gets no MFU rather than a wrong one.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "RTX 4090": 165e12,
                   "RTX 3090": 71e12, "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                   "A6000": 155e12, "A10": 125e12, "L4": 121e12}


def peak_flops(device, dtype):
    """Peak FLOP/s for MFU: PEAK_BF16_FLOPS's first name found as whole words in the GPU's ("A10" is not "A10G")."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if re.search(rf"(^|\W){re.escape(k)}($|\W)", name)), None)


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
    """Sum of a tensor over all ranks, in place (itself when not distributed)."""
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


# ---- A run's files: their names, one run per folder, the record of what made a run ----

RUN_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")  # no "/", "..", space or newline: it stays in its folder


def run_paths(out_dir, task, stage, name=None):
    """The files of one run under <out_dir>/<task>/: "pretrain": best = pretrain.pt (finetune.py --init), last =
    pretrain_last.pt (--resume), init = pretrain_init.pt, log = pretrain_log.jsonl, snapshot = pretrain_step{step}.pt,
    lock = pretrain.lock; "finetune" with a run name: the same for finetune_<name>, and json = finetune_<name>.json.
    ValueError for a name not plain (RUN_NAME, not ending like a run's own files): a run's files stay its own."""
    if name is not None and (not RUN_NAME.fullmatch(name) or re.search(r"_(last|init|step\d+)$", name)):
        raise ValueError(f"--name {name!r}: a run name is letters, digits, '_', '.', '+' and '-', not starting with "
                         f"'.' and not ending in _last, _init or _step<N> (the names of a run's own files)")
    stem = os.path.join(out_dir, task, "pretrain" if name is None else f"finetune_{name}")
    paths = dict(best=stem + ".pt", last=stem + "_last.pt", init=stem + "_init.pt", log=stem + "_log.jsonl",
                 snapshot=stem + "_step{step}.pt", lock=stem + ".lock")
    return dict(paths, json=stem + ".json") if name is not None else paths


def run_init_path(path):
    """The _init.pt of the run a checkpoint belongs to (run_paths' names), or None if it is missing."""
    init = re.sub(r"(_last|_step\d+|_init)$", "", os.path.splitext(path)[0]) + "_init.pt"
    return init if os.path.exists(init) else None


@contextlib.contextmanager
def own_run(paths, args):
    """Hold the run whose files are `paths` (run_paths) while a stage writes them: one run per folder. Rank 0 locks
    paths["lock"] (fcntl.flock, released when the process ends, even killed): a live run's files, or an earlier run's
    without args.resume or args.overwrite (which removes them), are FileExistsError; killed writes' temporaries go.
    A fault inside (not a ValueError: bad input) gets a note naming the last checkpoint, for data.run_cli's line."""
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run, --overwrite removes it: give one of them")
    folder, lock, started = os.path.dirname(paths["log"]), None, False
    try:
        if args.rank == 0:
            os.makedirs(folder, exist_ok=True)
            lock = open(paths["lock"], "a+", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder, lock = lock.read().strip(), lock.close()
                raise FileExistsError(f"{paths['lock']}: the run is live in another process ({holder}); wait for "
                                      f"it, or give another --out_dir") from None
            lock.truncate(0)
            lock.write(f"pid {os.getpid()} on {platform.node()}: {' '.join(sys.argv)}\n")
            lock.flush()
            snapshot = re.compile(re.escape(os.path.basename(paths["log"])[:-len("_log.jsonl")]) + r"_step\d+\.pt")
            old = [paths[k] for k in ("best", "last", "init", "log", "json") if os.path.lexists(paths.get(k, ""))]
            old += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if snapshot.fullmatch(f)]
            if old and not (args.resume or args.overwrite):
                raise FileExistsError(f"{folder} holds this run's files ({', '.join(map(os.path.basename, old[:3]))}"
                                      f"...): --resume continues it, --overwrite removes it, or give another --out_dir")
            for f in (old if args.overwrite else []) + [t for p in old for t in glob.glob(glob.escape(p) + ".*.tmp")]:
                os.remove(f)
        if args.resume and not os.path.exists(paths["last"]):
            print(f"--resume: no {paths['last']} yet: the run starts at step 0")
        if args.world_size > 1:
            dist.barrier()  # rank 0 has checked the folder before any rank goes on
        started = True
        yield
    except BaseException as e:
        if started and not isinstance(e, ValueError) and args.rank == 0:
            e.add_note(f"the last checkpoint is {paths['last']}: the same command with --resume (not --overwrite) "
                       f"continues from it" if os.path.exists(paths["last"]) else "no checkpoint was written yet")
        raise
    finally:
        if lock:
            lock.truncate(0)  # the file stays: removing it would race with a process locking it
            lock.close()


def run_record(args, **fields):
    """The plain-type record every checkpoint of a run stores: `fields` (the stage's: task, data, what a --resume
    must share), the run's flags, and what produced it: the git commit (with the tracked files that differ from it,
    or None outside a git checkout), torch, the device and the CPU threads, on which float sums depend."""
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD").strip() or None
    modified = sorted(line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines())
    config = {k: str(v) if isinstance(v, (torch.device, torch.dtype)) else v for k, v in vars(args).items()}
    device = getattr(args, "device", torch.device("cpu"))
    return dict(fields, config=config, git_commit=commit, git_modified=modified if commit else None,
                torch_version=str(torch.__version__), threads=torch.get_num_threads(),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine())


# ---- The command line every stage shares ----

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
        f"{s} {len(splits[s]['labels'])} (sha256 {splits[s]['tensors_sha256'][:12]})" for s in data.SPLITS))
    return splits


def run_stage(main_fn):
    """data.run_cli for the stages, which also end on SIGTERM and SIGHUP as on Ctrl-C: one line naming the last
    checkpoint (own_run), exit status 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    def stop(signum, frame):
        e = KeyboardInterrupt()
        e.signum = signum
        raise e
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    data.run_cli(main_fn)


if __name__ == "__main__":
    run_stage(main)
