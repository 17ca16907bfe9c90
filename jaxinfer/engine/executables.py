"""Compiled steps and the count of compilations.

`ExecutableCache`: every compiled step, keyed by what shapes the program and by its devices; a step wanted on
other devices than those it was compiled for is loaded there from the compiled one (parallel/relocate.py).
`CompileCounter`: counts the XLA compilations an engine's own calls make (a stray one after warm-up shows up in
`LLM.stats()`); a user's own JAX code, or a second engine in the process, does not count.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref

import jax

from jaxinfer.parallel.relocate import relocate


class ExecutableCache:
    """Compiled steps keyed by everything that shapes the program, and by the devices they run on. Params are
    arguments, so an executable serves any weights of the same shapes: every LLM in a process shares
    `SHARED_EXECUTABLES` by default, and a second LLM of the same size starts at once. A step wanted on other
    devices than those it was compiled for (a data-parallel replica) is loaded there from the compiled one
    (parallel/relocate.py: milliseconds instead of a compile).
    What it keeps: every executable a live engine holds (weakly: the engines hold them), and the `keep` most
    recently used besides, so that LLMs made and dropped one after another (a notebook, a sweep of options) do not
    pile up compiled code until the process runs out of memory mappings (~1,300 more for each tiny CPU engine of
    new shapes, measured; Linux allows 65,530)."""

    def __init__(self, keep: int = 64):
        self._compiled = weakref.WeakValueDictionary()   # (key, device ids) -> executable, while anyone holds it
        self._recent: collections.OrderedDict = collections.OrderedDict()   # the `keep` last used, held
        self._any_devices: dict[tuple, tuple] = {}       # program key -> (devices, (key, ids)): one to relocate
        self._keep = keep
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}    # program key -> held while one thread builds it

    def get(self, key: tuple, devices: list, build):
        """The executable of program `key` on `devices` (a mesh's devices, in order): cached, relocated from
        another set of devices, or `build()`."""
        full = (key, tuple(d.id for d in devices))
        exe = self._compiled.get(full)
        if exe is None:
            with self._lock:
                gate = self._building.setdefault(key, threading.Lock())
            with gate:   # one build of a program at a time: replicas wanting it at once (threads) relocate it after
                exe = self._compiled.get(full)
                if exe is None:
                    exe = self._build_or_relocate(key, full, devices, build)
        with self._lock:
            self._recent[full] = exe
            self._recent.move_to_end(full)
            while len(self._recent) > self._keep:
                self._recent.popitem(last=False)
        return exe

    def _build_or_relocate(self, key: tuple, full: tuple, devices: list, build):
        other_devices, other_full = self._any_devices.get(key, ((), None))
        other = self._compiled.get(other_full) if other_full is not None else None
        exe = relocate(other, list(other_devices), list(devices)) if other is not None else None
        if exe is None:
            with engine_numerics():
                exe = build()
        with self._lock:
            exe = self._compiled.setdefault(full, exe)
            if other is None:
                self._any_devices[key] = (tuple(devices), full)
        return exe

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()
            self._recent.clear()
            self._any_devices.clear()
            self._building.clear()


SHARED_EXECUTABLES = ExecutableCache()


@contextlib.contextmanager
def engine_numerics():
    """The JAX settings the engine's arrays and programs are made and run under, whatever the user set for their
    own code (these are thread-local): the steps broadcast (a user's rank promotion "raise"), mix bool and float (a
    "strict" dtype promotion), index in int32 (a user's x64 made the kernels' block tables int64), use XLA's own
    matmul precision (a user's "highest" would reach every LLM through the shared executables), are compiled (a
    user's disable_jit), move their own batches (a user's transfer guard), place their arrays on their own
    devices (a user's `jax.set_mesh`) and draw a preset's random weights as JAX's defaults do (a user's
    jax_threefry_partitionable; the PRNG itself is named where the keys are made)."""
    with (jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"), jax.enable_x64(False),
          jax.default_matmul_precision(None), jax.disable_jit(False), jax.transfer_guard("allow"), jax.set_mesh(None),
          jax.threefry_partitionable(True)):
        yield


_SETTINGS = ("jax_numpy_rank_promotion", "jax_numpy_dtype_promotion", "jax_enable_x64", "jax_default_matmul_precision",
             "jax_disable_jit", "jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host",
             "jax_transfer_guard_device_to_device")
_ENGINES = ("allow", "standard", False, None, False, "allow", "allow", "allow")


def users_settings_differ() -> bool:
    """Whether engine_numerics would change anything here (~2 us: a step's calls skip the context when not)."""
    for name, want in zip(_SETTINGS, _ENGINES):
        v = getattr(jax.config, name)
        if v != want and (v is not None or want != "allow") and getattr(v, "value", v) != want:
            return True
    return not jax.sharding.get_abstract_mesh().empty


_owner = threading.local()      # .counter: the CompileCounter whose engine code this thread is running


class CompileCounter:
    """Counts the XLA compilations made while this thread runs a method of the counter's engine decorated with
    `counts_compiles`: JAX reports every compilation in the process to a monitoring listener, and
    only those made inside the engine's own calls are its own. The listener is removed by `close()` or when the
    counter is collected (it holds only a weak reference to it)."""
    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()
        me = weakref.ref(self)

        def listener(event: str, *args, **kwargs) -> None:
            counter = me()
            if counter is not None and event == CompileCounter._EVENT and getattr(_owner, "counter", None) is counter:
                with counter._lock:
                    counter.count += 1
        self._listener = listener
        jax.monitoring.register_event_duration_secs_listener(listener)

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                jax.monitoring.unregister_event_duration_listener(listener)
            except (AssertionError, ValueError):    # already gone (e.g. clear_event_listeners)
                pass

    def __del__(self):
        try:
            self.close()
        except Exception:       # at interpreter exit jax.monitoring may already be torn down
            pass


def counts_compiles(method):
    """Decorator for an engine method (the engine has `compile_counter`): what it compiles is the engine's."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):         # (a few times every step: no context-manager object)
        prev = getattr(_owner, "counter", None)
        _owner.counter = self.compile_counter
        try:
            if users_settings_differ():
                with engine_numerics():
                    return method(self, *args, **kwargs)
            return method(self, *args, **kwargs)
        finally:
            _owner.counter = prev
    return wrapped
