"""One-question probes: each answered a question of its own, whose report is in docs/experiments/; kept
to ask it again (`python -m bench.probes.<name>`), not part of `python -m bench`."""
