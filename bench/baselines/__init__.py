"""Baseline servers that rill is measured against: the seed recipe and the usual chat Space."""
