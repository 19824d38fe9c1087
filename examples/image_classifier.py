"""A small convolutional image classifier, built in float32 and converted with `kmix.autocast`.

The images are generated here: 24x24 grey images, each showing one of four
shapes (a horizontal bar, a vertical bar, a square outline, a diagonal) at a
random place, with noise. The model is written in float32, as most existing
code is; `kmix.autocast` places it in place: the convolutions and dense
layers compute in half precision while batch normalization and the softmax
output stay in float32 (Apex O1's placement).

What kmix adds:

    model = kmix.autocast(model, "O1")                  # the same model, placed
    with kmix.policy_scope("O1"):                       # so kmix.wrap picks the loss scaling
        model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(...)), ...)
    model.fit(..., callbacks=[kmix.callbacks.LossScaleWarmup(), kmix.callbacks.LossScaleMonitor()])

Run:

    python examples/image_classifier.py                  # float16: minutes on a CPU
    python examples/image_classifier.py --policy O1-bfloat16
    python examples/image_classifier.py --steps 30 --batch 32   # a smoke test

float16 convolutions have no fast kernels on a CPU: on a 2-core Intel Xeon
with AMX-BF16 (2026-11-28; Keras's average over 60 steps at batch 64) a
float16 step took 0.71 s (the default 300 steps: about 3.5 minutes), a
bfloat16 one 0.046 s, a float32 one 0.035 s. On a GPU float16 is the fast one.

The last line printed is `result: initial_loss=... final_loss=... accuracy=...
skipped_steps=... loss_scale=...`, measured on held-out images.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402

SIZE = 24
CLASSES = 4


def make_images(n, seed):
    """`n` noisy 24x24x1 images of four shapes, and their labels."""
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, 0.3, size=(n, SIZE, SIZE, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=n).astype(np.int32)
    for img, label in zip(images[..., 0], labels):
        k = rng.integers(6, 11)  # the shape's size
        r, c = rng.integers(0, SIZE - k, size=2)
        if label == 0:
            img[r + k // 2, c:c + k] += 1.0
        elif label == 1:
            img[r:r + k, c + k // 2] += 1.0
        elif label == 2:
            img[r, c:c + k] += 1.0
            img[r + k - 1, c:c + k] += 1.0
            img[r:r + k, c] += 1.0
            img[r:r + k, c + k - 1] += 1.0
        else:
            img[r + np.arange(k), c + np.arange(k)] += 1.0
    return images, labels


def build_model():
    """The classifier, in float32, as it would be written without kmix."""
    return keras.Sequential([
        keras.Input((SIZE, SIZE, 1)),
        keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalMaxPooling2D(),
        keras.layers.Dense(CLASSES, activation="softmax", name="probabilities"),
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps; default 300")
    parser.add_argument("--batch", type=int, default=64, help="batch size; default 64")
    parser.add_argument("--policy", default="O1",
                        help="any kmix policy: O1, O2, mixed_float16, mixed_bfloat16, ...; default O1")
    args = parser.parse_args(argv)

    x, y = make_images(args.steps * args.batch, seed=0)
    x_test, y_test = make_images(512, seed=1)
    keras.utils.set_random_seed(0)
    model = build_model()
    model, table = kmix.autocast(model, args.policy, return_table=True)
    print(table)
    with kmix.policy_scope(args.policy) as policy:
        model.compile(
            optimizer=kmix.wrap(keras.optimizers.SGD(0.05, momentum=0.9)),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    callbacks = [kmix.callbacks.LossScaleMonitor()]
    if policy.needs_loss_scaling:
        # Start the scale at 2^7 and double it every 20 steps up to the first overflow.
        callbacks.insert(0, kmix.callbacks.LossScaleWarmup(2**7, growth_interval=20))
    initial_loss, _ = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=2, callbacks=callbacks)
    final_loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    opt = model.optimizer
    print(f"result: initial_loss={initial_loss:.5f} final_loss={final_loss:.5f} accuracy={accuracy:.4f} "
          f"skipped_steps={int(opt.skipped_steps)} loss_scale={float(opt.loss_scale):g}")


if __name__ == "__main__":
    main()
