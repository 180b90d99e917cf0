"""A small trial with no heavy ML dependency: fits y = 3x + 1 by gradient descent.

It uses the nni API; with the `nni` package missing it falls back to trialstream's
dependency-free module, which reads and writes the same files.
"""

import random

try:
    import nni
except ImportError:
    import trialstream_sdk as nni

params = nni.get_next_parameter()
lr, steps, batch = params["lr"], params["steps"], params["batch_size"]
rng = random.Random(nni.get_sequence_id())
data = [(x, 3 * x + 1 + rng.gauss(0, 0.1)) for x in (rng.uniform(-1, 1) for _ in range(256))]

w = b = 0.0
for step in range(1, steps + 1):
    sample = rng.sample(data, batch)
    grad_w = sum(2 * (w * x + b - y) * x for x, y in sample) / batch
    grad_b = sum(2 * (w * x + b - y) for x, y in sample) / batch
    w, b = w - lr * grad_w, b - lr * grad_b
    if step % (steps // 5) == 0:
        loss = sum((w * x + b - y) ** 2 for x, y in data) / len(data)
        nni.report_intermediate_result({"default": -loss, "loss": loss})

loss = sum((w * x + b - y) ** 2 for x, y in data) / len(data)
nni.report_final_result({"default": -loss, "loss": loss, "w": w, "b": b})
