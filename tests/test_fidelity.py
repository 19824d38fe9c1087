"""Whole runs: every opt level trains a small model to where float32 does.

A classifier (an MLP with a LayerNormalization, 288 Adam steps at Keras's
defaults, beta_2=0.999) on every opt level, `master_weights="kahan"`
included, and a small causal language model with an untied `Dense` output
head (192 steps) under O1, each from float32's first seed, must end with a
validation loss inside float32's own seed spread: the band from the lowest to
the highest of three float32 seeds, widened by half its width each side (the
float32 runs and the route share seed 0; what differs is only the
precision). The band is measured in the test, so it holds on any CPU.

The test can fail: O3 bfloat16 without master weights (updates rounding away
in bfloat16) ends far outside the band, and is asserted to (a route the band
would not catch would make the test hollow). The opt levels and losses are
in docs/guide.md, "What each opt level stores and computes, and what it
costs".
"""

import functools

import keras
import numpy as np
import pytest

import kmix

SEEDS = (0, 1, 2)
_RNG = np.random.default_rng(0)
_W1, _W2 = _RNG.normal(size=(16, 32)), _RNG.normal(size=(32,))
_CHAIN = _RNG.dirichlet(np.full(32, 0.3), size=32)  # a Markov chain over 32 tokens


def classification(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    return x, ((np.tanh(x @ _W1 / 4) @ _W2) > 0).astype(np.int32)


def sequences(n, seed, length=24):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, length + 1), np.int32)
    tokens[:, 0] = rng.integers(0, 32, n)
    for t in range(length):
        cumulative = np.cumsum(_CHAIN[tokens[:, t]], axis=1)
        tokens[:, t + 1] = np.minimum((rng.random((n, 1)) < cumulative).argmax(axis=1), 31)
    return tokens[:, :-1], tokens[:, 1:]


def mlp():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="gelu"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(64, activation="gelu"),
                             keras.layers.Dense(2)])


def language_model():
    """Embedding, one causal attention block with an MLP, and an untied Dense head."""
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(32, 32)(tokens)
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(2, 16)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(h))
    logits = keras.layers.Dense(32, name="head")(keras.layers.LayerNormalization()(x))
    return keras.Model(tokens, logits)


TASKS = {
    # build, train data, validation data, epochs, batch size
    "mlp": (mlp, classification(1536, 1), classification(1024, 2), 6, 32),
    "lm": (language_model, sequences(768, 1, length=16), sequences(256, 2, length=16), 8, 32),
}


def _compiled(task, route):
    """`task`'s model, built and compiled for `route` (`(policy, master_weights)`; None: float32).

    Its optimizer is built before `fit`, as Keras builds it under a distribution
    strategy: built in the first trace of the train step instead, a loss
    scale's counters make TensorFlow trace the step twice.
    """
    model = TASKS[task][0]()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if route is None:
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, steps_per_execution=32)
    else:
        policy, master_weights = route
        model = kmix.autocast(model, policy)
        with kmix.policy_scope(policy):
            optimizer = kmix.wrap(keras.optimizers.Adam(1e-3), master_weights=master_weights)
            model.compile(optimizer=optimizer, loss=loss, steps_per_execution=32)
    model.optimizer.build(model.trainable_variables)
    return model


def _train(task, model):
    """Trains `model` on `task`'s data; its validation loss (one call, float32 logits)."""
    _, (x, y), (xv, yv), epochs, batch = TASKS[task]
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=0)
    logits = keras.ops.cast(model(xv, training=False), "float32")
    value = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yv, logits))
    assert np.isfinite(value)
    return value


def final_loss(task, route, seed=0):
    """Validation loss after training `task` on `route` (`(policy, master_weights)`; None: float32)."""
    keras.utils.set_random_seed(seed)
    return _train(task, _compiled(task, route))


@functools.lru_cache(maxsize=None)
def band(task):
    """float32's seed spread, widened by half its width each side.

    One float32 model is compiled (one trace of its train step) and trained
    from each seed's weights in turn, its optimizer's state reset: as a model
    built and compiled afresh under that seed would be (the seed-0 run is
    `final_loss(task, None)`).
    """
    losses, model = [], None
    for seed in SEEDS:
        keras.utils.set_random_seed(seed)
        if model is None:
            model = _compiled(task, None)
            fresh = [variable.numpy() for variable in model.optimizer.variables]
        else:
            model.set_weights(TASKS[task][0]().get_weights())  # draws what a fresh build draws
            for variable, value in zip(model.optimizer.variables, fresh):
                variable.assign(value)
        losses.append(_train(task, model))
    width = max(losses) - min(losses)
    assert width > 0, losses
    return min(losses) - width / 2, max(losses) + width / 2, losses


def O(level, half, master_weights="auto"):
    return kmix.Policy(level, half=half), master_weights


def test_every_opt_level_trains_a_classifier_within_float32s_seed_spread():
    low, high, f32 = band("mlp")
    routes = {
        "O1-bfloat16": O("O1", "bfloat16"),
        "O1-float16": O("O1", "float16"),
        "O2-float16": O("O2", "float16"),
        "O2-bfloat16": O("O2", "bfloat16"),
        "O3-bfloat16-kahan": O("O3", "bfloat16", "kahan"),
        "O3-float16-kahan": O("O3", "float16", "kahan"),
    }
    losses = {name: final_loss("mlp", route) for name, route in routes.items()}
    outside = {name: loss for name, loss in losses.items() if not low <= loss <= high}
    assert not outside, (outside, (low, high), f32)
    # The band catches a route that loses updates: bfloat16 parameters with no master weights.
    broken = final_loss("mlp", O("O3", "bfloat16", False))
    assert not low <= broken <= high, (broken, (low, high))


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_a_language_model_with_an_untied_head_trains_under_o1_within_float32s_seed_spread(half):
    low, high, f32 = band("lm")
    loss = final_loss("lm", O("O1", half))
    assert low <= loss <= high, (loss, (low, high), f32)


if __name__ == "__main__":  # the figures of docs/guide.md: `PYTHONPATH=. python tests/test_fidelity.py`
    rows = {"mlp": {"O0 (float32), seeds 0/1/2": None, "O1-bfloat16": O("O1", "bfloat16"),
                    "O1-float16": O("O1", "float16"), "O2-float16": O("O2", "float16"),
                    "O2-bfloat16": O("O2", "bfloat16"), "O3-bfloat16 + kahan": O("O3", "bfloat16", "kahan"),
                    "O3-float16 + kahan": O("O3", "float16", "kahan"),
                    "O3-bfloat16, no master weights": O("O3", "bfloat16", False),
                    "O3-float16, no master weights": O("O3", "float16", False)},
            "lm": {"O0 (float32), seeds 0/1/2": None, "O1-bfloat16": O("O1", "bfloat16"),
                   "O1-float16": O("O1", "float16")}}
    for task, routes in rows.items():
        print(f"{task}: band {band(task)[:2]}")
        for name, route in routes.items():
            value = band(task)[2] if route is None else final_loss(task, route)
            print(f"  {name:34s} {np.round(value, 4)}", flush=True)
