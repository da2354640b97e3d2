"""eagledata.tokens.memory: the tokens job's setting for polars' allocator reaches polars, and a user's own
setting is kept. Each case runs in a fresh interpreter (polars reads the variable once, when imported)."""
import os
import subprocess
import sys

import pytest

from eagledata.tokens.memory import AT_ONCE, POLARS_DEFAULT

PROBE = ("import os; from eagledata.tokens.memory import return_freed_pages_at_once as r; set_ = r(); "
         "import polars; print(set_); print(os.environ['_RJEM_MALLOC_CONF'])")


def probe(value):
    env = {k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"}
    if value is not None:
        env["_RJEM_MALLOC_CONF"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    set_, conf = out.splitlines()
    return set_ == "True", conf


def effective(conf, option):
    """What jemalloc takes for ``option``: the last of its settings in ``conf`` (later ones win)."""
    values = [kv.split(":", 1)[1] for kv in conf.split(",") if kv.split(":", 1)[0] == option]
    return values[-1] if values else None


@pytest.mark.parametrize("inherited", [None, "", POLARS_DEFAULT])
def test_unset_or_polars_default_is_replaced_and_wins_after_polars_import(inherited):
    set_, conf = probe(inherited)
    assert set_
    assert effective(conf, "dirty_decay_ms") == "0" and effective(conf, "muzzy_decay_ms") == "0"


def test_polars_default_as_snakemake_passes_it_on():
    """A parent process that imported polars passes polars' default on: the job still gets its setting."""
    parent = subprocess.run([sys.executable, "-c", "import os, polars; print(os.environ['_RJEM_MALLOC_CONF'])"],
                            env={k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert parent == POLARS_DEFAULT  # (else polars changed its default: update POLARS_DEFAULT)
    assert probe(parent)[0]


def test_a_users_setting_is_kept():
    set_, conf = probe("dirty_decay_ms:2000")
    assert not set_
    assert effective(conf, "dirty_decay_ms") == "2000" and effective(conf, "muzzy_decay_ms") == "1000"
    assert AT_ONCE not in conf
