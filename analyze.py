r"""analyze.py -- what self-pretraining does to attention, and the theory behind it (Coser et al. 2026).

    python analyze.py prop1                     # Proposition 1 checked numerically (CPU, seconds)
    python analyze.py gradients --ckpt out/synthetic/pretrain_init.pt out/synthetic/pretrain.pt   # ... in the model
    python analyze.py attention --ckpt out/synthetic/pretrain_init.pt out/synthetic/pretrain.pt \
                                       out/synthetic/finetune_spt.pt     # maps, PE-only probe, W_Q^T W_K
    python analyze.py curves --run_dir out/synthetic                      # proximity over training (--snapshots)

Reads checkpoints (*.pt) and the task's validation split only; trains nothing. Writes PNG figures (matplotlib
Agg) and JSON numbers into --out (default out/analysis). The same commands run on GPU checkpoints of the paper
preset (pass --ckpt paths of any task; the maps are averaged over validation sequences).
Expect: prop1 in ~10 s (supervised derivative ~1e-18, closed form to ~1e-15); attention on the synthetic run in
~10 s: under the default reference init, entropy 4.56 -> ~2.2 nats, band mass 0.11 -> ~0.87, PE-only probe
correlation 0.87 -> ~0.98 (under --init_scheme normal: 4.61 -> ~2.2, 0.07 -> ~0.88, ~0.997 after SPT).

Sections: 1. Proposition 1 (1b: in the model)  2. attention after self-pretraining  3. the figures of ablate.py's experiments
(learning curves, the init-scale phase diagram)  4. command line
"""
import argparse
import math
import os
import shlex
import sys

import numpy as np
import torch
import torch.nn.functional as F

import data
from data import single_sequences
from model import Transformer, config_from_dict, param_group, unwrapped_state_dict

# ----------------------------------------------------------------------------------------------------------
# 1. Proposition 1 (Coser et al., Prop. 1): gradients of the two losses at uniform attention
# ----------------------------------------------------------------------------------------------------------
#
# Setting. Tokens X_1..X_L in R^d; scores s(a) = a D for a direction D (L x L); A(a) = row-softmax(s(a));
# o_i = sum_j A_ij X_j; mean pool h = (1/L) sum_i o_i; L_sup(a) = E[l(h(a), Y)];
# L_SPT(a) = (1/(2L)) sum_i E||X_i - o_i(a)||^2. Expectations E are averages over a sample of N sequences.
#
# Derivation. At a = 0 attention is uniform, A = 11^T/L, and dA/da(0) = Dbar/L with Dbar = D P the row-centred
# direction (P = I - 11^T/L). Hence o_i'(0) = (1/L) sum_j Dbar_ij X_j and
#     h'(0) = (1/L^2) sum_j (1^T Dbar)_j X_j,      1^T Dbar = 1^T D P,
# which is 0 for every sample when D has zero column sums (1^T D = 0): L_sup'(0) = 0 for ANY loss l.
# For reconstruction, X_i - o_i(0) = X_i - mean_k X_k = (P X)_i is not zero, so
#     L_SPT'(0) = -(1/L) sum_i E[(P X)_i . o_i'(0)] = -(1/L^2) <Dbar, P C>_F = -(1/L^2) <P D P, C>_F,
# with C_ij = E[X_i . X_j] (uncentred second moments; exact when C is the empirical matrix of the same sample).
# The cross term with the mean is +(1/L^3) sum_j (1^T Dbar)_j (1^T C)_j; it vanishes exactly when 1^T D = 0,
# because then P D P = D P = Dbar. So the paper's -(1/L^2) <Dbar, C>_F is exact (to float precision, with the
# empirical C; with the population C only up to sampling error) for zero-column-sum directions, and
# -(1/L^2) <P D P, C>_F is the exact form for every direction. Centring of the tokens is not needed for either.
# With [CLS] pooling (h = o_1), h'(0) = (1/L) sum_j Dbar_1j X_j, which does not vanish unless row 1 of D is
# constant, so the zero-gradient argument does not carry over (the table reports the numbers).

def ar1_tokens(n, length, dim, rho=0.8, seed=0):
    """(n, length, dim) float64 tokens, a stationary AR(1) process along the sequence (corr rho^|i-j|).

    Built as X = chol(Sigma) Z with Sigma_ij = rho^|i-j| (no loop over positions), then centred over the
    sample at each position. Population second moments (before centring): C_ij = dim * rho^|i-j|, the 2nd output.
    """
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(length, dtype=torch.float64)
    sigma = rho ** (idx[:, None] - idx[None, :]).abs()
    z = torch.randn(n, length, dim, generator=g, dtype=torch.float64)
    x = torch.einsum("ij,njd->nid", torch.linalg.cholesky(sigma), z)
    return x - x.mean(0, keepdim=True), dim * sigma


def column_centred(d):
    """D - 11^T D / L: the (L, L) direction with zero column sums closest to D."""
    return d - d.mean(0, keepdim=True)


def row_centred(d):
    """Dbar = D - D 11^T / L (Coser et al., Prop. 1): each row of the (L, L) direction sums to zero."""
    return d - d.mean(1, keepdim=True)


def band_direction(length, width=2):
    """(L, L) proximity direction: 1 where |i - j| <= width, else 0, column-centred (so 1^T D = 0)."""
    idx = torch.arange(length)
    return column_centred(((idx[:, None] - idx[None, :]).abs() <= width).to(torch.float64))


def second_moments(x):
    """Empirical C_ij = (1/N) sum_n X_i^(n) . X_j^(n) for x of shape (N, L, d); returns (L, L)."""
    return torch.einsum("nid,njd->ij", x, x) / x.shape[0]


def prop1_losses(x, d, a, w, y, pooling="mean"):
    """The two losses of Coser et al., Prop. 1, at attention scores a * D.

    x: (N, L, d) tokens; d: (L, L) direction; a: scalar tensor; w: (d, K) fixed linear classifier; y: (N,) labels.
    pooling: "mean" (h = mean_i o_i) or "cls" (h = o_1, the output at the first position).
    Returns (L_sup, L_SPT): cross-entropy of h @ w against y, and (1/(2L)) sum_i mean_n ||X_i - o_i||^2.
    """
    attn = torch.softmax(a * d, dim=-1)                # (L, L), the same for every sequence
    o = torch.einsum("ij,njd->nid", attn, x)           # (N, L, d)
    h = o.mean(1) if pooling == "mean" else o[:, 0]    # (N, d)
    l_sup = F.cross_entropy(h @ w, y)
    l_spt = ((x - o) ** 2).sum((1, 2)).mean() / (2 * x.shape[1])
    return l_sup, l_spt


def prop1_derivatives(x, d, w, y, pooling="mean", a0=0.0):
    """(L_sup'(a0), L_SPT'(a0)) as floats, by autograd through `prop1_losses` (a0 = 0: uniform attention)."""
    a = torch.tensor(a0, dtype=torch.float64, requires_grad=True)
    l_sup, l_spt = prop1_losses(x, d, a, w, y, pooling)
    d_sup = torch.autograd.grad(l_sup, a, retain_graph=True)[0]
    d_spt = torch.autograd.grad(l_spt, a)[0]
    return d_sup.item(), d_spt.item()


def closed_form_spt_derivative(x, d, c=None):
    """The paper's closed form L_SPT'(0) = -(1/L^2) <Dbar, C>_F (Coser et al., Prop. 1).

    x: (N, L, d); d: (L, L); c: (L, L) second moments, the empirical ones of x if None.
    Exact only for directions with zero column sums (see `exact_spt_derivative` and the section notes).
    """
    c = second_moments(x) if c is None else c
    return (-(row_centred(d) * c).sum() / x.shape[1] ** 2).item()


def exact_spt_derivative(x, d, c=None):
    """L_SPT'(0) = -(1/L^2) <P D P, C>_F with P = I - 11^T/L, exact for every (L, L) direction d.

    Adds to the paper's form the cross term with the mean, +(1/L^3) sum_j (1^T Dbar)_j (1^T C)_j, which is zero
    when 1^T D = 0. x: (N, L, d); c: (L, L), the empirical second moments of x if None.
    """
    c = second_moments(x) if c is None else c
    return (-(column_centred(row_centred(d)) * c).sum() / x.shape[1] ** 2).item()


def rel_err(value, reference):
    return abs(value - reference) / max(abs(reference), 1e-300)


def prop1_table(n=512, length=16, dim=8, n_classes=3, n_random=3, seed=0):
    """Rows (dicts) of the Proposition 1 check: autograd derivatives at a = 0 against the closed forms."""
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
        paper, exact = closed_form_spt_derivative(xs, d, c), exact_spt_derivative(xs, d, c)
        rows.append(dict(case=name, pooling=pooling, max_abs_col_sum=d.sum(0).abs().max().item(), dsup=sup,
                         dspt=spt, paper=paper, rel_err_paper=rel_err(paper, spt),
                         exact=exact, rel_err_exact=rel_err(exact, spt)))
    settings = dict(n=n, length=length, dim=dim, n_classes=n_classes, seed=seed, rho=0.8, dtype="float64",
                    loss="cross-entropy of a fixed random linear classifier on random labels")
    return rows, settings, (x, w, y)


def format_prop1_table(rows):
    head = (f"{'case':38s} {'Lsup_prime(0)':>13s} {'Lspt_prime(0)':>13s} {'paper form':>13s} {'rel.err':>8s}"
            f" {'exact form':>13s} {'rel.err':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:38s} {r['dsup']:13.3e} {r['dspt']:13.6e} {r['paper']:13.6e} "
                     f"{r['rel_err_paper']:8.1e} {r['exact']:13.6e} {r['rel_err_exact']:8.1e}")
    return "\n".join(lines)


def plot_prop1(x, w, y, d, path, command, a_max=3.0, n_points=121):
    """Both losses along a in [-a_max, a_max] for direction d, with the closed-form tangent of L_SPT at 0;
    `command` drew it (save_figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    grid = np.linspace(-a_max, a_max, n_points)
    losses = np.array([[v.item() for v in prop1_losses(x, d, torch.tensor(a), w, y)] for a in grid])
    slope, l0 = closed_form_spt_derivative(x, d), losses[n_points // 2, 1]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(grid, losses[:, 0])
    axes[0].set(xlabel="a (scores = a D)", ylabel="L_sup(a)", title="supervised loss, mean pooling")
    axes[1].plot(grid, losses[:, 1], label="L_SPT(a)")
    axes[1].plot(grid, l0 + slope * grid, "--", label="tangent, -(1/L^2)<Dbar, C>")
    axes[1].set(xlabel="a (scores = a D)", ylabel="L_SPT(a)", title="reconstruction loss")
    axes[1].set_ylim(losses[:, 1].min() - 0.1 * np.ptp(losses[:, 1]), losses[:, 1].max() + 0.1 * np.ptp(losses[:, 1]))
    axes[1].legend()
    for ax in axes:
        ax.axvline(0, color="gray", lw=0.5)
    fig.suptitle("Coser et al. Prop. 1: band direction (column-centred), AR(1) tokens")
    fig.tight_layout()
    save_figure(fig, path, command, dpi=120)


def command_line(script, argv):
    """The command `python <script> <argv...>` as one would type it (shell-quoted): what a figure records of
    how it was drawn (save_figure)."""
    return "python " + shlex.join([script, *argv])


def save_figure(fig, path, command, dpi=110):
    """Write a matplotlib figure as PNG atomically (data.save_atomic) and close it. `command` (command_line: the
    command that drew it) goes into the PNG's text chunk "Command", so the file itself says how to redraw it
    (figure_command reads it back; ablate.py report prints it under the figure in the README)."""
    import matplotlib.pyplot as plt
    data.save_atomic(lambda f: fig.savefig(f, format="png", dpi=dpi, metadata={"Command": command}), path)
    plt.close(fig)


def figure_command(path):
    """The command recorded in a PNG by save_figure, or None (a PNG drawn before figures recorded it, or by
    something else). Raises OSError for a file that is missing or not an image."""
    from PIL import Image  # pillow: matplotlib's own image library, installed with it
    with Image.open(path) as image:
        if image.format != "PNG":  # a JPEG or GIF under a .png name has no text chunks
            raise OSError(f"{path}: a {image.format} image, not a PNG")
        return image.text.get("Command")


def cmd_prop1(args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny tensors: thread start-up would cost more than the arithmetic
    try:
        run_prop1(args)
    finally:
        torch.set_num_threads(threads)


def run_prop1(args):
    rows, settings, (x, w, y) = prop1_table(seed=args.seed)
    print(format_prop1_table(rows))
    zero = [r for r in rows if r["max_abs_col_sum"] < 1e-12]
    print(f"\nzero column sums: max |L_sup'(0)| (mean pool) = "
          f"{max(abs(r['dsup']) for r in zero if r['pooling'] == 'mean'):.1e}; paper form matches autograd "
          f"(empirical C) to {max(r['rel_err_paper'] for r in zero if 'population' not in r['case']):.1e} rel.")
    print("the exact form -(1/L^2)<P D P, C> matches for every direction; the paper's form needs 1^T D = 0;")
    print("with the population C both hold only up to sampling error. [CLS] pooling (h = o_1): L_sup'(0) = "
          f"{rows[-1]['dsup']:.2e}, not zero: the blind spot does not hold for [CLS] pooling here.")
    os.makedirs(args.out, exist_ok=True)
    plot_prop1(x, w, y, band_direction(settings["length"]), os.path.join(args.out, "prop1.png"), args.command_line)
    data.save_atomic(dict(settings=settings, rows=rows), os.path.join(args.out, "prop1.json"))
    print(f"wrote {os.path.join(args.out, 'prop1.png')} and prop1.json")


# ----------------------------------------------------------------------------------------------------------
# 1b. Proposition 1 in the model itself: where each loss's gradient points at the attention scores
# ----------------------------------------------------------------------------------------------------------
# The directions of Prop. 1 are the score directions D with zero column sums. A score gradient G = dL/dS (L x L)
# has <G, D> = 0 for all of them exactly when every row of G is the same (G = 1 g^T): a change that raises key j's
# score for every query alike, a key salience with no query-key interaction and so no proximity. The share of
# ||G||^2 along Prop. 1's directions is ||G - 1 gbar^T||^2 / ||G||^2, gbar the mean row. Prop. 1 says it is 0 for
# L_sup in the minimal model (one layer, no LayerNorm, no MLP, mean pooling, a linear head) at uniform attention;
# an MLP after the attention, LayerNorm, or attention that is not uniform make it positive. This measures it, for
# both losses, in any SPT checkpoint (pretrain_init.pt: at init; pretrain.pt: after SPT).

def prop1_share(grad, lengths=None):
    """The share of the score gradients' squared norm along Prop. 1's directions (zero column sums), pooled.

    grad: (B, H, L, L) dL/dS of one layer; lengths: (B,) real lengths or None. Only real query rows count, and
    the mean row is taken over them (padded keys have zero gradient, padded queries feed nothing). Returns
    sum ||G_bh - 1 gbar_bh^T||^2 / sum ||G_bh||^2 over sequences b and heads h (0 if the gradient is 0).
    """
    B, H, L, _ = grad.shape
    real = torch.ones(B, L, dtype=grad.dtype) if lengths is None else \
        (torch.arange(L)[None, :] < lengths[:, None]).to(grad.dtype)
    w = real[:, None, :, None]                                                      # (B, 1, L, 1) query rows
    mean_row = (grad * w).sum(2, keepdim=True) / w.sum(2, keepdim=True)            # (B, H, 1, L)
    total = (grad.pow(2) * w).sum()
    return ((grad - mean_row).pow(2) * w).sum().item() / total.item() if total > 0 else 0.0


def score_gradient(probs, probs_grad):
    """dL/dS from the attention probabilities P = softmax(S) (rows) and dL/dP, both (..., L, L): the softmax
    backward, dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)."""
    return probs * (probs_grad - (probs * probs_grad).sum(-1, keepdim=True))


def loss_gradients(path, data_dir, n=64, chunk=None, seed=0, losses=("L_sup", "L_SPT")):
    """Prop. 1 in the model of a checkpoint: on its task's first n training sequences, the attention-score
    gradients of L_sup (cross-entropy of the labels through mean pooling, what finetuning minimizes) and, for a
    checkpoint of pretrain.py, of L_SPT (the run's masked reconstruction: its mask ratio and loss, masks drawn with
    `seed`), each summed over the sequences. A finetuning checkpoint (e.g. finetune_scratch_init.pt, the model
    from-scratch training starts from) is scored on its own class head; a pretrain.py one gets a fresh class head of
    its preset's kind (linear, or the MLP head of Text/Image `paper`) drawn with `seed` and zeros in its
    mask-indicator channel (pass finetune_spt_init.pt for the head finetuning after SPT really starts from). Returns {loss: {"prop1_share": [per layer], "grad_norm": {group:
    ||dL/dW|| / sequences}}} (prop1_share; model.PARAM_GROUPS).

    `chunk` sequences at a time (default: at most 16, fewer at long L: chunk x L^2 <= 2^24 scores per head and
    layer, as attention_maps); `losses` the ones wanted (L_SPT is left out anyway where the checkpoint has no
    reconstruction head). Raises ValueError for a Retrieval (pair) model, whose head pools two documents, for
    local attention (attn_window), whose zeros outside the window are not Prop. 1's uniform attention, and for a
    model that attends to padded keys on sequences of unequal lengths (refuse_attended_padding).
    """
    import pretrain  # the masking and the loss of the SPT stage itself
    ck = data.load_pt(path)
    cfg, meta = ck["model_config"], ck["data_meta"]
    if cfg.get("pair") or (cfg.get("attn_window") and cfg["attn_window"] < meta["max_len"]):
        raise ValueError(f"{path}: a pair model (Retrieval) or one with local attention; Prop. 1's measure needs "
                         f"one sequence through full attention")
    run = ck.get("config") or {}
    if ck.get("stage") == "pretrain":  # no class head: the one finetuning would give it (its preset's, as finetune.py)
        preset = pretrain.PRESETS[data.task_family(ck["task"])].get(run.get("preset"), {})
        cfg = dict(cfg, cls_mlp=preset.get("model", {}).get("cls_mlp", False))
    with torch.random.fork_rng():  # a fresh head from `seed`, the caller's random state left as it was
        torch.manual_seed(seed)
        model = Transformer(config_from_dict(dict(cfg, n_classes=meta["n_classes"]), path))
    missing, unexpected = model.load_state_dict(unwrapped_state_dict(ck["model"]), strict=False)
    if unexpected or any(not k.startswith("cls_head.") for k in missing):
        raise ValueError(f"{path}: weights {missing or unexpected} do not fit its own model_config")
    model.eval()  # dropout off (0 in every preset anyway); gradients still flow
    split = data.load_split(data_dir, ck["task"], "train")
    count = min(n, len(split["labels"]))
    refuse_attended_padding(model, split["lengths"][:count], path)
    ratio = run.get("mask_ratio") or pretrain.MASK_RATIO[data.task_family(ck["task"])]
    kind = run.get("rec_loss") or ("ce" if meta["kind"] == "tokens" else "mse")
    g = torch.Generator().manual_seed(seed)
    chunk = chunk or max(1, min(16, 2 ** 24 // data.split_width(split) ** 2))
    out = {}
    for loss_name in [name for name in losses if name == "L_sup" or model.rec_head is not None]:
        model.zero_grad(set_to_none=True)
        num, den = [0.0] * model.cfg.n_layers, [0.0] * model.cfg.n_layers  # per layer, summed over chunks
        for i in range(0, count, chunk):
            x, lengths, labels = data.get_batch(split, torch.arange(i, min(i + chunk, count)), "cpu", multiple=1)
            if loss_name == "L_sup":
                inputs = model_inputs(model, x)
            else:
                inputs, masked = pretrain.mask_batch(x, lengths, ratio, meta.get("mask_id"), g)
            z, probs = model.encode(inputs, lengths, need_weights=True)
            for p in probs:
                p.retain_grad()
            if loss_name == "L_sup":
                loss = F.cross_entropy(model.class_head(model.pool(z, lengths)), labels, reduction="sum")
            else:
                targets = pretrain.targets_at(x, None, kind, meta)
                loss = pretrain.reconstruction_loss(model.rec_head(z), targets, kind, masked) * masked.sum()
            loss.backward()
            grads = [score_gradient(p.detach(), p.grad) for p in probs]
            totals = [G.pow(2).sum().item() for G in grads]
            # pooled over chunks: each chunk's share times its total, summed, over the totals summed
            num = [a + prop1_share(G, lengths) * t for a, G, t in zip(num, grads, totals)]
            den = [a + t for a, t in zip(den, totals)]
        norms = {}
        for name, param in model.named_parameters():
            if param.grad is not None:
                group = param_group(name)
                norms[group] = norms.get(group, 0.0) + param.grad.pow(2).sum().item()
        out[loss_name] = dict(prop1_share=[a / b if b > 0 else 0.0 for a, b in zip(num, den)],
                              grad_norm={k: math.sqrt(v) / count for k, v in norms.items()})
    return out


def cmd_gradients(args):
    results = {}
    for path in args.ckpt:
        results[path] = res = loss_gradients(path, args.data_dir, args.n, seed=args.seed)
        print(f"{path}: the share of each loss's attention-score gradient along Prop. 1's directions (zero column "
              f"sums), per layer, and the gradient norm ratio |dL/dW_Q| / |dL/dW_V|:")
        for loss_name, r in res.items():  # (L_SPT only for a pretrain.py checkpoint)
            ratio = r["grad_norm"]["W_Q"] / r["grad_norm"]["W_V"] if r["grad_norm"].get("W_V") else float("nan")
            print(f"  {loss_name:5s} Prop. 1 share per layer " + " ".join(f"{s:.3g}" for s in r["prop1_share"])
                  + f";  |dL/dW_Q| / |dL/dW_V| {ratio:.3g}")
    print("reading: Prop. 1 makes L_sup's share exactly 0 only at exactly uniform attention; at init attention is "
          "near uniform, not exactly (the README's Results), so a small L_sup share there agrees with it")
    os.makedirs(args.out, exist_ok=True)
    data.save_atomic(dict(n=args.n, seed=args.seed, results=results), os.path.join(args.out, "gradients.json"))
    print(f"wrote {os.path.join(args.out, 'gradients.json')}")


# ----------------------------------------------------------------------------------------------------------
# 2. Attention after self-pretraining (Coser et al., Sec. 4): maps, PE-only probe, W_Q^T W_K, proximity
# ----------------------------------------------------------------------------------------------------------
# Everything below reads checkpoints written by pretrain.py / finetune.py (their _init.pt holds the weights at
# step 0) and the task's validation split; it trains nothing.

def load_model(path):
    """(model in eval mode on the CPU, checkpoint dict) from any checkpoint of this project."""
    ck = data.load_pt(path)
    model = Transformer(config_from_dict(ck["model_config"], path))
    model.load_state_dict(unwrapped_state_dict(ck["model"]))
    return model.eval(), ck


def refuse_attended_padding(model, lengths, path):
    """Raise ValueError if `model` attends to padded keys (ModelConfig.attend_padding, pretrain.py
    --attend_padding) and the sequences of `lengths` (B,) differ in length: the statistics here take attention over
    each sequence's own keys, and such a model would put weight on the padding of whatever batch it is given."""
    if model.cfg.attend_padding and bool((lengths != lengths.max()).any()):
        raise ValueError(f"{path}: trained with --attend_padding (padded keys attended, as Amos et al.'s code), and "
                         f"these sequences differ in length: its attention depends on the batch's padding, which "
                         f"these analyses leave out; analyze a model trained without the flag, or equal-length data")


def model_inputs(model, x):
    """An SPT model of continuous inputs expects a mask-indicator channel: append zeros (nothing masked)."""
    if x.dtype != torch.long and x.shape[-1] == model.cfg.d_input - 1:
        return torch.cat([x, torch.zeros_like(x[..., :1])], dim=-1)
    return x


@torch.no_grad()
def attention_maps(model, x, lengths=None, chunk=None):
    """Softmax attention of every layer averaged over a batch, and the mean entropy of its rows.

    x: (B, L) tokens or (B, L, d_input) values; lengths: (B,) or None (all of length L). Returns (maps,
    entropies), lists over layers of (H, L, L) and (H, L): maps[l][h, i] is the mean, over the sequences in
    which position i is real (i < length), of their attention row i; entropies[l][h, i] is the mean of those
    rows' entropies (nats). The entropy is taken row by row, before averaging: the entropy of the averaged map
    is larger (entropy is concave) and would make attention look more uniform than any one sequence's is.
    `chunk` sequences at a time (default: as many as keep chunk x L x L under 2^24), so that memory holds
    layers x chunk x H x L x L numbers, not layers x B x H x L x L (at L = 4096 one sequence at a time).
    """
    L = x.shape[1]
    chunk, sums, ents = chunk or max(1, 2 ** 24 // L ** 2), None, None
    real = torch.ones(len(x), L) if lengths is None else (torch.arange(L) < lengths[:, None]).float()  # (B, L)
    for i in range(0, len(x), chunk):
        part = None if lengths is None else lengths[i:i + chunk]
        _, probs = model.encode(model_inputs(model, x[i:i + chunk]), part, need_weights=True)
        w = real[i:i + chunk, None, :]                                                    # (chunk, 1, L)
        m = [(p * w[..., None]).sum(0) for p in probs]
        e = [(-(p * p.clamp_min(1e-30).log()).sum(-1) * w).sum(0) for p in probs]
        sums = m if sums is None else [s + a for s, a in zip(sums, m)]
        ents = e if ents is None else [s + a for s, a in zip(ents, e)]
    count = real.sum(0).clamp_min(1)  # sequences in which each position is real
    return [s / count[:, None] for s in sums], [e / count for e in ents]


@torch.no_grad()
def pe_probe(model, length, layer=0):
    """The PE-only probe: X = 0, only the sinusoidal encodings P (L, d) through layer `layer`'s W_Q, W_K.

    scores_h = (P W_Q,h^T)(P W_K,h^T)^T / sqrt(d_head) per head h (biases left out, as in the paper's
    P W_Q^T W_K P^T / sqrt(d)); P goes through the block's first LayerNorm when the model has one.
    Returns (scores (H, L, L), softmax probabilities (H, L, L)).
    """
    block = model.blocks[layer]
    attn = block.attn
    p = block.ln1(model.pe[:length])                                            # (L, d_model)
    q = (p @ attn.q_proj.weight.T).view(length, attn.n_heads, attn.d_head).transpose(0, 1)  # (H, L, d_head)
    k = (p @ attn.k_proj.weight.T).view(length, attn.n_heads, attn.d_head).transpose(0, 1)
    scores = q @ k.transpose(1, 2) / math.sqrt(attn.d_head)
    return scores, scores.softmax(-1)


@torch.no_grad()
def qk_product(model, layer=0, head=0):
    """W_Q,h^T W_K,h (d_model, d_model): the bilinear form that scores a query against a key for head h."""
    attn = model.blocks[layer].attn
    rows = slice(head * attn.d_head, (head + 1) * attn.d_head)
    return attn.q_proj.weight[rows].T @ attn.k_proj.weight[rows]


def attention_stats(probs, band=3, side=None, entropy=None, lengths=None):
    """Proximity statistics of attention probabilities (..., L, L), averaged over rows and leading dims.

    entropy (nats; log L for uniform attention): the mean row entropy of `probs`, or, when `probs` is a mean over
    sequences (attention_maps), the mean of `entropy` (..., L), the rows' entropies taken sequence by sequence
    (then entropy_of_mean_map is the former, for comparison). band_mass = attention within |i - j| <= band
    (uniform_band_mass: its value for uniform attention), mean_distance = sum_j A_ij |i - j| (L/3 roughly for
    uniform attention, 0 for attending to oneself); both are linear in A, so a mean map gives the mean over
    sequences. With `side` (an image of side x side pixels flattened row by row, L = side^2), the same
    in the image's two dimensions: band_mass_2d = attention within the (2 band + 1)^2 pixels around the query
    (Chebyshev distance <= band; the 1-D band misses the pixels above and below, `side` positions away), and
    mean_distance_2d, the mean Euclidean distance in pixels. Raises ValueError if side^2 != L.

    `lengths` (B,): the real lengths of the sequences an attention_maps mean was taken over (padded batches).
    Row i of that map is the mean over the sequences real at i, so each row is weighted by their count: every
    statistic is then the mean over real (sequence, query) pairs, and the uniform references are those of
    uniform attention over each sequence's own n real keys (log n; its band mass), not over L.
    """
    L = probs.shape[-1]
    pos = torch.arange(L)
    dist = (pos[:, None] - pos[None, :]).abs().to(probs.dtype)
    if lengths is None:
        real = torch.ones(1, L, dtype=probs.dtype)                       # (sequences, L): which rows and keys
    else:
        real = (pos < lengths[:, None]).to(probs.dtype)
    weight = real.sum(0)                                                 # (L,): sequences real at each row

    def mean(per_row):  # (..., L) per query row -> the mean over real (sequence, row) pairs and leading dims
        return ((per_row * weight).sum(-1) / weight.sum()).mean().item()

    def uniform(near):  # band mass of uniform attention over each sequence's real keys, over its real rows
        per_row = (real @ near.to(probs.dtype).T) / real.sum(1, keepdim=True)         # (sequences, L)
        return ((per_row * real).sum() / real.sum()).item()
    n = real.sum(1)
    map_entropy = mean(-(probs * probs.clamp_min(1e-30).log()).sum(-1))
    stats = dict(entropy=map_entropy if entropy is None else mean(entropy),
                 uniform_entropy=((n * n.log()).sum() / n.sum()).item(),
                 band_mass=mean((probs * (dist <= band)).sum(-1)), band=band,
                 uniform_band_mass=uniform(dist <= band),
                 mean_distance=mean((probs * dist).sum(-1)))
    if entropy is not None:
        stats["entropy_of_mean_map"] = map_entropy
    if side is not None:
        if side * side != L:
            raise ValueError(f"side {side}: an image of side x side pixels has {side * side} positions, not {L}")
        dr = (pos[:, None] // side - pos[None, :] // side).abs().to(probs.dtype)
        dc = (pos[:, None] % side - pos[None, :] % side).abs().to(probs.dtype)
        near = torch.maximum(dr, dc) <= band
        stats.update(band_mass_2d=mean((probs * near).sum(-1)), uniform_band_mass_2d=uniform(near),
                     mean_distance_2d=mean((probs * torch.hypot(dr, dc)).sum(-1)))
    return stats


def relative_displacement(init_sd, sd):
    """||W - W_init|| / ||W_init|| per parameter group (model.PARAM_GROUPS), over the groups both share."""
    num, den = {}, {}
    for name, w0 in init_sd.items():
        if name in sd and sd[name].shape == w0.shape:
            g = param_group(name)
            num[g] = num.get(g, 0.0) + (sd[name].float() - w0.float()).pow(2).sum().item()
            den[g] = den.get(g, 0.0) + w0.float().pow(2).sum().item()
    return {g: math.sqrt(num[g]) / math.sqrt(den[g]) for g in num if den[g] > 0}


def correlation(a, b):
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def analyze_checkpoints(paths, data_dir, n=64, band=3):
    """Attention maps, PE probes and statistics for each checkpoint in `paths` (a dict label -> path).

    Uses the first `n` validation sequences of the checkpoints' task (Retrieval: the 2n documents of n pairs).
    Each checkpoint's "displacement" is measured from the weights its own run started from (data.run_init_path,
    named in "displacement_from"): for pretrain.pt the random init, for finetune_spt.pt the SPT weights with a
    fresh head, for finetune_scratch.pt its own random init. Returns (results dict of plain numbers,
    maps: label -> dict(attention=list of (H, L, L), probe=(H, L, L), qk=(d, d))).
    """
    results, maps = {}, {}
    for label, path in paths.items():
        model, ck = load_model(path)
        split = data.load_split(data_dir, ck["task"], "val")
        x, lengths, _ = data.get_batch(split, torch.arange(min(n, len(split["labels"]))), "cpu", multiple=1)
        x, lengths = single_sequences(x, lengths)  # Retrieval: each document of a pair on its own
        refuse_attended_padding(model, lengths, path)
        padded = None if bool((lengths == x.shape[1]).all()) else lengths
        attn, entropies = attention_maps(model, x, padded)
        side = math.isqrt(x.shape[1])  # pixel tasks: square images flattened row by row
        side = side if (ck.get("data_meta") or {}).get("kind") == "pixels" and side * side == x.shape[1] else None
        stats = attention_stats(attn[0], band, side, entropy=entropies[0], lengths=padded)
        probe = None
        if model.cfg.pos == "sinusoidal":  # the probe feeds the absolute encodings P; other schemes have none
            _, probe = pe_probe(model, x.shape[1])
            stats["probe"] = attention_stats(probe, band, side)
            stats["probe_corr_with_attention"] = correlation(probe, attn[0])
        stats["stage"], stats["path"] = ck.get("stage"), path
        start = data.run_init_path(path)  # the weights this checkpoint's own run started from
        if start is not None and os.path.abspath(start) != os.path.abspath(path):
            stats["displacement"] = displacement(load_model(start)[0], model)
            stats["displacement_from"] = start
        results[label] = stats
        maps[label] = dict(attention=attn, probe=probe, qk=qk_product(model))
    return results, maps


def displacement(start, model):
    """norm(W - W_start) / norm(W_start) per parameter group (relative_displacement), and for layer 0's
    W_Q,h^T W_K,h (qk_product) over all its heads h together, from the model `start` to `model`."""
    moved = relative_displacement(start.state_dict(), model.state_dict())
    heads = range(model.blocks[0].attn.n_heads)
    qk0, qk = (torch.stack([qk_product(m, 0, h) for h in heads]) for m in (start, model))
    moved["W_Q^T W_K"] = ((qk - qk0).norm() / qk0.norm()).item()
    return moved


def plot_maps(maps, key, path, title, command):
    """One heatmap per checkpoint (layer 0, head 0) of maps[label][key], side by side; `command` drew it
    (save_figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(maps), figsize=(4 * len(maps), 3.8), squeeze=False)
    for ax, (label, m) in zip(axes[0], maps.items()):
        img = m[key][0][0] if key == "attention" else (m[key][0] if key == "probe" else m[key])
        im = ax.imshow(img.numpy(), cmap="viridis" if key != "qk" else "RdBu_r")
        ax.set_title(label)
        ax.set_xlabel("key position j" if key != "qk" else "key feature")
        ax.set_ylabel("query position i" if key != "qk" else "query feature")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, command)


def checkpoint_label(path, paths):
    """A checkpoint's label in figures and attention.json: its file name without .pt (pretrain), or, where
    another of `paths` has the same file name (seed0/pretrain.pt, seed1/pretrain.pt), its path without .pt."""
    stem = lambda p: os.path.splitext(os.path.basename(p))[0]  # a/x.pt and b/x.pth are both "x"
    bare = lambda p: os.path.splitext(os.path.normpath(p))[0]
    if sum(stem(p) == stem(path) for p in paths) == 1:
        return stem(path)
    return bare(path) if sum(bare(p) == bare(path) for p in paths) == 1 else os.path.normpath(path)


def cmd_attention(args):
    paths = {checkpoint_label(p, args.ckpt): p for p in args.ckpt}
    if len(paths) < len(args.ckpt):  # d/x.pt and d/x.pt.pt: one label; distinct files (main) have distinct paths
        paths = {os.path.normpath(p): p for p in args.ckpt}
    results, maps = analyze_checkpoints(paths, args.data_dir, args.n, args.band)
    os.makedirs(args.out, exist_ok=True)
    plot_maps(maps, "attention", os.path.join(args.out, "attention.png"),
              "softmax attention, layer 0 head 0, mean over validation sequences", args.command_line)
    probes = {label: m for label, m in maps.items() if m["probe"] is not None}  # sinusoidal positions only
    if probes:
        plot_maps(probes, "probe", os.path.join(args.out, "pe_probe.png"),
                  "PE-only probe: softmax(P W_Q^T W_K P^T / sqrt(d_head)), X = 0", args.command_line)
    plot_maps(maps, "qk", os.path.join(args.out, "qk_product.png"), "W_Q^T W_K, layer 0 head 0", args.command_line)
    data.save_atomic(results, os.path.join(args.out, "attention.json"))
    for label, r in results.items():
        disp = r.get("displacement", {})
        print(f"{label:24s} entropy {r['entropy']:.2f} (uniform {r['uniform_entropy']:.2f}) | band mass "
              f"(|i-j|<={r['band']}) {r['band_mass']:.2f} | mean distance {r['mean_distance']:.1f} | "
              + (f"2-D band mass {r['band_mass_2d']:.2f} (uniform {r['uniform_band_mass_2d']:.2f}), mean distance "
                 f"{r['mean_distance_2d']:.1f} px | " if "band_mass_2d" in r else "")
              + (f"PE probe (every position of the longest sequence): entropy {r['probe']['entropy']:.2f} "
                 f"(uniform {r['probe']['uniform_entropy']:.2f}), corr with attention "
                 f"{r['probe_corr_with_attention']:.3f}" if "probe" in r else "PE probe: none (no absolute positions)")
              + ("" if not disp else " | displacement W_Q {W_Q:.2f} W_K {W_K:.2f} W_Q^T W_K {qk:.2f}".format(
                  W_Q=disp.get("W_Q", float("nan")), W_K=disp.get("W_K", float("nan")), qk=disp["W_Q^T W_K"])))
    print(f"wrote attention.png, {'pe_probe.png, ' if probes else ''}qk_product.png, attention.json in {args.out}")


def cmd_curves(args):
    """Proximity statistics over training, from the snapshots of a run (pretrain.py --snapshots)."""
    import glob
    import re
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stage, _, name = args.stage.partition("_")
    run = data.run_paths(os.path.dirname(os.path.abspath(args.run_dir)), os.path.basename(os.path.abspath(args.run_dir)),
                         stage, name or None)
    files = glob.glob(run["snapshot"].format(step="*"))
    steps = sorted((int(re.search(r"_step(\d+)\.pt$", f).group(1)), f) for f in files)
    if not steps:
        raise FileNotFoundError(f"no {args.stage}_step*.pt in {args.run_dir}: run {stage}.py with --snapshots")
    paths = {"step0": run["init"], **{f"step{s}": f for s, f in steps}}
    results, _ = analyze_checkpoints(paths, args.data_dir, args.n, args.band)
    xs = [0] + [s for s, _ in steps]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(axes, ("entropy", "band_mass", "mean_distance"),
                              ("attention entropy (nats)", f"band mass |i-j|<={args.band}", "mean attended distance")):
        ax.plot(xs, [r[key] for r in results.values()], marker="o")
        ax.set(xlabel="training step", ylabel=label)
    axes[0].axhline(results["step0"]["uniform_entropy"], ls="--", color="gray", label="log L (uniform)")
    axes[0].legend()
    fig.suptitle(f"proximity of attention over {args.stage} ({args.run_dir})")
    fig.tight_layout()
    os.makedirs(args.out, exist_ok=True)
    save_figure(fig, os.path.join(args.out, f"curves_{args.stage}.png"), args.command_line)
    data.save_atomic(dict(steps=xs, stats=list(results.values())), os.path.join(args.out, f"curves_{args.stage}.json"))
    print(f"wrote {os.path.join(args.out, f'curves_{args.stage}.png')} and .json")


# ----------------------------------------------------------------------------------------------------------
# 3. Figures of the experiments (ablate.py): learning curves and the init-scale phase diagram
# ----------------------------------------------------------------------------------------------------------

def plot_curves(curves, path, title, command, x="epoch", probe=None, hline=None):
    """ablate.py's learning-curve figures: validation accuracy, one line per entry of `curves` ({label: result dict with "evals", or a list of
    them: their mean}); x "epoch" (from the step) or "minutes" (result["minutes"]: training minutes at each
    evaluation). `probe`: an extra dashed curve (label, result); `hline`: a dotted line (value, label); `command`:
    the ablate.py command that drew it (save_figure)."""
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
        xs = [s / r0["steps_per_epoch"] for s in steps] if x == "epoch" else r0["minutes"]
        ax.plot(xs, accs, "--" if probe and i == len(items) - 1 else "-", marker=".", label=label +
                (f" (mean of {len(results)})" if len(results) > 1 else ""))
    if hline is not None:  # (value, label), e.g. the majority-class rate
        ax.axhline(hline[0], ls=":", color="gray", label=hline[1])
    ax.set_xlabel("epoch" if x == "epoch" else "training minutes on one CPU thread (evaluations excluded)")
    ax.set_ylabel("validation accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, command)


def plot_initscale(runs, kinds, scales, lengths, seeds, path, command):
    """ablate.py initscale's phase diagram: mean best validation accuracy over (init scale, sequence length), one
    panel per init kind (rows) and stage (columns: from scratch, SPT then finetune), each cell annotated with its
    mean. runs: dicts with kind, stage, scale, length, best_val_acc; `command`: the one that drew it (save_figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(kinds), 2, figsize=(9, 3.2 * len(kinds)), squeeze=False)
    for row, kind in enumerate(kinds):
        for col, (stage, title) in enumerate((("scratch", "from scratch"), ("spt", "SPT, then finetune"))):
            grid = [[sum(r["best_val_acc"] for r in rs) / len(rs) if rs else float("nan")
                     for rs in ([r for r in runs if (r["kind"], r["stage"], r["scale"], r["length"]) ==
                                 (kind, stage, scale, length)] for scale in scales)]
                    for length in lengths]
            ax = axes[row][col]
            im = ax.imshow(grid, vmin=0.5, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
            for i, line in enumerate(grid):
                for j, value in enumerate(line):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="w" if value < 0.8 else "k")
            ax.set_xticks(range(len(scales)), [f"{s:g}" for s in scales])
            ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set_xlabel("init scale (x PyTorch default)")
            ax.set_ylabel("sequence length L")
            ax.set_title(f"{kind}: {title}")
            fig.colorbar(im, ax=ax, fraction=0.046, label="val acc")
    fig.suptitle(f"Synthetic trajectories: best validation accuracy, mean of {seeds} seed(s)")
    fig.tight_layout()
    save_figure(fig, path, command)


# ----------------------------------------------------------------------------------------------------------
# 4. Command line
# ----------------------------------------------------------------------------------------------------------

def main(argv=None):
    p = data.ArgumentParser(description="Numerical checks of Coser et al. (2026)")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    s = sub.add_parser("prop1", formatter_class=fmt, help="Proposition 1: derivatives of L_sup and L_SPT at uniform attention")
    s.add_argument("--out", default="out/analysis", help="folder for prop1.png and prop1.json")
    s.add_argument("--seed", type=int, default=0, help="seed of the random tokens and directions")
    s.set_defaults(func=cmd_prop1)
    s = sub.add_parser("gradients", formatter_class=fmt, help="Proposition 1 in the model: the share of each loss's "
                       "score gradient along Prop. 1's directions, at init and after SPT")
    s.add_argument("--ckpt", nargs="+", required=True, help="checkpoints, e.g. out/synthetic/pretrain_init.pt "
                   "out/synthetic/pretrain.pt (L_sup and L_SPT) or out/synthetic/finetune_scratch_init.pt (L_sup)")
    s.add_argument("--data_dir", default="data", help="root of data/<task>/ (the training split is read)")
    s.add_argument("--n", type=int, default=64, help="training sequences summed over")
    s.add_argument("--seed", type=int, default=0, help="seed of the fresh class head and of the masks")
    s.add_argument("--out", default="out/analysis", help="folder for gradients.json")
    s.set_defaults(func=cmd_gradients)
    s = sub.add_parser("attention", formatter_class=fmt, help="attention maps, PE-only probe, W_Q^T W_K and proximity statistics")
    s.add_argument("--ckpt", nargs="+", required=True, help="checkpoints, e.g. out/synthetic/pretrain_init.pt "
                   "out/synthetic/pretrain.pt out/synthetic/finetune_spt.pt (each one's displacement is measured "
                   "from its own run's start, its _init.pt)")
    s.add_argument("--data_dir", default="data", help="root of data/<task>/ (the validation split is read)")
    s.add_argument("--n", type=int, default=64, help="validation sequences averaged over")
    s.add_argument("--band", type=int, default=3, help="k of the band mass |i - j| <= k")
    s.add_argument("--out", default="out/analysis", help="folder for attention.png, pe_probe.png, qk_product.png "
                                                         "and attention.json")
    s.set_defaults(func=cmd_attention)
    s = sub.add_parser("curves", formatter_class=fmt, help="proximity statistics over training from --snapshots checkpoints")
    s.add_argument("--run_dir", required=True, help="folder with <stage>_init.pt and <stage>_step*.pt")
    s.add_argument("--stage", default="pretrain", choices=("pretrain", "finetune_spt", "finetune_scratch"),
                   help="which run's snapshots (file name prefix)")
    s.add_argument("--data_dir", default="data", help="root of data/<task>/ (the validation split is read)")
    s.add_argument("--n", type=int, default=64, help="validation sequences averaged over")
    s.add_argument("--band", type=int, default=3, help="k of the band mass |i - j| <= k")
    s.add_argument("--out", default="out/analysis", help="folder for curves_<stage>.png and .json")
    s.set_defaults(func=cmd_curves)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.command_line = command_line("analyze.py", argv)  # recorded in every figure this run draws
    seen = {}
    for path in getattr(args, "ckpt", None) or []:  # every file, before the first one's minutes of work
        if not os.path.isfile(path):
            raise data.not_a_file(path)
        if os.path.realpath(path) in seen:  # one file, however spelled (out/x.pt, ./out/x.pt, its absolute path)
            raise ValueError(f"--ckpt names one file twice: {seen[os.path.realpath(path)]} and {path}")
        seen[os.path.realpath(path)] = path
    if getattr(args, "run_dir", None) is not None and not os.path.isdir(args.run_dir):
        raise FileNotFoundError(f"--run_dir {args.run_dir}: " + ("a file, not a folder" if os.path.isfile(
            args.run_dir) else "no such folder") + f" (a run's folder, e.g. out/synthetic, holding {args.stage}_init.pt "
            f"and {args.stage}_step*.pt)")
    args.func(args)


if __name__ == "__main__":
    data.run_cli(main)
