"""TreePerf-like tables of a rank's ops: GPU time per op name over its subtree (``ops``), and the leaf ops that
launch kernels, grouped by name and input shapes (``kernel_launchers``)."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any

import numpy as np
import pandas as pd

from ...perf import needs_context
from ...perf.vllm import CONTEXT as VLLM_CONTEXT
from .decode import Args, json_text
from .model import RankModel, factorized

__all__ = ["LAUNCHER_COLUMNS", "op_keys", "op_tables"]

_DIMS, _TYPES = attrgetter("input_dims"), attrgetter("input_types")
LAUNCHER_COLUMNS = ["name", "input_dims", "input_types", "count", "gpu_time_us", "kernel_count", "top_kernels"]

_TOP = 3  # kernels named in a row's ``top_kernels``


def _top(counter: Counter[str]) -> str:
    return " | ".join(name for name, _ in counter.most_common(_TOP))


def op_tables(model: RankModel, is_op: np.ndarray, is_cpu_op: np.ndarray) -> tuple[pd.DataFrame, pd.DataFrame,
                                                                                  np.ndarray]:
    """TreePerf-like tables: GPU time per op name over its subtree, and the leaf ops that launch kernels; also
    each launched GPU event's leaf op (its position, -1 for none). ``is_op``, ``is_cpu_op``: per event, whether it
    is an op (a leaf op may launch kernels), and a CPU op."""
    tree, name_code, names, durs, args, g, launch_pos = (model.tree, model.name_code, model.names, model.dur,
                                                         model.args, model.gpu, model.launch_pos)
    order, parent = tree.order, tree.parent
    m = len(order)
    launched = launch_pos >= 0
    at = launch_pos[launched]
    kernel_ns = g.dur[launched]
    # Subtree totals from prefix sums over the tree order, where every subtree is a run of positions.
    gpu_ns = np.zeros(m + 1, dtype=np.int64)
    np.add.at(gpu_ns, at + 1, kernel_ns)
    gpu_ns = np.cumsum(gpu_ns)
    n_kernels = np.cumsum(np.bincount(at + 1, minlength=m + 1))
    sub_ns = gpu_ns[tree.stop] - gpu_ns[:m]
    sub_kernels = n_kernels[tree.stop] - n_kernels[:m]
    # Each position's op names up to its root and its innermost cpu_op, one depth at a time: a position's depth is
    # how many subtrees that start before it are still open. The names are a path in a trie (``paths``: each id's
    # parent id and op name), so that a chain of n nested ops costs n entries, not n²/2.
    up = np.asarray(parent, dtype=np.int64)
    depth = tree.depth
    op_at, cpu_op_at, code_at = is_op[order], is_cpu_op[order], name_code[order]
    path = np.zeros(m, dtype=np.int64)
    leaf = np.full(m, -1, dtype=np.int64)
    paths: list[tuple[int, int]] = [(0, -1)]  # id 0: the root, no op
    path_ids: dict[tuple[int, int], int] = {}
    by_depth = np.argsort(depth, kind="stable")
    cuts = np.flatnonzero(np.diff(depth[by_depth])) + 1
    for ks in np.split(by_depth, cuts):
        p = up[ks]
        inner = p >= 0
        path[ks[inner]], leaf[ks[inner]] = path[p[inner]], leaf[p[inner]]
        ops = ks[op_at[ks]]
        pairs, at_pair = np.unique(path[ops] * len(names) + code_at[ops], return_inverse=True)
        ids = []
        for key in zip(*(v.tolist() for v in np.divmod(pairs, len(names)))):
            i = path_ids.get(key)
            if i is None:
                i = path_ids[key] = len(paths)
                paths.append(key)
            ids.append(i)
        if ids:
            path[ops] = np.array(ids, dtype=np.int64)[at_pair]
        mine = ops[cpu_op_at[ops]]
        leaf[mine] = mine
    # Which kernels each op name launched: kernels summed per (op names on the path, kernel), then spread.
    by_path: dict[tuple[int, str], int] = {}
    for key, d in zip(zip(path[at].tolist(), g.name[launched]), kernel_ns.tolist()):
        by_path[key] = by_path.get(key, 0) + d
    op_kernels: dict[int, Counter[str]] = defaultdict(Counter)
    for (k, name), d in by_path.items():
        named: set[int] = set()  # an op name met twice on the way up (recursion) counts the kernel once
        while k:
            k, op = paths[k]
            if op not in named:
                named.add(op)
                op_kernels[op][name] += d
    total_gpu = int(g.dur.sum())
    rows = [(names[code], c, cpu, gns / 1e3, 100.0 * gns / total_gpu if total_gpu else 0.0, k,
             _top(op_kernels.get(code, Counter()))) for code, c, cpu, gns, k in _per_op(
        np.sort(order[is_op[order]]), name_code, durs, sub_ns, sub_kernels, tree.pos)]
    # the most GPU time first, then the most CPU time (as the column's floats compare), then by name
    rows.sort(key=lambda r: (-r[3], -float(r[2]), r[0]))
    ops = pd.DataFrame(rows, columns=["name", "count", "cpu_time_us", "gpu_time_us", "gpu_pct", "kernel_count",
                                      "top_kernels"])
    return ops, _launchers(leaf[at], g.code[launched], kernel_ns, order, code_at, names, args), leaf[at]


def op_keys(model: RankModel, through: Mapping[int, int]
            ) -> Callable[[np.ndarray], list[tuple[str, str, str, str, str]]]:
    """Tree positions' op names, args as compact JSON text and context (``op_perf``'s groups), each distinct text
    converted once. The context is, for an op whose model reads it (``perf.needs_context``), the name of the
    nearest enclosing event that the model's pattern matches (vLLM's batch annotation); for a backward op modelled
    through its forward op (``through``: position to the forward op's event), the forward op's name, and the args
    are the forward op's; else ""."""
    order, parent, name_code, names, args = (model.tree.order, model.tree.parent, model.name_code, model.names,
                                             model.args)
    seen: dict[tuple[int, bytes, bytes, bytes, str], tuple[str, str, str, str, str]] = {}
    contextual = {c for c, nm in enumerate(names) if needs_context(str(nm))}

    def context(p: int) -> str:
        q = parent[p]
        while q >= 0:
            nm = str(names[name_code[order[q]]])
            if VLLM_CONTEXT.match(nm):
                return nm
            q = parent[q]
        return ""

    def keys_of(positions: np.ndarray) -> list[tuple[str, str, str, str, str]]:
        pos = positions.tolist()
        codes = name_code[order[positions]].tolist()
        contexts = [str(names[name_code[through[p]]]) if p in through else context(p) if c in contextual else ""
                    for p, c in zip(pos, codes)]
        at = [through.get(p, i) for p, i in zip(pos, order[positions].tolist())]  # whose args
        raws = zip(codes, [bytes(args[i].input_dims) for i in at], [bytes(args[i].input_types) for i in at],
                   [bytes(args[i].concrete_inputs) for i in at], contexts)
        out = []
        for raw in raws:
            key = seen.get(raw)
            if key is None:
                key = seen[raw] = (str(names[raw[0]]), *map(json_text, raw[1:4]), raw[4])
            out.append(key)
        return out

    return keys_of


def _launchers(leaf: np.ndarray, kernel: np.ndarray, kernel_ns: np.ndarray, order: np.ndarray,
               code_at: np.ndarray, names: np.ndarray, args: list[Args]) -> pd.DataFrame:
    """The leaf ops that launched kernels, grouped by name, input shapes and input types (TraceLens's kernel
    launchers): per kernel launched, its leaf op's position (-1: none), name code and time (ns).

    Groups, and each group's kernels for ``top_kernels``, come in the order of their first kernel, leaf by leaf
    (a leaf's kernels together, in the order of its first), as a loop over the leaves would meet them."""
    has = leaf >= 0
    if not has.any():
        return pd.DataFrame([], columns=LAUNCHER_COLUMNS)
    leaf, kernel, kernel_ns = leaf[has], kernel[has], kernel_ns[has]
    leaves, first, at_leaf = np.unique(leaf, return_index=True, return_inverse=True)
    seen = np.argsort(first, kind="stable")  # the leaves by their first kernel
    place = np.empty_like(seen)
    place[seen] = np.arange(len(seen))
    at_leaf = place[at_leaf]
    leaf_args = [args[i] for i in order[leaves[seen]].tolist()]
    # grouped by the args' text as in the file first (few distinct), then by their text as JSON (a null is absent)
    raw_code, raws = factorized(list(zip(code_at[leaves[seen]].tolist(), map(bytes, map(_DIMS, leaf_args)),
                                          map(bytes, map(_TYPES, leaf_args)))))
    key_code, keys = factorized([(names[c], json_text(d), json_text(t)) for c, d, t in raws])
    group = key_code[raw_code][at_leaf]  # each kernel's
    n = len(keys)
    gpu_ns = np.zeros(n, dtype=np.int64)
    np.add.at(gpu_ns, group, kernel_ns)
    # each group's kernels by time, ties in the order a loop would meet them (Counter.most_common)
    met = np.argsort(at_leaf, kind="stable")
    pair = group[met] * len(names) + kernel[met]
    pairs, first_met, pair_at = np.unique(pair, return_index=True, return_inverse=True)
    pair_ns = np.zeros(len(pairs), dtype=np.int64)
    np.add.at(pair_ns, pair_at, kernel_ns[met])
    pair_group, pair_kernel = np.divmod(pairs, len(names))
    by = np.lexsort((first_met, -pair_ns, pair_group))
    top: list[list[str]] = [[] for _ in range(n)]
    for r, k in zip(pair_group[by].tolist(), pair_kernel[by].tolist()):
        if len(top[r]) < _TOP:
            top[r].append(names[k])
    name, dims, types = (np.array(v, dtype=object) for v in zip(*keys))
    gpu_us = gpu_ns / 1e3
    by = np.lexsort((dims, name, -gpu_us))  # the most GPU time first, then by name and shapes
    return pd.DataFrame(dict(zip(LAUNCHER_COLUMNS, (
        name[by], dims[by], types[by], np.bincount(key_code[raw_code], minlength=n)[by], gpu_us[by],
        np.bincount(group, minlength=n)[by], [" | ".join(top[i]) for i in by.tolist()]))))


def _per_op(ops: np.ndarray, name_code: np.ndarray, durs: np.ndarray, sub_ns: np.ndarray, sub_kernels: np.ndarray,
            pos: np.ndarray) -> Iterable[tuple[int, int, Any, int, int]]:
    """Per op name: (name code, count, CPU time as Python sums it in input order, GPU ns, kernels)."""
    if not len(ops):
        return []
    by = np.argsort(name_code[ops], kind="stable")
    ops, codes = ops[by], name_code[ops[by]]
    first = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    at = pos[ops]
    return zip(codes[first].tolist(), np.diff(np.r_[first, len(ops)]).tolist(),
               np.add.reduceat(durs[ops], first).tolist(), np.add.reduceat(sub_ns[at], first).tolist(),
               np.add.reduceat(sub_kernels[at], first).tolist())
