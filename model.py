"""model.py -- the one compact Transformer every stage shares.

    input encoder (token embedding or linear layer)  +  sinusoidal absolute positions  (Vaswani et al. 2017, 3.5)
    -> n_layers x pre-LayerNorm block:  x + Attention(LN(x)),  x + MLP(LN(x))          (Amos et al. 2024 configs)
    -> final LayerNorm
    -> reconstruction head (per position, self-pretraining)  and/or  mean pooling + classification head

The attention module keeps W_Q, W_K, W_V, W_O as four separate Linear layers (`q_proj`, `k_proj`, `v_proj`,
`o_proj`) so that the ablations of Coser et al. (Table 3) can inherit or freeze them one by one. It has two
paths that compute the same thing:
  * fast: torch.nn.functional.scaled_dot_product_attention (fused kernels, no L x L tensor in our code);
  * explicit: softmax(Q K^T / sqrt(d_head)) written out, returning the attention probabilities for analysis.
LayerNorm and the MLP can be switched off, which gives the paper's minimal one-layer, one-head model (Sec. 4).

Checkpoint helpers (`checkpoint_dict`, `model_from_checkpoint`) live here too, since a checkpoint is a model.
"""
import math
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
    dropout: float = 0.0       # on attention probabilities and residual branches (the paper uses 0.0)
    layernorm: bool = True     # pre-LN in every block and a final LN; False for the minimal model
    mlp: bool = True           # False drops the MLP sub-block (minimal model)
    causal: bool = False       # causal attention mask (SPT is bidirectional masked reconstruction)
    pos: str = "sinusoidal"    # absolute sinusoidal positions added to the input, or "none"
    pooling: str = "mean"      # "mean" or "max" over non-padding positions
    n_classes: int = 0         # > 0 adds the classification head (finetuning)
    n_rec: int = 0             # > 0 adds the per-position reconstruction head with this many outputs (SPT)
    init_std: float = 0.02     # std of the normal init of every Linear and Embedding weight (see init_weights)


def sinusoidal_positions(n_pos, d_model, base=10000.0):
    """Fixed sinusoidal encodings P (n_pos, d_model): P[t, 2i] = sin(t / base^(2i/d)), P[t, 2i+1] = cos(...).

    Source: Vaswani et al. 2017, Sec. 3.5. These are the absolute positions that SPT turns into a proximity
    bias through W_Q^T W_K (Coser et al., Sec. 4).
    """
    t = torch.arange(n_pos, dtype=torch.float32)[:, None]                         # (n_pos, 1)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)  # (ceil(d/2),)
    P = torch.zeros(n_pos, d_model)
    P[:, 0::2] = torch.sin(t * inv_freq)
    P[:, 1::2] = torch.cos(t * inv_freq[: d_model // 2])
    return P


class Attention(nn.Module):
    """Multi-head self-attention with separate W_Q, W_K, W_V, W_O (bias included, as in Amos et al.).

    forward(x (B, L, d_model), valid (B, L) bool or None, need_weights) -> (y (B, L, d_model), probs or None)
    `valid[b, t]` is True at real tokens; padded keys get no attention. Padded queries still produce an output
    (it is ignored downstream). With need_weights the explicit path runs and returns probs (B, H, L, L).
    """

    def __init__(self, cfg):
        super().__init__()
        assert cfg.d_model % cfg.n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads, self.d_head, self.causal = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.causal
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)  # W_Q
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)  # W_K
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)  # W_V
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)  # W_O

    def forward(self, x, valid=None, need_weights=False):
        B, L, _ = x.shape
        # (B, L, d_model) -> (B, H, L, d_head) for each of Q, K, V
        q, k, v = (proj(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = self._mask(valid, L, x.device)  # (B, 1, 1 or L, L) bool, True = may attend; None = attend all
        if need_weights:
            if mask is None and self.causal:
                mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            y, probs = self.explicit_attention(q, k, v, mask)
        else:
            y, probs = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                is_causal=self.causal and mask is None), None
        y = y.transpose(1, 2).reshape(B, L, -1)  # (B, H, L, d_head) -> (B, L, d_model)
        return self.o_proj(y), probs

    def _mask(self, valid, L, device):
        """Boolean mask of padded keys (and future keys if causal), or None when there is no padding, so that
        SDPA can pick a fused kernel (causality then goes through is_causal)."""
        mask = None
        if valid is not None and not bool(valid.all()):
            mask = valid[:, None, None, :]                                       # (B, 1, 1, L) keys
        if self.causal and (mask is not None):
            mask = mask & torch.ones(L, L, dtype=torch.bool, device=device).tril()  # (B, 1, L, L)
        return mask

    def explicit_attention(self, q, k, v, mask):
        """softmax(Q K^T / sqrt(d_head) + mask) V written out. q, k, v: (B, H, L, d_head).

        Returns (y (B, H, L, d_head), probs (B, H, L, L)). Used only when attention weights are asked for.
        """
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)                  # (B, H, L, L)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))  # every row keeps >= 1 key, so no NaN
        probs = scores.softmax(dim=-1)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, self.dropout)
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
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, valid=None, need_weights=False):
        a, probs = self.attn(self.ln1(x), valid, need_weights)
        x = x + self.drop(a)
        if self.mlp is not None:
            x = x + self.drop(self.mlp(self.ln2(x)))
        return x, probs


class Transformer(nn.Module):
    """The encoder of the study plus its two heads. See the module docstring for the layout.

    Inputs: tokens (B, L) int64 for discrete tasks, or values (B, L, d_input) float for continuous ones;
    lengths (B,) int64 real length of each sequence (None = no padding).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        if cfg.vocab_size > 0:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)   # input encoder for tokens
        else:
            self.embed = nn.Linear(cfg.d_input, cfg.d_model)         # input encoder for continuous values
        pe = sinusoidal_positions(cfg.max_len, cfg.d_model) if cfg.pos == "sinusoidal" else torch.zeros(0)
        self.register_buffer("pe", pe, persistent=False)            # a function of the config, not a weight
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model) if cfg.layernorm else nn.Identity()
        self.rec_head = nn.Linear(cfg.d_model, cfg.n_rec) if cfg.n_rec > 0 else None
        self.cls_head = nn.Linear(cfg.d_model, cfg.n_classes) if cfg.n_classes > 0 else None
        init_weights(self, cfg.init_std)

    def encode(self, x, lengths=None, need_weights=False):
        """Hidden states Z (B, L, d_model) and, with need_weights, the list of attention probs per layer."""
        L = x.shape[1]
        if L > self.cfg.max_len:
            raise ValueError(f"sequence length {L} exceeds the model's max_len {self.cfg.max_len}")
        valid = None if lengths is None else torch.arange(L, device=x.device)[None, :] < lengths[:, None]
        h = self.embed(x)                                                 # (B, L, d_model)
        if self.cfg.pos == "sinusoidal":
            h = h + self.pe[:L]
        all_probs = []
        for block in self.blocks:
            h, probs = block(h, valid, need_weights)
            all_probs.append(probs)
        return self.ln_f(h), (all_probs if need_weights else None)

    def pool(self, z, lengths=None):
        """Mean (or max) pooling over non-padding positions: (B, L, d) -> (B, d)."""
        if lengths is None:
            return z.mean(dim=1) if self.cfg.pooling == "mean" else z.max(dim=1).values
        valid = (torch.arange(z.shape[1], device=z.device)[None, :] < lengths[:, None])[..., None]  # (B, L, 1)
        if self.cfg.pooling == "mean":
            return (z * valid).sum(dim=1) / lengths[:, None].to(z.dtype)
        return z.masked_fill(~valid, float("-inf")).max(dim=1).values

    def classify(self, x, lengths=None):
        """Class logits (B, n_classes): encode, pool, linear head."""
        z, _ = self.encode(x, lengths)
        return self.cls_head(self.pool(z, lengths))

    def reconstruct(self, x, lengths, positions):
        """Reconstruction outputs (M, n_rec) at the M positions where `positions` (B, L) bool is True.

        Only the masked positions go through the head, which saves a (B, L, vocab) tensor.
        """
        z, _ = self.encode(x, lengths)
        return self.rec_head(z[positions])


def init_weights(model, std=0.02):
    """The single initialization of the project (applied by Transformer.__init__):

    | tensor                                   | init            |
    | Linear weights (W_Q, W_K, W_V, W_O, MLP, | N(0, std^2)     |
    |   input encoder, heads)                  |                 |
    | Linear biases                            | 0               |
    | Embedding weights                        | N(0, std^2)     |
    | LayerNorm weight / bias                  | 1 / 0           |
    std = 0.02 as in GPT-2 and in the measured synthetic-task design (shared/notes/synthetic_task.md).
    At this scale Q K^T / sqrt(d_head) is near 0 at init, i.e. attention is near uniform (Coser et al., Sec. 4).
    """
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def count_params(model):
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: plain dicts of tensors and Python types, loadable with torch.load(weights_only=True)
# ----------------------------------------------------------------------------------------------------------

WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DistributedDataParallel add these


def unwrapped_state_dict(state_dict):
    """A state dict with torch.compile / DDP prefixes removed, so it loads into a plain Transformer."""
    out = {}
    for key, value in state_dict.items():
        for prefix in WRAPPER_PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


def config_from_dict(d, where="checkpoint"):
    """ModelConfig from a plain dict; raises ValueError naming unknown fields."""
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{where}: unknown model_config fields {sorted(unknown)}")
    return ModelConfig(**d)


def checkpoint_dict(model, **extra):
    """The checkpoint schema: model (state dict), model_config (dict) and whatever plain fields `extra` holds."""
    return dict(model=unwrapped_state_dict(model.state_dict()), model_config=asdict(model.cfg), **extra)
