"""A small but real DeepSpeed training job, runnable on CPU.

A few transformer layers learn a synthetic token language model through a
``torch.utils.data.DataLoader`` (or DeepSpeed's own loader). It knows nothing
about OpenTelemetry: run it under ``opentelemetry-instrument`` to trace it::

    opentelemetry-instrument deepspeed --num_gpus 2 examples/train.py --steps 20
    opentelemetry-instrument torchrun --nproc_per_node 2 examples/train.py --zero-stage 3
    opentelemetry-instrument python examples/train.py --grad-accum 4
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import pathlib
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

HERE = pathlib.Path(__file__).resolve().parent


def _input_faults(faults) -> None:
    """The input's faults: what the batches hold changes."""
    faults.add_argument("--shift-seq-len", type=int, default=0, metavar="N",
                        help="from optimizer step --shift-at on, batches hold sequences of N tokens instead of "
                             "--seq-len (the input changes: more or fewer tokens per step)")
    faults.add_argument("--shift-at", type=int, default=0, metavar="K", help="first step of --shift-seq-len")
    faults.add_argument("--shift-until", type=int, default=0, metavar="L",
                        help="last step of --shift-seq-len, then back to --seq-len (0: to the end)")
    faults.add_argument("--shift-rank", type=int, default=-1, metavar="R", help="only rank R's input shifts")
    faults.add_argument("--padding", action="store_true",
                        help="each sequence holds between half and all of its length in real tokens, padded to "
                             "the batch's length with an attention_mask, as tokenizers pad")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--config", default=str(HERE / "ds_config.json"), help="base DeepSpeed config")
    parser.add_argument("--loader", choices=("torch", "deepspeed"), default="torch",
                        help="torch: a DataLoader with a DistributedSampler; "
                             "deepspeed: deepspeed.initialize(training_data=...)")
    parser.add_argument("--backward", choices=("engine", "direct"), default="engine",
                        help="engine.backward(loss), or loss.backward() (ZeRO >= 1)")
    parser.add_argument("--fp16", action="store_true",
                        help="fp16 with a 2**24 initial loss scale, so the first steps overflow and are skipped")
    parser.add_argument("--average-loss", choices=("off", "sync", "async"), default="off",
                        help="all-reduce each micro-batch's loss with torch.distributed for logging, as many loops do; "
                             "async overlaps it with 20 ms of host work before waiting")
    faults = parser.add_argument_group("fault injection", "slow-downs for `opentelemetry-deepspeed diagnose` to find")
    faults.add_argument("--stall-every", type=int, default=0, metavar="K",
                        help="the data loader stalls on every K-th optimizer step (its first micro-batch)")
    faults.add_argument("--stall-ms", type=float, default=200.0, metavar="D", help="length of each stall")
    faults.add_argument("--stall-from", type=int, default=1, metavar="N",
                        help="the stalls begin at optimizer step N (a loader that degrades mid-run)")
    faults.add_argument("--stall-rank", type=int, default=-1, metavar="R",
                        help="only rank R's data loader stalls (default: every rank's)")
    faults.add_argument("--host-work", metavar="K:D[:R]",
                        help="after every K-th optimizer step the loop works D ms on the host before the next one (a "
                             "checkpoint, an evaluation, logging): between steps, no step open; only rank R's loop, "
                             "if given")
    faults.add_argument("--slow-rank", type=int, default=-1, metavar="R",
                        help="rank R computes --slow-ms longer in each --slow-phase (a straggler)")
    faults.add_argument("--slow-ms", type=float, default=50.0, metavar="D")
    faults.add_argument("--slow-phase", choices=("forward", "backward", "optimizer", "data"), default="forward",
                        help="where the slow rank spends its extra time: each forward, each backward, each "
                             "optimizer step, or each micro-batch its loader makes (data)")
    faults.add_argument("--comm-heavy", action="store_true",
                        help="each backward also all-reduces a buffer of --comm-heavy-mib, as tensor parallelism "
                             "all-reduces its activations' gradients: the step waits on the transfer")
    faults.add_argument("--comm-heavy-mib", type=float, default=48.0, metavar="M",
                        help="size of --comm-heavy's all-reduce in MiB")
    faults.add_argument("--hang-rank", type=int, default=-1, metavar="R",
                        help="rank R blocks forever in --hang-phase of step --hang-step (the others then wait for "
                             "it in their next collective)")
    faults.add_argument("--hang-step", type=int, default=0, metavar="N", help="optimizer step (1-based) of the hang")
    faults.add_argument("--hang-seconds", type=float, default=0.0, metavar="S",
                        help="the hang ends after S seconds and the run goes on (a stall); 0: for good")
    faults.add_argument("--hang-phase", choices=("forward", "backward", "data", "after-step"), default="forward",
                        help="data: the loader never returns step N's first micro-batch (no step open yet); "
                             "after-step: the loop blocks after step N's engine.step() (between steps)")
    faults.add_argument("--desync-rank", type=int, default=-1, metavar="R",
                        help="at step --desync-step every rank all-reduces a small float32 tensor, rank R an int32 "
                             "one of the same size: the same collective with another dtype on one rank")
    faults.add_argument("--desync-step", type=int, default=0, metavar="N")
    _input_faults(faults)
    faults.add_argument("--slowdown-at", type=int, default=0, metavar="K",
                        help="from optimizer step K on, every rank's forward and backward compute "
                             "--slowdown-factor times slower, with the same tokens (a throttled device, a slower "
                             "kernel)")
    faults.add_argument("--slowdown-factor", type=float, default=2.0, metavar="F")
    faults.add_argument("--barrier", action="store_true",
                        help="after each step the loop waits for the other ranks in torch.distributed.barrier(), as "
                             "a program's own code between steps does (an evaluation, a checkpoint): no step is open")
    faults.add_argument("--crash-after", type=int, default=0, metavar="K",
                        help="the forward of step K+1 raises RuntimeError on rank 0 (--crash-rank): the rank dies "
                             "with an exception")
    faults.add_argument("--crash-in", choices=("forward", "data", "loop", "after-step"), default="forward",
                        help="where --crash-after raises: the forward, the data loader (its collate raises "
                             "ValueError, as a corrupt sample does), the loop's own code between the forward and "
                             "the backward (an AssertionError, as a check of the loss does), or its code after step K "
                             "(a RuntimeError, as a callback or a checkpoint's save may raise)")
    faults.add_argument("--crash-rank", type=int, default=0, metavar="R", help="the rank --crash-after fails")
    faults.add_argument("--crash-how", choices=("raise", "kill", "exit", "segv"), default="raise",
                        help="how it fails there: its exception, SIGKILL (as the kernel's OOM killer does), "
                             "os._exit(3) (a hard exit, no exit handler runs), or a segmentation fault (a bug in "
                             "native code: it reads address 0)")
    _numerics_arguments(parser)
    parser.add_argument("--print-steps", action="store_true",
                        help="each rank prints its loss (mean over the micro-batches) and gradient norm of every "
                             "optimizer step, exactly (repr)")
    faults.add_argument("--block-in-step", type=int, default=0, metavar="K",
                        help="the forward of step K blocks on rank 0 until a signal arrives, after printing "
                             "'blocked in step K': a SIGTERM sent then lands inside a step; SIGUSR1 lets the step "
                             "go on (a running job's telemetry can be read while it waits)")
    parser.add_argument("--eval-every", type=int, default=0, metavar="K",
                        help="after every K-th optimizer step, evaluate a micro-batch of half the size in "
                             "engine.eval() under torch.no_grad(), then engine.train()")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--loss-file", help="rank 0 writes one JSON loss per optimizer step here")
    parser.add_argument("--comms-log", help="each rank writes DeepSpeed's own comms_logger counts of the training "
                                            "loop to FILE.rank<N>.json: {op: {message bytes: calls}}")
    parser.add_argument("--step-times", metavar="FILE",
                        help="each rank writes the wall time of every optimizer step of the loop (host clock, from "
                             "fetching its first micro-batch to its engine.step() and loss read) to FILE.rank<N>: "
                             "one line per step, in seconds")
    parser.add_argument("--deepspeed-builtins", action="store_true",
                        help="turn on DeepSpeed's own tools (no OpenTelemetry): wall_clock_breakdown, comms_logger "
                             "and the CSV monitor (files under ./deepspeed_monitor), to compare their cost")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser.parse_args(argv)


class SyntheticTokens(Dataset):
    """Deterministic token sequences with a learnable rule: each token predicts the next."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (size, 1), generator=generator)
        strides = torch.randint(1, 7, (size, 1), generator=generator)
        positions = torch.arange(seq_len + 1).unsqueeze(0)
        self.tokens = (starts + strides * positions) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        sequence = self.tokens[index]
        return {"input_ids": sequence[:-1], "labels": sequence[1:]}


class StallingCollate:
    """Collates micro-batches; the first micro-batch of every K-th optimizer step takes D ms longer.

    Sequences are cut to the step's length (``lengths(step)``); with ``pad_id`` each one keeps between
    half and all of it in real tokens and is padded with ``pad_id`` to the length (an ``attention_mask``
    says which tokens are real; labels of padding are -100, which the loss ignores).
    """

    def __init__(self, every: int, milliseconds: float, grad_accum: int, *, lengths=None,
                 pad_id: int | None = None, seed: int = 0, hang_step: int = 0, stall_from: int = 1,
                 crash_step: int = 0, crash_how: str = "raise", slow_ms: float = 0.0):
        self.every, self.seconds, self.grad_accum, self.batches = every, milliseconds / 1000, grad_accum, 0
        self.slow = slow_ms / 1000  # every micro-batch (--slow-phase data)
        self.stall_from = stall_from
        self.hang_step = hang_step  # the first micro-batch of this step never comes (--hang-phase data)
        self.crash_step, self.crash_how = crash_step, crash_how  # ... fails (--crash-in data)
        self.lengths, self.pad_id = lengths, pad_id
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, samples):
        step, micro = divmod(self.batches, self.grad_accum)
        self.batches += 1
        if micro == 0 and step + 1 == self.hang_step:
            block_forever()
        if micro == 0 and step + 1 == self.crash_step:
            crash(self.crash_how, ValueError(f"injected corrupt sample in the batch of step {step + 1}"))
        if self.every and micro == 0 and (step + 1) % self.every == 0 and step + 1 >= self.stall_from:
            time.sleep(self.seconds)
        if self.slow:
            time.sleep(self.slow)
        batch = torch.utils.data.default_collate(samples)
        if self.lengths is not None:
            length = self.lengths(step + 1)
            batch = {name: value[:, :length] for name, value in batch.items()}
        if self.pad_id is not None:
            ids, labels = batch["input_ids"], batch["labels"]
            length = ids.shape[1]
            real = torch.randint(length // 2, length + 1, (ids.shape[0], 1), generator=self.generator)
            mask = torch.arange(length).unsqueeze(0) < real
            batch = {"input_ids": ids.masked_fill(~mask, self.pad_id), "labels": labels.masked_fill(~mask, -100),
                     "attention_mask": mask.long()}
        return batch


class _OnBackward(torch.autograd.Function):
    """The identity forward; its backward, the first of the pass when applied to the loss, calls ``act``
    first: extra backward time (a sleep), or the moment the backward started."""

    @staticmethod
    def forward(ctx, tensor, act):
        ctx.act = act
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.act()
        return grad, None


class _AllReduceInBackward(torch.autograd.Function):
    """The identity forward; its backward all-reduces ``buffer`` first (a synchronous collective)."""

    @staticmethod
    def forward(ctx, tensor, buffer):
        ctx.buffer = buffer
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        torch.distributed.all_reduce(ctx.buffer)
        return grad, None


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, seq_len: int, *, delay_ms: float = 0.0,
                 backward_delay_ms: float = 0.0, exchange: int = 0):
        super().__init__()
        self.delay = delay_ms / 1000
        self.backward_delay = backward_delay_ms / 1000
        self.slowdown = 1.0  # the forward's compute takes this many times as long (fault injection)
        # Allocated once and reused, as a GPU's caching allocator would: a fresh large tensor per step
        # costs a CPU host as much in page faults as the transfer itself.
        self.exchange = torch.zeros(exchange) if exchange else None
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.mask = nn.Transformer.generate_square_subsequent_mask(seq_len)

    def forward(self, input_ids, labels, attention_mask=None):
        # Padding is on the right: under the causal mask no real token attends to it, so
        # attention_mask needs no use here (the labels of padding are -100).
        if getattr(self, "crash", None):
            crash(self.crash, RuntimeError("injected crash in forward"))
        if getattr(self, "block", None):
            # SIGUSR1 (its default action would kill) becomes a wake-up; polled, not signal.pause(),
            # so that one sent right after the line is printed is not missed. A SIGTERM ends the sleep
            # and its handler runs here, inside the step.
            woken = []
            signal.signal(signal.SIGUSR1, lambda _signum, _frame: woken.append(_signum))
            print(f"blocked in step {self.block}", flush=True)
            while not woken:
                time.sleep(0.05)
        if getattr(self, "out_of_memory", False):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if self.delay:
            time.sleep(self.delay)
        hang = getattr(self, "hang", None)
        if hang == "forward":
            block_forever()
        # A slowdown multiplies the compute's CPU time, not its wall time: a slower device multiplies the work,
        # and a host that other processes fill later must not multiply the injected fault with it.
        started = time.thread_time()
        hidden = self.embed(input_ids) + self.position[:, : input_ids.shape[1]]
        if hang == "backward":
            hidden.register_hook(lambda _gradient: block_forever())
        backward_clock = {}
        if self.slowdown > 1:  # the layers' backward too, timed from the loss down to here
            factor = self.slowdown
            hidden.register_hook(lambda _gradient: time.sleep(
                (factor - 1) * (time.thread_time() - backward_clock["started"])))
        mask = self.mask[: input_ids.shape[1], : input_ids.shape[1]].to(hidden.dtype)
        hidden = self.encoder(hidden, mask=mask, is_causal=True)
        logits = self.head(hidden)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.thread_time() - started))
            loss = _OnBackward.apply(loss, lambda: backward_clock.update(started=time.thread_time()))
        if self.backward_delay:
            loss = _OnBackward.apply(loss, functools.partial(time.sleep, self.backward_delay))
        if self.exchange is not None:
            loss = _AllReduceInBackward.apply(loss, self.exchange)
        return loss


HANG_SECONDS = 0.0  # --hang-seconds: how long an injected hang lasts; 0, for good


def block_forever():
    """An injected hang: this rank does not return (for --hang-seconds, if given), the others wait for it in their
    next collective."""
    if HANG_SECONDS:
        time.sleep(HANG_SECONDS)
        return
    while True:
        time.sleep(3600)


def desync(rank: int, bad_rank: int) -> None:
    """A collective whose dtype differs on one rank (same bytes, so gloo completes it)."""
    dtype = torch.int32 if rank == bad_rank else torch.float32
    torch.distributed.all_reduce(torch.ones(4, dtype=dtype))


class _IdentityForward(torch.autograd.Function):
    """The loss's value as it is; a fault of the backward's, in the subclass."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)


class _RaiseOutOfMemory(_IdentityForward):
    """The backward raises the allocator's error, as a backward that runs out of memory does."""

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


class _NonFiniteGradient(_IdentityForward):
    """The backward makes every gradient NaN."""

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Injection:
    """The numerics and memory faults of one rank, by optimizer step (1-based)."""

    def __init__(self, args, rank: int):
        def parse(value, fields):
            if not value:
                return None
            parts = value.split(":")
            step, target = int(parts[0]), int(parts[1])
            return (step, *parts[2:fields]) if target == rank else None

        self.loss_spike = parse(args.inject_loss_spike, 3)
        self.grad_spike = parse(args.inject_grad_spike, 3)
        self.nan = parse(args.inject_nan, 2)
        self.grad_nan = parse(args.inject_grad_nan, 2)
        self.oom = parse(args.inject_oom, 3)

    def forward(self, step: int, model) -> None:
        """Arms the model's forward to run out of memory inside DeepSpeed's forward, as a real one would."""
        model.out_of_memory = bool(self.oom and self.oom[0] == step and self.oom[1] == "forward")

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.loss_spike and self.loss_spike[0] == step:
            loss = loss * float(self.loss_spike[1])
        if self.grad_spike and self.grad_spike[0] == step:
            factor = float(self.grad_spike[1])
            loss = loss * factor - (loss * (factor - 1)).detach()
        if self.nan and self.nan[0] == step:
            loss = loss * float("nan")
        if self.grad_nan and self.grad_nan[0] == step:
            loss = _NonFiniteGradient.apply(loss)
        if self.oom and self.oom[0] == step and self.oom[1] == "backward":
            loss = _RaiseOutOfMemory.apply(loss)
        return loss


def deepspeed_config(args) -> dict:
    config = json.loads(pathlib.Path(args.config).read_text())
    config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    config["gradient_accumulation_steps"] = args.grad_accum
    config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 1000}
    if args.deepspeed_builtins:
        config["wall_clock_breakdown"] = True
        config["comms_logger"] = {"enabled": True}
        config["csv_monitor"] = {"enabled": True, "output_path": "deepspeed_monitor", "job_name": "train"}
    return config


def default_single_process_env():
    # DeepSpeed looks for MPI when a plain `python train.py` lacks the launcher's variables.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        os.environ.setdefault(name, value)


def average_loss(loss: torch.Tensor, asynchronous: bool) -> float:
    """The cross-rank mean of a loss, with plain torch.distributed (not deepspeed.comm)."""
    total = loss.detach().clone()
    work = torch.distributed.all_reduce(total, async_op=asynchronous)
    if asynchronous:
        time.sleep(0.02)
        work.wait()
    return total.item() / torch.distributed.get_world_size()


def make_optimizer(args, model, delay_ms: float = 0.0):
    """A torch optimizer: DeepSpeed's config optimizers JIT-compile fused kernels on CPU.
    ``delay_ms``: each of its steps takes that much longer (a slow optimizer on one rank)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if delay_ms:
        step = optimizer.step

        def slow_step(*args, **kwargs):
            time.sleep(delay_ms / 1000)
            return step(*args, **kwargs)

        optimizer.step = slow_step
    return optimizer


def write_comms_counts(prefix: str, rank: int) -> None:
    """DeepSpeed's own count of the collectives it issued: an oracle for the telemetry's."""
    import deepspeed

    deepspeed.comm.configure(enabled=False)
    counts = {op: {size: record[0] for size, record in sizes.items()}
              for op, sizes in deepspeed.comm.comms_logger.comms_dict.items()}
    pathlib.Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(counts))


def write_measurements(args, rank: int, step_seconds: list[float]) -> None:
    if args.step_times:
        lines = "".join(f"{seconds:.9f}\n" for seconds in step_seconds)
        pathlib.Path(f"{args.step_times}.rank{rank}").write_text(lines)
    if args.comms_log:
        write_comms_counts(args.comms_log, rank)


def _numerics_arguments(parser) -> None:
    numerics = parser.add_argument_group("numerics and memory faults", "for the MODEL and MEMORY verdicts; STEP is the "
                                         "1-based optimizer step (training.step), R the rank")
    numerics.add_argument("--inject-loss-spike", metavar="STEP:R:F",
                          help="multiply the loss (and so its gradients) of optimizer step STEP on rank R by F")
    numerics.add_argument("--inject-grad-spike", metavar="STEP:R:F",
                          help="multiply the gradients of step STEP on rank R by F, leaving the loss's value as it is")
    numerics.add_argument("--inject-nan", metavar="STEP:R",
                          help="the loss of step STEP on rank R is NaN (and so are the weights after it, unless the "
                               "optimizer skips the step: fp16's does, and ZeRO 1 and 2's in any precision)")
    numerics.add_argument("--inject-grad-nan", metavar="STEP:R",
                          help="the gradients of step STEP on rank R are NaN, the loss's value as it is")
    numerics.add_argument("--inject-oom", metavar="STEP:R:PHASE",
                          help="raise torch.OutOfMemoryError in the forward or backward of step STEP on rank R")


def crash(how: str, error: BaseException) -> None:
    """--crash-how: ``error`` raised, or the process gone without a word."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        os._exit(3)
    if how == "segv":
        import ctypes

        ctypes.string_at(0)
    raise error


def inject_faults(args, model, rank: int, step: int) -> None:
    """Before step ``step + 1`` (0-based ``step``): a rank's forward fails, or rank 0's blocks until a signal,
    when asked to; every rank's compute slows down from --slowdown-at on; one rank hangs for good."""
    crashes = rank == args.crash_rank and bool(args.crash_after) and step == args.crash_after
    model.crash = args.crash_how if crashes and args.crash_in == "forward" else None
    if rank == 0:
        model.block = step + 1 if args.block_in_step and step + 1 == args.block_in_step else None
    if args.slowdown_at and step + 1 >= args.slowdown_at:
        model.slowdown = args.slowdown_factor
    model.hang = args.hang_phase if step + 1 == args.hang_step and rank == args.hang_rank else None


def after_step(args, rank: int, step: int) -> None:
    """The loop's own code after optimizer step ``step`` (1-based) ends, before the next one fetches."""
    if args.crash_in == "after-step" and rank == args.crash_rank and step == args.crash_after > 0:
        crash(args.crash_how, RuntimeError(f"injected failure after step {step}"))
    if args.hang_phase == "after-step" and step == args.hang_step and rank == args.hang_rank:
        block_forever()
    if args.host_work:
        every, work, *who = args.host_work.split(":")
        if step % int(every) == 0 and int(who[0] if who else rank) == rank:
            time.sleep(float(work) / 1000)
    if args.barrier:
        torch.distributed.barrier()


def make_loader(args, engine, dataset) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank, shuffle=False)
    every = args.stall_every if args.stall_rank in (-1, engine.global_rank) else 0
    lengths = None
    if args.shift_seq_len:  # the sequences are cut to the step's length: unshifted, --seq-len
        shifts = args.shift_rank in (-1, engine.global_rank)

        def lengths(step):
            shifted = shifts and step >= args.shift_at and (not args.shift_until or step <= args.shift_until)
            return args.shift_seq_len if shifted else args.seq_len
    pad_id = args.vocab if args.padding else None
    hang = args.hang_step if args.hang_phase == "data" and args.hang_rank == engine.global_rank else 0
    crashes = args.crash_after and args.crash_in == "data" and engine.global_rank == args.crash_rank
    crash_step = args.crash_after + 1 if crashes else 0
    slow = args.slow_ms if args.slow_phase == "data" and args.slow_rank == engine.global_rank else 0.0
    return DataLoader(dataset, batch_size=args.micro_batch_size, sampler=sampler, num_workers=args.workers,
                      collate_fn=StallingCollate(every, args.stall_ms, args.grad_accum, lengths=lengths,
                                                 pad_id=pad_id, seed=args.seed + engine.global_rank, hang_step=hang,
                                                 stall_from=args.stall_from, crash_step=crash_step,
                                                 crash_how=args.crash_how, slow_ms=slow))


def evaluate(engine, evaluation: DataLoader, batches: int = 1) -> float:
    """An evaluation as a loop makes it between steps: DeepSpeed's eval() (the wrapped module's mode), no gradients,
    the first ``batches`` of the evaluation set (the loader left before its end)."""
    engine.eval()
    with torch.no_grad():
        losses = [float(engine(**{name: value.to(engine.device) for name, value in batch.items()}))
                  for batch in itertools.islice(evaluation, batches)]
    engine.train()
    return sum(losses) / len(losses)


def print_step(args, engine, loss: float) -> None:
    if not args.print_steps:
        return
    grad_norm = engine.get_global_grad_norm()
    # One write per line: print() writes the text and its newline apart, and ranks sharing the
    # launcher's unbuffered stdout then interleave their lines.
    sys.stdout.write(f"step {engine.global_steps} rank {engine.global_rank} loss {loss!r} "
                     f"grad_norm {None if grad_norm is None else float(grad_norm)!r}\n")
    sys.stdout.flush()


def slow_rank_delays(args) -> dict[str, float]:
    """Milliseconds this rank adds to each forward, backward and optimizer step (--slow-rank)."""
    delay = args.slow_ms if int(os.environ.get("RANK", "0")) == args.slow_rank else 0.0
    return {phase: delay if phase == args.slow_phase else 0.0 for phase in ("forward", "backward", "optimizer")}


def build(args):
    """The model, its engine and the training loader."""
    import deepspeed

    delays = slow_rank_delays(args)
    longest = max(args.seq_len, args.shift_seq_len)
    # With padding, the id after the vocabulary pads (it gets an embedding of its own).
    model = TinyLM(args.vocab + args.padding, args.d_model, args.layers, longest, delay_ms=delays["forward"],
                   backward_delay_ms=delays["backward"],
                   exchange=int(args.comm_heavy_mib * 2**18) if args.comm_heavy else 0)
    optimizer = make_optimizer(args, model, delays["optimizer"])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dataset = SyntheticTokens(args.steps * args.grad_accum * args.micro_batch_size * world_size,
                              longest, args.vocab, args.seed)

    engine, _, ds_loader, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(args),
        training_data=dataset if args.loader == "deepspeed" else None,
    )
    loader = ds_loader if ds_loader is not None else make_loader(args, engine, dataset)
    return model, engine, loader


def main(argv=None):
    global HANG_SECONDS  # noqa: PLW0603 - read by the injected hang wherever it runs (a loader worker too)
    args = parse_args(argv)
    HANG_SECONDS = args.hang_seconds
    default_single_process_env()
    torch.manual_seed(args.seed)

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # DeepSpeed would JIT-compile its shared-memory allreduce (~40 s) on first use;
        # gloo is what it falls back to without it, and what this example is for.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    model, engine, loader = build(args)

    if args.comms_log:
        deepspeed.comm.configure(enabled=True, prof_all=True)
    losses = []
    batches = iter(loader)
    evaluation = DataLoader(SyntheticTokens(4 * max(1, args.micro_batch_size // 2), args.seq_len, args.vocab,
                                            args.seed + 1), batch_size=max(1, args.micro_batch_size // 2))
    engine.train()
    step_seconds = []
    injection = Injection(args, engine.global_rank)
    for step in range(args.steps):
        started = time.perf_counter()
        inject_faults(args, model, engine.global_rank, step)
        step_loss = 0.0
        for _ in range(args.grad_accum):
            batch = next(batches)
            batch = {name: value.to(engine.device) for name, value in batch.items()}
            injection.forward(step + 1, model)
            loss = injection.loss(step + 1, engine(**batch))
            if args.crash_in == "loop" and engine.global_rank == args.crash_rank and step == args.crash_after > 0:
                # the loop's own code
                crash(args.crash_how, AssertionError(f"injected check of the loss failed in step {step + 1}"))
            if args.backward == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            if args.average_loss != "off":
                average_loss(loss, asynchronous=args.average_loss == "async")
            if step + 1 == args.desync_step:
                desync(engine.global_rank, args.desync_rank)
            engine.step()
            step_loss += loss.item() / args.grad_accum
        losses.append(step_loss)
        print_step(args, engine, step_loss)
        step_seconds.append(time.perf_counter() - started)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            evaluate(engine, evaluation)
        after_step(args, engine.global_rank, step + 1)
    write_measurements(args, engine.global_rank, step_seconds)

    if engine.global_rank == 0:
        # One write, as print_step's.
        sys.stdout.write(f"trained {engine.global_steps} steps ({engine.skipped_steps} skipped), "
                         f"loss {losses[0]:.4f} -> {losses[-1]:.4f}\n")
        sys.stdout.flush()
        if args.loss_file:
            pathlib.Path(args.loss_file).write_text(json.dumps(losses))


def end_process_group() -> None:
    """What a training script does last: gloo's threads outlive a group not destroyed and can abort the
    exit ("terminate called without an active exception"). Not in main(), which tests call in-process."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process_group()
