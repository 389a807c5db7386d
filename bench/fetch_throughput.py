"""kvasir-fetch throughput against S3 on loopback (moto's server), by concurrency and part size.

Compared in the same run with boto3's plain `download_file`, one file after the other (what a
simple storage initializer does), with its default TransferConfig and with threads off. The
kvasir-fetch figures are end to end: ranged GETs, writes, SHA-256 of every byte, publish.
moto serves from one Python process, so on a small machine the server, not the client, is the
ceiling; the figures compare strategies on one machine, they are not S3's throughput. Worse for
ranged GETs: moto answers each one by copying the *whole* object under a per-object lock, so
parallel parts of one file are serialised there and small parts cost O(file) each. The
`local source` row (the same transfer engine reading a local file, as for pvc://) shows what the
client side sustains on this machine when the server is not the limit. Each figure is the best of
`--repeats` runs (the machine is shared).

    python bench/fetch_throughput.py            # ~1-2 min; writes bench/results/fetch_throughput.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from kvasir_operator.fetch.fetcher import fetch
from kvasir_operator.fetch.manifest import MANIFEST_NAME, Manifest, ManifestFile
from kvasir_operator.fetch.options import FetchOptions, MiB
from kvasir_operator.fetch.progress import Progress

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET, PREFIX = "bench-models", "llama"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        ["moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def upload_model(client: Any, num_files: int, file_mib: int) -> Manifest:
    import hashlib

    client.create_bucket(Bucket=BUCKET)
    files = []
    for index in range(num_files):
        data = os.urandom(file_mib * MiB)
        name = f"model-{index + 1:05d}-of-{num_files:05d}.safetensors"
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=data)
        files.append(ManifestFile(name, len(data), hashlib.sha256(data).hexdigest()))
    manifest = Manifest(files=tuple(files))
    body = json.dumps(manifest.to_json()).encode()
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{MANIFEST_NAME}", Body=body)
    return manifest


def time_kvasir(uri: str, endpoint: str, dest: Path, concurrency: int, part_mib: int) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    options = FetchOptions(endpoint_url=endpoint, concurrency=concurrency, part_size=part_mib * MiB)
    progress = Progress(None, interval=3600)
    start = time.perf_counter()
    fetch(uri, dest, options, progress)
    return time.perf_counter() - start


def best_of(repeats: int, run: Any) -> float:
    return min(run() for _ in range(repeats))


def time_download_file(client: Any, manifest: Manifest, dest: Path, use_threads: bool) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    config = TransferConfig(use_threads=use_threads)
    start = time.perf_counter()
    for entry in manifest.files:
        client.download_file(
            BUCKET, f"{PREFIX}/{entry.path}", str(dest / entry.path), Config=config
        )
    return time.perf_counter() - start


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    concurrencies = report["concurrencies"]
    width = 0.8 / len(report["part_sizes_mib"])
    for offset, part in enumerate(report["part_sizes_mib"]):
        rows = [r for r in report["kvasir"] if r["part_mib"] == part]
        xs = [i + offset * width for i in range(len(concurrencies))]
        ax.bar(xs, [r["mb_per_s"] for r in rows], width, label=f"kvasir-fetch, {part} MiB parts")
    local = report["local_source"]
    ax.axhline(
        local["mb_per_s"],
        color="tab:green",
        linestyle="-.",
        label="kvasir-fetch, local source (client-side ceiling)",
    )
    styles = iter(["--", ":"])
    for name, row in report["baselines"].items():
        ax.axhline(row["mb_per_s"], color="black", linestyle=next(styles), label=name)
    ax.set_xticks(
        [i + width * (len(report["part_sizes_mib"]) - 1) / 2 for i in range(len(concurrencies))]
    )
    ax.set_xticklabels([f"concurrency {c}" for c in concurrencies])
    ax.set_ylabel("MB/s (end to end, incl. SHA-256 for kvasir-fetch)")
    ax.set_title(
        f"{report['model_mib']} MiB model from moto S3 on loopback ({report['cpus']} CPUs)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--file-mib", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--part-mib", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    moto, endpoint = start_moto()
    work = Path(tempfile.mkdtemp(prefix="kvasir-fetch-bench-"))
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        manifest = upload_model(client, args.files, args.file_mib)
        mb = manifest.total_bytes / 1e6
        uri = f"s3://{BUCKET}/{PREFIX}"
        baselines = {}
        for name, threads in (
            ("download_file, default TransferConfig", True),
            ("download_file, use_threads=False", False),
        ):
            seconds = best_of(
                args.repeats,
                lambda t=threads: time_download_file(client, manifest, work / "baseline", t),
            )
            baselines[name] = {"seconds": round(seconds, 3), "mb_per_s": round(mb / seconds, 1)}
            print(f"{name:42s} {seconds:7.2f} s {mb / seconds:8.1f} MB/s", flush=True)
        rows = []
        for part in args.part_mib:
            for conc in args.concurrency:
                seconds = best_of(
                    args.repeats,
                    lambda c=conc, p=part: time_kvasir(uri, endpoint, work / "kvasir", c, p),
                )
                rows.append(
                    {
                        "concurrency": conc,
                        "part_mib": part,
                        "seconds": round(seconds, 3),
                        "mb_per_s": round(mb / seconds, 1),
                    }
                )
                print(
                    f"kvasir-fetch concurrency={conc:<3d} part={part:>2d} MiB      "
                    f"{seconds:7.2f} s {mb / seconds:8.1f} MB/s",
                    flush=True,
                )
        # The client-side ceiling: the same engine reading a local copy (the pvc:// path).
        time_kvasir(uri, endpoint, work / "local-src", 8, 32)
        (work / "local-src" / MANIFEST_NAME).write_text(json.dumps(manifest.to_json()))
        seconds = best_of(
            args.repeats,
            lambda: time_kvasir(str(work / "local-src"), endpoint, work / "kvasir", 8, 32),
        )
        local = {
            "concurrency": 8,
            "part_mib": 32,
            "seconds": round(seconds, 3),
            "mb_per_s": round(mb / seconds, 1),
        }
        print(
            f"kvasir-fetch local source, conc=8 part=32 MiB {seconds:7.2f} s {mb / seconds:8.1f} MB/s"
        )
        report = {
            "model_mib": manifest.total_bytes // MiB,
            "files": args.files,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "boto3": boto3.__version__,
            "concurrencies": args.concurrency,
            "part_sizes_mib": args.part_mib,
            "repeats": args.repeats,
            "baselines": baselines,
            "kvasir": rows,
            "local_source": local,
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fetch_throughput.json").write_text(json.dumps(report, indent=2) + "\n")
        plot(report, RESULTS / "fetch_throughput.png")
        print(f"wrote {RESULTS / 'fetch_throughput.json'} and .png", file=sys.stderr)
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
