"""`kmix.Policy`: which dtype parameters, computations and outputs use.

A small immutable value, like jmp's: three dtypes and whether the optimizer
needs loss scaling and master weights. It is parsed from an opt level
(`"O0"`-`"O3"`), a Keras policy name, or a jmp-style string; docs/guide.md
("Opt levels") gives each spelling's dtypes.
"""

import keras

_DTYPES = {"float32": "float32", "f32": "float32", "float16": "float16", "f16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}
_HALF = ("float16", "bfloat16")
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute", "output": "output",
         "o": "output"}
_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_KERAS_NAMES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")
_ACCEPTED = (
    "an opt level 'O0', 'O1', 'O2' or 'O3' (with half='float16' or 'bfloat16'), or its name "
    "with the half dtype ('O1-bfloat16'); "
    "a Keras policy name 'float32', 'mixed_float16', 'mixed_bfloat16', 'float16' or 'bfloat16'; "
    "or a jmp-style string such as 'params=float32,compute=float16,output=float32' "
    "(keys params/p, compute/c, output/o; dtypes float32/f32, float16/f16, bfloat16/bf16); "
    "or a kmix.Policy or keras.DTypePolicy"
)


@keras.saving.register_keras_serializable(package="kmix")
class Policy:
    """A mixed-precision policy: the dtypes of parameters, compute and outputs.

    Immutable and hashable; two policies are equal when they behave the same
    (same dtypes, same loss-scaling and master-weight needs), whatever their
    spelling: `Policy("O1") == Policy("p=f32,c=f16,o=f32")`.

    Args:
        spec: an opt level (`"O0"`-`"O3"`), a Keras policy name (`"float32"`,
            `"mixed_float16"`, `"mixed_bfloat16"`, `"float16"`, `"bfloat16"`),
            a jmp-style string `"params=float32,compute=float16,output=float32"`
            (short keys `p`, `c`, `o`; short dtypes `f32`, `f16`, `bf16`),
            another `kmix.Policy`, or a `keras.DTypePolicy`.
        half: `"float16"` (the default) or `"bfloat16"`: the half dtype of an
            opt level. Only opt levels take it.

    Raises:
        ValueError: for a spec that is none of the above; the message quotes
            it and lists the accepted forms.

    Example:

    >>> p = kmix.Policy("O2", half="bfloat16")
    >>> p.params_dtype, p.compute_dtype, p.output_dtype, p.needs_master_weights
    ('bfloat16', 'bfloat16', 'float32', True)
    >>> p.to_keras()
    <DTypePolicy "bfloat16">
    """

    __slots__ = ("_spec", "_half", "_dtypes", "_master")

    def __init__(self, spec, half=None):
        if isinstance(spec, Policy):
            spec, half = spec.spec, spec.half if half is None else half
        elif isinstance(spec, keras.DTypePolicy):
            if spec.quantization_mode is not None:
                raise ValueError(
                    f"Quantized policies are not mixed-precision policies. Received: spec={spec!r}."
                )
            spec = spec.name
        if not isinstance(spec, str):
            raise TypeError(
                f"`spec` must be a string or a policy. Received: spec={spec!r} "
                f"(of type {type(spec).__name__}). Accepted: {_ACCEPTED}."
            )
        stripped = spec.strip()
        level, _, named_half = stripped.partition("-")
        if level in _OPT_LEVELS and named_half:  # a `name`: "O1-bfloat16"
            if _DTYPES.get(named_half) not in _HALF:
                raise ValueError(
                    f"`spec` names an opt level with a half dtype that is none: {named_half!r}. "
                    f"Received: spec={spec!r}. Accepted: '{level}-float16' or '{level}-bfloat16'."
                )
            if half is not None and half != named_half:
                raise ValueError(
                    f"`spec` names its half dtype, and `half` names another. Received: "
                    f"spec={spec!r}, half={half!r}."
                )
            stripped, half = level, named_half
        if stripped in _OPT_LEVELS:
            canonical, half = stripped, _parse_half(half)
            dtypes, master = _opt_level(stripped, half)
        else:
            if half is not None:
                raise ValueError(
                    "`half` only applies to opt levels 'O0'-'O3'; a Keras name or a jmp-style "
                    f"string already names its dtypes. Received: spec={spec!r}, half={half!r}."
                )
            if stripped in _KERAS_NAMES:
                canonical, (dtypes, master) = stripped, _keras_name(stripped)
            elif "=" in stripped:
                dtypes = _parse_jmp(spec)
                canonical = "params={},compute={},output={}".format(*dtypes)
                master = dtypes[0] in _HALF
            else:
                raise ValueError(
                    f"Unknown policy spec. Received: spec={spec!r}.{_did_you_mean(stripped)} Accepted: {_ACCEPTED}."
                )
        _check_expressible(spec, dtypes)
        for name, value in zip(self.__slots__, (canonical, half, dtypes, master)):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------- properties
    @property
    def spec(self):
        """The canonical spelling: `"O1"`, `"mixed_float16"` or `"params=...,compute=...,output=..."`."""
        return self._spec

    @property
    def half(self):
        """The half dtype of an opt level (`"float16"` or `"bfloat16"`); `None` for other specs."""
        return self._half

    @property
    def name(self):
        """A readable name: the spec, with the half dtype for opt levels (`"O2-bfloat16"`).

        `kmix.Policy(policy.name)` is the same policy.
        """
        return f"{self._spec}-{self._half}" if self._spec in _OPT_LEVELS[1:] else self._spec

    @property
    def opt_level(self):
        """`"O0"`-`"O3"` when the policy was given as an opt level, else `None`."""
        return self._spec if self._spec in _OPT_LEVELS else None

    @property
    def params_dtype(self):
        """The dtype of the model's variables."""
        return self._dtypes[0]

    @property
    def compute_dtype(self):
        """The dtype layers compute in."""
        return self._dtypes[1]

    @property
    def output_dtype(self):
        """The dtype of the outputs of a model placed by `kmix.autocast`, or of a `WithPolicy`.

        A model merely built under `kmix.set_policy(policy)` returns the
        compute dtype instead (every layer takes `to_keras()`).
        """
        return self._dtypes[2]

    @property
    def needs_loss_scaling(self):
        """Whether gradients can underflow: float16 compute or parameters."""
        return "float16" in self._dtypes[:2]

    @property
    def needs_master_weights(self):
        """Whether the optimizer should keep float32 copies of the half parameters."""
        return self._master

    # ------------------------------------------------------------- conversions
    def to_keras(self):
        """The `keras.DTypePolicy` for the model's layers under this policy.

        Returns:
            `DTypePolicy("float32")`, `("mixed_<half>")` for float32 params with
            half compute, or `("<half>")` for half params.
        """
        params, compute, _ = self._dtypes
        return keras.DTypePolicy(params if params == compute else f"mixed_{compute}")

    def cast_to_param(self, x):
        """Casts the floating tensors in the nested structure `x` to `params_dtype`."""
        return _cast_floating(x, self.params_dtype)

    def cast_to_compute(self, x):
        """Casts the floating tensors in the nested structure `x` to `compute_dtype`."""
        return _cast_floating(x, self.compute_dtype)

    def cast_to_output(self, x):
        """Casts the floating tensors in the nested structure `x` to `output_dtype`."""
        return _cast_floating(x, self.output_dtype)

    def get_config(self):
        """`{"spec": ..., "half": ...}`: every field is derived from these two."""
        return {"spec": self._spec, "half": self._half}

    @classmethod
    def from_config(cls, config):
        """Re-creates a policy from `get_config()`'s dict."""
        return cls(**config)

    # ----------------------------------------------------------------- value
    def _key(self):
        return self._dtypes + (self._master,)

    def __eq__(self, other):
        if not isinstance(other, Policy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __setattr__(self, name, value):
        raise AttributeError(f"kmix.Policy is immutable; create a new one instead of setting {name!r}.")

    def __delattr__(self, name):
        raise AttributeError(f"kmix.Policy is immutable; cannot delete {name!r}.")

    def __reduce__(self):
        return (Policy, (self._spec, self._half))

    def __repr__(self):
        params, compute, output = self._dtypes
        half = f", half={self._half!r}" if self._spec in _OPT_LEVELS[1:] else ""
        return (
            f"Policy({self._spec!r}{half}: params={params}, compute={compute}, output={output}, "
            f"loss_scaling={self.needs_loss_scaling}, master_weights={self._master})"
        )


def parse(value, argument):
    """`kmix.Policy(value)` for a caller whose parameter is named `argument`; its errors name that.

    Args:
        value: anything `kmix.Policy` accepts.
        argument: the caller's parameter name (`"policy"`), for the messages.

    Returns:
        A `kmix.Policy`.
    """
    try:
        return Policy(value)
    except (TypeError, ValueError) as e:
        message = str(e).replace("`spec`", f"`{argument}`").replace("spec=", f"{argument}=")
        raise type(e)(message.replace("Unknown policy spec.", f"Unknown policy spec in `{argument}`.")) from None


def _did_you_mean(spec):
    """' Did you mean ...?' for a spec that differs from an accepted name only in case, else ''."""
    lowered = spec.lower()
    for name in _OPT_LEVELS + _KERAS_NAMES:
        if lowered == name.lower() or lowered.partition("-")[0] == name.lower() != lowered:
            suggestion = name + (spec[len(name):] if lowered.startswith(name.lower()) else "")
            return f" Did you mean {suggestion!r}? (Names are case-sensitive.)"
    return ""


def _parse_half(half):
    if half is None:
        return "float16"
    dtype = _DTYPES.get(half) if isinstance(half, str) else None
    if dtype not in _HALF:
        raise ValueError(
            f"`half` must be 'float16' (or 'f16') or 'bfloat16' (or 'bf16'). Received: half={half!r}."
        )
    return dtype


def _opt_level(level, half):
    """`(dtypes, master weights)` of an opt level: O1 computes in half, O2 stores half too, O3 outputs half."""
    f32 = "float32"
    return {"O0": ((f32, f32, f32), False), "O1": ((f32, half, f32), False),
            "O2": ((half, half, f32), True), "O3": ((half, half, half), False)}[level]


def _keras_name(name):
    if name.startswith("mixed_"):
        half = name[len("mixed_"):]
        return ("float32", half, half), False
    return (name, name, name), False


def _parse_jmp(spec):
    found = {}
    for part in spec.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key.lower() not in _KEYS or value.lower() not in _DTYPES:
            raise ValueError(
                f"Cannot parse {part.strip()!r} in policy spec {spec!r}: expected key=dtype with key "
                f"in params/p, compute/c, output/o and dtype in float32/f32, float16/f16, "
                f"bfloat16/bf16. Accepted: {_ACCEPTED}."
            )
        key = _KEYS[key.lower()]
        if key in found:
            raise ValueError(f"Policy spec {spec!r} gives {key!r} twice. Accepted: {_ACCEPTED}.")
        found[key] = _DTYPES[value.lower()]
    missing = [k for k in ("params", "compute", "output") if k not in found]
    if missing:
        raise ValueError(f"Policy spec {spec!r} lacks {', '.join(missing)}. Accepted: {_ACCEPTED}.")
    return found["params"], found["compute"], found["output"]


def _check_expressible(spec, dtypes):
    params, compute, _ = dtypes
    if params != compute and params != "float32":
        raise ValueError(
            f"`spec` asks for {params} parameters with {compute} compute; Keras layers either compute "
            "in their variables' dtype or keep float32 variables with half compute. Received: "
            f"spec={spec!r}. "
            + (f"Use params=float32, or compute={params} to compute in {params} too."
               if compute == "float32" else f"Use params=float32, or params={compute} to match compute.")
        )


def _cast_floating(x, dtype):
    def cast(t):
        if not hasattr(t, "dtype"):
            return t
        current = keras.backend.standardize_dtype(t.dtype)
        if keras.backend.is_float_dtype(current) and current != dtype:
            return keras.ops.cast(t, dtype)
        return t

    return keras.tree.map_structure(cast, x)
