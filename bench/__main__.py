"""`python -m bench`: the whole benchmark suite (bench/suite.py)."""

from bench.suite import app

app()
