"""kmix.autocast on every keras-hub backbone, against float32 and plain Keras mixed precision.

Each architecture of `tests.hub_zoo.ZOO` is built tiny and compared from the
same float32 weights by `tests.hub_coverage.check`: kmix must not crash where
plain Keras runs, and give finite outputs within 5e-2 (bfloat16) / 1e-2
(float16) of float32's (or within 1.5x plain Keras's error), a `.keras` reload
that predicts bitwise what the placed model predicts, and two epochs of `fit`
close to the same two SGD steps run by hand on the float32 model. What no
criterion reads (plain Keras's `fit`; its reload where kmix's is exact) is
left out (`record=False`).

By default a subset, one architecture per family of failure; with
`KMIX_HUB_ALL=1` every architecture of the zoo under both half dtypes
(`python tools/hub_matrix.py` writes the same rows as a table).
"""

import inspect
import os

import pytest

from tests.testing import FULL

keras_hub = pytest.importorskip("keras_hub")

from tests.hub_coverage import check  # noqa: E402
from tests.hub_zoo import ZOO  # noqa: E402

DEFAULT = [
    # Functional keras.ops nodes record float32 at build (a reload may rebuild them otherwise).
    ("GemmaBackbone", "bfloat16"),
    # A float32 island (the layer norms) feeding raw ops inside a recurrent block.
    ("RWKV7Backbone", "bfloat16"),
    # A mixture-of-experts router and its load-balancing loss (float16: a loss scale's skipped step).
    ("Qwen3MoeBackbone", "float16"),
    # A plain encoder stack.
    ("BertBackbone", "float16"),
    # Vision: a convolutional pyramid with batch norms.
    ("ResNetBackbone", "float16"),
]
"""(architecture, half dtype) pairs run by default: one per family of failure."""


def concrete_backbones():
    """Every `*Backbone` class `keras_hub.models` exports, but the abstract bases.

    A base (`Backbone`, `FeaturePyramidBackbone`) is a class whose constructor
    requires no argument beyond `*args` / `**kwargs`: it describes no model.
    """
    names = []
    for name in dir(keras_hub.models):
        cls = getattr(keras_hub.models, name)
        if not (name.endswith("Backbone") and inspect.isclass(cls) and issubclass(cls, keras_hub.models.Backbone)):
            continue
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        required = [
            p for p in parameters
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            names.append(name)
    return sorted(names)


# Families the default run leaves to `KMIX_FULL_TESTS=1` (7-25 s each on 2 cores): Mixtral's
# router in bfloat16, Flux's sinusoidal timestep embeddings (in half, 0.4 of the output away;
# blocks without `dtype=`), SegFormer's MiT (a norm feeding raw ops inside a block), Gemma in
# float16 (its bfloat16 row runs by default) and CLIP's two towers.
FULL_EXTRA = [("MixtralBackbone", "bfloat16"), ("FluxBackbone", "bfloat16"), ("MiTBackbone", "bfloat16"),
              ("GemmaBackbone", "float16"), ("CLIPBackbone", "bfloat16")]


def cases():
    """The default pairs (with `KMIX_FULL_TESTS=1` five more), or with `KMIX_HUB_ALL=1` every
    architecture under both dtypes."""
    if os.environ.get("KMIX_HUB_ALL") == "1":
        return [(name, half) for name in sorted(ZOO) for half in ("bfloat16", "float16")]
    return DEFAULT + (FULL_EXTRA if FULL else [])


def test_concrete_backbones_found_generically():
    names = concrete_backbones()
    assert "GemmaBackbone" in names and "ResNetBackbone" in names
    assert "Backbone" not in names and "FeaturePyramidBackbone" not in names
    assert len(names) >= 77


def test_zoo_covers_every_backbone():
    missing = [name for name in concrete_backbones() if name not in ZOO]
    assert not missing, f"{len(missing)} keras-hub backbones have no builder in tests.hub_zoo: {', '.join(missing)}"


@pytest.mark.parametrize("name, half", cases(), ids=[f"{name}-{half}" for name, half in cases()])
def test_architecture(name, half):
    assert name in ZOO, f"tests.hub_zoo has no builder for {name}"
    row = check(name, half, record=False)
    failures = row.failures()
    assert failures == [], (
        f"kmix.autocast({name}, {half}) misses {len(failures)} criteria:\n  " + "\n  ".join(failures)
        + f"\n  (plain Keras: error {row.keras_error}, reload {row.keras_reload}, crash {row.keras_crash}; "
        f"kmix: error {row.kmix_error}, reload {row.kmix_reload}, fit {row.fit_losses} vs float32 "
        f"{row.fit_losses32}; kmix's warnings: {row.kmix_warnings})"
    )
