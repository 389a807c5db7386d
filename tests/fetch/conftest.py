"""Fixtures for tests/fetch; the helpers live in fetch_support.py (unique module name)."""

from fetch_support import proxy, s3, upload  # noqa: F401
