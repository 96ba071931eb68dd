"""Metrics, predictions over a split, prediction dumps, plots, the ensemble, seed statistics and reports."""
