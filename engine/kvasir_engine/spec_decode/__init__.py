"""Speculative decoding on the device side: the proposers (`ngram.py`, `draft.py`) and the
acceptance rule (`rejection.py`). The core decides who proposes (core/spec_policy.py); the
model runner verifies (docs/speculative.md)."""
