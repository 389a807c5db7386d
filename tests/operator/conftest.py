"""Fixtures for tests/operator; the helpers live in operator_support.py and autoscale_fakes.py
(unique module names)."""

from autoscale_fakes import engines  # noqa: F401
from operator_support import aws_env, s3, upload  # noqa: F401
