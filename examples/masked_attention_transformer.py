"""A transformer encoder with padding masks, trained in mixed precision with kmix.

The task: variable-length token sequences, zero-padded to `--seq`; the label
says whether token 1 occurs more often than token 2 in the unpadded part. The
model attends only to real tokens, through `kmix.layers.MultiHeadAttention`
with a boolean `attention_mask` (its softmax is float32, and a padding query,
whose every key is masked, gets zeros instead of NaN), and pools over the real
tokens only.

What kmix adds to a plain Keras model:

    kmix.set_policy(args.policy)                        # "mixed_float16", "O1", ...
    kmix.layers.MultiHeadAttention(...)                 # instead of keras.layers.MultiHeadAttention
    model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(...)), ...)
    model.fit(..., callbacks=[kmix.callbacks.LearningRateWarmup(...), kmix.callbacks.LossScaleMonitor()])

Run:

    python examples/masked_attention_transformer.py                 # under a minute on a CPU
    python examples/masked_attention_transformer.py --steps 20      # a smoke test

The last line printed is `result: initial_loss=... final_loss=... accuracy=...
skipped_steps=... loss_scale=...`, measured on held-out sequences.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402


def make_data(n, seq, vocab, seed):
    """Padded sequences and labels: 1 if token 1 occurs more often than token 2."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, seq), np.int32)
    labels = np.zeros(n, np.int32)
    for i in range(n):
        length = rng.integers(4, seq + 1)
        row = rng.integers(3, vocab, size=length)
        ones, twos = rng.choice(np.arange(0, length // 2), size=2, replace=False)
        positions = rng.permutation(length)
        row[positions[:ones]] = 1
        row[positions[ones:ones + twos]] = 2
        tokens[i, :length] = row
        labels[i] = int(ones > twos)
    return tokens, labels


def build_model(seq, vocab, d_model, heads, layers):
    """An encoder classifier; every attention layer sees the padding mask."""
    tokens = keras.Input((seq,), dtype="int32")
    keep = keras.ops.not_equal(tokens, 0)  # (B, S): True for real tokens
    attention_mask = keep[:, None, :]  # (B, 1, S): every query attends to the real keys
    x = keras.layers.Embedding(vocab, d_model)(tokens)
    for _ in range(layers):
        h = keras.layers.LayerNormalization()(x)
        h = kmix.layers.MultiHeadAttention(heads, d_model // heads)(h, h, attention_mask=attention_mask)
        x = x + h
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(2 * d_model, activation="gelu")(h)
        x = x + keras.layers.Dense(d_model)(h)
    x = keras.layers.LayerNormalization()(x)
    weights = keras.ops.cast(keep, x.dtype)[..., None]
    pooled = keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(keras.ops.sum(weights, axis=1), 1.0)
    # The output layer in float32: the loss is computed on float32 probabilities.
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(pooled)
    return keras.Model(tokens, outputs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps; default 400")
    parser.add_argument("--batch", type=int, default=32, help="batch size; default 32")
    parser.add_argument("--seq", type=int, default=48, help="padded sequence length; default 48")
    parser.add_argument("--policy", default="mixed_float16",
                        help="any kmix policy: mixed_float16, mixed_bfloat16, O1, O2, float32; default mixed_float16")
    parser.add_argument("--jit", action="store_true", help="compile the train step with XLA")
    args = parser.parse_args(argv)

    vocab, d_model, heads, layers = 16, 32, 4, 2
    x, y = make_data(args.steps * args.batch, args.seq, vocab, seed=0)
    x_test, y_test = make_data(512, args.seq, vocab, seed=1)

    keras.utils.set_random_seed(0)
    policy = kmix.set_policy(args.policy)
    print(f"policy: {policy}")
    model = build_model(args.seq, vocab, d_model, heads, layers)
    model.compile(
        # Loss scaling when the policy needs it; the warm-up callback wraps the cosine decay.
        optimizer=kmix.wrap(keras.optimizers.AdamW(keras.optimizers.schedules.CosineDecay(2e-3, args.steps))),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        jit_compile=args.jit,
    )
    initial_loss, _ = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    model.fit(
        x, y, batch_size=args.batch, epochs=1, verbose=2,
        callbacks=[
            kmix.callbacks.LearningRateWarmup(max(1, args.steps // 10)),
            kmix.callbacks.LossScaleMonitor(),  # loss_scale and skipped_steps in the logs
        ],
    )
    final_loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    opt = model.optimizer
    print(f"result: initial_loss={initial_loss:.5f} final_loss={final_loss:.5f} accuracy={accuracy:.4f} "
          f"skipped_steps={int(opt.skipped_steps)} loss_scale={float(opt.loss_scale):g}")


if __name__ == "__main__":
    main()
