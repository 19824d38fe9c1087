"""kmix.Policy: every spelling parses to the documented dtypes and round-trips."""

import pickle

import keras
import pytest

import kmix
from kmix.policy import Policy
from tests.testing import assert_config_round_trip

F32, F16, BF16 = "float32", "float16", "bfloat16"

# spec, half -> (params, compute, output, loss scaling, master weights, Keras policy),
# written out by hand from the definitions (Apex opt levels, Keras names, jmp).
TABLE = [
    ("O0", None, (F32, F32, F32, False, False, "float32")),
    ("O1", None, (F32, F16, F32, True, False, "mixed_float16")),
    ("O2", None, (F16, F16, F32, True, True, "float16")),
    ("O3", None, (F16, F16, F16, True, False, "float16")),
    ("O1", "bfloat16", (F32, BF16, F32, False, False, "mixed_bfloat16")),
    ("O2", "bf16", (BF16, BF16, F32, False, True, "bfloat16")),
    ("O3", "bfloat16", (BF16, BF16, BF16, False, False, "bfloat16")),
    ("float32", None, (F32, F32, F32, False, False, "float32")),
    ("mixed_float16", None, (F32, F16, F16, True, False, "mixed_float16")),
    ("mixed_bfloat16", None, (F32, BF16, BF16, False, False, "mixed_bfloat16")),
    ("float16", None, (F16, F16, F16, True, False, "float16")),
    ("bfloat16", None, (BF16, BF16, BF16, False, False, "bfloat16")),
    ("params=float32,compute=float16,output=float32", None, (F32, F16, F32, True, False, "mixed_float16")),
    ("p=f32,c=bf16,o=f32", None, (F32, BF16, F32, False, False, "mixed_bfloat16")),
    (" p = bf16 , c = bf16 , o = f32 ", None, (BF16, BF16, F32, False, True, "bfloat16")),
    ("o=f16,p=f16,c=f16", None, (F16, F16, F16, True, True, "float16")),
    ("params=F32,compute=F32,output=BF16", None, (F32, F32, BF16, False, False, "float32")),
]


# One test per property over the whole table: each test tears down a Keras session.
def test_spec_parses_to_documented_dtypes():
    for spec, half, expected in TABLE:
        p = Policy(spec, half=half)
        got = (p.params_dtype, p.compute_dtype, p.output_dtype, p.needs_loss_scaling,
               p.needs_master_weights, p.to_keras().name)
        assert got == expected, spec
        assert isinstance(p.to_keras(), keras.DTypePolicy)
        assert p.to_keras().variable_dtype == p.params_dtype, spec
        assert p.to_keras().compute_dtype == p.compute_dtype, spec


def test_round_trips():
    for spec, half, _ in TABLE:
        p = Policy(spec, half=half)
        clone = assert_config_round_trip(p)
        assert clone == p and clone.spec == p.spec and clone.half == p.half, spec
        assert Policy(p.spec, half=p.half) == p, spec  # the canonical spelling parses back
        assert Policy(p) == p
        assert pickle.loads(pickle.dumps(p)) == p
        assert eval(repr(p).split(":")[0] + ")", {"Policy": Policy}) == p, spec  # repr starts with the call


def test_equality_is_behaviour_not_spelling():
    assert Policy("O1") == Policy("p=f32,c=f16,o=f32")
    assert Policy("O2", half="bfloat16") == Policy("params=bf16,compute=bf16,output=float32")
    assert Policy("O3") == Policy("float16")
    assert Policy("O0") == Policy("float32")
    assert Policy("O1") != Policy("mixed_float16")  # output dtype differs
    assert Policy("O2") != Policy("O3")  # master weights differ
    assert len({Policy("O1"), Policy("p=f32,c=f16,o=f32"), Policy("O2")}) == 2
    assert Policy("O1") != "O1"


def test_policy_given_as_spec_keeps_or_replaces_its_half():
    p = Policy("O2", half="bfloat16")
    assert Policy(p).half == "bfloat16"
    assert Policy(p, half="f16") == Policy("O2")
    with pytest.raises(ValueError, match="only applies to opt levels"):
        Policy(Policy("float16"), half="bfloat16")


def test_keras_dtype_policy_is_accepted():
    assert Policy(keras.DTypePolicy("mixed_bfloat16")) == Policy("mixed_bfloat16")


def test_immutable():
    p = Policy("O2")
    with pytest.raises(AttributeError, match="immutable"):
        p.compute_dtype = "float32"
    with pytest.raises(AttributeError, match="immutable"):
        p.anything = 1
    with pytest.raises(AttributeError):
        del p._spec


def test_repr_is_readable():
    r = repr(Policy("O2", half="bfloat16"))
    assert r.startswith("Policy('O2', half='bfloat16'")
    for part in ("params=bfloat16", "compute=bfloat16", "output=float32", "master_weights=True"):
        assert part in r


BAD_SPECS = ["O4", "o1", "mixed_float32", "float64", "", "params=float32", "p=f32,c=f16,o=f32,x=f16",
             "p=f32,c=f64,o=f32", "p=f32,p=f16,c=f16,o=f16", "p=f32;c=f16;o=f32"]


def test_bad_spec_quotes_it_and_lists_accepted_forms():
    for spec in BAD_SPECS:
        with pytest.raises(ValueError) as info:
            Policy(spec)
        message = str(info.value)
        assert repr(spec) in message
        for form in ("'O1'", "mixed_float16", "params=float32,compute=float16,output=float32", "bf16"):
            assert form in message, (spec, message)


def test_bad_types_and_half():
    with pytest.raises(TypeError, match="spec=3"):
        Policy(3)
    with pytest.raises(ValueError, match="half='float64'"):
        Policy("O1", half="float64")
    with pytest.raises(ValueError, match="only applies to opt levels"):
        Policy("mixed_float16", half="bfloat16")


def test_inexpressible_in_keras_is_refused():
    with pytest.raises(ValueError, match="params=float32"):
        Policy("p=bf16,c=f32,o=f32")


def test_casts_only_floating_tensors():
    p = Policy("O2")
    x = {"a": keras.ops.ones((2,), "float32"), "ids": keras.ops.ones((2,), "int32")}
    assert keras.backend.standardize_dtype(p.cast_to_compute(x)["a"].dtype) == "float16"
    assert keras.backend.standardize_dtype(p.cast_to_output(x)["a"].dtype) == "float32"
    assert keras.backend.standardize_dtype(p.cast_to_param(x)["ids"].dtype) == "int32"


def test_exported_at_package_level():
    for name in ("Policy", "set_policy", "policy_scope", "active_policy", "memory_report"):
        assert getattr(kmix.policy, name).__doc__
    assert kmix.autocast is kmix.placing.autocast and kmix.autocast.__doc__


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_name_round_trips(level, half):
    policy = kmix.Policy(level, half=half)
    again = kmix.Policy(policy.name)
    if level == "O0":  # all float32: its name carries no half dtype, and none matters
        assert policy.name == "O0" and again.compute_dtype == "float32"
        return
    assert (again.spec, again.half, again.params_dtype, again.compute_dtype, again.output_dtype,
            again.needs_master_weights) == (policy.spec, policy.half, policy.params_dtype,
                                      policy.compute_dtype, policy.output_dtype, policy.needs_master_weights)
    assert again.name == policy.name
    with pytest.raises(ValueError, match="names its half dtype"):
        kmix.Policy(f"{level}-{half}", half="float16" if half == "bfloat16" else "bfloat16")
