"""kvkit: KV-cache-aware routing for LLM serving, and a fleet simulator that routes with the
same code (Python bindings of the Rust crates kvblock, kvroute, kvroute-vllm and kvsim).

- ``BlockHasher(block_size).hash(tokens)``: block hashes, equal to kvblock's.
- ``Router(block_size, policy="kv", overlap_weight=1.0, ...)``: feed it the engines' KV events
  (``apply_vllm_batch`` for vLLM/SGLang payloads), ``route`` requests, ``finish`` them.
- ``simulate(**flags)``, ``sweep``, ``capacity``, ``calibrate``: the ``kvsim`` command's
  reports as dicts; every ``kvsim`` flag is a keyword (``des_instances=8`` is
  ``--des-instances 8``).
- ``to_pandas(result)``: a DataFrame of any of those results (needs pandas).

Every error is a ``KvkitError`` (a ``ValueError``): ``HashError``, ``RouteError``,
``EventError``, ``SnapshotError``, ``SimError``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Sequence, Union, cast

from ._kvkit import (
    BlockHasher,
    Candidate,
    Decision,
    EventError,
    HashError,
    KvkitError,
    RouteError,
    Router,
    SimError,
    SnapshotError,
    __version__,
    _bench_route,
    _run,
)

__all__ = [
    "BlockHasher",
    "Candidate",
    "Decision",
    "EventError",
    "HashError",
    "KvkitError",
    "RouteError",
    "Router",
    "SimError",
    "SnapshotError",
    "__version__",
    "calibrate",
    "capacity",
    "flags_to_argv",
    "kvsim",
    "simulate",
    "sweep",
    "to_pandas",
    "trace_stats",
]

FlagValue = Union[str, int, float, bool, None, "os.PathLike[str]", Sequence[Any]]


def _value(name: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, os.PathLike):
        return str(os.fspath(v))
    raise TypeError(
        f"flag {name}: a value of type {type(v).__name__}; expected str, int, float, bool, "
        "a path or a list of them"
    )


def flags_to_argv(flags: Mapping[str, FlagValue]) -> List[str]:
    """The ``kvsim`` arguments of keyword flags: ``des_instances=8`` gives
    ``["--des-instances", "8"]``, ``True`` a bare flag, ``False`` and ``None`` nothing, a list or
    tuple its items joined by commas."""
    argv: List[str] = []
    for key, v in flags.items():
        flag = "--" + key.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(flag)
        elif isinstance(v, (list, tuple)):
            argv += [flag, ",".join(_value(key, x) for x in v)]
        else:
            argv += [flag, _value(key, v)]
    return argv


def kvsim(*args: Union[str, "os.PathLike[str]"]) -> str:
    """Runs ``kvsim`` with these arguments and returns what it prints (text by default), e.g.
    ``print(kvkit.kvsim("--des-instances", "8"))``. Raises SimError with kvsim's one-line message
    for a bad flag."""
    return _run(["kvsim", *(os.fspath(a) for a in args)])


def _json(sub: List[str], flags: Mapping[str, FlagValue]) -> Any:
    if "format" in flags:
        raise SimError("format: these functions return the JSON report; use kvkit.kvsim() for text")
    return json.loads(_run(["kvsim", *sub, *flags_to_argv(flags), "--format", "json"]))


def simulate(**flags: FlagValue) -> Dict[str, Any]:
    """Simulates a fleet and returns the report of ``kvsim --format json`` as a dict. Every
    ``kvsim`` flag is a keyword with underscores: ``simulate(des_instances=8,
    des_routing="round_robin", des_kv_blocks=20000)``. Raises SimError for a bad flag."""
    return cast(Dict[str, Any], _json([], flags))


def sweep(
    param: Union[str, Sequence[str], Mapping[str, Sequence[Any]]], **flags: FlagValue
) -> List[Dict[str, Any]]:
    """One simulation per value of a run flag (``kvsim sweep``): a list of rows (dicts).
    ``param`` is ``{"des_overlap_weight": [0, 1, 2]}`` (several keys move together),
    ``"des-overlap-weight=0,1,2"``, or a list of such strings."""
    if isinstance(param, Mapping):
        params = [
            f"{k.replace('_', '-')}=" + ",".join(_value(k, x) for x in v) for k, v in param.items()
        ]
    elif isinstance(param, str):
        params = [param]
    else:
        params = list(param)
    sub = ["sweep"]
    for p in params:
        sub += ["--param", p]
    return cast(List[Dict[str, Any]], _json(sub, flags))


def capacity(**flags: FlagValue) -> Dict[str, Any]:
    """The highest arrival rate (or, with ``find="instances"``, the fewest instances) that
    meets the ``slo_*`` targets (``kvsim capacity``), as a dict with the answer and every
    probe."""
    return cast(Dict[str, Any], _json(["capacity"], flags))


def calibrate(**flags: FlagValue) -> Dict[str, Any]:
    """Fits the step-time model (``kvsim calibrate``) to measured steps (``steps="steps.csv"``)
    or request spans (``spans="traces.otel.jsonl"``), as a dict."""
    return cast(Dict[str, Any], _json(["calibrate"], flags))


def trace_stats(
    file: Union[str, "os.PathLike[str]"], trace_block_size: Union[int, None] = None
) -> Dict[str, Any]:
    """A Mooncake trace's statistics (``kvsim trace-stats``), as a dict."""
    sub = ["trace-stats", os.fspath(file)]
    if trace_block_size is not None:
        sub += ["--trace-block-size", str(trace_block_size)]
    return cast(Dict[str, Any], json.loads(_run(["kvsim", *sub, "--format", "json"])))


def to_pandas(result: Any) -> Any:
    """A pandas DataFrame of a result: a sweep's rows, a capacity search's probes, a span
    calibration's phases, or one report (one row, nested fields as ``ttft_ms.p50``). Needs
    pandas (not a dependency of kvkit)."""
    try:
        import pandas as pd  # type: ignore[import-untyped,unused-ignore]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("kvkit.to_pandas needs pandas: pip install pandas") from e
    if isinstance(result, list):
        return pd.DataFrame(result)
    if isinstance(result, dict):
        for key in ("probes", "phases"):
            if isinstance(result.get(key), list):
                return pd.DataFrame(result[key])
        return pd.json_normalize(result)
    raise TypeError(f"to_pandas: expected a kvkit result (dict or list), got {type(result).__name__}")
