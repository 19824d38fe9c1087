"""A custom training loop with `tf.GradientTape` and a kmix loss-scale optimizer.

Under `mixed_float16` the gradients of a float16 model can underflow to zero;
the loss is multiplied by the loss scale before the backward pass and the
gradients divided by it afterwards. With `model.fit` Keras does both; in your
own loop you do the first and `opt.apply` does the rest:

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))   # float32: the output layer is float32
        scaled_loss = opt.scale_loss(loss)           # loss * loss_scale (tf.keras: get_scaled_loss)
    scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
    opt.apply(scaled_grads, model.trainable_variables)

`opt.apply` takes the *scaled* gradients: it checks them all for inf/NaN,
unscales them in float32, and either applies the step or skips it (no weight,
slot or iteration changes) and halves the scale. TensorFlow's guide loop
(`get_unscaled_gradients`, then `apply_gradients`) trains the same: kmix
knows the gradients `get_unscaled_gradients` returned and does not divide
them twice (docs/guide.md, "Custom training loops and train_step").
Everything is in-graph, so the step compiles with `jit_compile=True`.

The model is a small MLP on a synthetic 10-class problem. `--bad-batch N`
puts a NaN in batch N, to show the step being skipped and counted.

Run:

    python examples/custom_training_loop.py                        # well under a minute on a CPU
    python examples/custom_training_loop.py --steps 30 --bad-batch 5

The last line printed is `result: initial_loss=... final_loss=... accuracy=...
skipped_steps=... loss_scale=...`, measured on held-out data.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmix  # noqa: E402

FEATURES = 32
CLASSES = 10


def make_data(n, seed):
    """Gaussian clusters: one centre per class, in 32 dimensions."""
    centres = np.random.default_rng(123).normal(size=(CLASSES, FEATURES)).astype(np.float32)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n).astype(np.int32)
    x = centres[y] + rng.normal(scale=1.0, size=(n, FEATURES)).astype(np.float32)
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="training steps; default 500")
    parser.add_argument("--batch", type=int, default=64, help="batch size; default 64")
    parser.add_argument("--policy", default="mixed_float16", help="a kmix policy; default mixed_float16")
    parser.add_argument("--bad-batch", type=int, default=None,
                        help="put a NaN into this batch (0-based) to show a skipped step")
    parser.add_argument("--no-jit", action="store_true", help="do not compile the step with XLA")
    args = parser.parse_args(argv)

    kmix.set_policy(args.policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(CLASSES, dtype="float32"),  # float32 logits for a float32 loss
    ])
    opt = kmix.wrap(keras.optimizers.Adam(1e-3))
    opt.build(model.trainable_variables)  # creates the scale and the counters before tracing
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=not args.no_jit)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled_loss = opt.scale_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        opt.apply(scaled_grads, model.trainable_variables)  # unscales; skips the step on inf/NaN
        return loss

    @tf.function(jit_compile=not args.no_jit)
    def evaluate(x, y):
        logits = model(x, training=False)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.float32))
        return loss_fn(y, logits), accuracy

    x, y = make_data(args.steps * args.batch, seed=0)
    x_test, y_test = (tf.constant(a) for a in make_data(1024, seed=1))
    initial_loss = float(evaluate(x_test, y_test)[0])
    for step in range(args.steps):
        xb = x[step * args.batch:(step + 1) * args.batch].copy()
        if step == args.bad_batch:
            xb[0, 0] = np.nan
        loss = train_step(tf.constant(xb), tf.constant(y[step * args.batch:(step + 1) * args.batch]))
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            # Reading values makes the host wait for the device: do it only now and then.
            print(f"step {step:4d}  loss {float(loss):.4f}  loss_scale {float(opt.loss_scale):g}  "
                  f"skipped {int(opt.skipped_steps)}")
    final_loss, accuracy = (float(v) for v in evaluate(x_test, y_test))
    if opt.overflow_report():
        print("overflows per variable:", opt.overflow_report(top=3))
    print(f"result: initial_loss={initial_loss:.5f} final_loss={final_loss:.5f} accuracy={accuracy:.4f} "
          f"skipped_steps={int(opt.skipped_steps)} loss_scale={float(opt.loss_scale):g}")


if __name__ == "__main__":
    main()
