"""A tiny byte-level causal transformer and its corpora, built only from text that ships with Python.

Used by the convergence test and by ``python -m zenflow_triton.demo``: pretrain on standard-library source code
(:func:`load_corpora`'s ``pretrain``), then fine-tune on the English help text in ``pydoc_data.topics``
(``finetune_train`` / ``finetune_val``). Nothing is downloaded, and everything is deterministic for a given
Python installation and seed.

Typical use::

    corpora = load_corpora()
    cfg = CharLMConfig()
    model = make_model(cfg, device="cpu")
    model.load_state_dict(pretrained_state(cfg))          # cached in-process; about 10 s the first time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, corpora.finetune_train, steps=200, batch=8, seed=1)
    evaluate(model, corpora.finetune_val)

The vocabulary is the 256 byte values, so encoding is ``bytes -> uint8`` and needs no fitted tokenizer.
"""

from __future__ import annotations

import copy
import functools
import math
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CharLMConfig",
    "CharLM",
    "Corpora",
    "encode",
    "decode",
    "load_corpora",
    "make_model",
    "batches",
    "train",
    "pretrain",
    "pretrained_state",
    "is_pretrained",
    "evaluate",
    "offloadable_numel",
]

VOCAB_SIZE = 256


@dataclass(frozen=True)
class CharLMConfig:
    """Shape of the byte-level transformer.

    The defaults make every weight matrix (embeddings, attention and MLP projections, head) 2-D with at least
    4096 elements, so ZenFlow offloads all of them at its default ``min_offload_numel``; biases and LayerNorm
    parameters stay resident.
    """

    d_model: int = 64
    """Width of the residual stream."""
    n_layer: int = 2
    """Number of pre-LN transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 64
    """Context length (size of the learned positional embedding)."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Invalid {name}: {value!r} (an int >= 1)")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"Invalid n_head: {self.n_head} does not divide d_model={self.d_model}")


class _Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # [B, T, D] -> [B, H, T, D/H] for per-head attention.
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    """Byte-level causal transformer: token + positional embedding, pre-LN blocks, final LayerNorm, head."""

    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Untied from tok_emb on purpose: a shared parameter would be one offloaded matrix fed by two gradient
        # paths, which hides whether the optimizer treats embeddings and Linear weights alike.
        self.head = nn.Linear(cfg.d_model, VOCAB_SIZE)
        self.apply(self._init)
        # GPT-2 style: scale the residual-branch outputs so the stream's variance does not grow with depth.
        for block in self.blocks:
            for lin in (block.proj, block.fc_out):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, 256]`` for byte ids ``idx`` of shape ``[B, T]`` with ``T <= cfg.seq_len``."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats per byte)."""
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))


def offloadable_numel(model: nn.Module, min_offload_numel: int = 4096) -> tuple[int, int]:
    """(parameters ZenFlow would offload, all parameters) by DESIGN §3's rule: ndim >= 2 and numel >= threshold."""
    total = offloaded = 0
    for p in model.parameters():
        total += p.numel()
        if p.ndim >= 2 and p.numel() >= min_offload_numel:
            offloaded += p.numel()
    return offloaded, total


# ----------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Corpora:
    """Byte tensors (``uint8``, 1-D, CPU) of the three text sets."""

    pretrain: torch.Tensor
    """Standard-library Python source."""
    finetune_train: torch.Tensor
    """pydoc help topics (English prose with some code), the first 90%."""
    finetune_val: torch.Tensor
    """The held-out last 10% of the pydoc topics."""


def encode(text: str | bytes) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``uint8`` tensor (the model's token ids)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    # bytearray: torch.frombuffer wants a writable buffer, and owning a copy detaches us from `data`.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(ids: torch.Tensor) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 (a sample cut mid-character) is replaced, not raised."""
    return bytes(ids.to(torch.uint8).cpu().tolist()).decode("utf-8", errors="replace")


def _stdlib_source(max_bytes: int) -> bytes:
    # Top-level modules only, in sorted order: a fixed, installation-defined selection (site-packages and test
    # suites live in sub-folders and would make the corpus depend on what else is installed). An equal slice of
    # every module rather than whole files from the start of the alphabet: otherwise one module (_pydecimal.py,
    # 229 KB) would be half of the corpus.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no standard-library .py files found under {stdlib}")
    per_file = max_bytes // len(files) + 1
    chunks: list[bytes] = []
    for path in files:
        source = path.read_bytes()
        # From the middle of the module, starting on a line: code, not just the license and import header.
        start = max(0, len(source) // 2 - per_file // 2)
        start = source.rfind(b"\n", 0, start) + 1
        chunks.append(source[start : start + per_file])
    return b"\n".join(chunks)[:max_bytes]


def _pydoc_topics() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


@functools.lru_cache(maxsize=4)
def load_corpora(pretrain_bytes: int = 400_000, val_fraction: float = 0.1) -> Corpora:
    """Load the pretraining (stdlib source) and fine-tuning (pydoc topics) byte corpora; cached per arguments.

    Callers must not modify the returned tensors in place: they are shared through the cache.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"Invalid val_fraction: {val_fraction}")
    pre = encode(_stdlib_source(pretrain_bytes))
    fine = encode(_pydoc_topics())
    cut = int(len(fine) * (1.0 - val_fraction))
    return Corpora(pretrain=pre, finetune_train=fine[:cut], finetune_val=fine[cut:])


def batches(
    data: torch.Tensor,
    batch: int,
    seq: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(x, y)`` pairs of random windows of ``data``: ``x`` is ``[batch, seq]`` int64, ``y`` is ``x``
    shifted by one byte.

    The offsets come from ``generator`` (a CPU ``torch.Generator``), so two iterators built from generators
    seeded alike yield identical batches on any device.
    """
    if len(data) < seq + 2:
        raise ValueError(f"data of {len(data)} bytes is too short for seq={seq}")
    offsets = torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        window = data[starts[:, None] + offsets].long()
        window = window.to(device, non_blocking=True)
        yield window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------------------------------- training


def make_model(cfg: CharLMConfig | None = None, *, seed: int = 0, device: torch.device | str = "cpu") -> CharLM:
    """A freshly initialised :class:`CharLM`, identical for equal ``seed`` (the global RNG is left untouched)."""
    cfg = cfg or CharLMConfig()
    # fork_rng: nn.init draws from the global generator; seeding it here must not leak into the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CharLM(cfg)
    return model.to(device)


def train(
    model: CharLM,
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    *,
    steps: int,
    batch: int = 16,
    seed: int = 0,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
) -> list[float]:
    """Run ``steps`` optimizer steps on random windows of ``data``; return the training loss of each step.

    ``scheduler`` (if any) is stepped after each optimizer step. ``on_step(step, loss, seconds)`` is called after
    each step (1-based step, that step's loss, wall time of the forward, backward and ``optimizer.step()``). Losses
    are read back once at the end, so on CUDA the loop does not
    synchronise every step unless ``on_step`` is given.
    """
    model.train()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    stream = batches(data, batch, model.cfg.seq_len, gen, device)
    losses: list[torch.Tensor] = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = next(stream)
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach())
        if on_step is not None:
            value = loss.item()  # synchronises, so the time below covers the whole step on CUDA too
            on_step(step, value, time.perf_counter() - t0)
    return torch.stack(losses).tolist() if losses else []


def pretrain(
    model: CharLM,
    data: torch.Tensor,
    *,
    steps: int = 800,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float, float], None] | None = None,
) -> list[float]:
    """Pretrain with ``torch.optim.AdamW`` (linear warm-up over 10% of the steps, then cosine decay to 0.1x).

    The defaults are what the ZenFlow-vs-AdamW fine-tuning comparison needs. Measured on this model (fine-tuning
    200 steps, batch 8, lr 1e-3), ZenFlowAdamW's held-out loss over AdamW's after 200 / 400 / 600 / 800 pretraining
    steps: 1.083 / 1.050 / 1.044 / 1.037. A barely pretrained model still has generic byte statistics to learn,
    which the columns ZenFlow updates once per window learn more slowly. Batch 8 rather than 16: 600 steps of batch
    8 reached the held-out loss of 400 steps of batch 16 at two thirds of the cost. 800 steps take about 10 s on one
    CPU core. ``on_step`` is :func:`train`'s progress callback.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, steps // 10)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * (i - warm) / max(1, steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return train(model, opt, data, steps=steps, batch=batch, seed=seed, scheduler=sched, on_step=on_step)


_PRETRAINED_CACHE_SIZE = 4
# (cfg, steps, batch, lr, seed) -> CPU state dict, oldest first. A dict rather than functools.lru_cache: the
# progress callback must not be part of the key.
_pretrained: dict[tuple[CharLMConfig, int, int, float, int], dict[str, torch.Tensor]] = {}
_pretrained_lock = threading.Lock()


def pretrained_state(
    cfg: CharLMConfig | None = None,
    *,
    steps: int = 800,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float, float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """State dict (CPU tensors, a fresh copy) of a model pretrained on standard-library source.

    Pretraining runs on the CPU (about 10 s for the defaults), so the weights are the same whichever device the
    fine-tuning later uses; the result is cached in-process per arguments (the last 4 sets). ``on_step`` is
    :func:`train`'s progress callback; it is called only when pretraining runs, not when the cache answers (see
    :func:`is_pretrained`).
    """
    key = (cfg or CharLMConfig(), steps, batch, lr, seed)
    with _pretrained_lock:
        state = _pretrained.get(key)
        if state is None:
            model = make_model(key[0], seed=seed)
            pretrain(model, load_corpora().pretrain, steps=steps, batch=batch, lr=lr, seed=seed, on_step=on_step)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            while len(_pretrained) >= _PRETRAINED_CACHE_SIZE:
                del _pretrained[next(iter(_pretrained))]
            _pretrained[key] = state
        return copy.deepcopy(state)


def is_pretrained(
    cfg: CharLMConfig | None = None, *, steps: int = 800, batch: int = 8, lr: float = 3e-3, seed: int = 0
) -> bool:
    """Whether :func:`pretrained_state` with these arguments would answer from its in-process cache."""
    return (cfg or CharLMConfig(), steps, batch, lr, seed) in _pretrained


@torch.no_grad()
def evaluate(model: CharLM, data: torch.Tensor, *, batch: int = 32, n_batches: int = 8, seed: int = 1234) -> float:
    """Mean next-byte loss (nats) over ``n_batches`` fixed random windows of ``data`` (same windows every call).

    With ZenFlow, call ``optimizer.flush()`` first: the last window's host update reaches the device one window
    late (DESIGN §2).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    stream = batches(data, batch, model.cfg.seq_len, torch.Generator().manual_seed(seed), device)
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = next(stream)
        total += model.loss(x, y)
    model.train(was_training)
    return total.item() / n_batches
