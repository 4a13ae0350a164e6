"""Speculative decoding: proposers (EAGLE family, draft model, n-gram) and metrics."""
