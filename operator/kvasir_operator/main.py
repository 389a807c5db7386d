"""`kvasir-operator run [--namespace NS ... | --all-namespaces]`: the operator's entrypoint.

Only wiring: import the handler modules (registering them with kopf), then run kopf with the
namespaces asked for. Settings live in handlers.configure (an on.startup handler), so running the
handlers module directly with `kopf run -m kvasir_operator.handlers` behaves the same.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

import kvasir_operator.autoscale.handlers  # noqa: F401  (the builtin autoscaler's kopf timer)
import kvasir_operator.handlers  # noqa: F401  (registers the reconcile handlers)


def _parser() -> argparse.ArgumentParser:
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
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kopf.configure(verbose=args.verbose)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
