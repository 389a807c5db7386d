"""`kvasir-fetch`: the initContainer entrypoint, and `kvasir-fetch manifest DIR`.

Every option also comes from `KVASIR_FETCH_<OPTION>` (the operator renders env, not args, for
anything a user may override) and boto3 reads the standard AWS_* variables itself. The process
exit code is the contract (errors.py); stdout stays empty so logs hold only progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .annotate import PodAnnotator
from .errors import EXIT_OK, UsageError, report_failure
from .fetcher import fetch
from .manifest import write_manifest
from .options import FetchOptions

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected bytes like 16777216 or 16MiB, got {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see kvasir-fetch --help)")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVASIR_FETCH_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvasir-fetch", description="Verified, resumable model download.")
    parser.add_argument(
        "source",
        nargs="?",
        default=_env("SOURCE"),
        help="s3://bucket/prefix, pvc://claim/path or a local directory",
    )
    parser.add_argument("dest", nargs="?", default=_env("DEST"), help="local target directory")
    parser.add_argument("--endpoint-url", default=_env("ENDPOINT_URL"))
    parser.add_argument("--region", default=_env("REGION"))
    parser.add_argument("--addressing-style", default=_env("ADDRESSING_STYLE", "auto"))
    parser.add_argument("--concurrency", type=int, default=_env("CONCURRENCY", "8"))
    parser.add_argument("--part-size", type=parse_bytes, default=_env("PART_SIZE", "16MiB"))
    parser.add_argument("--stall-timeout", type=float, default=_env("STALL_TIMEOUT", "60"))
    parser.add_argument("--retries", type=int, default=_env("RETRIES", "5"))
    parser.add_argument("--progress-interval", type=float, default=_env("PROGRESS_INTERVAL", "5"))
    parser.add_argument("--pvc-root", default=_env("PVC_ROOT", "/mnt/kvasir-pvc"))
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        default=(_env("ALLOW_UNVERIFIED", "") or "").lower() in ("1", "true", "yes"),
        help="accept a source with neither kvasir-manifest.json nor S3 SHA-256 checksums",
    )
    return parser


def options_from_args(args: argparse.Namespace) -> FetchOptions:
    try:
        return FetchOptions(
            endpoint_url=args.endpoint_url or None,
            region=args.region or None,
            addressing_style=args.addressing_style,
            concurrency=args.concurrency,
            part_size=args.part_size,
            stall_timeout=args.stall_timeout,
            retries=args.retries,
            allow_unverified=args.allow_unverified,
            progress_interval=args.progress_interval,
            pvc_root=args.pvc_root,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _manifest_command(argv: Sequence[str]) -> int:
    parser = _Parser(prog="kvasir-fetch manifest", description="Write DIR/kvasir-manifest.json.")
    parser.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        target, manifest = write_manifest(args.dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(
        f"kvasir-fetch: wrote {target}: {len(manifest.files)} files, "
        f"{manifest.total_bytes} bytes, {manifest.digest}",
        file=sys.stderr,
    )
    return EXIT_OK


def _fetch_command(argv: Sequence[str]) -> int:
    from .progress import Progress  # after argument errors, which need none of it

    args = build_parser().parse_args(argv)
    if not args.source or not args.dest:
        raise UsageError("SOURCE and DEST are required (or KVASIR_FETCH_SOURCE/KVASIR_FETCH_DEST)")
    options = options_from_args(args)
    progress = Progress(PodAnnotator.from_env(), options.progress_interval)
    progress.start()
    try:
        result = fetch(args.source, Path(args.dest), options, progress)
    except BaseException as exc:
        progress.finish("Failed", str(exc) or type(exc).__name__)
        raise
    message = "already present, verified earlier" if result.is_noop else "verified and published"
    progress.finish("Done", message)
    print(
        progress.summary_line() + (" (no-op)" if result.is_noop else ""),
        file=sys.stderr,
        flush=True,
    )
    return EXIT_OK


def run(argv: Sequence[str]) -> int:
    try:
        if argv and argv[0] == "manifest":
            return _manifest_command(argv[1:])
        return _fetch_command(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and an exit code
        return report_failure(exc)


def main(argv: Sequence[str] | None = None) -> int:
    code = run(list(sys.argv[1:] if argv is None else argv))
    if code != EXIT_OK and any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        # A worker is stuck in a read no timeout interrupts (the watchdog fired): do not wait.
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
