"""False alarms and detection of the numerics watch's loss spikes on synthetic loss series.

False alarms: 300 healthy 60-step series per noise model (log-normal noise of 0.3 and 0.5 on a flat
or falling loss, the mean of 1 or 4 squared normals as a small batch's regression loss, Gaussian
noise on a falling loss, Student-t (3) noise, AR(1) noise, a loss falling fast); a series raises an
alarm when any step reads as a ``loss_spike``. Detection: one step of a 40-step series multiplied
by 3, 4.5 or 10 at step 9, 12, 20 or 30 (25 series each), in a loss falling fast (5.6 x e^(-t/8)
+ 1.5, noise 0.03) and in a noisy one (log-normal noise 0.3 on a falling loss); found when the
spike, and only it, is reported.

    python benchmarks/spike_noise.py
    PYTHONPATH=<older checkout> python benchmarks/spike_noise.py    # the same series, older code
"""

from __future__ import annotations

import collections
import json
import math
import random

from opentelemetry_instrumentation_deepspeed.diagnose.model import NumericsWatch

HEALTHY = ("lognorm0.5", "lognorm0.3", "chi1", "chi4", "gauss", "t3", "ar", "fastfall")


def series(kind: str, seed: int, steps: int) -> list[float]:
    rng, values, wander = random.Random(seed), [], 0.0
    for step in range(steps):
        falling = 4.0 * math.exp(-step / 30) + 1.0
        if kind == "lognorm0.5":
            value = 0.8 * math.exp(rng.gauss(0, 0.5))
        elif kind == "lognorm0.3":
            value = falling * math.exp(rng.gauss(0, 0.3))
        elif kind == "chi1":
            value = rng.gauss(0, 1) ** 2
        elif kind == "chi4":
            value = sum(rng.gauss(0, 1) ** 2 for _ in range(4)) / 4
        elif kind == "gauss":
            value = falling + rng.gauss(0, 0.08)
        elif kind == "t3":
            scale = math.sqrt(max(1e-9, sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3))
            value = falling * math.exp(0.05 * rng.gauss(0, 1) / scale)
        elif kind == "ar":
            wander = 0.9 * wander + rng.gauss(0, 0.05)
            value = falling * math.exp(wander)
        else:  # fastfall
            value = 5.6 * math.exp(-step / 8) + 1.5 + rng.gauss(0, 0.03)
        values.append(value)
    return values


def spikes(values: list[float]) -> list[int]:
    watch = NumericsWatch()
    return [step for step, value in enumerate(values) for kind, _ in watch.step(value, None, False)
            if kind == "loss_spike"]


def main() -> None:
    alarms = {kind: sum(bool(spikes(series(kind, seed, 60))) for seed in range(300)) for kind in HEALTHY}
    found = collections.Counter()
    for factor in (3.0, 4.5, 10.0):
        for at in (9, 12, 20, 30):
            for seed in range(25):
                for kind, offset in (("fastfall", 1000), ("lognorm0.3", 2000)):
                    values = series(kind, offset + seed, 40)
                    values[at] *= factor
                    found[f"{kind} x{factor:g}"] += spikes(values) == [at]
    print(json.dumps({"false_alarms_of_300": alarms, "false_alarms_total": sum(alarms.values()),
                      "detected_of_100": dict(found)}))


if __name__ == "__main__":
    main()
