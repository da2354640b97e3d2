"""Work shared between a job's process and the helper processes it spawns.

A spawned helper costs about a job's start before it does any work (the interpreter, the imports,
the tokenizer). :func:`shared_map` keeps the job's own process working meanwhile: the helpers take
the items from the first on, the job's process from the last back, and they meet where the helpers
have got to. Written here rather than taken from the standard library: ``Executor.map`` leaves the
calling process idle. :func:`spawned_pool` makes the helpers' pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from concurrent.futures import Executor


def spawned_pool(processes: int, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> Executor:
    """A pool of ``processes`` spawned helper processes. Spawned, not forked: forking a process that has
    run polars' threads (polars starts some on import) can deadlock. A spawned helper imports the caller's
    main module again (a Snakemake script guards its body for this). The modules are imported here, when a
    pool is made: a per-shard job never makes one, and importing them cost its start 20 ms."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                               initargs=initargs)


def shared_map(pool: Executor, helper_call: Callable[[Any], Any], local_call: Callable[[Any], Any],
               items: Sequence[Any]) -> list[Any]:
    """``[call(item) for item in items]``: ``helper_call`` in ``pool``'s processes, ``local_call`` (the same
    work) in this one, on each item not begun by a helper when this process comes to it (it is then
    withdrawn from the pool). An item's exception is raised here: one of this process's at once, a
    helper's when the results are gathered (the first in order)."""
    futures = [pool.submit(helper_call, item) for item in items]
    here: dict[int, Any] = {}
    try:
        for i in reversed(range(len(items))):
            if not futures[i].cancel():  # begun (or queued) by a helper: so are the ones before it
                break
            here[i] = local_call(items[i])
        return [here[i] if i in here else futures[i].result() for i in range(len(items))]
    except BaseException:
        for future in futures:  # the helpers begin no other item: the job has failed
            future.cancel()
        raise


__all__ = ["shared_map", "spawned_pool"]
