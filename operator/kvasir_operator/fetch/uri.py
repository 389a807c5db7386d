"""A model's URI, parsed in this one place: `s3://bucket/prefix`, `pvc://claim/path` or a path.

The fetcher (`open_source`, the S3 source's bucket and prefix) and the operator's spec
(`spec.py:ModelSource`, which also requires a local path to be absolute: it is a path inside the
engine image) both read a URI here, so they cannot disagree on what it names. A URI that names
nothing raises `ModelUriError`, which each reader words for its own user (a CLI argument, a spec
field). Imports nothing of the fetcher: the operator reads it without boto3.
"""

from __future__ import annotations

from dataclasses import dataclass

S3, PVC, LOCAL = "s3", "pvc", "local"


class ModelUriError(ValueError):
    """`reason`: what is wrong, e.g. "s3:// needs a bucket"; `form`: the URI's expected shape
    ("s3://bucket/prefix"), None when the scheme itself is unknown."""

    def __init__(self, reason: str, form: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.form = reason, form

    @property
    def is_unknown_scheme(self) -> bool:
        return self.form is None


@dataclass(frozen=True)
class ModelUri:
    kind: str  # S3, PVC or LOCAL
    uri: str  # as written
    authority: str = ""  # s3: the bucket; pvc: the claim's name; local: ""
    # s3: the key prefix and pvc: the path inside the claim, both as written after the
    # authority's "/" (slashes kept); local: the path itself
    path: str = ""

    @property
    def key_prefix(self) -> str:
        """s3: the prefix of the objects' keys, ending in "/" unless it is empty."""
        prefix = self.path.strip("/")
        return prefix + "/" if prefix else ""


def parse_model_uri(uri: str) -> ModelUri:
    """Any string that is not s3:// or pvc:// and has no other scheme is a local path; an
    absolute path is one whatever it holds."""
    for kind, form, missing in ((S3, "s3://bucket/prefix", "a bucket"),
                                (PVC, "pvc://claim/path", "a claim name")):
        scheme = f"{kind}://"
        if uri.startswith(scheme):
            authority, _, path = uri[len(scheme):].partition("/")
            if not authority:
                raise ModelUriError(f"{scheme} needs {missing}", form)
            return ModelUri(kind, uri, authority, path)
    if "://" in uri and not uri.startswith("/"):
        raise ModelUriError("scheme must be s3://, pvc:// or a local path")
    return ModelUri(LOCAL, uri, path=uri)
