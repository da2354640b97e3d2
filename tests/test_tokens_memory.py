"""eagledata.tokens.memory: the tokens job's setting for polars' allocator reaches polars, and a user's own
setting is kept. Each case runs in a fresh interpreter (polars reads the variable once, when imported)."""
import os
import subprocess
import sys

import pytest

from eagledata.tokens.memory import AT_ONCE, POLARS_DEFAULT, POLARS_THP

PROBE = ("import os, sys; from eagledata.tokens.memory import return_freed_pages_at_once as r; "
         "assert 'polars' not in sys.modules; set_ = r(); "
         "import polars; print(set_); print(os.environ.get('_RJEM_MALLOC_CONF', ''))")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("_RJEM_MALLOC_CONF", "POLARS_THP")}
    return {**env, **extra}


def probe(value, **extra):
    env = clean_env(**extra) if value is None else clean_env(_RJEM_MALLOC_CONF=value, **extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    set_, conf = out.splitlines()
    return set_ == "True", conf


def effective(conf, option):
    """What jemalloc takes for ``option``: the last of its settings in ``conf`` (later ones win)."""
    values = [kv.split(":", 1)[1] for kv in conf.split(",") if kv.split(":", 1)[0] == option]
    return values[-1] if values else None


@pytest.mark.parametrize("inherited", [None, "", POLARS_DEFAULT, POLARS_DEFAULT + POLARS_THP])
def test_unset_or_polars_default_is_replaced_and_wins_after_polars_import(inherited):
    set_, conf = probe(inherited)
    assert set_
    assert effective(conf, "dirty_decay_ms") == "0" and effective(conf, "muzzy_decay_ms") == "0"


def test_polars_default_as_snakemake_passes_it_on():
    """A parent process that imported polars passes polars' default on (with its huge-page options where
    POLARS_THP=1): the job still gets its setting."""
    for extra in ({}, {"POLARS_THP": "1"}):
        parent = subprocess.run([sys.executable, "-c", "import os, polars; print(os.environ.get('_RJEM_MALLOC_CONF', ''))"],
                                env=clean_env(**extra), capture_output=True, text=True, check=True).stdout.strip()
        if not parent:
            pytest.skip("this polars leaves _RJEM_MALLOC_CONF alone (older releases did)")
        assert parent == POLARS_DEFAULT + (POLARS_THP if extra else "")  # (else polars changed its default)
        set_, conf = probe(parent, **extra)
        assert set_ and effective(conf, "dirty_decay_ms") == "0" and effective(conf, "muzzy_decay_ms") == "0"


@pytest.mark.parametrize("users", ["dirty_decay_ms:2000", POLARS_DEFAULT + ",narenas:2"])
def test_a_users_setting_is_kept(users):
    set_, conf = probe(users)
    assert not set_
    assert conf.endswith(users) and AT_ONCE not in conf
