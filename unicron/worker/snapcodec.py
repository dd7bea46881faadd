"""A state tree (state_dicts, extra, RNG states) as JSON plus a flat list of tensors: no pickle.

``Encoder.encode(tree, path)`` returns a JSON-ready copy of ``tree`` in which the i-th tensor
is replaced by ``{"__tensor__": i}``, and collects the tensors in ``Encoder.tensors`` and their
``(dtype, shape, stride)`` in ``Encoder.specs``; ``Layout(specs)`` gives every tensor a 64-byte
aligned offset in one flat byte buffer and a record ``{"dtype": "float32", "shape": [...],
"offset": o, "nbytes": n}`` (plus ``"stride"`` for a permuted, dense tensor).
``decode(obj, load_tensor)`` rebuilds the tree with exactly the Python types it had,
``load_tensor(i)`` supplying the i-th tensor.

Plain JSON carries None, bools, ints, finite floats, strings, lists and dicts whose keys are
strings not starting with ``__``. Everything else is a one-tag object, the tag a key starting
with ``__``: ``__float__`` (nan/inf), ``__tuple__``, ``__set__``, ``__bytes__``,
``__bytearray__``, ``__complex__``, ``__dtype__``, ``__device__``, ``__size__``, ``__tensor__``,
``__dtensor__`` (a DTensor's local tensor and global shape: ``LocalShard``)
and ``__map__`` (a dict with other keys, e.g. an optimizer's int parameter ids, an
``OrderedDict`` with the ``_metadata`` that ``Module.load_state_dict`` reads, a ``Counter``).
Exact types only: a subclass (numpy's float64, an IntEnum) would come back as its base class,
so it is refused at commit with its path, not silently changed at restore.
"""

from __future__ import annotations

import base64
import collections
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from unicron.worker.errors import SnapshotTypeError

ALIGN = 64  # bytes: every tensor starts on a cache line (and any dtype's alignment)

_SCALARS = (type(None), bool, int, str)  # exactly representable in JSON
_MAPS: dict[str, type] = {"dict": dict, "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
_MAP_NAMES = {cls: name for name, cls in _MAPS.items()}
_KEY_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_DTYPE_NAMES: dict[torch.dtype, str] = {}  # cache: str(dtype) shows in the per-tensor cost


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _dense_permuted(t: torch.Tensor) -> bool:
    """Non-contiguous but covering its elements exactly once (e.g. a transpose): its strides can
    be rebuilt on restore. Views with gaps or overlaps come back contiguous."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class Layout:
    """Where each tensor of a commit lives in the flat buffer: ``records[i]`` describes
    ``{"__tensor__": i}`` as ``{"dtype", "shape", "offset", "nbytes"[, "stride"]}``. Built once
    per distinct ``specs`` (the list of ``(dtype, shape, stride or None)``), so a training loop
    whose state keeps its shapes pays for it, and for its JSON, once."""

    def __init__(self, specs: list[tuple[torch.dtype, torch.Size, tuple[int, ...] | None]]) -> None:
        self.specs = specs
        self.records: list[dict[str, Any]] = []
        end = 0
        for dtype, shape, stride in specs:
            numel = 1
            for n in shape:
                numel *= n
            offset = align(end)
            record: dict[str, Any] = {"dtype": dtype_name(dtype), "shape": list(shape), "offset": offset,
                                      "nbytes": numel * dtype.itemsize}
            if stride is not None:
                record["stride"] = list(stride)
            self.records.append(record)
            end = offset + record["nbytes"]
        self.nbytes = end
        self.records_json = json.dumps(self.records, separators=(",", ":"))


Path = Any  # str at the root, else (parent path, how, key): formatted only for an error message


def path_text(path: Path) -> str:
    """``model['layers.0.weight']``, ``extra['log'][3]``, ``rng{}``... from a lazy path."""
    if isinstance(path, str):
        return path
    parent, how, key = path
    head = path_text(parent)
    if how == "item":
        return f"{head}[{key!r}]"
    if how == "index":
        return f"{head}[{key}]"
    if how == "set":
        return f"{head}{{}}"
    if how == "key":
        return f"{head} key {key!r}"
    return f"{head}.{key}"


class Encoder:
    """Encodes one commit's tree; ``tensors[i]`` is the tensor of record ``__tensor__: i``.

    Runs on every commit, so paths are tuples built per node and formatted only when
    something is refused (an f-string per node cost more than the rest of the walk)."""

    def __init__(self, memo: dict[Any, tuple[Any, Any]] | None = None) -> None:
        self.tensors: list[torch.Tensor] = []
        self.specs: list[tuple[torch.dtype, torch.Size, tuple[int, ...] | None]] = []
        # path -> (value, its encoding) from an earlier commit, for subtrees without tensors
        # that come back equal every time (module state_dicts' version metadata)
        self._memo = memo

    def encode(self, x: Any, path: Path) -> Any:
        kind = type(x)
        if kind in _SCALARS:
            return x
        if kind is float:
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if kind is torch.Tensor or kind is torch.nn.Parameter or isinstance(x, torch.Tensor):
            return self._tensor(x, path)
        if kind is list or kind is tuple:
            if all(type(v) in _SCALARS for v in x):  # fast path, e.g. a list of step counters
                items = list(x)
            else:
                items = [self.encode(v, (path, "index", i)) for i, v in enumerate(x)]
            return items if kind is list else {"__tuple__": items}
        if kind in _MAP_NAMES:
            return self._map(x, path)
        if kind is set:
            return {"__set__": [self.encode(v, (path, "set", None)) for v in x]}
        if kind is complex:
            return {"__complex__": [self.encode(x.real, path), self.encode(x.imag, path)]}
        if kind is bytes or kind is bytearray:
            return {f"__{kind.__name__}__": base64.b64encode(x).decode("ascii")}
        if kind is torch.dtype:
            return {"__dtype__": dtype_name(x)}
        if kind is torch.device:
            return {"__device__": str(x)}
        if kind is torch.Size:
            return {"__size__": list(x)}
        raise _refuse(path, x)

    def _map(self, x: dict[Any, Any], path: Path) -> Any:
        if type(x) is dict and _plain_keys(x):
            return {k: self.encode(v, (path, "item", k)) for k, v in x.items()}
        out: dict[str, Any] = {
            "__map__": _MAP_NAMES[type(x)],
            "items": [[self._key(k, path), self.encode(v, (path, "item", k))] for k, v in x.items()],
        }
        metadata = getattr(x, "_metadata", None)
        if metadata is not None:  # module state_dicts carry versions load_state_dict reads
            out["meta"] = self._remembered(metadata, (path, "attr", "_metadata"))
        return out

    def _remembered(self, x: Any, path: Path) -> Any:
        """``encode(x)``, reusing the previous commit's encoding when ``x`` is equal to its value."""
        if self._memo is None:
            return self.encode(x, path)
        key = _flat_metadata(x)
        if key is None:  # not the shape module metadata has: no shortcut
            return self.encode(x, path)
        seen = self._memo.get(path)
        if seen is not None and seen[0] == key:
            return seen[1]
        encoded = self.encode(x, path)
        self._memo[path] = (key, encoded)
        return encoded

    def _key(self, k: Any, path: Path) -> Any:
        if type(k) is tuple:
            return {"__tuple__": [self._key(v, path) for v in k]}
        if type(k) not in _KEY_TYPES:
            raise _refuse((path, "key", k), k)
        return self.encode(k, path)

    def _tensor(self, t: torch.Tensor, path: Path) -> dict[str, Any]:
        if type(t).__name__ == "DTensor" and callable(getattr(t, "to_local", None)):
            # FSDP2 (fully_shard), tensor parallel: this rank's part, and the global shape. The
            # mesh and placements are the live object's at restore (``unicron.worker.shards``).
            local = t.to_local()  # type: ignore[attr-defined]
            return {"__dtensor__": self._tensor(local, (path, "attr", "to_local()")), "shape": list(t.shape)}
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided \
                or t.dtype in _QUANTIZED or t.is_meta or t.is_nested:
            raise SnapshotTypeError(f"unicron.State cannot snapshot {path_text(path)}: {type(t).__qualname__} with layout "
                            f"{t.layout}, dtype {t.dtype} on {t.device}; use plain dense tensors")
        stride = t.stride() if not t.is_contiguous() and _dense_permuted(t) else None
        self.specs.append((t.dtype, t.shape, stride))
        self.tensors.append(t)
        return {"__tensor__": len(self.tensors) - 1}


class LocalShard:
    """A DTensor as a snapshot holds it: this rank's local tensor and the global shape. Made a
    DTensor again, with the live object's mesh and placements, by ``unicron.worker.shards``."""

    __slots__ = ("local", "shape")

    def __init__(self, local: torch.Tensor, shape: torch.Size) -> None:
        self.local, self.shape = local, shape

    def __repr__(self) -> str:
        return f"LocalShard(local={tuple(self.local.shape)}, shape={tuple(self.shape)})"


def _flat_metadata(x: Any) -> tuple[Any, ...] | None:
    """A value that equals another's only when both encode the same, for module metadata
    (``{str: {str: int, bool, str or None}}``): keys and values with their exact types. None for
    anything else (not memoized)."""
    if type(x) not in (dict, collections.OrderedDict):
        return None
    out: list[Any] = [type(x)]
    for k, v in x.items():
        if type(k) is not str or type(v) is not dict:
            return None
        items = tuple((a, type(b), b) for a, b in v.items())
        if any(type(a) is not str or kind not in _SCALARS for a, kind, _ in items):
            return None
        out.append((k, items))
    return tuple(out)


_PLAIN_KEYS: dict[tuple[Any, ...], bool] = {}  # (keys, their types) seen -> all plain JSON keys


def _plain_keys(x: dict[Any, Any]) -> bool:
    """Every key a string not starting with ``__`` (memoized: the same dicts come every commit;
    the key's types are part of the memo, since a str subclass equals its str)."""
    keys = (tuple(x), tuple(map(type, x)))
    plain = _PLAIN_KEYS.get(keys)
    if plain is None:
        plain = all(type(k) is str and not k.startswith("__") for k in keys[0])
        if len(_PLAIN_KEYS) > 4096:
            _PLAIN_KEYS.clear()
        _PLAIN_KEYS[keys] = plain
    return plain


def _refuse(path: Path, x: object) -> SnapshotTypeError:
    from unicron.worker.generators import as_stateful

    hint = ""
    if as_stateful(x) is not None:  # State takes it by name, not inside extra
        name = path[2] if isinstance(path, tuple) and isinstance(path[2], str) and path[2].isidentifier() else "gen"
        hint = f" (a random generator: pass it to State by name, State(..., {name}=it))"
    return SnapshotTypeError(
        f"unicron.State cannot snapshot {path_text(path)} of type {type(x).__qualname__}: use tensors, "
        f"python scalars/strings, and lists/tuples/dicts of them{hint}"
    )


def decode(obj: Any, load_tensor: Callable[[int], torch.Tensor]) -> Any:
    """The tree ``Encoder.encode`` was given, with ``load_tensor(record)`` for each tensor."""
    if isinstance(obj, list):
        return [decode(v, load_tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj  # None, bool, int, float, str as JSON gave them
    tag = next((k for k in obj if k.startswith("__")), None)
    if tag is None:
        return {k: decode(v, load_tensor) for k, v in obj.items()}
    value = obj[tag]
    if tag == "__tensor__":
        return load_tensor(value)
    if tag == "__tuple__":
        return tuple(decode(v, load_tensor) for v in value)
    if tag == "__map__":
        out = _MAPS[value]()
        for k, v in obj["items"]:
            out[decode(k, load_tensor)] = decode(v, load_tensor)
        if "meta" in obj:
            out._metadata = decode(obj["meta"], load_tensor)
        return out
    if tag == "__float__":
        return float(value)
    if tag == "__set__":
        return {decode(v, load_tensor) for v in value}
    if tag == "__complex__":
        return complex(decode(value[0], load_tensor), decode(value[1], load_tensor))
    if tag in ("__bytes__", "__bytearray__"):
        raw = base64.b64decode(value)
        return raw if tag == "__bytes__" else bytearray(raw)
    if tag == "__dtype__":
        return dtype_from_name(value)
    if tag == "__device__":
        return torch.device(value)
    if tag == "__size__":
        return torch.Size(value)
    if tag == "__dtensor__":
        return LocalShard(decode(value, load_tensor), torch.Size(obj["shape"]))
    raise ValueError(f"unknown tag {tag!r} in snapshot metadata")
