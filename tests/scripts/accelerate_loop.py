"""A plain Accelerate training loop with a DeepSpeed plugin, as a user writes one.

The same tiny GPT-2 and data as ``hf_trainer.py``; the loop is Accelerate's documented one
(``accumulate``, ``backward``, an optimizer wrapper whose ``step`` DeepSpeed's engine does). It knows
nothing about OpenTelemetry. Rank 0 writes the loss of every micro-batch and a digest of the final
weights to ``--result``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from hf_trainer import Sequences, tiny_gpt2, weights_digest


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batches", type=int, default=5, help="micro-batches per rank per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--dispatch", action="store_true", help="rank 0 loads and dispatches (DataLoaderDispatcher)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--result", help="rank 0 writes {losses, weights} here")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__

    if get_accelerator().device_name() == "cpu":
        __compatible_ops__["deepspeed_shm_comm"] = False  # gloo, without a ~40 s JIT build
    from accelerate import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin
    from accelerate.utils import set_seed

    set_seed(args.seed)  # Python's random, numpy and torch, identically on every rank
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000000,
    })
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.grad_accum,
                              dataloader_config=DataLoaderConfiguration(dispatch_batches=args.dispatch or None))
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # On CPU, Accelerate finds no device backend and counts one process: every rank reads the whole dataset.
    loader = torch.utils.data.DataLoader(Sequences(args.micro_batches * args.micro_batch_size),
                                         batch_size=args.micro_batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for _epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            random.random()  # a loop that draws from Python's random, as augmentation code does
    engine = model
    if accelerator.is_main_process and engine.global_rank == 0:
        print(f"trained {engine.global_steps} steps, losses {losses}", flush=True)
        if args.result:
            pathlib.Path(args.result).write_text(json.dumps({"losses": losses, "steps": engine.global_steps,
                                                             "weights": weights_digest(engine.module)}))
    accelerator.end_training()
    # On CPU, Accelerate counts one process and leaves DeepSpeed's group alone: gloo's threads then outlive it
    # and can abort the exit ("terminate called without an active exception"), as a CI run's bare loop did.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
