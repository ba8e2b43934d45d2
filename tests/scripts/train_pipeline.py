"""A small pipeline-parallel DeepSpeed job (``deepspeed.pipe.PipelineModule``), runnable on CPU.

Run it under ``opentelemetry-instrument`` with the ``deepspeed`` launcher, one rank per stage (times
the data-parallel degree). ``--slow-stage S`` makes the first layer of stage S sleep ``--slow-ms``
in each forward: an imbalanced pipeline whose other stages wait for S.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--slow-stage", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=40.0)
    parser.add_argument("--eval", action="store_true", help="an eval_batch() after training: no step of its own")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class Block(nn.Module):
    def __init__(self, width: int, sleep_ms: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.sleep_ms = sleep_ms

    def forward(self, x):
        if self.sleep_ms:
            import time

            time.sleep(self.sleep_ms / 1000)
        return torch.relu(self.linear(x))


def main(argv=None):
    args = parse_args(argv)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")):
        os.environ.setdefault(name, value)
    torch.manual_seed(3)

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.utils import RepeatingLoader

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo: no 40 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    per_stage = args.layers_per_stage
    layers = [LayerSpec(Block, args.width, args.slow_ms if i == args.slow_stage * per_stage else 0.0)
              for i in range(args.stages * per_stage)]
    model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=nn.MSELoss(), partition_method="uniform")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    world_size = int(os.environ["WORLD_SIZE"])
    data_parallel = world_size // args.stages
    config = {"train_micro_batch_size_per_gpu": args.micro_batch_size,
              "gradient_accumulation_steps": args.micro_batches,
              "train_batch_size": args.micro_batch_size * args.micro_batches * data_parallel,
              "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    generator = torch.Generator().manual_seed(5)
    samples = args.steps * args.micro_batches * args.micro_batch_size
    inputs = torch.randn(samples, args.width, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.flip(1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch_size)
    batches = iter(RepeatingLoader(loader))
    losses = [float(engine.train_batch(data_iter=batches)) for _ in range(args.steps)]
    if args.eval:
        engine.eval_batch(iter(RepeatingLoader(loader)))
    if engine.global_rank == 0:
        print(f"losses {' '.join(f'{loss:.6f}' for loss in losses)}", flush=True)
        print(f"trained {engine.global_steps} steps ({engine.skipped_steps} skipped)", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
