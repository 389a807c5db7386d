"""Fixtures for tests/operator; the helpers live in operator_support.py (unique module name)."""

from operator_support import aws_env, s3, upload  # noqa: F401
