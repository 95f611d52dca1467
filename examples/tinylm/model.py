"""A decoder-only transformer LM in plain JAX, and its train step: the workload remesh keeps alive.

Everything the elastic trainer must save and restore is in one plain pytree of arrays,
``{"params", "opt_state", "step"}``; no flax modules, no Python objects hiding state. ``train_step``
is a pure function of ``(state, tokens)``: it takes the mean loss over whatever batch it is given, so
when it is jitted with the batch sharded along a data axis XLA itself inserts the cross-device
gradient mean. The same code thus runs on one device or many, and a re-mesh is only a re-jit
(``sharded_train_step``) with a new mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from examples.tinylm.data import VOCAB_SIZE

__all__ = [
    "Config",
    "TrainState",
    "forward",
    "init_params",
    "init_state",
    "loss_fn",
    "make_optimizer",
    "sharded_train_step",
    "train_step",
]

# {"params": pytree, "opt_state": pytree, "step": int32 scalar}; a dict, so it checkpoints as-is.
TrainState = dict[str, Any]
Params = dict[str, Any]
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and optimizer settings. Frozen and hashable, so it can be a static argument of jit."""

    vocab_size: int = VOCAB_SIZE  # byte tokens
    seq_len: int = 128  # longest input; the position table has this many rows
    # Width and depth: a step on 8 x 128 tokens takes 20-25 ms on an idle 2-core CPU (d_model 128:
    # 55-70 ms; both double under load), and two layers still get well past bigram statistics of the
    # corpus in 300 steps.
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4  # head size 16
    d_mlp: int = 256  # the usual 4 x d_model
    tie_embeddings: bool = True  # reuse the token table as output projection: fewer parameters
    learning_rate: float = 6e-3  # a tiny model tolerates (and needs, to learn in 300 steps) a high lr
    warmup_steps: int = 30  # linear warmup avoids early Adam blow-ups at this lr
    decay_steps: int = 300  # cosine decay to 10% of the peak over this many steps, then constant
    weight_decay: float = 0.01  # light: the run is far too short to overfit
    grad_clip: float = 1.0  # global-norm clipping keeps a rare bad batch from derailing the run

    @classmethod
    def tiny(cls) -> Config:
        """For tests: steps in milliseconds (compiling is most of their time), still a real transformer."""
        return cls(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_mlp=64, warmup_steps=0, decay_steps=100)

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {self.n_layers}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} does not divide by n_heads {self.n_heads}")


@dataclasses.dataclass(frozen=True)
class _Init:
    """How to fill one parameter; a plain (unregistered) dataclass, so it is a leaf of the spec tree."""

    shape: tuple[int, ...]
    std: float = 0.0  # 0: a constant ``fill``, else N(0, std)
    fill: float = 0.0


def init_params(rng: jax.Array, config: Config) -> Params:
    """Float32 parameters, GPT-2 style: N(0, 0.02), residual outputs scaled down by depth."""
    std = 0.02
    # Each block adds two residual branches; scaling them keeps the residual stream's variance
    # from growing with depth at initialisation.
    residual_std = std / math.sqrt(2 * config.n_layers)
    d, m = config.d_model, config.d_mlp
    layer_norm = {"scale": _Init((d,), fill=1.0), "bias": _Init((d,))}
    block = {
        "ln1": layer_norm,
        "attn": {
            # No q/k/v bias: a key bias only adds a per-query constant that softmax ignores, so its
            # gradient is pure rounding noise, which Adam would scale up into lr-sized steps that
            # differ with the device count. Dropping the q and v biases too keeps one plain matmul.
            "w_qkv": _Init((d, 3 * d), std),
            "w_out": _Init((d, d), residual_std),
            "b_out": _Init((d,)),
        },
        "ln2": layer_norm,
        "mlp": {
            "w_in": _Init((d, m), std),
            "b_in": _Init((m,)),
            "w_out": _Init((m, d), residual_std),
            "b_out": _Init((d,)),
        },
    }
    spec: dict[str, Any] = {
        "tok_emb": _Init((config.vocab_size, d), std),
        "pos_emb": _Init((config.seq_len, d), std),
        "blocks": [block] * config.n_layers,
        "ln_f": layer_norm,
    }
    if not config.tie_embeddings:
        spec["w_head"] = _Init((d, config.vocab_size), std)

    # One draw for all the random matrices, sliced in tree order: a single random-number kernel
    # instead of one per matrix keeps the jitted init small and quick to compile.
    inits: list[_Init] = jax.tree.leaves(spec)
    randoms = [i for i in inits if i.std]
    noise = jax.random.normal(rng, (sum(math.prod(i.shape) for i in randoms),), jnp.float32)
    leaves, offset = [], 0
    for i in inits:
        if not i.std:
            leaves.append(jnp.full(i.shape, i.fill, jnp.float32))
            continue
        size = math.prod(i.shape)
        leaves.append(i.std * noise[offset : offset + size].reshape(i.shape))
        offset += size
    params: Params = jax.tree.unflatten(jax.tree.structure(spec), leaves)
    return params


def _layer_norm(x: jax.Array, p: Params) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _attention(x: jax.Array, p: Params, n_heads: int) -> jax.Array:
    batch, time, d = x.shape
    qkv = x @ p["w_qkv"]
    q, k, v = (t.reshape(batch, time, n_heads, d // n_heads) for t in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // n_heads)
    causal = jnp.tril(jnp.ones((time, time), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)  # the diagonal is always allowed, so no row is all -inf
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(batch, time, d) @ p["w_out"] + p["b_out"]


def _mlp(x: jax.Array, p: Params) -> jax.Array:
    return jax.nn.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]


def forward(params: Params, inputs: jax.Array, config: Config) -> jax.Array:
    """Logits of shape ``(batch, time, vocab)`` for int tokens of shape ``(batch, time)``."""
    time = inputs.shape[1]
    if time > config.seq_len:
        raise ValueError(f"input of {time} tokens is longer than seq_len {config.seq_len}")
    x = params["tok_emb"][inputs] + params["pos_emb"][:time]
    for block in params["blocks"]:
        x = x + _attention(_layer_norm(x, block["ln1"]), block["attn"], config.n_heads)
        x = x + _mlp(_layer_norm(x, block["ln2"]), block["mlp"])
    x = _layer_norm(x, params["ln_f"])
    head = params["tok_emb"].T if config.tie_embeddings else params["w_head"]
    return x @ head


def loss_fn(params: Params, tokens: jax.Array, config: Config) -> jax.Array:
    """Mean next-token cross entropy (nats) of a ``(batch, seq_len + 1)`` block of tokens."""
    logits = forward(params, tokens[:, :-1], config)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """AdamW with warmup and cosine decay; its state is a pytree of arrays only (counts and moments)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.decay_steps, config.warmup_steps + 1),
        end_value=0.1 * config.learning_rate,
    )

    def decay_mask(params: Params) -> Any:
        # Decay matrices only: pulling LayerNorm scales and biases towards zero only hurts.
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(schedule, weight_decay=config.weight_decay, mask=decay_mask),
    )


@functools.partial(jax.jit, static_argnames="config")
def init_state(seed: int | jax.Array, config: Config) -> TrainState:
    """The state at step 0; the same seed gives the same parameters bit for bit.

    Jitted because run eagerly every initialiser is dispatched, and compiled, op by op: one
    compilation is several times faster, and ``config`` is hashable, so it is compiled once per config.
    """
    params = init_params(jax.random.key(seed), config)
    return {
        "params": params,
        "opt_state": make_optimizer(config).init(params),
        "step": jnp.zeros((), jnp.int32),
    }


def train_step(state: TrainState, tokens: jax.Array, config: Config) -> tuple[TrainState, Metrics]:
    """One optimizer step on a batch; pure, so jit may shard it and a replay gives the same result.

    There is no dropout and no RNG, so the step depends on nothing but its arguments.
    """
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens, config)
    updates, opt_state = make_optimizer(config).update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    return new_state, {"loss": loss}


def sharded_train_step(
    config: Config, mesh: Mesh, data_axis: str = "data"
) -> Callable[[TrainState, jax.Array | np.ndarray], tuple[TrainState, Metrics]]:
    """``train_step`` jitted for ``mesh``: state replicated, batch rows split along ``data_axis``.

    Pinning the output shardings keeps the state replicated step after step, so it can be fed back
    in (and saved from any one device) without a reshard. Put the first state on the mesh too
    (``jax.device_put(state, NamedSharding(mesh, PartitionSpec()))``): under explicit-axis meshes the
    sharding is part of the argument types, and a state from elsewhere would compile the step twice.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, PartitionSpec(data_axis))

    def step(state: TrainState, tokens: jax.Array) -> tuple[TrainState, Metrics]:
        return train_step(state, tokens, config)

    return jax.jit(step, in_shardings=(replicated, batch), out_shardings=(replicated, replicated))
