"""`rules.gather` and `rules.Rules.plan` on small hand-built models: each row's policy, `Kind` and reason.

Expected rows are worked out by hand from docs/guide.md ("Where an opt level's placement comes from") and
rules.py's docstrings: matmuls and embeddings half; norms, softmax, routers, sinusoids and outputs float32.
"""

import keras
import numpy as np
import pytest

import kmix
from kmix.placing import norms
from kmix.placing.rules import Kind, Rules, gather, is_router

HALF_OUT = "model output: matmul in half, activation and output float32"


def plan(model, policy="O1", float32_layers=None, find_outputs=None, facts=None):
    """`{path: (policy name, Kind, reason)}` of `model`'s plan (of its gathered facts, or of `facts`)."""
    rules = Rules(kmix.Policy(policy), float32_layers)
    facts = gather(model, rules, find_outputs) if facts is None else facts
    return {row.path: (row.dtype, row.kind, row.reason) for row in rules.plan(model, facts)}


class SquaringNorm(keras.layers.Layer):
    """An RMS norm squaring in its compute dtype (as keras-hub's T5LayerNorm): inf in float16 past |x| 256."""

    def build(self, shape):
        self.scale = self.add_weight(shape=shape[-1:], initializer="ones")

    def call(self, x):
        return x * keras.ops.rsqrt(keras.ops.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.scale


class Block(keras.layers.Layer):
    """A custom block: a Dense, a norm, a Dropout and an Activation of a dtype of its own, made by itself."""

    def __init__(self, norm=keras.layers.LayerNormalization, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")
        self.norm = norm(name="norm")
        self.drop = keras.layers.Dropout(0.1, name="drop")
        self.act = keras.layers.Activation("relu", name="act", dtype="mixed_bfloat16")

    def call(self, x):
        return self.act(self.norm(x + self.drop(self.proj(x))))


def with_block(norm=keras.layers.LayerNormalization, head=True):
    """`up` -> `block` (a `Block`) -> `head`, or `block` the output."""
    inputs = keras.Input((4,))
    h = Block(norm, name="block")(keras.layers.Dense(4, name="up")(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h) if head else h, name="m")


@pytest.mark.parametrize("level, half", [("O1", "mixed_float16"), ("O1-bfloat16", "mixed_bfloat16"), ("O2", "float16")])
def test_functional_model_places_each_layer_by_its_rule(level, half):
    inputs = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(10, 4, name="embed")(inputs)
    h = keras.layers.Dense(4, activation="relu", name="up")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Softmax(name="softmax")(h)
    h = keras.layers.Dense(4, activation="softmax", name="probs")(h)
    h = keras.layers.Activation("log_softmax", name="log_probs")(h)
    h = keras.layers.Dropout(0.1, name="drop")(h)
    outputs = keras.ops.mean(keras.layers.Dense(2, name="head")(h), axis=1)  # an ops node after the head
    assert plan(keras.Model(inputs, outputs), level) == {
        "embed": (half, Kind.HALF, "allow list"),
        "up": (half, Kind.HALF, "allow list"),
        "norm": ("float32", Kind.ISLAND, "normalization"),
        "softmax": (half, Kind.SAFE_CLASS, "kmix safe layer"),  # becomes kmix's Softmax
        "probs": ("float32", Kind.FLOAT32_OP, "softmax activation"),
        "log_probs": ("float32", Kind.FLOAT32_OP, "log_softmax activation"),
        "drop": (half, Kind.HALF, "follows inputs"),
        "head": (half, Kind.HALF_OUT, HALF_OUT),  # found through the `mean` node
    }


def test_sequential_output_rules_come_before_the_softmax_and_norm_rules():
    softmax_head = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="up"),
                                     keras.layers.Dense(3, activation="softmax", name="probs")])
    norm_last = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="up"),
                                  keras.layers.LayerNormalization(name="norm")])
    assert plan(softmax_head)["probs"] == ("mixed_float16", Kind.HALF_OUT, HALF_OUT)
    assert plan(norm_last) == {"up": ("mixed_float16", Kind.HALF, "allow list"),
                               "norm": ("float32", Kind.OUTPUT, "model output")}
    # Keras's `mixed_float16` has half outputs: the islands' rules decide.
    assert plan(softmax_head, "mixed_float16")["probs"] == ("float32", Kind.FLOAT32_OP, "softmax activation")
    assert plan(norm_last, "mixed_float16")["norm"] == ("float32", Kind.ISLAND, "normalization")


def test_outputs_without_a_float32_form_are_float32():
    tokens = keras.Input((3,), dtype="int32")
    embedded = keras.layers.Embedding(10, 4, name="tied")(tokens)  # a tied LM's embedding makes the logits
    scaled = keras.layers.Dense(4, activation=keras.ops.abs, name="scaled")(embedded)  # no float32-out form
    assert plan(keras.Model(tokens, [embedded, scaled])) == {
        "tied": ("float32", Kind.OUTPUT, "model output"), "scaled": ("float32", Kind.OUTPUT, "model output")}


@pytest.mark.parametrize("policy, half", [("O1", "mixed_float16"), ("O2", "float16")])
def test_block_layers_follow_the_block(policy, half):
    assert plan(with_block(head=False), policy) == {
        "up": (half, Kind.HALF, "allow list"),
        "block": (half, Kind.HALF, "model output, but a block: keeps its dtype"),
        "block/proj": (half, Kind.HALF, "allow list"),
        "block/norm": ("mixed_float16", Kind.ISLAND,  # O2's too: float32 variables, half out
                       "normalization in a block: statistics in float32 (probed), half out"),
        "block/drop": (half, Kind.IN_BLOCK, "in a block: follows it"),
        "block/act": (None, Kind.IN_BLOCK, "in a block: a dtype of its own, kept"),
    }


def test_plan_reads_only_the_facts():
    model, rules = with_block(), Rules(kmix.Policy("O1"))
    facts = {fact.path: fact for fact in gather(model, rules)}
    placed, block = rules.plan(model, list(facts.values())), model.get_layer("block")
    assert (placed.model, placed.subtree(block), placed.subtree(model.get_layer("head"))) == (
        model, [block.proj, block.norm, block.drop, block.act], [])
    assert placed.listed == {id(model.get_layer(name)) for name in ("up", "block", "head")}
    assert [(p, f.listed, f.output, f.block) for p, f in facts.items() if f.listed or f.output or f.block] == [
        ("up", True, False, False), ("block", True, False, True), ("head", True, True, False)]
    assert facts["block/norm"].norm.float32 is True and facts["up"].too_large is None
    facts["up"] = facts["up"]._replace(too_large="kernel (|x| up to 7e+04)")
    facts["head"] = facts["head"]._replace(listed=False)  # a config that does not list it (keras-hub's)
    facts["block/norm"] = facts["block/norm"]._replace(norm=norms.Verdict(False, "statistics in half (probed)"))
    rows = plan(model, facts=list(facts.values()))
    assert rows["up"] == ("float32", Kind.TOO_LARGE, "kernel (|x| up to 7e+04) does not fit float16 (largest 65504)")
    assert rows["head"] == ("float32", Kind.OUTPUT, "model output")
    assert rows["block/norm"] == plan(with_block(SquaringNorm))["block/norm"] == (  # as `gather` measures it
        "float32", Kind.ISLAND, "normalization in a block: statistics in half (probed), so float32")


@pytest.mark.parametrize("largest, policy, expected", [
    (7e4, "O1", ("float32", Kind.TOO_LARGE, "kernel (|x| up to 7e+04) does not fit float16 (largest 65504)")),
    (6.5e4, "O1", ("mixed_float16", Kind.HALF_OUT, HALF_OUT)),  # below 65504: fits
    (7e4, "O1-bfloat16", ("mixed_bfloat16", Kind.HALF_OUT, HALF_OUT)),  # bfloat16 has float32's range
])
def test_a_variable_beyond_float16_keeps_its_layer_float32(largest, policy, expected):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="big")])
    model.get_layer("big").kernel.assign(np.array([[1.0, -largest], [0.0, 3.0]], "float32"))
    assert plan(model, policy)["big"] == expected


class Chain(keras.layers.Layer):
    """Calls the layers it is given one after another: a block of its own layers, placed by its class's name."""

    def __init__(self, layers, **kwargs):
        super().__init__(**kwargs)
        self.chain = layers

    def call(self, x):
        for layer in self.chain:
            x = layer(x)
        return x


def test_routers_and_sinusoidal_embeddings_are_float32_islands():
    router = type("TopKRouter", (Chain,), {})([keras.layers.Dense(4, name="scores")], name="router")
    moe = type("SparseMoeBlock", (Chain,), {})(
        [keras.layers.Dense(4, name="gate"), keras.layers.Dense(4, name="expert_gate"), router], name="moe")
    inputs = keras.Input((4,))
    h = type("SinusoidalEmbedding", (Chain,), {})([], name="time")(moe(inputs))
    why = "router of a mixture of experts: its softmax and top-k choose the experts"
    assert plan(keras.Model(inputs, keras.layers.Dense(2, name="head")(h))) == {
        "moe": ("mixed_float16", Kind.HALF, "follows inputs"),
        "moe/gate": ("float32", Kind.ISLAND, why),
        "moe/expert_gate": ("mixed_float16", Kind.HALF, "allow list"),  # an expert's, by its name
        "moe/router": ("mixed_float16", Kind.HALF, "follows inputs"),
        "moe/router/scores": ("float32", Kind.ISLAND, why),  # any Dense in a `*Router`
        "time": ("float32", Kind.ISLAND, "sinusoidal embedding: sin/cos of large arguments, 3 digits in half"),
        "head": ("mixed_float16", Kind.HALF_OUT, HALF_OUT),
    }
    gate = moe.chain[0]
    assert [is_router(gate, moe), is_router(gate, Block()), is_router(keras.layers.Dense(2, name="router_norm"), moe),
            is_router(keras.layers.LayerNormalization(name="gate"), moe), is_router(gate, router)] == [
        True, False, True, False, True]


@pytest.mark.parametrize("given, named", [
    (["up"], {"up"}), ("head", {"head"}), (["block/norm"], {"block/norm"}),
    ([keras.layers.LayerNormalization], {"block/norm"}),
    (["block"], {"block", "block/proj", "block/norm", "block/drop", "block/act"}),  # with everything inside it
])
def test_float32_layers_by_name_path_or_class(given, named):
    rows, reference = plan(with_block(), float32_layers=given), plan(with_block())
    assert {path for path, row in rows.items() if row[1] is Kind.NAMED} == named
    assert rows == {path: ("float32", Kind.NAMED, "float32_layers") if path in named else row
                    for path, row in reference.items()}


def test_float32_layers_by_class_covers_the_layers_inside():  # as autocast's docstring says, and as by name
    assert plan(with_block(), float32_layers=[Block]) == plan(with_block(), float32_layers=["block"])


@pytest.mark.parametrize("policy, dtype, reason", [("O0", "float32", "float32 policy"),
                                                   ("O3", "float16", "pure half policy")])
def test_uniform_policies_place_every_layer_alike_but_the_named(policy, dtype, reason):
    rows = plan(with_block(), policy, float32_layers=["head"])
    assert rows.pop("head") == ("float32", Kind.NAMED, "float32_layers")
    assert rows == {path: (dtype, Kind.UNIFORM, reason) for path in ("up", "block", "block/proj", "block/norm",
                                                                       "block/drop", "block/act")}


def test_with_policy_layers_keep_theirs_and_nested_models_are_walked():
    inner_inputs = keras.Input((4,))
    inner = keras.Model(inner_inputs, keras.layers.Dense(4, name="inner_head")(
        keras.layers.LayerNormalization(name="inner_norm")(inner_inputs)), name="inner")
    inputs = keras.Input((4,))
    h = kmix.layers.WithPolicy(keras.layers.Dense(4, name="dense"), "float32", name="kept")(inputs)
    assert plan(keras.Model(inputs, inner(h)), float32_layers=["kept/dense"]) == {
        "kept": (None, Kind.KEPT, "WithPolicy: kept"),
        "kept/dense": (None, Kind.KEPT, "WithPolicy: kept"),  # named too, but its WithPolicy decides
        "inner": (None, Kind.NESTED, "a nested model: its layers are placed"),
        "inner/inner_norm": ("float32", Kind.ISLAND, "normalization"),
        "inner/inner_head": ("mixed_float16", Kind.HALF_OUT, HALF_OUT),  # the outer model's output
    }


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense, self.drop = keras.layers.Dense(3, name="dense"), keras.layers.Dropout(0.5, name="drop")

    def call(self, x):
        return self.drop(self.dense(x))


def test_a_subclassed_models_layers_are_placed_as_a_blocks():
    model = Subclassed()
    model(np.zeros((1, 3), "float32"))
    assert plan(model, find_outputs=lambda layers: {id(model.dense)}) == {
        "dense": ("float32", Kind.OUTPUT, "model output"),  # its config lists no layers: no float32-out form
        "drop": (None, Kind.IN_BLOCK, "in a block: as its block"),
    }
    assert plan(model)["dense"] == ("mixed_float16", Kind.HALF, "allow list")  # no outputs found


def test_bad_float32_layers_are_refused():
    policy = kmix.Policy("O1")
    with pytest.raises(TypeError, match=r"must be a list .* Received: float32_layers=\{'up': 1\} \(of type dict\)"):
        Rules(policy, {"up": 1})
    for item in (keras.layers.Dense(2), int, 3):
        with pytest.raises(TypeError, match=r"must hold layer classes or layer names\. Received: "):
            Rules(policy, ["up", item])
    with pytest.raises(ValueError, match=r"names \['block/nope', 'nope'\], which are no layers of model 'm'\. "
                                         r"Its layers are: \['act', 'block', 'drop', 'head', 'norm', 'proj', 'up'\]"):
        plan(with_block(), float32_layers=["nope", "block/nope", "block/norm"])
