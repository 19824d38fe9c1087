"""Bad input across the public API: a clear error at the call, and nothing changed.

Each row is (id, call, error type, words the message must contain). Every
message must also say what was received or what is accepted. The `state`
fixture snapshots what a failed call could have touched (Keras's global
policy, kmix's active policy, the model's and optimizer's variables) and
checks it is unchanged afterwards.
"""

import os
import tempfile

import numpy as np
import pytest

import keras
import kmix

x16 = np.zeros((2, 4, 4), np.float32)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])


@pytest.fixture
def env():
    """A small model, a built kmix optimizer, and a checker that nothing changed."""
    model = _model()
    opt = kmix.wrap(keras.optimizers.SGD(0.1), hysteresis=2)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)

    def snapshot():
        return (
            keras.config.dtype_policy().name,
            kmix.active_policy(),
            [w.copy() for w in model.get_weights()],
            [np.array(v.numpy()) for v in opt.variables],
            opt.get_config(),
        )

    before = snapshot()
    yield model, opt
    after = snapshot()
    assert after[:2] == before[:2], "a failed call changed the global policy"
    for a, b in zip(before[2] + before[3], after[2] + after[3]):
        np.testing.assert_array_equal(a, b)
    assert after[4] == before[4]


CASES = [
    ("growth_factor<=1", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), growth_factor=1.0), ValueError, ["growth_factor", "> 1"]),
    ("backoff>=1", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), backoff_factor=1.5), ValueError, ["backoff_factor", "(0, 1)"]),
    ("backoff<=0", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), backoff_factor=0.0), ValueError, ["backoff_factor"]),
    ("min>max", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), min_scale=8.0, max_scale=4.0), ValueError, ["min_scale", "max_scale"]),
    ("initial_scale<=0", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=-1), ValueError, ["initial_scale", "> 0"]),
    ("growth_interval=0", lambda m, o: kmix.LossScaleOptimizer(keras.optimizers.SGD(), growth_interval=0), ValueError, ["growth_interval", "int >= 1"]),
    ("growth_interval<0", lambda m, o: kmix.wrap("sgd", growth_interval=-5), ValueError, ["growth_interval"]),
    ("growth_interval float", lambda m, o: kmix.wrap("sgd", growth_interval=2.5), TypeError, ["growth_interval"]),
    ("hysteresis=0", lambda m, o: kmix.wrap("sgd", hysteresis=0), ValueError, ["hysteresis", "int >= 1"]),
    ("accumulation_steps=0", lambda m, o: kmix.wrap("sgd", accumulation_steps=0), ValueError, ["accumulation_steps"]),
    ("inner not keras", lambda m, o: kmix.LossScaleOptimizer(object()), TypeError, ["inner_optimizer", "keras.optimizers.Optimizer"]),
    ("wrap non-optimizer", lambda m, o: kmix.wrap(3.5), TypeError, ["optimizer", "keras.optimizers.Optimizer"]),
    ("wrap unknown name", lambda m, o: kmix.wrap("adamz"), ValueError, ["optimizer='adamz'"]),
    ("wrap conflicting kwargs", lambda m, o: kmix.wrap(o, hysteresis=4), ValueError, ["hysteresis=4"]),
    ("wrap inner accumulation", lambda m, o: kmix.wrap(keras.optimizers.SGD(gradient_accumulation_steps=2)), ValueError, ["gradient_accumulation_steps", "accumulation_steps=2"]),
    ("unknown policy", lambda m, o: kmix.set_policy("O5"), ValueError, ["'O5'", "Accepted"]),
    ("policy string missing key", lambda m, o: kmix.Policy("params=float32,compute=float16"), ValueError, ["output", "Accepted"]),
    ("policy not a string", lambda m, o: kmix.Policy(16), TypeError, ["spec"]),
    ("policy_scope unknown", lambda m, o: kmix.policy_scope("mixed_float17").__enter__(), ValueError, ["mixed_float17"]),
    ("mask wrong shape", lambda m, o: kmix.ops.masked_softmax(x16, mask=np.ones((2, 5), bool)), ValueError, ["mask.shape=(2, 5)", "broadcastable to (2, 4, 4)"]),
    ("mask wrong dtype", lambda m, o: kmix.ops.masked_softmax(x16, mask=np.array([["a"] * 4] * 4)), TypeError, ["mask"]),
    ("mask is a -1e9 bias", lambda m, o: kmix.ops.masked_softmax(x16, mask=np.where(np.eye(4, dtype=bool), 0.0, -1e9)), ValueError, ["mask", "outside [0, 1]", "additive bias", "bias="]),
    ("mask is a -inf bias", lambda m, o: kmix.ops.masked_log_softmax(x16, mask=np.where(np.eye(4, dtype=bool), 0.0, -np.inf)), ValueError, ["mask", "min=-inf", "bias="]),
    ("MaskedSoftmax mask is a bias", lambda m, o: kmix.layers.MaskedSoftmax()(x16, mask=np.full((4,), -1e4, np.float16)), ValueError, ["mask", "bias="]),
    ("Softmax mask is a bias", lambda m, o: kmix.layers.Softmax()(x16, mask=np.full((4,), -1e9)), ValueError, ["mask", "kmix.layers.MaskedSoftmax"]),
    ("MHA attention_mask is a bias", lambda m, o: kmix.layers.MultiHeadAttention(2, 2)(x16, x16, attention_mask=np.where(np.eye(4, dtype=bool), 0.0, -1e9)[None]), ValueError, ["attention_mask", "attention_bias="]),
    ("Softmax layer mask shape", lambda m, o: kmix.layers.Softmax()(x16, mask=np.ones((3, 4), bool)), ValueError, ["mask"]),
    ("autocast unbuilt", lambda m, o: kmix.autocast(Subclassed()), ValueError, ["not built", "model.build"]),
    ("autocast bad policy", lambda m, o: kmix.autocast(m, policy="O9"), ValueError, ["'O9'"]),
    ("WithPolicy non-layer", lambda m, o: kmix.layers.WithPolicy("dense", "float32"), TypeError, ["layer"]),
    ("memory_report batch 0", lambda m, o: kmix.memory_report(m, "O1", "adam", batch_size=0), ValueError, ["batch_size"]),
    ("Warmup negative steps", lambda m, o: kmix.schedules.Warmup(1e-3, -1), ValueError, ["warmup_steps"]),
    ("Warmup shape", lambda m, o: kmix.schedules.Warmup(1e-3, 10, shape="square"), ValueError, ["shape", "square"]),
    ("LossScaleMonitor mode", lambda m, o: kmix.callbacks.LossScaleMonitor(on_min_scale="explode"), ValueError, ["on_min_scale", "explode"]),
    ("NaNGuard lr_factor", lambda m, o: kmix.callbacks.NaNGuard(lr_factor=2.0), ValueError, ["lr_factor"]),
    ("LossScaleWarmup interval", lambda m, o: kmix.callbacks.LossScaleWarmup(growth_interval=0), ValueError, ["growth_interval"]),
    # Issue 39 item 7: each of wrap's numeric arguments, under a policy without float16 compute too.
    ("wrap initial_scale str", lambda m, o: kmix.wrap("sgd", initial_scale="big"), TypeError, ["initial_scale='big'", "real number"]),
    ("wrap initial_scale str dynamic", lambda m, o: kmix.wrap("sgd", dynamic=True, initial_scale="big"), TypeError, ["initial_scale='big'"]),
    ("wrap initial_scale fixed list", lambda m, o: kmix.wrap("sgd", dynamic=False, initial_scale=[2.0]), TypeError, ["initial_scale=[2.0]"]),
    ("wrap initial_scale nan", lambda m, o: kmix.wrap("sgd", initial_scale=float("nan")), ValueError, ["initial_scale", "finite"]),
    ("wrap min_scale str", lambda m, o: kmix.wrap("sgd", min_scale="1"), TypeError, ["min_scale='1'"]),
    ("wrap max_scale str", lambda m, o: kmix.wrap("sgd", max_scale="x"), TypeError, ["max_scale='x'"]),
    ("wrap growth_factor None", lambda m, o: kmix.wrap("sgd", growth_factor=None), TypeError, ["growth_factor=None"]),
    ("wrap backoff_factor str", lambda m, o: kmix.wrap("sgd", backoff_factor="0.5"), TypeError, ["backoff_factor='0.5'"]),
    ("wrap hysteresis str", lambda m, o: kmix.wrap("sgd", hysteresis="2"), TypeError, ["hysteresis='2'"]),
    ("wrap accumulation_steps float", lambda m, o: kmix.wrap("sgd", accumulation_steps=2.0), TypeError, ["accumulation_steps=2.0"]),
    ("wrap dynamic_growth_steps 0", lambda m, o: kmix.wrap("sgd", dynamic_growth_steps=0), ValueError, ["dynamic_growth_steps=0"]),
    ("wrap dynamic str", lambda m, o: kmix.wrap("sgd", dynamic="yes"), TypeError, ["dynamic='yes'"]),
    ("wrap unknown keyword", lambda m, o: kmix.wrap("sgd", initial_scael=8.0), TypeError, ["initial_scael=8.0", "initial_scale"]),
    ("policy params half compute float32", lambda m, o: kmix.Policy("params=float16,compute=float32,output=float32"), ValueError, ["params=float32, or compute=float16"]),
    ("policy_scope params half compute float32", lambda m, o: kmix.policy_scope("p=bf16,c=f32,o=f32").__enter__(), ValueError, ["params=float32, or compute=bfloat16"]),
    ("policy params bf16 compute f16", lambda m, o: kmix.Policy("p=bf16,c=f16,o=f32"), ValueError, ["params=float32, or params=float16"]),
    ("memory_report policy int", lambda m, o: kmix.memory_report(m, 16), TypeError, ["policy=16"]),
    ("memory_report verbose str", lambda m, o: kmix.memory_report(m, "O1", verbose="yes"), TypeError, ["verbose='yes'"]),
    ("LearningRateWarmup steps str", lambda m, o: kmix.callbacks.LearningRateWarmup("10"), TypeError, ["warmup_steps='10'"]),
    ("LossScaleMonitor log_every 0", lambda m, o: kmix.callbacks.LossScaleMonitor(log_every=0), ValueError, ["log_every=0"]),
    ("LossScaleWarmup initial_scale str", lambda m, o: kmix.callbacks.LossScaleWarmup(initial_scale="big"), TypeError, ["initial_scale='big'"]),
    ("NaNGuard max_rollbacks -1", lambda m, o: kmix.callbacks.NaNGuard(max_rollbacks=-1), ValueError, ["max_rollbacks=-1"]),
    ("Softmax output_dtype int8", lambda m, o: kmix.layers.Softmax(output_dtype="int8"), ValueError, ["output_dtype='int8'"]),
    ("masked_softmax axis out of range", lambda m, o: kmix.ops.masked_softmax(x16, axis=5), ValueError, ["axis=5"]),
    ("MHA bias int", lambda m, o: kmix.layers.MultiHeadAttention(2, 2)(x16, x16, attention_bias=np.zeros((2, 4, 4), np.int32)), TypeError, ["attention_bias.dtype=int32"]),
    ("Remat non-layer", lambda m, o: kmix.layers.Remat(3), TypeError, ["layer=3"]),
    ("WithPolicy policy None", lambda m, o: kmix.layers.WithPolicy(keras.layers.Dense(2), None), TypeError, ["policy=None"]),
    ("Policy half on a Keras name", lambda m, o: kmix.Policy("mixed_float16", half="bfloat16"), ValueError, ["half='bfloat16'"]),
    ("overflow_report top -1", lambda m, o: o.overflow_report(top=-1), ValueError, ["top=-1"]),
    ("overflow_report top str", lambda m, o: o.overflow_report(top="3"), TypeError, ["top='3'"]),
    ("diagnose bfloat16_available str", lambda m, o: kmix.diagnose(m, np.ones((4, 3)), np.ones((4, 1)), bfloat16_available="yes"), TypeError, ["bfloat16_available='yes'"]),
    ("masked_softmax logits str", lambda m, o: kmix.ops.masked_softmax(np.array(["a", "b"])), TypeError, ["logits.dtype=string"]),
    ("masked_softmax logits scalar", lambda m, o: kmix.ops.masked_softmax(3.0), ValueError, ["logits.shape=()"]),
    ("policy lower case", lambda m, o: kmix.Policy("o1"), ValueError, ["spec='o1'", "Did you mean 'O1'?"]),
    ("policy Keras name upper case", lambda m, o: kmix.policy_scope("MIXED_FLOAT16").__enter__(), ValueError, ["Did you mean 'mixed_float16'?"]),
    ("policy name with a bad half", lambda m, o: kmix.Policy("O1-float32"), ValueError, ["spec='O1-float32'", "'O1-bfloat16'"]),
    ("WithPolicy names policy", lambda m, o: kmix.layers.WithPolicy(keras.layers.Dense(2), 16), TypeError, ["`policy` must be", "policy=16"]),
    ("WithPolicy unknown policy", lambda m, o: kmix.layers.WithPolicy(keras.layers.Dense(2), "O9"), ValueError, ["policy='O9'"]),
    ("memory_report unknown policy", lambda m, o: kmix.memory_report(m, ["O1", "O8"]), ValueError, ["policy='O8'"]),
    ("diagnose unknown policy", lambda m, o: kmix.diagnose(m, np.ones((4, 3)), np.ones((4, 1)), policy="o1"), ValueError, ["policy='o1'", "Did you mean 'O1'?"]),
    ("Softmax autocast str", lambda m, o: kmix.layers.Softmax(autocast="no"), TypeError, ["autocast='no'"]),
    ("memory_report slot count nan", lambda m, o: kmix.memory_report(m, "O1", optimizer=float("nan")), ValueError, ["optimizer=nan"]),
    ("Scaled factor str", lambda m, o: kmix.schedules.Scaled(keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9), "x"), TypeError, ["factor='x'"]),
    # Issue 48 item 7: refused at the call, not inside `fit` or as a conversion error.
    ("wrap growth_interval beyond int64", lambda m, o: kmix.wrap("sgd", growth_interval=10**20), ValueError, ["growth_interval=100000000000000000000", "2**63 - 1"]),
    ("wrap dynamic_growth_steps beyond int64", lambda m, o: kmix.wrap("sgd", dynamic_growth_steps=2**63), ValueError, ["dynamic_growth_steps=9223372036854775808", "int64"]),
    ("wrap hysteresis beyond int64", lambda m, o: kmix.wrap("sgd", hysteresis=10**20), ValueError, ["hysteresis=100000000000000000000"]),
    ("wrap accumulation_steps beyond int64", lambda m, o: kmix.wrap("sgd", accumulation_steps=10**20), ValueError, ["accumulation_steps=100000000000000000000"]),
    ("wrap fixed initial_scale above max_scale", lambda m, o: kmix.wrap("sgd", initial_scale=2.0**30), ValueError, ["initial_scale=1073741824.0", "max_scale=16777216.0"]),
    ("memory_report nan", lambda m, o: kmix.memory_report(float("nan")), ValueError, ["`model`", "model=nan", "finite"]),
    ("memory_report inf", lambda m, o: kmix.memory_report(float("inf")), ValueError, ["`model`", "model=inf"]),
    ("memory_report bytes overflow", lambda m, o: kmix.memory_report(1e308), ValueError, ["model=1e+308"]),
    ("export bool sample", lambda m, o: kmix.export(m, os.path.join(tempfile.mkdtemp(), "a"), sample=np.ones((2, 3), bool), verbose=False), ValueError, ["`sample` must hold real numbers", "sample of dtype bool"]),
    ("export overwrite str", lambda m, o: kmix.export(m, os.path.join(tempfile.mkdtemp(), "a"), overwrite="yes"), TypeError, ["overwrite='yes'"]),
]


@pytest.mark.parametrize("call, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(env, call, error, words):
    model, opt = env
    with pytest.raises(error) as info:
        call(model, opt)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert any(w in message for w in ("Received", "received", "Accepted", "accepted", "expected")), message


def _fit_bad_data(value, callback):
    model = _model()
    opt = kmix.wrap(keras.optimizers.SGD(0.1))  # float32 policy: scale fixed at 1 == min_scale
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
    before = [w.copy() for w in model.get_weights()]
    x = np.full((16, 3), value, np.float32)
    with pytest.raises(FloatingPointError) as info:
        model.fit(x, np.zeros((16, 1), np.float32), batch_size=4, verbose=0, callbacks=[callback])
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # every step was skipped: weights untouched
    assert int(opt.skipped_steps) >= 1 and int(opt.iterations) == 0
    return str(info.value)


def test_nan_in_input_data_stops_naming_the_step():
    message = _fit_bad_data(np.nan, kmix.callbacks.NaNGuard(max_rollbacks=1, snapshot_every=1))
    assert "step" in message


def test_inf_in_input_data_at_min_scale_raises_naming_step_and_scale():
    message = _fit_bad_data(np.inf, kmix.callbacks.LossScaleMonitor(on_min_scale="raise"))
    assert "step" in message and "scale" in message


def _compiled_float32_model():
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("where", ["x", "y", "dataset"])
def test_diagnose_refuses_nan_data_naming_it(where):
    """Issue 39 item 7: NaN data is named at the call, not reported as 'non-finite' and 'Nothing alarming'."""
    model = _compiled_float32_model()
    x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)
    (y if where == "y" else x)[3, 0] = np.nan
    before = [w.copy() for w in model.get_weights()]
    args = ((__import__("tensorflow").data.Dataset.from_tensor_slices((x, y)).batch(4),) if where == "dataset"
            else (x, y))
    name = "y" if where == "y" else "x"
    with pytest.raises(ValueError) as info:
        kmix.diagnose(model, *args, policy="mixed_float16", batches=2, batch_size=4)
    message = str(info.value)
    assert message.startswith(f"`{name}` holds NaN: 1 of the ") and "Accepted" in message, message
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_diagnose_with_a_nonfinite_float32_loss_gives_one_verdict():
    """A loss that is non-finite in float32 (here: inf targets) never ends in 'Nothing alarming'."""
    model = _compiled_float32_model()
    x, y = np.ones((8, 3), np.float32), np.full((8, 1), np.inf, np.float32)
    d = kmix.diagnose(model, x, y, policy="mixed_float16", batches=2, batch_size=4)
    reference = np.mean((model.predict(x[:4], verbose=0) - y[:4]) ** 2)  # the float32 loss, by hand
    assert not np.isfinite(reference)
    text = "\n".join(d.findings)
    assert "non-finite in float32 already" in text, text
    assert "Nothing alarming" not in text, text


def test_overflow_report_before_build_says_how_to_build():
    with pytest.raises(ValueError, match=r"is not built yet.*optimizer\.build\(model\.trainable_variables\)"):
        kmix.wrap("adam").overflow_report()


def test_autocast_names_policy_and_float32_layers():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    with pytest.raises((TypeError, ValueError), match=r"`policy`.*Received: policy=16"):
        kmix.autocast(model, 16)
    with pytest.raises(TypeError, match=r"`float32_layers` must be a list .*Received: float32_layers=3 \(of type int\)"):
        kmix.autocast(model, "O1", float32_layers=3)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_an_initial_scale_above_max_scale_is_refused_under_every_policy(policy):
    """One answer whatever the policy: before, a fixed scale above the cap was taken outside float16 and
    became a dynamic scale above `max_scale` once a float16 model built the optimizer."""
    with kmix.policy_scope(policy):
        for dynamic in ({}, {"dynamic": True}, {"dynamic": False}):
            with pytest.raises(ValueError, match=r"`initial_scale` must .*max_scale.*Received: initial_scale=1073741824"):
                kmix.wrap("sgd", initial_scale=2.0**30, **dynamic)
        opt = kmix.wrap("sgd", initial_scale=2.0**30, max_scale=2.0**31)
    with kmix.policy_scope("mixed_float16"):
        model = _model()
    opt.build(model.trainable_variables)  # float16 layers: a fixed scale from the policy becomes dynamic
    assert float(opt.dynamic_scale) == 2.0**30 <= opt.max_scale == 2.0**31


def test_the_largest_counts_train_as_plain_sgd():
    """Counts up to 2**63 - 1 are taken and train: one step equals Keras's SGD step on the same model."""
    x, y = np.random.default_rng(0).normal(size=(8, 3)).astype("float32"), np.ones((8, 1), "float32")
    reference = _model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.train_on_batch(x, y)
    model = _model()
    opt = kmix.wrap(keras.optimizers.SGD(0.1), growth_interval=2**63 - 1, hysteresis=2**63 - 1)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(x, y)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(opt.current_growth_interval) == 2**63 - 1
