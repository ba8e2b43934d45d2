"""Plain PyTorch data-parallel training, no DeepSpeed: DDP, FSDP (``FullyShardedDataParallel``) or FSDP2
(``fully_shard``) over gloo.

    opentelemetry-instrument torchrun --nproc_per_node 2 tests/scripts/train_torch.py --mode fsdp

Gradient accumulation as such loops do it: DDP's and FSDP's ``no_sync()``, FSDP2's
``set_requires_gradient_sync(False)``, on every micro-batch but the last of a step. Each step's loss is
averaged across ranks with ``torch.distributed.all_reduce`` for logging, before the optimizer step.
``--slow-rank R`` makes rank R sleep ``--slow-ms`` in each forward (a straggler). ``--leftover N``: after the
last step, N more micro-batches, forward and backward, that no optimizer step takes (an epoch's leftovers).
``--exit-status S``: then ``sys.exit(S)``, as a program that reports an error it caught does (Hydra's ``@hydra.main``).
``--vocab V``: the model reads token ids (an embedding of V first), as a language model does. ``--wrap manual``: FSDP's
units built one by one, each layer's before the model's, not by an auto-wrap policy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "fsdp", "fsdp1"), default="ddp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=30.0)
    parser.add_argument("--leftover", type=int, default=0)
    parser.add_argument("--exit-status", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=0)
    parser.add_argument("--wrap", choices=("auto", "manual"), default="auto")
    return parser.parse_args(argv)


class Model(nn.Module):
    def __init__(self, width: int, delay_ms: float, vocab: int = 0):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width) if vocab else None
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.delay = delay_ms / 1000

    def forward(self, x):
        if self.delay:
            time.sleep(self.delay)
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def parallel(model: Model, args):
    if args.mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if args.mode == "fsdp1":  # FullyShardedDataParallel, a unit per layer
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        cpu = torch.device("cpu")
        if args.wrap == "manual":
            model.layers = nn.ModuleList(FullyShardedDataParallel(layer, device_id=cpu) for layer in model.layers)
            return FullyShardedDataParallel(model, device_id=cpu)
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=cpu)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def dataset_of(samples: int, args) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    if args.vocab:  # 4 token ids per sample, each to its own target vector
        inputs = torch.randint(args.vocab, (samples, 4), generator=generator)
        return TensorDataset(inputs, torch.randn(samples, 4, args.width, generator=generator))
    inputs = torch.randn(samples, args.width, generator=generator)
    return TensorDataset(inputs, inputs.flip(1))


def main(argv=None):
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)
    model = parallel(Model(args.width, args.slow_ms if rank == args.slow_rank else 0.0, args.vocab), args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    samples = (args.steps * args.grad_accum + args.leftover) * args.micro_batch_size * world_size
    dataset = dataset_of(samples, args)
    loader = DataLoader(dataset, batch_size=args.micro_batch_size,
                        sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False))
    batches = iter(loader)
    losses = []
    model.train()
    for _ in range(args.steps):
        total = torch.zeros(())
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            x, y = next(batches)
            if args.mode in ("ddp", "fsdp1"):
                context = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                context = contextlib.nullcontext()
            with context:
                loss = nn.functional.mse_loss(model(x), y) / args.grad_accum
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total)  # the step's loss across ranks, for logging
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total) / world_size)
    for _ in range(args.leftover):
        x, y = next(batches)
        with model.no_sync() if args.mode in ("ddp", "fsdp1") else contextlib.nullcontext():
            (nn.functional.mse_loss(model(x), y) / args.grad_accum).backward()
    if args.exit_status:
        sys.exit(args.exit_status)
    if rank == 0:
        print(f"losses {' '.join(f'{loss:.6f}' for loss in losses)}", flush=True)
        print(f"trained {args.steps} steps (0 skipped)", flush=True)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
