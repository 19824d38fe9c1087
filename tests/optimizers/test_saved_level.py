"""A weights file or checkpoint read at another opt level: every value converted, or a ValueError naming both levels.

The reference is the saved model's values cast with numpy (ml_dtypes for
bfloat16) to the dtype each variable has at the level that reads them.
"""

import shutil
import warnings

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.optimizers import saved_level
from kmix.optimizers.saved_level import RECORD_NAME, Layout
from kmix import _state

# name: (policy for kmix.autocast, or None for a float32 model kmix does not place; master_weights)
LEVELS = {
    "float32": (None, "auto"),
    "O1": ("O1", "auto"),
    "O1-bfloat16": (kmix.Policy("O1", half="bfloat16"), "auto"),
    "O2": ("O2", "auto"),
    "O2-bfloat16": (kmix.Policy("O2", half="bfloat16"), "auto"),
    "O2-kahan": ("O2", "kahan"),
    "O3": ("O3", "auto"),
}
AUX = {"float32": "none", "O1": "none", "O1-bfloat16": "none", "O2": "masters", "O2-bfloat16": "masters",
       "O2-kahan": "kahan", "O3": "none"}
NAMES = {"float32": "float32 or O1", "O1": "O1-float16", "O1-bfloat16": "O1-bfloat16", "O2": "O2-float16",
         "O2-bfloat16": "O2-bfloat16", "O2-kahan": "O2-float16", "O3": "O3-float16"}  # kmix.Policy(...).name; "float32 or O1" for a model autocast did not place
# Whether the run scales its loss (float16 compute): a scale carries over only between runs that agree.
SCALED = {"float32": False, "O1": True, "O1-bfloat16": False, "O2": True, "O2-bfloat16": False, "O2-kahan": True,
          "O3": True}
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int64": np.int64}
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 6)).astype(np.float32)
Y = RNG.normal(size=(32, 1)).astype(np.float32)


def make(level, seed=0, trained=True, build=True, eagerly=False):
    """Dense + BatchNormalization + Dense at `level`, compiled with kmix.wrap(Adam); trained one epoch, or built."""
    policy, master_weights = LEVELS[level]
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="dense"),
                              keras.layers.BatchNormalization(name="norm"), keras.layers.Dense(1, name="head")])
    if policy is not None:
        model = kmix.autocast(model, policy)
    with kmix.policy_scope(policy or "float32"):
        model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2), master_weights=master_weights,
                                          growth_interval=2), loss="mse", run_eagerly=eagerly)
    if build or trained:  # before fit: built inside its first trace, the step is traced twice
        model.optimizer.build(model.trainable_variables)
    if trained:
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def aux_variables(optimizer):
    return list(optimizer._weights.copies.values()) + list(optimizer._weights.remainders.values())


def scale_state(optimizer):
    """The loss scale's trajectory: scale, good steps, hysteresis left, growth interval."""
    return [optimizer.dynamic_scale, optimizer.good_steps, optimizer.hysteresis_left,
            optimizer.current_growth_interval]


def state(model):
    """Every model and optimizer variable's value."""
    return values(list(model.weights) + list(model.optimizer.variables))


def trained_eagerly(level):
    """`make(level)` trained eagerly: what is read back is the values, and no step is traced (3 s a level).

    A step skipped eagerly keeps its batch statistics, which kmix warns of: any values do here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LossScaleOptimizer .* skipped a step run eagerly")
        return make(level, eagerly=True)


class Saved:
    """A model trained one epoch at a level, saved once both ways, and the values it held (numpy)."""

    def __init__(self, level, folder):
        model = trained_eagerly(level)
        opt = model.optimizer
        self.weights_file = folder / "model.weights.h5"
        model.save_weights(self.weights_file)
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=opt).write(str(folder / "ckpt"))
        aux = {id(v) for v in aux_variables(opt)}
        self.weights = values(model.weights)
        self.weight_dtypes = [v.dtype for v in model.weights]
        self.inner = values(opt.inner_optimizer.variables)
        self.own = values([v for v in opt._variables if id(v) not in aux])  # scale, counters
        self.masters = values(opt._weights.copies.values())
        self.state = state(model)
        self.layout = opt._saved.layout.describe()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(level)`: each level's source model trained and saved once for the whole module (read-only)."""
    cache = {}

    def get(level):
        if level not in cache:
            cache[level] = Saved(level, tmp_path_factory.mktemp(level))
        return cache[level]

    return get


def assert_bitwise(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def cast(value, variable):
    """The numpy reference: `value` rounded to `variable`'s dtype (round to nearest even)."""
    return np.asarray(value).astype(NP_DTYPES[keras.backend.standardize_dtype(variable.dtype)])


def assert_cast(variables, saved):
    assert len(variables) == len(saved)
    for variable, value in zip(variables, saved):
        got = np.array(keras.ops.convert_to_numpy(variable))
        expected = cast(value, variable)
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), variable.path


# ---------------------------------------------------------------- .weights.h5: converted
CONVERTED = [("float32", "O2"), ("O1", "O2"), ("O2", "float32"), ("O2", "O1"), ("float32", "O2-kahan"),
             ("O2-kahan", "O1"), ("O2", "O2-bfloat16"), ("O2", "O3"), ("O3", "O2"), ("O1", "float32"),
             ("O1-bfloat16", "O2-bfloat16")]


@pytest.mark.parametrize("saved_at,read_at", CONVERTED, ids=[f"{a}-to-{b}" for a, b in CONVERTED])
def test_weights_file_converts_every_value(saved_at, read_at, saved):
    source = saved(saved_at)
    path, weights, inner, own, saved_masters = (source.weights_file, source.weights, source.inner, source.own,
                                                source.masters)
    target = make(read_at, seed=1, trained=False, eagerly=True)  # its step below: none traced
    opt = target.optimizer
    aux = {id(v) for v in aux_variables(opt)}
    own_here = [v for v in opt._variables if id(v) not in aux]
    if SCALED[saved_at] != SCALED[read_at]:  # a scale of the other kind: this optimizer keeps its own
        kept = {id(v) for v in scale_state(opt)}
        own = [value if id(v) not in kept else np.array(v.numpy()) for v, value in zip(own_here, own)]
    target.load_weights(path)
    assert_cast(target.weights, weights)  # every weight, in this level's dtype
    assert_cast(opt.inner_optimizer.variables, inner)  # slots, iterations: by position, cast
    assert_cast(own_here, own)  # scale, counters
    half_weights = [v for v in target.trainable_variables if keras.backend.standardize_dtype(v.dtype) != "float32"]
    if AUX[read_at] == "masters" and AUX[saved_at] == "masters":
        assert_cast(opt._weights.copies.values(), saved_masters)  # the saved copies: the low bits kept
    elif AUX[read_at] == "masters":  # made from the loaded weights, as autocast makes them
        expected = [np.array(keras.ops.convert_to_numpy(v)).astype(np.float32) for v in half_weights]
        assert_cast(opt._weights.copies.values(), expected)
    elif AUX[read_at] == "kahan":  # no remainder is known: zero, as a freshly placed model starts
        assert_cast(opt._weights.remainders.values(), [np.zeros(v.shape) for v in half_weights])
    # Training goes on from there (a step, eagerly).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LossScaleOptimizer .* skipped a step run eagerly")
        history = target.fit(X[:8], Y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize("saved_at,read_at", [("O2", "O2-kahan"), ("O2-kahan", "O2")])
def test_weights_file_refuses_master_copies_for_kahan_remainders(saved_at, read_at, saved):
    source = saved(saved_at)
    path = source.weights_file
    target = make(read_at, seed=1, trained=False)
    before = values(target.optimizer.variables)
    with pytest.raises(ValueError) as raised:
        target.load_weights(path)
    message = str(raised.value)
    assert "float32 master copies" in message and "Kahan remainders" in message
    assert message.count("O2-float16") >= 2  # both levels named
    assert_bitwise(values(target.optimizer.variables), before)  # nothing of the optimizer assigned
    # The documented way out: the weights alone (the same dtypes here: bit for bit), with a warning.
    with pytest.warns(UserWarning):
        target.load_weights(path, skip_mismatch=True)
    assert_bitwise(values(target.weights), source.weights)
    assert_bitwise(values(target.optimizer.variables), before)


def test_weights_file_without_a_layout_loads_only_where_every_value_fits(saved, tmp_path):
    """Files from before kmix recorded layouts: same level by position as Keras; another level refused."""
    source = saved("O2")
    path = tmp_path / "old.weights.h5"
    shutil.copyfile(source.weights_file, path)
    with h5py.File(path, "a") as f:
        groups = [name for name in _all_groups(f) if RECORD_NAME in f[name]]
        assert len(groups) == 1
        del f[groups[0]][RECORD_NAME]
    same = make("O2", seed=1, trained=False)
    same.load_weights(path)
    assert_bitwise(state(same), source.state)
    kahan = make("O2-kahan", seed=1, trained=False)
    before = values(kahan.optimizer.variables)
    with pytest.raises(ValueError, match="does not record the opt level"):
        kahan.load_weights(path)
    assert_bitwise(values(kahan.optimizer.variables), before)


def _all_groups(f):
    names = []
    f.visit(lambda name: names.append(name) if isinstance(f[name], h5py.Group) else None)
    return names


# ---------------------------------------------------------------- tf.train.Checkpoint: refused or as it is
REFUSED = [("float32", "O2"), ("O1", "O2"), ("O2", "O1"), ("O2", "float32"), ("O2", "O2-kahan"),
           ("O2-kahan", "O2"), ("O2", "O2-bfloat16"), ("O1", "O2-kahan"), ("float32", "O1"), ("O1", "float32")]


@pytest.mark.parametrize("saved_at,read_at", REFUSED, ids=[f"{a}-to-{b}" for a, b in REFUSED])
def test_checkpoint_at_another_layout_raises_before_restoring(saved_at, read_at, saved):
    source = saved(saved_at)
    path = source.checkpoint
    target = make(read_at, seed=1, trained=False)
    before = state(target)
    with pytest.raises(ValueError) as raised:
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(path)
    message = str(raised.value)
    # The first record matched raises: the model's where the weights differ in dtype, else the optimizer's.
    owner = "model" if "this model is at" in message else "optimizer"
    assert f"at {NAMES[saved_at]} (" in message and f"this {owner} is at {NAMES[read_at]} (" in message
    if owner == "optimizer":
        assert f"written at {source.layout}" in message
        assert f"optimizer is at {target.optimizer._saved.layout.describe()}" in message
    else:
        assert LEVELS[read_at][0] is not None  # only a model autocast placed carries the model's record
        assert source.weight_dtypes != [v.dtype for v in target.weights]
    assert "Nothing was restored" in message
    assert_bitwise(state(target), before)  # not one value read: no partial restore by position


UNBUILT = [("O1", "O2"), ("O2", "O1"), ("O1-bfloat16", "O2-bfloat16"), ("O2", "O2-bfloat16"), ("O3", "O1")]


@pytest.mark.parametrize("saved_at,read_at", UNBUILT, ids=[f"{a}-to-{b}" for a, b in UNBUILT])
def test_checkpoint_of_other_weight_dtypes_raises_before_the_optimizer_is_built(saved_at, read_at, saved):
    """The model's own record names both levels: the optimizer's waits for build, TensorFlow's error names none."""
    path = saved(saved_at).checkpoint
    target = make(read_at, seed=1, trained=False, build=False)
    before = values(target.weights)
    with pytest.raises(ValueError, match="Nothing was restored") as raised:
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(path)
    message = str(raised.value)
    assert f"written from a model at {NAMES[saved_at]} (" in message and f"this model is at {NAMES[read_at]} (" in message
    assert_bitwise(values(target.weights), before)
    assert not target.optimizer.built


def test_checkpoint_from_before_the_record_restores_as_before(tmp_path, monkeypatch):
    """A checkpoint written without the record (older kmix): unchecked, restored bit for bit at its level."""
    with monkeypatch.context() as patch:
        patch.setattr(saved_level._compat, "attach_record", lambda owner, name, record: None)
        source = trained_eagerly("O2")
        path = tf.train.Checkpoint(model=source, optimizer=source.optimizer).write(str(tmp_path / "ckpt"))
    target = make("O2", seed=1, trained=False)
    tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(path).expect_partial()
    assert_bitwise(state(target), state(source))


@pytest.mark.parametrize("saved_at,read_at", [("float32", "O1-bfloat16"), ("O1-bfloat16", "float32")])
def test_checkpoint_at_the_same_layout_restores_every_value(saved_at, read_at, saved):
    """float32 and O1-bfloat16 hold the same (float32 weights, no copies, no loss scale): restored bit for bit."""
    source = saved(saved_at)
    target = make(read_at, seed=1, trained=False)
    tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(source.checkpoint).assert_consumed()
    assert_bitwise(state(target), source.state)


def test_checkpoint_read_before_the_optimizer_is_built_is_checked_when_it_is(saved):
    """The read restores the (same-dtype) weights; the optimizer's state waits for build, which refuses it."""
    source = saved("O2")
    target = make("O2-kahan", seed=1, trained=False, build=False)
    assert not target.optimizer.built  # its state is restored when build creates it
    tf.train.Checkpoint(model=target, optimizer=target.optimizer).read(source.checkpoint)
    assert_bitwise(values(target.weights), source.weights)
    with pytest.raises(ValueError, match="none of the optimizer's state was") as raised:
        target.optimizer.build(target.trainable_variables)
    assert "float32 master copies" in str(raised.value) and "Kahan remainders" in str(raised.value)
    assert not target.optimizer.built  # refused before any variable of its state was created


# ---------------------------------------------------------------- what is recorded
def test_autocast_records_the_level_and_the_layout_round_trips():
    model = make("O2-bfloat16", trained=False)
    assert {p.level for p in _state.placed(model.trainable_variables)} == {"O2-bfloat16"}
    layout = model.optimizer._saved.layout
    assert layout == Layout("O2-bfloat16", "masters", (("bfloat16", 4), ("float32", 2)), False)
    decoded, fields = Layout.decode(layout.encode(aux=[2, 3]))
    assert decoded == layout and fields["aux"] == [2, 3]  # every field back
    assert Layout.decode("not a layout") == (None, {})
    assert layout.describe() == ("O2-bfloat16 (4 bfloat16 and 2 float32 parameters, float32 master copies, "
                                 "no loss scaling)")
