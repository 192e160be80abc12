"""Type stubs of kvkit's compiled module (kvkit._kvkit); the package re-exports these."""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

__version__: str

# One block's extra keys: str, bytes, int, float, bool, None, or tuples (lists) of them.
KeyValue = Union[str, bytes, int, float, bool, None, Tuple[Any, ...], List[Any]]
ExtraKeys = Sequence[Optional[Sequence[KeyValue]]]
# Token ids: ints (a list is fastest among sequences), an array.array("I"), or bytes of
# native-endian 4-byte ids.
TokenIds = Union[Iterable[int], bytes]

class KvkitError(ValueError): ...
class HashError(KvkitError): ...
class RouteError(KvkitError): ...
class EventError(KvkitError): ...
class SnapshotError(KvkitError): ...
class SimError(KvkitError): ...

class BlockHasher:
    """kvblock's block hashing: chained XXH3-64 of every full block."""

    def __init__(self, block_size: int) -> None: ...
    @property
    def block_size(self) -> int: ...
    def hash(
        self,
        tokens: TokenIds,
        salt: Optional[str] = None,
        extra_keys: Optional[ExtraKeys] = None,
        *,
        namespace: Optional[str] = None,
    ) -> List[int]: ...
    def local_hashes(
        self, tokens: TokenIds, salt: Optional[str] = None, *, namespace: Optional[str] = None
    ) -> List[int]: ...

class Candidate:
    """One worker's score for a request."""

    @property
    def worker(self) -> str: ...
    @property
    def cache_hits(self) -> int: ...
    @property
    def active_blocks(self) -> int: ...
    @property
    def pending_prefill_blocks(self) -> int: ...
    @property
    def decode_blocks(self) -> int: ...
    @property
    def busy(self) -> bool: ...
    @property
    def lower_tier_hits(self) -> int: ...
    @property
    def cost(self) -> float: ...

class Decision:
    """Where a request was routed."""

    @property
    def worker(self) -> str: ...
    @property
    def cache_hits(self) -> int: ...
    @property
    def cost(self) -> float: ...
    @property
    def request_blocks(self) -> int: ...
    @property
    def lower_tier_hits(self) -> int: ...
    @property
    def candidates(self) -> Optional[List[Candidate]]: ...

class Router:
    """A KV-cache-aware router; safe to share between threads (the GIL is released while it
    works)."""

    def __init__(
        self,
        block_size: int = 16,
        policy: str = "kv",
        overlap_weight: float = 1.0,
        *,
        prefill_overlap_weight: Optional[float] = None,
        decode_overlap_weight: Optional[float] = None,
        seed: int = 0,
        prefix_blocks: int = 1,
        virtual_nodes: int = 128,
        cost_model: str = "seed",
        temperature: float = 0.0,
        busy_decode_fraction: Optional[float] = None,
        busy_capacity_blocks: Optional[int] = None,
        busy_prefill_tokens: Optional[int] = None,
        predicted_ttl_s: float = 0.0,
        host_hit_credit: Optional[float] = None,
        disk_hit_credit: Optional[float] = None,
        tail_first_evictions: bool = False,
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    def add_worker(self, name: str) -> bool: ...
    def remove_worker(self, name: str) -> bool: ...
    def workers(self) -> List[str]: ...
    def apply_vllm_batch(
        self, worker: str, payload: bytes, seq: Optional[int] = None
    ) -> Dict[str, Any]: ...
    def apply_vllm_message(self, worker: str, frames: Sequence[bytes]) -> Dict[str, Any]: ...
    def apply_event(
        self,
        worker: str,
        event_id: int,
        kind: str,
        blocks: Optional[Sequence[int]] = None,
        parent: Optional[int] = None,
    ) -> Dict[str, Any]: ...
    def route(
        self,
        request_id: int,
        token_ids: TokenIds,
        salt: Optional[str] = None,
        *,
        namespace: Optional[str] = None,
        cache_salt: Optional[str] = None,
        extra_keys: Optional[ExtraKeys] = None,
        role: str = "unified",
        explain: bool = False,
    ) -> Decision: ...
    def explain(
        self,
        token_ids: TokenIds,
        salt: Optional[str] = None,
        *,
        namespace: Optional[str] = None,
        cache_salt: Optional[str] = None,
        extra_keys: Optional[ExtraKeys] = None,
        role: str = "unified",
    ) -> List[Candidate]: ...
    def prefill_done(self, request_id: int) -> None: ...
    def finish(self, request_id: int) -> None: ...
    def cache_view(self, worker: str) -> int: ...
    def active_blocks(self, worker: str) -> int: ...
    def in_flight(self, worker: str) -> int: ...
    def set_clock(self, seconds: float) -> None: ...
    def snapshot(self) -> bytes: ...
    def restore(self, data: bytes) -> None: ...

def _run(argv: List[str]) -> str: ...
def _bench_route(router: Router, prompts: List[List[int]], n: int) -> float: ...
