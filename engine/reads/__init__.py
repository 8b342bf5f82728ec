"""Reads over the base Lance table plus the memtables of the shards this process owns.

`engine.reader.Reader` is the face every caller uses; this package holds its parts, one
concern per module, in the order a query meets them:

- `context`: what every query kind shares (`ReadContext`: settings, events, request
  validation, the base worker pool, the statistics cache, `snapshot()`).
- `snapshot`: one query's consistent view (`Snapshot`: fresh memtable tiers, newest first,
  and one base version) and the base's over-fetch past rows a fresh memtable decides.
- `tiers`: the memtable tiers (`MemtableTier`) and the flushed memtables kept for text
  search (`FlushedTier`).
- `merge`: candidates of memtable batches, materialised only if they make the top k, and
  the merge of ranked parts.
- `stats`: base statistics cached per base version, refreshed in the background.
- `vector`, `text`, `scan`, `lookup`: one query kind each; `hybrid`: vector and text on
  one snapshot, with one request per owner pod for both.
"""
