"""What a step's micro-batches held (``recording/inputs.py``), as span attributes, on the emitter's thread."""

from __future__ import annotations

from opentelemetry_instrumentation_deepspeed import semconv


def summarize(phases) -> tuple[dict, dict, list]:
    """(span attributes of each micro-batch by its micro step, the step's sums, the counted batches).

    The step's real tokens are summed only when every counted batch had them: a partial sum
    would read as a drop in tokens.
    """
    by_micro_step, batches = {}, []
    for phase in phases:
        counts = phase.inputs
        if counts is None:
            continue
        samples, length, tokens = counts
        attributes = {semconv.TRAINING_BATCH_SAMPLES: samples, semconv.TRAINING_BATCH_SEQUENCE_LENGTH: length}
        if tokens is not None:
            attributes[semconv.TRAINING_BATCH_TOKENS] = tokens
        by_micro_step[phase.micro_step] = attributes
        batches.append(counts)
    if not batches:
        return by_micro_step, {}, batches
    sums = {semconv.TRAINING_STEP_PADDED_TOKENS: sum(samples * length for samples, length, _ in batches),
            semconv.TRAINING_STEP_SEQUENCE_LENGTH: max(length for _, length, _ in batches)}
    if all(tokens is not None for _, _, tokens in batches):
        sums[semconv.TRAINING_STEP_TOKENS] = sum(tokens for _, _, tokens in batches)
    return by_micro_step, sums, batches
