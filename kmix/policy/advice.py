"""What kmix learned about a model when it placed it, for the optimizer that trains it.

`kmix.autocast` records here, per trainable variable, the dtype its layer
computes in, the opt level it was placed at, and (with `sample=`) the
initial loss scale the diagnosis advises. `kmix.LossScaleOptimizer.build`
looks its variables up, so that an optimizer wrapped outside
`kmix.policy_scope` still scales the loss of a model whose layers compute in
float16, starts from the advised scale, and names the model's opt level in
what it saves (`kmix.optimizers.saved_level`).

Variables are unhashable, so entries are keyed by `id()` and hold a weak
reference that tells a live variable from a later one that reuses the id.
"""

import weakref

_COMPUTE = {}  # id(variable) -> (weakref, compute dtype of the layer that owns it)
_SCALE = {}  # id(variable) -> (weakref, advised initial loss scale)
_LEVEL = {}  # id(variable) -> (weakref, name of the policy it was placed under)
_LEVEL_SCALE = {}  # policy name -> the initial scale last advised under it


def record(variables_by_dtype, initial_scale=None, policy_name=None):
    """Records the compute dtype of each variable's layer and an advised scale.

    Args:
        variables_by_dtype: pairs `(variable, compute_dtype)`.
        initial_scale: the initial loss scale advised for these variables, or None.
        policy_name: the name of the policy the model was placed under
            (`kmix.Policy.name`), recorded for each variable; `kmix.wrap`
            under that policy then uses `initial_scale` as its default.
    """
    variables = []
    for variable, dtype in variables_by_dtype:
        _put(_COMPUTE, variable, str(dtype))
        if policy_name is not None:
            _put(_LEVEL, variable, str(policy_name))
        variables.append(variable)
    if initial_scale is not None:
        for variable in variables:
            _put(_SCALE, variable, float(initial_scale))
        if policy_name is not None:
            _LEVEL_SCALE[policy_name] = float(initial_scale)


def record_model(model, initial_scale=None, policy_name=None):
    """Records, for each trainable variable of `model`, the compute dtype of the layer that owns it.

    The owner is the innermost layer holding the variable (a `Dense` inside a
    block, not the block). `initial_scale` and `policy_name` as in `record`.
    """
    from kmix._tree import walk  # placement imports nothing of the optimizers'

    owners = {id(v): (v, model.compute_dtype) for v in model.trainable_variables}
    for _, layer, _ in walk(model):  # parents before children: the innermost owner is last
        for v in layer.trainable_variables:
            owners[id(v)] = (v, layer.compute_dtype)
    record(owners.values(), initial_scale, policy_name)


def compute_dtypes(variables):
    """The set of compute dtypes recorded for `variables` (empty when none were)."""
    found = (_get(_COMPUTE, v) for v in variables)
    return {dtype for dtype in found if dtype is not None}


def levels(variables):
    """The set of policy names (`"O2-float16"`) the variables were placed under (empty when none were recorded)."""
    found = (_get(_LEVEL, v) for v in variables)
    return {name for name in found if name is not None}


def initial_scale(variables=None, policy_name=None):
    """The largest initial scale advised for `variables`, else for `policy_name`, else None."""
    if variables is not None:
        scales = [s for s in (_get(_SCALE, v) for v in variables) if s is not None]
        if scales:
            return max(scales)
    if policy_name is not None:
        return _LEVEL_SCALE.get(policy_name)
    return None


def _put(table, variable, value):
    key = id(variable)
    table[key] = (weakref.ref(variable, lambda _, k=key, t=table: t.pop(k, None)), value)


def _get(table, variable):
    entry = table.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    return entry[1]


def snapshot(variables):
    """What is recorded for `variables` (and per policy), for `restore` to put back."""
    keys = {id(v) for v in variables}
    tables = tuple({k: e for k, e in table.items() if k in keys} for table in (_COMPUTE, _SCALE, _LEVEL))
    return tables, keys, dict(_LEVEL_SCALE)


def restore(saved):
    """Puts back the records `snapshot` took: `kmix.recommend` places the user's model only for a while."""
    tables, keys, level = saved
    for table, entries in zip((_COMPUTE, _SCALE, _LEVEL), tables):
        for key in keys:
            table.pop(key, None)
        table.update(entries)
    _LEVEL_SCALE.clear()
    _LEVEL_SCALE.update(level)
