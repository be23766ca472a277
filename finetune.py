"""finetune.py -- supervised finetuning from the SPT checkpoint, or from scratch for the comparison.

The story (Amos et al.; Coser et al. Table 2). The model is rebuilt from the checkpoint's own model_config. The
backbone (input encoder, blocks, final LayerNorm) is loaded strictly; the reconstruction head is dropped and a
fresh classification head sits on mean pooling (a dual-encoder head for Retrieval). The loss is the labels'
cross-entropy. Validation accuracy picks the weights tested. --inherit and --freeze select parameter groups
(Coser et al. Table 3). A checkpoint of another task with the same kind of input is a dataset swap (Sec. 3).

    python finetune.py --task listops --init out/listops/pretrain.pt     # SPT, then finetune
    python finetune.py --task listops --init scratch                     # the from-scratch baseline
    python finetune.py --task synthetic --init out/synthetic/pretrain.pt --inherit qk    # only W_Q, W_K from SPT
    python finetune.py --task image --init out/pathfinder/pretrain.pt    # dataset swap (both 1024 pixels)

Reads data/<task>/{train,val,test}.pt and the --init checkpoint. Writes out/<task>/finetune_<name>.* (run_paths;
the .json: accuracy per evaluation, best validation, test and train accuracy). <name> is "spt" or "scratch", with
"_inherit-<groups>" / "_freeze-<groups>" when those are set. To see SPT's effect on a CPU: ablate.py demo.

Reading order: INHERIT and FREEZE (Table 3's groups), hybrid_state_dict, model_from_pretrained, then main, whose
loss_fn is the labels' cross-entropy through mean pooling; the loop is pretrain.train.
"""
import time

import torch
import torch.nn.functional as F

import data
import pretrain
from data import data_hashes
from model import ModelConfig, Transformer, config_from_dict, param_group, unwrapped_state_dict
from pretrain import (MODEL_FLAGS, autocast, build_parser, evaluate, local_rows, own_run, prepare_data, resolve,
                      train, wrap)


# The groups are model.PARAM_GROUPS (W_Q, W_K, W_V, W_O, mlp, embed, norm, head, posenc, summary), by parameter name.
# SPT hands on the summary token of [CLS] pooling with the backbone (--inherit all): SPT trains it as a key every
# position may attend to (it is never reconstructed), so it arrives as a position the attention already knows.
_BACKBONE = ("W_Q", "W_K", "W_V", "W_O", "mlp", "embed", "norm", "posenc", "summary")
# finetune.py --inherit: which groups come from the SPT checkpoint (Coser et al. Table 3); the rest is fresh.
INHERIT = {"all": _BACKBONE, "qk": ("W_Q", "W_K"), "attn": ("W_Q", "W_K", "W_V", "W_O"),
           "qk+embed+norm": ("W_Q", "W_K", "embed", "norm"),
           "all-but-qk": tuple(g for g in _BACKBONE if g not in ("W_Q", "W_K"))}
# finetune.py --freeze: groups kept at their initial values during finetuning (Coser et al. Sec. 3, Table 3).
# The paper's "attention frozen (MLP + head trained)" read two ways: attention only, or all but the MLP and head.
# Freezing "attn" also freezes learned positions (posenc: FIRE's bias, the learned table), which shape the scores;
# inheriting "attn" is Table 3's row, the four matrices W_Q, W_K, W_V, W_O (sinusoidal positions have no weights).
FREEZE = {"none": (), "attn": ("W_Q", "W_K", "W_V", "W_O", "posenc"),
          "attn+embed+norm": ("W_Q", "W_K", "W_V", "W_O", "posenc", "embed", "norm"),
          "attn+mlp": ("W_Q", "W_K", "W_V", "W_O", "posenc", "mlp")}


# ModelConfig fields without weights that finetuning takes from its own task's preset, not from the SPT
# checkpoint: they differ in a dataset swap (PathFinder -> PathX: max pooling, local attention).
FINETUNE_FIELDS = ("cls_mlp", "pooling", "attn_window")


def hybrid_state_dict(fresh, pretrained, groups):
    """Hybrid initialization (Coser et al. Table 3): the state dict that takes every tensor whose parameter
    group (param_group) is in `groups` from `pretrained` and every other tensor from `fresh`.

    fresh, pretrained: state dicts (name -> tensor); a name missing from `pretrained` (a new head) stays fresh.
    Returns a new dict with the keys of `fresh`; neither input is modified.
    """
    return {name: pretrained[name] if name in pretrained and param_group(name) in groups else tensor
            for name, tensor in fresh.items()}


def check_spt_data(ck, task, hashes):
    """"same" when the SPT checkpoint `ck` was pretrained on the training split finetuning uses (by its tensors'
    sha256, `hashes`: data.data_hashes), "swap" for another task (Coser et al. Sec. 3); else ValueError."""
    spt, ours = ck["data_sha256"]["train"], hashes["train"]
    if ck["task"] != task:
        print(f"dataset swap: SPT on {ck['task']}, finetuning on {task}")
        return "swap"
    if spt != ours:
        raise ValueError(f"--init: SPT trained on {task} data of sha256 {spt[:12]}..., this run's is {ours[:12]}...: "
                         f"finetune on the data SPT used")
    return "same"


def model_from_pretrained(ck, meta, n_classes, task, inherit="all", head=None):
    """A classification model (on the CPU) whose INHERIT[`inherit`] groups come from the SPT checkpoint `ck` (a
    loaded pretrain.py dict), the others fresh (Coser et al. Table 3). `ck` is of `task` or of a task with the same
    kind of input (a dataset swap), else ValueError. `head` ({field: value} of FINETUNE_FIELDS; None: the
    checkpoint's) sets what holds no weights; whether the model reads pairs (Retrieval) comes from `meta`."""
    if ck.get("stage") != "pretrain":
        raise ValueError(f"--init: not a checkpoint written by pretrain.py (stage {ck.get('stage')!r})")
    kind = lambda m: (m["kind"], m.get("vocab_size"), m.get("d_input"), m.get("vocab"))  # noqa: E731
    if kind(ck["data_meta"]) != kind(meta):  # a swap needs one kind of input
        raise ValueError(f"--init: SPT's inputs {kind(ck['data_meta'])[:3]} ({ck['task']}) are not {task}'s "
                         f"{kind(meta)[:3]}: a dataset swap needs the same kind of input")
    max_len = max(ck["model_config"]["max_len"], meta["max_len"])
    cfg = config_from_dict(dict(ck["model_config"], n_rec=0, n_classes=n_classes, **(head or {}),
                                pair=bool(meta.get("pair")), max_len=max_len))
    state = unwrapped_state_dict(ck["model"])
    if cfg.vocab_size == 0:  # SPT on continuous inputs added a mask-indicator channel; finetuning has none
        cfg.d_input = meta["d_input"]
        state["embed.weight"] = state["embed.weight"][:, :cfg.d_input]
    model = Transformer(cfg)
    model.load_state_dict(hybrid_state_dict(model.state_dict(), state, INHERIT[inherit]), strict=True)
    print(f"--inherit {inherit}: {', '.join(INHERIT[inherit])} from SPT, the other groups fresh")
    return model


def evaluate_accuracy(model, split, args):
    """Classification accuracy and mean cross-entropy over a whole split (pretrain.evaluate: sharded under
    torchrun): {"acc": float, "loss": float}."""
    def batch_sums(i, idx):  # correct, loss sum
        x, lengths, labels = data.get_batch(split, idx, args.device)
        with autocast(args.device, args.dtype):
            logits = model.classify(x, lengths)
        return torch.stack([(logits.argmax(-1) == labels).sum().float(),
                            F.cross_entropy(logits.float(), labels, reduction="sum")])

    correct, loss_sum = evaluate(model, split, args, batch_sums, 2)
    n = len(split["labels"])
    return {"acc": correct / n, "loss": loss_sum / n}


def train_accuracy(model, train_split, n_val, args, at_least=1000):
    """Accuracy on a fixed random subset of the training split, for the optimization-failure claim (from
    scratch the model does not even fit its training data): (acc, n_rows), n_rows = min(N_train, max(n_val,
    at_least)). The rows are a draw seeded 0, not the first rows: UCR files are sorted by class.
    """
    n_train = len(train_split["labels"])
    n = min(n_train, max(n_val, at_least))
    rows = torch.randperm(n_train, generator=torch.Generator().manual_seed(0))[:n].sort().values
    subset = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in train_split.items()}
    return evaluate_accuracy(model, subset, args)["acc"], n


def finetune_parser():
    """The flags of finetune.py: the shared ones (pretrain.build_parser), the initialization and the Table 3
    groups."""
    parser = build_parser("finetune", __doc__.split("\n")[0])
    parser.add_argument("--init", required=True, help="'scratch' or the path of a pretrain.py checkpoint")
    parser.add_argument("--name", default=None, help="run name in out/<task>/finetune_<name>.* (default spt/scratch)")
    parser.add_argument("--inherit", default="all", choices=tuple(INHERIT), help="INHERIT: groups taken from SPT")
    parser.add_argument("--freeze", default="none", choices=tuple(FREEZE), help="FREEZE: groups kept at their init")
    return parser


def main(argv=None):
    """Finetuning: python finetune.py --task TASK --init scratch|PATH [flags]; writes run_paths(..., "finetune",
    name): the checkpoints, the log, and finetune_<name>.json with the run's results."""
    parser = finetune_parser()
    args = parser.parse_args(argv)
    preset = resolve(args, "finetune", parser)
    if args.init == "scratch" and args.inherit != "all":
        parser.error("--inherit selects groups of an SPT checkpoint: give --init PATH")
    # The one read of the SPT checkpoint: its weights, and what the run records of it (provenance), come from it.
    spt = None if args.init == "scratch" else data.load_pt(args.init)
    if args.name is None:  # a default that never overwrites the plain SPT run with an ablation or a dataset swap
        swap = None if spt is None or spt.get("task") in (None, args.task) else spt["task"].replace("/", "-")
        args.name = ("scratch" if spt is None else "spt") + (f"_from_{swap}" if swap else "") + \
            ("" if args.inherit == "all" else f"_inherit-{args.inherit}") + \
            ("" if args.freeze == "none" else f"_freeze-{args.freeze}")
    paths = pretrain.run_paths(args.out_dir, args.task, "finetune", args.name)
    splits = prepare_data(args, preset)
    meta = splits["train"]["meta"]
    provenance = {}
    if spt is None:
        inputs = dict(vocab_size=meta["vocab_size"]) if meta["kind"] == "tokens" else dict(d_input=meta["d_input"])
        model = Transformer(ModelConfig(**inputs, max_len=meta["max_len"], n_classes=meta["n_classes"],
                                        **preset["model"]))
    else:
        head = {k: preset["model"].get(k, getattr(ModelConfig, k)) for k in FINETUNE_FIELDS}
        model = model_from_pretrained(spt, meta, meta["n_classes"], args.task, args.inherit, head)
        for flag, field in MODEL_FLAGS.items():  # the checkpoint's model is the run's: a model flag that differs
            if getattr(args, flag) is not None and getattr(args, flag) != getattr(model.cfg, field):
                parser.error(f"--{flag} {getattr(args, flag)}: the SPT checkpoint has {field}="
                             f"{getattr(model.cfg, field)!r}, and finetuning keeps it (drop --{flag})")
        provenance = dict(spt_task=spt["task"], spt_sha256=spt["tensors_sha256"], spt_step=spt["state"]["step"],
                          spt_data_sha256=spt["data_sha256"],
                          spt_data=check_spt_data(spt, args.task, data_hashes(splits)))
    del spt
    model = model.to(args.device)
    for n, param in model.named_parameters():  # frozen tensors get no gradient and are not given to AdamW
        param.requires_grad_(param_group(n) not in FREEZE[args.freeze])
    train_split, net = splits["train"], wrap(model, args)

    def loss_fn(idx, step):
        x, lengths, labels = local_rows(args, *data.get_batch(train_split, idx, args.device))
        with autocast(args.device, args.dtype):
            logits = net(x, lengths)
        return F.cross_entropy(logits.float(), labels, reduction="sum"), torch.ones_like(labels).sum()

    def eval_fn(step):  # the same validation split at every step
        val = evaluate_accuracy(model, splits["val"], args)
        return {"val_acc": val["acc"], "val_loss": val["loss"]}

    record = pretrain.run_record(args, stage="finetune", task=args.task, data_meta=meta,
                                 data_sha256=data_hashes(splits), init=args.init, **provenance,
                                 same=dict(data=data_hashes(splits), init=provenance.get("spt_sha256"),
                                           inherit=args.inherit, freeze=args.freeze))
    print(f"finetuning {args.task} from {args.init}: {model.cfg}")
    with own_run(paths, args):
        best = train(model, splits, args, loss_fn, eval_fn, paths, record, metric="val_acc", maximize=True)
        t_trained = time.time()
        # Test accuracy of the best-validation weights, and train accuracy for the optimization-failure claim.
        model.load_state_dict(data.load_pt(paths["best"], map_location=args.device)["model"])
        test = evaluate_accuracy(model, splits["test"], args)
        train_acc, n_sub = train_accuracy(model, train_split, len(splits["val"]["labels"]), args)
        result = dict(task=args.task, init=args.init, name=args.name, seed=args.seed, preset=args.preset,
                      steps_per_epoch=best["n_batches"], init_scheme=model.cfg.init, init_scale=model.cfg.init_scale,
                      init_std=model.cfg.init_std if model.cfg.init == "normal" else None,
                      best_step=best["step"], best_epoch=best["epoch"], best_val_acc=best["val_acc"],
                      test_acc=test["acc"], train_acc=train_acc, train_acc_subset=n_sub, evals=best["evals"],
                      wall_time_s=best["elapsed_s"] + time.time() - t_trained,
                      source_sha256=meta.get("sha256"), label_names=meta.get("label_names"),
                      **{k: v for k, v in record.items() if k not in ("stage", "task", "init", "data_meta", "same")})
        if args.rank == 0:
            data.save_atomic(result, paths["json"])
    if args.world_size > 1:
        torch.distributed.barrier()  # the JSON exists before any rank goes on (ablate.py reads it back)
        torch.distributed.destroy_process_group()
    print(f"{args.task} ({args.name}, init {model.cfg.init}): best validation accuracy {best['val_acc']:.4f} "
          f"(step {best['step']}, the weights tested), test accuracy {test['acc']:.4f}, train accuracy "
          f"{train_acc:.4f}; wrote {paths['json']}")


if __name__ == "__main__":
    pretrain.run_stage(main)
