"""A Hugging Face ``Trainer`` job with a DeepSpeed config, as a user writes one.

A tiny GPT-2 built from a config (nothing downloaded) learns synthetic token sequences. It knows
nothing about OpenTelemetry: the tests run it under ``opentelemetry-instrument torchrun``. Rank 0
writes what it trained to ``--result``: the logged loss of every optimizer step and a digest of the
final weights, to compare a run with and without instrumentation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import torch
from torch.utils.data import Dataset

SEQ_LEN = 16
VOCAB = 96


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batches", type=int, default=5, help="micro-batches per rank per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-dir", default="trainer-output")
    parser.add_argument("--result", help="rank 0 writes {losses, weights} here")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser.parse_args(argv)


class Sequences(Dataset):
    """Deterministic token sequences with a learnable rule: each token predicts the next."""

    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(7)
        starts = torch.randint(0, VOCAB, (size, 1), generator=generator)
        strides = torch.randint(1, 5, (size, 1), generator=generator)
        self.tokens = (starts + strides * torch.arange(SEQ_LEN).unsqueeze(0)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def deepspeed_config(args) -> dict:
    # No train_batch_size: on CPU, Accelerate counts one process when it checks it against "auto".
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000000,
    }


def tiny_gpt2():
    """A 2-layer GPT-2 built from its config: nothing is downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, parameter in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(argv=None):
    args = parse_args(argv)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__

    if get_accelerator().device_name() == "cpu":
        __compatible_ops__["deepspeed_shm_comm"] = False  # gloo, without a ~40 s JIT build
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(args.seed)  # seeds Python's random, numpy and torch, identically on every rank
    model = tiny_gpt2()
    # On CPU, Accelerate (under the Trainer) finds no device backend and counts one process: every rank
    # reads the whole dataset, and DeepSpeed still averages the gradients of both ranks.
    dataset = Sequences(args.micro_batches * args.micro_batch_size)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.grad_accum, num_train_epochs=args.epochs, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed, deepspeed=deepspeed_config(args),
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=dataset)
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"trained {trainer.state.global_step} steps, losses {losses}", flush=True)
        if args.result:
            pathlib.Path(args.result).write_text(json.dumps({"losses": losses,
                                                             "steps": trainer.state.global_step,
                                                             "weights": weights_digest(trainer.model)}))
    # Gloo's threads outlive a group not destroyed and can abort the exit ("terminate called without an
    # active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
