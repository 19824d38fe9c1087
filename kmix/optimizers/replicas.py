"""Running part of a step on every replica together, or on none.

The decision (`finite`, or the end of an accumulation window) is the same on
every replica; the work it guards may contain collectives (an all-reduce) and
optimizer updates. Under a strategy that updates through
`ReplicaContext.merge_call` (`MirroredStrategy` and `MultiWorkerMirroredStrategy`
on CPUs, or without XLA) a merge call may not sit inside a `tf.cond` taken in
replica context, so the `tf.cond` is taken in cross-replica context and the
guarded work runs on each replica from there (`call_for_each_replica`).
Elsewhere (no strategy, XLA on GPUs) a plain `tf.cond` does it.
"""

import functools

import tensorflow as tf

from kmix._compat import strategy_supports_no_merge_call


def run_if(pred, fn, *args):
    """Calls `fn(*args)` on every replica where `pred` holds; does nothing where it does not.

    Args:
        pred: a boolean scalar, the same on every replica.
        fn: a function of `args`, called in replica context; returns nothing.
        *args: tensors (per-replica values in a replica context), lists of them or variables.

    Example:

    >>> run_if(finite, functools.partial(master_weights.apply_inner, optimizer), unscaled, variables)
    """
    if strategy_supports_no_merge_call():
        tf.cond(pred, lambda: _call(fn, args), lambda: None)
        return
    ctx = tf.distribute.get_replica_context()
    # `fn` goes in the merge function's closure: as an argument, each replica's own bound
    # method would be regrouped into a per-replica value. Every replica's `fn` is the same.
    ctx.merge_call(functools.partial(_cross_replica_run_if, fn=fn), args=(pred, args))


def _call(fn, args):
    fn(*args)


def _cross_replica_run_if(distribution, pred, args, fn):
    # Every replica holds the same `pred`: the first local one decides.
    pred = distribution.experimental_local_results(pred)[0]

    def branch():
        distribution.extended.call_for_each_replica(fn, args=args)

    tf.cond(pred, branch, lambda: None)
