r"""analyze.py -- what self-pretraining does to attention, and the theory behind it (Coser et al. 2026).

    python analyze.py prop1                     # Proposition 1 checked numerically
    python analyze.py gradients --ckpt out/synthetic/pretrain_init.pt out/synthetic/pretrain.pt   # ... in the model
    python analyze.py attention --ckpt out/synthetic/pretrain_init.pt out/synthetic/pretrain.pt \
                                       out/synthetic/finetune_spt.pt     # maps, PE-only probe, W_Q^T W_K
    python analyze.py curves --run_dir out/synthetic                      # proximity over training (--snapshots)

Reads checkpoints of any task and the task's data; trains nothing; writes PNG figures and JSON numbers into --out.
Sections: 1. Proposition 1 (1b: in the model)  2. attention after self-pretraining  3. figures  4. command line
"""
import argparse
import collections
import glob
import itertools
import math
import os
import shlex
import sys

import numpy as np
import torch
import torch.nn.functional as F

import data
import pretrain
from data import single_sequences
from model import Transformer, config_from_dict, param_group, real_positions, unwrapped_state_dict

# ---- 1. Proposition 1 (Coser et al., Prop. 1): gradients of the two losses at uniform attention ----
#
# Tokens X_1..X_L in R^d; scores a D for a direction D (L x L); A(a) = row-softmax(a D); o_i = sum_j A_ij X_j; mean
# pool h = (1/L) sum_i o_i; L_sup(a) = E[l(h(a), Y)]; L_SPT(a) = (1/(2L)) sum_i E||X_i - o_i(a)||^2 (E: the sample
# mean). At a = 0, dA/da = Dbar/L with Dbar = D J the row-centred direction (J = I - 11^T/L), so
#     h'(0) = (1/L^2) sum_j (1^T Dbar)_j X_j:  0 for every sample, and L_sup'(0) = 0 for ANY loss, if 1^T D = 0;
#     L_SPT'(0) = -(1/L) sum_i E[(J X)_i . o_i'(0)] = -(1/L^2) <J D J, C>_F,    C_ij = E[X_i . X_j] (uncentred).
# If 1^T D = 0, J D J = Dbar: the paper's -(1/L^2) <Dbar, C>_F; otherwise they differ by +(1/L^3) sum_j (1^T Dbar)_j
# (1^T C)_j. Exact with the sample's C; with the population C, up to sampling error. With [CLS] pooling (h = o_1),
# h'(0) = (1/L) sum_j Dbar_1j X_j vanishes only if row 1 of D is constant (the table reports the numbers).

def ar1_tokens(n, length, dim, rho=0.8, seed=0):
    """(n, length, dim) float64 tokens, a stationary AR(1) process along the sequence (corr rho^|i-j|), centred
    over the sample at each position; and their population second moments C_ij = dim * rho^|i-j| (L, L)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(length, dtype=torch.float64)
    sigma = rho ** (idx[:, None] - idx[None, :]).abs()
    z = torch.randn(n, length, dim, generator=g, dtype=torch.float64)
    x = torch.einsum("ij,njd->nid", torch.linalg.cholesky(sigma), z)
    return x - x.mean(0, keepdim=True), dim * sigma


def column_centred(d):
    """D - 11^T D / L: the (L, L) direction with zero column sums nearest D."""
    return d - d.mean(0, keepdim=True)


def band_direction(length, width=2):
    """(L, L) proximity direction: 1 where |i - j| <= width, else 0, column-centred (so 1^T D = 0)."""
    idx = torch.arange(length)
    return column_centred(((idx[:, None] - idx[None, :]).abs() <= width).to(torch.float64))


def prop1_losses(x, d, a, w, y, pooling="mean"):
    """(L_sup, L_SPT) of Prop. 1 at scores a * D: cross-entropy of h @ w against y, (1/(2L)) sum_i mean_n ||X_i -
    o_i||^2. x: (N, L, d); d: (L, L); a: scalar tensor; w: (d, K); y: (N,); pooling: "mean" or "cls" (h = o_1)."""
    attn = torch.softmax(a * d, dim=-1)                # (L, L), the same for every sequence
    o = torch.einsum("ij,njd->nid", attn, x)           # (N, L, d)
    h = o.mean(1) if pooling == "mean" else o[:, 0]    # (N, d)
    l_sup = F.cross_entropy(h @ w, y)
    l_spt = ((x - o) ** 2).sum((1, 2)).mean() / (2 * x.shape[1])
    return l_sup, l_spt


def prop1_derivatives(x, d, w, y, pooling="mean"):
    """(L_sup'(0), L_SPT'(0)) as floats at uniform attention, by autograd through `prop1_losses`."""
    a = torch.tensor(0.0, dtype=torch.float64, requires_grad=True)
    losses = prop1_losses(x, d, a, w, y, pooling)
    return tuple(torch.autograd.grad(loss, a, retain_graph=True)[0].item() for loss in losses)


def closed_form_spt_derivative(x, d, c=None):
    """The paper's L_SPT'(0) = -(1/L^2) <Dbar, C>_F (Coser et al., Prop. 1), with Dbar = D - D 11^T / L the
    row-centred direction; exact only when 1^T D = 0. x: (N, L, d); d: (L, L); c: (L, L) second moments, if None
    the empirical C_ij = mean_n X_i^(n) . X_j^(n)."""
    c = torch.einsum("nid,njd->ij", x, x) / len(x) if c is None else c
    return (-((d - d.mean(1, keepdim=True)) * c).sum() / x.shape[1] ** 2).item()


def rel_err(value, reference):
    """|value - reference| / |reference| (floats; a zero reference counts as 1e-300)."""
    return abs(value - reference) / max(abs(reference), 1e-300)


def prop1_table(n=512, length=16, dim=8, n_classes=3, n_random=3, seed=0):
    """Rows (dicts) of the Proposition 1 check: autograd derivatives at a = 0 against the closed forms (the exact
    one, -(1/L^2) <J D J, C>_F for every D, is the paper's applied to J D: row-centring J D gives J D J)."""
    x, c_pop = ar1_tokens(n, length, dim, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(dim, n_classes, generator=g, dtype=torch.float64)
    y = torch.randint(n_classes, (n,), generator=g)
    rand = lambda: torch.randn(length, length, generator=g, dtype=torch.float64)
    x_iid = torch.randn(n, length, dim, generator=g, dtype=torch.float64)     # uncentred, identity C
    cases = [(f"random D (1^T D = 0) #{k}", x, column_centred(rand()), "mean", None) for k in range(n_random)]
    cases += [("band D, col-centred", x, band_direction(length), "mean", None),
              ("random D (1^T D = 0), iid X", x_iid, column_centred(rand()), "mean", None),
              ("random D (1^T D = 0), population C", x, cases[0][2], "mean", c_pop),
              ("random D (1^T D != 0)", x, rand(), "mean", None),
              ("random D (1^T D = 0), [CLS] pool", x, cases[0][2], "cls", None)]
    rows = []
    for name, xs, d, pooling, c in cases:
        sup, spt = prop1_derivatives(xs, d, w, y, pooling)
        paper, exact = closed_form_spt_derivative(xs, d, c), closed_form_spt_derivative(xs, column_centred(d), c)
        rows.append(dict(case=name, pooling=pooling, max_abs_col_sum=d.sum(0).abs().max().item(), dsup=sup,
                         dspt=spt, paper=paper, rel_err_paper=rel_err(paper, spt),
                         exact=exact, rel_err_exact=rel_err(exact, spt)))
    settings = dict(n=n, length=length, dim=dim, n_classes=n_classes, seed=seed, rho=0.8, dtype="float64",
                    loss="cross-entropy of a fixed random linear classifier on random labels")
    return rows, settings, (x, w, y)


def cmd_prop1(args):
    """prop1.png: both losses along a in [-3, 3] for the band direction, with the closed-form tangent of L_SPT at 0;
    the verdict printed. Returns the name and numbers of prop1.json (main writes it, a row per case)."""
    rows, settings, (x, w, y) = prop1_table(seed=args.seed)
    d, grid = band_direction(settings["length"]), np.linspace(-3, 3, 121)
    losses = np.array([[v.item() for v in prop1_losses(x, d, torch.tensor(a), w, y)] for a in grid])
    slope, l0 = closed_form_spt_derivative(x, d), losses[60, 1]  # a = 0
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    axes[0].plot(grid, losses[:, 0])
    axes[0].set(xlabel="a (scores = a D)", ylabel="L_sup(a)", title="supervised loss, mean pooling")
    axes[1].plot(grid, losses[:, 1], label="L_SPT(a)")
    axes[1].plot(grid, l0 + slope * grid, "--", label="tangent, -(1/L^2)<Dbar, C>")
    axes[1].set(xlabel="a (scores = a D)", ylabel="L_SPT(a)", title="reconstruction loss")
    margin = 0.1 * np.ptp(losses[:, 1])
    axes[1].set_ylim(losses[:, 1].min() - margin, losses[:, 1].max() + margin)
    axes[1].legend()
    for ax in axes:
        ax.axvline(0, color="gray", lw=0.5)
    save_figure(fig, os.path.join(args.out, "prop1.png"), args.command_line,
                "Coser et al. Prop. 1: band direction (column-centred), AR(1) tokens")
    zero = [r for r in rows if r["max_abs_col_sum"] < 1e-12]
    sup = max(abs(r["dsup"]) for r in zero if r["pooling"] == "mean")
    paper = max(r["rel_err_paper"] for r in zero if "population" not in r["case"])
    print(f"zero column sums, mean pool: max |L_sup'(0)| {sup:.1e}; the paper's form matches autograd to {paper:.1e}"
          f" (empirical C; the exact form for every D). [CLS] pooling: L_sup'(0) = {rows[-1]['dsup']:.2e}, not 0.")
    return "prop1.json", dict(settings=settings, rows=rows)


# 1b. Proposition 1 in the model: a score gradient G = dL/dS (L x L) is orthogonal to every direction with zero column
# sums exactly when its rows are equal. Its share along them, ||G - 1 gbar^T||^2 / ||G||^2, is 0 for L_sup in the
# minimal model (one layer, no LayerNorm, no MLP, mean pooling, a linear head) at uniform attention.

def prop1_parts(grad, lengths=None, prefix=0):
    """Squared norms of grad (B, H, L, L), dL/dS of one layer, summed over sequences b, heads h and real query rows:
    "along": ||G_bh - 1 gbar_bh^T||^2, the part along Prop. 1's directions (gbar: the mean real row), and "whole":
    ||G_bh||^2; "seq_along" and "seq_whole" the same over the sequence's own rows (the `prefix` rows of a summary
    token left out, gbar their mean); "summary": ||G_bh||^2 on the `prefix` rows. A group of one row is all "along"
    but 1/L of itself, so the summary row is reported apart, as a magnitude."""
    B, H, L, _ = grad.shape
    lengths = torch.full((B,), L) if lengths is None else lengths
    real = real_positions(lengths, L, "cpu").to(grad.dtype)[:, None, :, None]     # (B, 1, L, 1) query rows
    own = real * (torch.arange(L) >= prefix).to(grad.dtype)[None, None, :, None]   # the sequence's own rows
    out = {}
    for key, w in (("", real), ("seq_", own)):
        mean_row = (grad * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1)  # (B, H, 1, L)
        out[key + "along"] = ((grad - mean_row).pow(2) * w).sum().item()
        out[key + "whole"] = (grad.pow(2) * w).sum().item()
    out["summary"] = (grad.pow(2) * (real - own)).sum().item()
    return out


def score_gradient(probs, probs_grad):
    """dL/dS from the attention probabilities P = softmax(S) (rows) and dL/dP, both (..., L, L): the softmax
    backward, dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)."""
    return probs * (probs_grad - (probs * probs_grad).sum(-1, keepdim=True))


def loss_gradients(path, data_dir, n=64, chunk=None, seed=0, losses=("L_sup", "L_SPT")):
    """Prop. 1 in a checkpoint's model, on its task's first n training sequences: the score gradients of L_sup (a
    pretrain.py checkpoint gets a class head of its preset's kind, drawn from `seed` as the masks) and of a pretrain.py
    checkpoint's L_SPT. Returns {loss: {"prop1_share": [per layer] (all real query rows), "seq_share": [...] (the
    sequence's own rows), "seq_along": [...] (their norm along Prop. 1's directions, root mean square per sequence),
    "summary_row": [...] (the summary token's row, same norm), "grad_norm": {group: ||dL/dW|| / sequences}}};
    `chunk` sequences at a time. ValueError for a pair model or local attention."""
    model, ck = load_model(path, head_seed=seed)
    meta, run = ck["data_meta"], ck["config"]  # run: a pretrain.py run's masks and loss
    if model.cfg.pair or (model.cfg.attn_window and model.cfg.attn_window < meta["max_len"]):
        raise ValueError(f"{path}: a pair model or local attention; Prop. 1's measure needs full attention")
    split = data.load_split(data_dir, ck["task"], "train", ck)
    count = min(n, len(split["labels"]))
    g = torch.Generator().manual_seed(seed)
    chunk = chunk or max(1, min(16, 2 ** 24 // split["meta"]["max_len"] ** 2))
    out = {}
    for loss_name in [name for name in losses if name == "L_sup" or model.rec_head is not None]:
        model.zero_grad(set_to_none=True)
        parts = [collections.Counter() for _ in range(model.cfg.n_layers)]  # prop1_parts per layer, over chunks
        for i in range(0, count, chunk):
            x, lengths, labels = data.get_batch(split, torch.arange(i, min(i + chunk, count)), "cpu", multiple=1)
            if loss_name == "L_sup":
                z, probs = model.encode(model_inputs(model, x), lengths, need_weights=True)
                loss = F.cross_entropy(model.class_head(model.pool(z, lengths)), labels, reduction="sum")
            else:  # the outputs at the sequence's positions, after the summary token
                inputs, masked = pretrain.mask_batch(x, lengths, run["mask_ratio"], meta.get("mask_id"), g)
                z, probs = model.encode(inputs, lengths, need_weights=True)
                loss = pretrain.reconstruction_loss(model.rec_head(z[:, model.prefix:]), pretrain.targets_at(
                    x, run["rec_loss"], meta), masked, run["rec_loss"]) * masked.sum()
            for p in probs:
                p.retain_grad()
            loss.backward()
            real = None if lengths is None else lengths + model.prefix  # [CLS]: the token is a real query and key
            for layer, p in zip(parts, probs):
                layer.update(prop1_parts(score_gradient(p.detach(), p.grad), real, model.prefix))
        norms = {}
        for name, param in model.named_parameters():
            if param.grad is not None:
                norms[param_group(name)] = norms.get(param_group(name), 0.0) + param.grad.pow(2).sum().item()
        share = lambda a, b: [p[a] / p[b] if p[b] > 0 else 0.0 for p in parts]
        per_sequence = lambda key: [math.sqrt(p[key] / count) for p in parts]
        out[loss_name] = dict(prop1_share=share("along", "whole"), seq_share=share("seq_along", "seq_whole"),
                              seq_along=per_sequence("seq_along"), summary_row=per_sequence("summary"),
                              grad_norm={k: math.sqrt(v) / count for k, v in norms.items()})
    return out


def cmd_gradients(args):
    """analyze.py gradients: loss_gradients of each --ckpt, printed; returns (the JSON's name, its contents)."""
    results = {}
    for path in args.ckpt:
        results[path] = res = loss_gradients(path, args.data_dir, args.n, seed=args.seed)
        print(f"checkpoint {path}: each loss's score gradient per layer: its share along Prop. 1's directions over "
              f"all query rows; on the sequence's own rows its norm along them (per sequence) and share; the summary "
              f"token's row")
        for loss_name, r in res.items():  # (L_SPT only for a pretrain.py checkpoint)
            ratio = r["grad_norm"]["W_Q"] / r["grad_norm"]["W_V"] if r["grad_norm"].get("W_V") else float("nan")
            for layer, parts in enumerate(zip(r["prop1_share"], r["seq_along"], r["seq_share"], r["summary_row"])):
                print(f"  {loss_name:5s} layer {layer}: share {parts[0]:.3g}; sequence rows {parts[1]:.3g}, "
                      f"share {parts[2]:.3g}; summary row {parts[3]:.3g}")
            print(f"  {loss_name:5s} |dL/dW_Q| / |dL/dW_V| {ratio:.3g}")
    print(f"L_sup's share depends on the checkpoint: how far its attention is from uniform (Prop. 1: 0 only at "
          f"uniform attention), and a pretrain.py checkpoint's fresh class head (--seed {args.seed}).")
    return "gradients.json", dict(n=args.n, seed=args.seed, results=results)


# ---- 2. Attention after self-pretraining (Coser et al., Sec. 4): maps, PE-only probe, W_Q^T W_K, proximity ----

def load_model(path, head_seed=None):
    """(model in eval mode on the CPU, checkpoint dict) from any checkpoint of this project. With `head_seed`, a
    pretrain.py checkpoint gets the class head finetune.py would give it (its preset's kind), drawn from that seed."""
    ck = data.load_pt(path)
    cfg = ck["model_config"]
    if head_seed is not None and ck.get("stage") == "pretrain":
        preset = pretrain.PRESETS[data.task_family(ck["task"])][ck["config"]["preset"]]
        cfg = dict(cfg, n_classes=ck["data_meta"]["n_classes"], cls_mlp=preset["model"].get("cls_mlp", False))
    with torch.random.fork_rng():  # the caller's random state left as it was
        torch.manual_seed(head_seed or 0)
        model = Transformer(config_from_dict(cfg, path))
    missing, unexpected = model.load_state_dict(unwrapped_state_dict(ck["model"]), strict=False)
    if unexpected or any(not k.startswith("cls_head.") for k in missing):  # a head only may be left as drawn
        raise ValueError(f"{path}: weights {missing or unexpected} do not fit its own model_config")
    return model.eval(), ck


def model_inputs(model, x):
    """An SPT model of continuous inputs expects a mask-indicator channel: append zeros (nothing masked)."""
    if x.dtype != torch.long and x.shape[-1] == model.cfg.d_input - 1:
        return torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
    return x


def row_entropy(probs):
    """The entropy in nats of each row of attention probabilities (..., L) -> (...)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


@torch.no_grad()
def attention_maps(model, x, lengths=None, chunk=None):
    """Softmax attention of every layer averaged over a batch x (B, L) or (B, L, d_input), lengths (B,) or None:
    lists over layers of (H, L, L) maps and (H, L) row entropies (nats, taken per sequence), row i the mean over the
    sequences where position i is real ([CLS]: the token is position 0). `chunk` sequences at a time bound memory."""
    L, layers = model.prefix + x.shape[1], model.cfg.n_layers
    chunk, sums, ents = chunk or max(1, 2 ** 24 // L ** 2), [0.0] * layers, [0.0] * layers
    real = torch.ones(len(x), L) if lengths is None else real_positions(model.prefix + lengths, L, "cpu").float()
    for i in range(0, len(x), chunk):
        part = None if lengths is None else lengths[i:i + chunk]
        _, probs = model.encode(model_inputs(model, x[i:i + chunk]), part, need_weights=True)
        w = real[i:i + chunk, None, :]                                                    # (chunk, 1, L)
        sums = [s + (p * w[..., None]).sum(0) for s, p in zip(sums, probs)]
        ents = [s + (row_entropy(p) * w).sum(0) for s, p in zip(ents, probs)]
    count = real.sum(0).clamp_min(1)  # sequences in which each position is real
    return [s / count[:, None] for s in sums], [e / count for e in ents]


@torch.no_grad()
def pe_probe(model, length, layer=0):
    """The PE-only probe: X = 0, only the model's absolute positions P (L, d) (model.absolute_positions) through
    layer `layer`'s first LayerNorm (if any), W_Q and W_K without biases: scores_h = (P W_Q,h^T)(P W_K,h^T)^T /
    sqrt(d_head), the paper's P W_Q^T W_K P^T / sqrt(d). Returns (scores (H, L, L), softmax probabilities
    (H, L, L)). ValueError for a model without absolute positions (relative schemes, "none")."""
    block, attn = model.blocks[layer], model.blocks[layer].attn
    P = model.absolute_positions(length)
    if P is None:
        raise ValueError(f"the PE-only probe needs absolute positions; this model's pos is {model.cfg.pos!r}")
    q, k = ((block.ln1(P) @ proj.weight.T).view(length, attn.n_heads, attn.d_head).transpose(0, 1)  # (H, L, d_head)
            for proj in (attn.q_proj, attn.k_proj))
    scores = q @ k.transpose(1, 2) / math.sqrt(attn.d_head)
    return scores, scores.softmax(-1)


@torch.no_grad()
def qk_product(model, layer=0, head=0):
    """W_Q,h^T W_K,h (d_model, d_model): the bilinear form that scores a query against a key for head h."""
    attn = model.blocks[layer].attn
    rows = slice(head * attn.d_head, (head + 1) * attn.d_head)
    return attn.q_proj.weight[rows].T @ attn.k_proj.weight[rows]


def attention_stats(probs, band=3, entropy=None, lengths=None):
    """Proximity statistics of attention probabilities (..., L, L), averaged over rows and leading dims: entropy
    (nats; or the mean of attention_maps' `entropy` (..., L)), uniform_entropy (of uniform attention), band_mass
    within |i - j| <= band, mean_distance. `lengths` (B,): of the sequences behind an attention_maps mean, each row
    counted once per real one."""
    L = probs.shape[-1]
    pos = torch.arange(L)
    dist = (pos[:, None] - pos[None, :]).abs().to(probs.dtype)
    real = real_positions(torch.tensor([L]) if lengths is None else lengths, L, "cpu").to(probs.dtype)  # (B, L)
    weight, n = real.sum(0), real.sum(1)                          # sequences real at each row, real rows of each

    def mean(per_row):  # (..., L) per query row -> the mean over real (sequence, row) pairs and leading dims
        return ((per_row * weight).sum(-1) / weight.sum()).mean().item()
    return dict(entropy=mean(row_entropy(probs) if entropy is None else entropy),
                uniform_entropy=((n * n.log()).sum() / n.sum()).item(),
                band_mass=mean((probs * (dist <= band)).sum(-1)), band=band, mean_distance=mean((probs * dist).sum(-1)))


def analyze_checkpoints(paths, data_dir, n=64, band=3):
    """Attention maps, PE probes and statistics of each checkpoint of `paths` ({label: path}) on its task's first
    `n` validation sequences (Retrieval: 2n documents), and the displacement from its run's start. Returns (numbers,
    {label: dict(attention=[(H, L, L) per layer], probe=(H, L, L) or None, qk=(d, d))}). [CLS]: the maps over the
    sequence (rows renormalized)."""
    results, maps = {}, {}
    for label, path in paths.items():
        model, ck = load_model(path)
        split = data.load_split(data_dir, ck["task"], "val", ck)
        x, lengths, _ = data.get_batch(split, torch.arange(min(n, len(split["labels"]))), "cpu", multiple=1)
        x, lengths = single_sequences(x, lengths)  # Retrieval: each document of a pair on its own
        padded = None if bool((lengths == x.shape[1]).all()) else lengths
        attn, entropies = attention_maps(model, x, padded)
        probe = pe_probe(model, model.prefix + x.shape[1])[1] if model.absolute_positions(1) is not None else None
        if model.prefix:  # [CLS]: the token's row and column left out, the rest renormalized over the sequence's keys
            attn = [a[:, 1:, 1:] / a[:, 1:, 1:].sum(-1, keepdim=True) for a in attn]
            probe = None if probe is None else probe[:, 1:, 1:] / probe[:, 1:, 1:].sum(-1, keepdim=True)
            entropies = [None] * len(attn)  # the renormalized map's own entropy
        stats = attention_stats(attn[0], band, entropy=entropies[0], lengths=padded)
        if probe is not None:  # the probe feeds the absolute positions P
            stats["probe"] = attention_stats(probe, band)
            pair = torch.stack([probe.flatten(), attn[0].flatten()])
            stats["probe_corr_with_attention"] = torch.corrcoef(pair)[0, 1].item()
        stats["stage"], stats["path"] = ck.get("stage"), path
        start = pretrain.run_init_path(path)  # the weights this checkpoint's own run started from
        if start is not None and os.path.abspath(start) != os.path.abspath(path):
            stats.update(displacement=displacement(load_model(start)[0], model), displacement_from=start)
        results[label] = stats
        maps[label] = dict(attention=attn, probe=probe, qk=qk_product(model))
    return results, maps


def displacement(start, model):
    """norm(W - W_start) / norm(W_start) from the model `start` to `model`: per parameter group (model.PARAM_GROUPS;
    those both have), and for layer 0's W_Q,h^T W_K,h (qk_product) over all its heads h together."""
    num, den, after = {}, {}, model.state_dict()
    for name, w0 in start.state_dict().items():
        if name in after and after[name].shape == w0.shape:
            g = param_group(name)
            num[g] = num.get(g, 0.0) + (after[name].float() - w0.float()).pow(2).sum().item()
            den[g] = den.get(g, 0.0) + w0.float().pow(2).sum().item()
    moved = {g: math.sqrt(num[g] / den[g]) for g in num if den[g] > 0}
    heads = range(model.blocks[0].attn.n_heads)
    qk0, qk = (torch.stack([qk_product(m, 0, h) for h in heads]) for m in (start, model))
    moved["W_Q^T W_K"] = ((qk - qk0).norm() / qk0.norm()).item()
    return moved


def checkpoint_labels(paths):
    """{label: path}: each path relative to the folder all share, without .pt unless two labels would be the same
    (x.pt, x.pth)."""
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    full = [os.path.relpath(os.path.abspath(p), root) for p in paths]
    bare = [os.path.splitext(f)[0] for f in full]
    return dict(zip(bare if len(set(bare)) == len(bare) else full, paths))


def cmd_attention(args):
    """analyze.py attention: analyze_checkpoints of --ckpt and its figure; returns (the JSON's name, contents)."""
    results, maps = analyze_checkpoints(checkpoint_labels(args.ckpt), args.data_dir, args.n, args.band)
    plot_attention(maps, os.path.join(args.out, "attention.png"), args.command_line)
    plot_maps({"W_Q^T W_K": {label: m["qk"] for label, m in maps.items()}}, os.path.join(args.out, "qk_product.png"),
              "W_Q^T W_K, layer 0 head 0", args.command_line, diverging=True)
    for label, r in results.items():
        parts = [f"entropy {r['entropy']:.2f} (uniform {r['uniform_entropy']:.2f})",
                 f"band mass (|i-j|<={r['band']}) {r['band_mass']:.2f}", f"mean distance {r['mean_distance']:.1f}"]
        parts.append(f"PE probe corr {r['probe_corr_with_attention']:.3f}" if "probe" in r else "no PE probe")
        if "displacement" in r:
            parts.append(f"W_Q^T W_K moved {r['displacement']['W_Q^T W_K']:.2f}")
        print(f"{label:24s} " + " | ".join(parts))
    return "attention.json", results


def cmd_curves(args):
    """Proximity statistics over training, from the snapshots of a run (pretrain.py --snapshots)."""
    prefix = os.path.join(args.run_dir, args.stage + "_step")  # pretrain.run_paths' snapshot names
    steps = sorted((int(f[len(prefix):-3]), f) for f in glob.glob(prefix + "*.pt") if f[len(prefix):-3].isdigit())
    if not steps:
        raise FileNotFoundError(f"no {args.stage}_step*.pt in {args.run_dir}: run with --snapshots")
    paths = {"step0": os.path.join(args.run_dir, args.stage + "_init.pt"), **{f"step{s}": f for s, f in steps}}
    results, _ = analyze_checkpoints(paths, args.data_dir, args.n, args.band)
    xs = [0] + [s for s, _ in steps]
    fig, axes = pyplot().subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(axes, ("entropy", "band_mass", "mean_distance"),
                              ("attention entropy (nats)", f"band mass |i-j|<={args.band}", "mean attended distance")):
        ax.plot(xs, [r[key] for r in results.values()], marker="o")
        ax.set(xlabel="training step", ylabel=label)
    axes[0].axhline(results["step0"]["uniform_entropy"], ls="--", color="gray", label="log L (uniform)")
    axes[0].legend()
    save_figure(fig, os.path.join(args.out, f"curves_{args.stage}.png"), args.command_line,
                f"proximity of attention over {args.stage} ({args.run_dir})")
    return f"curves_{args.stage}.json", dict(steps=xs, stats=list(results.values()))


# ---- 3. Figures: how every PNG is saved, and the figures of ablate.py's experiments ----

def pyplot():
    """matplotlib.pyplot, drawing to files only (the Agg backend: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def command_line(script, argv):
    """`python <script> <argv...>`, shell-quoted: what a figure records of how it was drawn (save_figure)."""
    return "python " + shlex.join([script, *argv])


def save_figure(fig, path, command, title=None):
    """Write a figure as PNG atomically (data.save_atomic), `title` on top, tightened unless constrained, and close
    it. `command`, the one that drew it, goes into the PNG's text chunk "Command" (figure_command reads it)."""
    if title:
        fig.suptitle(title)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    data.save_atomic(lambda f: fig.savefig(f, format="png", dpi=110, metadata={"Command": command}), path)
    pyplot().close(fig)


def figure_command(path):
    """The command save_figure recorded in a PNG, or None (a PNG drawn otherwise). Raises OSError for a file that
    is missing or not a PNG."""
    from PIL import Image  # pillow: matplotlib's own image library, installed with it
    with Image.open(path) as image:
        if image.format != "PNG":  # a JPEG or GIF under a .png name has no text chunks
            raise OSError(f"{path}: a {image.format} image, not a PNG")
        return image.text.get("Command")


def plot_maps(rows, path, title, command, diverging=False, top=None):
    """Heatmaps, a row of panels per entry of `rows` ({row name: {panel title: (n, m) tensor}}), on ONE colour scale
    with one colorbar, from 0 (`diverging`: from -top) to `top` (default: the largest absolute value shown)."""
    top = top or max(float(img.abs().max()) for row in rows.values() for img in row.values())
    width = max(len(row) for row in rows.values())
    fig, axes = pyplot().subplots(len(rows), width, figsize=(3.6 * width + 1, 3.4 * len(rows)), squeeze=False,
                                  layout="constrained")
    x_label, y_label = ("key feature", "query feature") if diverging else ("key position j", "query position i")
    for ax_row, (name, row) in zip(axes, rows.items()):
        for ax, (label, img) in zip(ax_row, row.items()):
            im = ax.imshow(img.numpy(), cmap="RdBu_r" if diverging else "viridis", vmin=-top if diverging else 0,
                           vmax=top)
            ax.set(title=label, xlabel=x_label, ylabel=f"{name}\n{y_label}")
        for ax in ax_row[len(row):]:
            ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.8, label="one scale for every panel")
    save_figure(fig, path, command, title)


def plot_attention(maps, path, command, percentile=99.0):
    """analyze_checkpoints' maps (plot_maps): layer 0 head 0's attention of each checkpoint, below it the PE-only
    probes; the scale from 0 to the `percentile` of every value shown, so that a proximity band stands out."""
    rows = {"attention": {label: m["attention"][0][0] for label, m in maps.items()}}
    title = "layer 0, head 0: softmax attention, mean over validation sequences"
    probes = {label: m["probe"][0] for label, m in maps.items() if m["probe"] is not None}
    if probes:
        rows["PE-only probe"] = probes
        title += "; PE-only probe softmax(P W_Q^T W_K P^T / sqrt(d_head))"
    values = np.concatenate([img.flatten().numpy() for row in rows.values() for img in row.values()])
    top, L = float(np.percentile(values, percentile)), next(iter(rows["attention"].values())).shape[-1]
    plot_maps(rows, path, f"{title}\ncolour scale 0 to {top:.3f} (the {percentile:g}th percentile of every panel; "
              f"above it: the brightest colour); uniform attention is 1/L = {1 / L:.4f}\nLook for a bright band "
              f"along the diagonal: each position attends to its neighbours", command, top=top)


def plot_curves(curves, path, title, command, hline=None):
    """Validation accuracy per epoch, one line per entry of `curves` ({label: finetune.py result dict, or a list of
    them: their mean}); `hline`: a dotted line (value, label)."""
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for label, results in curves.items():
        results = results if isinstance(results, list) else [results]
        epochs = [e["step"] / results[0]["steps_per_epoch"] for e in results[0]["evals"]]
        accs = [sum(r["evals"][j]["val_acc"] for r in results) / len(results) for j in range(len(epochs))]
        ax.plot(epochs, accs, marker=".", label=label if len(results) == 1 else f"{label} (mean of {len(results)})")
    if hline is not None:
        ax.axhline(hline[0], ls=":", color="gray", label=hline[1])
    ax.set(xlabel="epoch", ylabel="validation accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path, command)


def plot_initscale(runs, kinds, scales, lengths, seeds, path, command):
    """ablate.py initscale's phase diagram: mean best_val_acc of `runs` (dicts) per (scale, length) in each cell; a
    panel per init kind (row) and stage (column), one colour scale."""
    stages = (("scratch", "from scratch"), ("spt", "SPT, then finetune"))
    mean = lambda rs: sum(r["best_val_acc"] for r in rs) / len(rs) if rs else float("nan")
    grids = {(kind, stage): np.array([[mean([r for r in runs if (r["kind"], r["stage"], r["scale"], r["length"]) ==
                                            (kind, stage, scale, length)]) for scale in scales] for length in lengths])
             for kind in kinds for stage, _ in stages}
    low = min(0.5, np.nanmin(list(grids.values())))  # chance for two classes, or a cell below it
    fig, axes = pyplot().subplots(len(kinds), 2, figsize=(9, 3.2 * len(kinds)), squeeze=False, layout="constrained")
    for row, kind in enumerate(kinds):
        for col, (stage, title) in enumerate(stages):
            ax, grid = axes[row][col], grids[kind, stage]
            im = ax.imshow(grid, vmin=low, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
            for (i, j), value in np.ndenumerate(grid):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.8 else "k")
            ax.set_xticks(range(len(scales)), [f"{s:g}" for s in scales])
            ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set(xlabel="init scale (x PyTorch default)", ylabel="sequence length L", title=f"{kind}: {title}")
    fig.colorbar(im, ax=axes, shrink=0.8, label=f"best val acc (one scale, {low:.2f} to 1)")
    save_figure(fig, path, command, f"Synthetic trajectories: best validation accuracy, mean of {seeds} seed(s)")


def plot_seed_curves(runs, majority, path, command):
    """ablate.py pooling's curves: validation accuracy per epoch of each run (r["curve"]: (epoch, val acc) pairs), a
    line per seed; a panel per pooling (row) and run (column: r["name"]), the majority rate and 0.9 dashed."""
    poolings, names = sorted({r["pooling"] for r in runs}), sorted({r["name"] for r in runs})
    fig, axes = pyplot().subplots(len(poolings), len(names), figsize=(4.5 * len(names), 2.6 * len(poolings)),
                                  squeeze=False, sharex=True, sharey=True, layout="constrained")
    for (row, pooling), (col, name) in itertools.product(enumerate(poolings), enumerate(names)):
        ax = axes[row][col]
        for r in sorted((r for r in runs if (r["pooling"], r["name"]) == (pooling, name)), key=lambda r: r["seed"]):
            ax.plot(*zip(*r["curve"]), label=f"seed {r['seed']}")
        for level in (majority, 0.9):
            ax.axhline(level, color="gray", linestyle="--", linewidth=0.8)
        ax.set(title=f"{pooling} pooling, {name}", xlabel="epoch", ylabel="val acc")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, command, "Validation accuracy per epoch (dashed: the majority rate and 0.9)")


# ---- 4. Command line: a table of subcommands, each with the flags it takes ----

FLAGS = {  # flag: argparse keywords
    "out": dict(type=data.folder, default="out/analysis", help="folder for the figures and JSON"),
    "ckpt": dict(nargs="+", required=True, help="checkpoints, e.g. out/synthetic/pretrain.pt"),
    "data_dir": dict(type=data.folder, default="data", help="root of data/<task>/"),
    "n": dict(type=data.POSITIVE, default=64, help="sequences used (gradients: training; else validation)"),
    "seed": dict(type=data.SEED, default=0, help="seed of the random tokens (prop1), of the class head and masks"),
    "band": dict(type=data.NON_NEGATIVE, default=3, help="k of the band mass |i - j| <= k"),
    "run_dir": dict(required=True, help="folder with <stage>_init.pt and <stage>_step*.pt"),
    "stage": dict(default="pretrain", choices=("pretrain", "finetune_spt", "finetune_scratch"), help="whose snapshots"),
}
COMMANDS = {  # name: (function, help, flags besides --out)
    "prop1": (cmd_prop1, "Proposition 1: L_sup'(0) and L_SPT'(0) at uniform attention", ("seed",)),
    "gradients": (cmd_gradients, "Proposition 1 in a model: score gradient shares", ("ckpt", "data_dir", "n", "seed")),
    "attention": (cmd_attention, "maps, PE-only probe, W_Q^T W_K, proximity", ("ckpt", "data_dir", "n", "band")),
    "curves": (cmd_curves, "proximity over training (--snapshots)", ("run_dir", "stage", "data_dir", "n", "band")),
}


def main(argv=None):
    """python analyze.py prop1 | gradients | attention | curves [flags]: one subcommand, its JSON and figures."""
    p = data.ArgumentParser(description="Numerical checks of Coser et al. (2026)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (func, help, flags) in COMMANDS.items():
        s = sub.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter, help=help)
        s.set_defaults(func=func)
        for flag in ("out",) + flags:
            s.add_argument("--" + flag, **FLAGS[flag])
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.command_line = command_line("analyze.py", argv)  # recorded in every figure this run draws
    for path in getattr(args, "ckpt", None) or []:  # every file opens (an OSError names it) before any work
        open(path, "rb").close()
    name, numbers = args.func(args)
    data.save_atomic(numbers, os.path.join(args.out, name))
    print(f"wrote {os.path.join(args.out, name)} and its figures")


if __name__ == "__main__":
    pretrain.run_stage(main)
