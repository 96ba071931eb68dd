"""Metrics, each task's best dev epoch (`selection`), predictions over a split, prediction dumps, plots, the
ensemble, seed statistics and reports."""
