"""GPU check (scripts/gpu-check.sh): a batch already on the GPU is not counted, so it is never synchronized."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from opentelemetry_instrumentation_deepspeed.recording import inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_a_batch_on_the_gpu_keeps_its_shape_and_is_never_synchronized(pad_token_id):
    ids = torch.randint(0, 100, (4, 64), device="cuda")
    mask = torch.ones(4, 64, dtype=torch.long, device="cuda")
    recorder = SimpleNamespace(inputs=deque(maxlen=4), pad_token_id=pad_token_id)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises from here on
    try:
        inputs.left_loader(recorder, {"input_ids": ids, "attention_mask": mask})
        inputs.left_loader(recorder, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not inputs._reading.broken
    assert list(recorder.inputs) == [(4, 64, None), (4, 64, None if pad_token_id is not None else 256)]
