"""Choosing a route (a policy and a `jit_compile`), measured, with the reasons.

Imports run one way: facts <- probe <- trials <- decision <- recommendation <- doctor,
with timing and rule below them all; `device` is `kmix.device`.
"""
