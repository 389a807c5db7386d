"""`kvasir-operator run [--namespace NS ... | --all-namespaces]`: the operator's entrypoint.

Only wiring: build the one `Settings` from the environment and the command line, import the
handler module (registering it with kopf), then run kopf with the namespaces asked for and the
settings in its memo. kopf's own settings live in handlers.configure (an on.startup handler),
which builds the same `Settings` from the environment when the handlers module runs directly
(`kopf run -m kvasir_operator.handlers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping

import kopf

import kvasir_operator.handlers  # noqa: F401  (registers the reconcile handlers)
from kvasir_operator.metrics import OperatorMetrics
from kvasir_operator.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvasir-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator against the current kubeconfig")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable; glob patterns allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="watch every namespace (the default when no --namespace is given)")
    run.add_argument("--liveness", default=None,
                     help="serve kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--kubeconfig", default=None,
                     help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config; "
                          "ignored in a pod, which uses its service account)")
    run.add_argument("--context", default=None, help="kubeconfig context (default: current)")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve the operator's Prometheus metrics (kvasir_operator_*) on this "
                          "port at /metrics (default: not served)")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def settings_of(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """The one Settings: the environment's, with the command line's choices over it."""
    settings = Settings.from_env(env)
    return dataclasses.replace(settings, kubeconfig=args.kubeconfig or settings.kubeconfig,
                               context=args.context)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def configure_logging(verbose: bool) -> None:
    """kopf's handler on the root logger, and no other: a second one (logging.basicConfig)
    printed every line twice."""
    kopf.configure(verbose=verbose)
    if not verbose:  # httpx logs every API request at INFO
        logging.getLogger("httpx2").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    settings = settings_of(args, os.environ)
    metrics = OperatorMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness,
             memo=kopf.Memo(settings=settings, metrics=metrics, cluster_wide=not args.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
