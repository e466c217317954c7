"""Several models behind one server: the registry of the models it serves, each loaded on demand
into an engine of its own, unloaded when idle past `--model-ttl` or to make room under
`--models-max` or under `--models-memory` (the least recently used idle ones), as llama-server's
router mode and Ollama's keep_alive do. A model's memory is estimated as its weights file plus its
KV pool (sized as the engine will size it, from the model's geometry; measured once it is loaded).

A model's state: unloaded -> loading -> loaded, or failed (the load's error kept until a later
request retries it). Concurrent first requests share one load (a task per model every caller
awaits); the load runs in a thread (it takes seconds). A model is idle when no route holds it
(`acquire` .. `release`: from the body's check to admission) and its engine has no request left;
an idle model is the only kind unloaded, so no running stream is ever cut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.host import return_freed_memory
from frontend.errors import ApiError
from frontend.request import RequestDefaults
from frontend.sampling_defaults import model_sampling_defaults

log = logging.getLogger("rill.models")

STATES = ("unloaded", "loading", "loaded", "failed")
ROOM_WAIT_S = 120.0  # how long a request waits for a busy model to become idle before its 503
ROOM_POLL_S = 0.05  # how often a request waiting for room looks again (engines go idle on their own thread)
RETRY_AFTER_S = 5  # what the 503 of a request that found no room suggests


@dataclass(slots=True, eq=False)
class ModelEntry:
    """One model the server serves, loaded or not."""

    name: str  # what a client puts in `model`: a folder's or file's name, a Hub id
    source: str | None  # what is loaded: folder, .gguf file or Hub id; None = the embedded default
    aliases: tuple[str, ...] = ()  # other names a request may use (the --model value as given, the file name)
    pinned: bool = False  # --pin: never unloaded by the TTL or to make room
    state: str = "unloaded"  # one of STATES
    engine: object | None = None  # the EngineClient while loaded
    defaults: RequestDefaults | None = None  # what unset fields take, from the loaded model's config
    error: str | None = None  # why the last load failed (state "failed")
    loading: asyncio.Future | None = None  # the load in flight; every caller waits for this one
    has_room: bool = False  # loading, and counted against --models-max already
    leases: int = 0  # routes holding it now (between the body's check and admission)
    last_used: float = 0.0  # time.monotonic() of its last request or its last busy sweep
    loads: int = 0  # loads started, failed ones included
    max_model_len: int | None = None  # known once loaded (kept after an unload, for /v1/models)
    footprint: "Footprint | None" = None  # its memory estimate: computed when first needed, measured once loaded
    line: list = field(default_factory=list)  # the requests waiting for it to load, first come first
    waits_for: str | None = None  # while its load waits for room: what it waits for ("`a` to finish 2 requests")
    overrides: tuple[tuple[str, object], ...] = ()  # its own settings (--models-preset): Settings field -> value
    shown: tuple[tuple[str, object], ...] = ()  # those settings as the preset file wrote them (/v1/models)

    def names(self) -> set[str]:
        names = {self.name, *self.aliases}
        if self.engine is not None:
            names.add(self.engine.model_name)
        return names


def disk_size(source: str | None) -> int | None:
    """Bytes the model takes on disk (a file, or a folder's files); None for a Hub id."""
    if source is None:
        from engine.model.loading import embedded_gguf_path

        path = embedded_gguf_path()
    else:
        path = Path(source).expanduser()
    if path is None or not path.exists():
        return None
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one loaded model takes, as --models-memory counts it."""

    weights_bytes: int | None  # its file or folder on disk; None for a Hub id
    kv_cache_bytes: int | None  # its KV pool; None when its geometry cannot be read (a bad file)

    @property
    def total(self) -> int:
        return (self.weights_bytes or 0) + (self.kv_cache_bytes or 0)


def _geometry(source: str | None) -> tuple[int, int, int, int | None] | None:
    """(layers, KV heads, head size, context) read from a GGUF header or a folder's config.json
    (milliseconds: no weights, no tokenizer); None when neither says (a Hub id, a bad file)."""
    if source is None:
        from engine.model.loading import embedded_gguf_path

        path = embedded_gguf_path()
    else:
        path = Path(source).expanduser()
    try:
        if path is not None and path.is_file():
            from transformers.integrations.gguf import reader

            meta = reader.read_gguf_metadata(str(path))[0]
            arch = meta["general.architecture"]
            heads = meta[f"{arch}.attention.head_count"]
            head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // heads
            return (meta[f"{arch}.block_count"], meta.get(f"{arch}.attention.head_count_kv") or heads, head_dim,
                    meta.get(f"{arch}.context_length"))
        if path is not None and (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
            config = config.get("text_config") or config  # a vision-language model's language half
            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            context = next((config[k] for k in ("max_position_embeddings", "n_positions", "seq_length")
                            if isinstance(config.get(k), int)), None)
            return config["num_hidden_layers"], config.get("num_key_value_heads") or heads, head_dim, context
    except Exception:  # noqa: BLE001 - unreadable: its load will say why
        log.debug("no geometry for %s", source, exc_info=True)
    return None


def measure_footprint(source: str | None, settings, engine=None) -> Footprint:
    """The model's weights on disk plus its KV pool: the loaded `engine`'s pool, else the one the engine
    will allocate under these settings (engine/model/memory.py's rule, from the model's geometry)."""
    import torch

    from engine.attention import kv_cache_dtype
    from engine.model.loading import resolve_device, resolve_dtype
    from engine.model.memory import num_kv_blocks
    from frontend.backends import iter_engine_fields
    from frontend.backends.local import engine_config

    weights, geometry = disk_size(source), _geometry(source)
    if geometry is None:
        return Footprint(weights, None)
    layers, kv_heads, head_dim, context = geometry
    device = resolve_device(getattr(settings, "device", "auto"))
    if engine is not None:
        dtype = getattr(torch, engine.health_info().get("kv_cache_dtype", "float32"))
    else:
        dtype = kv_cache_dtype(settings.kv_cache_dtype, resolve_dtype(settings.dtype, device))
    per_token = 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    if engine is not None:
        return Footprint(weights, engine.kv_cache_tokens * per_token)
    config = engine_config(dict(iter_engine_fields(settings)))
    max_len = settings.max_model_len or context or 2048
    blocks = num_kv_blocks(config, max_len, per_token * config.block_size, device)
    return Footprint(weights, blocks * config.block_size * per_token)


def settings_of(settings, entry: ModelEntry):
    """The settings `entry`'s engine is built with: the server's, its source, its preset's own."""
    if not hasattr(settings, "model_id"):  # a registry around one running engine (`single`): nothing to build
        return settings
    return dataclasses.replace(settings, model_id=entry.source, **dict(entry.overrides))


def _ordinal(n: int) -> str:
    """1 -> "1st", 2 -> "2nd", 11 -> "11th", 23 -> "23rd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


def _bytes(n: int) -> str:
    """1234567 -> "1,234,567 bytes (1.2 MiB)": exact, and readable."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n:,} bytes ({n / size:.1f} {unit})"
    return f"{n:,} bytes"


def discover(settings) -> list[ModelEntry]:
    """The models the settings name, in order: each --model, then each table of --models-preset (with
    its own settings), then each .gguf file and model folder (with a config.json) of --models-dir by
    name; the embedded model when none is named."""
    entries: list[ModelEntry] = []
    for source in settings.models or ((settings.model_id,) if settings.model_id else ()):
        path = Path(source).expanduser()
        if path.exists():
            name = path.name.removesuffix(".gguf") if path.is_file() else path.resolve().name
            entries.append(ModelEntry(name, source, aliases=tuple({source, path.name} - {name})))
        else:  # a Hub id is its own name
            entries.append(ModelEntry(source, source))
    if settings.models_preset:
        from frontend.options import engine_config
        from frontend.presets import read_presets

        for preset in read_presets(settings.models_preset):
            entry = ModelEntry(preset.name, preset.source, pinned=preset.pinned, overrides=preset.settings,
                               shown=preset.shown, max_model_len=dict(preset.settings).get("max_model_len"))
            try:  # its engine's settings together (a draft model without speculative = "draft", ...)
                engine_config(settings_of(settings, entry))
            except ValueError as exc:
                raise ValueError(f"--models-preset {settings.models_preset}: [{preset.name}] {exc}") from None
            entries.append(entry)
    if settings.models_dir:
        folder = Path(settings.models_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--models-dir must be an existing folder of .gguf files and model folders. "
                             f"Given: {settings.models_dir!r}")
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix == ".gguf":
                entries.append(ModelEntry(path.stem, str(path), aliases=(path.name,)))
            elif path.is_dir() and (path / "config.json").exists():
                entries.append(ModelEntry(path.name, str(path)))
        if not entries:
            raise ValueError(f"--models-dir {settings.models_dir!r} holds no .gguf file and no model folder "
                             "(a folder with config.json)")
    if not entries:
        entries.append(ModelEntry("embedded", None))  # renamed to the model's own name once loaded
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.name in seen:
            raise ValueError(f"two models are named {entry.name!r} ({seen[entry.name]!r} and {entry.source!r}); "
                             "give each model a distinct file or folder name")
        seen[entry.name] = entry.source
    return entries


class ModelRegistry:
    """The models of one server process and their engines (see the module docstring).

    `acquire(name)` -> the loaded entry (loading it first), held until `release(entry)`; `load`,
    `unload` and `snapshot` for the API; `abort` reaches the engine that runs a request id."""

    def __init__(self, entries: list[ModelEntry], settings, build: Callable[[object], object] | None = None,
                 default: str | None = None, measure: Callable[..., Footprint] | None = None):
        if not entries:
            raise ValueError("a registry needs at least one model")
        self.entries = entries
        self.settings = settings
        self._build = build or _build_engine  # settings -> a started EngineClient (blocking)
        self.autoload = settings.models_autoload
        self.max_loaded = settings.models_max
        self.memory = settings.models_memory  # bytes; None = no bound
        self._measure = measure or measure_footprint  # (source, settings, engine | None) -> Footprint
        self.ttl = settings.model_ttl
        self.default = self._find(default) if default else entries[0]
        if default and self.default is None:
            raise ValueError(f"--default-model must name one of the models served ({self._served()}). "
                             f"Given: {default!r}")
        for name in settings.pin:
            entry = self._find(name)
            if entry is None:
                raise ValueError(f"--pin must name one of the models served ({self._served()}). Given: {name!r}")
            entry.pinned = True
        pinned = sum(e.pinned for e in entries)
        if pinned > self.max_loaded:
            raise ValueError(f"--pin keeps {pinned} models loaded but --models-max allows {self.max_loaded}; "
                             "raise --models-max or pin fewer")
        self._room = asyncio.Lock()  # one load at a time decides what to unload for its room
        self._sweeper: asyncio.Task | None = None
        self.on_fatal = None  # app.py's: given to every engine built

    @classmethod
    def from_settings(cls, settings) -> "ModelRegistry":
        return cls(discover(settings), settings, default=settings.default_model)

    @classmethod
    def single(cls, engine, settings, defaults: RequestDefaults | None = None) -> "ModelRegistry":
        """The registry of a server built around one engine already running (tests, create_app alone)."""
        source = getattr(settings, "model_id", None)
        entry = ModelEntry(engine.model_name, source, aliases=(source,) if source else (), pinned=True)
        registry = cls([entry], _single_settings(settings))
        registry._loaded(entry, engine, defaults)
        return registry

    def start(self):
        """Load the default model and the pinned ones now, in this thread (start-up: a bad file stops the
        server here). Returns the engine the server holds for good: the default's own when it is the only
        model and never unloaded, else a `ModelView` of it. Raises ModelLoadError or ValueError."""
        first = [e for e in self.entries if e is self.default or e.pinned]
        if self.memory is not None and sum(self.footprint(e).total for e in first) > self.memory:
            needs = ", ".join(f"`{e.name}` {_bytes(self.footprint(e).total)}" for e in first)
            raise ValueError(f"--models-memory {_bytes(self.memory)} cannot hold the models loaded at start (the "
                             f"default and --pin: {needs}); raise it, pin fewer or lower their KV cache "
                             "(--num-kv-blocks, --kv-cache-memory, --max-model-len)")
        for entry in self.entries:
            if entry is self.default or entry.pinned:
                entry.loads += 1
                self._loaded(entry, self._build(settings_of(self.settings, entry)))
        if not self.several and not self.ttl:
            self.default.pinned = True  # nothing else could take its place
            return self.default.engine
        return ModelView(self, self.default)

    def shutdown(self) -> None:
        for engine in self.engines():
            engine.shutdown()

    # ---- what a request names -------------------------------------------------------------

    @property
    def several(self) -> bool:
        return len(self.entries) > 1

    def _find(self, name: str) -> ModelEntry | None:
        for entry in self.entries:
            if name in entry.names():
                return entry
        return None

    def _served(self) -> str:
        return ", ".join(f"`{e.name}`" for e in self.entries)

    def resolve(self, name: str | None) -> ModelEntry:
        """The entry `name` names (the default for None or ""); a 404 naming the models served."""
        if name in (None, ""):
            return self.default
        entry = self._find(name)
        if entry is None:
            raise ApiError(404, f"The model `{name}` does not exist on this server. It serves {self._served()} "
                                "(see GET /v1/models).", param="model", code="model_not_found")
        return entry

    async def acquire(self, name: str | None, *, load: bool | None = None, ticket: object = None) -> ModelEntry:
        """The loaded entry of `name`, held (never unloaded) until `release`. Loads it first (`load`, by
        default --models-autoload), making room under --models-max; the load's failure as an ApiError.
        While it waits for the load it holds a place in the model's line (`ticket`: see `place`)."""
        entry = self.resolve(name)
        self._start_sweeper()
        entry.leases += 1
        ticket = object() if ticket is None else ticket
        try:
            while entry.state != "loaded":
                if ticket not in entry.line:
                    entry.line.append(ticket)
                if entry.loading is None:
                    if not (self.autoload if load is None else load):
                        raise ApiError(400, f"The model `{entry.name}` is not loaded and this server loads models "
                                            f"only when asked (--no-models-autoload): POST /models/load "
                                            f'{{"model": "{entry.name}"}} first.', param="model",
                                       code="model_not_loaded")
                    entry.loading = asyncio.ensure_future(self._load(entry))
                await asyncio.shield(entry.loading)
        except BaseException:
            entry.leases -= 1
            raise
        finally:
            if ticket in entry.line:
                entry.line.remove(ticket)
        entry.last_used = time.monotonic()
        return entry

    def place(self, name: str | None, ticket: object) -> str | None:
        """Where the request holding `ticket` waits for `name`'s load, as the page shows it ("Loading model
        `a` · 2nd in line · waiting for `b` to finish 1 request"); None once it no longer waits."""
        entry = self.resolve(name)
        if entry.state == "loaded" and ticket not in entry.line:
            return None
        text = f"Loading model `{entry.name}`"
        if ticket in entry.line:
            text += f" · {_ordinal(entry.line.index(ticket) + 1)} in line"
        if entry.waits_for:
            text += f" · waiting for {entry.waits_for}"
        return text

    def release(self, entry: ModelEntry) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()

    def abort(self, request_id: str) -> bool:
        """Abort a request in whichever loaded engine runs it (request ids are unique per server)."""
        return any(e.engine.abort(request_id) for e in self.entries if e.engine is not None)

    def engines(self) -> list:
        return [e.engine for e in self.entries if e.engine is not None]

    # ---- loading and unloading ------------------------------------------------------------

    def busy(self, entry: ModelEntry) -> int:
        """Requests holding or running on the model (0: idle, it may be unloaded)."""
        if entry.leases or entry.engine is None:
            return entry.leases
        try:
            stats = entry.engine.stats()
        except Exception:  # a dead engine runs nothing
            return 0
        return stats.num_running + stats.num_waiting

    async def _load(self, entry: ModelEntry) -> None:
        """The one load of `entry` every caller awaits: room made, the engine built in a thread."""
        entry.state, entry.error, entry.has_room = "loading", None, False
        entry.loads += 1
        try:
            try:
                await self._make_room(entry)
            finally:
                entry.waits_for = None
            started = time.monotonic()
            engine = await asyncio.to_thread(self._build, settings_of(self.settings, entry))
            log.info("model %s loaded in %.1f s", entry.name, time.monotonic() - started)
            self._loaded(entry, engine)
        except BaseException as exc:
            entry.state, entry.has_room = "failed", False
            if isinstance(exc, ApiError):  # no room: the model was never tried, it stays unloaded
                entry.state = "unloaded"
                raise
            from engine.model.errors import ModelLoadError

            log.error("model %s failed to load", entry.name, exc_info=exc)
            # a ModelLoadError's line is written for the user; any other failure's text may name internals
            entry.error = (str(exc) if isinstance(exc, (ModelLoadError, ValueError)) else
                           f"{type(exc).__name__} while loading; the server log has the details")
            raise ApiError(500, f"The model `{entry.name}` failed to load: {entry.error}. Other models still "
                                "serve; a later request naming it tries again.", param="model",
                           code="model_load_failed") from None
        finally:
            entry.loading = None

    def _loaded(self, entry: ModelEntry, engine, defaults: RequestDefaults | None = None) -> None:
        if self.on_fatal is not None:
            engine.on_fatal = self.on_fatal
        entry.engine, entry.state, entry.has_room, entry.error = engine, "loaded", False, None
        entry.defaults = defaults or RequestDefaults(model_sampling_defaults(engine),
                                                     self.settings.default_max_new_tokens)
        entry.max_model_len = engine.max_model_len
        entry.last_used = time.monotonic()
        if self.memory is not None or entry.footprint is not None:  # the pool it really has (where it can say)
            entry.footprint = None
            self.footprint(entry)
        if not self.several and entry.name != engine.model_name:  # one model goes by its own name, as before
            entry.aliases, entry.name = (*entry.aliases, *(() if entry.source is None else (entry.name,))), \
                engine.model_name

    def footprint(self, entry: ModelEntry) -> Footprint:
        """The model's memory estimate (computed once; measured again when it loads)."""
        if entry.footprint is None:
            try:
                entry.footprint = self._measure(entry.source, settings_of(self.settings, entry), entry.engine)
            except Exception:  # noqa: BLE001 - an engine that cannot say (a remote one): its size on disk alone
                log.debug("no KV estimate for %s", entry.name, exc_info=True)
                entry.footprint = Footprint(disk_size(entry.source), None)
        return entry.footprint

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload the least recently used idle models until `entry` fits under --models-max and
        --models-memory; wait for a busy one to finish (ROOM_WAIT_S at most, then a 503 with
        Retry-After). A model that cannot fit even beside the pinned ones alone: a 503 at once."""
        if self.memory is not None and entry.footprint is None:
            entry.footprint = await asyncio.to_thread(self._measure, entry.source, settings_of(self.settings, entry),
                                                      None)
        need = self.footprint(entry).total if self.memory is not None else 0
        if self.memory is not None and need > self.memory:
            raise ApiError(503, f"The model `{entry.name}` cannot be loaded: it needs about {_bytes(need)} (its "
                                f"weights and KV cache) and --models-memory is {_bytes(self.memory)}, so it does "
                                "not fit even alone. Raise --models-memory or lower its KV cache (--num-kv-blocks, "
                                "--kv-cache-memory, --max-model-len).", param="model", code="model_too_large")
        deadline = time.monotonic() + ROOM_WAIT_S
        async with self._room:
            while True:
                others = [e for e in self.entries if e is not entry and (e.state == "loaded" or e.has_room)]
                used = sum(self.footprint(e).total for e in others) if self.memory is not None else 0
                count_ok = len(others) < self.max_loaded
                memory_ok = self.memory is None or used + need <= self.memory
                if count_ok and memory_ok:
                    entry.has_room = True
                    return
                if not count_ok and all(e.pinned for e in others):
                    raise ApiError(503, f"The model `{entry.name}` cannot be loaded: --models-max "
                                        f"{self.max_loaded} models are loaded and every one is pinned (--pin "
                                        f"{', '.join(e.name for e in others)}).", code="model_no_room")
                pinned = sum(self.footprint(e).total for e in others if e.pinned) if self.memory is not None else 0
                if not memory_ok and pinned + need > self.memory:
                    raise ApiError(503, f"The model `{entry.name}` cannot be loaded: it needs about {_bytes(need)} "
                                        f"and the pinned models (--pin) keep {_bytes(pinned)} of --models-memory "
                                        f"{_bytes(self.memory)}.", code="model_no_room")
                idle = [e for e in others if e.state == "loaded" and not e.pinned and not self.busy(e)]
                if idle:
                    await self._unload(min(idle, key=lambda e: e.last_used))
                    continue
                entry.waits_for = " and ".join(f"`{e.name}` to finish {_requests(self.busy(e))}"
                                               for e in others if not e.pinned and self.busy(e)) or None
                if time.monotonic() > deadline:
                    busy = ", ".join(f"`{e.name}` ({self.busy(e)} requests)" for e in others)
                    bound = (f"--models-max {self.max_loaded} models are loaded" if not count_ok else
                             f"it needs about {_bytes(need)} and the loaded models take {_bytes(used)} of "
                             f"--models-memory {_bytes(self.memory)}")
                    raise ApiError(503, f"The model `{entry.name}` cannot be loaded now: {bound} and each is busy "
                                        f"({busy}); it waited {ROOM_WAIT_S:g} s for one to finish. Retry later.",
                                   code="model_no_room", headers={"Retry-After": str(RETRY_AFTER_S)})
                await asyncio.sleep(ROOM_POLL_S)

    async def _unload(self, entry: ModelEntry) -> None:
        """Shut the engine down and drop it; its memory goes back to the system."""
        engine, entry.engine, entry.defaults, entry.state = entry.engine, None, None, "unloaded"
        if engine is None:
            return
        log.info("model %s unloaded (%s)", entry.name, "idle" if not self.busy(entry) else "asked")
        await asyncio.to_thread(engine.shutdown)
        del engine
        await asyncio.to_thread(_collect)

    async def load(self, name: str) -> ModelEntry:
        """POST /models/load: the model loaded (already, or now)."""
        entry = await self.acquire(name, load=True)
        self.release(entry)
        return entry

    async def unload(self, name: str) -> ModelEntry:
        """POST /models/unload: a 409 while it runs requests or is pinned (nothing is cut)."""
        entry = self.resolve(name)
        if entry.pinned:
            why = "pinned (--pin)" if self.several else "the only model this server serves"
            raise ApiError(409, f"The model `{entry.name}` is {why}: it stays loaded.", param="model",
                           code="model_pinned")
        if entry.state == "loading":
            raise ApiError(409, f"The model `{entry.name}` is loading; unload it once it is loaded.", param="model",
                           code="model_busy")
        busy = self.busy(entry)
        if busy:
            raise ApiError(409, f"The model `{entry.name}` is running {busy} requests; it is unloaded only when "
                                "idle (nothing is cut). Retry once they finish.", param="model", code="model_busy")
        await self._unload(entry)
        return entry

    # ---- the idle timer -------------------------------------------------------------------

    def _start_sweeper(self) -> None:
        """On the server's event loop (the first request or /health starts it; never at build time)."""
        if self.ttl <= 0 or self._sweeper is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs (the page being built): the next call starts it
            return
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Every loaded, unpinned model idle for --model-ttl seconds is unloaded."""
        period = min(1.0, self.ttl / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for entry in self.entries:
                if entry.state != "loaded" or entry.pinned:
                    continue
                if self.busy(entry):
                    entry.last_used = now  # idle time counts from the end of its last request
                elif now - entry.last_used >= self.ttl:
                    try:
                        await self._unload(entry)
                    except Exception:  # the sweeper goes on; the log says why
                        log.exception("unloading the idle model %s failed", entry.name)

    # ---- what the API shows ---------------------------------------------------------------

    def snapshot(self) -> list[dict]:
        """Each model as /v1/models and /health show it."""
        self._start_sweeper()
        out = []
        for entry in self.entries:
            status = {"value": entry.state}
            if entry.state == "failed":
                status["error"] = entry.error
            elif entry.state == "loading":  # the requests waiting for this load (the first one included)
                status["waiting"] = entry.leases
            footprint = self.footprint(entry)
            out.append({"id": entry.name, "status": status, "size_bytes": disk_size(entry.source),
                        "estimated_memory_bytes": footprint.total, "kv_cache_bytes": footprint.kv_cache_bytes,
                        "max_model_len": entry.max_model_len, "loads": entry.loads, "pinned": entry.pinned,
                        "default": entry is self.default, **({"settings": dict(entry.shown)} if entry.shown else {})})
        return out


def _collect() -> None:
    """A full collection (the engine's cycles; app.py froze what start-up built), then malloc_trim."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    else:
        gc.collect()
    return_freed_memory()


def _build_engine(settings):
    from frontend.backends import create_engine

    return create_engine(settings)


@dataclass(frozen=True, slots=True)
class _SingleSettings:
    """The registry settings of a server around one engine: nothing to load, nothing to unload."""

    default_max_new_tokens: int = 512
    models_autoload: bool = True
    models_max: int = 1
    models_memory: int | None = None
    model_ttl: float = 0.0
    pin: tuple[str, ...] = field(default=())


def _single_settings(settings) -> _SingleSettings:
    return _SingleSettings(default_max_new_tokens=getattr(settings, "default_max_new_tokens", 512))


class ModelView:
    """An EngineClient that is the registry's current engine of one model: what the parts of the server
    that hold one engine for good (metrics, the page's header, the test hooks) hold instead, so that
    unloading the model frees it. Its name and context stay known while it is unloaded."""

    def __init__(self, registry: ModelRegistry, entry: ModelEntry):
        self._registry, self._entry = registry, entry

    @property
    def model_name(self) -> str:
        return self._entry.name

    @property
    def max_model_len(self) -> int | None:
        return self._entry.max_model_len

    @property
    def alive(self) -> bool:  # an unloaded model can serve: a request loads it
        engine = self._entry.engine
        return True if engine is None else engine.alive

    def stats(self):
        """The engine's; an unloaded model runs nothing (its KV cache is gone with it)."""
        if self._entry.engine is None:
            from engine.core import EngineStats

            return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)
        return self._entry.engine.stats()

    def health_info(self) -> dict:
        engine = self._entry.engine
        return {"backend": self.backend, "loaded": False} if engine is None else engine.health_info()

    @property
    def backend(self) -> str:  # local or ray (frontend/options.py refuses several models on openai)
        return getattr(self._registry.settings, "backend", "local")

    def replica_stats(self) -> list[dict]:  # --backend ray: the replicas of this model's own replica set
        engine = self._entry.engine
        return [] if engine is None else engine.replica_stats()

    def _engine(self):
        engine = self._entry.engine
        if engine is None:
            raise RuntimeError(f"The model `{self._entry.name}` is not loaded; a request naming it loads it.")
        return engine

    # the rest of EngineClient, each member the current engine's (tests/test_engine_client.py holds it to that)
    tokenizer = property(lambda self: self._engine().tokenizer)
    continuable = property(lambda self: self._engine().continuable)
    attention_path = property(lambda self: self._engine().attention_path)
    think_tags = property(lambda self: self._engine().think_tags)
    grammars = property(lambda self: self._engine().grammars)
    generation_config = property(lambda self: self._engine().generation_config)
    kv_cache_tokens = property(lambda self: self._engine().kv_cache_tokens)

    @property
    def vision(self):  # what /health shows of an unloaded model too: None until it is loaded
        engine = self._entry.engine
        return None if engine is None else engine.vision

    @property
    def on_fatal(self):
        return self._registry.on_fatal

    @on_fatal.setter
    def on_fatal(self, value) -> None:  # every engine the registry builds gets it
        self._registry.on_fatal = value
        for engine in self._registry.engines():
            engine.on_fatal = value

    def unavailable_reason(self) -> str:
        return self._engine().unavailable_reason()

    def encode(self, text: str) -> list[int]:
        return self._engine().encode(text)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
        return self._engine().encode_chat(messages, add_generation_prompt, tools, **template_kwargs)

    def check_prompt(self, prompt_token_ids: list[int], params) -> None:
        self._engine().check_prompt(prompt_token_ids, params)

    def compile_constraint(self, params) -> None:
        self._engine().compile_constraint(params)

    def add_request(self, prompt_token_ids: list[int], params, request_id: str | None = None,
                    prior_output_ids: list[int] = (), session: str | None = None, client: str | None = None,
                    images=None):
        extra = {} if images is None else {"images": images}  # a text engine's add_request takes none
        return self._engine().add_request(prompt_token_ids, params, request_id, prior_output_ids, session, client,
                                          **extra)

    async def wait_admitted(self, stream, timeout: float | None = None) -> None:
        await self._engine().wait_admitted(stream, timeout)

    def abort(self, request_id: str) -> bool:
        return self._engine().abort(request_id)

    def inject_fault(self, request_id: str) -> bool:
        return self._engine().inject_fault(request_id)

    def shutdown(self, timeout: float | None = 5.0) -> None:
        engine = self._entry.engine
        if engine is not None:
            engine.shutdown(timeout)
