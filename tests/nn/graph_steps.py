"""The training step the captured-step tests run (test_graphs.py in the simulator, test_graphs_gpu.py on a GPU):
the same model trained through kernelgen.nn.CapturedStep and eagerly must end with the same weights."""
import contextlib

import numpy as np

from kernelgen.nn import SGD, Tensor, amp
from kernelgen.nn import functional as F


def train_step(model, opt, scaler, amp_on):
    """One step as bench_step's: zero_grad, forward (fp16 under amp_on), scaled backward, scaler step/update."""
    def step(x, labels):
        opt.zero_grad()
        with amp.autocast("fp16") if amp_on else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return step


def trained(make_model, batches, captured, amp_on=False, warmup=2):
    """make_model() trained on `batches` ((x, labels) host arrays) with SGD + momentum and a GradScaler: through a
    CapturedStep (built on the first batch, which its `warmup` steps train on) or eagerly on the same sequence.
    Returns (state_dict, last loss, the CapturedStep or None)."""
    from kernelgen.nn import CapturedStep, cuda_ops
    model = make_model().to("cuda")
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    scaler = amp.GradScaler(init_scale=2.0 ** 10)
    step = train_step(model, opt, scaler, amp_on)
    dev = [(Tensor(cuda_ops.to_device(x)), cuda_ops.to_device(y)) for x, y in batches]
    if captured:
        runner = CapturedStep(step, *dev[0], warmup=warmup)
        for x, y in dev[1:]:
            loss = runner(x, y)
        runner.synchronize()
    else:
        runner = None
        for x, y in [dev[0]] * warmup + dev[1:]:
            loss = step(x, y)
    return model.state_dict(), float(np.asarray(loss.numpy()).reshape(-1)[0]), runner
