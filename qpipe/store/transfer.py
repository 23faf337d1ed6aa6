"""`qpipe cache push/pull`: copy entries and their aliases from one store to another, verified.

The source entry is opened with full checksum verification before anything is written, and the
destination commits it under the same marker (files first, marker last), so a copy is as
trustworthy as the original and an interrupted copy leaves nothing visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qpipe.store.base import Store, StoreError


@dataclass
class TransferReport:
    copied: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{len(self.copied)} entries copied, {len(self.present)} already there, "
            f"{len(self.aliases)} aliases set"
        )


def resolve_refs(store: Store, refs: Sequence[str]) -> tuple[list[str], dict[str, dict]]:
    """Entry keys and alias records named by `refs` (keys, unique key prefixes or aliases);
    no refs means every entry of the store and the aliases that point at one (a dangling alias
    is not copied: it would dangle in the target too). Naming a dangling alias is a DanglingAlias
    error that says how to fix it."""
    aliases = store.aliases()
    if not refs:
        keys = [meta.key for meta in store.entries()]
        present = set(keys)
        return keys, {alias: r for alias, r in aliases.items() if r["key"] in present}
    keys: list[str] = []
    chosen: dict[str, dict] = {}
    all_keys: list[str] | None = None
    for ref in refs:
        if ref in aliases:
            store.resolve_alias(ref)  # raises DanglingAlias for an alias whose entry is gone
            chosen[ref] = aliases[ref]
            keys.append(aliases[ref]["key"])
            continue
        if store.lookup(ref) is not None:
            keys.append(ref)
            continue
        if all_keys is None:
            all_keys = [meta.key for meta in store.entries()]
        matches = [key for key in all_keys if key.startswith(ref)]
        if len(matches) != 1:
            problem = "matches several entries" if matches else "is no key, key prefix or alias"
            raise StoreError(f"{ref!r} {problem} in {store.location} (see `qpipe cache ls`)")
        keys.append(matches[0])
    for alias, record in aliases.items():
        if record["key"] in keys:
            chosen.setdefault(alias, record)
    return list(dict.fromkeys(keys)), chosen


def copy_entries(source: Store, target: Store, refs: Sequence[str] = ()) -> TransferReport:
    """Copy the named entries (and aliases pointing at them) from source to target."""
    keys, aliases = resolve_refs(source, refs)
    report = TransferReport()
    for key in keys:
        if target.lookup(key) is not None:
            report.present.append(key)
            continue
        meta = source.lookup(key)
        if meta is None:
            raise StoreError(f"entry {key[:12]} vanished from {source.location} during the copy")
        target.import_entry(meta, source.open(key, verify=True))
        report.copied.append(key)
    for alias, record in aliases.items():
        info = {name: value for name, value in record.items() if name != "key"}
        target.set_alias(alias, record["key"], info)
        report.aliases.append(alias)
    return report
