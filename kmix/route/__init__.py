"""Choosing a route (a policy and a `jit_compile`), measured, with the reasons; `device` is `kmix.device`.

Imports run one way: timing <- facts <- probe <- rule <- data <- trials <- decision <- recommendation <- doctor.
"""
