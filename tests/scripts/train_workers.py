"""A small DeepSpeed job whose DataLoader reads through worker processes.

Run it under ``opentelemetry-instrument`` like the example. Each worker writes what it inherited
from its rank (threads, the global providers, the SIGTERM handler) to ``--probe-dir``, and one
chosen sample takes ``--slow-ms`` to load, as on a slow storage read.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import train as example  # examples/train.py, found through the path above


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--prefetch-factor", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="the steps are split over this many epochs")
    parser.add_argument("--epoch-micro-batches", type=int, default=0,
                        help="epochs of this many micro-batches instead, the iterator restarted where one runs out "
                             "(inside a step, where gradient accumulation does not divide it)")
    parser.add_argument("--slow-sample", type=int, default=-1, help="index of the sample that loads slowly")
    parser.add_argument("--slow-ms", type=float, default=0.0)
    parser.add_argument("--probe-dir", required=True)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class SlowSample(Dataset):
    def __init__(self, size: int, slow_index: int, slow_seconds: float):
        self.tokens = example.SyntheticTokens(size, 16, 128, seed=7)
        self.slow_index, self.slow_seconds = slow_index, slow_seconds

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        if index == self.slow_index:
            time.sleep(self.slow_seconds)
        return self.tokens[index]


def _name(obj) -> str:
    kind = obj if isinstance(obj, type) or callable(obj) else type(obj)
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', repr(kind))}"


class Probe:
    """A worker_init_fn: what the worker process holds once it starts, as JSON, one file per worker."""

    def __init__(self, directory: str):
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        from opentelemetry import metrics, trace

        handler = signal.getsignal(signal.SIGTERM)
        record = {
            "pid": os.getpid(),
            "parent": os.getppid(),
            "worker_id": worker_id,
            "threads": sorted(thread.name for thread in threading.enumerate()),
            "tracer_provider": _name(trace.get_tracer_provider()),
            "meter_provider": _name(metrics.get_meter_provider()),
            "sigterm": _name(handler) if callable(handler) else str(handler),
            "profiling": torch._C._autograd._profiler_enabled(),  # a torch.profiler session inherited from its rank
        }
        path = pathlib.Path(self.directory) / f"worker-{os.getpid()}.json"
        path.write_text(json.dumps(record))


def cycle(engine, loader, args) -> None:
    """The loop of many training scripts: micro-batches drawn for ever, a new epoch's iterator where one runs out."""
    batches = iter(loader)
    for _ in range(args.steps):
        for _ in range(args.grad_accum):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(loader)
                batch = next(batches)
            engine.backward(engine(**batch))
            engine.step()


def main(argv=None):
    args = parse_args(argv)
    example.default_single_process_env()
    torch.manual_seed(1)

    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo, as the example: no 40 s JIT build
    model = example.TinyLM(128, 32, 1, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_micro_batch_size_per_gpu": args.micro_batch_size, "gradient_accumulation_steps": args.grad_accum,
              "steps_per_print": 10**6, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    per_epoch = args.steps // args.epochs
    micro_batches = args.epoch_micro_batches or per_epoch * args.grad_accum
    dataset = SlowSample(micro_batches * args.micro_batch_size * world_size, args.slow_sample, args.slow_ms / 1000)
    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=args.micro_batch_size, sampler=sampler, num_workers=args.workers,
                        multiprocessing_context=args.context, persistent_workers=args.persistent,
                        prefetch_factor=args.prefetch_factor,
                        worker_init_fn=Probe(args.probe_dir))
    engine.train()
    if args.epoch_micro_batches:
        cycle(engine, loader, args)
    for _ in range(0 if args.epoch_micro_batches else args.epochs):
        batches = iter(loader)  # non-persistent workers are started anew here, mid-job, as in most loops
        for _ in range(per_epoch):
            for _ in range(args.grad_accum):
                batch = next(batches)
                engine.backward(engine(**batch))
                engine.step()
        del batches  # its workers exit now, not alongside the next epoch's
    if engine.global_rank == 0:
        print(f"trained {engine.global_steps} steps ({engine.skipped_steps} skipped)", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
