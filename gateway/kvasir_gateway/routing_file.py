"""`RoutingFile`: the routing file (`--routing-file`), reloaded without a restart.

Checked every `key_reload_seconds` (2 s) like the key file (watched_file.py): a new version that
parses replaces the aliases, rules, cascades, shadows and prices at once for the requests that
arrive after it (a request in flight keeps the route it resolved); one that does not parse is
logged once with the field at fault, counted
(`kvasir_gateway_routing_reloads_total{outcome="error"}`), and the previous table stays.
"""

from __future__ import annotations

import logging

import yaml

from kvasir_gateway.aliases import RoutingTable, parse_routing_text
from kvasir_gateway.watched_file import WatchedFile

log = logging.getLogger("kvasir_gateway.routing_file")


class RoutingFile:
    def __init__(self, path: str, table: RoutingTable) -> None:
        """`table`: the version read at start (config.py), so a bad file fails the start."""
        self.file = WatchedFile(path)
        self.table = table
        try:
            self.file.read_if_changed()  # the stamp of the version `table` came from
        except (OSError, UnicodeDecodeError):
            pass

    def refresh(self) -> bool | None:
        """True: a new table is in force; False: a new version was refused; None: unchanged."""
        try:
            text = self.file.read_if_changed()
            if text is None:
                return None
            table = parse_routing_text(text, self.file.path)
        except (OSError, ValueError, UnicodeDecodeError, yaml.YAMLError) as exc:
            self.file.report(exc, f"the previous table ({len(self.table.aliases)} aliases)")
            return False
        self.table = table
        self.file.loaded()
        log.info("routing file %s reloaded: %d aliases, %d priced pools", self.file.path,
                 len(table.aliases), len(table.pools))
        return True
