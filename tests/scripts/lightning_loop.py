"""PyTorch Lightning on 2 CPU ranks, ``strategy="ddp"``: Lightning launches its second rank itself.

    opentelemetry-instrument python tests/scripts/lightning_loop.py --accumulate 2 --validate-every 4

Each optimizer step's loss as the loop sees it is printed per rank (``step <n> loss <sum of the micro-batches'
loss / accumulation>``), for the test to hold the telemetry against. ``--stall-rank R --stall-every K
--stall-ms D``: rank R's dataset sleeps before every K-th batch.
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

WIDTH, BATCH, CLASSES = 32, 8, 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--validate-every", type=int, default=0, help="batches between validations (0: none)")
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-every", type=int, default=0)
    parser.add_argument("--stall-ms", type=float, default=0.0)
    return parser.parse_args(argv)


class Pairs(Dataset):
    def __init__(self, size: int, stall: tuple[int, float] | None = None):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, WIDTH, generator=generator)
        self.y = torch.randint(0, CLASSES, (size,), generator=generator)
        self.stall, self.calls = stall, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        # The first sample of every K-th batch this rank reads (Lightning's DistributedSampler picks the indices).
        if self.stall is not None and self.calls % (BATCH * self.stall[0]) == BATCH * (self.stall[0] - 1):
            time.sleep(self.stall[1])
        self.calls += 1
        return self.x[index], self.y[index]


class Classifier(L.LightningModule):
    def __init__(self, accumulate: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))
        self.accumulate, self.step_loss = accumulate, 0.0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _index):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        # Lightning divides the loss by the accumulation before its backward, as the telemetry sums it.
        self.step_loss += (loss / self.accumulate).item()
        return loss

    def on_before_optimizer_step(self, _optimizer):
        # One write per line: the two ranks share the pipe.
        print(f"rank {self.global_rank} step {self.global_step + 1} loss {self.step_loss!r}\n", end="", flush=True)
        self.step_loss = 0.0

    def validation_step(self, batch, _index):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(argv=None):
    args = parse_args(argv)
    L.seed_everything(7, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set in the processes Lightning launches
    stall = (args.stall_every, args.stall_ms / 1000) if rank == args.stall_rank and args.stall_every else None
    train = DataLoader(Pairs(args.steps * args.accumulate * BATCH * 2, stall), batch_size=BATCH)
    validation = DataLoader(Pairs(3 * BATCH), batch_size=BATCH) if args.validate_every else None
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        val_check_interval=args.validate_every or None,
                        limit_val_batches=3 if args.validate_every else 0,
                        num_sanity_val_steps=2 if args.validate_every else 0)
    trainer.fit(Classifier(args.accumulate), train, validation)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
