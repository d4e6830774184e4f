#!/usr/bin/env python3
"""An unmodified PyTorch job through the preloaded shim: 2 ranks of torch.distributed's NCCL
backend on one GPU (two fake hosts, NCCL_HOSTID, as tests/gpu/two_ranks.h does for the C tests).

    torch_ddp_smoke.py --shim build-gpu/shim/libdynamiq.so [--steps 30] [--timeout 150]
    torch_ddp_smoke.py --dry-run    # gloo on the CPU, no shim: this script's own logic only

Each rank, with libdynamiq.so preloaded and DYNAMIQ_ENABLE=1 (every communicator opted in, the
default DYNAMIQ_COMMS):
 1. all-reduces 4 MiB of gradient-like FP32 values (a scale per 256 values) with SUM and AVG,
    and their BF16 copy, each against the exact sum of the same values in FP64 (which the shim
    passes through): vNMSE at most 1e-2, and the same bytes on both ranks;
 2. trains a small MLP with DistributedDataParallel (buckets of 1 MiB, so several all-reduces a
    step) and, from the same initial weights, a twin over a second process group that
    dynamiq.register() opts out (NCCL's exact all-reduce): both losses must fall to under half,
    the compressed run's final loss within 1.5x of the exact one's, and the compressed model's
    weights the same bytes on both ranks;
 3. reads dynamiq.counters() for both groups: the default group's all-reduces compressed (the
    FP64 ones passed through), the opted-out group's all passed through.
A rank's exit code names the first phase that failed (11 all-reduce, 12 DDP, 13 the Python API
and counters), 0 when all passed. The parent starts the
ranks as fresh processes, bounds them (--timeout), and prints their output.

Exit 0 pass, 1 fail, 77 skip (no torch, no CUDA device, no NCCL backend), 2 usage.
"""
import argparse
import datetime
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
COUNT = 1 << 20  # 4 MiB of FP32: above DYNAMIQ_MIN_BYTES (1M)
VNMSE_BOUND = 1e-2  # DynamiQ at 5 bits on such values: about 1e-4; a broken call is far above


def log(rank, text):
    print("rank %d: %s" % (rank, text), flush=True)


# ------------------------------------------------------------------------------------------
# Rank side.

def digest(t):
    """SHA-256 of a tensor's bytes (moved to the CPU)."""
    import torch

    raw = t.detach().to("cpu").contiguous().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def same_on_all_ranks(dist, text):
    """Whether every rank holds the same string (an all_gather_object: not an all-reduce)."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, text)
    return all(g == got[0] for g in got)


def gradient_like(torch, count, rank, device):
    """Values with one scale per 256 (over 2^-12..2^12), as gradients have: DynamiQ's case."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(count, generator=gen)
    scales = torch.exp2(torch.randint(-12, 13, ((count + 255) // 256,), generator=gen).float())
    return (x * scales.repeat_interleave(256)[:count]).to(device)


def vnmse(got, exact):
    err = (got.double() - exact).pow(2).sum().item()
    norm = exact.pow(2).sum().item()
    return err / norm if norm > 0 else float("inf")


def phase_allreduce(torch, dist, rank, device, with_avg, failures):
    x = gradient_like(torch, COUNT, rank, device)
    ops = [("SUM", dist.ReduceOp.SUM)]
    if with_avg and getattr(dist.ReduceOp, "AVG", None) is not None:
        ops.append(("AVG", dist.ReduceOp.AVG))
    else:
        log(rank, "AVG not checked (not in this torch, or not in gloo)")
    for dtype in (torch.float32, torch.bfloat16):
        own = x.to(dtype)
        exact_sum = own.double()
        dist.all_reduce(exact_sum)  # FP64: passed through, NCCL's exact sum; once a dtype
        for op_name, op in ops:
            exact = exact_sum / dist.get_world_size() if op_name == "AVG" else exact_sum
            got = own.clone()
            dist.all_reduce(got, op=op)
            e = vnmse(got, exact)
            same = same_on_all_ranks(dist, digest(got))
            ok = e <= VNMSE_BOUND and same and bool(torch.isfinite(got).all())
            log(rank, "%s %s all-reduce: vNMSE %.3e against FP64, same bytes on all ranks: %s%s"
                % (op_name, str(dtype).replace("torch.", ""), e, same, "" if ok else "  FAIL"))
            if not ok:
                failures.append("all-reduce %s %s" % (op_name, dtype))


def make_model(torch, seed, device):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 64)).to(device)


def train(torch, ddp_model, rank, device, steps):
    """Adam on a fixed teacher (the same on every rank), each rank its own inputs: the losses."""
    teacher = make_model(torch, 7, device)
    gen = torch.Generator().manual_seed(500 + rank)
    opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 256, generator=gen).to(device)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def phase_ddp(torch, dist, rank, device, steps, exact_group, failures):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    runs = {}
    for name, group in (("compressed", None), ("exact", exact_group)):
        model = DDP(make_model(torch, 3, device), device_ids=ids, bucket_cap_mb=1,
                    process_group=group)
        losses = train(torch, model, rank, device, steps)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        runs[name] = (losses, weights)
        log(rank, "DDP %s: loss %.4f -> %.4f over %d steps" % (name, losses[0], losses[-1], steps))
    (lc, wc), (le, _) = runs["compressed"], runs["exact"]
    for name, losses in (("compressed", lc), ("exact", le)):
        if not losses[-1] < 0.5 * losses[0]:
            failures.append("DDP %s: the loss did not halve" % name)
    if not lc[-1] <= 1.5 * le[-1]:
        failures.append("DDP: compressed final loss %.4f above 1.5x the exact %.4f"
                        % (lc[-1], le[-1]))
    if not same_on_all_ranks(dist, digest(wc)):
        failures.append("DDP: the compressed model's weights differ between ranks")
    return runs


def rank_main(args):
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.dry_run:
        device, backend = torch.device("cpu"), "gloo"
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % args.port, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    # The twin's group, opted out before its first all-reduce (its communicator exists once a
    # collective that is not an all-reduce ran on it: a broadcast).
    exact_group = dist.new_group(list(range(world)))
    dist.broadcast(torch.zeros(1, device=device), 0, group=exact_group)
    api_failures, registered = [], False
    if not args.dry_run:
        import dynamiq

        try:
            dynamiq.register(exact_group, enable=False)
            registered = True
        except (TypeError, RuntimeError) as e:
            api_failures.append("dynamiq.register(group) with this torch: %s" % e)
    allreduce_failures, ddp_failures = [], []
    phase_allreduce(torch, dist, rank, device, not args.dry_run, allreduce_failures)
    phase_ddp(torch, dist, rank, device, args.steps, exact_group, ddp_failures)
    if not args.dry_run:
        failures = api_failures
        try:
            c_default = dynamiq.counters(dist.group.WORLD)
            log(rank, "default group: %s" % json.dumps(c_default))
            # Phase 1: 4 compressed (SUM, AVG x FP32, BF16), 2 FP64 passed through; DDP: every
            # step's buckets (at least one a step).
            if c_default["rerouted"] < 4 + args.steps:
                failures.append("counters: %d all-reduces compressed on the default group, "
                                "expected at least %d" % (c_default["rerouted"], 4 + args.steps))
            if registered:
                c_exact = dynamiq.counters(exact_group)
                log(rank, "opted-out group: %s" % json.dumps(c_exact))
                if c_exact["rerouted"] != 0 or c_exact["passed"] < args.steps:
                    failures.append("counters: the opted-out group compressed %d, passed %d"
                                    % (c_exact["rerouted"], c_exact["passed"]))
        except (TypeError, RuntimeError) as e:
            failures.append("counters: %s" % e)
    code = 11 if allreduce_failures else 12 if ddp_failures else 13 if api_failures else 0
    for f in allreduce_failures + ddp_failures + api_failures:
        log(rank, "FAIL: " + f)
    dist.barrier()
    dist.destroy_process_group()
    log(rank, "done, exit %d" % code)
    return code


# ------------------------------------------------------------------------------------------
# Parent side.

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent_main(args):
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print("SKIP: torch is not importable: %s" % e)
        return SKIP
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("SKIP: no CUDA device for torch (torch %s)" % torch.__version__)
            return SKIP
        if not dist.is_nccl_available():
            print("SKIP: this torch has no NCCL backend")
            return SKIP
        if not args.shim or not os.path.exists(args.shim):
            print("usage: --shim PATH to libdynamiq.so is required (or --dry-run)")
            return 2
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    with tempfile.TemporaryDirectory(prefix="dq-torch-") as tmp:
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       PYTHONUNBUFFERED="1")
            env["PYTHONPATH"] = os.path.join(root, "python") + (
                ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            if not args.dry_run:
                env.update(LD_PRELOAD=os.path.abspath(args.shim), DYNAMIQ_ENABLE="1",
                           DYNAMIQ_METRICS_FILE=os.path.join(tmp, "metrics.%r.json"),
                           # Two fake hosts, so that NCCL takes two ranks on one device; NCCL's
                           # own socket transport between them (the net plugin has its tests).
                           NCCL_HOSTID="dynamiq-torch-host-%d" % rank, NCCL_NET="Socket",
                           NCCL_SOCKET_IFNAME="lo")
                env.setdefault("NCCL_DEBUG", "WARN")
            cmd = [sys.executable, os.path.abspath(__file__), "--rank-of-parent", "--port",
                   str(port), "--steps", str(args.steps)] + (["--dry-run"] if args.dry_run else [])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + args.timeout
        codes = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                print(out, end="")
                print("FAIL: the ranks did not end within %d s (killed)" % args.timeout)
                return 1
            print(out, end="")
            codes.append(p.returncode)
    if any(codes):
        print("FAIL: rank exit codes %s (11 all-reduce, 12 DDP, 13 counters)" % codes)
        return 1
    print("PASS: torch %s, %s" % (torch.__version__, "gloo dry run (no shim)" if args.dry_run
                                   else "NCCL through the shim"))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shim", help="libdynamiq.so to preload")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--rank-of-parent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.timeout < 1:
        ap.error("--steps and --timeout must be positive")
    return rank_main(args) if args.rank_of_parent else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
