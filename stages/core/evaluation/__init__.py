"""Metrics, predictions over a split, prediction dumps, plots and the ensemble."""
