"""One side of tests/test_resume_process.py, run as a script in a fresh process:

    python resume_process_case.py THREADS MAX_GRAD_NORM MODE OUT

THREADS: torch.set_num_threads before anything else (0: torch's default); MAX_GRAD_NORM: 0 for no clipping. MODE
"straight" trains STEPS steps, saving a checkpoint at RESUME_AT on the way (the run goes on unchanged), and writes
the final weights to OUT; "resume" loads that checkpoint (checkpoint.pt beside OUT) and trains the rest, writing
its weights to OUT."""

from __future__ import annotations

import os
import sys

import torch

THREADS, MAX_GRAD_NORM, MODE, OUT = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
if THREADS:
    torch.set_num_threads(THREADS)  # before the optimizer's import, as people pin it beside a host worker

from zenflow_triton import ZenFlowAdamW  # noqa: E402

DIM = 128  # the feed-forward weights (128 x 512) are above torch's intra-op grain: its thread count shows in sums
STEPS = 20
RESUME_AT = 10  # mid-window (update_interval 4), after the first selection


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(DIM)
        self.att = torch.nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ff = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        return x + self.ff(x)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    clip = {"max_grad_norm": MAX_GRAD_NORM} if MAX_GRAD_NORM else {}
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, topk_ratio=0.25, update_interval=4,
                       grads_in_backward=True, min_offload_numel=1024, **clip)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 5))
    return model, opt, sched


def train(model, opt, sched, steps: range) -> None:
    for t in steps:
        x = torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(t))
        loss = (model(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def main() -> None:
    model, opt, sched = build()
    checkpoint = os.path.join(os.path.dirname(OUT), "checkpoint.pt")
    if MODE == "straight":
        train(model, opt, sched, range(RESUME_AT))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, checkpoint)
        train(model, opt, sched, range(RESUME_AT, STEPS))
    else:
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        train(model, opt, sched, range(RESUME_AT, STEPS))
    opt.flush()
    torch.save([p.detach().clone() for p in model.parameters()], OUT)
    opt.close()


if __name__ == "__main__":
    main()
