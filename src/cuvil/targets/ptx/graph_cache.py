"""The bounded CUDA-graph cache of a GPU model (issue 22): at most ``max_graphs`` captured graphs alive, one
per shape bucket, the least recently used destroyed first; per bucket it keeps what ``Model.stats()``
reports: captures, capture time, graph nodes and memory, hits, misses, evictions (kept after the graph is
evicted, so a bucket that thrashes shows it).

Pure Python: the values are opaque (the runtime stores ``(graph, graph_exec)`` and passes ``destroy``), so
the policy is tested without a GPU (tests/test_gpu_profiles.py, tests/test_gpu_bundle.py).
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, Hashable

from ...errors import CuvilError


class GraphCache:
    """At most ``max_graphs`` entries, least recently used evicted first (``destroy`` is called on each
    evicted entry). ``get`` counts a hit or a miss for its key; ``put`` a capture (with its seconds, nodes
    and bytes); totals and per-key figures in :meth:`stats`."""

    def __init__(self, max_graphs: int, destroy: Callable[[object], None]):
        if isinstance(max_graphs, bool) or int(max_graphs) < 1:
            raise CuvilError(f"max_graphs must be at least 1, got {max_graphs}",
                             hint="max_graphs=4 (the default) keeps four shape buckets' graphs alive")
        self.max_graphs = int(max_graphs)
        self._destroy = destroy
        self._entries: "collections.OrderedDict[Hashable, tuple]" = collections.OrderedDict()
        self.captures = self.hits = self.misses = self.evictions = 0
        self._per: Dict[Hashable, dict] = {}

    def _bucket(self, key: Hashable) -> dict:
        b = self._per.get(key)
        if b is None:
            b = self._per[key] = {"captures": 0, "capture_ms": 0.0, "last_capture_ms": 0.0, "nodes": 0,
                                  "graph_bytes": 0, "hits": 0, "misses": 0, "evictions": 0, "alive": False}
        return b

    def get(self, key: Hashable):
        """The entry of ``key`` (now the most recent), or None (a miss)."""
        got = self._entries.get(key)
        if got is None:
            self.misses += 1
            self._bucket(key)["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        self._bucket(key)["hits"] += 1
        return got[0]

    def put(self, key: Hashable, value, nbytes: int = 0, *, seconds: float = 0.0, nodes: int = 0) -> None:
        """Keep ``value`` for ``key`` (replacing and destroying an older one), evicting the least recently
        used entries beyond ``max_graphs``."""
        if key in self._entries:
            self._destroy(self._entries.pop(key)[0])
        self._entries[key] = (value, int(nbytes))
        self.captures += 1
        b = self._bucket(key)
        b["captures"] += 1
        b["capture_ms"] += 1e3 * float(seconds)
        b["last_capture_ms"] = 1e3 * float(seconds)
        b["nodes"], b["graph_bytes"], b["alive"] = int(nodes), int(nbytes), True
        while len(self._entries) > self.max_graphs:
            old_key, (old, _) = self._entries.popitem(last=False)
            self.evictions += 1
            ob = self._bucket(old_key)
            ob["evictions"] += 1
            ob["alive"] = False
            self._destroy(old)

    def clear(self) -> None:
        while self._entries:
            k, (v, _) = self._entries.popitem(last=False)
            self._bucket(k)["alive"] = False
            self._destroy(v)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        return list(self._entries)

    def per_bucket(self, name: Callable[[Hashable], str] = str) -> Dict[str, dict]:
        """Per key ever seen (``name(key)`` as the dict key): captures, capture_ms (total), last_capture_ms,
        nodes, graph_bytes, hits, misses, evictions, alive."""
        return {name(k): dict(v) for k, v in self._per.items()}

    def stats(self) -> dict:
        return {"graphs": len(self._entries), "max_graphs": self.max_graphs,
                "bytes": sum(n for _, n in self._entries.values()), "captures": self.captures,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "buckets": [_listify(k) for k in self._entries]}


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (tuple, list)) else x


__all__ = ["GraphCache"]
