"""Where a reload names layers anew: the twin's policy maps foresee the names, so that one build is the reload's.

A reload may name a block's layers otherwise than the model in memory does (a keras-hub block naming them
after the model, Keras's counter running on), and the maps `write.write_maps` keys by the model's paths miss
those names. The twin is built with `TwinMaps`: each of its maps gives a path that no key names the policy of
the layer the path renames (`renamed_policies`), and records what it gave. Once the model's maps are keyed by
the twin's paths too, `TwinMaps.foresaw` reads whether they give every path what the twin was given: then the
twin is what `keras.models.load_model` builds from them, and its maps become theirs; else it is built again.
"""

import collections
import re

import keras

from kmix._tree import is_auto_named, resolved_policy, snake_case

_REGISTERED = "kmix_twin>DTypePolicyMap"  # the name each map takes in the twin's own copy of the config


def renamed_policies(plan):
    """`policy(path)`: the placed policy of the model's layer a reload names `path`, or None where none or several do.

    A reload may name a block's layers anew: after the model's own name (DINOV3's `encoder` becomes
    `dinov3_backbone_encoder`), or by Keras's counter, which runs on (`dense` becomes `dense_3`). Each step of
    `path` is then the model's step, that step after a prefix (`<name>_<step>`), or, for a step Keras named inside a
    block (the maps key it by a pattern), its class counted anew; a first step Keras named is keyed as it is, and a
    reload counting it anew takes the maps' default. Where the layers renamed so are placed otherwise, None.

    Args:
        plan: the placement's `rules.Plan`, its layers placed.

    Returns:
        A function of a path, giving a `keras.DTypePolicy` or None.

    Example:

    >>> renamed_policies(plan)("dinov3_backbone_layernorm").name   # the model's `layernorm`
    'float32'
    """
    by_path = {row.layer.path: row.layer for row in plan if row.layer.path}
    counted = {path: re.escape(snake_case(type(layer).__name__)) + r"(_\d+)?"  # keyed by a pattern too
               for path, layer in by_path.items() if "/" in path and is_auto_named(layer)}
    index = collections.defaultdict(list)  # (steps, last step or, where Keras named it, its class's) -> paths
    for path, layer in by_path.items():
        steps = path.split("/")
        for form in {steps[-1], snake_case(type(layer).__name__) if path in counted else steps[-1]}:
            index[len(steps), form].append(steps)
    found = {}

    def renames(theirs, ours):
        for i, (their, our) in enumerate(zip(theirs, ours)):
            pattern = counted.get("/".join(ours[: i + 1]))
            if not (their == our or their.endswith("_" + our) or (pattern and re.fullmatch(pattern, their))):
                return False
        return True

    def policy(path):
        if path not in found:
            steps, parts = path.split("/"), path.split("/")[-1].split("_")
            forms = {"_".join(parts[i:]) for i in range(len(parts))} | {re.sub(r"_\d+$", "", steps[-1])}
            ours = {"/".join(candidate) for form in forms for candidate in index.get((len(steps), form), ())
                    if renames(steps, candidate)}
            policies = {resolved_policy(by_path[p]).name: resolved_policy(by_path[p]) for p in ours}
            found[path] = next(iter(policies.values())) if len(policies) == 1 else None
        return found[path]

    return policy


class TwinMaps:
    """The `DTypePolicyMap`s of one twin: each answers a path its keys miss by `renamed(path)`, recording each answer.

    Args:
        renamed: `renamed_policies(plan)`.

    Example:

    >>> before = write.write_maps(plan)                      # keyed by the model's paths
    >>> maps = TwinMaps(renamed_policies(plan))
    >>> built = twin.build(model, [row.layer for row in plan], maps)
    >>> after = write.write_maps(plan, built.model, before.holders) if maps.missed() else before
    >>> maps.foresaw(before, after)                       # True: `built` is what a reload builds from them
    """

    def __init__(self, renamed):
        self.renamed, self.made = renamed, []
        self.map_class = type("TwinPolicyMap", (_AnsweringMap,), {"owner": self})

    def prepare(self, config):
        """Makes each `DTypePolicyMap` of `config` (the twin's own) one of `map_class`; returns `config`."""
        if isinstance(config, dict):
            if config.get("class_name") == "DTypePolicyMap" and str(config.get("module")).startswith("keras"):
                config["registered_name"] = _REGISTERED  # a registered name is looked up before Keras's own
            for value in config.values():
                self.prepare(value)
        elif isinstance(config, list):
            for value in config:
                self.prepare(value)
        return config

    def custom_objects(self):
        """`{registered name: map_class}`, for the twin's `custom_object_scope`."""
        return {_REGISTERED: self.map_class}

    def missed(self):
        """Whether a map was asked a path no key of its names (a reload's new name, a pattern left out)."""
        return any(held.missed for held in self.made)

    def foresaw(self, before, after):
        """Whether the maps written since give every path what the twin's maps gave it; if so, they become those.

        Args:
            before: the `write.Maps` the model held when it was serialized.
            after: the `write.Maps` it holds now.

        Returns:
            True where the twin is what a reload of the model as it is now builds: what its layers were given
            while it was built, and what they read from now on, is what the maps written give them.
        """
        if after is before and not self.missed():  # every answer a key's (or the default): no map changes
            for held in self.made:
                held.renamed = None
            return True
        now = []
        for held in self.made:
            if _policies(held) != held.written:
                return False  # written into while the twin was built: as a reload writes into it
            ours = all(held.written.get(key) == policy.name for key, policy in before.entries.items())
            if ours and after.default.name != held.default_policy.name:
                return False
            keys = dict(after.entries) if ours else {}
            for key in held:
                if not ours or key not in before.entries:  # a holder's own path; a map not the placement's
                    keys.setdefault(key, held.written_policy(key))
            written = keras.dtype_policies.DTypePolicyMap(held.default_policy, keys)
            for path, given in held.answers.items():
                try:
                    if written[path].name != given:
                        return False
                except ValueError:  # several keys match the path: a reload raises
                    return False
            now.append((held, keys))
        for held, keys in now:
            held.become(keys)
        return True


class _AnsweringMap(keras.dtype_policies.DTypePolicyMap):
    """A map of the twin's: its keys, else the policy of the layer a path renames; each answer recorded by name."""

    owner = None  # the `TwinMaps` it belongs to: a subclass per twin

    def __init__(self, default_policy=None, policy_map=None):
        super().__init__(default_policy, policy_map)
        self.renamed, self.answers, self.missed = self.owner.renamed, {}, set()
        self.written = _policies(self)
        self.owner.made.append(self)

    def __getitem__(self, path):
        policy = self._answer(path)
        self.answers[path] = policy.name
        return policy

    def _answer(self, path):
        policy = super().__getitem__(path)  # Keras's own match (an error where several keys match)
        if policy is not self.default_policy or self.renamed is None:
            return policy
        self.missed.add(path)  # no key matched: the default, one object, unless the layer is renamed
        renamed = self.renamed(path)
        return policy if renamed is None else renamed

    def written_policy(self, key):
        """The policy stored under `key`, read without an answer recorded."""
        return keras.dtype_policies.DTypePolicyMap.__getitem__(self, key)

    def become(self, keys):
        """Holds `keys` (`{key: policy}`) and answers by them alone, as the map a reload reads."""
        for key in list(self):
            del self[key]
        for key, policy in keys.items():
            self[key] = policy
        self.renamed, self.answers, self.missed = None, {}, set()
        self.written = _policies(self)


def _policies(held):
    """`{key: policy name}` of a twin's map, read without an answer recorded."""
    return {key: held.written_policy(key).name for key in held}
