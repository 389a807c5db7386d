"""kvasir-fetch: verified, resumable model download (S3 or a mounted path -> local disk).

The reusable API for the operator (capacity checks before scheduling):
`open_source(uri, options)`, `read_catalog(source)` / `read_manifest(source)`, and
`source.read_small("config.json")`.
"""

from .catalog import Catalog, read_catalog, read_manifest
from .errors import FetchError
from .manifest import MANIFEST_NAME, Manifest, ManifestFile, build_manifest
from .objects import ObjectInfo, Source
from .options import FetchOptions
from .source import open_source

__all__ = [
    "MANIFEST_NAME",
    "Catalog",
    "FetchError",
    "FetchOptions",
    "Manifest",
    "ManifestFile",
    "ObjectInfo",
    "Source",
    "build_manifest",
    "open_source",
    "read_catalog",
    "read_manifest",
]
