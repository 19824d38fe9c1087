"""Benchmarks run by `python -m kmix bench ...`; each module has `main(argv=None)`."""
