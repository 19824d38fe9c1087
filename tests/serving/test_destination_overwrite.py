"""`kmix.export` writes only what it owns: occupied paths refused at the call, re-exports moved in whole.

Issue 48 items 1-2. Each artifact is checked by what it serves against the
float32 model's predictions (a re-export against the model it was written
from), and the user's files byte for byte against what the test wrote.
"""

import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmix.serving import destination, export
from kmix.serving import pipeline

BF16_RTOL = 0.05  # bfloat16 keeps 8 bits of mantissa
USER = {"train.py": b"import kmix\n", os.path.join("src", "data.csv"): b"x,y\n1,2\n"}


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(4, name="out")(h))


X = np.random.default_rng(1).normal(size=(8, 16)).astype("float32")


def user_project(path):
    for rel, data in USER.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)) or path, exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)


def user_files_intact(path):
    return all(open(os.path.join(path, rel), "rb").read() == data for rel, data in USER.items())


def serves(path, model):
    """Whether the SavedModel at `path` predicts as `model` does, within bfloat16's rounding."""
    loaded = tf.saved_model.load(path)
    got, expected = loaded.serve(X).numpy(), keras.ops.convert_to_numpy(model(X, training=False))
    return np.abs(got - expected).max() <= BF16_RTOL * np.abs(expected).max()


def artifact_bytes(path):
    """The bytes of the SavedModel's own files at `path` (the user's left out)."""
    names = ["saved_model.pb", "fingerprint.pb", "variables"]
    return {n: open(os.path.join(path, n), "rb").read() if os.path.isfile(os.path.join(path, n)) else
            sorted((f, open(os.path.join(path, n, f), "rb").read()) for f in os.listdir(os.path.join(path, n)))
            for n in names}


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    """`mlp()` and its export, written once: the artifact the tests below find at their paths, copied there."""
    path = str(tmp_path_factory.mktemp("old") / "served")
    model = mlp()
    export(model, path, sample=X, verbose=False)
    return model, path


def place(artifact, path, user=False):
    """`artifact`'s files copied to `path` (a new directory), the user's project files beside them if `user`."""
    shutil.copytree(artifact, path)
    if user:
        user_project(path)


def test_a_project_directory_is_refused_and_with_overwrite_its_files_stay(tmp_path):
    project = str(tmp_path / "project")
    user_project(project)
    child = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    child.wait()  # a process id that is no longer running
    stale = tmp_path / f".kmix-partial-{child.pid}-project"  # a killed export's, as the run in issue 48 left them
    os.makedirs(stale / "variables")
    (stale / "variables" / "variables.data-00000-of-00001").write_bytes(b"\0" * 1024)
    model = mlp()
    with pytest.raises(ValueError, match=r"`filepath` names a directory that is not empty.*Received: filepath=.*"
                                         r"overwrite=False.*overwrite=True"):
        export(model, project, sample=X, verbose=False)
    assert sorted(os.listdir(project)) == ["src", "train.py"] and user_files_intact(project)
    assert sorted(os.listdir(tmp_path)) == ["project"]  # the killed export's partial removed by the next call

    report = export(model, project, sample=X, verbose=False, overwrite=True)
    assert user_files_intact(project) and serves(project, model)
    assert sorted(os.listdir(project)) == ["assets", "fingerprint.pb", "saved_model.pb", "src", "train.py", "variables"]
    own = sum(os.path.getsize(os.path.join(here, f)) for here, _, files in os.walk(project) for f in files
              if f not in ("train.py", "data.csv"))
    assert report.disk_bytes[project] == own  # the artifact's files, not the user's

    retrained = mlp(seed=1)  # the same path again: the artifact replaced, the user's files kept
    export(retrained, project, sample=X, verbose=False, overwrite=True)
    assert user_files_intact(project) and serves(project, retrained) and not serves(project, model)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".kmix")] == []


def test_occupied_paths_are_refused_at_the_call(tmp_path, monkeypatch):
    model = mlp()
    (tmp_path / "notes").write_text("mine")
    calls = []
    monkeypatch.setattr(pipeline.check, "inputs_to_check", lambda *a: calls.append(a))  # never reached
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"`filepath` names an existing file: a SavedModel is a directory"):
            export(model, str(tmp_path / "notes"), sample=X, verbose=False, overwrite=overwrite)
    os.makedirs(tmp_path / "m.keras")
    (tmp_path / "m.keras" / "keep").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"`filepath` ends in '.keras' but names a directory"):
            export(model, str(tmp_path / "m.keras"), sample=X, verbose=False, overwrite=overwrite)
    (tmp_path / "old.keras").write_bytes(b"zip")
    with pytest.raises(ValueError, match=r"names an existing file\. Received: filepath=.*old.keras.*overwrite=False"):
        export(model, [str(tmp_path / "new"), str(tmp_path / "old.keras")], sample=X, verbose=False)
    os.makedirs(tmp_path / "work")
    (tmp_path / "work" / "keep").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ValueError, match=r"`filepath` names the working directory"):
        export(model, ".", sample=X, verbose=False)
    with pytest.raises(ValueError, match=r"names one path twice"):
        export(model, ["a", os.path.abspath("a")], sample=X, verbose=False)
    with pytest.raises(TypeError, match=r"`overwrite` must be True or False\. Received: overwrite='yes'"):
        export(model, "a", sample=X, verbose=False, overwrite="yes")
    assert calls == []
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "notes", "old.keras", "work"]
    assert (tmp_path / "notes").read_text() == "mine" and os.listdir(".") == ["keep"]
    assert os.listdir(tmp_path / "m.keras") == ["keep"]
    assert (tmp_path / "old.keras").read_bytes() == b"zip"


@pytest.mark.parametrize("step", ["write", "read back", "exchange", "merge"])
def test_an_interrupted_re_export_leaves_the_old_artifact_whole(tmp_path, monkeypatch, old, step):
    model, artifact = old
    path = str(tmp_path / ("project" if step == "merge" else "served"))
    place(artifact, path, user=step == "merge")
    before = artifact_bytes(path)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if step == "write":  # half written: the partial directory exists, then Ctrl-C
        real = pipeline.artifact.write_function
        monkeypatch.setattr(pipeline.artifact, "write_function",
                            lambda *a, **k: (real(*a, **k), interrupt()))
    elif step == "read back":
        monkeypatch.setattr(pipeline.artifact, "read_saved_model", interrupt)
    elif step == "exchange":  # the step that swaps the directories
        monkeypatch.setattr(destination, "_exchange", interrupt)
    else:  # the last file of a merge into the user's directory: the others are in already
        real = os.replace

        def replace(source, there, *args, **kwargs):
            if there.endswith("saved_model.pb"):
                raise KeyboardInterrupt
            return real(source, there, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        export(mlp(seed=1), path, sample=X, verbose=False, overwrite=True)
    monkeypatch.undo()
    assert artifact_bytes(path) == before and serves(path, model)
    if step == "merge":
        assert user_files_intact(path)
    assert [n for d in (tmp_path, path) for n in os.listdir(d) if n.startswith(".kmix")] == []
