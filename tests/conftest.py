"""Shared pytest fixtures: every test starts and ends under Keras's default policy."""

import gc
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The same CPU kernels and allocator on every machine: TensorFlow turns oneDNN on by default
# only on CPUs with AVX-512 and the like, and without it the CPU allocator keeps no statistics
# (the memory tests read them). Read when TensorFlow is imported.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


def _hands_tests_out(config):
    """True in pytest-xdist's controller (`-n 2`): it runs no test, and its workers start their own TensorFlow."""
    return (config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None))
            and not hasattr(config, "workerinput") and not config.getoption("collectonly"))


def pytest_configure(config):
    """Two logical CPU devices, so that tf.distribute tests can run on one CPU: set before TensorFlow
    initialises its devices. Not in xdist's controller: importing it there held the workers back by about 9 s."""
    if _hands_tests_out(config):
        return
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    if cpus:
        try:
            tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        except RuntimeError:  # devices already initialised by an earlier import
            pass


def pytest_collection_finish(session):
    """What lives as long as the process (modules, TensorFlow's and Keras's registries, the collected tests) is
    left out of every later full collection: kmix.export's and recommend's `gc.collect`, and Python's own."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (pytest.ini) need a GPU: skipped, saying so, where TensorFlow sees none."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return
    skip = pytest.mark.skip(reason="needs a GPU (marked gpu): `python -m pytest -m gpu` on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def collective_keys_of_its_own():
    """Every test's `MirroredStrategy` numbers its collectives from keys no other test used.

    Each strategy numbers its collective ops from the same keys, and TensorFlow's
    runtime remembers each key's shape and dtype for the life of the process: a
    second strategy (another test, or an example run in this process) whose first
    all-reduce has another shape aborts every collective after it. A program has
    one strategy; a test process has many. TensorFlow's own tests move this class
    attribute by 100,000 per strategy for the same reason (strategy_combinations.py).
    """
    import tensorflow as tf

    tf.distribute.MirroredStrategy._collective_key_base += 100_000
    yield


@pytest.fixture(autouse=True)
def restore_keras_globals():
    """Restore Keras's global dtype policy and kmix's policy after every test."""
    import keras

    from kmix import _state

    policy = keras.config.dtype_policy()
    saved = _state.save()
    yield
    keras.config.set_dtype_policy(policy)
    _state.restore(saved)
    # Name uniqueness and a fresh graph per test; the gc pass is skipped (about 0.2 s a test).
    keras.backend.clear_session(free_memory=False)
