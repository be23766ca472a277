"""model.py -- the one compact Transformer every stage shares.

    input encoder (token embedding or linear layer)  +  sinusoidal absolute positions  (Vaswani et al. 2017, 3.5)
    -> n_layers x pre-LayerNorm block:  x + Attention(LN(x)),  x + MLP(LN(x))          (Amos et al. 2024 configs)
    -> final LayerNorm
    -> reconstruction head (per position, self-pretraining)  and/or  pooling (mean, max, [CLS]) + classification head

Attention keeps W_Q, W_K, W_V, W_O as four Linear layers, so that Coser et al.'s Table 3 can inherit or freeze them
one by one; its fast path is torch's scaled_dot_product_attention, its explicit path returns the probabilities for
analysis. LayerNorm and the MLP can be switched off: the paper's minimal model. A library: it imports no stage.
"""
import math
import re
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    """Every model setting (the only place they live). Saved as a plain dict in each checkpoint."""
    vocab_size: int = 0        # > 0: discrete tokens through nn.Embedding; 0: continuous inputs
    d_input: int = 1           # channels of a continuous input (ignored for tokens)
    max_len: int = 2048        # longest sequence the positional encoding covers
    d_model: int = 128         # width of the residual stream
    n_layers: int = 2          # Transformer blocks
    n_heads: int = 4           # attention heads (d_model must be divisible by it)
    d_mlp: int = 256           # hidden width of the MLP
    layernorm: bool = True     # pre-LN in every block and a final LN; False for the minimal model
    mlp: bool = True           # False drops the MLP sub-block (minimal model)
    pos: str = "sinusoidal"    # positions (POSITIONS): "sinusoidal" or "learned" (absolute, added to the input),
                               # "alibi", "rope", "fire" (relative, inside attention), "none" (order-blind)
    pooling: str = "mean"      # POOLINGS: "mean", "max" over real positions, "cls": a learned summary token's state
    pair: bool = False         # dual encoder (LRA Retrieval): classify a pair of documents from [u, v, u*v, u-v]
    cls_mlp: bool = False      # Linear(d, d) + ReLU before the class layer (Amos et al.'s `sequence_nonelinear`)
    attn_window: int = 0       # > 0: local attention, blocks of this many positions see their neighbour blocks
    n_classes: int = 0         # > 0 adds the classification head (finetuning)
    n_rec: int = 0             # > 0 adds the per-position reconstruction head with this many outputs (SPT)
    init: str = "reference"    # INIT_SCHEMES (init_weights): "reference" (Amos et al.'s code), "torch", "normal"
    init_std: float = 0.02     # std of every Linear and Embedding weight under "normal"; of pos "learned" always
    init_scale: float = 1.0    # multiplies every initialized Linear/Embedding tensor (ablate.py initscale)

    def __post_init__(self):
        """ValueError for a setting no model has, naming the choices: a string of POSITIONS, POOLINGS or
        INIT_SCHEMES (a typo would otherwise run another model), local attention with a score bias or [CLS] pooling,
        or d_model not divisible by n_heads."""
        for field, choices in (("pos", POSITIONS), ("pooling", POOLINGS), ("init", INIT_SCHEMES)):
            if getattr(self, field) not in choices:
                raise ValueError(f"model {field} {getattr(self, field)!r}: expected one of {', '.join(choices)}")
        if self.attn_window and (self.pos in SCORE_BIASES or self.pooling == "cls"):  # neither fits the blocks
            raise ValueError(f"local attention (attn_window > 0) with pos {self.pos!r}, pooling {self.pooling!r}: "
                             f"it takes no score bias ({', '.join(SCORE_BIASES)}) and no [CLS] token")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")


def sinusoidal_positions(n_pos, d_model, base=10000.0):
    """Fixed sinusoidal encodings P (n_pos, d_model): P[t, 2i] = sin(t / base^(2i/d)), P[t, 2i+1] = cos(...)
    (Vaswani et al. 2017, Sec. 3.5): what SPT turns into a proximity bias through W_Q^T W_K (Coser et al., Sec. 4)."""
    t = torch.arange(n_pos, dtype=torch.float32)[:, None]                         # (n_pos, 1)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)  # (ceil(d/2),)
    P = torch.zeros(n_pos, d_model)
    P[:, 0::2] = torch.sin(t * inv_freq)
    P[:, 1::2] = torch.cos(t * inv_freq[: d_model // 2])
    return P


# Every scheme of ModelConfig.pos. A new one: add it here, build it in Transformer.absolute_positions (added to the
# input) or in Attention (relative: a score bias in _position_bias, listed in SCORE_BIASES); its parameters go in
# PARAM_GROUPS["posenc"] and init_weights, its buffers non-persistent and constant (pretrain.wrap).
POSITIONS = ("sinusoidal", "learned", "alibi", "rope", "fire", "none")
SCORE_BIASES = ("alibi", "fire")  # the schemes that add a bias (H, L, L) to the attention scores
# Every ModelConfig.pooling (Transformer.pool); weights of its own go in PARAM_GROUPS and init_weights, as cls's.
POOLINGS = ("mean", "max", "cls")


def alibi_slopes(n_heads):
    """ALiBi head slopes m_h (Press et al. 2022, Sec. 3 and their reference code): for n a power of two,
    m_h = 2^(-8h/n), h = 1..n; otherwise the n' = largest power of two below n gives the first n' slopes and
    the odd-indexed slopes of 2n' fill the rest. Returns (n_heads,) float32."""
    power_of_two = lambda n: [2 ** (-8 * h / n) for h in range(1, n + 1)]
    n = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: n_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def rope(x, base=10000.0):
    """Rotary position embedding (Su et al. 2021, RoFormer, Eq. 34): rotate each pair of channels
    (x_2i, x_2i+1) of x (B, H, L, d_head) by the angle t / base^(2i/d_head) at position t."""
    L, d = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)   # (d/2,)
    angle = torch.arange(L, device=x.device, dtype=torch.float32)[:, None] * inv_freq      # (L, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class FIRE(nn.Module):
    """FIRE, functional interpolation for relative positions (Li et al. 2023, Eq. 5): a learned bias
    b_h(i, j) = MLP(psi(|i - j|) / psi(max(threshold, i + 1)))_h with psi(x) = log(c x + 1), c and threshold
    learned. The paper's causal i - j becomes |i - j|: our encoder is bidirectional."""

    def __init__(self, n_heads, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_heads))  # f_theta
        self.log_c = nn.Parameter(torch.zeros(()))                 # c = exp(log_c) > 0
        self.log_threshold = nn.Parameter(torch.tensor(math.log(32.0)))

    def forward(self, L, device):
        """Bias (H, L, L) added to the attention scores."""
        pos = torch.arange(L, device=device, dtype=self.log_c.dtype)  # float64 when the model is .double()
        c = self.log_c.exp()
        psi = lambda t: torch.log(c * t + 1)
        rel = psi((pos[:, None] - pos[None, :]).abs())                                     # (L, L)
        norm = psi(torch.maximum(self.log_threshold.exp(), pos + 1))[:, None]             # (L, 1)
        return self.net((rel / norm)[..., None]).permute(2, 0, 1)                          # (H, L, L)


class Attention(nn.Module):
    """Multi-head self-attention with separate W_Q, W_K, W_V, W_O (bias included, as in Amos et al.).

    forward(x (B, L, d_model), valid (B, L) bool or None, need_weights) -> (y (B, L, d_model), probs or None).
    valid is True at real tokens (None: no padding); padded keys get no attention. need_weights: the explicit path,
    probs (B, H, L, L). SCORE_BIASES add a bias (H, L, L) to the scores, "rope" rotates Q and K."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.pos, self.window = cfg.pos, cfg.attn_window
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))
        if cfg.pos == "alibi":
            self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)
        self.fire = FIRE(cfg.n_heads) if cfg.pos == "fire" else None

    def forward(self, x, valid=None, need_weights=False):
        B, L, _ = x.shape
        q, k, v = (proj(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, L, d_head)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.pos == "rope":
            q, k = rope(q), rope(k)
        if need_weights:
            y, probs = self.explicit_attention(q, k, v, self._mask(valid, q))
        elif self.window and L > self.window:
            y, probs = self.local_attention(q, k, v, valid), None
        else:
            y, probs = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(valid, q)), None
        y = y.transpose(1, 2).reshape(B, L, -1)  # (B, H, L, d_head) -> (B, L, d_model)
        return self.o_proj(y), probs

    def _position_bias(self, L, device):
        """The score bias (H, L, L) of the schemes in SCORE_BIASES."""
        if self.pos == "alibi":  # -m_h |i - j|: the symmetric (bidirectional) form of ALiBi's linear penalty
            dist = (torch.arange(L, device=device)[:, None] - torch.arange(L, device=device)[None, :]).abs()
            return -self.slopes[:, None, None] * dist
        return self.fire(L, device)

    def _mask(self, valid, q):
        """The mask of the scores of q (B, H, L, d_head), or None: boolean (True = may attend) of the padded keys
        (B, 1, 1, L), with a window shorter than L also local_attention's band of blocks (B or 1, 1, L, L); with a
        score bias a float mask (B or 1, H, L, L) of q's dtype: the bias, -inf where the boolean one forbids."""
        L, device = q.shape[-2], q.device
        mask = None if valid is None else valid[:, None, None, :]                # (B, 1, 1, L) keys
        if self.window and L > self.window:
            block = torch.arange(L, device=device) // self.window
            band = (block[:, None] - block[None, :]).abs() <= 1                  # (L, L)
            # A padded query may see every key of its window, so that no row is empty (its output is ignored).
            mask = band if mask is None else (mask | ~valid[:, None, :, None]) & band
        if self.pos not in SCORE_BIASES:
            return mask
        bias = self._position_bias(L, device)[None].to(q.dtype)
        return bias if mask is None else bias.masked_fill(~mask, float("-inf"))

    def local_attention(self, q, k, v, valid):
        """Block-local attention, as Amos et al. used for PathX: blocks of `window` positions, each attending to
        itself and its two neighbours. q, k, v (B, H, L, d_head), valid (B, L) bool or None -> y (B, H, L, d_head).
        The blocks are folded into the batch, so memory grows linearly in L."""
        B, H, L, d = q.shape
        w, pad = self.window, -L % self.window
        n = (L + pad) // w
        key_ok = F.pad(torch.ones(B, L, dtype=torch.bool, device=q.device) if valid is None else valid, (0, pad))
        q, k, v = (F.pad(t, (0, 0, 0, pad)).view(B, H, n, w, d) for t in (q, k, v))

        def with_neighbours(t):  # (B, H, n, w, c) -> (B, H, n, 3w, c): blocks b-1, b, b+1 (zeros outside)
            before = F.pad(t, (0, 0, 0, 0, 1, 0))[:, :, :-1]
            after = F.pad(t, (0, 0, 0, 0, 0, 1))[:, :, 1:]
            return torch.cat([before, t, after], dim=3)

        k, v = with_neighbours(k), with_neighbours(v)
        keys = with_neighbours(key_ok.view(B, 1, n, w, 1)).transpose(-1, -2)         # (B, 1, n, 1, 3w)
        # Padded queries see their whole window, so that no row is empty (their output is ignored).
        mask = keys if valid is None else keys | ~key_ok.view(B, 1, n, w, 1)        # (B, 1, n, 1 or w, 3w)
        fold = lambda t: t.transpose(1, 2).flatten(0, 1)  # (B, H, n, ...) -> (B n, H, ...): 4-D for fused kernels
        y = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), attn_mask=fold(mask))  # (B n, H, w, d)
        return y.view(B, n, H, w, d).transpose(1, 2).reshape(B, H, n * w, d)[:, :, :L]

    def explicit_attention(self, q, k, v, mask):
        """softmax(Q K^T / sqrt(d_head) + mask) V written out. q, k, v: (B, H, L, d_head); mask: bool (True =
        may attend) or float (added to the scores), broadcastable to (B, H, L, L), or None.
        Returns (y (B, H, L, d_head), probs (B, H, L, L)). Used only when attention weights are asked for."""
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)                  # (B, H, L, L)
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))  # every row keeps >= 1 key, so no NaN
        elif mask is not None:
            scores = scores + mask
        probs = scores.softmax(dim=-1)
        return probs @ v, probs


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + Attn(LN(x)), then x + MLP(LN(x)). LN and MLP can be switched off."""

    def __init__(self, cfg):
        super().__init__()
        norm = (lambda: nn.LayerNorm(cfg.d_model)) if cfg.layernorm else nn.Identity
        self.ln1, self.attn = norm(), Attention(cfg)
        self.ln2 = norm() if cfg.mlp else None
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_mlp), nn.GELU(),
                                 nn.Linear(cfg.d_mlp, cfg.d_model)) if cfg.mlp else None

    def forward(self, x, valid=None, need_weights=False):
        a, probs = self.attn(self.ln1(x), valid, need_weights)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(self.ln2(x))
        return x, probs


def real_positions(lengths, L, device):
    """(B, L) bool on `device`, True at the real positions t < lengths[b] of each sequence (False: padding).
    lengths (B,) int64 on any device; from pinned CPU memory the copy does not wait for queued GPU work."""
    lengths = lengths.to(device, non_blocking=lengths.is_pinned())
    return torch.arange(L, device=device) < lengths[:, None]


class Transformer(nn.Module):
    """The encoder of the study plus its two heads (the module docstring's layout). Inputs: tokens (B, L) int64, or
    values (B, L, d_input) float; lengths (B,) int64 real length of each sequence (None = no padding), on any
    device: on the CPU (as data.get_batch returns them) the has-padding check needs no GPU synchronisation."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.vocab_size > 0 else \
            nn.Linear(cfg.d_input, cfg.d_model)
        # [CLS] pooling: a learned summary token at position 0 (Devlin et al. 2019), never masked nor reconstructed
        self.prefix = int(cfg.pooling == "cls")                         # positions before the sequence
        self.summary_token = nn.Parameter(torch.zeros(cfg.d_model)) if self.prefix else None
        n_pos = cfg.max_len + self.prefix
        pe = sinusoidal_positions(n_pos, cfg.d_model) if cfg.pos == "sinusoidal" else torch.zeros(0)
        self.register_buffer("pe", pe, persistent=False)            # a function of the config, not a weight
        self.pos_embed = nn.Embedding(n_pos, cfg.d_model) if cfg.pos == "learned" else None  # a weight
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.layernorm else nn.Identity()
        self.rec_head = nn.Linear(cfg.d_model, cfg.n_rec) if cfg.n_rec > 0 else None
        self.cls_head = None
        if cfg.n_classes > 0 and (cfg.pair or cfg.cls_mlp):  # pair: LRA's dual-encoder head on [u, v, u*v, u-v]
            d_in, act = (4 * cfg.d_model, nn.GELU()) if cfg.pair else (cfg.d_model, nn.ReLU())
            self.cls_head = nn.Sequential(nn.Linear(d_in, cfg.d_model), act, nn.Linear(cfg.d_model, cfg.n_classes))
        elif cfg.n_classes > 0:
            self.cls_head = nn.Linear(cfg.d_model, cfg.n_classes)
        init_weights(self, cfg)

    def forward(self, x, lengths=None, reconstruct=False):
        """Class logits (classify), or with `reconstruct` the reconstruction outputs at every position (reconstruct).
        The training steps of both stages go through here (DistributedDataParallel hooks forward)."""
        return self.reconstruct(x, lengths) if reconstruct else self.classify(x, lengths)

    def encode(self, x, lengths=None, need_weights=False):
        """Hidden states Z (B, prefix + L, d_model) and, with need_weights, the list of attention probs per layer
        (B, H, prefix + L, prefix + L). prefix is 1 under [CLS] pooling (the summary token at position 0), else 0."""
        B, L = x.shape[:2]
        if L > self.cfg.max_len:
            raise ValueError(f"sequence length {L} exceeds the model's max_len {self.cfg.max_len}")
        # One check per forward: without padding no mask. Free with lengths on the CPU (as data.get_batch gives them).
        valid = None
        if lengths is not None and not bool((lengths >= L).all()):
            valid = F.pad(real_positions(lengths, L, x.device), (self.prefix, 0), value=True)  # the token is real
        h = self.embed(x)                                                 # (B, L, d_model)
        if self.prefix:                                                   # the summary token first: (B, 1 + L, d)
            h = torch.cat([self.summary_token.to(h.dtype).expand(B, 1, -1), h], dim=1)
        P = self.absolute_positions(self.prefix + L)
        h = h if P is None else h + P
        all_probs = []
        for block in self.blocks:
            h, probs = block(h, valid, need_weights)
            all_probs.append(probs)
        return self.ln_f(h), (all_probs if need_weights else None)

    def absolute_positions(self, L):
        """The absolute positions P (L, d_model) added to the input, or None (relative positions, or "none").
        "sinusoidal": the fixed sinusoidal_positions; "learned": the first L rows of a trained table (BERT, GPT-2)."""
        if self.cfg.pos == "sinusoidal":
            return self.pe[:L]
        return self.pos_embed.weight[:L] if self.pos_embed is not None else None

    def pool(self, z, lengths=None):
        """Pooling by cfg.pooling: "mean" or "max" over non-padding positions, or "cls": the summary token's state at
        position 0 (z from encode: (B, 1 + L, d)). (B, L, d) -> (B, d); z unchanged."""
        if self.cfg.pooling == "cls":
            return z[:, 0]
        if lengths is None:
            return z.mean(dim=1) if self.cfg.pooling == "mean" else z.max(dim=1).values
        valid = real_positions(lengths, z.shape[1], z.device)[..., None]          # (B, L, 1)
        if self.cfg.pooling == "mean":
            return (z * valid).sum(dim=1) / valid.sum(dim=1).to(z.dtype)
        return z.masked_fill(~valid, float("-inf")).max(dim=1).values

    def classify(self, x, lengths=None):
        """Class logits (B, n_classes) float32: encode, pool, head (class_head).

        With cfg.pair (LRA Retrieval), x is (B, 2, L) and lengths (B, 2): both documents go through the same
        encoder, their pooled vectors u, v (B, d) are combined as [u, v, u*v, u-v] (Tay et al. 2021, Sec. 3.4).
        """
        if self.cfg.pair:
            flat_lengths = None if lengths is None else lengths.flatten()
            z, _ = self.encode(x.flatten(0, 1), flat_lengths)
            u, v = self.pool(z, flat_lengths).view(len(x), 2, -1).unbind(dim=1)
            return self.class_head(torch.cat([u, v, u * v, u - v], dim=-1))
        z, _ = self.encode(x, lengths)
        return self.class_head(self.pool(z, lengths))

    def class_head(self, h):
        """cls_head in float32 (in_fp32): h (B, d_in) -> logits (B, n_classes). In bf16, close logits tie and
        argmax gives ties to class 0, so near chance the accuracy would read as class 0's frequency."""
        return in_fp32(self.cls_head, h)

    def reconstruct(self, x, lengths=None):
        """Reconstruction outputs (B, L, n_rec) float32 (as class_head) at every position of the sequence, not the
        summary token: not only the masked ones, whose count a GPU would have to be waited for."""
        z = self.encode(x, lengths)[0][:, self.prefix:]
        return in_fp32(self.rec_head, z)


def in_fp32(head, h):
    """head(h) in float32 with autocast switched off on h's device: h (..., d_in) -> (..., d_out) float32 (the
    head's weights are float32). A device without autocast (e.g. "meta") has nothing to switch off."""
    kind = h.device.type
    with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else nullcontext():
        return head(h.to(next(head.parameters()).dtype))


# Parameter groups of Coser et al. Table 3 by attribute name (finetune.py --inherit, --freeze; analyze.py).
PARAM_GROUPS = {
    "W_Q": lambda n: ".attn.q_proj." in n,
    "W_K": lambda n: ".attn.k_proj." in n,
    "W_V": lambda n: ".attn.v_proj." in n,
    "W_O": lambda n: ".attn.o_proj." in n,
    "mlp": lambda n: ".mlp." in n,
    "embed": lambda n: n.startswith("embed."),                       # the input encoder
    "norm": lambda n: ".ln1." in n or ".ln2." in n or n.startswith("ln_f."),
    "head": lambda n: n.startswith(("cls_head.", "rec_head.")),
    "posenc": lambda n: ".attn.fire." in n or n.startswith("pos_embed."),  # learned positions: FIRE, the table
    "summary": lambda n: n == "summary_token",                        # [CLS] pooling's token (not the class head)
}


def param_group(name):
    """The PARAM_GROUPS key of a Transformer parameter name; ValueError unless it is in exactly one group."""
    groups = [g for g, member in PARAM_GROUPS.items() if member(name)]
    if len(groups) != 1:
        raise ValueError(f"parameter {name!r} is in groups {groups}, expected exactly one")
    return groups[0]


INIT_SCHEMES = ("reference", "torch", "normal")


def init_weights(model, cfg):
    """Initialize `model` in place by the scheme cfg.init (applied by Transformer.__init__), tensor by tensor:

    | tensor                               | "reference" (default)      | "torch"          | "normal"         |
    | Linear weight (W_Q, W_K, W_V, W_O,   | U(-1/sqrt(d_in),           | as "reference"   | N(0, init_std^2) |
    |   MLP, continuous input encoder,     |   1/sqrt(d_in)): std       |                  |                  |
    |   heads, FIRE's MLP)                 |   1/sqrt(3 d_in)           |                  |                  |
    | Linear bias                          | U(-1/sqrt(d_in), ...)      | as "reference"   | 0                |
    | Embedding (token input encoder)      | N(0, 1)                    | N(0, 1)          | N(0, init_std^2) |
    | pos_embed, summary token             | N(0, init_std^2)           | N(0, init_std^2) | N(0, init_std^2) |
    | W_Q, W_K, W_V, W_O of one layer      | equal (one draw, copied)   | independent      | independent      |
    LayerNorm keeps weight 1, bias 0. Then every Linear weight and bias and every Embedding weight is multiplied by
    cfg.init_scale (1 = as above).

    "reference": Amos et al.'s code behind the paper's LRA numbers (MultiheadAttentionFlash deep-copies ONE layer),
    so W_Q = W_K makes the scores at init a Gram matrix, leaning towards nearby positions. "normal": GPT-2's
    N(0, 0.02), attention almost exactly uniform (Prop. 1's premise).
    """
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            if cfg.init == "normal" or m is model.pos_embed:  # the table: BERT's and GPT-2's N(0, 0.02)
                nn.init.normal_(m.weight, 0.0, cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            else:
                m.reset_parameters()  # PyTorch's own default (kaiming-uniform a = sqrt 5; Embedding N(0, 1))
            with torch.no_grad():  # init_scale 1: x * 1.0 is x exactly
                for p in m.parameters(recurse=False):
                    p.mul_(cfg.init_scale)
    if model.summary_token is not None:  # BERT's [CLS] is a row of its embedding table, N(0, 0.02)
        with torch.no_grad():
            model.summary_token.normal_(0.0, cfg.init_std).mul_(cfg.init_scale)
    if cfg.init == "reference":  # clones(): the four projections start as copies of one layer
        for attn in (block.attn for block in model.blocks):
            for proj in (attn.k_proj, attn.v_proj, attn.o_proj):
                proj.load_state_dict(attn.q_proj.state_dict())


# Checkpoints: plain dicts of tensors and Python types, loadable with torch.load(weights_only=True).

WRAPPERS = re.compile(r"^(_orig_mod\.|module\.)+")  # torch.compile, DDP: in any order and number


def unwrapped_state_dict(state_dict):
    """A state dict with torch.compile / DDP prefixes removed, so it loads into a plain Transformer."""
    return {WRAPPERS.sub("", key): value for key, value in state_dict.items()}


def config_from_dict(d, where="checkpoint"):
    """ModelConfig from a plain dict; raises ValueError naming `where` and the unknown fields."""
    unknown = set(d) - {f.name for f in fields(ModelConfig)}
    if unknown:
        raise ValueError(f"{where}: unknown model_config fields {sorted(unknown)}")
    return ModelConfig(**d)


def checkpoint_dict(model, **extra):
    """The checkpoint schema: model (state dict), model_config (dict) and whatever plain fields `extra` holds."""
    return dict(model=unwrapped_state_dict(model.state_dict()), model_config=asdict(model.cfg), **extra)

